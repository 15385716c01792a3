//! What the kernel says a container's init runs in, for consumers that act
//! on it in their own BPF programs: every namespace, the id of its cgroup
//! v2 directory (what `bpf_get_current_cgroup_id()` returns), and, in a
//! user namespace of its own, how its ids map to the host's.
//!
//! [`fill`] sets all of it on a [`Container`]; what cannot be read is
//! left out and its reason put in [`Container::unresolved`], so one odd
//! container costs a field, never the container.
//!
//! ```
//! let me = std::process::id();
//! let mut c = lookout_model::Container::new("self", lookout_model::RuntimeKind::Runc);
//! lookout_host::kernel::fill(&mut c, me, None);
//! assert!(c.namespaces.user.is_some());
//! // This process is in the host's user namespace: no maps.
//! assert_eq!(c.id_maps, None);
//! ```

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use lookout_model::{Container, IdMapping, IdMaps};

use crate::proc;

/// The field names [`fill`] records reasons under.
pub mod field {
    /// [`Container::cgroup_id`](lookout_model::Container::cgroup_id).
    pub const CGROUP_ID: &str = "cgroup_id";
    /// [`Container::id_maps`](lookout_model::Container::id_maps).
    pub const ID_MAPS: &str = "id_maps";
}

/// Sets `c`'s namespaces (all eight; `mnt` as given when the caller read
/// it already), cgroup path and id, and id maps from its init `pid`.
/// Reads `/proc` and the cgroup file system: call it off any task that
/// answers runtimes. A process that is gone leaves the fields empty (and
/// says why for the cgroup id and the maps).
pub fn fill(c: &mut Container, pid: u32, mnt: Option<u64>) {
    c.namespaces = proc::namespaces_with_mnt(pid, mnt);
    let text = proc::cgroup_text(pid);
    c.cgroup = text.as_deref().and_then(proc::parse_cgroup);
    match text {
        Some(text) => match cgroup_id(&text) {
            Ok(id) => c.cgroup_id = Some(id),
            Err(e) => c.set_unresolved(field::CGROUP_ID, lookout_model::Chain(&e).to_string()),
        },
        None => c.set_unresolved(
            field::CGROUP_ID,
            format!("/proc/{pid}/cgroup is unreadable"),
        ),
    }
    match id_maps(pid, c.namespaces.user) {
        Ok(maps) => c.id_maps = maps,
        Err(e) => c.set_unresolved(field::ID_MAPS, e.to_string()),
    }
}

/// Why a cgroup id is not known.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CgroupIdError {
    /// No cgroup v2 hierarchy whose root this process can see.
    #[error("{0}")]
    NoHierarchy(String),
    /// The process is in the hierarchy's root cgroup: no group of the
    /// container's own, and the root's id would stand for every process
    /// left there (a consumer's BPF map keyed by it would match them all).
    #[error("the process is in the root cgroup, not one of its container's own")]
    RootCgroup,
    /// The process's cgroup file has no `0::` line: a cgroup v1 node
    /// without the unified hierarchy.
    #[error("the process is in no cgroup v2 group (no 0:: line: a cgroup v1 node)")]
    NotInV2,
    /// The path reads relative to a cgroup namespace this process is in
    /// (`/../..`), so it names no directory here.
    #[error("the cgroup path {0:?} is relative to the agent's cgroup namespace")]
    OutsideNamespace(String),
    /// The directory could not be read: the container's cgroup was
    /// removed, or the path is not where the hierarchy's root is mounted.
    #[error("cannot stat {}", path.display())]
    Stat {
        /// The directory.
        path: PathBuf,
        /// What `stat` said.
        #[source]
        source: std::io::Error,
    },
}

