//! Hostile snapshot files: each defect a torn, truncated or tampered file
//! can have gets a typed error, with no panic, no unbounded allocation and
//! no change to the map it was restored into.

use lookout_inode_map::{
    ConflictPolicy, DeviceIdentity, Error, FALLBACK_BASE, FileKey, InodeMap, Limits,
    MAX_COUNTER_SPAN, Mode, Overflow, SavedEntry, Snapshot, SnapshotError, Stamp,
};

fn key(ino: u64) -> FileKey {
    FileKey { dev: 1, ino }
}

/// A small map of `mode` with a few files, one of them reused.
fn small(mode: Mode) -> InodeMap {
    let mut m = InodeMap::new(mode, Limits::default());
    m.register_device(1, DeviceIdentity::marker("data"))
        .expect("dev");
    for i in 0..4u64 {
        // Xino: past its field, so that the fallback table fills too.
        let ino = if matches!(mode, Mode::Xino { .. }) {
            (1 << 60) + i
        } else {
            100 + i
        };
        m.map(key(ino), Stamp(7), Some(&ino.to_le_bytes()))
            .expect("map");
    }
    m
}

fn bytes(s: &Snapshot) -> Vec<u8> {
    let mut b = Vec::new();
    s.save(&mut b).expect("save");
    b
}

fn refused(s: &Snapshot) -> SnapshotError {
    match Snapshot::load(&bytes(s)[..]) {
        Err(Error::Snapshot(e)) => {
            // restore() validates too: a snapshot built in memory is
            // refused the same way, and changes nothing.
            let mut m = InodeMap::new(s.mode, Limits::default());
            let before = m.snapshot();
            assert!(m.restore(s, ConflictPolicy::Trust).is_err());
            assert_eq!(m.snapshot(), before);
            e
        }
        other => panic!("expected a snapshot error, got {other:?}"),
    }
}

const XINO: Mode = Mode::Xino {
    bits: 4,
    overflow: Overflow::Fallback,
};

#[test]
fn every_mode_round_trips_and_validates() {
    for mode in [Mode::Passthrough, XINO, Mode::Allocated, Mode::Hashed] {
        let s = small(mode).snapshot();
        s.validate().expect("a map's own snapshot is valid");
        let back = Snapshot::load(&bytes(&s)[..]).expect("load");
        assert_eq!(back, s, "{mode:?}");
        assert_eq!(bytes(&back), bytes(&s), "canonical bytes");
    }
}

#[test]
fn an_oversized_file_is_refused_before_its_body_is_read() {
    let b = bytes(&small(Mode::Allocated).snapshot());
    let body = (b.len() - 24) as u64;
    assert!(matches!(
        Snapshot::load_limited(&b[..], body - 1),
        Err(Error::Snapshot(SnapshotError::TooLarge { .. }))
    ));
    Snapshot::load_limited(&b[..], body).expect("exactly at the limit");
    // A header that claims an exabyte: refused at once, nothing allocated.
    let mut huge = b.clone();
    huge[12..20].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(matches!(
        Snapshot::load(&huge[..]),
        Err(Error::Snapshot(SnapshotError::TooLarge { len, .. })) if len == 1 << 60
    ));
    // An endless stream is read no further than the limit.
    let endless = std::io::repeat(0xff);
    let head = &b[..24];
    let mut claim = head.to_vec();
    claim[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        Snapshot::load(std::io::Read::chain(&claim[..], endless)),
        Err(Error::Snapshot(SnapshotError::TooLarge { .. }))
    ));
}

#[test]
fn a_flipped_bit_fails_the_checksum() {
    let b = bytes(&small(Mode::Allocated).snapshot());
    for i in 24..b.len() {
        let mut bad = b.clone();
        bad[i] ^= 0x10;
        assert!(
            matches!(
                Snapshot::load(&bad[..]),
                Err(Error::Snapshot(SnapshotError::Checksum { .. }))
            ),
            "byte {i}"
        );
    }
}

#[test]
fn truncation_at_every_byte_is_a_typed_error() {
    for mode in [XINO, Mode::Allocated, Mode::Hashed] {
        let b = bytes(&small(mode).snapshot());
        for cut in 0..b.len() {
            match Snapshot::load(&b[..cut]) {
                Err(Error::Snapshot(SnapshotError::Truncated { got, .. })) => {
                    assert_eq!(
                        got,
                        if cut < 24 {
                            cut as u64
                        } else {
                            (cut - 24) as u64
                        }
                    )
                }
                other => panic!("{mode:?} cut at {cut}: {other:?}"),
            }
        }
        let mut long = b.clone();
        long.push(0);
        assert!(matches!(
            Snapshot::load(&long[..]),
            Err(Error::Snapshot(SnapshotError::TrailingBytes))
        ));
    }
}

