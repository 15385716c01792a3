//! Snapshot and restore: a versioned serde format (postcard), and a
//! restore that reports conflicts under a policy instead of panicking.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::device::DeviceSlot;
use crate::map::{Entry, InodeMap, Mode, Owner, Stamp};

/// The format version this crate writes and reads.
pub const SNAPSHOT_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"LKINOMAP";

/// One saved file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedEntry {
    /// Device slot.
    pub slot: u32,
    /// Host inode.
    pub ino: u64,
    /// Its stamp when saved.
    pub stamp: Stamp,
    /// The number it had.
    pub out: u64,
}

/// Everything needed to give the same files the same numbers again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// [`SNAPSHOT_VERSION`] when written.
    pub version: u32,
    /// The mode of the map.
    pub mode: Mode,
    /// Device identities and their slots.
    pub devices: Vec<DeviceSlot>,
    /// The allocation counters.
    pub next: u64,
    /// The fallback counter.
    pub next_fallback: u64,
    /// Allocated entries (and Xino/Hashed fallbacks).
    pub entries: Vec<SavedEntry>,
    /// Hashed numbers and their owners.
    pub hashed: Vec<SavedEntry>,
    /// Numbers of reused inodes still out of circulation.
    pub tombstones: Vec<u64>,
}

impl Snapshot {
    /// Writes the snapshot: an 8-byte magic, the version (u32 LE), then the
    /// postcard encoding.
    pub fn save(&self, mut w: impl Write) -> Result<(), Error> {
        let body = postcard::to_stdvec(self).map_err(|e| Error::Snapshot(e.to_string()))?;
        w.write_all(MAGIC).map_err(Error::SnapshotIo)?;
        w.write_all(&self.version.to_le_bytes())
            .map_err(Error::SnapshotIo)?;
        w.write_all(&body).map_err(Error::SnapshotIo)?;
        Ok(())
    }

    /// Reads a snapshot written by [`Snapshot::save`]. A different magic or
    /// a version this crate does not know is an error, not a guess.
    pub fn load(mut r: impl Read) -> Result<Snapshot, Error> {
        let mut head = [0u8; 12];
        r.read_exact(&mut head).map_err(Error::SnapshotIo)?;
        if &head[..8] != MAGIC {
            return Err(Error::Snapshot(
                "not an inode-map snapshot (bad magic)".into(),
            ));
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if version != SNAPSHOT_VERSION {
            return Err(Error::Snapshot(format!(
                "snapshot version {version}; this build reads version {SNAPSHOT_VERSION}"
            )));
        }
        let mut body = Vec::new();
        r.read_to_end(&mut body).map_err(Error::SnapshotIo)?;
        let s: Snapshot = postcard::from_bytes(&body)
            .map_err(|e| Error::Snapshot(format!("corrupt snapshot: {e}")))?;
        if s.version != version {
            return Err(Error::Snapshot("header and body versions differ".into()));
        }
        Ok(s)
    }
}

/// What to do when a snapshot disagrees with the map it is restored into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictPolicy {
    /// Stop at the first conflict with [`Error::Conflict`]; the map is left
    /// as it was before the restore.
    Fail,
    /// Keep what the map has; a saved file whose number is taken gets a
    /// fresh one. Reported.
    Remap,
    /// The snapshot wins: its numbers replace the map's. Reported.
    Trust,
}

/// The outcome of a restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Entries restored with their saved numbers.
    pub restored: usize,
    /// Entries that got a fresh number (Remap).
    pub remapped: usize,
    /// Entries of the map replaced by the snapshot's (Trust).
    pub replaced: usize,
    /// The first conflicts, described.
    pub conflicts: Vec<String>,
}

const MAX_REPORTED: usize = 32;

impl InodeMap {
    /// A snapshot of everything the map knows.
    pub fn snapshot(&self) -> Snapshot {
        let mut entries = Vec::with_capacity(self.entries.values().map(|m| m.len()).sum());
        for (slot, m) in &self.entries {
            for (ino, e) in m {
                entries.push(SavedEntry {
                    slot: *slot,
                    ino: *ino,
                    stamp: e.stamp,
                    out: e.out,
                });
            }
        }
        let hashed = self
            .owners
            .iter()
            .map(|(n, o)| SavedEntry {
                slot: o.slot,
                ino: o.ino,
                stamp: o.stamp,
                out: *n,
            })
            .collect();
        Snapshot {
            version: SNAPSHOT_VERSION,
            mode: self.mode,
            devices: self.devices.slots(),
            next: self.next,
            next_fallback: self.next_fallback,
            entries,
            hashed,
            tombstones: self.tombstones.keys().copied().collect(),
        }
    }

    /// A new map with the snapshot's numbers.
    pub fn from_snapshot(snapshot: &Snapshot, limits: crate::Limits) -> Result<InodeMap, Error> {
        let mut m = InodeMap::new(snapshot.mode, limits);
        m.restore(snapshot, ConflictPolicy::Fail)?;
        Ok(m)
    }

