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
    /// Enter the namespaces of this process (pid 1 for the host's, from a
    /// pod with `hostPID`) before exec: mnt, net, ipc, uts. `None`: stay in
    /// ours.
    pub namespaces_of: Option<u32>,
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
        .map_or(opts.default_timeout, |t| Duration::from_secs(t as u64));
    let (namespaces, enters_mnt) = match opts.namespaces_of {
        Some(pid) => open_namespaces(pid),
        None => (Vec::new(), false),
    };
    // In the host's mount namespace already, but under another root (a
    // chrooted agent): the hook enters the host process's root instead.
    let root = match opts.namespaces_of {
        Some(pid) if !enters_mnt => other_root(pid),
        _ => None,
    };
    let in_host = enters_mnt || root.is_some();
    // Host paths: as they are in the host's mount namespace, or else under
    // `host_root` from ours, the host's symlinks followed there.
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
    let cwd =
        std::ffi::CString::new(cwd.into_os_string().into_vec()).unwrap_or_else(|_| c"/".into());
    let mut cmd = tokio::process::Command::new(&program);
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
    let ns_fds: Vec<RawFd> = namespaces.iter().map(AsRawFd::as_raw_fd).collect();
    let root_fd: Option<RawFd> = root.as_ref().map(AsRawFd::as_raw_fd);
    let close = opts.close_fds.clone();
    // SAFETY: the closure runs in the forked child before exec and calls
    // only async-signal-safe syscalls (close, setns, fchdir, chroot, chdir)
    // on plain integers and on C strings allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &close {
                libc::close(*fd);
            }
            for fd in &ns_fds {
                if libc::setns(*fd, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(fd) = root_fd
                && (libc::fchdir(fd) != 0 || libc::chroot(c".".as_ptr()) != 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            // After setns: entering a mount namespace moved us to its root.
            if libc::chdir(cwd.as_ptr()) != 0 {
                libc::chdir(c"/".as_ptr());
            }
            Ok(())
        });
    }
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|source| Error::Spawn {
        path: path.clone(),
        source,
    })?;
    drop(namespaces);
    drop(root);
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
