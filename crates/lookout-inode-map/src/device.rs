//! Stable identities for host file systems, and the virtual device numbers
//! and indexes derived from them.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::Error;

/// What identifies a host file system across reboots and device
/// renumbering, as text: `uuid:<uuid>`, `fsid:<type>:<hex>`, `mnt:<id>`,
/// `marker:<caller's>` or, as a last resort, `dev:<major>:<minor>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceIdentity(pub String);

impl DeviceIdentity {
    /// A caller's own name for a file system (a volume name, a mount's
    /// configured id). Survives whatever the caller makes it survive.
    pub fn marker(name: &str) -> DeviceIdentity {
        DeviceIdentity(format!("marker:{name}"))
    }

    /// Whether the identity survives a reboot (UUID, fsid of a disk file
    /// system, marker) or only this boot (mount id, raw device number).
    pub fn is_persistent(&self) -> bool {
        self.0.starts_with("uuid:")
            || self.0.starts_with("marker:")
            || self.0.starts_with("fsid:disk:")
    }
}

impl std::fmt::Display for DeviceIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// File systems whose `statfs` fsid is derived from their UUID (so it is
/// stable across reboots): ext2/3/4, XFS, btrfs, F2FS.
const DISK_MAGICS: &[i64] = &[0xEF53, 0x5846_5342, 0x9123_683E, 0xF2F5_2010];

/// The identity of the file system holding `path`, and its current
/// `st_dev`. Tries, in order: the UUID under `/dev/disk/by-uuid` whose
/// block device is `st_dev`; the `statfs` fsid (stable for disk file
/// systems, which derive it from their UUID); the mount id; the device
/// number.
pub fn probe_device(path: &Path) -> Result<(u64, DeviceIdentity), Error> {
    let io = |source: std::io::Error| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    let dev = std::os::unix::fs::MetadataExt::dev(&meta);
    if let Ok(entries) = std::fs::read_dir("/dev/disk/by-uuid") {
        for e in entries.flatten() {
            if let Ok(m) = std::fs::metadata(e.path())
                && std::os::unix::fs::MetadataExt::rdev(&m) == dev
            {
                return Ok((
                    dev,
                    DeviceIdentity(format!("uuid:{}", e.file_name().to_string_lossy())),
                ));
            }
        }
    }
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| io(e.into()))?;
    // SAFETY: an all-zero statfs is a valid value for the kernel to fill.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is a valid out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io(std::io::Error::last_os_error()));
    }
    // SAFETY: fsid_t is two ints; reading them as such is fine.
    let fsid: [i32; 2] = unsafe { std::mem::transmute(st.f_fsid) };
    let magic = st.f_type as i64;
    if fsid != [0, 0] {
        let class = if DISK_MAGICS.contains(&magic) {
            "disk"
        } else {
            "other"
        };
        return Ok((
            dev,
            DeviceIdentity(format!(
                "fsid:{class}:{magic:x}:{:08x}{:08x}",
                fsid[0] as u32, fsid[1] as u32
            )),
        ));
    }
    if let Some(mnt) = mount_id(&c) {
        return Ok((dev, DeviceIdentity(format!("mnt:{mnt}"))));
    }
    Ok((
        dev,
        DeviceIdentity(format!("dev:{}:{}", libc::major(dev), libc::minor(dev))),
    ))
}

fn mount_id(path: &CString) -> Option<u64> {
    // SAFETY: an all-zero statx is a valid value for the kernel to fill.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated, `stx` a valid out-pointer.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_STATX_SYNC_AS_STAT,
            libc::STATX_MNT_ID,
            &mut stx,
        )
    };
    (rc == 0 && stx.stx_mask & libc::STATX_MNT_ID != 0).then_some(stx.stx_mnt_id)
}

/// A registered device: its index (Xino's high bits) and the virtual
/// device number presented for it (Passthrough's `st_dev`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSlot {
    /// Its identity.
    pub identity: DeviceIdentity,
    /// Index in `0..2^bits`.
    pub index: u32,
}

/// Device identities and the slots derived from them.
///
/// A slot comes from a hash of the identity (FNV-1a), so the same file
/// system gets the same index and virtual device number in every process
/// and after every reboot, whatever order devices are met in. Two
/// identities that hash to the same slot are resolved by probing to the
/// next free one, which depends on who came first: the snapshot records
/// every assignment, so a restore reproduces it.
#[derive(Debug, Clone, Default)]
pub struct Devices {
    bits: u32,
    /// `st_dev` → slot: a handful of devices, so a scan (1-2 ns) beats
    /// hashing (SipHash cost 25 ns per lookup on the hot path).
    by_dev: Vec<(u64, u32)>,
    by_identity: HashMap<DeviceIdentity, u32>,
    slots: HashMap<u32, DeviceIdentity>,
}

/// The major number of the virtual devices Passthrough presents (one of
/// the "local/experimental use" majors of devices.txt).
pub const VIRTUAL_MAJOR: u32 = 240;