    /// Re-links the snapshot's entries to their saved numbers. Saved stamps
    /// come along, so a host inode reused since the snapshot is recognised
    /// at its next [`InodeMap::map`] with a stamp and gets a new number.
    /// Devices keep their saved slots: register them again (with their
    /// current `st_dev`) after the restore.
    pub fn restore(
        &mut self,
        s: &Snapshot,
        policy: ConflictPolicy,
    ) -> Result<RestoreReport, Error> {
        if s.version != crate::SNAPSHOT_VERSION {
            return Err(Error::Snapshot(format!("snapshot version {}", s.version)));
        }
        if s.mode != self.mode {
            return Err(Error::Snapshot(format!(
                "the snapshot is of a {:?} map, this one is {:?}",
                s.mode, self.mode
            )));
        }
        let mut report = RestoreReport::default();
        let conflict = |report: &mut RestoreReport, what: String| -> Result<(), Error> {
            if policy == ConflictPolicy::Fail {
                return Err(Error::Conflict(what));
            }
            if report.conflicts.len() < MAX_REPORTED {
                report.conflicts.push(what);
            }
            Ok(())
        };
        // The numbers this map has handed out already (none when restoring
        // into an empty map, the common case).
        let mut taken: std::collections::HashSet<u64> = self
            .entries
            .values()
            .flat_map(|m| m.values().map(|e| e.out))
            .chain(self.owners.keys().copied())
            .collect();
        // Check first under Fail, so that a failed restore changes nothing.
        if policy == ConflictPolicy::Fail {
            for d in &s.devices {
                if let Some(other) = self.devices.identity(d.index)
                    && *other != d.identity
                {
                    return Err(Error::Conflict(format!(
                        "device slot {} is {other} here, {} in the snapshot",
                        d.index, d.identity
                    )));
                }
            }
            if let Some(e) = s
                .entries
                .iter()
                .chain(&s.hashed)
                .find(|e| taken.contains(&e.out))
            {
                return Err(Error::Conflict(format!(
                    "number {} is in use here and belongs to inode {} of slot {} in the snapshot",
                    e.out, e.ino, e.slot
                )));
            }
        }
        for d in &s.devices {
            if let Err(Error::Conflict(what)) = self.devices.pin(d.identity.clone(), d.index) {
                conflict(&mut report, what)?;
            }
        }
        let check = !taken.is_empty();
        // Fresh numbers for remapped files come after both maps' ranges, so
        // they cannot collide with numbers still to be restored.
        self.next = self.next.max(s.next);
        // Size each device's table once instead of growing it entry by
        // entry (a rehash at 1M entries moves 46 MB).
        let mut per_slot: std::collections::BTreeMap<u32, usize> =
            std::collections::BTreeMap::new();
        for e in &s.entries {
            *per_slot.entry(e.slot).or_default() += 1;
        }
        for (slot, n) in per_slot {
            self.entries.entry(slot).or_default().reserve(n);
        }
        for e in &s.entries {
            let m = self.entries.entry(e.slot).or_default();
            if check && taken.contains(&e.out) && m.get(&e.ino).map(|x| x.out) != Some(e.out) {
                conflict(
                    &mut report,
                    format!(
                        "number {} is taken; inode {} of slot {}",
                        e.out, e.ino, e.slot
                    ),
                )?;
                match policy {
                    ConflictPolicy::Remap => {
                        if let std::collections::hash_map::Entry::Vacant(slot) = m.entry(e.ino) {
                            let out = self.next;
                            self.next += 1;
                            slot.insert(Entry {
                                out,
                                stamp: e.stamp,
                                live: false,
                            });
                            taken.insert(out);
                        }
                        report.remapped += 1;
                        continue;
                    }
                    ConflictPolicy::Trust => {
                        // The file that had this number here loses it: it
                        // gets a fresh one when it is seen again.
                        for other in self.entries.values_mut() {
                            other.retain(|ino, x| x.out != e.out || *ino == e.ino);
                        }
                        report.replaced += 1;
                    }
                    ConflictPolicy::Fail => {}
                }
            }
            let m = self.entries.entry(e.slot).or_default();
            m.insert(
                e.ino,
                Entry {
                    out: e.out,
                    stamp: e.stamp,
                    live: false,
                },
            );
            if check {
                taken.insert(e.out);
            }
            report.restored += 1;
        }
        self.owners.reserve(s.hashed.len());
        for e in &s.hashed {
            if let Some(o) = self.owners.get(&e.out)
                && (o.slot, o.ino) != (e.slot, e.ino)
            {
                conflict(
                    &mut report,
                    format!("hashed number {} belongs to another file here", e.out),
                )?;
                if policy == ConflictPolicy::Remap {
                    report.remapped += 1;
                    continue;
                }
                report.replaced += 1;
            }
            self.owners.insert(
                e.out,
                Owner {
                    slot: e.slot,
                    ino: e.ino,
                    stamp: e.stamp,
                },
            );
            report.restored += 1;
        }
        for t in &s.tombstones {
            self.tombstones.insert(*t, ());
        }
        self.next = self.next.max(s.next);
        self.next_fallback = self.next_fallback.max(s.next_fallback);
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceIdentity, FileKey, Limits};

