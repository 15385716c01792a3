//! Running a hook inside a container, as a runtime runs `createContainer`
//! and `startContainer` hooks, without handing the container anything of
//! the host's: the namespaces of the very process the hook is for (checked
//! through a pidfd), a program that is a sealed copy in memory and static
//! (`createContainer`: nothing of the container's file system runs as the
//! runtime), or the container process's own identity (`startContainer`:
//! the container's program runs as the container's process would).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use crate::Error;

/// A hook run inside a container: in its user (when it has its own),
/// cgroup, ipc, uts, net, pid and mount namespaces, as a runtime runs a
/// `createContainer` or `startContainer` hook.
///
/// The container has already pivoted into its root (lookout sees it after
/// `create`); what the hook runs as depends on [`PathIn`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct InContainer {
    /// The container's init process, as this process sees it.
    pub pid: u32,
    /// Where the hook's `path` is looked up, and so what it runs as.
    pub path_in: PathIn,
    /// A pidfd of the init, opened when the init was known to be the
    /// container's: the hook then runs only while that process lives (a pid
    /// reused meanwhile is never entered).
    pub pidfd: Option<Arc<OwnedFd>>,
}

impl InContainer {
    /// In the namespaces of `pid`, `path` looked up as `path_in` says.
    pub fn new(pid: u32, path_in: PathIn) -> InContainer {
        InContainer {
            pid,
            path_in,
            pidfd: None,
        }
    }

    /// Only while the process behind `pidfd` (the init `pid` was when it
    /// was opened) lives.
    pub fn with_pidfd(mut self, pidfd: Arc<OwnedFd>) -> InContainer {
        self.pidfd = Some(pidfd);
        self
    }
}

/// Where a hook run in a container finds its program, and what it runs
/// as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PathIn {
    /// `createContainer` ("the path MUST resolve in the runtime
    /// namespace"): the program is read from the host's file system (under
    /// [`RunOptions::host_root`](crate::RunOptions::host_root)) into a
    /// sealed memfd before the hook enters the container, and that copy is
    /// executed, as root (the container's root when it has its own user
    /// namespace), as runc runs it. It must be a static program: an
    /// interpreter (`#!`, an ELF `PT_INTERP`) would be looked up in the
    /// container's file system and run as root there.
    Host,
    /// `startContainer`: the path is looked up in the container's root and
    /// runs with the container process's identity: its uids, gids,
    /// supplementary groups and capability sets, with `no_new_privs`, as
    /// runc runs it in the container's init. (Not under the container's
    /// seccomp filter or LSM label, which cannot be read back.)
    Container,
}

/// The most bytes of a hook program copied into memory.
const MAX_PROGRAM_BYTES: u64 = 64 << 20;

/// Sealed copies kept for reuse, by the file's identity: a hook that runs
/// for every container is copied once.
const PROGRAM_CACHE: usize = 16;

type ProgramKey = (u64, u64, u64, i64, i64, i64, i64);

fn programs() -> &'static Mutex<HashMap<ProgramKey, Arc<OwnedFd>>> {
    static CACHE: OnceLock<Mutex<HashMap<ProgramKey, Arc<OwnedFd>>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

/// A hook's program, to be executed from inside a container: a sealed
/// copy in memory, never the host's file, and static. The hook runs in the
/// container's pid namespace, where the container's processes see its
/// `/proc/<pid>/exe`: through the host's file they could write to it (as
/// runc's CVE-2019-5736); through a sealed memfd there is nothing to
/// write. One copy per file (device, inode, size, times), reused.
pub(crate) fn open_program(path: &Path) -> std::io::Result<Arc<OwnedFd>> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::open(path)?;
    let m = file.metadata()?;
    let key = (
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec(),
    );
    if let Some(fd) = programs().lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(fd);
    }
    if m.size() > MAX_PROGRAM_BYTES {
        return Err(std::io::Error::other(format!(
            "{} bytes: a program run in a container is copied into memory, at most \
             {MAX_PROGRAM_BYTES}",
            m.size()
        )));
    }
    let mut head = Vec::new();
    (&file).take(64 << 10).read_to_end(&mut head)?;
    static_program(&head)?;
    let fd = nix::sys::memfd::memfd_create(
        c"lookout-hook",
        nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
    )?;
    let mut copy = std::fs::File::from(fd);
    std::io::copy(&mut std::io::Cursor::new(&head), &mut copy)?;
    std::io::copy(&mut (&file).take(MAX_PROGRAM_BYTES), &mut copy)?;
    let seals = nix::fcntl::SealFlag::F_SEAL_SEAL
        | nix::fcntl::SealFlag::F_SEAL_SHRINK
        | nix::fcntl::SealFlag::F_SEAL_GROW
        | nix::fcntl::SealFlag::F_SEAL_WRITE;
    nix::fcntl::fcntl(&copy, nix::fcntl::FcntlArg::F_ADD_SEALS(seals))?;
    let fd = Arc::new(OwnedFd::from(copy));
    if let Ok(mut c) = programs().lock() {
        if c.len() >= PROGRAM_CACHE {
            c.clear();
        }
        c.insert(key, Arc::clone(&fd));
    }
    Ok(fd)
}

