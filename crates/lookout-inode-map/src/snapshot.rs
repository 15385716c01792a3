//! Snapshot and restore: a versioned, checksummed serde format (postcard)
//! that is checked field by field before it touches a map, and a restore
//! that reports conflicts under a policy instead of panicking.
//!
//! # Format
//!
//! A snapshot file may have been torn by a crash, truncated, or written by
//! someone else: [`Snapshot::load`] bounds what it reads before it
//! allocates, checks the checksum, decodes, then [`Snapshot::validate`]s
//! every field against the mode.
//!
//! | version | layout (integers little-endian) | read by this build |
//! |---|---|---|
//! | 1 | `"LKINOMAP"`, `u32` version, postcard body to the end of the file | yes (no checksum: validated only) |
//! | 2 | `"LKINOMAP"`, `u32` version, `u64` body length, `u32` CRC-32 (ISO-HDLC, as zlib) of the body, postcard body | yes; written |
//!
//! The body is the postcard encoding of [`Snapshot`]: its `version` must
//! equal the header's. Nothing may follow the body.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::device::DeviceSlot;
use crate::map::{Entry, FALLBACK_BASE, InodeMap, Mode, Owner, Stamp};

/// The format version this crate writes. It reads this one and version 1.
pub const SNAPSHOT_VERSION: u32 = 2;

/// The largest snapshot [`Snapshot::load`] and [`Snapshot::read_file`]
/// accept (256 MiB: some 10 million entries). [`Snapshot::load_limited`]
/// takes another bound.
pub const DEFAULT_MAX_SNAPSHOT_BYTES: u64 = 256 << 20;

/// How far the counters may run: 2^62 numbers after their start, so that
/// no sequence of allocations after a restore can overflow them.
pub const MAX_COUNTER_SPAN: u64 = 1 << 62;

/// The longest device identity accepted in a snapshot.
pub const MAX_IDENTITY_LEN: usize = 4096;

const MAGIC: &[u8; 8] = b"LKINOMAP";
const HEADER_V1: usize = 12;
const HEADER_V2: usize = 24;

