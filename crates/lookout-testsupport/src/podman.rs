//! Podman as the reference for an oci-hooks(5) `hooks.d` directory: a
//! private podman (Debian 12's 4.3.1, with runc 1.1.5) that runs a
//! container from a root file system directory with chosen hooks
//! directories, and a [`Recorder`] hook that writes one line per run, so
//! that a conformance test can compare what podman ran with what lookout
//! runs.
//!
//! What podman 4.3.1 + runc 1.1.5 do with one hook per stage (measured;
//! `tests/podman.rs` checks it):
//!
//! | stage | run by | mount ns | `status` | `pid` | cwd |
//! |---|---|---|---|---|---|
//! | `prestart` | runc create | host | `creating` | init's host pid | bundle |
//! | `createRuntime` | runc create | host | `creating` | init's host pid | bundle |
//! | `createContainer` | runc init, before pivot_root | container | `creating` | `1` | rootfs (host path) |
//! | `poststart` | runc **create** | host | `created` | init's host pid | bundle |
//! | `startContainer` | runc init, after pivot_root | container | `created` | `1` | `/` |
//! | (the command) | | container | | | `/` |
//! | `poststop` | `podman container cleanup` | host | `stopped` | absent | podman's cwd |
//!
//! That is [`PODMAN_ORDER`]: runc < 1.2 runs `poststart` during `create`,
//! before `startContainer` and the command. `prestart` is not mapped to
//! `createRuntime`: runc gets both and runs all `prestart` hooks, then all
//! `createRuntime` ones. Podman keeps `poststop` out of the runtime's
//! config and runs it itself at cleanup (done before `podman run`
//! returns). Hooks runc runs without an `env` inherit runc's environment
//! (podman's, plus `_OCI_SYNCPIPE`/`_OCI_STARTPIPE`), the in-container ones
//! the container process's; podman's `poststop` gets an empty one.
//!
//! Two [`Podman`]s share nothing with each other or the machine's podman:
//! each has its own `--root`, `--runroot`, `--tmpdir`, containers.conf
//! (file locks and events, no network, an empty default hooks dir),
//! storage.conf (vfs), cgroup parent and runc copy. Only runc's state
//! (`/run/runc/<id>`) is runc's default: podman does not pass
//! `--runtime-flag` on to its cleanup process.
//! `tests/podman.rs` shows the use.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::cmd::shell_line;

/// The six stages of oci-hooks(5).
pub const STAGES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

/// The stage label of the container's own command in the records
/// ([`Recorder::container_command`]).
pub const COMMAND: &str = "command";

/// The order in which podman 4.3.1 with runc 1.1.5 ran one hook per stage
/// and the container's command.
pub const PODMAN_ORDER: [&str; 7] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "poststart",
    "startContainer",
    COMMAND,
    "poststop",
];

/// How long a `podman run` may take by default.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// The PATH of every podman command (and so of the hooks runc runs).
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Whether this test can run [`Podman`]: root, and podman, runc, conmon,
/// gcc (the recorder's clock) and busybox-static installed. If not,
/// reports `test` as skipped (a failure under CI).
pub fn require_podman(test: &str) -> bool {
    if !crate::require_root(test) {
        return false;
    }
    let programs = ["podman", "runc", "conmon", "gcc", "busybox"];
    programs.iter().all(|p| crate::require_program(test, p))
}

/// A busybox root file system for [`RunOptions::new`]: `dir/rootfs` of
/// [`crate::bundle::busybox`] (`dir` must not exist; panics on failure).
pub fn busybox_rootfs(dir: &Path) -> PathBuf {
    crate::bundle::busybox(dir, &["/bin/true"], |_| {}).join("rootfs")
}

/// A private podman: every command runs with this instance's global flags
/// and configuration files (see the module's documentation). Dropping it
/// removes its containers, kills what is left in its cgroups, unmounts
/// what is mounted under its directory and deletes it; Drop reports
/// problems and never panics.
#[derive(Debug)]
pub struct Podman {
    dir: Option<tempfile::TempDir>,
    base: PathBuf,
    runtime: PathBuf,
    cgroup_parent: String,
    next: AtomicU32,
}

