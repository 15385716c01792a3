//! What `/proc/<pid>` tells about a process: namespaces, cgroup, start
//! time, working directory. All reads are of small kernel-made files; any
//! failure is `None` (the process may be gone).

use std::path::PathBuf;

use lookout_model::Namespaces;

/// A `/proc` file read whole. `std::fs::read` asks the file its size
/// (`statx`, and `lseek` for the position), which is 0 for these, then
/// reads in 32-byte probes doubling up: eight calls for a `stat` line.
/// Here a page-sized buffer takes a `stat`, `status` or `cgroup` file in
/// one `read`, and a read that returns less than it asked for ends it.
///
/// N.B. That short read is the end only for the files read here: `stat`,
/// `status` and `cgroup` are single-record `seq_file`s, which the kernel
/// renders whole and hands out until they are consumed, and `cmdline`
/// gives as much as is asked while any is left. A multi-record `seq_file`
/// (`mountinfo`) may stop short of a record that did not fit; read those
/// to the end.
pub(crate) fn read_proc_bytes(path: &str) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    let mut bytes = vec![0; 4096];
    let mut len = 0;
    loop {
        let n = match file.read(&mut bytes[len..]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return None,
        };
        len += n;
        if len < bytes.len() {
            bytes.truncate(len);
            return Some(bytes);
        }
        bytes.resize(bytes.len() * 2, 0);
    }
}

/// [`read_proc_bytes`] as text, bytes that are not UTF-8 replaced.
///
/// N.B. not `None` for those, as `std::fs::read_to_string` would: a
/// process names itself (`prctl(PR_SET_NAME)`, `/proc/self/comm`: any
/// bytes but NUL), and that name is in `stat` and `status`. A container
/// whose init named itself `"\xff"` would read as dead, and the start-up
/// scan would skip it: hidden. The fields parsed here are ASCII; only the
/// name (and a cgroup path component) can be replaced.
pub(crate) fn read_proc(path: &str) -> Option<String> {
    let bytes = read_proc_bytes(path)?;
    Some(
        String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
    )
}

fn ns_inode(pid: u32, ns: &str) -> Option<u64> {
    parse_ns_link(&std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok()?)
}

/// The inode in a namespace link's target (`mnt:[4026531841]`).
fn parse_ns_link(target: &std::path::Path) -> Option<u64> {
    let s = target.to_str()?;
    s.split('[').nth(1)?.trim_end_matches(']').parse().ok()
}

/// The inodes of every namespace of `pid`: mnt, net, pid, user, cgroup,
/// ipc, uts and time (each `None` when unreadable: the process is gone,
/// or the kernel predates the namespace, as time before 5.6).
pub fn namespaces(pid: u32) -> Namespaces {
    namespaces_with_mnt(pid, None)
}

/// [`namespaces`], the mount namespace already known when `mnt` is
/// `Some`. One open of `/proc/<pid>/ns`, then a `readlinkat` relative to
/// it per namespace: the pid's directory is looked up once, not eight
/// times. N.B. `readlink`, not `stat`: the link's text names the inode,
/// and a `stat` follows the link into nsfs, which costs more.
pub(crate) fn namespaces_with_mnt(pid: u32, mnt: Option<u64>) -> Namespaces {
    use nix::fcntl::{OFlag, open, readlinkat};
    use nix::sys::stat::Mode;
    let mut ns = Namespaces::default();
    ns.mnt = mnt;
    let Ok(dir) = open(
        format!("/proc/{pid}/ns").as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) else {
        return ns;
    };
    let inode = |name: &str| {
        readlinkat(&dir, name)
            .ok()
            .and_then(|target| parse_ns_link(std::path::Path::new(&target)))
    };
    if ns.mnt.is_none() {
        ns.mnt = inode("mnt");
    }
    ns.net = inode("net");
    ns.pid = inode("pid");
    ns.user = inode("user");
    ns.cgroup = inode("cgroup");
    ns.ipc = inode("ipc");
    ns.uts = inode("uts");
    ns.time = inode("time");
    ns
}

/// The cgroup of `pid`: the cgroup2 (`0::`) path if there is one, else the
/// first v1 line's path. As the host renders it once
/// [`use_host_cgroup_namespace`] succeeded (`None` if the reader there
/// does not answer within a second); else as this process's cgroup
/// namespace does.
pub fn cgroup(pid: u32) -> Option<String> {
    parse_cgroup(&cgroup_text(pid)?)
}