/// Why a snapshot was refused. Each names the first defect found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The file does not start with the magic bytes.
    #[error("not an inode-map snapshot (bad magic)")]
    BadMagic,
    /// A version this build does not read.
    #[error("snapshot version {0}; this build reads versions 1 and {SNAPSHOT_VERSION}")]
    UnsupportedVersion(u32),
    /// Bigger than the limit (checked before the body is read).
    #[error("the snapshot body is {len} bytes, over the limit of {max}")]
    TooLarge {
        /// Its length, or the limit plus one when only that much was read.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The file ends early.
    #[error("truncated: {got} of {want} bytes of the {part}")]
    Truncated {
        /// Which part (header, body).
        part: &'static str,
        /// Bytes present.
        got: u64,
        /// Bytes expected.
        want: u64,
    },
    /// Bytes after the body.
    #[error("bytes after the body")]
    TrailingBytes,
    /// The body's checksum differs from the header's.
    #[error("checksum mismatch: header {expected:#010x}, body {actual:#010x}")]
    Checksum {
        /// From the header.
        expected: u32,
        /// Of the body read.
        actual: u32,
    },
    /// The body does not decode.
    #[error("corrupt body")]
    Corrupt(#[source] postcard::Error),
    /// The body's version field differs from the header's.
    #[error("the header says version {header}, the body {body}")]
    VersionMismatch {
        /// From the header.
        header: u32,
        /// From the body.
        body: u32,
    },
    /// Xino's slot width outside 1..=20.
    #[error("Xino slot width {0} outside 1..=20")]
    BadBits(u32),
    /// A device slot beyond the mode's slot bits.
    #[error("device slot {slot} does not fit in {bits} bits")]
    SlotOutOfRange {
        /// The slot.
        slot: u32,
        /// The mode's slot bits.
        bits: u32,
    },
    /// Two devices in one slot, or one identity in two slots.
    #[error("device {0} appears twice")]
    DuplicateDevice(String),
    /// A device identity longer than [`MAX_IDENTITY_LEN`].
    #[error("a device identity of {0} bytes")]
    IdentityTooLong(usize),
    /// An entry of a slot no device has.
    #[error("an entry of slot {0}, which has no device")]
    UnknownSlot(u32),
    /// A number the map never hands out (0 and 1).
    #[error("reserved number {0}")]
    ReservedNumber(u64),
    /// A number given to two files.
    #[error("number {0} is given twice")]
    DuplicateNumber(u64),
    /// One host file with two entries.
    #[error("inode {ino} of slot {slot} has two entries")]
    DuplicateFile {
        /// The slot.
        slot: u32,
        /// The host inode.
        ino: u64,
    },
    /// A number outside the range its mode and table allow (for example
    /// at or beyond the counter that hands them out).
    #[error("number {number} outside {lo}..{hi} ({what})")]
    NumberOutOfRange {
        /// The number.
        number: u64,
        /// The lowest allowed.
        lo: u64,
        /// One past the highest allowed.
        hi: u64,
        /// Which table.
        what: &'static str,
    },
    /// A counter outside its range.
    #[error("counter {what} = {value} outside {lo}..={hi}")]
    CounterOutOfRange {
        /// Which counter.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The lowest allowed.
        lo: u64,
        /// The highest allowed.
        hi: u64,
    },
    /// Entries in a table the mode never fills.
    #[error("a {mode:?} map has no {what}")]
    UnexpectedTable {
        /// The mode.
        mode: Mode,
        /// The table.
        what: &'static str,
    },
    /// The snapshot is of another mode than the map.
    #[error("the snapshot is of a {snapshot:?} map, this one is {map:?}")]
    ModeMismatch {
        /// The snapshot's.
        snapshot: Mode,
        /// The map's.
        map: Mode,
    },
    /// Restoring would take the map past [`crate::Limits::max_entries`].
    #[error("{entries} entries (the map's and the snapshot's) exceed the limit of {max}")]
    OverLimit {
        /// The map's entries plus the snapshot's.
        entries: usize,
        /// The limit.
        max: usize,
    },
}

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
    /// The format version (the header's).
    pub version: u32,
    /// The mode of the map.
    pub mode: Mode,
    /// Device identities and their slots.
    pub devices: Vec<DeviceSlot>,
    /// The allocation counter: the next number handed out (Allocated).
    pub next: u64,
    /// The fallback counter (Xino, Hashed).
    pub next_fallback: u64,
    /// Allocated entries (and Xino/Hashed fallbacks).
    pub entries: Vec<SavedEntry>,
    /// Hashed numbers and their owners.
    pub hashed: Vec<SavedEntry>,
    /// Numbers of reused inodes still out of circulation.
    pub tombstones: Vec<u64>,
}

fn io_or_truncated(e: std::io::Error, part: &'static str, want: u64) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        // read_exact does not say how much it got; the caller that can
        // tell uses read_up_to instead.
        SnapshotError::Truncated { part, got: 0, want }.into()
    } else {
        Error::SnapshotIo(e)
    }
}

/// Reads up to `n` bytes (fewer only at the end of the stream).
fn read_up_to(r: &mut impl Read, n: u64) -> Result<Vec<u8>, Error> {
    let mut buf = Vec::new();
    r.take(n).read_to_end(&mut buf).map_err(Error::SnapshotIo)?;
    Ok(buf)
}

impl Snapshot {
    /// Writes the snapshot in the current format (version
    /// [`SNAPSHOT_VERSION`] in the header, whatever `self.version` says).
    pub fn save(&self, mut w: impl Write) -> Result<(), Error> {
        let mut s = std::borrow::Cow::Borrowed(self);
        if s.version != SNAPSHOT_VERSION {
            s.to_mut().version = SNAPSHOT_VERSION;
        }
        let body =
            postcard::to_stdvec(&*s).map_err(|e| Error::Snapshot(SnapshotError::Corrupt(e)))?;
        let mut head = [0u8; HEADER_V2];
        head[..8].copy_from_slice(MAGIC);
        head[8..12].copy_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        head[12..20].copy_from_slice(&(body.len() as u64).to_le_bytes());
        head[20..24].copy_from_slice(&crc32fast::hash(&body).to_le_bytes());
        w.write_all(&head).map_err(Error::SnapshotIo)?;
        w.write_all(&body).map_err(Error::SnapshotIo)?;
        Ok(())
    }

    /// Reads a snapshot of at most [`DEFAULT_MAX_SNAPSHOT_BYTES`]; see
    /// [`Snapshot::load_limited`].
    pub fn load(r: impl Read) -> Result<Snapshot, Error> {
        Snapshot::load_limited(r, DEFAULT_MAX_SNAPSHOT_BYTES)
    }

