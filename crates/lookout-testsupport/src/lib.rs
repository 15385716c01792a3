//! Test support shared by lookout's crates.
//!
//! - [`skip`] and [`require_root`]: a test whose prerequisite is missing
//!   prints a loud `SKIPPED` line and returns, except under CI (`CI=true`),
//!   where it fails: CI runs as root with every package installed, so a skip
//!   there is a broken environment, not a pass.
//! - [`Restrictions`]: run a child process the way an unprivileged or
//!   sandboxed node would, with a seccomp filter that makes chosen syscalls
//!   fail with a chosen errno, and with capabilities removed.
//! - [`apiserver::ApiServer`]: a Kubernetes API server speaking the Pod
//!   list/watch protocol over real HTTP, recording posted Events, and
//!   [`apiserver::PodJson`] for pods shaped like a real cluster's.
//! - [`install_executable`]: copy a program that a test will run without
//!   this multi-threaded process ever holding it open for writing (the
//!   `ETXTBSY` race).
//! - [`wait_until`]: wait for a condition, with a deadline.
//! - [`cmd`]: the tooling's commands, each printed, each failure naming its
//!   step and its fix.
//! - [`cri::CriNode`]: a real CRI node (containerd 1.7 with NRI, on private
//!   sockets) and a kubelet-like CRI client.
//! - [`podman::Podman`]: a private podman (4.3.1 with runc 1.1.5), the
//!   reference for hooks.d directories, and [`podman::Recorder`], a hook
//!   that records each stage's namespace, State and time.
#![deny(missing_docs)]

pub mod apiserver;
pub mod cmd;
pub mod cri;
pub mod perf;
pub mod podman;

use std::io;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// Waits until `cond` holds, looking every 5 ms, for at most `timeout`,
/// and returns how long that took. Panics with `what()` (built only then)
/// if it never does. A test waits for a condition with a deadline, never
/// for a fixed time: what another process or thread produces can lag on a
/// loaded machine.
///
/// ```
/// use std::time::Duration;
/// let start = std::time::Instant::now();
/// lookout_testsupport::wait_until(
///     Duration::from_secs(5),
///     || start.elapsed() > Duration::from_millis(20),
///     || "time never passed".into(),
/// );
/// ```
#[track_caller]
pub fn wait_until(
    timeout: std::time::Duration,
    mut cond: impl FnMut() -> bool,
    what: impl FnOnce() -> String,
) -> std::time::Duration {
    let start = std::time::Instant::now();
    while !cond() {
        if start.elapsed() > timeout {
            panic!("not within {timeout:?}: {}", what());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    start.elapsed()
}

/// Whether we run under CI (`CI` set to anything but `false`/`0`/empty).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Reports a skipped test. Panics under CI.
pub fn skip(test: &str, reason: &str) {
    if in_ci() {
        panic!("{test}: prerequisite missing under CI: {reason}");
    }
    eprintln!("\n!!! SKIPPED {test}: {reason}\n");
}

/// Whether the test process is root. If not, reports `test` as skipped.
pub fn require_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        skip(test, "needs root (run `sudo -E cargo xtask test`)");
    }
    root
}

/// Whether `program` is on PATH. If not, reports `test` as skipped.
pub fn require_program(test: &str, program: &str) -> bool {
    let found = find_program(program).is_some();
    if !found {
        skip(test, &format!("`{program}` is not installed"));
    }
    found
}

/// Debian 13's runsc (release 20240729), which `cargo xtask test` fetches
/// from Debian's archive and extracts beside the system's (Debian 12's):
/// `$LOOKOUT_RUNSC_NEXT`, else `<cache>/runsc-trixie/root/usr/bin/runsc`,
/// the cache being `$LOOKOUT_CACHE_DIR`, `$XDG_CACHE_HOME/lookout` or
/// `~/.cache/lookout`, as xtask's.
pub fn runsc_next() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("LOOKOUT_RUNSC_NEXT") {
        return p.into();
    }
    cache_dir().join("runsc-trixie/root/usr/bin/runsc")
}

