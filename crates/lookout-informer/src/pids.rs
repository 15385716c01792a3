//! Host pids of containers the API server names, found by matching their
//! ids in `/proc/*/cgroup`: no CRI socket needed.
//!
//! Cgroup leaves by runtime and driver (see docs/deploy.md):
//!
//! | driver + runtime | leaf |
//! |---|---|
//! | systemd + containerd | `cri-containerd-<id>.scope` |
//! | systemd + CRI-O | `crio-<id>.scope` (`crio-conmon-<id>.scope` is conmon) |
//! | systemd + cri-dockerd | `docker-<id>.scope` |
//! | systemd + podman | `libpod-<id>.scope` |
//! | cgroupfs + containerd | `<id>` |
//! | cgroupfs + CRI-O | `crio-<id>` |
//! | containerd without SystemdCgroup | `…slice:cri-containerd:<id>` |

use std::collections::{HashMap, HashSet};
use std::path::Path;

/// The container id in a cgroup path (`0::` line or a v1 path), if its
/// leaf (or, for `*.service`/`init` leaves, the one above) names one.
///
/// ```
/// use lookout_informer::container_id_from_cgroup;
/// let id = "4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d";
/// let systemd = format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1_2.slice/cri-containerd-{id}.scope");
/// assert_eq!(container_id_from_cgroup(&systemd), Some(id));
/// assert_eq!(container_id_from_cgroup(&format!("/kubepods/burstable/pod12/crio-{id}")), Some(id));
/// assert_eq!(container_id_from_cgroup(&format!("/kubepods/pod12/crio-conmon-{id}.scope")), None);
/// ```
pub fn container_id_from_cgroup(path: &str) -> Option<&str> {
    let mut parts = path.rsplit('/').filter(|p| !p.is_empty());
    let leaf = parts.next()?;
    match id_in(leaf) {
        Some(id) => Some(id),
        // A process in a sub-cgroup of the container (systemd in a
        // container puts itself in `init.scope`, some runtimes use
        // `*.service`): the container is one level up.
        None if leaf.ends_with(".service") || leaf == "init.scope" || leaf == "container" => {
            parts.next().and_then(id_in)
        }
        None => None,
    }
}

fn id_in(component: &str) -> Option<&str> {
    if component.starts_with("crio-conmon-") {
        return None;
    }
    let c = component.strip_suffix(".scope").unwrap_or(component);
    let c = match c.rsplit_once(":cri-containerd:") {
        Some((_, id)) => id,
        None => ["cri-containerd-", "crio-", "docker-", "libpod-"]
            .iter()
            .find_map(|p| c.strip_prefix(p))
            .unwrap_or(c),
    };
    (c.len() == 64 && c.bytes().all(|b| b.is_ascii_hexdigit())).then_some(c)
}

/// Whether cgroup `path` (as the host's cgroup namespace renders it) is a
/// directory root owns in the cgroup v2 tree; `true` when that cannot be
/// told (no cgroup v2 tree, or a v1 path not in it): nothing to go by.
fn owned_by_root(path: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(root) = lookout_host::kernel::find_cgroup2_root(Path::new("/")) else {
        return true;
    };
    let rel = path.trim_start_matches('/');
    if rel.split('/').any(|c| c == "..") {
        return false;
    }
    match std::fs::symlink_metadata(root.join(rel)) {
        Ok(m) => m.uid() == 0,
        Err(_) => true,
    }
}

/// For each id in `wanted`, the pid of the container's init process under
/// `proc_root` (normally `/proc`; the host's in a pod with `hostPID`): of
/// the processes in the container's cgroup, the one that started first.
pub fn find_pids(proc_root: &Path, wanted: &HashSet<String>) -> HashMap<String, u32> {
    let mut best: HashMap<String, (u64, u32)> = HashMap::new();
    if wanted.is_empty() {
        return HashMap::new();
    }
    let Ok(dir) = std::fs::read_dir(proc_root) else {
        return HashMap::new();
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        // Bytes that are not UTF-8 are replaced, not a reason to skip the
        // process: a process names itself (its `stat`) and, with a
        // delegated cgroup tree, its cgroup.
        let Ok(bytes) = std::fs::read(entry.path().join("cgroup")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&bytes);
        let Some(path) = lookout_host::proc::parse_cgroup(&text) else {
            continue;
        };
        let Some(id) = container_id_from_cgroup(&path).filter(|id| wanted.contains(*id)) else {
            continue;
        };
        // A cgroup that is not root's is a delegated one (a user's
        // `user@UID.service`, rootless podman): its owner can give it any
        // container's name and move a process of theirs in, older than the
        // container's init. Kubernetes' containers' cgroups are root's.
        if !owned_by_root(&path) {
            continue;
        }
        let started = std::fs::read(entry.path().join("stat"))
            .ok()
            .and_then(|s| lookout_host::proc::parse_start_time(&String::from_utf8_lossy(&s)))
            .unwrap_or(u64::MAX);
        let e = best.entry(id.to_owned()).or_insert((started, pid));
        if (started, pid) < *e {
            *e = (started, pid);
        }
    }
    best.into_iter().map(|(id, (_, pid))| (id, pid)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn every_known_layout() {
        for p in [
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5f_1.slice/cri-containerd-{ID}.scope"
            ),
            format!("/kubepods.slice/kubepods-pod5f_1.slice/crio-{ID}.scope"),
            format!("/kubepods.slice/kubepods-pod5f_1.slice/docker-{ID}.scope"),
            format!("/machine.slice/libpod-{ID}.scope"),
            format!("/kubepods/besteffort/pod5f-1/{ID}"),
            format!("/kubepods/pod5f-1/crio-{ID}"),
            format!(
                "/system.slice/containerd.service/kubepods-besteffort-pod5f_1.slice:cri-containerd:{ID}"
            ),
            format!("/kubepods.slice/kubepods-pod5f_1.slice/cri-containerd-{ID}.scope/init.scope"),
        ] {
            assert_eq!(container_id_from_cgroup(&p), Some(ID), "{p}");
        }
        for p in [
            format!("/kubepods.slice/kubepods-pod5f_1.slice/crio-conmon-{ID}.scope"),
            "/system.slice/containerd.service".to_owned(),
            "/user.slice/user-0.slice/session-1.scope".to_owned(),
            "/".to_owned(),
            format!("/kubepods/pod/{}", &ID[..63]),
        ] {
            assert_eq!(container_id_from_cgroup(&p), None, "{p}");
        }
    }

    #[test]
    fn finds_the_first_started_process_of_a_container_in_a_proc_tree() {
        let d = tempfile::tempdir().expect("tempdir");
        let mk = |pid: u32, cgroup: &str, start: u64| {
            let p = d.path().join(pid.to_string());
            std::fs::create_dir_all(&p).expect("mkdir");
            std::fs::write(p.join("cgroup"), format!("0::{cgroup}\n")).expect("cgroup");
            let stat = format!("{pid} (sh) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0");
            std::fs::write(p.join("stat"), stat).expect("stat");
        };
        let leaf = format!("/kubepods/pod1/{ID}");
        mk(300, &leaf, 50); // a later exec into the container
        mk(200, &leaf, 10); // its init
        mk(100, "/system.slice/sshd.service", 1);
        std::fs::create_dir_all(d.path().join("self")).expect("mkdir");
        let wanted = HashSet::from([ID.to_owned(), "f".repeat(64)]);
        let found = find_pids(d.path(), &wanted);
        assert_eq!(found.get(ID), Some(&200));
        assert_eq!(found.len(), 1);
    }
}