    fn filled(mode: Mode) -> InodeMap {
        let mut m = InodeMap::new(mode, Limits::default());
        m.register_device(1, DeviceIdentity::marker("a"))
            .expect("dev");
        for i in 0..100u64 {
            m.map(
                FileKey {
                    dev: 1,
                    ino: 1000 + i,
                },
                Stamp(7),
                Some(&i.to_le_bytes()),
            )
            .expect("map");
        }
        m
    }

    #[test]
    fn save_load_restore_gives_every_file_its_number_back() {
        for mode in [Mode::Allocated, Mode::Hashed] {
            let mut m = filled(mode);
            let before: Vec<u64> = (0..100u64)
                .map(|i| {
                    m.map(
                        FileKey {
                            dev: 1,
                            ino: 1000 + i,
                        },
                        Stamp(7),
                        Some(&i.to_le_bytes()),
                    )
                    .expect("map")
                    .ino
                })
                .collect();
            let mut bytes = Vec::new();
            m.snapshot().save(&mut bytes).expect("save");
            let s = Snapshot::load(&bytes[..]).expect("load");
            let mut r = InodeMap::from_snapshot(&s, Limits::default()).expect("restore");
            // After a reboot the device has another st_dev, same identity.
            r.register_device(99, DeviceIdentity::marker("a"))
                .expect("dev");
            let after: Vec<u64> = (0..100u64)
                .map(|i| {
                    r.map(
                        FileKey {
                            dev: 99,
                            ino: 1000 + i,
                        },
                        Stamp(7),
                        Some(&i.to_le_bytes()),
                    )
                    .expect("map")
                    .ino
                })
                .collect();
            assert_eq!(before, after, "{mode:?}");
            // New files do not take restored numbers.
            let new = r
                .map(FileKey { dev: 99, ino: 5 }, Stamp(7), Some(b"new"))
                .expect("map");
            assert!(!after.contains(&new.ino));
        }
    }

    #[test]
    fn bad_snapshots_are_errors() {
        assert!(matches!(
            Snapshot::load(&b"not a snapshot at all"[..]),
            Err(Error::Snapshot(_))
        ));
        let mut bytes = Vec::new();
        filled(Mode::Allocated)
            .snapshot()
            .save(&mut bytes)
            .expect("save");
        bytes[8] = 9;
        assert!(
            Snapshot::load(&bytes[..])
                .expect_err("version 9")
                .to_string()
                .contains("version 9")
        );
        bytes[8] = 1;
        let cut = bytes.len() / 2;
        assert!(Snapshot::load(&bytes[..cut]).is_err());
        let s = filled(Mode::Allocated).snapshot();
        let mut other = InodeMap::new(Mode::Hashed, Limits::default());
        assert!(
            other.restore(&s, ConflictPolicy::Trust).is_err(),
            "mode mismatch"
        );
    }

    #[test]
    fn conflicts_follow_the_policy() {
        let s = filled(Mode::Allocated).snapshot();
        // A map that already gave numbers 2.. to other files.
        let busy = || {
            let mut m = InodeMap::new(Mode::Allocated, Limits::default());
            m.register_device(1, DeviceIdentity::marker("a"))
                .expect("dev");
            for i in 0..10u64 {
                m.map(FileKey { dev: 1, ino: i }, Stamp(1), None)
                    .expect("map");
            }
            m
        };
        let mut m = busy();
        let e = m.restore(&s, ConflictPolicy::Fail).expect_err("conflict");
        assert!(matches!(e, Error::Conflict(_)));
        assert_eq!(m.stats().entries, 10, "a failed restore changes nothing");

        let mut m = busy();
        let r = m.restore(&s, ConflictPolicy::Remap).expect("remap");
        assert_eq!(r.remapped, 10);
        assert_eq!(r.restored, 90);
        assert!(!r.conflicts.is_empty());
        assert_eq!(
            m.map(FileKey { dev: 1, ino: 0 }, Stamp(1), None)
                .expect("map")
                .ino,
            2,
            "kept"
        );

        let mut m = busy();
        let r = m.restore(&s, ConflictPolicy::Trust).expect("trust");
        assert_eq!((r.restored, r.replaced), (100, 10));
        assert_eq!(
            m.map(FileKey { dev: 1, ino: 1000 }, Stamp(7), None)
                .expect("map")
                .ino,
            2,
            "the snapshot's"
        );
        let displaced = m
            .map(FileKey { dev: 1, ino: 0 }, Stamp(1), None)
            .expect("map")
            .ino;
        assert!(
            displaced > 101,
            "the displaced file gets a fresh number, not a duplicate: {displaced}"
        );
    }
}
