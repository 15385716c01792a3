//! Running one hook program: the State on stdin, a timeout after which
//! its whole process group is killed and reaped, bounded output capture.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use oci_spec::runtime::{Hook, State};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::Error;
use crate::container::{Creds, InContainer, PathIn};

/// How to run hooks. Start from [`RunOptions::default`] and set fields;
/// more options may be added.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RunOptions {
    /// The timeout when the hook has none of its own.
    pub default_timeout: Duration,
    /// The working directory (the runtime spec defines none; runc-hook
    /// style programs expect the bundle), as the hook's mount namespace
    /// sees it. Entered after the namespaces: `setns` into a mount
    /// namespace resets the working directory to its root. `/` when it
    /// is not a directory there.
    pub cwd: PathBuf,
    /// Where the `/` of the namespaces in [`RunOptions::namespaces_of`] is
    /// in this process's mount namespace (`/host` in a DaemonSet). When
    /// the hook cannot enter that mount namespace, its path and `cwd` are
    /// taken under this root. `/` by default.
    pub host_root: PathBuf,
    /// Bytes of stdout and of stderr kept; the rest is read and dropped.
    pub output_limit: usize,
    /// File descriptors to close in the child before it execs. N.B. give
    /// the fanotify group here: a child that still holds it while it execs
    /// a marked runtime binary keeps the group alive, and the kernel's
    /// "listener gone, allow everything" safety net with it.
    pub close_fds: Vec<RawFd>,
    /// No hook runs longer than this, whatever its own timeout (what is
    /// left of a container's start budget). `None`: no cap.
    pub max_timeout: Option<Duration>,
    /// Enter the namespaces of this process (pid 1 for the host's, from a
    /// pod with `hostPID`) before exec: mnt, net, ipc, uts. `None`: stay in
    /// ours. Not used with [`RunOptions::container`].
    pub namespaces_of: Option<u32>,
    /// Run the hook in a container's namespaces (the runtime spec's
    /// `createContainer` and `startContainer` stages) instead of the
    /// host's. `cwd` is then ignored: the hook starts in the container's
    /// `/`.
    pub container: Option<InContainer>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            default_timeout: Duration::from_secs(10),
            cwd: PathBuf::from("/"),
            host_root: PathBuf::from("/"),
            output_limit: 64 * 1024,
            close_fds: Vec::new(),
            namespaces_of: None,
            container: None,
            max_timeout: None,
        }
    }
}

/// What happened to a hook.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Outcome {
    /// How it ended (`None` if it could not be waited for).
    pub status: Option<ExitStatus>,
    /// Whether it was killed at the timeout.
    pub timed_out: bool,
    /// From spawn to reaped.
    pub duration: Duration,
    /// Its stdout, up to the limit (lossy UTF-8).
    pub stdout: String,
    /// Its stderr, up to the limit (lossy UTF-8).
    pub stderr: String,
    /// Whether output was cut at the limit.
    pub truncated: bool,
}

impl Outcome {
    /// Exit status 0 within the timeout.
    pub fn success(&self) -> bool {
        !self.timed_out && self.status.is_some_and(|s| s.success())
    }

    /// `exit 3`, `signal 9`, `timed out after 1s`, for logs.
    pub fn describe(&self) -> String {
        if self.timed_out {
            return format!("timed out after {:?} and was killed", self.duration);
        }
        match self.status {
            Some(s) => match (s.code(), s.signal()) {
                (Some(c), _) => format!("exit {c}"),
                (None, Some(sig)) => format!("signal {sig}"),
                _ => "unknown status".into(),
            },
            None => "not waited for".into(),
        }
    }
}

/// Reads everything from `r`, keeping the first `limit` bytes.
async fn capture(mut r: impl AsyncRead + Unpin, limit: usize) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    let mut cut = false;
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = limit.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
                cut |= n > room;
            }
        }
    }
    (kept, cut)
}

/// The namespaces of `pid` that differ from ours and can be entered, and
/// whether the mount namespace is one of them.
fn open_namespaces(pid: u32) -> (Vec<OwnedFd>, bool) {
    let mut fds = Vec::new();
    let mut mnt = false;
    for ns in ["ipc", "uts", "net", "mnt"] {
        let theirs = format!("/proc/{pid}/ns/{ns}");
        let ours = format!("/proc/self/ns/{ns}");
        match (std::fs::read_link(&theirs), std::fs::read_link(&ours)) {
            // Already there: setns would be a no-op that needs privileges.
            (Ok(a), Ok(b)) if a == b => continue,
            (Ok(_), _) => {}
            // Not ours to inspect (no CAP_SYS_PTRACE over it, or a VM init
            // that hides itself): stay where we are, and say so.
            (Err(e), _) => {
                tracing::debug!(ns, pid, %e, "cannot inspect the namespace; the hook runs in ours");
                continue;
            }
        }
        match std::fs::File::open(&theirs) {
            Ok(f) => {
                mnt |= ns == "mnt";
                fds.push(OwnedFd::from(f));
            }
            Err(e) => {
                tracing::warn!(ns, pid, %e, "cannot enter the namespace; the hook runs in ours");
            }
        }
    }
    (fds, mnt)
}