/// What [`Podman::run`] runs: build it with [`RunOptions::new`] and the
/// methods, or set the fields.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The container's root file system, a directory (`--rootfs`).
    pub rootfs: PathBuf,
    /// `podman --hooks-dir DIR` each (none: an empty private directory,
    /// never the system's `/usr/share` or `/etc/containers/oci/hooks.d`).
    pub hooks_dirs: Vec<PathBuf>,
    /// `--annotation KEY=VALUE` each.
    pub annotations: Vec<(String, String)>,
    /// `-v HOST:CONTAINER` each: any makes `when.hasBindMounts` true.
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// The command, an absolute path first (no image, no PATH lookup).
    pub command: Vec<String>,
    /// More `podman run` arguments (before `--rootfs`).
    pub args: Vec<String>,
    /// How long `podman run` may take before it is killed and fails.
    pub timeout: Duration,
}

impl RunOptions {
    /// `/bin/true` in `rootfs`, with no hooks directory.
    pub fn new(rootfs: &Path) -> Self {
        RunOptions {
            rootfs: rootfs.to_path_buf(),
            hooks_dirs: Vec::new(),
            annotations: Vec::new(),
            binds: Vec::new(),
            command: vec!["/bin/true".to_owned()],
            args: Vec::new(),
            timeout: RUN_TIMEOUT,
        }
    }

    /// Adds a hooks directory.
    pub fn hooks_dir(mut self, dir: &Path) -> Self {
        self.hooks_dirs.push(dir.to_path_buf());
        self
    }

    /// Adds an annotation.
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Bind-mounts `path` at the same path in the container.
    pub fn bind_same(mut self, path: &Path) -> Self {
        self.binds.push((path.to_path_buf(), path.to_path_buf()));
        self
    }

    /// Sets the command.
    pub fn command<S: Into<String>>(mut self, argv: impl IntoIterator<Item = S>) -> Self {
        self.command = argv.into_iter().map(Into::into).collect();
        self
    }
}

/// What a `podman run` did.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// The container's name (unique on the machine: `lookout-podman-PID-N-M`).
    pub name: String,
    /// The container's 64-hex id, if podman created it (a hooks directory
    /// it cannot read fails the run before that).
    pub id: Option<String>,
    /// `podman run`'s exit status: the command's, or 126 when runc failed
    /// to create the container (a failing hook up to `poststart`).
    pub status: ExitStatus,
    /// The container's stdout.
    pub stdout: String,
    /// podman's stderr and the container's.
    pub stderr: String,
    /// How long `podman run` took.
    pub elapsed: Duration,
    /// The bundle podman made for the container (the State's `bundle`).
    pub bundle: Option<PathBuf>,
}

static INSTANCES: AtomicU32 = AtomicU32::new(0);

/// The private configuration files, `@` standing for the directory.
const CONFIG: [(&str, &str); 3] = [
    (
        "containers.conf",
        r#"# A private podman for lookout's tests (lookout_testsupport::podman).
[containers]
netns = "none"
[network]
network_config_dir = "@/netconf"
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "@/tmp/events.log"
lock_type = "file"
hooks_dir = ["@/no-hooks"]
"#,
    ),
    (
        "storage.conf",
        "[storage]\ndriver = \"vfs\"\nrunroot = \"@/runroot\"\ngraphroot = \"@/root\"\n",
    ),
    ("registries.conf", "unqualified-search-registries = []\n"),
];

