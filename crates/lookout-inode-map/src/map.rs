//! The map itself: host `(st_dev, st_ino)` to the numbers presented.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::device::{DeviceIdentity, Devices, fnv1a};

/// A multiply-rotate hasher for integer keys (the FxHash recipe): the
/// keys here are inode numbers, not attacker-chosen strings, and SipHash
/// costs 4-10× more per lookup.
#[derive(Default, Clone, Copy)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        // hashbrown takes the bucket from the low bits and a tag from the
        // top 7: finish with murmur3's mixer so both are well spread (a bare
        // fold left probe chains long enough to triple the cost of a hit
        // over 1000 cached keys).
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^ (h >> 33)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
}

type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// How numbers are made. Each mode's guarantees:
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// The host inode number passes through unchanged; each host device
    /// gets a stable virtual device number (`makedev(240, slot)`, the slot
    /// from the device's identity). No memory per file, no syscall per
    /// directory entry. Stable across restarts and reboots wherever the
    /// host's own numbers are. Unique only per (virtual device, inode): a
    /// consumer that ignores `st_dev` can see two files with one number.
    /// A host inode that is freed and reused keeps its number, exactly as
    /// on the host.
    Passthrough,
    /// overlayfs-style: one device, the device slot packed into the high
    /// bits: `| 1 fallback bit | bits slot | 63 - bits host inode |`. No
    /// memory per file, unique across devices, stable like Passthrough. A
    /// host inode wider than its field takes `overflow`.
    Xino {
        /// Bits for the device slot (1..=20).
        bits: u32,
        /// What to do with a host inode that does not fit.
        overflow: Overflow,
    },
    /// A dense counter from 2 in first-seen order: the legacy behaviour
    /// (gVisor's). Stable only through a snapshot; without one the numbers
    /// depend on access order. A reused host inode (another birth time or
    /// type) gets a new number. Memory per file.
    Allocated,
    /// Numbers from a hash of the device identity and the file handle
    /// (`name_to_handle_at`, which ext4/XFS/btrfs keep across mounts and
    /// reboots), checked against collisions; a colliding file gets a number
    /// from the fallback range (top bit set), stable only through a
    /// snapshot. A reused host inode has a new handle, hence a new number.
    /// Memory per file and a `name_to_handle_at` per new file.
    Hashed,
}

/// Xino's overflow policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Overflow {
    /// Give the file a number from the fallback range (top bit set, a
    /// counter, kept in memory: stable only through a snapshot).
    Fallback,
    /// Refuse the file ([`Error::Overflow`]).
    Fail,
}

/// A host file: its device and inode number as `stat` shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileKey {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
}

/// What tells one life of a host inode from the next: a hash of its birth
/// time and type (`statx` `STATX_BTIME`; ctime where there is no birth
/// time). `Stamp::UNKNOWN` when the caller has not stat'ed the file (a
/// directory listing); it never counts as a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Stamp(pub u32);

impl Stamp {
    /// Not known.
    pub const UNKNOWN: Stamp = Stamp(0);

    /// From a birth time and `st_mode` (only the type bits count).
    pub fn new(birth_sec: i64, birth_nsec: u32, mode: u32) -> Stamp {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&birth_sec.to_le_bytes());
        b[8..12].copy_from_slice(&birth_nsec.to_le_bytes());
        b[12..].copy_from_slice(&(mode & libc::S_IFMT).to_le_bytes());
        let h = fnv1a(&b, 0x5741_4d50);
        Stamp(((h as u32) ^ ((h >> 32) as u32)).max(1))
    }

    pub(crate) fn differs(self, other: Stamp) -> bool {
        self != Stamp::UNKNOWN && other != Stamp::UNKNOWN && self != other
    }
}

/// The number (and device) presented for a host file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Mapped {
    /// `st_ino` to present.
    pub ino: u64,
    /// `st_dev` to present.
    pub dev: u64,
}