/// `/proc/<pid>/cgroup` as [`cgroup`] reads it: in the host's cgroup
/// namespace when it can.
pub(crate) fn cgroup_text(pid: u32) -> Option<String> {
    let text = match HOST_CGROUP_READER.get() {
        // A thread that entered the host's namespace reads it itself.
        Some(_) if IN_HOST_CGROUP_NAMESPACE.get() => read_proc(&format!("/proc/{pid}/cgroup"))?,
        // N.B. no read in this process's namespace when the reader is
        // late: that path would be relative to the agent's own cgroup
        // (`/../../kubepods/...`), a wrong answer where none is honest.
        Some(reader) => reader.read(pid)?,
        None => read_proc(&format!("/proc/{pid}/cgroup"))?,
    };
    Some(text)
}

std::thread_local! {
    /// Whether this thread entered the host's cgroup namespace
    /// ([`enter_host_cgroup_namespace`]).
    static IN_HOST_CGROUP_NAMESPACE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Moves the calling thread into the host's cgroup namespace, once
/// [`use_host_cgroup_namespace`] found it differs from this process's:
/// [`cgroup`] then reads on this thread, without the hand-over to the
/// reader thread there and back (two thread wake-ups per read). For
/// threads that read a cgroup for every container and do nothing else
/// that a cgroup namespace changes: how `/proc/*/cgroup` and the cgroup
/// roots in `/proc/*/mountinfo` read, cgroup2 mounts made from the thread,
/// and the namespace of every process the thread starts (a child inherits
/// its creator's). Not for a thread that starts hooks or other programs.
///
/// Returns `Ok(false)`, and does nothing, when there is no other namespace
/// to enter (or the thread is in it already).
///
/// # Errors
/// What `setns(2)` returned (`EPERM` without `CAP_SYS_ADMIN`); the thread
/// stays where it was and [`cgroup`] hands its reads over as before.
pub fn enter_host_cgroup_namespace() -> std::io::Result<bool> {
    let Some(reader) = HOST_CGROUP_READER.get() else {
        return Ok(false);
    };
    if IN_HOST_CGROUP_NAMESPACE.get() {
        return Ok(false);
    }
    enter_cgroup_namespace(&reader.namespace)?;
    IN_HOST_CGROUP_NAMESPACE.set(true);
    Ok(true)
}

/// Reads `/proc/<pid>/cgroup` on a thread in the host's cgroup namespace.
struct HostCgroupReader {
    requests: std::sync::Mutex<std::sync::mpsc::Sender<(u32, std::sync::mpsc::SyncSender<String>)>>,
    /// The host's cgroup namespace, for threads that enter it themselves.
    namespace: std::fs::File,
}

static HOST_CGROUP_READER: std::sync::OnceLock<HostCgroupReader> = std::sync::OnceLock::new();

/// How long a cgroup read waits for the reader thread. Its reads take
/// microseconds; only a stalled machine (or a kernel holding the cgroup
/// lock, which a read in any namespace would wait for too) makes it late.
/// A stall of 100 ms (the wait before) is within what a loaded 2-core VM
/// shows.
const HOST_READ_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl HostCgroupReader {
    fn read(&self, pid: u32) -> Option<String> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.requests.lock().ok()?.send((pid, tx)).ok()?;
        rx.recv_timeout(HOST_READ_WAIT).ok()
    }
}

/// Makes [`cgroup`] read cgroup paths in the cgroup namespace of `pid`
/// (the host's init, from a pod with `hostPID`), when it is not this
/// process's. `/proc/<pid>/cgroup` shows paths relative to the *reader's*
/// cgroup namespace: a pod on a cgroup v2 node has one of its own, where
/// other containers' cgroups read `/../../kubepods/...`.
///
/// Returns `Ok(false)` when this process is already in that namespace.
/// Entering it takes `CAP_SYS_ADMIN`; one thread of this process lives
/// there and does nothing but these reads, for the threads that did not
/// enter it themselves ([`enter_host_cgroup_namespace`]).
pub fn use_host_cgroup_namespace(pid: u32) -> std::io::Result<bool> {
    let theirs = std::fs::read_link(format!("/proc/{pid}/ns/cgroup"))?;
    if std::fs::read_link("/proc/self/ns/cgroup")? == theirs {
        return Ok(false);
    }
    if HOST_CGROUP_READER.get().is_some() {
        return Ok(true);
    }
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/cgroup"))?;
    let namespace = ns.try_clone()?;
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let (tx, rx) = std::sync::mpsc::channel::<(u32, std::sync::mpsc::SyncSender<String>)>();
    std::thread::Builder::new()
        .name("lookout-cgroupns".into())
        .spawn(move || {
            let entered = enter_cgroup_namespace(&ns);
            let ok = entered.is_ok();
            let _ = ready_tx.send(entered);
            if !ok {
                return;
            }
            for (pid, reply) in rx {
                if let Some(text) = read_proc(&format!("/proc/{pid}/cgroup")) {
                    let _ = reply.try_send(text);
                }
            }
        })?;
    ready_rx
        .recv()
        .map_err(|_| std::io::Error::other("the cgroup namespace thread died"))??;
    let _ = HOST_CGROUP_READER.set(HostCgroupReader {
        requests: std::sync::Mutex::new(tx),
        namespace,
    });
    Ok(true)
}

