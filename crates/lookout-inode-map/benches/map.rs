//! Criterion benchmarks of the map: a hit per mode at 1M entries, an
//! insert, and a snapshot round trip. `cargo bench -p lookout-inode-map`.
//! (`cargo xtask bench --only inode-map` measures the same in one pass and
//! adds the FUSE listing.)

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use lookout_inode_map::{
    DeviceIdentity, FileKey, InodeMap, Limits, Mode, Overflow, Snapshot, Stamp,
};

const N: u64 = 1_000_000;
const DEV: u64 = 0x803;

fn host_ino(i: u64) -> u64 {
    12 + i * 7 + (i >> 3)
}

fn handle(i: u64) -> [u8; 8] {
    host_ino(i).to_le_bytes()
}

fn filled(mode: Mode) -> InodeMap {
    let mut m = InodeMap::new(mode, Limits::default());
    m.register_device(DEV, DeviceIdentity::marker("bench"))
        .expect("device");
    m.reserve(DEV, N as usize).expect("reserve");
    for i in 0..N {
        m.map(
            FileKey {
                dev: DEV,
                ino: host_ino(i),
            },
            Stamp(7),
            Some(&handle(i)),
        )
        .expect("map");
    }
    m
}

fn lookups(c: &mut Criterion) {
    let mut g = c.benchmark_group("hit_at_1M");
    for (name, mode) in [
        ("passthrough", Mode::Passthrough),
        (
            "xino",
            Mode::Xino {
                bits: 8,
                overflow: Overflow::Fallback,
            },
        ),
        ("allocated", Mode::Allocated),
        ("hashed", Mode::Hashed),
    ] {
        let mut m = filled(mode);
        let mut i = 0u64;
        g.bench_function(name, |b| {
            b.iter(|| {
                // A stride through the keys: every hit a different bucket.
                i = (i + 7919) % N;
                black_box(m.map(
                    FileKey {
                        dev: DEV,
                        ino: host_ino(i),
                    },
                    Stamp(7),
                    Some(&handle(i)),
                ))
            })
        });
    }
    g.finish();
}

fn inserts(c: &mut Criterion) {
    c.bench_function("allocated_insert_1M", |b| {
        b.iter_batched(
            || InodeMap::new(Mode::Allocated, Limits::default()),
            |mut m| {
                m.register_device(DEV, DeviceIdentity::marker("bench"))
                    .expect("device");
                m.reserve(DEV, N as usize).expect("reserve");
                for i in 0..N {
                    black_box(
                        m.map(
                            FileKey {
                                dev: DEV,
                                ino: host_ino(i),
                            },
                            Stamp(7),
                            None,
                        )
                        .ok(),
                    );
                }
                m
            },
            BatchSize::PerIteration,
        )
    });
}

fn snapshots(c: &mut Criterion) {
    let m = filled(Mode::Allocated);
    c.bench_function("snapshot_save_and_restore_1M", |b| {
        b.iter(|| {
            let mut buf = Vec::new();
            m.snapshot().save(&mut buf).expect("save");
            let s = Snapshot::load(&buf[..]).expect("load");
            black_box(InodeMap::from_snapshot(&s, Limits::default()).expect("restore"))
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = lookups, inserts, snapshots
}
criterion_main!(benches);