/// Memory limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Entries kept at most (Allocated, Hashed). Past this, released
    /// entries go first, then any (counted as forced evictions: such a file
    /// gets a new number next time).
    pub max_entries: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_entries: 4 << 20,
        }
    }
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Entries held.
    pub entries: usize,
    /// Numbers of reused host inodes, kept out of circulation until
    /// forgotten.
    pub tombstones: usize,
    /// Host inodes found reused (another birth time or type).
    pub reused: u64,
    /// Entries evicted to stay within the limit.
    pub evictions: u64,
    /// Of those, entries still in use.
    pub forced_evictions: u64,
    /// Numbers taken from the fallback range.
    pub fallbacks: u64,
    /// Bytes the tables take (capacity × entry size), an estimate.
    pub bytes: usize,
}

/// One entry: the number given and the stamp of the life it was given to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    pub(crate) out: u64,
    pub(crate) stamp: Stamp,
    pub(crate) live: bool,
}

/// Owner of a hashed number.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    pub(crate) slot: u32,
    pub(crate) ino: u64,
    pub(crate) stamp: Stamp,
}

/// First number of the fallback range.
pub const FALLBACK_BASE: u64 = 1 << 63;

/// Host files to presented numbers. See [`Mode`] for what each mode
/// guarantees.
#[derive(Debug)]
pub struct InodeMap {
    pub(crate) mode: Mode,
    pub(crate) devices: Devices,
    /// Hashed: per slot, the hash of the device identity.
    seeds: IntMap<u32, u64>,
    /// Allocated (and Xino/Hashed fallbacks): per device slot, host ino →
    /// entry.
    pub(crate) entries: IntMap<u32, IntMap<u64, Entry>>,
    /// Hashed: number → owner.
    pub(crate) owners: IntMap<u64, Owner>,
    pub(crate) next: u64,
    pub(crate) next_fallback: u64,
    pub(crate) tombstones: IntMap<u64, ()>,
    pub(crate) released: VecDeque<(u32, u64)>,
    pub(crate) limits: Limits,
    pub(crate) stats: Stats,
}

