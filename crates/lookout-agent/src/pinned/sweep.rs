//! Removes entries that no live container of this agent holds and whose
//! container is gone: those an earlier agent wrote for containers that
//! ended while no agent ran, or that a surge's other agent left.
//!
//! Gone is the kernel's word, not this agent's: a cgroup id that names no
//! cgroup any more (asked by file handle; the kernel never gives an id
//! twice), or, for a mount namespace entry without a cgroup id, no process
//! in that mount namespace and the entry's pid namespace. An entry of a container this agent has not
//! found (yet) stays: a tracer's map never loses a live container.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use lookout_ebpf_common::ContainerEntry;

use super::{Maps, Pinned, Which};

/// How often the sweep runs after the first, at `ready`.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(30);
/// Entries removed in one pass at most (the rest, in the next ones).
const MAX_REMOVALS_PER_PASS: usize = 512;

/// The sweep: its own handle on the maps (reads need no lock), the
/// writer's state (through which it removes), the cgroup v2 root.
pub(crate) struct Sweep {
    reader: Maps,
    pinned: Weak<Mutex<Pinned>>,
    cgroup_root: Option<PathBuf>,
}

/// An entry that may be stale.
struct Candidate {
    which: Which,
    key: u64,
    value: [u8; ContainerEntry::SIZE],
}

impl Sweep {
    pub(crate) fn new(
        reader: Maps,
        pinned: &Arc<Mutex<Pinned>>,
        cgroup_root: Option<PathBuf>,
    ) -> Sweep {
        Sweep {
            reader,
            pinned: Arc::downgrade(pinned),
            cgroup_root,
        }
    }

    /// One pass; `None` once the writer is gone (the agent stops).
    pub(crate) fn pass(&self) -> Option<usize> {
        let pinned = self.pinned.upgrade()?;
        let mut keys = Vec::new();
        for which in Which::BOTH {
            for key in self.reader.get(which).keys().flatten() {
                keys.push((which, key));
            }
        }
        {
            let p = pinned.lock().unwrap_or_else(PoisonError::into_inner);
            keys.retain(|(which, key)| !p.owns(*which, *key));
        }
        let mut candidates = Vec::new();
        for (which, key) in keys {
            if let Ok(value) = self.reader.get(which).get(&key, 0) {
                candidates.push(Candidate { which, key, value });
            }
        }
        if candidates.is_empty() {
            return Some(0);
        }
        let cgroups = self.cgroup_root.as_deref().and_then(CgroupIds::open);
        let needs_mnt = candidates
            .iter()
            .any(|c| c.which == Which::Mntns && cgroup_of(c) == 0);
        let mntns = needs_mnt.then(live_mount_namespaces);
        let stale = candidates.into_iter().filter(|c| {
            let cgroup = cgroup_of(c);
            if cgroup != 0 {
                // Without the cgroup tree, nothing is known to be gone.
                cgroups.as_ref().and_then(|t| t.exists(cgroup)) == Some(false)
            } else {
                // Gone unless a process is in that mount namespace *and*
                // the entry's pid namespace: the kernel gives a freed
                // namespace's number to the next one made (anyone's
                // `unshare -m`).
                let pid_ns = ContainerEntry::from_bytes(&c.value).map_or(0, |e| e.pid_ns);
                mntns
                    .as_ref()
                    .is_some_and(|live| !live.contains(&(c.key, pid_ns)))
            }
        });
        let mut removed = 0;
        for c in stale.take(MAX_REMOVALS_PER_PASS) {
            // The lock per entry, for two syscalls: the writer (the task that
            // answers runtimes) never waits for a whole pass.
            let gone = {
                let mut p = pinned.lock().unwrap_or_else(PoisonError::into_inner);
                // Written meanwhile (by this agent, or changed by another):
                // not the entry that was found gone.
                !p.owns(c.which, c.key)
                    && self.reader.get(c.which).get(&c.key, 0).ok() == Some(c.value)
                    && p.maps_mut().get_mut(c.which).remove(&c.key).is_ok()
                    && {
                        p.metrics().stale_removed(c.which);
                        true
                    }
            };
            if gone {
                removed += 1;
                let id = ContainerEntry::from_bytes(&c.value)
                    .map(|e| String::from_utf8_lossy(e.id()).into_owned())
                    .unwrap_or_default();
                tracing::info!(
                    map = c.which.pin_name(),
                    key = c.key,
                    id,
                    "stale pinned map entry removed (its container is gone)"
                );
            }
        }
        Some(removed)
    }
}