/// `setns(fd, CLONE_NEWCGROUP)` for the calling thread only.
fn enter_cgroup_namespace(ns: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: setns takes a file descriptor we own (open for the call's
    // duration) and a flag; it changes only this thread's cgroup namespace.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWCGROUP) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The cgroup path in the text of a `/proc/<pid>/cgroup` file (see [`cgroup`]).
pub fn parse_cgroup(text: &str) -> Option<String> {
    let mut first = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(_ctrl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && path != "/" {
            return Some(path.to_owned());
        }
        if first.is_none() && path != "/" {
            first = Some(path.to_owned());
        }
    }
    first
}

/// Field 22 of `/proc/<pid>/stat`: start time in clock ticks since boot.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = read_proc(&format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat)
}

/// The start time of `pid` (as [`start_time`]) if it is alive: not a
/// zombie (`Z`) or dead (`X`). A container's init whose parent has not
/// reaped it yet still has a `/proc` entry, but it has exited.
pub fn live_start_time(pid: u32) -> Option<u64> {
    let stat = read_proc(&format!("/proc/{pid}/stat"))?;
    let state = stat[stat.rfind(')')? + 1..].split_whitespace().next()?;
    if matches!(state, "Z" | "X" | "x") {
        return None;
    }
    parse_start_time(&stat)
}

/// What [`container_init`] read of a container's init process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Init {
    /// Its pid.
    pub pid: u32,
    /// Its start time (as [`start_time`]).
    pub start_time: u64,
    /// Its mount namespace's inode.
    pub mnt: u64,
}

impl Init {
    /// Its namespace inodes, as [`namespaces`] reads them, the mount
    /// namespace from the check.
    pub fn namespaces(&self) -> Namespaces {
        namespaces_with_mnt(self.pid, Some(self.mnt))
    }
}

/// Why a process cannot be a container's init ([`container_init`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotInit {
    /// Pid 0 or 1.
    #[error("pid {0} is the host's init")]
    HostInit(u32),
    /// Gone, a zombie, or dead: a container that stopped, or a pid that was
    /// never one.
    #[error("pid {0} is not alive")]
    NotAlive(u32),
    /// Alive, but started at another time than the runtime recorded for
    /// its init: that init exited and its pid was reused.
    #[error(
        "pid {pid} started at tick {started}, not at {recorded} as the runtime recorded: reused"
    )]
    Reused {
        /// The pid.
        pid: u32,
        /// When the process now behind it started (clock ticks since boot).
        started: u64,
        /// When the runtime recorded its init started.
        recorded: u64,
    },
    /// Its `/proc/<pid>/ns/mnt` cannot be read.
    #[error("the mount namespace of pid {0} cannot be read")]
    MountNamespaceUnreadable(u32),
    /// It shares the host's mount namespace (pid 1's, or this process's
    /// without being this process or one of its ancestors).
    #[error("pid {0} is in the host's mount namespace")]
    HostMountNamespace(u32),
}

/// Why `pid`, named by a runtime's state as a container's init process,
/// cannot be one: `None` when it can (see [`container_init`]).
pub fn not_a_container_init(pid: u32) -> Option<String> {
    container_init(pid, None).err().map(|e| e.to_string())
}