pub(crate) fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Devices {
    /// Slots in `0..2^bits` (`bits` ≤ 20, the width of a minor number).
    pub fn new(bits: u32) -> Devices {
        Devices {
            bits: bits.min(20),
            ..Devices::default()
        }
    }

    /// The slot of `identity`, now also known as `st_dev` `dev`.
    pub fn register(&mut self, dev: u64, identity: DeviceIdentity) -> Result<u32, Error> {
        let index = match self.by_identity.get(&identity) {
            Some(i) => *i,
            None => self.place(&identity)?,
        };
        self.by_dev.retain(|(d, _)| *d != dev);
        self.by_dev.push((dev, index));
        Ok(index)
    }

    /// The slot width.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// Puts `identity` in a given slot (a restore).
    pub(crate) fn pin(&mut self, identity: DeviceIdentity, index: u32) -> Result<(), Error> {
        self.pin_conflict(&identity, index)
            .map_or(Ok(()), |c| Err(Error::Conflict(c)))?;
        self.slots.insert(index, identity.clone());
        self.by_identity.insert(identity, index);
        Ok(())
    }

    /// Why `identity` cannot be pinned to `index`, if it cannot.
    pub(crate) fn pin_conflict(&self, identity: &DeviceIdentity, index: u32) -> Option<String> {
        if u64::from(index) >= 1u64 << self.bits {
            return Some(format!(
                "device slot {index} does not fit in {} bits",
                self.bits
            ));
        }
        match (self.slots.get(&index), self.by_identity.get(identity)) {
            (Some(other), _) if other != identity => Some(format!(
                "device slot {index} belongs to {other}, the snapshot gives it to {identity}"
            )),
            (_, Some(at)) if *at != index => Some(format!(
                "{identity} has slot {at} here, slot {index} in the snapshot"
            )),
            _ => None,
        }
    }

    fn place(&mut self, identity: &DeviceIdentity) -> Result<u32, Error> {
        let size = 1u64 << self.bits;
        if self.slots.len() as u64 >= size {
            return Err(Error::DevicesFull {
                bits: self.bits,
                identity: identity.clone(),
            });
        }
        let mut index = (fnv1a(identity.0.as_bytes(), 0) % size) as u32;
        while self.slots.contains_key(&index) {
            index = ((u64::from(index) + 1) % size) as u32;
        }
        self.slots.insert(index, identity.clone());
        self.by_identity.insert(identity.clone(), index);
        Ok(index)
    }

    /// The slot of a host `st_dev` registered before.
    #[inline]
    pub fn index_of(&self, dev: u64) -> Option<u32> {
        self.by_dev.iter().find(|(d, _)| *d == dev).map(|(_, i)| *i)
    }

    /// The virtual `st_dev` of slot `index`: `makedev(240, index)`.
    pub fn virtual_dev(index: u32) -> u64 {
        libc::makedev(VIRTUAL_MAJOR, index)
    }

    /// Every assignment, for a snapshot.
    pub fn slots(&self) -> Vec<DeviceSlot> {
        let mut v: Vec<DeviceSlot> = self
            .slots
            .iter()
            .map(|(i, id)| DeviceSlot {
                identity: id.clone(),
                index: *i,
            })
            .collect();
        v.sort_by_key(|s| s.index);
        v
    }

    /// The identity in slot `index`.
    pub fn identity(&self, index: u32) -> Option<&DeviceIdentity> {
        self.slots.get(&index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_depend_on_the_identity_not_on_the_order() {
        let ids: Vec<DeviceIdentity> = (0..6)
            .map(|i| DeviceIdentity::marker(&format!("vol{i}")))
            .collect();
        let mut a = Devices::new(8);
        let mut b = Devices::new(8);
        let ia: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(n, id)| a.register(n as u64, id.clone()).expect("slot"))
            .collect();
        let mut ib: Vec<u32> = ids
            .iter()
            .enumerate()
            .rev()
            .map(|(n, id)| b.register(100 + n as u64, id.clone()).expect("slot"))
            .collect();
        ib.reverse();
        assert_eq!(
            ia, ib,
            "same identities, same slots, whatever the order and st_dev"
        );
        assert_eq!(a.index_of(3), Some(ia[3]));
        assert!(a.index_of(99).is_none());
    }

    #[test]
    fn a_full_table_is_an_error_not_a_panic() {
        let mut d = Devices::new(1);
        d.register(1, DeviceIdentity::marker("a")).expect("slot");
        d.register(2, DeviceIdentity::marker("b")).expect("slot");
        assert!(matches!(
            d.register(3, DeviceIdentity::marker("c")),
            Err(Error::DevicesFull { .. })
        ));
    }

    #[test]
    fn probing_a_real_file_system_gives_a_stable_identity() {
        let (dev, id) = probe_device(Path::new("/")).expect("probe /");
        let (dev2, id2) = probe_device(Path::new("/")).expect("probe / again");
        assert_eq!((dev, &id), (dev2, &id2));
        assert!(!id.0.is_empty());
        let (_, proc_id) = probe_device(Path::new("/proc")).expect("probe /proc");
        assert_ne!(id, proc_id, "two file systems, two identities");
    }
}