/// Whether `head` (a program's first bytes) is a static ELF: not a script
/// and without an interpreter (`PT_INTERP`), either of which the kernel
/// would look up in the container's file system.
pub(crate) fn static_program(head: &[u8]) -> std::io::Result<()> {
    let refuse = |why: &str| {
        Err(std::io::Error::other(format!(
            "{why}: a createContainer hook runs as root inside the container, where its \
             interpreter would come from the container's file system; use a static program (or \
             the createRuntime stage)"
        )))
    };
    if head.starts_with(b"#!") {
        return refuse("a script");
    }
    if head.len() < 64 || &head[..4] != b"\x7fELF" {
        return refuse("not an ELF program");
    }
    let u16_at = |o: usize| head.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        head.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        head.get(o..o + 8).map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        })
    };
    // Little-endian only: amd64 and arm64.
    if head[5] != 1 {
        return refuse("a big-endian ELF");
    }
    let (phoff, phentsize, phnum) = match head[4] {
        2 => (u64_at(32), u16_at(54), u16_at(56)),
        1 => (u32_at(28).map(u64::from), u16_at(42), u16_at(44)),
        _ => return refuse("an ELF of unknown class"),
    };
    let (Some(phoff), Some(phentsize), Some(phnum)) = (phoff, phentsize, phnum) else {
        return refuse("a truncated ELF header");
    };
    for i in 0..u64::from(phnum) {
        let at = phoff.saturating_add(i.saturating_mul(u64::from(phentsize)));
        let Some(p_type) = usize::try_from(at).ok().and_then(u32_at) else {
            return refuse("program headers past the first 64 KiB");
        };
        // PT_INTERP
        if p_type == 3 {
            return refuse("a dynamically linked program");
        }
    }
    Ok(())
}

/// The namespaces of a container's init to enter.
pub(crate) struct ContainerNamespaces {
    /// Entered by the child, in order: user first (it grants the
    /// capabilities over the others when the container has its own), mnt
    /// last.
    pub(crate) fds: Vec<OwnedFd>,
    /// Entered by the thread that spawns the child.
    pub(crate) pid: Option<OwnedFd>,
    /// Whether the container has a user namespace of its own (entered).
    pub(crate) user: bool,
}

/// Opens the namespaces of the container's init that differ from ours.
/// Unlike the host's (best effort), a namespace of the container that
/// cannot be opened is an error: the hook must not run outside it. With a
/// pidfd, the init must still be alive once they are open: then the pid
/// named it throughout, not a process that reused it.
pub(crate) fn container_namespaces(ic: &InContainer) -> Result<ContainerNamespaces, Error> {
    let pid = ic.pid;
    let mut fds = Vec::new();
    let mut pid_ns = None;
    let mut user = false;
    for ns in ["user", "cgroup", "ipc", "uts", "net", "pid", "mnt"] {
        let theirs = PathBuf::from(format!("/proc/{pid}/ns/{ns}"));
        let spawn = |source| Error::Spawn {
            path: theirs.clone(),
            source,
        };
        let target = match std::fs::read_link(&theirs) {
            Ok(t) => t,
            // A kernel without this namespace type (cgroup before 4.6).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && ns != "mnt" && ns != "pid" => {
                if std::fs::metadata(format!("/proc/{pid}")).is_err() {
                    return Err(spawn(e));
                }
                continue;
            }
            Err(e) => return Err(spawn(e)),
        };
        if std::fs::read_link(format!("/proc/self/ns/{ns}")).is_ok_and(|ours| ours == target) {
            continue;
        }
        let fd = OwnedFd::from(std::fs::File::open(&theirs).map_err(spawn)?);
        match ns {
            "pid" => pid_ns = Some(fd),
            "user" => {
                user = true;
                fds.push(fd);
            }
            _ => fds.push(fd),
        }
    }
    if let Some(pidfd) = &ic.pidfd
        && let Err(source) = alive(pidfd)
    {
        return Err(Error::Spawn {
            path: PathBuf::from(format!("/proc/{pid}")),
            source,
        });
    }
    Ok(ContainerNamespaces {
        fds,
        pid: pid_ns,
        user,
    })
}