/// `pid`, named by a runtime's state as a container's init process, if it
/// can be one; else why not. It must be alive (not a zombie), not pid 1,
/// started when the runtime recorded (`recorded_start`, clock ticks since
/// boot, when the state has it: runc's and crun's do), and in a mount
/// namespace of its own (neither this process's nor pid 1's, when that is
/// readable). A state file that names a host process is a spoof or a bug,
/// never a container; one that names a reused pid is of a container that
/// stopped. The start time is checked before the namespaces, so that a
/// stopped container whose pid a host process took reads as
/// [`NotInit::Reused`], not as a host process.
///
/// One exception: this process, or one of its ancestors, in this process's
/// mount namespace. That is the agent's own container (a DaemonSet's pod,
/// with the host's pids), whose init shares the agent's mount namespace.
///
/// # Errors
/// Why `pid` is no container's init.
pub fn container_init(pid: u32, recorded_start: Option<u64>) -> Result<Init, NotInit> {
    if pid <= 1 {
        return Err(NotInit::HostInit(pid));
    }
    let Some(start_time) = live_start_time(pid) else {
        return Err(NotInit::NotAlive(pid));
    };
    if let Some(recorded) = recorded_start.filter(|&at| at != start_time) {
        return Err(NotInit::Reused {
            pid,
            started: start_time,
            recorded,
        });
    }
    let Some(mnt) = ns_inode(pid, "mnt") else {
        // Most often it exited in between.
        return Err(if live_start_time(pid).is_none() {
            NotInit::NotAlive(pid)
        } else {
            NotInit::MountNamespaceUnreadable(pid)
        });
    };
    let (own, host) = fixed_mount_namespaces();
    if Some(mnt) == host || (Some(mnt) == own && !is_self_or_ancestor(pid)) {
        return Err(NotInit::HostMountNamespace(pid));
    }
    Ok(Init {
        pid,
        start_time,
        mnt,
    })
}

/// This process's mount namespace and pid 1's (`None`: not readable), read
/// once. Neither changes while the agent runs: lookout never calls
/// `unshare(2)` or `setns(2)` for a mount namespace, and pid 1 never leaves
/// its own. Read for every container before, they were two path walks
/// through `/proc` on the path from a `create`'s exit to its `added`.
///
/// N.B. Only an answer is kept: a value read, or pid 1's namespace refused
/// to this process (`EACCES`: no ptrace access to pid 1, for good). Any
/// other failure (`ENOMEM`) is read again next time: kept, it would turn
/// the check against pid 1's namespace off for the agent's life.
fn fixed_mount_namespaces() -> (Option<u64>, Option<u64>) {
    use std::sync::OnceLock;
    static OWN: OnceLock<Option<u64>> = OnceLock::new();
    static HOST: OnceLock<Option<u64>> = OnceLock::new();
    /// The inode of the namespace `link` names; `None` if it is for good.
    fn read(link: &str) -> Result<Option<u64>, ()> {
        match std::fs::read_link(link) {
            Ok(target) => Ok(parse_ns_link(&target)),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Ok(None),
            Err(_) => Err(()),
        }
    }
    let once = |cell: &OnceLock<Option<u64>>, link: &str| match cell.get() {
        Some(v) => *v,
        None => match read(link) {
            Ok(v) => *cell.get_or_init(|| v),
            Err(()) => None,
        },
    };
    (
        once(&OWN, "/proc/self/ns/mnt"),
        once(&HOST, "/proc/1/ns/mnt"),
    )
}

/// Whether `mnt` is the host's mount namespace (pid 1's, when it can be
/// read) or this process's own: a namespace no container has to itself.
pub fn is_host_mount_namespace(mnt: u64) -> bool {
    let (own, host) = fixed_mount_namespaces();
    Some(mnt) == own || Some(mnt) == host
}

/// Whether `pid` is this process or one of its ancestors (as this pid
/// namespace numbers them).
fn is_self_or_ancestor(pid: u32) -> bool {
    let mut p = std::process::id();
    // A parent chain is short; the bound only guards against a loop.
    for _ in 0..64 {
        if p == pid {
            return true;
        }
        if p <= 1 {
            return false;
        }
        let Some(parent) = read_proc(&format!("/proc/{p}/stat")).and_then(|stat| {
            let rest = &stat[stat.rfind(')')? + 1..];
            rest.split_whitespace().nth(1)?.parse().ok()
        }) else {
            return false;
        };
        p = parent;
    }
    false
}

/// The real uid of `pid` (the first `Uid:` field of its status), as the
/// reader's user namespace sees it.
pub fn real_uid(pid: u32) -> Option<u32> {
    caller(pid).map(|c| c.real_uid)
}