/// `/proc/<pid>/root`, opened, when it is not our own root: the agent
/// runs chrooted (a chroot, systemd's `RootDirectory=`) in the mount
/// namespace of `pid`. Entering it needs CAP_SYS_CHROOT.
fn other_root(pid: u32) -> Option<OwnedFd> {
    use std::os::unix::fs::MetadataExt;
    let theirs = std::fs::metadata(format!("/proc/{pid}/root")).ok()?;
    let ours = std::fs::metadata("/proc/self/root").ok()?;
    if (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino()) {
        return None;
    }
    match std::fs::File::open(format!("/proc/{pid}/root")) {
        Ok(f) => Some(OwnedFd::from(f)),
        Err(e) => {
            tracing::warn!(pid, %e, "cannot enter the root of the host's process; the hook runs in ours");
            None
        }
    }
}

/// What a hook's child process does after the fork, before exec.
#[derive(Default)]
struct ChildSetup {
    /// Closed first.
    close: Vec<RawFd>,
    /// Namespaces entered, in order.
    namespaces: Vec<RawFd>,
    /// A root directory to enter after them.
    root: Option<RawFd>,
    /// The working directory, entered last (entering a mount namespace
    /// moves to its root); `/` if it cannot be.
    cwd: Option<std::ffi::CString>,
    /// Exec this open file instead of the program's path.
    exec: Option<ExecFd>,
    /// Not dumpable from the fork on (a hook that enters a container:
    /// nothing there may ptrace it before it execs).
    undumpable: bool,
    /// The identity taken after the namespaces.
    creds: Option<Creds>,
}