/// Where the cgroup v2 hierarchy's root is mounted, once found.
static CGROUP2_ROOT: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// Finds the cgroup v2 hierarchy's root under `host_root` (the host's `/`
/// as this process sees it: `/host` in the DaemonSet): its
/// `/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid node. The
/// first call decides for the process; later ones return its answer.
/// [`cgroup_id`] calls it with `/` if nobody did.
///
/// A pod's own `/sys/fs/cgroup` is no answer: its runtime mounts the
/// pod's part of the hierarchy there (a cgroup namespace's root), where
/// other containers' directories are not. That mount has `cgroup.type`
/// at its top, which only non-root groups have, and is refused.
///
/// # Errors
/// Why no root was found, in words for an operator.
pub fn find_cgroup2_root(host_root: &Path) -> Result<&'static Path, &'static str> {
    match CGROUP2_ROOT.get_or_init(|| locate_cgroup2_root(host_root)) {
        Ok(p) => Ok(p.as_path()),
        Err(e) => Err(e.as_str()),
    }
}

fn locate_cgroup2_root(host_root: &Path) -> Result<PathBuf, String> {
    use nix::sys::statfs::{CGROUP2_SUPER_MAGIC, statfs};
    let base = crate::host_path(host_root, Path::new("/sys/fs/cgroup"));
    let mut partial = None;
    for dir in [base.clone(), base.join("unified")] {
        if !statfs(&dir).is_ok_and(|fs| fs.filesystem_type() == CGROUP2_SUPER_MAGIC) {
            continue;
        }
        if dir.join("cgroup.type").exists() {
            partial = Some(dir);
            continue;
        }
        return Ok(dir);
    }
    Err(match partial {
        Some(dir) => format!(
            "{} shows a cgroup namespace's part of the cgroup v2 hierarchy, not its root \
             (mount the host's /sys/fs/cgroup, as the host root volume does)",
            dir.display()
        ),
        None => format!(
            "no cgroup v2 hierarchy at {} or {}/unified (a cgroup v1 node)",
            base.display(),
            base.display()
        ),
    })
}

/// The cgroup id of the process whose `/proc/<pid>/cgroup` reads `text`
/// (as the host's cgroup namespace renders it): the inode number of its
/// cgroup v2 directory, which the kernel uses as the cgroup's id on 64-bit
/// machines.
///
/// # Errors
/// Why the id cannot be known ([`CgroupIdError`]).
pub fn cgroup_id(text: &str) -> Result<u64, CgroupIdError> {
    let path = parse_cgroup_v2(text).ok_or(CgroupIdError::NotInV2)?;
    let relative = cgroup_v2_relative(path)?;
    if relative.as_os_str().is_empty() {
        return Err(CgroupIdError::RootCgroup);
    }
    let root =
        find_cgroup2_root(Path::new("/")).map_err(|e| CgroupIdError::NoHierarchy(e.to_owned()))?;
    let dir = root.join(relative);
    match std::fs::metadata(&dir) {
        Ok(m) => Ok(m.ino()),
        Err(e) => Err(CgroupIdError::Stat {
            path: dir,
            source: e,
        }),
    }
}

/// The path of the `0::` line of a `/proc/<pid>/cgroup` text, if any.
///
/// ```
/// let text = "12:memory:/a\n0::/kubepods/pod1/c1\n";
/// assert_eq!(lookout_host::kernel::parse_cgroup_v2(text), Some("/kubepods/pod1/c1"));
/// assert_eq!(lookout_host::kernel::parse_cgroup_v2("12:memory:/a\n"), None);
/// ```
pub fn parse_cgroup_v2(text: &str) -> Option<&str> {
    text.lines().find_map(|l| l.strip_prefix("0::"))
}

/// `path` (a `0::` line's) relative to the hierarchy's root: no `..`
/// (the path is relative to another cgroup namespace) and nothing but
/// plain names.
fn cgroup_v2_relative(path: &str) -> Result<&Path, CgroupIdError> {
    use std::path::Component;
    let relative = Path::new(path.strip_prefix('/').unwrap_or(path));
    if relative
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        Ok(relative)
    } else {
        Err(CgroupIdError::OutsideNamespace(path.to_owned()))
    }
}