    /// Reads a snapshot written by [`Snapshot::save`] (or by version 1 of
    /// this crate) whose body is at most `max_bytes`. The size is checked
    /// before the body is read, the checksum before it is decoded, and
    /// the decoded snapshot is [validated](Snapshot::validate): anything
    /// else is a [`SnapshotError`], never a guess.
    pub fn load_limited(mut r: impl Read, max_bytes: u64) -> Result<Snapshot, Error> {
        let head = read_up_to(&mut r, HEADER_V1 as u64)?;
        if head.len() >= MAGIC.len() && &head[..8] != MAGIC
            || head.len() < MAGIC.len() && !MAGIC.starts_with(&head)
        {
            return Err(SnapshotError::BadMagic.into());
        }
        if head.len() < HEADER_V1 {
            return Err(SnapshotError::Truncated {
                part: "header",
                got: head.len() as u64,
                want: HEADER_V1 as u64,
            }
            .into());
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        let body = match version {
            1 => {
                // No length in the header: read one byte past the limit to
                // tell "at the limit" from "over it".
                let body = read_up_to(&mut r, max_bytes.saturating_add(1))?;
                if body.len() as u64 > max_bytes {
                    return Err(SnapshotError::TooLarge {
                        len: body.len() as u64,
                        max: max_bytes,
                    }
                    .into());
                }
                body
            }
            2 => {
                let rest = HEADER_V2 - HEADER_V1;
                let more = read_up_to(&mut r, rest as u64)?;
                if more.len() < rest {
                    return Err(SnapshotError::Truncated {
                        part: "header",
                        got: (HEADER_V1 + more.len()) as u64,
                        want: HEADER_V2 as u64,
                    }
                    .into());
                }
                let mut len = [0u8; 8];
                len.copy_from_slice(&more[..8]);
                let len = u64::from_le_bytes(len);
                let crc = u32::from_le_bytes([more[8], more[9], more[10], more[11]]);
                if len > max_bytes {
                    return Err(SnapshotError::TooLarge {
                        len,
                        max: max_bytes,
                    }
                    .into());
                }
                let body = read_up_to(&mut r, len)?;
                if (body.len() as u64) < len {
                    return Err(SnapshotError::Truncated {
                        part: "body",
                        got: body.len() as u64,
                        want: len,
                    }
                    .into());
                }
                let mut probe = [0u8; 1];
                match r.read(&mut probe) {
                    Ok(0) => {}
                    Ok(_) => return Err(SnapshotError::TrailingBytes.into()),
                    Err(e) => return Err(io_or_truncated(e, "body", len)),
                }
                let actual = crc32fast::hash(&body);
                if actual != crc {
                    return Err(SnapshotError::Checksum {
                        expected: crc,
                        actual,
                    }
                    .into());
                }
                body
            }
            v => return Err(SnapshotError::UnsupportedVersion(v).into()),
        };
        let (s, rest): (Snapshot, &[u8]) = postcard::take_from_bytes(&body)
            .map_err(|e| Error::Snapshot(SnapshotError::Corrupt(e)))?;
        if !rest.is_empty() {
            return Err(SnapshotError::TrailingBytes.into());
        }
        if s.version != version {
            return Err(SnapshotError::VersionMismatch {
                header: version,
                body: s.version,
            }
            .into());
        }
        s.validate()?;
        Ok(s)
    }

    /// Writes the snapshot to `path` atomically: into a new file (created
    /// `O_EXCL | O_NOFOLLOW`, mode 0600) in the same directory, flushed
    /// with `fsync`, then renamed over `path`, and the directory synced.
    /// A crash leaves the old snapshot or the new one, never a torn file;
    /// a symlink planted at `path` is replaced, not followed. (The
    /// directory itself is trusted: keep it root's.)
    pub fn write_file(&self, path: &Path) -> Result<(), Error> {
        use std::os::unix::fs::OpenOptionsExt;
        let io = |source: std::io::Error| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let name = path
            .file_name()
            .ok_or_else(|| io(std::io::Error::other("the path has no file name")))?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{}.{nanos}.tmp", std::process::id()));
        let tmp = dir.join(tmp_name);
        let written = (|| -> Result<(), Error> {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&tmp)
                .map_err(io)?;
            let mut w = std::io::BufWriter::new(file);
            self.save(&mut w)?;
            let file = w.into_inner().map_err(|e| io(e.into_error()))?;
            file.sync_all().map_err(io)?;
            std::fs::rename(&tmp, path).map_err(io)?;
            Ok(())
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
            return written;
        }
        // The rename is durable once the directory is.
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io)
    }