/// The cgroup id an entry names: its key in `containers_by_cgroup`, the
/// entry's own field in `containers_by_mntns` (0: not known).
fn cgroup_of(c: &Candidate) -> u64 {
    match c.which {
        Which::Cgroup => c.key,
        Which::Mntns => ContainerEntry::from_bytes(&c.value).map_or(0, |e| e.cgroup_id),
    }
}

/// Whether a cgroup id still names a cgroup: asked of the kernel by file
/// handle (a kernfs handle is the id), one call per id, however large the
/// tree (a delegated subtree can hold any number of groups).
pub(crate) struct CgroupIds {
    root: std::os::fd::OwnedFd,
}

/// `FILEID_KERNFS`: a kernfs node's 64-bit id as a file handle.
const FILEID_KERNFS: i32 = 0xfe;

/// `struct file_handle` with room for a kernfs id.
#[repr(C)]
struct KernfsHandle {
    handle_bytes: u32,
    handle_type: i32,
    id: [u8; 8],
}

impl CgroupIds {
    /// The cgroup v2 tree mounted at `root`; `None` if it cannot be opened.
    pub(crate) fn open(root: &Path) -> Option<CgroupIds> {
        let dir = std::fs::File::open(root).ok()?;
        Some(CgroupIds { root: dir.into() })
    }

    /// `Some(true)`: the cgroup exists; `Some(false)`: it is gone;
    /// `None`: the kernel would not say (no `CAP_DAC_READ_SEARCH`).
    pub(crate) fn exists(&self, id: u64) -> Option<bool> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let mut handle = KernfsHandle {
            handle_bytes: 8,
            handle_type: FILEID_KERNFS,
            id: id.to_ne_bytes(),
        };
        // SAFETY: open_by_handle_at(2) reads `handle_bytes` bytes of the
        // handle after its header, which `KernfsHandle` has; the mount fd
        // is ours and open. The returned fd, if any, is owned here.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_by_handle_at,
                self.root.as_raw_fd(),
                (&raw mut handle).cast::<libc::c_void>(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd >= 0 {
            // SAFETY: a new fd the kernel just gave us.
            drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
            return Some(true);
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ESTALE | libc::ENOENT) => Some(false),
            _ => None,
        }
    }
}

/// (mount namespace, pid namespace) of every process now.
fn live_mount_namespaces() -> HashSet<(u64, u64)> {
    let mut live = HashSet::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return live;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let ns = lookout_host::proc::namespaces(pid);
        if let (Some(mnt), Some(pid_ns)) = (ns.mnt, ns.pid) {
            live.insert((mnt, pid_ns));
        }
    }
    live
}

/// Runs the sweep on `side`'s blocking pool: once now (the start-up's
/// reconciliation, after the first scan), then every [`SWEEP_EVERY`], until
/// the writer is dropped.
pub(crate) fn spawn(sweep: Sweep, side: &tokio::runtime::Handle) {
    let sweep = Arc::new(sweep);
    side.spawn(async move {
        loop {
            let s = Arc::clone(&sweep);
            match tokio::task::spawn_blocking(move || s.pass()).await {
                Ok(Some(n)) if n > 0 => tracing::info!(removed = n, "pinned maps reconciled"),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return,
            }
            tokio::time::sleep(SWEEP_EVERY).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_cgroup_id_exists_until_its_cgroup_is_removed() {
        let skip = |why: &str| {
            let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false");
            assert!(!ci, "cgroup_ids: {why} under CI");
            eprintln!("\n!!! SKIPPED cgroup_ids: {why}\n");
        };
        let Ok(root) = lookout_host::kernel::find_cgroup2_root(Path::new("/")) else {
            return skip("no cgroup v2 tree");
        };
        let dir = root.join(format!("lookout-test-ids-{}", std::process::id()));
        if std::fs::create_dir(&dir).is_err() {
            return skip("cannot make a cgroup (root needed)");
        }
        let id = std::fs::metadata(&dir)
            .map(|m| m.ino())
            .expect("stat the cgroup");
        let ids = CgroupIds::open(root).expect("open the cgroup root");
        let root_id = std::fs::metadata(root)
            .map(|m| m.ino())
            .expect("stat the root");
        assert_eq!(ids.exists(root_id), Some(true));
        assert_eq!(ids.exists(id), Some(true));
        std::fs::remove_dir(&dir).expect("rmdir the cgroup");
        assert_eq!(ids.exists(id), Some(false));
    }
}