/// `Ok` while the process behind `pidfd` lives.
fn alive(pidfd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: pidfd_send_signal(2) with signal 0 (a check, nothing sent)
    // on an fd we own, no siginfo.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "the container's process is gone ({})",
            std::io::Error::last_os_error()
        )))
    }
}

/// The identity a hook takes after entering the container's namespaces,
/// in the ids of the container's user namespace when it has its own.
#[derive(Debug, Clone, Default)]
pub(crate) struct Creds {
    pub(crate) uid: [libc::uid_t; 3],
    pub(crate) gid: [libc::gid_t; 3],
    pub(crate) groups: Vec<libc::gid_t>,
    /// Capability sets (bit masks): inheritable, permitted, effective,
    /// bounding. `None`: unchanged (root's).
    pub(crate) caps: Option<[u64; 4]>,
    /// Set `no_new_privs`.
    pub(crate) no_new_privs: bool,
}

impl Creds {
    /// Root: in the container's user namespace (0 must be mapped there),
    /// or unchanged without one (`None`).
    pub(crate) fn root(pid: u32, userns: bool) -> Result<Option<Creds>, Error> {
        if !userns {
            return Ok(None);
        }
        root_mapped(pid, "uid_map")?;
        root_mapped(pid, "gid_map")?;
        Ok(Some(Creds {
            uid: [0; 3],
            gid: [0; 3],
            ..Creds::default()
        }))
    }

    /// The identity of process `pid` (its status), translated into its
    /// user namespace when it has its own.
    pub(crate) fn of(pid: u32, userns: bool) -> Result<Creds, Error> {
        let path = PathBuf::from(format!("/proc/{pid}/status"));
        let bad = |what: &str| Error::Spawn {
            path: path.clone(),
            source: std::io::Error::other(format!("no {what} line")),
        };
        let status = std::fs::read_to_string(&path).map_err(|source| Error::Spawn {
            path: path.clone(),
            source,
        })?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name).map(str::trim))
        };
        let ids = |name: &str| -> Result<Vec<u32>, Error> {
            field(name)
                .ok_or_else(|| bad(name))?
                .split_whitespace()
                .map(|x| x.parse().map_err(|_| bad(name)))
                .collect()
        };
        let cap = |name: &str| -> Result<u64, Error> {
            u64::from_str_radix(field(name).ok_or_else(|| bad(name))?, 16).map_err(|_| bad(name))
        };
        let (uids, gids, groups) = (ids("Uid:")?, ids("Gid:")?, ids("Groups:")?);
        let (Some(&[ru, eu, su]), Some(&[rg, eg, sg])) = (uids.get(..3), gids.get(..3)) else {
            return Err(bad("Uid:/Gid:"));
        };
        let map = |file: &str, id: u32| -> Result<u32, Error> {
            if userns { in_ns(pid, file, id) } else { Ok(id) }
        };
        Ok(Creds {
            uid: [
                map("uid_map", ru)?,
                map("uid_map", eu)?,
                map("uid_map", su)?,
            ],
            gid: [
                map("gid_map", rg)?,
                map("gid_map", eg)?,
                map("gid_map", sg)?,
            ],
            groups: groups
                .into_iter()
                .map(|g| map("gid_map", g))
                .collect::<Result<_, _>>()?,
            caps: Some([
                cap("CapInh:")?,
                cap("CapPrm:")?,
                cap("CapEff:")?,
                cap("CapBnd:")?,
            ]),
            no_new_privs: true,
        })
    }
}

/// capset(2)'s header and data (`_LINUX_CAPABILITY_VERSION_3`: two
/// 32-bit halves).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