impl Podman {
    /// A podman with a fresh private directory. Needs root (see
    /// [`require_podman`]); runs nothing yet.
    pub fn new() -> io::Result<Podman> {
        let dir = tempfile::Builder::new()
            .prefix("lookout-podman-")
            .tempdir()?;
        let base = dir.path().to_path_buf();
        for d in [
            "root", "runroot", "tmp", "home", "netconf", "runs", "bin", "no-hooks",
        ] {
            std::fs::create_dir_all(base.join(d))?;
        }
        let runc = crate::find_program("runc").unwrap_or_else(|| "/usr/sbin/runc".into());
        let runtime = base.join("bin/runc");
        crate::install_executable(&runc, &runtime)?;
        let b = base.display().to_string();
        for (name, text) in CONFIG {
            std::fs::write(base.join(name), text.replace('@', &b))?;
        }
        let n = INSTANCES.fetch_add(1, Ordering::Relaxed);
        Ok(Podman {
            dir: Some(dir),
            cgroup_parent: format!("/lookout-podman-{}-{n}", std::process::id()),
            base,
            runtime,
            next: AtomicU32::new(0),
        })
    }

    /// The private directory (root, runroot, tmpdir, configuration).
    pub fn dir(&self) -> &Path {
        &self.base
    }

    /// The private copy of runc every container runs with (an agent that
    /// watches this inode sees this podman's containers and no other's).
    pub fn runtime(&self) -> &Path {
        &self.runtime
    }

    /// `podman` with this instance's global flags, a clean environment
    /// (PATH, HOME, TMPDIR and the CONTAINERS_* files only), the private
    /// directory as working directory (so `poststop`'s cwd), and
    /// `hooks_dirs` as `--hooks-dir`.
    pub fn command(&self, hooks_dirs: &[PathBuf]) -> Command {
        let b = self.base.display();
        let mut cmd = Command::new("podman");
        cmd.env_clear().env("PATH", PATH).current_dir(&self.base);
        cmd.stdin(Stdio::null());
        for (var, file) in [
            ("HOME", "home"),
            ("TMPDIR", "tmp"),
            ("CONTAINERS_CONF", "containers.conf"),
            ("CONTAINERS_STORAGE_CONF", "storage.conf"),
            ("CONTAINERS_REGISTRIES_CONF", "registries.conf"),
        ] {
            cmd.env(var, self.base.join(file));
        }
        cmd.args([
            format!("--root={b}/root"),
            format!("--runroot={b}/runroot"),
            format!("--tmpdir={b}/tmp"),
            "--storage-driver=vfs".to_owned(),
            "--cgroup-manager=cgroupfs".to_owned(),
            "--events-backend=file".to_owned(),
            format!("--network-config-dir={b}/netconf"),
            format!("--runtime={}", self.runtime.display()),
        ]);
        for d in hooks_dirs {
            cmd.arg(format!("--hooks-dir={}", d.display()));
        }
        cmd
    }