#[test]
fn a_slot_beyond_the_modes_bits_is_refused() {
    // Xino with 4 bits: slot 16 would spill into the fallback bit.
    let mut s = small(XINO).snapshot();
    s.devices[0].index = 16;
    for e in &mut s.entries {
        e.slot = 16;
    }
    assert_eq!(
        refused(&s),
        SnapshotError::SlotOutOfRange { slot: 16, bits: 4 }
    );
    let mut s = small(Mode::Allocated).snapshot();
    s.devices[0].index = 1 << 20;
    assert!(matches!(
        refused(&s),
        SnapshotError::SlotOutOfRange { bits: 20, .. }
    ));
    let mut s = small(XINO).snapshot();
    s.mode = Mode::Xino {
        bits: 40,
        overflow: Overflow::Fallback,
    };
    assert_eq!(refused(&s), SnapshotError::BadBits(40));
    let mut s = small(Mode::Allocated).snapshot();
    s.entries[0].slot = 7;
    assert_eq!(refused(&s), SnapshotError::UnknownSlot(7));
}

#[test]
fn duplicate_numbers_files_and_devices_are_refused() {
    let mut s = small(Mode::Allocated).snapshot();
    s.entries[1].out = s.entries[0].out;
    assert_eq!(
        refused(&s),
        SnapshotError::DuplicateNumber(s.entries[0].out)
    );
    let mut s = small(Mode::Allocated).snapshot();
    s.entries[1].ino = s.entries[0].ino;
    assert!(matches!(refused(&s), SnapshotError::DuplicateFile { .. }));
    let mut s = small(Mode::Hashed).snapshot();
    s.hashed[1].out = s.hashed[0].out;
    assert!(matches!(refused(&s), SnapshotError::DuplicateNumber(_)));
    let mut s = small(Mode::Allocated).snapshot();
    let mut twin = s.devices[0].clone();
    twin.index += 1;
    s.devices.push(twin);
    assert!(matches!(refused(&s), SnapshotError::DuplicateDevice(_)));
}

#[test]
fn reserved_numbers_are_refused() {
    for n in [0, 1] {
        let mut s = small(Mode::Allocated).snapshot();
        s.entries[0].out = n;
        assert_eq!(refused(&s), SnapshotError::ReservedNumber(n));
        let mut s = small(Mode::Hashed).snapshot();
        s.hashed[0].out = n;
        assert_eq!(refused(&s), SnapshotError::ReservedNumber(n));
        let mut s = small(Mode::Allocated).snapshot();
        s.tombstones.push(n);
        assert_eq!(refused(&s), SnapshotError::ReservedNumber(n));
    }
}

#[test]
fn counters_that_could_overflow_or_repeat_numbers_are_refused() {
    let mut s = small(Mode::Allocated).snapshot();
    s.next = u64::MAX;
    assert!(matches!(
        refused(&s),
        SnapshotError::CounterOutOfRange { what: "next", .. }
    ));
    let mut s = small(XINO).snapshot();
    s.next_fallback = u64::MAX;
    assert!(matches!(
        refused(&s),
        SnapshotError::CounterOutOfRange {
            what: "next_fallback",
            ..
        }
    ));
    // At the counter's span: still valid, and allocating from there works.
    let mut s = small(Mode::Allocated).snapshot();
    s.next = 2 + MAX_COUNTER_SPAN;
    let mut m = InodeMap::from_snapshot(&s, Limits::default()).expect("restore");
    m.register_device(1, DeviceIdentity::marker("data"))
        .expect("dev");
    assert_eq!(
        m.map(key(5), Stamp(1), None).expect("map").ino,
        2 + MAX_COUNTER_SPAN
    );
    // A number the counter has not reached would be handed out twice.
    let mut s = small(Mode::Allocated).snapshot();
    s.entries[0].out = s.next;
    assert!(matches!(
        refused(&s),
        SnapshotError::NumberOutOfRange { .. }
    ));
    // A fallback number below the fallback range.
    let mut s = small(XINO).snapshot();
    s.entries[0].out = 5;
    assert!(matches!(
        refused(&s),
        SnapshotError::NumberOutOfRange {
            lo: FALLBACK_BASE,
            ..
        }
    ));
    // A table the mode never fills.
    let mut s = small(Mode::Passthrough).snapshot();
    s.entries.push(SavedEntry {
        slot: s.devices[0].index,
        ino: 1,
        stamp: Stamp(1),
        out: 2,
    });
    assert!(matches!(refused(&s), SnapshotError::UnexpectedTable { .. }));
}