impl Creds {
    /// Takes this identity. Runs in the forked child, after the
    /// namespaces: only async-signal-safe syscalls on what `self` holds.
    pub(crate) fn apply(&self) -> std::io::Result<()> {
        let check = |r: libc::c_int| {
            if r == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        // SAFETY: setgroups(2) with the length and pointer of a Vec that
        // outlives the call.
        check(unsafe { libc::setgroups(self.groups.len(), self.groups.as_ptr()) })?;
        let [rg, eg, sg] = self.gid;
        // SAFETY: setresgid(2) on integers.
        check(unsafe { libc::setresgid(rg, eg, sg) })?;
        if let Some([_, _, _, bounding]) = self.caps {
            // SAFETY: prctl(2) with integers: keep the permitted set across
            // the uid change below, then drop what the bounding set lacks
            // (EINVAL past the kernel's last capability: ignored).
            check(unsafe { libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) })?;
            for cap in 0..64 {
                if bounding & (1 << cap) == 0 {
                    // SAFETY: as above.
                    unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
                }
            }
        }
        let [ru, eu, su] = self.uid;
        // SAFETY: setresuid(2) on integers.
        check(unsafe { libc::setresuid(ru, eu, su) })?;
        if let Some([inheritable, permitted, effective, _]) = self.caps {
            let half = |v: u64, i: usize| (v >> (32 * i)) as u32;
            let data = [0, 1].map(|i| CapData {
                effective: half(effective, i),
                permitted: half(permitted, i),
                inheritable: half(inheritable, i),
            });
            let mut header = CapHeader {
                version: CAP_VERSION_3,
                pid: 0,
            };
            // SAFETY: capset(2) with a version-3 header and two data
            // structs, both on this stack.
            let r = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
            check(r as libc::c_int)?;
            // SAFETY: prctl(2) with integers.
            unsafe {
                libc::prctl(
                    libc::PR_CAP_AMBIENT,
                    libc::PR_CAP_AMBIENT_CLEAR_ALL,
                    0,
                    0,
                    0,
                )
            };
        }
        if self.no_new_privs {
            // SAFETY: prctl(2) with integers.
            check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
        }
        Ok(())
    }
}

/// `inside outside count`: a line of a `uid_map` or `gid_map`.
type IdRange = (u64, u64, u64);

/// The lines of `pid`'s `uid_map` or `gid_map` (and the file's path).
fn id_map(pid: u32, file: &str) -> Result<(PathBuf, Vec<IdRange>), Error> {
    let path = PathBuf::from(format!("/proc/{pid}/{file}"));
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Spawn {
        path: path.clone(),
        source,
    })?;
    let lines = text
        .lines()
        .filter_map(|line| {
            let v: Vec<u64> = line
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            match v[..] {
                [inside, outside, count] => Some((inside, outside, count)),
                _ => None,
            }
        })
        .collect();
    Ok((path, lines))
}

/// Host id `host` as the user namespace of `pid` sees it.
fn in_ns(pid: u32, file: &str, host: u32) -> Result<u32, Error> {
    let (path, map) = id_map(pid, file)?;
    let h = u64::from(host);
    map.iter()
        .find(|(_, outside, count)| h >= *outside && h < outside + count)
        .and_then(|(inside, outside, _)| u32::try_from(inside + (h - outside)).ok())
        .ok_or_else(|| unmapped(&path, host))
}

/// Whether id 0 exists in the user namespace of `pid`.
fn root_mapped(pid: u32, file: &str) -> Result<(), Error> {
    let (path, map) = id_map(pid, file)?;
    if map
        .iter()
        .any(|(inside, _, count)| *inside == 0 && *count > 0)
    {
        Ok(())
    } else {
        Err(unmapped(&path, 0))
    }
}

fn unmapped(path: &Path, id: u32) -> Error {
    Error::Spawn {
        path: path.to_path_buf(),
        source: std::io::Error::other(format!(
            "id {id} has no counterpart across the container's user namespace"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(path: &str) -> Vec<u8> {
        use std::io::Read;
        let mut v = Vec::new();
        let f = std::fs::File::open(path).expect("open");
        f.take(64 << 10).read_to_end(&mut v).expect("read");
        v
    }

    #[test]
    fn only_static_programs_run_as_root_in_a_container() {
        // This test binary: dynamically linked (cargo's default).
        let me = head("/proc/self/exe");
        let e = static_program(&me).expect_err("dynamic");
        assert!(
            e.to_string().starts_with("a dynamically linked program"),
            "{e}"
        );
        let e = static_program(b"#!/bin/sh\necho hi\n").expect_err("script");
        assert!(e.to_string().starts_with("a script"), "{e}");
        assert!(static_program(b"\x7fELF").is_err(), "truncated");
        assert!(static_program(&[0u8; 128]).is_err(), "not ELF");
        // A static ELF64 header with one PT_LOAD program header.
        let mut elf = vec![0u8; 64 + 56];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        elf[32..40].copy_from_slice(&64u64.to_le_bytes());
        elf[54..56].copy_from_slice(&56u16.to_le_bytes());
        elf[56..58].copy_from_slice(&1u16.to_le_bytes());
        elf[64..68].copy_from_slice(&1u32.to_le_bytes());
        static_program(&elf).expect("static");
        // The same with PT_INTERP.
        elf[64..68].copy_from_slice(&3u32.to_le_bytes());
        assert!(static_program(&elf).is_err());
        // Program headers claimed past what was read.
        elf[32..40].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(static_program(&elf).is_err());
    }
}