impl InodeMap {
    /// An empty map. Xino's `bits` is clamped to 1..=20.
    pub fn new(mode: Mode, limits: Limits) -> InodeMap {
        let mode = match mode {
            Mode::Xino { bits, overflow } => Mode::Xino {
                bits: bits.clamp(1, 20),
                overflow,
            },
            m => m,
        };
        let bits = match mode {
            Mode::Xino { bits, .. } => bits,
            _ => 20,
        };
        InodeMap {
            mode,
            devices: Devices::new(bits),
            seeds: IntMap::default(),
            entries: IntMap::default(),
            owners: IntMap::default(),
            next: 2,
            next_fallback: FALLBACK_BASE,
            tombstones: IntMap::default(),
            released: VecDeque::new(),
            limits,
            stats: Stats::default(),
        }
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Makes host device `dev` (its current `st_dev`) known as `identity`.
    /// Call it before mapping files of that device; again after the device
    /// number changed (a reboot), with the same identity.
    pub fn register_device(&mut self, dev: u64, identity: DeviceIdentity) -> Result<u32, Error> {
        self.devices.register(dev, identity)
    }

    /// The devices and their slots.
    pub fn devices(&self) -> &Devices {
        &self.devices
    }

    #[inline]
    fn slot(&self, dev: u64) -> Result<u32, Error> {
        self.devices.index_of(dev).ok_or(Error::UnknownDevice(dev))
    }

    /// The presented device number for Xino and the modes that present
    /// one device.
    pub fn single_dev() -> u64 {
        Devices::virtual_dev((1 << 20) - 1)
    }

    /// The number for a host file. `stamp` tells reused inodes apart
    /// (Allocated, Hashed); `handle` is the file handle Hashed needs for a
    /// file it has not seen (ignored by the other modes).
    #[inline]
    pub fn map(
        &mut self,
        key: FileKey,
        stamp: Stamp,
        handle: Option<&[u8]>,
    ) -> Result<Mapped, Error> {
        let slot = self.slot(key.dev)?;
        match self.mode {
            Mode::Passthrough => Ok(Mapped {
                ino: key.ino,
                dev: Devices::virtual_dev(slot),
            }),
            Mode::Xino { bits, overflow } => {
                let field = 63 - bits;
                if key.ino < (1u64 << field) {
                    return Ok(Mapped {
                        ino: (u64::from(slot) << field) | key.ino,
                        dev: Self::single_dev(),
                    });
                }
                match overflow {
                    Overflow::Fail => Err(Error::Overflow {
                        ino: key.ino,
                        bits: field,
                    }),
                    Overflow::Fallback => Ok(Mapped {
                        ino: self.allocated(slot, key.ino, stamp, true),
                        dev: Self::single_dev(),
                    }),
                }
            }
            Mode::Allocated => Ok(Mapped {
                ino: self.allocated(slot, key.ino, stamp, false),
                dev: Self::single_dev(),
            }),
            Mode::Hashed => Ok(Mapped {
                ino: self.hashed(slot, key.ino, stamp, handle)?,
                dev: Self::single_dev(),
            }),
        }
    }

    pub(crate) fn fresh(&mut self, fallback: bool) -> u64 {
        if fallback {
            self.stats.fallbacks += 1;
            let n = self.next_fallback;
            self.next_fallback += 1;
            n
        } else {
            let n = self.next;
            self.next += 1;
            n
        }
    }

    fn allocated(&mut self, slot: u32, ino: u64, stamp: Stamp, fallback: bool) -> u64 {
        if let Some(e) = self.entries.get_mut(&slot).and_then(|m| m.get_mut(&ino)) {
            if !e.stamp.differs(stamp) {
                // N.B. write only what changes: a hit that dirties its
                // cache line costs a write-back on every lookup.
                if e.stamp == Stamp::UNKNOWN && stamp != Stamp::UNKNOWN {
                    e.stamp = stamp;
                }
                if !e.live {
                    e.live = true;
                }
                return e.out;
            }
            // The host freed this inode and gave it to a new file: the old
            // number stays out of circulation until it is forgotten.
            let old = e.out;
            self.tombstones.insert(old, ());
            self.stats.reused += 1;
        }
        self.make_room();
        let out = self.fresh(fallback);
        self.entries.entry(slot).or_default().insert(
            ino,
            Entry {
                out,
                stamp,
                live: true,
            },
        );
        out
    }

    fn hashed(
        &mut self,
        slot: u32,
        ino: u64,
        stamp: Stamp,
        handle: Option<&[u8]>,
    ) -> Result<u64, Error> {
        // A file that collided lives in the fallback table.
        if let Some(m) = self.entries.get_mut(&slot)
            && let Some(e) = m.get(&ino)
        {
            if !e.stamp.differs(stamp) {
                return Ok(e.out);
            }
            // The fallback number was another life's: it leaves circulation,
            // and must not shadow this life's number on a lookup without a
            // stamp (found by tests/properties.rs).
            let old = e.out;
            m.remove(&ino);
            self.tombstones.insert(old, ());
            self.stats.reused += 1;
        }
        let handle = handle.ok_or(Error::NeedHandle)?;
        let seed = match self.seeds.get(&slot) {
            Some(s) => *s,
            None => {
                let s = self
                    .devices
                    .identity(slot)
                    .map_or(u64::from(slot), |id| fnv1a(id.0.as_bytes(), 0));
                self.seeds.insert(slot, s);
                s
            }
        };
        let mut n = fnv1a(handle, seed) & (FALLBACK_BASE - 1);
        if n < 2 {
            n += 2;
        }
        match self.owners.get_mut(&n) {
            Some(o) if o.slot == slot && o.ino == ino => {
                if o.stamp.differs(stamp) {
                    // Same handle, another life: cannot happen on file
                    // systems whose handles carry a generation; treat the
                    // number as reused.
                    self.stats.reused += 1;
                    self.tombstones.insert(n, ());
                    return Ok(self.allocated(slot, ino, stamp, true));
                }
                if o.stamp == Stamp::UNKNOWN && stamp != Stamp::UNKNOWN {
                    o.stamp = stamp;
                }
                Ok(n)
            }
            Some(_) => Ok(self.allocated(slot, ino, stamp, true)),
            None if self.tombstones.contains_key(&n) => Ok(self.allocated(slot, ino, stamp, true)),
            None => {
                self.make_room();
                self.owners.insert(n, Owner { slot, ino, stamp });
                Ok(n)
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.values().map(HashMap::len).sum::<usize>() + self.owners.len()
    }

    fn make_room(&mut self) {
        if self.len() < self.limits.max_entries {
            return;
        }
        while let Some((slot, ino)) = self.released.pop_front() {
            if let Some(m) = self.entries.get_mut(&slot)
                && m.get(&ino).is_some_and(|e| !e.live)
            {
                m.remove(&ino);
                self.stats.evictions += 1;
                return;
            }
        }
        // Nothing released: drop any entry (its file gets a new number
        // when it is seen again).
        let victim = self
            .entries
            .iter()
            .find_map(|(s, m)| m.keys().next().map(|i| (*s, *i)));
        if let Some((slot, ino)) = victim
            && let Some(m) = self.entries.get_mut(&slot)
        {
            m.remove(&ino);
            self.stats.evictions += 1;
            self.stats.forced_evictions += 1;
        } else if let Some(n) = self.owners.keys().next().copied() {
            self.owners.remove(&n);
            self.stats.evictions += 1;
            self.stats.forced_evictions += 1;
        }
    }

    /// The caller no longer uses the file (a FUSE `forget`): its entry may
    /// be evicted first when the map is full. It keeps its number while it
    /// stays in the map.
    pub fn release(&mut self, key: FileKey) {
        let Ok(slot) = self.slot(key.dev) else { return };
        if let Some(e) = self
            .entries
            .get_mut(&slot)
            .and_then(|m| m.get_mut(&key.ino))
            && e.live
        {
            e.live = false;
            self.released.push_back((slot, key.ino));
            // A file used and released over and over queues itself each
            // time: keep the queue within a constant factor of the map.
            if self.released.len() > 2 * self.len() + 64 {
                self.compact_released();
            }
        }
    }

    /// Drops queued keys that are gone, live again, or queued twice.
    fn compact_released(&mut self) {
        let mut seen = std::collections::HashSet::with_capacity(self.released.len());
        let entries = &self.entries;
        self.released.retain(|(slot, ino)| {
            entries
                .get(slot)
                .and_then(|m| m.get(ino))
                .is_some_and(|e| !e.live)
                && seen.insert((*slot, *ino))
        });
    }

    /// Number `n` (of a reused inode) is no longer referenced anywhere: it
    /// leaves the tombstones.
    pub fn forget_number(&mut self, n: u64) {
        self.tombstones.remove(&n);
    }

    /// Counters, and the memory the tables take.
    pub fn stats(&self) -> Stats {
        let entry = std::mem::size_of::<(u64, Entry)>() + 1;
        let owner = std::mem::size_of::<(u64, Owner)>() + 1;
        let bytes = self
            .entries
            .values()
            .map(|m| m.capacity() * entry)
            .sum::<usize>()
            + self.owners.capacity() * owner
            + self.tombstones.capacity() * (std::mem::size_of::<u64>() + 1);
        Stats {
            entries: self.len(),
            tombstones: self.tombstones.len(),
            bytes,
            ..self.stats
        }
    }

    /// Reserves room for `n` more entries of device `dev` (a bulk load).
    pub fn reserve(&mut self, dev: u64, n: usize) -> Result<(), Error> {
        let slot = self.slot(dev)?;
        match self.mode {
            Mode::Hashed => self.owners.reserve(n),
            Mode::Allocated => self.entries.entry(slot).or_default().reserve(n),
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(mode: Mode) -> InodeMap {
        let mut m = InodeMap::new(mode, Limits::default());
        m.register_device(10, DeviceIdentity::marker("a"))
            .expect("dev");
        m.register_device(20, DeviceIdentity::marker("b"))
            .expect("dev");
        m
    }

    const A: u64 = 10;
    const B: u64 = 20;

    #[test]
    fn passthrough_keeps_numbers_and_separates_devices() {
        let mut m = map(Mode::Passthrough);
        let x = m
            .map(FileKey { dev: A, ino: 7 }, Stamp::UNKNOWN, None)
            .expect("map");
        let y = m
            .map(FileKey { dev: B, ino: 7 }, Stamp::UNKNOWN, None)
            .expect("map");
        assert_eq!((x.ino, y.ino), (7, 7));
        assert_ne!(x.dev, y.dev);
        assert_eq!(m.stats().entries, 0, "no memory per file");
        assert!(
            m.map(FileKey { dev: 99, ino: 1 }, Stamp::UNKNOWN, None)
                .is_err()
        );
    }

    #[test]
    fn xino_packs_devices_and_applies_the_overflow_policy() {
        let mut m = map(Mode::Xino {
            bits: 4,
            overflow: Overflow::Fallback,
        });
        let x = m
            .map(FileKey { dev: A, ino: 7 }, Stamp::UNKNOWN, None)
            .expect("map");
        let y = m
            .map(FileKey { dev: B, ino: 7 }, Stamp::UNKNOWN, None)
            .expect("map");
        assert_ne!(x.ino, y.ino);
        assert_eq!(x.dev, y.dev);
        assert_eq!(x.ino & ((1 << 59) - 1), 7);
        let big = m
            .map(
                FileKey {
                    dev: A,
                    ino: 1 << 60,
                },
                Stamp::UNKNOWN,
                None,
            )
            .expect("map");
        assert!(big.ino >= FALLBACK_BASE);
        assert_eq!(m.stats().fallbacks, 1);
        let mut strict = map(Mode::Xino {
            bits: 4,
            overflow: Overflow::Fail,
        });
        assert!(matches!(
            strict.map(
                FileKey {
                    dev: A,
                    ino: 1 << 60
                },
                Stamp::UNKNOWN,
                None
            ),
            Err(Error::Overflow { .. })
        ));
    }

    #[test]
    fn allocated_gives_a_reused_inode_a_new_number() {
        let mut m = map(Mode::Allocated);
        let k = FileKey { dev: A, ino: 5 };
        let first = m.map(k, Stamp(11), None).expect("map");
        assert_eq!(m.map(k, Stamp(11), None).expect("map"), first);
        assert_eq!(
            m.map(k, Stamp::UNKNOWN, None).expect("map"),
            first,
            "a listing does not stat"
        );
        let again = m.map(k, Stamp(12), None).expect("map");
        assert_ne!(again.ino, first.ino);
        let s = m.stats();
        assert_eq!((s.reused, s.tombstones), (1, 1));
        m.forget_number(first.ino);
        assert_eq!(m.stats().tombstones, 0);
    }

    #[test]
    fn hashed_numbers_come_from_handles_and_collisions_fall_back() {
        let mut m = map(Mode::Hashed);
        let x = m
            .map(FileKey { dev: A, ino: 5 }, Stamp(1), Some(b"handle-5"))
            .expect("map");
        let mut other = map(Mode::Hashed);
        let x2 = other
            .map(FileKey { dev: A, ino: 5 }, Stamp(1), Some(b"handle-5"))
            .expect("map");
        assert_eq!(x, x2, "a function of identity and handle, not of order");
        // Another file whose handle hashes to the same number (here: the
        // same handle bytes) must not share it.
        let y = m
            .map(FileKey { dev: A, ino: 6 }, Stamp(1), Some(b"handle-5"))
            .expect("map");
        assert_ne!(x.ino, y.ino);
        assert!(y.ino >= FALLBACK_BASE);
        assert!(matches!(
            m.map(FileKey { dev: A, ino: 9 }, Stamp(1), None),
            Err(Error::NeedHandle)
        ));
    }

    #[test]
    fn releasing_one_file_over_and_over_keeps_the_queue_bounded() {
        let mut m = map(Mode::Allocated);
        let k = FileKey { dev: A, ino: 5 };
        for _ in 0..10_000 {
            m.map(k, Stamp(1), None).expect("map");
            m.release(k);
            m.release(k);
        }
        assert!(m.released.len() <= 2 + 64 + 1, "{}", m.released.len());
        assert_eq!(m.stats().entries, 1);
    }

    #[test]
    fn the_limit_evicts_released_entries_first() {
        let mut m = InodeMap::new(Mode::Allocated, Limits { max_entries: 3 });
        m.register_device(1, DeviceIdentity::marker("a"))
            .expect("dev");
        let k = |i| FileKey { dev: 1, ino: i };
        for i in 0..3 {
            m.map(k(i), Stamp(1), None).expect("map");
        }
        m.release(k(1));
        m.map(k(3), Stamp(1), None).expect("map");
        let s = m.stats();
        assert_eq!((s.entries, s.evictions, s.forced_evictions), (3, 1, 0));
        m.map(k(4), Stamp(1), None).expect("map");
        assert_eq!(m.stats().forced_evictions, 1);
    }
}