    /// Runs `podman ARGS` to completion (printed first), and returns its
    /// stdout; fails naming `step` if it cannot start or fails.
    pub fn exec(&self, step: &str, args: &[&str]) -> io::Result<String> {
        let mut cmd = self.command(&[]);
        cmd.args(args);
        let line = shell_line(&cmd);
        eprintln!("[podman {step}] $ {line}");
        let out = cmd
            .output()
            .map_err(|e| io::Error::new(e.kind(), format!("podman step '{step}': {line}: {e}")))?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "podman step '{step}' failed ({}): {line}\n  stderr: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs one container to completion: `podman run`, attached, stdin
    /// /dev/null, no network, this instance's cgroup parent, the test's
    /// open-file and process limits (the latter at most 32768: root here
    /// lacks CAP_SYS_RESOURCE, and podman lowers its own RLIMIT_NPROC to
    /// 32768). A non-zero exit is a result; a run past its timeout is
    /// killed and an error. The container stays until the drop.
    pub fn run(&self, opts: &RunOptions) -> io::Result<RunResult> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-{n}", &self.cgroup_parent[1..]);
        let file = |ext: &str| self.base.join("runs").join(format!("{name}.{ext}"));
        let (cidfile, out_path, err_path) = (file("cid"), file("out"), file("err"));
        let nofile = rlimit(libc::RLIMIT_NOFILE, u64::MAX)?;
        let nproc = rlimit(libc::RLIMIT_NPROC, 32768)?;
        let mut cmd = self.command(&opts.hooks_dirs);
        cmd.args(["run", "--name", &name, "--network=none"])
            .arg(format!("--cidfile={}", cidfile.display()))
            .arg(format!("--cgroup-parent={}", self.cgroup_parent))
            .arg(format!("--ulimit=nofile={nofile}"))
            .arg(format!("--ulimit=nproc={nproc}"));
        for (k, v) in &opts.annotations {
            cmd.arg(format!("--annotation={k}={v}"));
        }
        for (h, c) in &opts.binds {
            cmd.arg(format!("--volume={}:{}", h.display(), c.display()));
        }
        cmd.args(&opts.args)
            .arg("--rootfs")
            .arg(&opts.rootfs)
            .args(&opts.command)
            .stdout(std::fs::File::create(&out_path)?)
            .stderr(std::fs::File::create(&err_path)?);
        let line = shell_line(&cmd);
        eprintln!("[podman run] $ {line}");
        let read =
            |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("podman step 'run': {line}: {e}")))?;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if started.elapsed() > opts.timeout {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other(format!(
                    "podman step 'run' took more than {:?} and was killed: {line}\n  stderr: {}",
                    opts.timeout,
                    read(&err_path).trim()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let id = Some(read(&cidfile).trim().to_owned()).filter(|id| !id.is_empty());
        let bundle =
            (id.as_ref()).map(|id| self.base.join(format!("root/vfs-containers/{id}/userdata")));
        let result = RunResult {
            name,
            id,
            status,
            stdout: read(&out_path),
            stderr: read(&err_path),
            elapsed: started.elapsed(),
            bundle,
        };
        let RunResult { name, elapsed, .. } = &result;
        eprintln!(
            "[podman run] {name}: {status} in {elapsed:.2?}; stderr: {:?}",
            result.stderr.trim()
        );
        Ok(result)
    }

    /// This instance's cgroups, children first, in every hierarchy (cgroup
    /// v1 controllers, the hybrid `unified`, or a pure cgroup2 mount).
    fn cgroups(&self) -> Vec<PathBuf> {
        let rel = self.cgroup_parent.trim_start_matches('/');
        let root = Path::new("/sys/fs/cgroup");
        let hierarchies = std::fs::read_dir(root).into_iter().flatten().flatten();
        let mut out = Vec::new();
        for top in std::iter::once(root.join(rel)).chain(hierarchies.map(|e| e.path().join(rel))) {
            let children = std::fs::read_dir(&top).into_iter().flatten().flatten();
            out.extend(children.map(|e| e.path()).filter(|p| p.is_dir()));
            out.push(top);
        }
        out.retain(|d| d.is_dir());
        out
    }

    fn cleanup(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Err(e) = self.exec("rm --all", &["rm", "--all", "--force", "--time", "0"]) {
            problems.push(e.to_string());
        }
        // What is left in our cgroups (a conmon, a container podman lost)
        // is ours: kill it by pid, then remove the cgroups.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left: Vec<PathBuf> = self
                .cgroups()
                .into_iter()
                .filter(|c| !kill_and_remove(c))
                .collect();
            if left.is_empty() || Instant::now() > deadline {
                if !left.is_empty() {
                    problems.push(format!("cgroups left: {left:?}"));
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Mounts under our directory (a container's shm), the last first.
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mounts = mountinfo.lines().rev().filter_map(|l| l.split(' ').nth(4));
        for m in mounts
            .map(|m| m.replace("\\040", " "))
            .filter(|m| Path::new(m).starts_with(&self.base))
        {
            let Ok(c) = std::ffi::CString::new(m.as_str()) else {
                continue;
            };
            // SAFETY: a valid NUL-terminated path; MNT_DETACH has no other
            // preconditions.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
                problems.push(format!("umount {m}: {}", io::Error::last_os_error()));
            }
        }
        if let Some(dir) = self.dir.take()
            && let Err(e) = dir.close()
        {
            problems.push(format!("remove {}: {e}", self.base.display()));
        }
        problems
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for p in self.cleanup() {
            eprintln!("[podman cleanup] warning: {p}");
        }
    }
}

/// Kills the processes in `cgroup` and removes it; whether it is gone.
fn kill_and_remove(cgroup: &Path) -> bool {
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
    for pid in procs
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
    {
        // SAFETY: kill has no memory preconditions; the pid is in one of
        // this podman's own cgroups.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    std::fs::remove_dir(cgroup).is_ok() || !cgroup.exists()
}

/// `SOFT:HARD` of this process's limit `resource`, each at most `cap`.
fn rlimit(resource: libc::__rlimit_resource_t, cap: u64) -> io::Result<String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the valid struct it is given.
    if unsafe { libc::getrlimit(resource, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(format!(
        "{}:{}",
        lim.rlim_cur.min(cap),
        lim.rlim_max.min(cap)
    ))
}

/// This process's mount namespace (its inode number): the host's, for a
/// test.
pub fn host_mnt_ns() -> io::Result<u64> {
    let link = std::fs::read_link("/proc/self/ns/mnt")?;
    parse_ns(&link.to_string_lossy()).ok_or_else(|| io::Error::other(format!("{link:?}")))
}

fn parse_ns(s: &str) -> Option<u64> {
    s.strip_prefix("mnt:[")?.strip_suffix(']')?.parse().ok()
}

/// What a recorded hook does after writing its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Exits 0.
    Ok,
    /// Writes `recorder: STAGE fails on purpose` to stderr and exits 1.
    Fail,
    /// Becomes `sleep SECS` (`exec`): a timeout's kill ends it.
    Sleep(u32),
    /// Runs `sleep SECS` as a child and waits: a timeout's kill ends the
    /// shell, but the child holds the hook's stdout and stderr, which runc
    /// and podman both wait for (the timeout error comes after SECS).
    SleepChild(u32),
}

/// The prefix (with the format's version) of every record line.
pub const RECORD_PREFIX: &str = "LOOKOUT-PODMAN-REC v1 ";

/// The recorder, a `#!/bin/sh` script using `dir/busybox` and `dir/mono`
/// (CLOCK_MONOTONIC), appending one line per run to `dir/records`. Its argv is `recorder.sh STAGE [fail | sleep SECS | sleep-child SECS]`
/// ([`Action`]). The line is [`RECORD_PREFIX`] and `key=value` fields (`%`
/// and spaces in values written `%25` and `%20`; `-`: absent): `stage`
/// (argv 1), `action`, `mono` (ns), `mnt` (`readlink /proc/self/ns/mnt`),
/// the State's `status`, `pid`, `id`, `bundle` and number of annotations
/// `ann` (sed on stdin; `ann` counts `":"` pairs), `cwd` (`pwd -P`), the
/// environment the hook was given (the shell's own `/proc/self/environ`,
/// not what the shell adds): `envc` variables and its `path`, and `self`,
/// the shell's pid in its pid namespace.
pub fn recorder_script(dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"#!/bin/sh
# lookout_testsupport::podman recorder: one line per run to {d}/records.
# argv: STAGE [fail | sleep SECS | sleep-child SECS]
D='{d}'
B="$D/busybox"
t=$("$D/mono")
# The environment the hook was given: fd 3 is opened by the shell itself.
exec 3</proc/self/environ
envs=$("$B" tr '\0' '\n' <&3)
exec 3<&-
envc=$(printf '%s' "$envs" | "$B" grep -c .)
path=$(printf '%s\n' "$envs" | "$B" sed -n 's/^PATH=//p')
state=$("$B" cat)
field() {{ printf '%s' "$state" | "$B" sed -n "s/.*\"$1\":$2.*/\\1/p"; }}
status=$(field status '"\([^"]*\)"')
pid=$(field pid '\([0-9]*\)')
id=$(field id '"\([^"]*\)"')
bundle=$(field bundle '"\([^"]*\)"')
ann=$(printf '%s' "$state" | "$B" sed -n 's/.*"annotations":{{\([^}}]*\)}}.*/\1/p' | "$B" grep -o '":"' | "$B" grep -c .)
mnt=$("$B" readlink /proc/self/ns/mnt)
cwd=$(pwd -P)
enc() {{ if [ -z "$1" ]; then printf '%s' -; else printf '%s' "$1" | "$B" sed 's/%/%25/g; s/ /%20/g'; fi; }}
printf '{prefix}stage=%s action=%s mono=%s mnt=%s status=%s pid=%s id=%s bundle=%s ann=%s cwd=%s envc=%s path=%s self=%s\n' \
  "$(enc "$1")" "$(enc "${{2:-ok}}")" "$t" "$mnt" "$(enc "$status")" "$(enc "$pid")" "$(enc "$id")" \
  "$(enc "$bundle")" "${{ann:-0}}" "$(enc "$cwd")" "${{envc:-0}}" "$(enc "$path")" "$$" >> "$D/records"
case "$2" in
fail) echo "recorder: $1 fails on purpose" >&2; exit 1 ;;
sleep) exec "$B" sleep "$3" ;;
sleep-child) "$B" sleep "$3" ;;
esac
exit 0
"#,
        prefix = RECORD_PREFIX,
    )
}