    /// Reads a snapshot file written by [`Snapshot::write_file`]: opened
    /// `O_NOFOLLOW | O_NONBLOCK` (a symlink or a FIFO planted there is
    /// refused, not followed or waited on), a regular file of at most
    /// [`DEFAULT_MAX_SNAPSHOT_BYTES`] plus its header.
    pub fn read_file(path: &Path) -> Result<Snapshot, Error> {
        use std::os::unix::fs::OpenOptionsExt;
        let io = |source: std::io::Error| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::other("not a regular file")));
        }
        let max = DEFAULT_MAX_SNAPSHOT_BYTES;
        if meta.len() > max + HEADER_V2 as u64 {
            return Err(SnapshotError::TooLarge {
                len: meta.len(),
                max,
            }
            .into());
        }
        Snapshot::load_limited(std::io::BufReader::new(file), max)
    }

    /// Checks every field against the mode: slot widths and ranges, that
    /// numbers are neither reserved (0, 1) nor given twice nor at or past
    /// the counter that hands them out, that each table is one the mode
    /// fills, and that the counters leave room ([`MAX_COUNTER_SPAN`]).
    /// O(n log n) in the number of entries.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        let bits = match self.mode {
            Mode::Xino { bits, .. } if !(1..=20).contains(&bits) => {
                return Err(SnapshotError::BadBits(bits));
            }
            Mode::Xino { bits, .. } => bits,
            _ => 20,
        };
        let counter = |what, value, lo, hi| {
            if (lo..=hi).contains(&value) {
                Ok(())
            } else {
                Err(SnapshotError::CounterOutOfRange {
                    what,
                    value,
                    lo,
                    hi,
                })
            }
        };
        counter("next", self.next, 2, 2 + MAX_COUNTER_SPAN)?;
        counter(
            "next_fallback",
            self.next_fallback,
            FALLBACK_BASE,
            FALLBACK_BASE + MAX_COUNTER_SPAN,
        )?;

        let mut slots: Vec<u32> = Vec::with_capacity(self.devices.len());
        let mut ids: Vec<&str> = Vec::with_capacity(self.devices.len());
        for d in &self.devices {
            if u64::from(d.index) >= 1u64 << bits {
                return Err(SnapshotError::SlotOutOfRange {
                    slot: d.index,
                    bits,
                });
            }
            if d.identity.0.len() > MAX_IDENTITY_LEN {
                return Err(SnapshotError::IdentityTooLong(d.identity.0.len()));
            }
            slots.push(d.index);
            ids.push(&d.identity.0);
        }
        slots.sort_unstable();
        if let Some(w) = slots.windows(2).find(|w| w[0] == w[1]) {
            return Err(SnapshotError::DuplicateDevice(format!("slot {}", w[0])));
        }
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(SnapshotError::DuplicateDevice(w[0].to_string()));
        }

        let empty = |v: &[SavedEntry], what| {
            if v.is_empty() {
                Ok(())
            } else {
                Err(SnapshotError::UnexpectedTable {
                    mode: self.mode,
                    what,
                })
            }
        };
        // Which numbers each table may hold.
        let fallback = (FALLBACK_BASE, self.next_fallback);
        let (entry_range, hashed_range) = match self.mode {
            Mode::Passthrough => {
                empty(&self.entries, "entries")?;
                empty(&self.hashed, "hashed numbers")?;
                if !self.tombstones.is_empty() {
                    return Err(SnapshotError::UnexpectedTable {
                        mode: self.mode,
                        what: "tombstones",
                    });
                }
                ((0, 0), (0, 0))
            }
            Mode::Xino { .. } => {
                empty(&self.hashed, "hashed numbers")?;
                (fallback, (0, 0))
            }
            Mode::Allocated => {
                empty(&self.hashed, "hashed numbers")?;
                ((2, self.next), (0, 0))
            }
            Mode::Hashed => (fallback, (2, FALLBACK_BASE)),
        };
        let check = |e: &SavedEntry, (lo, hi): (u64, u64), what| {
            if e.out < 2 {
                return Err(SnapshotError::ReservedNumber(e.out));
            }
            if slots.binary_search(&e.slot).is_err() {
                return Err(SnapshotError::UnknownSlot(e.slot));
            }
            if !(lo..hi).contains(&e.out) {
                return Err(SnapshotError::NumberOutOfRange {
                    number: e.out,
                    lo,
                    hi,
                    what,
                });
            }
            Ok(())
        };
        for e in &self.entries {
            check(e, entry_range, "entries")?;
        }
        for e in &self.hashed {
            check(e, hashed_range, "hashed numbers")?;
        }
        if let Some(t) = self.tombstones.iter().find(|t| **t < 2) {
            return Err(SnapshotError::ReservedNumber(*t));
        }

        let mut files: Vec<(u32, u64)> = self.entries.iter().map(|e| (e.slot, e.ino)).collect();
        files.sort_unstable();
        if let Some(w) = files.windows(2).find(|w| w[0] == w[1]) {
            return Err(SnapshotError::DuplicateFile {
                slot: w[0].0,
                ino: w[0].1,
            });
        }
        drop(files);
        let mut numbers: Vec<u64> = self
            .entries
            .iter()
            .chain(&self.hashed)
            .map(|e| e.out)
            .collect();
        numbers.sort_unstable();
        if let Some(w) = numbers.windows(2).find(|w| w[0] == w[1]) {
            return Err(SnapshotError::DuplicateNumber(w[0]));
        }
        Ok(())
    }
}