impl ChildSetup {
    /// Runs in the forked child. Only async-signal-safe syscalls, on
    /// integers and on C strings and pointer arrays made before the fork.
    fn run(&self) -> std::io::Result<()> {
        let check = |r: libc::c_int| {
            if r == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        if self.undumpable {
            // SAFETY: prctl(2) PR_SET_DUMPABLE with an integer.
            check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })?;
        }
        for fd in &self.close {
            // SAFETY: close(2) on an integer; a wrong one only fails.
            unsafe { libc::close(*fd) };
        }
        for fd in &self.namespaces {
            // SAFETY: setns(2) on a namespace fd the parent keeps open.
            check(unsafe { libc::setns(*fd, 0) })?;
        }
        if let Some(c) = &self.creds {
            c.apply()?;
        }
        if let Some(fd) = self.root {
            // SAFETY: fchdir(2) on a directory fd the parent keeps open,
            // then chroot(2) on a static C string.
            check(unsafe { libc::fchdir(fd) })?;
            // SAFETY: as above.
            check(unsafe { libc::chroot(c".".as_ptr()) })?;
        }
        if let Some(cwd) = &self.cwd {
            // SAFETY: chdir(2) on C strings that outlive the call.
            if unsafe { libc::chdir(cwd.as_ptr()) } != 0 {
                // SAFETY: as above.
                unsafe { libc::chdir(c"/".as_ptr()) };
            }
        }
        if let Some(e) = &self.exec {
            // Kept across exec: an interpreter (`#!`) reads the script
            // through /dev/fd/N.
            // SAFETY: fcntl(2) F_SETFD on an fd the parent keeps open.
            unsafe { libc::fcntl(e.fd, libc::F_SETFD, 0) };
            // SAFETY: execveat(2) with NULL-terminated arrays of pointers
            // into C strings owned by `e`, all made before the fork; it
            // only returns on failure.
            unsafe {
                libc::syscall(
                    libc::SYS_execveat,
                    e.fd,
                    c"".as_ptr(),
                    e.argv_ptrs.as_ptr(),
                    e.envp_ptrs.as_ptr(),
                    libc::AT_EMPTY_PATH,
                )
            };
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// An open program and the argv and environment to exec it with, as the
/// NULL-terminated arrays execveat(2) takes.
struct ExecFd {
    fd: RawFd,
    _argv: Vec<std::ffi::CString>,
    _envp: Vec<std::ffi::CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp_ptrs: Vec<*const libc::c_char>,
}

// SAFETY: the pointers point into the CStrings owned by the same value,
// never written through; they are only read by execveat in the child.
unsafe impl Send for ExecFd {}
// SAFETY: as for Send: read-only.
unsafe impl Sync for ExecFd {}

impl ExecFd {
    fn new(fd: RawFd, hook: &Hook, path: &Path) -> ExecFd {
        let c = |s: &[u8]| std::ffi::CString::new(s).ok();
        let argv: Vec<std::ffi::CString> = match hook.args().as_deref() {
            Some(a) if !a.is_empty() => a.iter().filter_map(|x| c(x.as_bytes())).collect(),
            _ => c(path.as_os_str().as_encoded_bytes()).into_iter().collect(),
        };
        let envp: Vec<std::ffi::CString> = hook
            .env()
            .iter()
            .flatten()
            .filter(|kv| kv.split_once('=').is_some_and(|(k, _)| !k.is_empty()))
            .filter_map(|kv| c(kv.as_bytes()))
            .collect();
        let ptrs = |v: &[std::ffi::CString]| {
            v.iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect::<Vec<_>>()
        };
        ExecFd {
            fd,
            argv_ptrs: ptrs(&argv),
            envp_ptrs: ptrs(&envp),
            _argv: argv,
            _envp: envp,
        }
    }
}

/// What the spawning thread keeps open until the child is forked: the
/// namespaces the child enters, its program's copy, and the pid namespace
/// the thread enters for its children.
type SpawnHeld = (
    Vec<OwnedFd>,
    Option<std::sync::Arc<OwnedFd>>,
    Option<OwnedFd>,
);

/// Spawns `cmd` from a thread of its own, which first enters the pid
/// namespace `held.2` for its children when there is one (setns(2) on a
/// pid namespace changes only where the caller's children go) and ends
/// with the spawn, so nothing else forks from it. `None` when the spawn
/// did not return within `timeout` (its exec is stuck in the container's
/// file system): the child, if it ever comes, is killed on drop.
async fn spawn_on_thread(
    mut cmd: tokio::process::Command,
    held: SpawnHeld,
    timeout: Duration,
) -> std::io::Result<Option<tokio::process::Child>> {
    let handle = tokio::runtime::Handle::current();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("lookout-hook".into())
        .spawn(move || {
            let _in_runtime = handle.enter();
            let (_fds, _program, pid_ns) = held;
            if let Some(ns) = &pid_ns {
                // SAFETY: setns(2) on a namespace fd this thread owns.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWPID) } != 0 {
                    let _ = tx.send(Err(std::io::Error::last_os_error()));
                    return;
                }
            }
            let _ = tx.send(cmd.spawn());
        })?;
    match tokio::time::timeout(timeout, rx).await {
        Ok(Ok(spawned)) => spawned.map(Some),
        Ok(Err(_)) => Err(std::io::Error::other("the spawning thread ended")),
        Err(_) => Ok(None),
    }
}

/// Runs `hook` with `state` on stdin.
///
/// The hook gets `hook.args` as its argv (`args[0]` is argv\[0\], as with
/// execv), exactly `hook.env` as its environment (none when unset, like
/// containers/common), and `opts.cwd`. It runs in its own process group;
/// at the timeout (`hook.timeout` seconds, else `opts.default_timeout`) the
/// whole group is killed with SIGKILL and the hook reaped.
pub async fn run_hook(hook: &Hook, state: &State, opts: &RunOptions) -> Result<Outcome, Error> {
    let path = hook.path().clone();
    let input = serde_json::to_vec(state).map_err(Error::Encode)?;
    let timeout = hook
        .timeout()
        .filter(|t| *t > 0)
        .map_or(opts.default_timeout, |t| Duration::from_secs(t as u64))
        .min(opts.max_timeout.unwrap_or(Duration::MAX));
    let mut cmd;
    // What the child does between fork and exec, prepared here: after the
    // fork only async-signal-safe calls on what exists already.
    let mut child = ChildSetup {
        close: opts.close_fds.clone(),
        ..ChildSetup::default()
    };
    // Kept open until the child is spawned.
    let mut held: Vec<OwnedFd> = Vec::new();
    let mut program_copy: Option<std::sync::Arc<OwnedFd>> = None;
    let mut pid_ns = None;
    match &opts.container {
        Some(ic) => {
            let entered = crate::container::container_namespaces(ic)?;
            child.namespaces = entered.fds.iter().map(AsRawFd::as_raw_fd).collect();
            child.undumpable = true;
            child.creds = match ic.path_in {
                PathIn::Host => Creds::root(ic.pid, entered.user)?,
                PathIn::Container => Some(Creds::of(ic.pid, entered.user)?),
            };
            held.extend(entered.fds);
            pid_ns = entered.pid;
            cmd = match ic.path_in {
                PathIn::Container => tokio::process::Command::new(&path),
                PathIn::Host => {
                    let here = lookout_host::resolve_in_root(&opts.host_root, &path)
                        .unwrap_or_else(|_| lookout_host::host_path(&opts.host_root, &path));
                    let program =
                        crate::container::open_program(&here).map_err(|source| Error::Spawn {
                            path: path.clone(),
                            source,
                        })?;
                    child.exec = Some(ExecFd::new(program.as_raw_fd(), hook, &path));
                    program_copy = Some(program);
                    // Never exec'd: the child execs the open file itself.
                    tokio::process::Command::new(&path)
                }
            };
            child.cwd = Some(c"/".into());
        }
        None => {
            let (namespaces, enters_mnt) = match opts.namespaces_of {
                Some(pid) => open_namespaces(pid),
                None => (Vec::new(), false),
            };
            // In the host's mount namespace already, but under another
            // root (a chrooted agent): the hook enters the host process's
            // root instead.
            let root = match opts.namespaces_of {
                Some(pid) if !enters_mnt => other_root(pid),
                _ => None,
            };
            let in_host = enters_mnt || root.is_some();
            // Host paths: as they are in the host's mount namespace, or else
            // under `host_root` from ours, the host's symlinks followed there.
            let here = |p: &Path| {
                lookout_host::resolve_in_root(&opts.host_root, p)
                    .unwrap_or_else(|_| lookout_host::host_path(&opts.host_root, p))
            };
            let program = if in_host { path.clone() } else { here(&path) };
            let cwd = if in_host {
                opts.cwd.clone()
            } else {
                here(&opts.cwd)
            };
            child.cwd = Some(
                std::ffi::CString::new(cwd.into_os_string().into_vec())
                    .unwrap_or_else(|_| c"/".into()),
            );
            child.namespaces = namespaces.iter().map(AsRawFd::as_raw_fd).collect();
            child.root = root.as_ref().map(AsRawFd::as_raw_fd);
            held.extend(namespaces);
            held.extend(root);
            cmd = tokio::process::Command::new(&program);
        }
    }
    if let Some((first, rest)) = hook.args().as_deref().and_then(|a| a.split_first()) {
        cmd.arg0(first);
        cmd.args(rest);
    }
    cmd.env_clear();
    for kv in hook.env().iter().flatten() {
        match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                cmd.env(k, v);
            }
            _ => tracing::debug!(entry = kv, "hook env entry without '=' ignored"),
        }
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: the closure runs in the forked child before exec and calls
    // only async-signal-safe syscalls on plain integers, C strings and
    // pointer arrays allocated before the fork (ChildSetup::run).
    unsafe {
        cmd.pre_exec(move || child.run());
    }
    let started = Instant::now();
    let spawned = if opts.container.is_some() {
        // Its exec looks the program (or an interpreter) up in the
        // container's file system, which may never answer: off this
        // runtime, within the hook's timeout.
        spawn_on_thread(cmd, (held, program_copy, pid_ns), timeout).await
    } else {
        drop(program_copy);
        let child = cmd.spawn();
        drop(held);
        child.map(Some)
    };
    let spawned = spawned.map_err(|source| Error::Spawn {
        path: path.clone(),
        source,
    })?;
    let Some(mut child) = spawned else {
        return Ok(Outcome {
            status: None,
            timed_out: true,
            duration: started.elapsed(),
            stdout: String::new(),
            stderr: String::new(),
            truncated: false,
        });
    };
    let pgid = child.id();
    if let Some(mut stdin) = child.stdin.take() {
        // A hook that does not read its stdin must not block us: write
        // from a task, and ignore EPIPE.
        tokio::spawn(async move {
            let _ = stdin.write_all(&input).await;
            let _ = stdin.shutdown().await;
        });
    }
    let out = child
        .stdout
        .take()
        .map(|o| tokio::spawn(capture(o, opts.output_limit)));
    let err = child
        .stderr
        .take()
        .map(|e| tokio::spawn(capture(e, opts.output_limit)));
    let (status, timed_out) = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(s) => (s.ok(), false),
        Err(_) => {
            if let Some(pg) = pgid {
                // SAFETY: kill(2) on the process group we created.
                unsafe { libc::kill(-(pg as i32), libc::SIGKILL) };
            }
            let _ = child.start_kill();
            (child.wait().await.ok(), true)
        }
    };
    let duration = started.elapsed();
    // Output of descendants that outlive the hook is not waited for long.
    let collect = |h: Option<tokio::task::JoinHandle<(Vec<u8>, bool)>>| async move {
        match h {
            Some(h) => {
                let abort = h.abort_handle();
                match tokio::time::timeout(Duration::from_millis(200), h).await {
                    Ok(Ok(v)) => v,
                    _ => {
                        abort.abort();
                        (Vec::new(), false)
                    }
                }
            }
            None => (Vec::new(), false),
        }
    };
    let (stdout, cut_out) = collect(out).await;
    let (stderr, cut_err) = collect(err).await;
    Ok(Outcome {
        status,
        timed_out,
        duration,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        truncated: cut_out || cut_err,
    })
}