const MONO_C: &str = r#"#include <stdio.h>
#include <time.h>
int main(void) {
    struct timespec t;
    if (clock_gettime(CLOCK_MONOTONIC, &t)) return 1;
    printf("%lld\n", (long long)t.tv_sec * 1000000000LL + t.tv_nsec);
    return 0;
}
"#;

/// One run of the recorder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// argv 1: the stage's label (or [`COMMAND`]).
    pub stage: String,
    /// argv 2: `ok`, `fail`, `sleep`, `sleep-child`.
    pub action: String,
    /// CLOCK_MONOTONIC in ns when the recorder started.
    pub monotonic_ns: u64,
    /// The recorder's mount namespace (inode number).
    pub mnt_ns: u64,
    /// The State's `status` (none for the command).
    pub status: Option<String>,
    /// The State's `pid` (none: absent or 0).
    pub pid: Option<u32>,
    /// The State's `id`.
    pub id: Option<String>,
    /// The State's `bundle`.
    pub bundle: Option<String>,
    /// The number of the State's annotations.
    pub annotations: usize,
    /// The recorder's working directory (`pwd -P`).
    pub cwd: String,
    /// The number of environment variables the hook was given.
    pub env_count: usize,
    /// Its PATH, if it was given one.
    pub path: Option<String>,
    /// The shell's pid, in its own pid namespace.
    pub self_pid: u32,
}