/// Debian 13's dockerd (26.1), which `cargo xtask test` fetches from
/// Debian's archive and extracts beside the system's (Debian 12's 20.10):
/// `$LOOKOUT_DOCKERD26`, else `<cache>/docker26/root/usr/sbin/dockerd`.
pub fn dockerd26() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("LOOKOUT_DOCKERD26") {
        return p.into();
    }
    cache_dir().join("docker26/root/usr/sbin/dockerd")
}

/// xtask's cache directory: `$LOOKOUT_CACHE_DIR`, `$XDG_CACHE_HOME/lookout`
/// or `~/.cache/lookout`.
pub fn cache_dir() -> std::path::PathBuf {
    use std::path::PathBuf;
    std::env::var_os("LOOKOUT_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("lookout")))
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/lookout")
        })
}

/// Debian 13's containerd 1.7 binaries' directory: see [`cri::containerd17`].
pub fn containerd17() -> std::path::PathBuf {
    cri::containerd17()
}

/// Where `program` is in `PATH`, if anywhere.
pub fn find_program(program: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Copies the executable `src` to `dest` (mode 0755, a new inode) **in a
/// child process**, so that no descriptor open for writing on `dest` ever
/// exists in this process.
///
/// Every test that writes a program and then runs it (a private runtime
/// copy, a busybox in a root file system, a stamp binary) must use this
/// instead of [`std::fs::copy`] (which clippy refuses in this workspace;
/// see `clippy.toml`). The reason is a race of multi-threaded processes:
/// while `std::fs::copy` holds `dest` open for writing, another test
/// thread may fork; the child inherits that descriptor and keeps it until
/// it execs (`O_CLOEXEC` closes it only then), and meanwhile the kernel
/// refuses to execute `dest` with `ETXTBSY` ("Text file busy"). Here the
/// descriptor lives in `install(1)`, a separate process that has exited
/// when this returns, so no fork of ours can inherit it. (A hard link
/// would not do: the runtime copies exist to have their own inode, which
/// their own fanotify marks watch.)
///
/// `dest` is replaced if it exists (GNU install unlinks it first).
pub fn install_executable(src: &Path, dest: &Path) -> io::Result<()> {
    let out = Command::new("install")
        .args(["-m", "0755", "-T", "--"])
        .arg(src)
        .arg(dest)
        .stdin(std::process::Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "install {} {}: {}: {}",
            src.display(),
            dest.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// An unprivileged user on this machine, for tests that play an attacker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct User {
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
}

impl User {
    /// The user's name.
    pub const NAME: &'static str = "lookout-attacker";

    /// Makes `cmd` run as this user (no supplementary groups: std drops
    /// them when a root parent sets the uid).
    pub fn apply<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.uid(self.uid).gid(self.gid)
    }
}

/// The unprivileged user [`User::NAME`], created with `useradd` (a system
/// user without a home or a login shell) the first time a test asks. Needs
/// root and `useradd`; reports `test` as skipped otherwise.
pub fn unprivileged_user(test: &str) -> Option<User> {
    static USER: std::sync::OnceLock<Result<User, String>> = std::sync::OnceLock::new();
    if !require_root(test) || !require_program(test, "useradd") {
        return None;
    }
    let user = USER.get_or_init(|| {
        let id = |flag: &str| -> Option<u32> {
            let out = Command::new("id").args([flag, User::NAME]).output().ok()?;
            String::from_utf8_lossy(&out.stdout).trim().parse().ok()
        };
        if id("-u").is_none() {
            let out = Command::new("useradd")
                .args([
                    "--system",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                ])
                .arg(User::NAME)
                .output()
                .map_err(|e| format!("useradd: {e}"))?;
            // 9: the user exists (another test binary made it meanwhile).
            if !out.status.success() && out.status.code() != Some(9) {
                return Err(format!(
                    "useradd {}: {}",
                    User::NAME,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
        match (id("-u"), id("-g")) {
            (Some(uid), Some(gid)) if uid != 0 => Ok(User { uid, gid }),
            other => Err(format!("no usable uid/gid for {}: {other:?}", User::NAME)),
        }
    });
    match user {
        Ok(u) => Some(*u),
        Err(why) => {
            skip(test, why);
            None
        }
    }
}

/// Linux capability numbers (see capabilities(7)) used by the tests.
pub mod cap {
    /// CAP_DAC_READ_SEARCH.
    pub const DAC_READ_SEARCH: u32 = 2;
    /// CAP_SYS_PTRACE.
    pub const SYS_PTRACE: u32 = 19;
    /// CAP_SYS_ADMIN.
    pub const SYS_ADMIN: u32 = 21;
    /// CAP_PERFMON.
    pub const PERFMON: u32 = 38;
    /// CAP_BPF.
    pub const BPF: u32 = 39;
}

/// Restrictions applied to a child between `fork` and `exec`.
///
/// ```no_run
/// use lookout_testsupport::{Restrictions, cap};
/// let mut cmd = std::process::Command::new("lookout");
/// Restrictions::new()
///     .deny_syscall(libc::SYS_fanotify_init, libc::ENOSYS)
///     .drop_capability(cap::SYS_ADMIN)
///     .apply(&mut cmd)
///     .unwrap();
/// ```
#[derive(Debug, Default, Clone)]
pub struct Restrictions {
    deny: Vec<(i64, i32)>,
    drop_caps: Vec<u32>,
    nofile: Option<(u64, u64)>,
}

impl Restrictions {
    /// No restrictions yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes syscall `nr` (a `libc::SYS_*` number) fail with `errno`.
    pub fn deny_syscall(mut self, nr: i64, errno: i32) -> Self {
        self.deny.push((nr, errno));
        self
    }

    /// Removes capability `cap` from the bounding set, so that the exec'd
    /// program (even as root) does not get it.
    pub fn drop_capability(mut self, cap: u32) -> Self {
        self.drop_caps.push(cap);
        self
    }

    /// Sets the open-file limit (`RLIMIT_NOFILE`) to `soft`:`hard`, as
    /// `prlimit --nofile=SOFT:HARD` would.
    pub fn nofile(mut self, soft: u64, hard: u64) -> Self {
        self.nofile = Some((soft, hard));
        self
    }

    /// Installs the restrictions on `cmd` (they take effect in the child).
    pub fn apply(&self, cmd: &mut Command) -> io::Result<()> {
        // Compile the filters here, in the parent: the pre_exec closure runs
        // after fork and must not allocate.
        let mut programs = Vec::new();
        for &(nr, errno) in &self.deny {
            let rules = std::collections::BTreeMap::from([(nr, Vec::new())]);
            let filter = seccompiler::SeccompFilter::new(
                rules,
                seccompiler::SeccompAction::Allow,
                seccompiler::SeccompAction::Errno(errno as u32),
                std::env::consts::ARCH
                    .try_into()
                    .map_err(|e| io::Error::other(format!("seccomp arch: {e:?}")))?,
            )
            .map_err(|e| io::Error::other(format!("seccomp filter: {e}")))?;
            let prog: seccompiler::BpfProgram = filter
                .try_into()
                .map_err(|e| io::Error::other(format!("seccomp compile: {e:?}")))?;
            programs.push(prog);
        }
        let caps = self.drop_caps.clone();
        let nofile = self.nofile;
        let hook = move || -> io::Result<()> {
            if let Some((soft, hard)) = nofile {
                let lim = libc::rlimit {
                    rlim_cur: soft,
                    rlim_max: hard,
                };
                // SAFETY: setrlimit with a valid struct; async-signal-safe.
                if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for &c in &caps {
                // SAFETY: prctl with integer arguments; no memory is passed.
                if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, c as libc::c_ulong, 0, 0, 0) } != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if !caps.is_empty() {
                // SAFETY: as above.
                let rc = unsafe {
                    libc::prctl(
                        libc::PR_CAP_AMBIENT,
                        libc::PR_CAP_AMBIENT_CLEAR_ALL,
                        0,
                        0,
                        0,
                    )
                };
                if rc != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for prog in &programs {
                seccompiler::apply_filter(prog).map_err(|e| io::Error::other(e.to_string()))?;
            }
            Ok(())
        };
        // SAFETY: the closure only makes setrlimit/prctl/seccomp syscalls on data
        // prepared before the fork; it neither allocates nor takes locks.
        unsafe { cmd.pre_exec(hook) };
        Ok(())
    }
}

/// OCI bundles with a busybox root file system, for tests with real
/// runtimes.
pub mod bundle {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// Applets linked into the root file system.
    const APPLETS: &[&str] = &[
        "sh", "sleep", "echo", "cat", "true", "false", "date", "ls", "touch",
    ];

    /// Creates a bundle at `dir` (which must not exist) whose process runs
    /// `args`. The root file system is writable; `extra` edits the
    /// config.json as a `serde_json::Value` before it is written.
    pub fn busybox(
        dir: &Path,
        args: &[&str],
        extra: impl FnOnce(&mut serde_json::Value),
    ) -> PathBuf {
        let rootfs = dir.join("rootfs");
        std::fs::create_dir_all(rootfs.join("bin")).expect("mkdir rootfs/bin");
        for d in ["proc", "sys", "dev", "tmp", "etc"] {
            std::fs::create_dir_all(rootfs.join(d)).expect("mkdir");
        }
        let busybox = ["/bin/busybox", "/usr/bin/busybox"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("busybox-static is installed");
        crate::install_executable(Path::new(busybox), &rootfs.join("bin/busybox"))
            .expect("copy busybox");
        for a in APPLETS {
            let _ = std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(a));
        }
        let status = Command::new("runc")
            .args(["spec", "--bundle"])
            .arg(dir)
            .status()
            .expect("runc spec");
        assert!(status.success(), "runc spec failed");
        let path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read config.json"))
                .expect("runc spec JSON");
        config["process"]["terminal"] = false.into();
        config["process"]["args"] = args.iter().map(|a| serde_json::Value::from(*a)).collect();
        config["root"]["readonly"] = false.into();
        extra(&mut config);
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&config).expect("serialize"),
        )
        .expect("write config.json");
        dir.to_path_buf()
    }

    /// A static binary that writes `CLOCK_MONOTONIC` nanoseconds to the
    /// file named by its first argument, then exits: a container's "first
    /// instruction" with a timestamp. Built with `gcc -static` into `dir`.
    pub fn monotonic_stamp(dir: &Path) -> PathBuf {
        let src = dir.join("stamp.c");
        let bin = dir.join("stamp");
        std::fs::write(
            &src,
            r#"#include <stdio.h>
#include <time.h>
int main(int argc, char **argv) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    FILE *f = fopen(argc > 1 ? argv[1] : "/stamp", "w");
    if (!f) return 1;
    fprintf(f, "%lld\n", (long long)t.tv_sec * 1000000000LL + t.tv_nsec);
    return fclose(f) ? 1 : 0;
}
"#,
        )
        .expect("write stamp.c");
        gcc_static(&src, &bin);
        bin
    }

    /// A static program that execs `argv[1]` (a shell: busybox) as `sh`
    /// with the rest of its arguments: `SHIM BUSYBOX SCRIPT ARGS...` runs
    /// `sh SCRIPT ARGS...`. A `createContainer` hook must be static (it
    /// runs as root in the container); the shim lets a test's script be
    /// one, with a shell the test provides. Built with `gcc -static` into
    /// `dir`.
    pub fn static_shim(dir: &Path) -> PathBuf {
        let src = dir.join("shim.c");
        let bin = dir.join("shim");
        std::fs::write(
            &src,
            r#"#include <unistd.h>
int main(int argc, char **argv) {
    if (argc < 3) return 2;
    char *shell = argv[1];
    argv[1] = "sh";
    execv(shell, argv + 1);
    return 127;
}
"#,
        )
        .expect("write shim.c");
        gcc_static(&src, &bin);
        bin
    }

    /// `gcc -O2 -static -o bin src`, or a panic that says what to install.
    fn gcc_static(src: &Path, bin: &Path) {
        let status = Command::new("gcc")
            .args(["-O2", "-static", "-o"])
            .arg(bin)
            .arg(src)
            .status()
            .expect("run gcc");
        assert!(
            status.success(),
            "gcc -static failed (is libc6-dev installed?)"
        );
    }
}