/// Why a user namespace's id maps are not known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdMapError {
    /// The container's user namespace could not be read.
    #[error("the user namespace of the process cannot be read")]
    UserNamespaceUnknown,
    /// A map file could not be read (the process is gone).
    #[error("{0} cannot be read")]
    Unreadable(String),
    /// A map file is longer than the kernel writes (340 lines).
    #[error("{0} is longer than {MAX_MAP_BYTES} bytes")]
    TooLong(String),
    /// A line is not three numbers.
    #[error("{file}, line {line}: {why}")]
    Malformed {
        /// The file (`uid_map` or `gid_map`).
        file: String,
        /// Its line, from 1.
        line: usize,
        /// What was wrong.
        why: &'static str,
    },
}

/// Bytes at most in a map file: the kernel allows 340 lines of three
/// 10-digit numbers.
pub const MAX_MAP_BYTES: usize = 16 * 1024;

/// The user namespace this process is in: the host's, for the agent.
fn own_user_namespace() -> Option<u64> {
    static OWN: OnceLock<Option<u64>> = OnceLock::new();
    *OWN.get_or_init(|| {
        std::fs::metadata("/proc/self/ns/user")
            .ok()
            .map(|m| m.ino())
    })
}

/// The id maps of `pid`, whose user namespace is `user`: `None` when that
/// is this process's own (the host's, for the agent).
///
/// # Errors
/// Why the maps cannot be known ([`IdMapError`]).
pub fn id_maps(pid: u32, user: Option<u64>) -> Result<Option<IdMaps>, IdMapError> {
    let user = user.ok_or(IdMapError::UserNamespaceUnknown)?;
    if own_user_namespace() == Some(user) {
        return Ok(None);
    }
    let read = |name: &str| {
        let file = format!("/proc/{pid}/{name}");
        let text = read_bounded(&file)?;
        parse_id_map(&text, name)
    };
    let mut maps = IdMaps::default();
    maps.uid = read("uid_map")?;
    maps.gid = read("gid_map")?;
    Ok(Some(maps))
}

/// `path` whole, if it is at most [`MAX_MAP_BYTES`].
fn read_bounded(path: &str) -> Result<String, IdMapError> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|_| IdMapError::Unreadable(path.to_owned()))?;
    let mut bytes = Vec::with_capacity(1024);
    file.take(MAX_MAP_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|_| IdMapError::Unreadable(path.to_owned()))?;
    if bytes.len() > MAX_MAP_BYTES {
        return Err(IdMapError::TooLong(path.to_owned()));
    }
    String::from_utf8(bytes).map_err(|_| IdMapError::Malformed {
        file: path.to_owned(),
        line: 0,
        why: "not UTF-8",
    })
}