fn decode(v: &str) -> Option<String> {
    (v != "-").then(|| v.replace("%20", " ").replace("%25", "%"))
}

impl Record {
    /// One recorder line, if it is one.
    pub fn parse(line: &str) -> Option<Record> {
        let rest = line.strip_prefix(RECORD_PREFIX)?;
        let mut map = std::collections::HashMap::new();
        for field in rest.split_whitespace() {
            let (k, v) = field.split_once('=')?;
            map.insert(k, v);
        }
        let get = |k: &str| map.get(k).copied();
        Some(Record {
            stage: decode(get("stage")?)?,
            action: decode(get("action")?).unwrap_or_else(|| "ok".to_owned()),
            monotonic_ns: get("mono")?.parse().ok()?,
            mnt_ns: parse_ns(get("mnt")?)?,
            status: get("status").and_then(decode),
            pid: get("pid")
                .and_then(|p| p.parse().ok())
                .filter(|&p: &u32| p != 0),
            id: get("id").and_then(decode),
            bundle: get("bundle").and_then(decode),
            annotations: get("ann").and_then(|a| a.parse().ok()).unwrap_or(0),
            cwd: get("cwd").and_then(decode).unwrap_or_default(),
            env_count: get("envc").and_then(|a| a.parse().ok()).unwrap_or(0),
            path: get("path").and_then(decode),
            self_pid: get("self")?.parse().ok()?,
        })
    }
}