/// Who a process is, as far as deciding whether it may act as the node's
/// root goes: from one read of its `/proc/<pid>/status`, which any user
/// may read (unlike `/proc/<pid>/ns/*`, which needs ptrace access).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// The real uid (the first `Uid:` field), as the reader's user
    /// namespace sees it.
    pub real_uid: u32,
    /// Whether it runs in a pid namespace below the one this `/proc` was
    /// mounted for: its `NSpid:` line lists more than one id, as for every
    /// process of a container that does not share the node's pid
    /// namespace. (Kernels before 4.1 have no `NSpid:`: `false`.)
    pub nested_pid_ns: bool,
}

/// [`Caller`] of `pid`, or `None` if its status cannot be read.
pub fn caller(pid: u32) -> Option<Caller> {
    parse_caller(&read_proc(&format!("/proc/{pid}/status"))?)
}

/// [`Caller`] from the text of a `/proc/<pid>/status` file.
pub fn parse_caller(status: &str) -> Option<Caller> {
    let mut real_uid = None;
    let mut nested_pid_ns = false;
    for line in status.lines() {
        if let Some(v) = line.strip_prefix("Uid:") {
            real_uid = v.split_whitespace().next()?.parse().ok();
        } else if let Some(v) = line.strip_prefix("NSpid:") {
            nested_pid_ns = v.split_whitespace().count() > 1;
        }
    }
    Some(Caller {
        real_uid: real_uid?,
        nested_pid_ns,
    })
}

/// The pid of `pid` in its own (innermost) pid namespace: what
/// `getpid()` returns inside its container (1 for a container's init),
/// the pid a runtime gives the hooks it runs in the container's
/// namespaces. `None` if its status cannot be read.
pub fn innermost_pid(pid: u32) -> Option<u32> {
    parse_innermost_pid(&read_proc(&format!("/proc/{pid}/status"))?)
}

