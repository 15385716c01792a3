//! Removes entries that no live container of this agent holds and whose
//! container is gone: those an earlier agent wrote for containers that
//! ended while no agent ran, or that a surge's other agent left.
//!
//! Gone is the kernel's word, not this agent's: a cgroup id that no
//! directory of the cgroup v2 tree has any more (the kernel never gives an
//! id twice), or, for a mount namespace entry without a cgroup id, a
//! namespace no process is in. An entry of a container this agent has not
//! found (yet) stays: a tracer's map never loses a live container.

use std::collections::HashSet;
use std::os::unix::fs::DirEntryExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use lookout_ebpf_common::ContainerEntry;

use super::{Maps, Pinned, Which};

/// How often the sweep runs after the first, at `ready`.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(30);
/// At most this many cgroup directories are walked (a node has thousands).
const MAX_CGROUPS: usize = 1 << 20;
/// And at most this deep.
const MAX_DEPTH: usize = 64;

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
        let cgroups = self.cgroup_root.as_deref().and_then(live_cgroups);
        let needs_mnt = candidates
            .iter()
            .any(|c| c.which == Which::Mntns && cgroup_of(c) == 0);
        let mntns = needs_mnt.then(live_mount_namespaces);
        let stale: Vec<Candidate> = candidates
            .into_iter()
            .filter(|c| {
                let cgroup = cgroup_of(c);
                if cgroup != 0 {
                    // Without the tree, nothing is known to be gone.
                    cgroups.as_ref().is_some_and(|live| !live.contains(&cgroup))
                } else {
                    mntns.as_ref().is_some_and(|live| !live.contains(&c.key))
                }
            })
            .collect();
        let mut removed = 0;
        let mut p = pinned.lock().unwrap_or_else(PoisonError::into_inner);
        for c in stale {
            // Written meanwhile (by this agent, or changed by another):
            // not the entry that was found gone.
            if p.owns(c.which, c.key)
                || self.reader.get(c.which).get(&c.key, 0).ok() != Some(c.value)
            {
                continue;
            }
            if p.maps_mut().get_mut(c.which).remove(&c.key).is_ok() {
                removed += 1;
                p.metrics().stale_removed(c.which);
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

/// The ids of every cgroup under `root` (directory inodes, read from the
/// directory entries: no stat), or `None` if the tree cannot be read or is
/// larger than [`MAX_CGROUPS`] (then nothing is judged gone).
fn live_cgroups(root: &Path) -> Option<HashSet<u64>> {
    let mut ids = HashSet::new();
    ids.insert(
        std::fs::metadata(root)
            .ok()
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))?,
    );
    let mut stack = vec![(root.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            // Removed while walked: its children went with it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => return None,
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            ids.insert(entry.ino());
            if ids.len() > MAX_CGROUPS {
                return None;
            }
            if depth < MAX_DEPTH {
                stack.push((entry.path(), depth + 1));
            }
        }
    }
    Some(ids)
}

/// The mount namespaces processes are in now.
fn live_mount_namespaces() -> HashSet<u64> {
    let mut live = HashSet::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return live;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(mnt) = lookout_host::proc::namespaces(pid).mnt {
            live.insert(mnt);
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