/// Parses recorder lines in file order, printing (not failing on) every
/// line that is not a record ([`Record::parse`]).
pub fn parse_records(text: &str) -> Vec<Record> {
    let lines = text.lines().filter(|l| !l.trim().is_empty());
    let parsed = lines.map(|l| Record::parse(l).ok_or(l));
    let report = |r| match r {
        Ok(r) => Some(r),
        Err(l) => {
            eprintln!("[podman recorder] not a record, ignored: {l:?}");
            None
        }
    };
    parsed.filter_map(report).collect()
}

/// The [`recorder_script`] installed in a directory, the hook files that
/// run it, and its records.
///
/// Its directory must be at the same path wherever a hook runs
/// (`startContainer` and the command run after pivot_root): bind-mount it
/// ([`RunOptions::bind_same`], so `hasBindMounts` is true). Without, only
/// the host-side stages record (enough to check `hasBindMounts: false`).
#[derive(Debug, Clone)]
pub struct Recorder {
    dir: PathBuf,
}

impl Recorder {
    /// Installs the recorder in `dir` (made absolute; created if missing):
    /// `recorder.sh`, `busybox`, `mono` (compiled with `gcc -static`) and
    /// an empty `records` log anyone may append to.
    pub fn install(dir: &Path) -> io::Result<Recorder> {
        let dir = &std::path::absolute(dir)?;
        std::fs::create_dir_all(dir)?;
        let build = tempfile::tempdir()?;
        let src = build.path().join("mono.c");
        std::fs::write(&src, MONO_C)?;
        let mut gcc = Command::new("gcc");
        gcc.args(["-O2", "-static", "-o"])
            .arg(build.path().join("mono"))
            .arg(&src);
        crate::cmd::exec("recorder mono", &mut gcc, "install gcc and libc6-dev")?;
        let script = build.path().join("recorder.sh");
        std::fs::write(&script, recorder_script(dir))?;
        for (src, name) in [
            (build.path().join("mono"), "mono"),
            (
                crate::find_program("busybox").unwrap_or_default(),
                "busybox",
            ),
            (script, "recorder.sh"),
        ] {
            crate::install_executable(&src, &dir.join(name))?;
        }
        let recorder = Recorder {
            dir: dir.to_path_buf(),
        };
        recorder.clear()?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join("records"), std::fs::Permissions::from_mode(0o666))?;
        Ok(recorder)
    }

    /// The recorder's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The script's path (a hook's `path`).
    pub fn script(&self) -> PathBuf {
        self.dir.join("recorder.sh")
    }

    /// The container command that records itself as [`COMMAND`], then
    /// exits 0.
    pub fn container_command(&self) -> Vec<String> {
        vec![self.script().display().to_string(), COMMAND.to_owned()]
    }

    /// An oci-hooks(5) 1.0.0 hook that records `label` at `stages` when
    /// `when` matches, then does `action`; `timeout` in seconds.
    pub fn hook(
        &self,
        label: &str,
        stages: &[&str],
        when: serde_json::Value,
        action: Action,
        timeout: Option<u32>,
    ) -> serde_json::Value {
        let mut args = vec!["recorder.sh".to_owned(), label.to_owned()];
        match action {
            Action::Ok => {}
            Action::Fail => args.push("fail".to_owned()),
            Action::Sleep(s) => args.extend(["sleep".to_owned(), s.to_string()]),
            Action::SleepChild(s) => args.extend(["sleep-child".to_owned(), s.to_string()]),
        }
        let mut hook = serde_json::json!({"path": self.script(), "args": args});
        if let Some(t) = timeout {
            hook["timeout"] = t.into();
        }
        serde_json::json!({"version": "1.0.0", "hook": hook, "when": when, "stages": stages})
    }

    /// Writes the six-stage directory `dir`: `01-prestart.json` ...
    /// `06-poststop.json`, each `when: {"always": true}` recording its
    /// stage.
    pub fn six_stage_dir(&self, dir: &Path) -> io::Result<()> {
        for (i, stage) in STAGES.iter().enumerate() {
            let always = serde_json::json!({"always": true});
            let hook = self.hook(stage, &[stage], always, Action::Ok, None);
            write_hook(dir, &format!("0{}-{stage}.json", i + 1), &hook)?;
        }
        Ok(())
    }

    /// Empties the log.
    pub fn clear(&self) -> io::Result<()> {
        std::fs::write(self.dir.join("records"), "")
    }

    /// The raw log.
    pub fn text(&self) -> String {
        std::fs::read_to_string(self.dir.join("records")).unwrap_or_default()
    }

    /// The records so far, in the order they were made (their monotonic
    /// stamps'); lines that are not records are printed and skipped.
    pub fn records(&self) -> Vec<Record> {
        let mut records = parse_records(&self.text());
        records.sort_by_key(|r| r.monotonic_ns);
        records
    }

    /// Waits (at most `timeout`) until a record of `stage` exists, and
    /// returns all records then. Panics with the log if none comes.
    #[track_caller]
    pub fn wait_for(&self, stage: &str, timeout: Duration) -> Vec<Record> {
        crate::wait_until(
            timeout,
            || self.records().iter().any(|r| r.stage == stage),
            || format!("no {stage} record; log:\n{}", self.text()),
        );
        self.records()
    }
}