#[test]
fn limits_are_honoured_and_a_refused_restore_changes_nothing() {
    let s = small(Mode::Allocated).snapshot();
    assert!(matches!(
        InodeMap::from_snapshot(&s, Limits { max_entries: 3 }),
        Err(Error::Snapshot(SnapshotError::OverLimit {
            entries: 4,
            max: 3
        }))
    ));
    let mut m = InodeMap::new(Mode::Allocated, Limits { max_entries: 6 });
    m.register_device(1, DeviceIdentity::marker("data"))
        .expect("dev");
    for i in 0..3 {
        m.map(key(i), Stamp(1), None).expect("map");
    }
    let before = m.snapshot();
    for policy in [
        ConflictPolicy::Fail,
        ConflictPolicy::Remap,
        ConflictPolicy::Trust,
    ] {
        assert!(matches!(
            m.restore(&s, policy),
            Err(Error::Snapshot(SnapshotError::OverLimit { .. }))
        ));
        assert_eq!(m.snapshot(), before, "{policy:?}");
    }
}

#[test]
fn a_failed_fail_restore_leaves_the_map_bit_for_bit_unchanged() {
    let s = small(Mode::Allocated).snapshot();
    // Same device identity, but the map gave the snapshot's numbers to
    // files of another device.
    let mut m = InodeMap::new(Mode::Allocated, Limits::default());
    m.register_device(1, DeviceIdentity::marker("data"))
        .expect("dev");
    m.register_device(2, DeviceIdentity::marker("other"))
        .expect("dev");
    for i in 0..6 {
        m.map(FileKey { dev: 2, ino: i }, Stamp(1), None)
            .expect("map");
    }
    let before = m.snapshot();
    let mut saved = Vec::new();
    before.save(&mut saved).expect("save");
    assert!(matches!(
        m.restore(&s, ConflictPolicy::Fail),
        Err(Error::Conflict(_))
    ));
    let mut after = Vec::new();
    m.snapshot().save(&mut after).expect("save");
    assert_eq!(saved, after);
    // The map still works as it did: the same files, the same numbers,
    // and the next number where it was.
    assert_eq!(
        m.map(FileKey { dev: 2, ino: 0 }, Stamp(1), None)
            .expect("map")
            .ino,
        2
    );
    assert_eq!(m.map(key(50), Stamp(1), None).expect("map").ino, 8);
}

#[test]
fn a_version_1_file_from_an_earlier_build_still_loads() {
    // tests/fixtures/allocated-v1.snap was written by the version-1 code
    // (no length, no checksum): device "marker:data", inodes 100..=102,
    // inode 101 reused once (its first number, 3, is a tombstone).
    let b = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/allocated-v1.snap"
    ))
    .expect("fixture");
    assert_eq!(&b[8..12], &1u32.to_le_bytes());
    let s = Snapshot::load(&b[..]).expect("load v1");
    assert_eq!(s.version, 1);
    let mut m = InodeMap::from_snapshot(&s, Limits::default()).expect("restore");
    m.register_device(9, DeviceIdentity::marker("data"))
        .expect("dev");
    let n = |m: &mut InodeMap, ino| {
        m.map(FileKey { dev: 9, ino }, Stamp(7), None)
            .expect("map")
            .ino
    };
    assert_eq!(n(&mut m, 100), 2);
    assert_eq!(n(&mut m, 102), 4);
    assert_eq!(m.stats().tombstones, 1);
    assert_eq!(n(&mut m, 103), 6, "after every number the v1 file gave");
    // Written again, it is version 2.
    let again = bytes(&m.snapshot());
    assert_eq!(&again[8..12], &2u32.to_le_bytes());
    // A truncated v1 file is an error too (its body no longer decodes).
    for cut in 12..b.len() {
        assert!(Snapshot::load(&b[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn files_are_written_atomically_and_symlinks_are_not_followed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = small(Mode::Hashed).snapshot();
    let path = dir.path().join("map.snap");
    s.write_file(&path).expect("write");
    assert_eq!(Snapshot::read_file(&path).expect("read"), s);
    // A symlink planted where the snapshot goes: replaced, its target
    // untouched.
    let target = dir.path().join("precious");
    std::fs::write(&target, b"keep me").expect("write");
    let planted = dir.path().join("planted.snap");
    std::os::unix::fs::symlink(&target, &planted).expect("symlink");
    assert!(
        Snapshot::read_file(&planted).is_err(),
        "reading through a symlink is refused"
    );
    s.write_file(&planted).expect("write over the symlink");
    assert_eq!(std::fs::read(&target).expect("read"), b"keep me");
    assert!(
        std::fs::symlink_metadata(&planted)
            .expect("stat")
            .file_type()
            .is_file()
    );
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    // A FIFO is refused without blocking.
    let fifo = dir.path().join("fifo.snap");
    nix_mkfifo(&fifo);
    assert!(Snapshot::read_file(&fifo).is_err());
}

fn nix_mkfifo(path: &std::path::Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo");
    assert!(status.success());
}
