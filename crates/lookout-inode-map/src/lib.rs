//! Stable, collision-free inode numbers for host files seen through a
//! sandbox or a FUSE layer.
//!
//! # The problem
//!
//! gVisor gives files from host mounts made-up inode numbers from a
//! counter, in first-access order, so they change on every restart; log
//! shippers that track files by `(path, inode)` then re-read or lose logs.
//! Passing host numbers through needs a stable mapping of host devices;
//! checkpoint/restore needs numbers that survive a restore; and an
//! ever-growing map costs memory and a `stat` per directory entry.
//!
//! # The modes
//!
//! One API ([`InodeMap::map`]), four [`Mode`]s, each with its guarantees in
//! its docs:
//!
//! | mode | memory per file | syscall per dirent | stable across restart |
//! |---|---|---|---|
//! | [`Mode::Passthrough`] | none | none | yes (host numbers; per-device `st_dev`) |
//! | [`Mode::Xino`] | none (fallbacks only) | none | yes, except overflow fallbacks (snapshot) |
//! | [`Mode::Allocated`] | ~50 B | none | only through a [`Snapshot`] |
//! | [`Mode::Hashed`] | ~50 B | `name_to_handle_at` for new files | yes (handles), collisions through a snapshot |
//!
//! Devices are known by a [`DeviceIdentity`] (filesystem UUID, fsid, mount
//! id or a caller's marker; [`probe_device`]), not by the raw `st_dev`, so
//! numbers survive reboots and device renumbering wherever the host file
//! system's own numbers do. Reused host inodes (unlink, then create) are
//! recognised by a [`Stamp`] (birth time and type) in the modes that keep
//! entries, and get a new number; the old one stays a tombstone until
//! forgotten.
//!
//! ```
//! use lookout_inode_map::{DeviceIdentity, FileKey, InodeMap, Limits, Mode, Overflow, Stamp};
//!
//! let mut map = InodeMap::new(Mode::Xino { bits: 8, overflow: Overflow::Fallback }, Limits::default());
//! map.register_device(0x803, DeviceIdentity::marker("logs-volume")).unwrap();
//! map.register_device(0x2b, DeviceIdentity::marker("config-volume")).unwrap();
//! let a = map.map(FileKey { dev: 0x803, ino: 12 }, Stamp::UNKNOWN, None).unwrap();
//! let b = map.map(FileKey { dev: 0x2b, ino: 12 }, Stamp::UNKNOWN, None).unwrap();
//! assert_ne!(a.ino, b.ino, "same host number on two devices, two numbers");
//! assert_eq!(a.ino & 0xfff, 12, "the host number is in the low bits");
//! ```
#![deny(missing_docs)]

mod device;
mod handle;
mod map;
mod snapshot;

pub use device::{DeviceIdentity, DeviceSlot, Devices, VIRTUAL_MAJOR, probe_device};
pub use handle::file_handle_at;
pub use map::{
    FALLBACK_BASE, FileKey, InodeMap, IntHasher, Limits, Mapped, Mode, Overflow, Stamp, Stats,
};
pub use snapshot::{
    ConflictPolicy, DEFAULT_MAX_SNAPSHOT_BYTES, MAX_COUNTER_SPAN, MAX_IDENTITY_LEN, RestoreReport,
    SNAPSHOT_VERSION, SavedEntry, Snapshot, SnapshotError,
};

use std::path::PathBuf;

/// Errors. None of them leaves the map inconsistent.
///
/// An underlying error (a [`SnapshotError`], an [`std::io::Error`]) is the
/// [`source`](std::error::Error::source), not part of the message: print
/// the error with its sources (anyhow's `{:#}`, or walk `source()`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file of a device that was never registered.
    #[error("device {0:#x} is not registered (call register_device first)")]
    UnknownDevice(u64),
    /// Xino with [`Overflow::Fail`]: the host number does not fit.
    #[error("inode {ino} does not fit in {bits} bits")]
    Overflow {
        /// The host number.
        ino: u64,
        /// The bits available.
        bits: u32,
    },
    /// Hashed mode met a new file without its handle.
    #[error("Hashed mode needs the file handle of a file it has not seen")]
    NeedHandle,
    /// More devices than slots.
    #[error("no free device slot for {identity} ({bits} bits)")]
    DevicesFull {
        /// The slot width.
        bits: u32,
        /// The device that did not fit.
        identity: DeviceIdentity,
    },
    /// A restore conflict under [`ConflictPolicy::Fail`].
    #[error("restore conflict: {0}")]
    Conflict(String),
    /// A snapshot that cannot be used: which defect.
    #[error("unusable snapshot")]
    Snapshot(#[from] SnapshotError),
    /// Reading or writing a snapshot failed.
    #[error("snapshot I/O")]
    SnapshotIo(#[source] std::io::Error),
    /// Probing a path, or reading or writing a snapshot file, failed.
    #[error("{}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

#[cfg(test)]
mod error_tests {
    use super::*;
    use std::error::Error as _;

    fn chain(e: &Error) -> String {
        let mut s = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            s = format!("{s}: {c}");
            cause = c.source();
        }
        s
    }

    #[test]
    fn each_cause_is_printed_once() {
        let e = Error::from(SnapshotError::BadMagic);
        assert_eq!(
            chain(&e),
            "unusable snapshot: not an inode-map snapshot (bad magic)"
        );
        let cause = std::io::Error::from_raw_os_error(libc::ENOENT).to_string();
        let e = Error::Io {
            path: PathBuf::from("/var/lib/lookout/inodes"),
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        };
        assert_eq!(chain(&e), format!("/var/lib/lookout/inodes: {cause}"));
        // A body that does not decode keeps postcard's error as its cause.
        let e = Snapshot::load(&b"LKINOMAP\x01\x00\x00\x00\xff\xff\xff\xff"[..])
            .expect_err("not a snapshot body");
        let text = chain(&e);
        assert!(text.starts_with("unusable snapshot: "), "{text}");
        let Error::Snapshot(SnapshotError::Corrupt(p)) = &e else {
            panic!("expected a corrupt body, got {text}");
        };
        assert_eq!(text.matches(&p.to_string()).count(), 1, "{text}");
    }
}