/// Writes `hook` (pretty JSON) as `dir/name` (`dir` created if missing).
pub fn write_hook(dir: &Path, name: &str, hook: &serde_json::Value) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let text = serde_json::to_vec_pretty(hook).map_err(io::Error::other)?;
    std::fs::write(dir.join(name), text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_and_garbage_is_reported() {
        let text = format!(
            "{p}stage=prestart action=ok mono=12 mnt=mnt:[4026531832] status=creating pid=77 \
             id=abc bundle=/b%20x ann=8 cwd=/b%20x envc=8 path=/usr/bin self=80\n\
             half a line\n\
             {p}stage=command action=ok mono=15 mnt=mnt:[4026532174] status=- pid=- id=- \
             bundle=- ann=0 cwd=/ envc=4 path=- self=1\n\
             {p}stage=x mono=notanumber mnt=mnt:[1] self=1\n\
             \n{p}stage=broken",
            p = RECORD_PREFIX
        );
        let records = parse_records(&text);
        assert_eq!(records.len(), 2, "{records:?}");
        let garbage = text
            .lines()
            .filter(|l| !l.is_empty() && Record::parse(l).is_none());
        assert_eq!(garbage.count(), 3);
        let r = &records[0];
        assert_eq!(r.stage, "prestart");
        assert_eq!(r.mnt_ns, 4026531832);
        assert_eq!(r.status.as_deref(), Some("creating"));
        assert_eq!(r.pid, Some(77));
        assert_eq!(r.bundle.as_deref(), Some("/b x"));
        assert_eq!(r.cwd, "/b x");
        assert_eq!(r.annotations, 8);
        let c = &records[1];
        assert_eq!(
            (c.status.as_deref(), c.pid, c.path.as_deref()),
            (None, None, None)
        );
        assert_eq!(c.self_pid, 1);
        assert_eq!(parse_records("garbage only\n"), vec![]);
    }

    #[test]
    fn hook_json_is_oci_hooks_1_0_0() {
        let rec = Recorder {
            dir: PathBuf::from("/r"),
        };
        let h = rec.hook(
            "poststop",
            &["poststop"],
            serde_json::json!({"always": true}),
            Action::Sleep(5),
            Some(1),
        );
        assert_eq!(
            h,
            serde_json::json!({
                "version": "1.0.0",
                "hook": {"path": "/r/recorder.sh", "args": ["recorder.sh", "poststop", "sleep", "5"], "timeout": 1},
                "when": {"always": true},
                "stages": ["poststop"],
            })
        );
    }
}