/// The last id of the `NSpid:` line of a `/proc/<pid>/status` text (the
/// innermost namespace's); `None` without one (kernels before 4.1).
pub fn parse_innermost_pid(status: &str) -> Option<u32> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// Field 22 of the text of a `/proc/<pid>/stat` file.
pub fn parse_start_time(stat: &str) -> Option<u64> {
    // comm may contain spaces and parentheses: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ")" come fields 3.. ; starttime is field 22 -> index 19 here.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The working directory of `pid`.
pub fn cwd(pid: u32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/cwd")).ok()
}

/// argv of `pid` from `/proc/<pid>/cmdline`.
pub fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = read_proc_bytes(&format!("/proc/{pid}/cmdline"))?;
    Some(
        raw.split(|&b| b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_that_names_itself_in_bytes_that_are_not_utf8_is_still_read() {
        // sh names itself "\xff\xfe) Z 1 (" (a parenthesis and a fake state
        // too) and waits: alive, with a start time, a parent and a uid.
        let mut child = std::process::Command::new("/bin/sh")
            .args([
                "-c",
                "printf '\\377\\376) Z 1 (' > /proc/$$/comm && echo named && sleep 10; exit 0",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
            &mut line,
        )
        .expect("read");
        let pid = child.id();
        let comm = std::fs::read(format!("/proc/{pid}/comm")).unwrap_or_default();
        let named = line.trim() == "named";
        let alive = live_start_time(pid);
        let started = start_time(pid);
        let uid = real_uid(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert!(named, "sh could not rename itself: {line:?}");
        assert!(comm.starts_with(b"\xff\xfe)"), "{comm:?}");
        assert!(alive.is_some(), "a renamed process reads as dead");
        assert_eq!(alive, started);
        // SAFETY: getuid has no preconditions.
        assert_eq!(uid, Some(unsafe { libc::getuid() }));
    }

    #[test]
    fn a_caller_in_a_nested_pid_namespace_is_told_apart() {
        let host = "Name:\tsh\nUid:\t0\t0\t0\t0\nNSpid:\t4242\n";
        assert_eq!(
            parse_caller(host),
            Some(Caller {
                real_uid: 0,
                nested_pid_ns: false
            })
        );
        let pod = "Uid:\t0\t0\t0\t0\nNStgid:\t4243\t1\nNSpid:\t4243\t1\n";
        assert_eq!(parse_caller(pod).map(|c| c.nested_pid_ns), Some(true));
        assert_eq!(parse_innermost_pid(pod), Some(1));
        assert_eq!(parse_innermost_pid(host), Some(4242));
        assert_eq!(parse_innermost_pid("NSpid:\t9\t7\tx\n"), None);
        assert_eq!(parse_innermost_pid("Uid:\t0\n"), None);
        // A kernel without NSpid (before 4.1): not nested, as far as known.
        assert_eq!(
            parse_caller("Uid:\t1000\t1000\t1000\t1000\n"),
            Some(Caller {
                real_uid: 1000,
                nested_pid_ns: false
            })
        );
        assert_eq!(parse_caller("NSpid:\t1\n"), None, "no uid, no caller");
        assert_eq!(parse_caller("Uid:\tx\n"), None);
        // And this process.
        let me = caller(std::process::id()).expect("own status");
        // SAFETY: getuid has no preconditions.
        assert_eq!(me.real_uid, unsafe { libc::getuid() });
    }

    #[test]
    fn proc_files_longer_than_the_first_page_are_read_whole() {
        // A command line of 3 x 3000 bytes: more than the one page the
        // read starts with (sh keeps its arguments while it waits).
        let arg = "x".repeat(3000);
        let mut child = std::process::Command::new("/bin/sh")
            .args(["-c", "sleep 10; :", &arg, &arg, &arg])
            .spawn()
            .expect("spawn sh");
        let path = format!("/proc/{}/cmdline", child.id());
        // Until the exec is through, the cmdline is the test's own.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !std::fs::read(&path).is_ok_and(|b| b.starts_with(b"/bin/sh\0-c"))
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let ours = read_proc_bytes(&path);
        let std = std::fs::read(&path).ok();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(ours, std);
        assert!(ours.is_some_and(|b| b.len() > 9000));
        let line = read_proc(&format!("/proc/{}/stat", std::process::id())).expect("stat");
        assert!(
            line.starts_with(&format!("{} (", std::process::id())),
            "{line}"
        );
        assert!(read_proc("/proc/no-such-pid/stat").is_none());
    }

    #[test]
    fn cgroup_prefers_unified() {
        let v1 = "12:memory:/runc/c1\n11:cpu:/runc/c1\n0::/runc/c1u\n";
        assert_eq!(parse_cgroup(v1).as_deref(), Some("/runc/c1u"));
        assert_eq!(parse_cgroup("3:cpu:/a\n0::/\n").as_deref(), Some("/a"));
        assert_eq!(parse_cgroup("garbage").as_deref(), None);
    }

    #[test]
    fn start_time_survives_odd_comm() {
        let stat = "123 (we ird) name)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 4242 99";
        assert_eq!(parse_start_time(stat), Some(4242));
        assert_eq!(parse_start_time("123 (x) S 1"), None);
    }

    #[test]
    fn a_container_init_is_alive_and_not_in_the_hosts_mount_namespace() {
        let me = std::process::id();
        let started = start_time(me).expect("own start time");
        // This process is itself (the agent's own container), unless it
        // shares pid 1's mount namespace, where pid 1's is readable: then it
        // is a host process like any other.
        let host = std::fs::read_link("/proc/1/ns/mnt").ok();
        let ours = std::fs::read_link("/proc/self/ns/mnt").expect("own mnt");
        if host.as_ref() == Some(&ours) {
            assert_eq!(
                container_init(me, None),
                Err(NotInit::HostMountNamespace(me))
            );
        } else {
            let init = container_init(me, None).expect("this process");
            assert_eq!(init.pid, me);
            assert_eq!(init.start_time, started);
            assert_eq!(init.namespaces(), namespaces(me));
            assert_eq!(container_init(me, Some(started)), Ok(init));
        }
        // Started at another time than recorded: reused, whatever else.
        assert_eq!(
            container_init(me, Some(started + 1)),
            Err(NotInit::Reused {
                pid: me,
                started,
                recorded: started + 1
            })
        );
        assert_eq!(container_init(1, None), Err(NotInit::HostInit(1)));
        assert_eq!(container_init(0, None), Err(NotInit::HostInit(0)));
        // A child in this mount namespace is a host process; once it
        // exited (a zombie, not reaped), not alive.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = child.id();
        assert_eq!(
            container_init(pid, None),
            Err(NotInit::HostMountNamespace(pid))
        );
        assert_eq!(
            not_a_container_init(pid).as_deref(),
            Some(format!("pid {pid} is in the host's mount namespace").as_str())
        );
        child.kill().expect("kill");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while live_start_time(pid).is_some() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert_eq!(container_init(pid, None), Err(NotInit::NotAlive(pid)));
        let _ = child.wait();
    }

    #[test]
    fn reads_own_process() {
        let me = std::process::id();
        assert!(start_time(me).is_some());
        assert!(namespaces(me).mnt.is_some());
        assert_eq!(cwd(me), std::env::current_dir().ok());
    }
}
