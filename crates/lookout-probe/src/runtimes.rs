//! Where container runtimes live, and finding them under a host root.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use lookout_host::resolve_in_root;

use serde::{Deserialize, Serialize};

/// The runtime binaries lookout knows how to follow.
pub const RUNTIME_NAMES: [&str; 5] = ["runc", "crun", "runsc", "youki", "conmon"];

/// Well-known install locations (host paths), by distribution or product.
pub const KNOWN_RUNTIME_PATHS: &[&str] = &[
    // Distribution packages and manual installs.
    "/usr/bin/runc",
    "/usr/sbin/runc",
    "/usr/local/bin/runc",
    "/usr/local/sbin/runc",
    "/bin/runc",
    "/sbin/runc",
    "/usr/bin/crun",
    "/usr/local/bin/crun",
    "/usr/bin/runsc",
    "/usr/local/bin/runsc",
    "/usr/bin/youki",
    "/usr/local/bin/youki",
    "/usr/bin/conmon",
    "/usr/local/bin/conmon",
    "/usr/libexec/podman/conmon",
    "/usr/local/libexec/podman/conmon",
    // CRI-O packages.
    "/usr/lib/cri-o-runc/sbin/runc",
    "/usr/libexec/crio/runc",
    "/usr/libexec/crio/crun",
    "/usr/libexec/crio/conmon",
    // k3s, RKE2, k0s, microk8s.
    "/var/lib/rancher/k3s/data/current/bin/runc",
    "/var/lib/rancher/rke2/bin/runc",
    "/var/lib/k0s/bin/runc",
    "/snap/microk8s/current/bin/runc",
    // Bottlerocket.
    "/x86_64-bottlerocket-linux-gnu/sys-root/usr/bin/runc",
    "/aarch64-bottlerocket-linux-gnu/sys-root/usr/bin/runc",
    // Talos.
    "/usr/local/lib/containers/runc",
    // GKE's Container-Optimized OS (runc, and runsc for GKE Sandbox).
    "/home/kubernetes/bin/runc",
    "/home/kubernetes/bin/runsc",
    "/home/containerd/usr/local/sbin/runc",
];

/// A runtime binary found on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RuntimeBinary {
    /// `runc`, `crun`, ... (the file name).
    pub name: String,
    /// The host path it was found at (without the host-root prefix).
    pub host_path: PathBuf,
    /// The resolved path as this process opens it (host root + symlinks
    /// followed inside the host root).
    pub resolved: PathBuf,
    /// Other host paths that lead to the same file (symlinks, merged /usr).
    pub aliases: Vec<PathBuf>,
    /// Device and inode of the file.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
}

/// Candidate host paths: the known list, the given `PATH` directories, and
/// `extra` paths, without repeats, in that order.
pub fn candidate_paths(path_env: Option<&std::ffi::OsStr>, extra: &[PathBuf]) -> Vec<PathBuf> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut push = |p: PathBuf| {
        if seen.insert(p.clone()) {
            out.push(p);
        }
    };
    for p in KNOWN_RUNTIME_PATHS {
        push(PathBuf::from(p));
    }
    if let Some(path_env) = path_env {
        for dir in std::env::split_paths(path_env).filter(|d| d.is_absolute()) {
            for name in RUNTIME_NAMES {
                push(dir.join(name));
            }
        }
    }
    for p in extra {
        push(p.clone());
    }
    out
}

/// Finds the runtime binaries that exist under `root` among `candidates`.
/// Files reached through several paths are reported once, with aliases.
/// A candidate that is not an executable regular file is skipped.
pub fn find_runtimes(root: &Path, candidates: &[PathBuf]) -> Vec<RuntimeBinary> {
    let mut out: Vec<RuntimeBinary> = Vec::new();
    for host_path in candidates {
        let Ok(resolved) = resolve_in_root(root, host_path) else {
            continue;
        };
        let Ok(meta) = std::fs::metadata(&resolved) else {
            continue;
        };
        if !meta.is_file() || meta.mode() & 0o111 == 0 {
            continue;
        }
        if let Some(prev) = out
            .iter_mut()
            .find(|b| b.dev == meta.dev() && b.ino == meta.ino())
        {
            prev.aliases.push(host_path.clone());
            continue;
        }
        let name = host_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.push(RuntimeBinary {
            name,
            host_path: host_path.clone(),
            resolved,
            aliases: Vec::new(),
            dev: meta.dev(),
            ino: meta.ino(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn exe(path: &Path) {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, b"#!/bin/sh\n").expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    #[test]
    fn absolute_symlinks_stay_inside_root() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        exe(&r.join("opt/k3s/data/abc/bin/runc"));
        std::fs::create_dir_all(r.join("var/lib/rancher/k3s/data")).expect("mkdir");
        // An absolute link must be read relative to the host root.
        symlink(
            "/opt/k3s/data/abc",
            r.join("var/lib/rancher/k3s/data/current"),
        )
        .expect("symlink");
        let got = resolve_in_root(r, Path::new("/var/lib/rancher/k3s/data/current/bin/runc"))
            .expect("resolves");
        assert_eq!(got, r.join("opt/k3s/data/abc/bin/runc"));
    }

    #[test]
    fn dotdot_cannot_escape_root() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        std::fs::create_dir_all(r.join("usr/bin")).expect("mkdir");
        std::fs::create_dir_all(r.join("etc")).expect("mkdir");
        symlink("../../../../../../etc", r.join("usr/bin/escape")).expect("symlink");
        let got = resolve_in_root(r, Path::new("/usr/bin/escape")).expect("resolves");
        assert_eq!(got, r.join("etc"));
    }

    #[test]
    fn symlink_loops_fail_with_eloop() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        symlink("/b", r.join("a")).expect("symlink");
        symlink("/a", r.join("b")).expect("symlink");
        let err = resolve_in_root(r, Path::new("/a")).expect_err("loop");
        assert_eq!(err.raw_os_error(), Some(libc::ELOOP));
    }

    #[test]
    fn merged_usr_aliases_are_reported_once() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        exe(&r.join("usr/bin/runc"));
        exe(&r.join("usr/bin/crun"));
        std::fs::write(r.join("usr/bin/youki"), b"not executable").expect("write");
        symlink("usr/bin", r.join("bin")).expect("symlink");
        let cands = candidate_paths(None, &[PathBuf::from("/usr/bin/youki")]);
        let found = find_runtimes(r, &cands);
        let names: Vec<&str> = found.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["runc", "crun"]);
        assert_eq!(found[0].host_path, Path::new("/usr/bin/runc"));
        assert_eq!(found[0].aliases, [PathBuf::from("/bin/runc")]);
    }

    #[test]
    fn path_env_and_extra_paths_are_candidates() {
        let env = std::ffi::OsString::from("/opt/rt/bin:relative/dir");
        let c = candidate_paths(Some(&env), &[PathBuf::from("/srv/my-runc")]);
        assert!(c.contains(&PathBuf::from("/opt/rt/bin/crun")));
        assert!(!c.iter().any(|p| p.starts_with("relative")));
        assert_eq!(c.last(), Some(&PathBuf::from("/srv/my-runc")));
    }
}
