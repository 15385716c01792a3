//! Inode-map snapshots, written by an earlier process and possibly torn,
//! truncated or tampered with: load, then restore under every policy into
//! a map that already holds files. Raw bytes would rarely pass the
//! checksum, so most inputs are a body wrapped in a valid header.
//!
//! Input: a first byte (mod 3: 0 the file's bytes; 1 a postcard body put
//! behind a correct version-2 header, length and CRC-32; 2 a body behind
//! a version-1 header), then the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lookout_inode_map::{
    ConflictPolicy, DeviceIdentity, FileKey, InodeMap, Limits, Mode, Overflow, Snapshot, Stamp,
};

fn header(version: u32, body: &[u8]) -> Vec<u8> {
    let mut b = b"LKINOMAP".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    if version == 2 {
        b.extend_from_slice(&(body.len() as u64).to_le_bytes());
        b.extend_from_slice(&crc32(body).to_le_bytes());
    }
    b.extend_from_slice(body);
    b
}

/// CRC-32 (ISO-HDLC), bit by bit: a second implementation, so that the
/// crate's is checked too.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A map of `mode` that already numbered a few files.
fn busy(mode: Mode) -> InodeMap {
    let mut m = InodeMap::new(mode, Limits { max_entries: 64 });
    let _ = m.register_device(1, DeviceIdentity::marker("a"));
    let _ = m.register_device(2, DeviceIdentity::marker("b"));
    for ino in 2..6u64 {
        let _ = m.map(FileKey { dev: 1, ino }, Stamp(3), Some(&ino.to_le_bytes()));
    }
    m
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bytes = match mode % 3 {
        0 => rest.to_vec(),
        1 => header(2, rest),
        _ => header(1, rest),
    };
    let Ok(s) = Snapshot::load_limited(&bytes[..], 1 << 20) else {
        return;
    };
    s.validate().expect("load validates");
    let modes = [
        s.mode,
        Mode::Allocated,
        Mode::Hashed,
        Mode::Xino {
            bits: 4,
            overflow: Overflow::Fallback,
        },
    ];
    for policy in [
        ConflictPolicy::Fail,
        ConflictPolicy::Remap,
        ConflictPolicy::Trust,
    ] {
        for mode in modes {
            let mut m = busy(mode);
            let before = m.snapshot();
            match m.restore(&s, policy) {
                Ok(_) => {
                    // Whatever was restored, the map's own state holds.
                    m.snapshot().validate().expect("a restored map is valid");
                    let _ = m.map(FileKey { dev: 1, ino: 9 }, Stamp(1), Some(b"x"));
                }
                Err(_) => assert_eq!(m.snapshot(), before, "a refused restore changes nothing"),
            }
        }
    }
    let mut again = Vec::new();
    s.save(&mut again).expect("save");
    assert_eq!(
        Snapshot::load(&again[..]).expect("reload").entries,
        s.entries
    );
});
