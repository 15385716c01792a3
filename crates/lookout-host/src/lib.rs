//! What the host says about a process or a path, read from `/proc` and the
//! file system: the I/O half of what lookout-model's types describe.
//!
//! - [`proc`]: a process's namespaces, cgroup (as the host's cgroup
//!   namespace renders it), start time, uid, working directory and argv.
//!   Every read is of a small kernel-made file; a process that is gone is
//!   `None`, never an error.
//! - [`kernel`]: what a container's init runs in, as consumers' BPF
//!   programs key it: every namespace, the cgroup id, the id maps.
//! - [`sched`]: a short scheduler time slice for the threads a runtime
//!   waits on (Linux 6.12+).
//! - [`host_path`] and [`resolve_in_root`]: host paths for an agent that
//!   sees the host's root at `/host`, with host symlinks followed as the
//!   host follows them.
//!
//! ```
//! let me = std::process::id();
//! let ns = lookout_host::proc::namespaces(me);
//! assert!(ns.mnt.is_some());
//! assert!(lookout_host::proc::start_time(me).is_some());
//! ```
#![deny(missing_docs)]

pub mod kernel;
pub mod proc;
pub mod sched;

use std::path::PathBuf;

/// Where the host's path `path` is for a process that sees the host's root
/// at `host_root` (`/` on the host, `/host` in the DaemonSet's pod):
/// `host_path("/host", "/run/runc")` is `/host/run/runc`. A relative `path`
/// is taken as relative to the host's root.
///
/// ```
/// use lookout_host::host_path;
/// use std::path::Path;
/// assert_eq!(host_path(Path::new("/host"), Path::new("/run/runc")), Path::new("/host/run/runc"));
/// assert_eq!(host_path(Path::new("/"), Path::new("/run/runc")), Path::new("/run/runc"));
/// ```
pub fn host_path(host_root: &std::path::Path, path: &std::path::Path) -> PathBuf {
    host_root.join(path.strip_prefix("/").unwrap_or(path))
}

/// Resolves `path`, a host path, under `host_root` as the host resolves it:
/// symlinks are followed, but an absolute link starts again at
/// `host_root` and `..` never goes above it (at most 40 links, as the
/// kernel allows; more is `ELOOP`). Returns the path under `host_root`.
///
/// A DaemonSet sees the host at `/host`; a host symlink such as
/// `/usr/bin/sh -> /bin/dash` must be read as `/host/bin/dash`, not as the
/// pod's own `/bin/dash`.
///
/// ```
/// use lookout_host::resolve_in_root;
/// let root = std::env::temp_dir().join(format!("resolve-doc-{}", std::process::id()));
/// std::fs::create_dir_all(root.join("usr/bin")).unwrap();
/// std::fs::write(root.join("usr/bin/dash"), b"").unwrap();
/// let _ = std::fs::remove_file(root.join("usr/bin/sh"));
/// std::os::unix::fs::symlink("/usr/bin/dash", root.join("usr/bin/sh")).unwrap();
/// let got = resolve_in_root(&root, std::path::Path::new("/usr/bin/sh")).unwrap();
/// assert_eq!(got, root.join("usr/bin/dash"));
/// # std::fs::remove_dir_all(&root).unwrap();
/// ```
pub fn resolve_in_root(
    host_root: &std::path::Path,
    path: &std::path::Path,
) -> std::io::Result<PathBuf> {
    use std::path::Component;
    const MAX_LINKS: usize = 40;
    let mut links = 0;
    // Components still to walk, reversed (a stack).
    let mut todo: Vec<std::ffi::OsString> = Vec::new();
    let push = |todo: &mut Vec<std::ffi::OsString>, p: &std::path::Path| {
        for c in p.components().rev() {
            match c {
                Component::Normal(s) => todo.push(s.to_os_string()),
                Component::ParentDir => todo.push("..".into()),
                _ => {}
            }
        }
    };
    push(&mut todo, path);
    let mut done: Vec<std::ffi::OsString> = Vec::new();
    while let Some(c) = todo.pop() {
        if c == ".." {
            done.pop();
            continue;
        }
        let mut at = host_root.to_path_buf();
        at.extend(&done);
        at.push(&c);
        if !std::fs::symlink_metadata(&at)?.file_type().is_symlink() {
            done.push(c);
            continue;
        }
        links += 1;
        if links > MAX_LINKS {
            return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
        }
        let target = std::fs::read_link(&at)?;
        if target.is_absolute() {
            done.clear();
        }
        push(&mut todo, &target);
    }
    let mut out = host_root.to_path_buf();
    out.extend(&done);
    Ok(out)
}

// Compiles the README's examples as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