/// What to do when a snapshot disagrees with the map it is restored into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictPolicy {
    /// Stop at the first conflict with [`Error::Conflict`]; the map is left
    /// as it was before the restore (everything is checked first).
    Fail,
    /// Keep what the map has; a saved file whose number is taken gets a
    /// fresh one. Reported.
    Remap,
    /// The snapshot wins: its numbers replace the map's. Reported.
    Trust,
}

/// The outcome of a restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RestoreReport {
    /// Entries restored with their saved numbers.
    pub restored: usize,
    /// Entries that got a fresh number or kept the map's (Remap).
    pub remapped: usize,
    /// Entries of the map replaced by the snapshot's (Trust).
    pub replaced: usize,
    /// Entries of a device slot that holds another device here: not
    /// restored (their files get new numbers when seen).
    pub skipped: usize,
    /// The first conflicts, described.
    pub conflicts: Vec<String>,
}

const MAX_REPORTED: usize = 32;

impl RestoreReport {
    fn note(&mut self, what: String) {
        if self.conflicts.len() < MAX_REPORTED {
            self.conflicts.push(what);
        }
    }
}

/// Who holds a number in a map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// An entry (Allocated, fallbacks): slot, host inode.
    Entry(u32, u64),
    /// A hashed number's owner: slot, host inode.
    Owner(u32, u64),
}

type Taken = HashMap<u64, Holder, std::hash::BuildHasherDefault<crate::IntHasher>>;
type Owned = HashMap<(u32, u64), u64>;