/// The lines of a `uid_map` or `gid_map` (`file` names it in errors):
/// three numbers each, inside id, host id and count, as the kernel
/// writes them (padded with spaces). Empty lines are skipped; an empty
/// map (a namespace whose maps were not written yet) is no line.
///
/// ```
/// let maps = lookout_host::kernel::parse_id_map("         0     100000      65536\n", "uid_map").unwrap();
/// assert_eq!((maps[0].container_id, maps[0].host_id, maps[0].size), (0, 100000, 65536));
/// assert!(lookout_host::kernel::parse_id_map("0 1\n", "uid_map").is_err());
/// ```
///
/// # Errors
/// [`IdMapError::Malformed`], naming the line.
pub fn parse_id_map(text: &str, file: &str) -> Result<Vec<IdMapping>, IdMapError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let malformed = |why| IdMapError::Malformed {
            file: file.to_owned(),
            line: i + 1,
            why,
        };
        let mut fields = line.split_ascii_whitespace();
        let Some(first) = fields.next() else {
            continue;
        };
        let number = |f: Option<&str>| -> Result<u32, IdMapError> {
            f.ok_or_else(|| malformed("fewer than three numbers"))?
                .parse()
                .map_err(|_| malformed("not a 32-bit number"))
        };
        let container_id = number(Some(first))?;
        let host_id = number(fields.next())?;
        let size = number(fields.next())?;
        if fields.next().is_some() {
            return Err(malformed("more than three numbers"));
        }
        if u64::from(container_id) + u64::from(size) > 1 << 32
            || u64::from(host_id) + u64::from(size) > 1 << 32
        {
            return Err(malformed("the range passes 2^32"));
        }
        out.push(IdMapping::new(container_id, host_id, size));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_maps_parse_as_the_kernel_writes_them() {
        let text = "         0     100000      65536\n     65536          0          1\n";
        let maps = parse_id_map(text, "uid_map").expect("parse");
        assert_eq!(
            maps,
            [
                IdMapping::new(0, 100_000, 65_536),
                IdMapping::new(65_536, 0, 1)
            ]
        );
        assert_eq!(parse_id_map("", "uid_map").expect("empty"), []);
        assert_eq!(
            parse_id_map("0 0 4294967295\n", "uid_map").expect("the host's own map"),
            [IdMapping::new(0, 0, u32::MAX)]
        );
    }

    #[test]
    fn a_malformed_map_line_is_named() {
        for (text, line, why) in [
            ("0 1\n", 1, "fewer than three numbers"),
            ("0 1 2\nx 1 2\n", 2, "not a 32-bit number"),
            ("0 1 2 3\n", 1, "more than three numbers"),
            ("0 1 -2\n", 1, "not a 32-bit number"),
            ("0 4294967295 2\n", 1, "the range passes 2^32"),
            ("4294967296 0 1\n", 1, "not a 32-bit number"),
        ] {
            assert_eq!(
                parse_id_map(text, "gid_map"),
                Err(IdMapError::Malformed {
                    file: "gid_map".into(),
                    line,
                    why
                }),
                "{text:?}"
            );
        }
    }

    #[test]
    fn a_cgroup_path_of_another_namespace_names_no_directory() {
        assert_eq!(
            cgroup_v2_relative("/kubepods/pod1/c1").expect("plain"),
            Path::new("kubepods/pod1/c1")
        );
        assert_eq!(cgroup_v2_relative("/").expect("root"), Path::new(""));
        for odd in ["/../../kubepods/c1", "/a/../b"] {
            assert!(
                matches!(
                    cgroup_v2_relative(odd),
                    Err(CgroupIdError::OutsideNamespace(_))
                ),
                "{odd}"
            );
        }
        assert!(matches!(
            cgroup_id("3:cpu:/a\n"),
            Err(CgroupIdError::NotInV2)
        ));
        assert!(matches!(
            cgroup_id("3:cpu:/a\n0::/\n"),
            Err(CgroupIdError::RootCgroup)
        ));
    }

    /// This process's own cgroup id is its cgroup directory's inode, on a
    /// node with a cgroup v2 hierarchy (every CI machine has one).
    #[test]
    fn own_cgroup_id_is_the_directory_inode() {
        let text = std::fs::read_to_string("/proc/self/cgroup").expect("own cgroup");
        let Some(path) = parse_cgroup_v2(&text) else {
            eprintln!("SKIPPED: no cgroup v2 hierarchy on this machine");
            return;
        };
        match find_cgroup2_root(Path::new("/")) {
            // A test run from the root cgroup (a VM's shell, as on the
            // project's machines): no id of its own.
            Ok(_) if path == "/" => {
                assert!(matches!(cgroup_id(&text), Err(CgroupIdError::RootCgroup)));
            }
            Ok(root) => {
                let dir = root.join(path.trim_start_matches('/'));
                let inode = std::fs::metadata(&dir).expect("own cgroup dir").ino();
                assert_eq!(cgroup_id(&text).expect("own cgroup id"), inode);
            }
            // A test run in a container with a cgroup namespace of its
            // own: refused with the reason.
            Err(why) => assert!(why.contains("cgroup"), "{why}"),
        }
        let mut c = Container::new("me", lookout_model::RuntimeKind::Runc);
        fill(&mut c, std::process::id(), None);
        assert_eq!(c.namespaces, proc::namespaces(std::process::id()));
        for ns in [
            c.namespaces.mnt,
            c.namespaces.net,
            c.namespaces.pid,
            c.namespaces.user,
            c.namespaces.cgroup,
            c.namespaces.ipc,
            c.namespaces.uts,
        ] {
            assert!(ns.is_some(), "{:?}", c.namespaces);
        }
        assert_eq!(c.id_maps, None, "this process is in its own user namespace");
    }
}
