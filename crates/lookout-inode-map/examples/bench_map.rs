//! Measures the map: insert and lookup per mode at N entries, bytes per
//! entry, snapshot save and restore. Prints one JSON object.
//! `cargo xtask bench` runs it (release); by hand:
//!
//! ```sh
//! cargo run --release -p lookout-inode-map --example bench_map -- 1000000
//! ```

use std::hint::black_box;
use std::time::Instant;

use lookout_inode_map::{
    DeviceIdentity, FileKey, InodeMap, Limits, Mode, Overflow, Snapshot, Stamp,
};

/// Host inode numbers like a busy ext4's: spread out, not dense.
fn host_ino(i: u64) -> u64 {
    12 + i * 7 + (i >> 3)
}

/// A handle like ext4's (inode + generation, 8 bytes).
fn handle(i: u64) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&(host_ino(i) as u32).to_le_bytes());
    h[4..].copy_from_slice(&((i as u32).wrapping_mul(2_654_435_761)).to_le_bytes());
    h
}

fn shuffled(n: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let order = shuffled(n);
    // The floor on this machine: a bare hash map of u64 -> u64 with the
    // same hasher and keys, measured in the same run.
    let mut bare: std::collections::HashMap<
        u64,
        u64,
        std::hash::BuildHasherDefault<lookout_inode_map::IntHasher>,
    > = std::collections::HashMap::default();
    bare.reserve(n as usize);
    for i in 0..n {
        bare.insert(host_ino(i), i);
    }
    let t = Instant::now();
    let mut sum = 0u64;
    for i in 0..n {
        sum = sum.wrapping_add(bare.get(&host_ino(i)).copied().unwrap_or(0));
    }
    black_box(sum);
    let bare_ns = t.elapsed().as_nanos() as f64 / n as f64;
    let mut modes = serde_json_lite::Obj::default();
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
        let mut m = InodeMap::new(mode, Limits::default());
        let dev = 0x803;
        if m.register_device(dev, DeviceIdentity::marker("bench"))
            .is_err()
        {
            eprintln!("cannot register the device");
            std::process::exit(1);
        }
        let _ = m.reserve(dev, n as usize);
        let stamp = Stamp(7);
        let t = Instant::now();
        for i in 0..n {
            let k = FileKey {
                dev,
                ino: host_ino(i),
            };
            let h = handle(i);
            black_box(m.map(k, stamp, Some(&h)).ok());
        }
        let insert_ns = t.elapsed().as_nanos() as f64 / n as f64;
        // Hits in creation order (a directory's files were mostly created
        // together and are walked together) ...
        let t = Instant::now();
        let mut sum = 0u64;
        for i in 0..n {
            let k = FileKey {
                dev,
                ino: host_ino(i),
            };
            let h = handle(i);
            sum = sum.wrapping_add(m.map(k, stamp, Some(&h)).map_or(0, |x| x.ino));
        }
        black_box(sum);
        let lookup_ns = t.elapsed().as_nanos() as f64 / n as f64;
        // ... and in random order (every hit a cache and TLB miss).
        let t = Instant::now();
        let mut sum = 0u64;
        for &i in &order {
            let k = FileKey {
                dev,
                ino: host_ino(i),
            };
            let h = handle(i);
            sum = sum.wrapping_add(m.map(k, stamp, Some(&h)).map_or(0, |x| x.ino));
        }
        black_box(sum);
        let random_ns = t.elapsed().as_nanos() as f64 / n as f64;
        let s = m.stats();
        let bytes_per_entry = s.bytes as f64 / n as f64;
        let mut o = serde_json_lite::Obj::default();
        o.num("insert_ns", insert_ns);
        o.num("lookup_ns", lookup_ns);
        o.num("lookup_random_ns", random_ns);
        o.num("bytes_per_entry", bytes_per_entry);
        o.num("entries", s.entries as f64);
        o.num("fallbacks", s.fallbacks as f64);
        if matches!(mode, Mode::Allocated | Mode::Hashed) {
            let t = Instant::now();
            let mut buf = Vec::with_capacity(n as usize * 20);
            if let Err(e) = m.snapshot().save(&mut buf) {
                eprintln!("save: {}", chain(&e));
                std::process::exit(1);
            }
            let save_ms = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            let restored = Snapshot::load(&buf[..])
                .and_then(|s| InodeMap::from_snapshot(&s, Limits::default()));
            let restore_ms = t.elapsed().as_secs_f64() * 1e3;
            match restored {
                Ok(r) => o.num("restored_entries", r.stats().entries as f64),
                Err(e) => {
                    eprintln!("restore: {}", chain(&e));
                    std::process::exit(1);
                }
            }
            o.num("snapshot_save_ms", save_ms);
            o.num("snapshot_restore_ms", restore_ms);
            o.num("snapshot_bytes", buf.len() as f64);
        }
        modes.obj(name, o);
    }
    let mut top = serde_json_lite::Obj::default();
    top.num("entries", n as f64);
    top.num("bare_hashmap_lookup_ns", bare_ns);
    top.obj("modes", modes);
    println!("{}", top.render());
}

/// A few lines of JSON output, to keep this example free of dependencies.
mod serde_json_lite {
    #[derive(Default)]
    pub struct Obj(Vec<(String, String)>);

    impl Obj {
        pub fn num(&mut self, k: &str, v: f64) {
            self.0.push((k.to_owned(), format!("{v:.3}")));
        }
        pub fn obj(&mut self, k: &str, v: Obj) {
            self.0.push((k.to_owned(), v.render()));
        }
        pub fn render(&self) -> String {
            let body: Vec<String> = self.0.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            format!("{{{}}}", body.join(","))
        }
    }
}

/// `e` and its causes, `outer: cause: root` (the crate's errors leave
/// their causes to `source()`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s = format!("{s}: {c}");
        cause = c.source();
    }
    s
}