impl InodeMap {
    /// A snapshot of everything the map knows, in a canonical order (the
    /// same map gives the same bytes).
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
        entries.sort_unstable_by_key(|e| (e.slot, e.ino));
        let mut hashed: Vec<SavedEntry> = self
            .owners
            .iter()
            .map(|(n, o)| SavedEntry {
                slot: o.slot,
                ino: o.ino,
                stamp: o.stamp,
                out: *n,
            })
            .collect();
        hashed.sort_unstable_by_key(|e| e.out);
        let mut tombstones: Vec<u64> = self.tombstones.keys().copied().collect();
        tombstones.sort_unstable();
        Snapshot {
            version: SNAPSHOT_VERSION,
            mode: self.mode,
            devices: self.devices.slots(),
            next: self.next,
            next_fallback: self.next_fallback,
            entries,
            hashed,
            tombstones,
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
    ///
    /// The snapshot is [validated](Snapshot::validate) first, and the
    /// map's entries plus the snapshot's must fit in
    /// [`crate::Limits::max_entries`]; either failing is an error that
    /// changes nothing, whatever the policy. So does any conflict under
    /// [`ConflictPolicy::Fail`]. O(n) in the entries of both.
    pub fn restore(
        &mut self,
        s: &Snapshot,
        policy: ConflictPolicy,
    ) -> Result<RestoreReport, Error> {
        s.validate()?;
        if s.mode != self.mode {
            return Err(SnapshotError::ModeMismatch {
                snapshot: s.mode,
                map: self.mode,
            }
            .into());
        }
        let entries = self.len() + s.entries.len() + s.hashed.len();
        if entries > self.limits.max_entries {
            return Err(SnapshotError::OverLimit {
                entries,
                max: self.limits.max_entries,
            }
            .into());
        }
        let mut report = RestoreReport::default();
        // The numbers this map has handed out already, and to whom (none
        // when restoring into an empty map, the common case).
        let mut taken = Taken::default();
        for (slot, m) in &self.entries {
            for (ino, e) in m {
                taken.insert(e.out, Holder::Entry(*slot, *ino));
            }
        }
        // Hashed: the files that own a hashed number here. A saved fallback
        // entry for one of them would take precedence over its number.
        let mut owned = Owned::default();
        for (n, o) in &self.owners {
            taken.insert(*n, Holder::Owner(o.slot, o.ino));
            owned.insert((o.slot, o.ino), *n);
        }
        let mut bad_slots = Vec::new();
        for d in &s.devices {
            if let Some(what) = self.devices.pin_conflict(&d.identity, d.index) {
                if policy == ConflictPolicy::Fail {
                    return Err(Error::Conflict(what));
                }
                report.note(what);
                bad_slots.push(d.index);
            }
        }
        if policy == ConflictPolicy::Fail {
            // Every conflict is found before anything changes.
            for e in &s.entries {
                if let Some(what) = self.entry_conflict(e, &taken, &owned) {
                    return Err(Error::Conflict(what));
                }
            }
            for e in &s.hashed {
                if let Some(what) = self.hashed_conflict(e, &taken) {
                    return Err(Error::Conflict(what));
                }
            }
        }
        // From here on nothing fails.
        for d in &s.devices {
            if !bad_slots.contains(&d.index) {
                // Checked above (and the snapshot's devices are distinct).
                let _ = self.devices.pin(d.identity.clone(), d.index);
            }
        }
        // Fresh numbers for remapped files come after both maps' ranges, so
        // they cannot collide with numbers still to be restored.
        self.next = self.next.max(s.next);
        self.next_fallback = self.next_fallback.max(s.next_fallback);
        let fallback = self.mode != Mode::Allocated;
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
            if bad_slots.contains(&e.slot) {
                report.skipped += 1;
                continue;
            }
            let here = self.number_of(e.slot, e.ino);
            if here == Some(e.out) {
                // Already so (a snapshot of this very map): the map's
                // stamp and use are newer.
                report.restored += 1;
                continue;
            }
            if let Some(what) = self.entry_conflict(e, &taken, &owned) {
                report.note(what);
                if policy == ConflictPolicy::Trust {
                    if let Some(h) = here {
                        // The file's number here leaves circulation.
                        taken.remove(&h);
                        self.tombstones.insert(h, ());
                    }
                    if let Some(holder) = taken.get(&e.out).copied() {
                        self.evict(holder, e.out);
                    }
                    report.replaced += 1;
                } else {
                    if here.is_none() && !owned.contains_key(&(e.slot, e.ino)) {
                        let out = self.fresh(fallback);
                        self.insert_entry(e.slot, e.ino, e.stamp, out);
                        taken.insert(out, Holder::Entry(e.slot, e.ino));
                    }
                    report.remapped += 1;
                    continue;
                }
            }
            self.insert_entry(e.slot, e.ino, e.stamp, e.out);
            taken.insert(e.out, Holder::Entry(e.slot, e.ino));
            report.restored += 1;
        }
        self.owners.reserve(s.hashed.len());
        for e in &s.hashed {
            if bad_slots.contains(&e.slot) {
                report.skipped += 1;
                continue;
            }
            if taken.get(&e.out) == Some(&Holder::Owner(e.slot, e.ino)) {
                // Already so: the map's stamp is newer.
                report.restored += 1;
                continue;
            }
            if let Some(what) = self.hashed_conflict(e, &taken) {
                report.note(what);
                if policy != ConflictPolicy::Trust {
                    // The map's number stays (or the file gets a fallback
                    // number when it is seen).
                    report.remapped += 1;
                    continue;
                }
                let holder = taken.get(&e.out).copied();
                let shadow = match holder {
                    Some(h) if h == Holder::Owner(e.slot, e.ino) => None,
                    _ => self.shadowing(e),
                };
                if let Some(holder) = holder
                    && holder != Holder::Owner(e.slot, e.ino)
                {
                    self.evict(holder, e.out);
                }
                if let Some(f) = shadow {
                    // Its fallback number leaves circulation.
                    self.evict(Holder::Entry(e.slot, e.ino), f);
                    taken.remove(&f);
                    self.tombstones.insert(f, ());
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
            taken.insert(e.out, Holder::Owner(e.slot, e.ino));
            report.restored += 1;
        }
        for t in &s.tombstones {
            self.tombstones.insert(*t, ());
        }
        Ok(report)
    }

    fn number_of(&self, slot: u32, ino: u64) -> Option<u64> {
        self.entries.get(&slot)?.get(&ino).map(|x| x.out)
    }

    /// Why saved entry `e` cannot simply be restored here, if it cannot.
    fn entry_conflict(&self, e: &SavedEntry, taken: &Taken, owned: &Owned) -> Option<String> {
        match self.number_of(e.slot, e.ino) {
            Some(h) if h != e.out => {
                return Some(format!(
                    "inode {} of slot {} has number {h} here, {} in the snapshot",
                    e.ino, e.slot, e.out
                ));
            }
            Some(_) => {}
            None => {
                if let Some(n) = owned.get(&(e.slot, e.ino)) {
                    return Some(format!(
                        "inode {} of slot {} has hashed number {n} here, fallback {} in the snapshot",
                        e.ino, e.slot, e.out
                    ));
                }
            }
        }
        match taken.get(&e.out) {
            Some(h) if *h != Holder::Entry(e.slot, e.ino) => Some(format!(
                "number {} is taken here; the snapshot gives it to inode {} of slot {}",
                e.out, e.ino, e.slot
            )),
            _ => None,
        }
    }

    /// Why saved hashed number `e` cannot simply be restored here, if it
    /// cannot: another file holds it, or the file has a fallback number
    /// here for the same life, which would shadow it.
    fn hashed_conflict(&self, e: &SavedEntry, taken: &Taken) -> Option<String> {
        match taken.get(&e.out) {
            Some(h) if *h != Holder::Owner(e.slot, e.ino) => {
                return Some(format!(
                    "hashed number {} belongs to another file here",
                    e.out
                ));
            }
            // Already so: whatever else the map has for the file, it had
            // it before.
            Some(_) => return None,
            None => {}
        }
        self.shadowing(e).map(|f| {
            format!(
                "inode {} of slot {} has fallback number {f} here, hashed {} in the snapshot",
                e.ino, e.slot, e.out
            )
        })
    }

    /// The fallback number the map has for the file of saved hashed
    /// number `e`, in the same life.
    fn shadowing(&self, e: &SavedEntry) -> Option<u64> {
        let x = self.entries.get(&e.slot)?.get(&e.ino)?;
        (!x.stamp.differs(e.stamp)).then_some(x.out)
    }

    fn insert_entry(&mut self, slot: u32, ino: u64, stamp: Stamp, out: u64) {
        self.entries.entry(slot).or_default().insert(
            ino,
            Entry {
                out,
                stamp,
                live: false,
            },
        );
        // Not in use until it is seen again: evicted first under pressure.
        self.released.push_back((slot, ino));
    }

    /// Takes number `n` away from its holder here.
    fn evict(&mut self, holder: Holder, n: u64) {
        match holder {
            Holder::Entry(slot, ino) => {
                if let Some(m) = self.entries.get_mut(&slot)
                    && m.get(&ino).is_some_and(|x| x.out == n)
                {
                    m.remove(&ino);
                }
            }
            Holder::Owner(..) => {
                self.owners.remove(&n);
            }
        }
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
            Err(Error::Snapshot(SnapshotError::BadMagic))
        ));
        let mut bytes = Vec::new();
        filled(Mode::Allocated)
            .snapshot()
            .save(&mut bytes)
            .expect("save");
        bytes[8] = 9;
        assert!(matches!(
            Snapshot::load(&bytes[..]),
            Err(Error::Snapshot(SnapshotError::UnsupportedVersion(9)))
        ));
        bytes[8] = 2;
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
