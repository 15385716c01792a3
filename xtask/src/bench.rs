//! `cargo xtask bench`: measures the agent against real runtimes and writes
//! target/bench/report.json. Needs root. Ratios are measured side by side
//! in one run; absolute times on shared VMs are noisy.
//!
//! [`PARTS`] lists the parts `--only` selects (a full run is `agent`, then
//! `inode-map`); each adds its keys to one report and prints its share of
//! it. The `agent` part runs one function per measurement, in order
//! ([`agent_part`]).

use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::util::{cargo, exec, is_root, say, workspace_root};

// A child of this module (it shares the helpers below); its file sits
// beside this one.
#[path = "bench_against.rs"]
mod against;
#[path = "bench_consumers.rs"]
mod consumers;
#[path = "bench_exits.rs"]
mod exits;
#[path = "bench_nri.rs"]
mod nri;

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Execs per configuration and round for the exec-overhead measurement.
    #[arg(long, default_value_t = 200)]
    pub execs: usize,
    /// Rounds (configurations are interleaved round by round).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Sequential containers for the discovery-latency measurement.
    /// With 200, the p99 is the third largest lag, not the maximum.
    #[arg(long, default_value_t = 200)]
    pub latency: usize,
    /// Containers for the churn measurement.
    #[arg(long, default_value_t = 500)]
    pub churn: usize,
    /// Containers, each with 64 KiB of annotations, for the memory
    /// measurement (all tracked at once).
    #[arg(long, default_value_t = 200)]
    pub heavy: usize,
    /// Entries per mode for the inode-map measurement.
    #[arg(long, default_value_t = 1_000_000)]
    pub inode_entries: u64,
    /// Rounds of the gate measurement: each round times one `runc start`
    /// per agent (0, 1 and 10 gate subscribers), in a random order.
    #[arg(long, default_value_t = 200)]
    pub gate_rounds: usize,
    /// Containers churned through each of the two agents (100 watchers,
    /// none) for the watcher CPU and memory measurement.
    #[arg(long, default_value_t = 300)]
    pub watch_churn: usize,
    /// Run only one part (`agent` includes `consumers`). Without it: `agent`,
    /// then `inode-map`.
    #[arg(long, value_name = "PART", value_parser = part_names())]
    pub only: Option<String>,
    /// Also build the agent of revision REV (a commit, tag or branch) and
    /// measure it side by side with this tree's, interleaved scenario by
    /// scenario on the same machine: each figure is printed for both, with
    /// their ratio. Runs the `agent` part (consumers included). REV is
    /// built once, in a git worktree under target/bench/against.
    #[arg(long, value_name = "REV")]
    pub against: Option<String>,
    /// Start each agent as in a pod on a cgroup v2 node: in a cgroup and a
    /// cgroup namespace of its own (`unshare --cgroup`), told the host's
    /// namespace by `--host-namespaces-pid` (this process). The agent then
    /// reads every container's cgroup in the host's namespace, as in the
    /// DaemonSet. Applies to the agents this process starts (discovery,
    /// churn, memory, start-up); not to the consumers part.
    #[arg(long)]
    pub agent_cgroup_namespace: bool,
    /// Internal: run only the consumers part, in this process, and write
    /// its results to PATH (how a release build of xtask runs it).
    #[arg(long, hide = true, value_name = "PATH")]
    pub consumers_out: Option<PathBuf>,
    /// Internal: the agent binary `--consumers-out` measures.
    #[arg(long, hide = true, value_name = "PATH", requires = "consumers_out")]
    pub agent: Option<PathBuf>,
}

/// Prints the inode-map table.
fn print_inode(v: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let m = &v["map"];
    println!(
        "\ninode map, {} entries per mode (a bare hash map lookup here: {:.0} ns)\n",
        g(m, "entries"),
        g(m, "bare_hashmap_lookup_ns")
    );
    println!(
        "| mode | insert (ns) | lookup (ns) | lookup, random order (ns) | bytes/entry | snapshot save (ms) | restore (ms) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for mode in ["passthrough", "xino", "allocated", "hashed"] {
        let x = &m["modes"][mode];
        let opt = |k: &str| {
            x.get(k)
                .and_then(Value::as_f64)
                .map_or("-".to_owned(), |f| format!("{f:.0}"))
        };
        println!(
            "| {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
            g(x, "insert_ns"),
            g(x, "lookup_ns"),
            g(x, "lookup_random_ns"),
            g(x, "bytes_per_entry"),
            opt("snapshot_save_ms"),
            opt("snapshot_restore_ms")
        );
    }
    let l = &v["listing_50k"];
    println!(
        "\nlisting {} entries: raw {:.1} ms, through stablefs (passthrough) {:.1} ms, ratio {:.2}",
        l["entries"],
        g(l, "raw_ms_p50"),
        g(l, "stablefs_passthrough_ms_p50"),
        g(l, "ratio")
    );
}

/// CLOCK_MONOTONIC now, in nanoseconds (the agent's event clock).
fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// `clock` now, in nanoseconds (0 if it cannot be read).
fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec pointer; an unknown clock is an error.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[idx.min(v.len() - 1)]
}

fn stats(v: &[f64]) -> Value {
    let mut v = v.to_vec();
    json!({
        "n": v.len(), "p50": pct(&mut v, 0.5), "p90": pct(&mut v, 0.9),
        "p99": pct(&mut v, 0.99), "max": pct(&mut v, 1.0),
    })
}

/// A new random order of `order` from the xorshift state `rng`.
///
/// An exec's cost depends on what ran just before it (caches, which CPU is
/// awake), and a fixed or rotating order gives each configuration a fixed
/// predecessor.
fn shuffle<T>(rng: &mut u64, order: &mut [T]) {
    for k in (1..order.len()).rev() {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        order.swap(k, (*rng % (k as u64 + 1)) as usize);
    }
}

/// A `lookout run --output json` child, stopped (SIGTERM, then reaped) when
/// dropped, so that a failed benchmark leaves no agent behind.
struct Agent {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

/// The cgroup agents run in with `--agent-cgroup-namespace`.
static AGENT_CGROUP: std::sync::OnceLock<AgentCgroup> = std::sync::OnceLock::new();

/// A cgroup (v2) that agents are started in, each in a cgroup namespace
/// rooted there: as a DaemonSet's pod sees the node's cgroups.
struct AgentCgroup {
    dir: PathBuf,
}

impl AgentCgroup {
    /// Makes `lookout-bench-agents` under the cgroup2 mount, once.
    fn make() -> anyhow::Result<()> {
        let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
        let mount = mounts
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() > 2 && f[2] == "cgroup2")
            .map(|f| PathBuf::from(f[1]))
            .context("--agent-cgroup-namespace: no cgroup2 hierarchy is mounted")?;
        let dir = mount.join("lookout-bench-agents");
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
        say(
            "bench",
            &format!(
                "agents run in {} and a cgroup namespace of their own",
                dir.display()
            ),
        );
        let _ = AGENT_CGROUP.set(AgentCgroup { dir });
        Ok(())
    }

    /// `command` (a `lookout run`), started in this cgroup and a new cgroup
    /// namespace, with this process as the host's: the shell and
    /// `unshare` exec, so the agent keeps the pid spawned.
    fn wrap(&self, command: &Command) -> Command {
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg("echo $$ > \"$0/cgroup.procs\" && exec unshare --cgroup \"$@\"")
            .arg(&self.dir)
            .arg(command.get_program())
            .args(command.get_args())
            .arg(format!("--host-namespaces-pid={}", std::process::id()));
        sh
    }
}

impl Agent {
    /// Starts the agent with stdout and stderr in `work` and waits for its
    /// `ready` line; returns it and the time to ready.
    fn start(bin: &Path, work: &Path, args: &[&str]) -> anyhow::Result<(Agent, Duration)> {
        let out = work.join("agent.out");
        let err = work.join("agent.err");
        let t = Instant::now();
        let mut command = Command::new(bin);
        command.args(["run", "--output", "json"]).args(args);
        if let Some(cg) = AGENT_CGROUP.get() {
            command = cg.wrap(&command);
        }
        let child = command
            // The start-up phases are a debug line (see `startup`).
            .env_remove("LOOKOUT_LOG")
            .env("RUST_LOG", "info,lookout_agent::run::startup=debug")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out)?)
            .stderr(std::fs::File::create(&err)?)
            .spawn()
            .context("starting lookout")?;
        let agent = Agent { child, out, err };
        let deadline = Instant::now() + Duration::from_secs(30);
        // `lookout::run: ready` from the binary's own module, or
        // `lookout_agent::run: ready` since the agent is a library.
        while !std::fs::read_to_string(&agent.err)
            .unwrap_or_default()
            .contains("::run: ready")
        {
            if Instant::now() > deadline {
                bail!(
                    "lookout never became ready:\n{}",
                    std::fs::read_to_string(&agent.err).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok((agent, t.elapsed()))
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the agent printed on stdout (its events) so far.
    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Everything the agent logged so far.
    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Events by container id: (added ns, removed ns).
    fn events(&self) -> Events {
        events_in(&self.out)
    }

    /// Stops the agent (SIGTERM) and reaps it.
    fn stop(self) {
        drop(self);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // N.B. SIGTERM, not SIGKILL: the agent removes its fanotify marks
        // and its socket on the way out.
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// Samples a process's RSS every 50 ms on a thread, keeping the peak.
struct PeakRss {
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl PeakRss {
    fn start(pid: u32) -> PeakRss {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let peak = std::sync::Arc::new(AtomicU64::new(0));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(proc_sample(pid).2, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        PeakRss { peak, stop, thread }
    }

    /// Stops sampling; the peak RSS in kB.
    fn stop(self) -> u64 {
        use std::sync::atomic::Ordering;
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
        self.peak.load(Ordering::Relaxed)
    }
}

/// The CPU time of our child `pid` in seconds: its process CPU clock
/// (nanoseconds, all threads, exited ones included); NaN if unreadable.
fn cpu_clock_s(pid: u32) -> f64 {
    let mut clock: libc::clockid_t = 0;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointers; the pid is our own unreaped child.
    unsafe {
        if libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) == 0
            && libc::clock_gettime(clock, &mut ts) == 0
        {
            ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
        } else {
            f64::NAN
        }
    }
}

/// The allow-all floor responder (lookout-fanotify's `allow_all` example)
/// marking some files: the least any exec-permission listener can do, and
/// so the floor of the agent's CPU per exec. Killed when dropped.
struct Floor {
    child: Child,
}

impl Floor {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts the allow-all responder on `marked` and waits for its `ready`
    /// line (its log in `dir/floor.err`).
    fn start(bin: &Path, marked: &[&Path], dir: &Path) -> anyhow::Result<Floor> {
        Self::start_with(bin, marked, dir, None)
    }

    /// Starts the work floor on `marked` (the BPF object first), its events
    /// in `dir/floor.out`, and waits for its `ready` line.
    fn start_work(floors: &Floors, marked: &Path, dir: &Path) -> anyhow::Result<Floor> {
        let out = dir.join("floor.out");
        Self::start_with(&floors.work, &[&floors.bpf_object, marked], dir, Some(&out))
    }

    /// Starts `bin` with `args`, its stdout in `out` (or nowhere), and waits
    /// for its `ready` line (its log in `dir/floor.err`).
    fn start_with(
        bin: &Path,
        args: &[&Path],
        dir: &Path,
        out: Option<&Path>,
    ) -> anyhow::Result<Floor> {
        std::fs::create_dir_all(dir)?;
        let err = dir.join("floor.err");
        let stdout = match out {
            Some(o) => Stdio::from(std::fs::File::create(o)?),
            None => Stdio::null(),
        };
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(std::fs::File::create(&err)?)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let floor = Floor { child };
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut floor = floor;
        loop {
            let log = std::fs::read_to_string(&err).unwrap_or_default();
            if log.contains("ready: allowing") {
                give_agent_slice(floor.child.id());
                return Ok(floor);
            }
            if let Ok(Some(status)) = floor.child.try_wait() {
                bail!("the floor responder exited ({status}):\n{log}");
            }
            if Instant::now() > deadline {
                bail!("the floor responder never became ready:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Its CPU time so far, in seconds.
    fn cpu_s(&self) -> f64 {
        cpu_clock_s(self.child.id())
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How many `kind` lines (`added`, `removed`) the work floor started in
/// `dir` printed for containers whose id holds `prefix`.
fn work_floor_lines(dir: &Path, kind: &str, prefix: &str) -> usize {
    let kind = format!("\"event\":\"{kind}\"");
    std::fs::read_to_string(dir.join("floor.out"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&kind) && l.contains(prefix))
        .count()
}

/// The runtime binary `name` as found in PATH, symlinks resolved (a mark
/// is on the file, not on a link to it).
fn in_path(name: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} is not in PATH (install it: cargo xtask test does)"))?
        .canonicalize()
        .with_context(|| format!("resolving {name}"))
}

/// (utime+stime ticks, voluntary context switches, VmRSS kB).
fn proc_sample(pid: u32) -> (u64, u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (
        ticks,
        status_field(&status, "voluntary_ctxt_switches:"),
        status_field(&status, "VmRSS:"),
    )
}

/// The number after `name` in a /proc/PID/status text (0 when absent).
fn status_field(status: &str, name: &str) -> u64 {
    status
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0)
}

/// Every thread of `pid` now: (tid, name, voluntary, involuntary context
/// switches). A thread that exits between two samples takes its count
/// with it; one born between them counts from 0.
fn thread_switches(pid: u32) -> Vec<(u32, String, u64, u64)> {
    threads(pid)
        .into_iter()
        .filter_map(|(tid, dir)| {
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let name = status
                .lines()
                .find_map(|l| l.strip_prefix("Name:"))
                .unwrap_or("")
                .trim()
                .to_owned();
            Some((
                tid,
                name,
                status_field(&status, "voluntary_ctxt_switches:"),
                status_field(&status, "nonvoluntary_ctxt_switches:"),
            ))
        })
        .collect()
}

/// Every thread of `pid` now: its id and `/proc/<pid>/task/<tid>`.
fn threads(pid: u32) -> Vec<(u32, PathBuf)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| Some((t.file_name().to_str()?.parse().ok()?, t.path())))
        .collect()
}

/// On-CPU time (ns) of the thread whose /proc directory is `dir`, from its
/// `schedstat` (not clock ticks).
pub(crate) fn schedstat_ns(dir: &Path) -> Option<u64> {
    std::fs::read_to_string(dir.join("schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The context switches between two [`thread_switches`] samples, per
/// `per` (containers): voluntary (a thread that waits: one per hand-off
/// it waits for), involuntary (a thread preempted), and the voluntary
/// ones by thread name.
fn switches_between(
    before: &[(u32, String, u64, u64)],
    after: &[(u32, String, u64, u64)],
    per: usize,
) -> Value {
    let per = per.max(1) as f64;
    let (mut voluntary, mut involuntary) = (0u64, 0u64);
    let mut by_thread = std::collections::BTreeMap::<String, u64>::new();
    for (tid, name, v, n) in after {
        let (v0, n0) = before
            .iter()
            .find(|b| b.0 == *tid)
            .map_or((0, 0), |b| (b.2, b.3));
        let dv = v.saturating_sub(v0);
        voluntary += dv;
        involuntary += n.saturating_sub(n0);
        *by_thread.entry(name.clone()).or_default() += dv;
    }
    json!({
        "voluntary_per_container": voluntary as f64 / per,
        "involuntary_per_container": involuntary as f64 / per,
        "voluntary_per_container_by_thread": by_thread
            .into_iter()
            .filter(|(_, v)| *v > 0)
            .map(|(k, v)| (k, json!(v as f64 / per)))
            .collect::<serde_json::Map<_, _>>(),
    })
}

/// The agent's resident memory split (`RssAnon`, `RssFile` in kB): its
/// heap and stacks, against the pages of its binary and libraries that it
/// touched (clean, shared with the page cache, reclaimable).
fn rss_split(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (
        status_field(&status, "RssAnon:"),
        status_field(&status, "RssFile:"),
    )
}

fn exec_times(bin: &Path, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            let _ = Command::new(bin).status();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect()
}

/// Writes `path` back and drops it from the page cache.
fn drop_page_cache(path: &Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    f.sync_all()?;
    // SAFETY: posix_fadvise on an fd we own; it only advises the kernel.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!("posix_fadvise({}): errno {rc}", path.display());
    }
    Ok(())
}

pub(crate) fn busybox_bundle(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("rootfs/bin"))?;
    lookout_testsupport::install_executable(
        Path::new("/bin/busybox"),
        &dir.join("rootfs/bin/busybox"),
    )
    .context("busybox-static needed")?;
    for a in ["sh", "sleep", "true"] {
        let _ = std::os::unix::fs::symlink("busybox", dir.join("rootfs/bin").join(a));
    }
    // `runc spec` refuses to overwrite: the bundle of an earlier agent of
    // the same run (`--against`) is made again.
    let _ = std::fs::remove_file(dir.join("config.json"));
    let st = Command::new("runc")
        .args(["spec", "--bundle"])
        .arg(dir)
        .status()?;
    if !st.success() {
        bail!("runc spec failed");
    }
    let p = dir.join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p)?)?;
    c["process"]["terminal"] = false.into();
    c["process"]["args"] = json!(args);
    std::fs::write(&p, serde_json::to_vec(&c)?)?;
    Ok(())
}

fn runc(args: &[&str]) -> bool {
    runtime(Path::new("runc"), args)
}

/// Runs the runtime `bin` with `args`, output discarded; whether it
/// succeeded. N.B. not a pipe: the container would inherit it.
fn runtime(bin: &Path, args: &[&str]) -> bool {
    Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Microseconds from `from` to `to` (negative when `to` came first: two
/// waiters on one exit wake in either order).
fn lag_us(from: u64, to: u64) -> f64 {
    (to as f64 - from as f64) / 1e3
}

/// A thread of its own waiting for process `pid` to end, as a listener
/// for container exits does: the floor of the discovery lags.
struct Observer(std::thread::JoinHandle<Option<u64>>);

impl Observer {
    /// Starts the thread and returns once it holds a pidfd for `pid` (so
    /// that the exit cannot come first); on the exit it reads `then`, if
    /// given, and notes the time. `None` if the pidfd cannot be had.
    fn arm(pid: u32, then: Option<PathBuf>) -> Option<Observer> {
        let (armed, rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            // As the agent's threads (see `AGENT_SLICE`).
            let _ = lookout_host::sched::request_slice(AGENT_SLICE);
            let fd = pidfd(pid);
            let _ = armed.send(fd.is_some());
            let ended = exited(&fd?);
            let read = then.is_none_or(|f| std::fs::read(f).is_ok_and(|b| !b.is_empty()));
            (ended && read).then(now_ns)
        });
        match rx.recv() {
            Ok(true) => Some(Observer(thread)),
            _ => None,
        }
    }

    /// When it saw the exit (and read its file), if it did.
    fn woke(self) -> Option<u64> {
        self.0.join().ok().flatten()
    }
}

/// The scheduler slice the agent's threads ask for by default
/// (`--scheduler-slice`), given to the floors' threads too: a floor that
/// waits longer for a CPU after a wake-up than the agent does is no floor.
pub(crate) const AGENT_SLICE: Duration = Duration::from_micros(100);

/// Gives every thread of process `pid` [`AGENT_SLICE`] (a floor, once it
/// is ready; its threads do not start more threads after that).
fn give_agent_slice(pid: u32) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for t in tasks.flatten() {
        if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse().ok()) {
            let _ = lookout_host::sched::request_slice_of(tid, AGENT_SLICE);
        }
    }
}

/// A pidfd for process `pid`, or `None` if it is gone.
fn pidfd(pid: u32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes integers and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
    // SAFETY: a new fd that nothing else owns.
    (fd >= 0).then(|| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// Waits (at most 10 s) for the process of pidfd `fd` to end.
fn exited(fd: &std::os::fd::OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(fd),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    (unsafe { libc::poll(&mut p, 1, 10_000) }) == 1
}

/// When process `pid` ended, as this thread saw it (at most 10 s).
fn wait_exit(pid: u32) -> Option<u64> {
    let fd = pidfd(pid)?;
    exited(&fd).then(now_ns)
}

/// The report being built: report.json's top-level keys.
type Report = serde_json::Map<String, Value>;

/// A part of the benchmark, as `--only` names it.
struct Part {
    /// The name `--only` takes.
    name: &'static str,
    /// What it measures, for `--help`.
    about: &'static str,
    /// Whether a run without `--only` includes it.
    in_full_run: bool,
    /// What must be built before it runs.
    needs: Needs,
    /// Measures; returns the part's top-level keys of report.json.
    run: fn(&Options, &Paths) -> anyhow::Result<Report>,
    /// Prints the part's table and lines from the whole report.
    print: fn(&Value),
}

/// The parts `--only` selects from, in the order a full run runs them.
const PARTS: &[Part] = &[
    Part {
        name: "agent",
        about: "exec overhead, start-up, idle, discovery, churn, memory, then consumers",
        in_full_run: true,
        needs: Needs::AgentAndFloor,
        run: agent_part,
        print: print_agent,
    },
    Part {
        name: "exec",
        about: "exec overhead alone, and where the agent's share goes",
        // N.B. The agent part runs it already.
        in_full_run: false,
        needs: Needs::AgentAndFloor,
        run: |opts, paths| {
            fresh_dir(&paths.work)?;
            let x = exec_overhead(opts, paths, &paths.lookout)?;
            Ok(entries([("exec_us", x)]))
        },
        print: |report| {
            let x = &report["exec_us"];
            for key in ["none", "floor", "lookout"] {
                println!(
                    "exec, {key}: p50 {:.1} us, p99 {:.1} us",
                    x[key]["p50"].as_f64().unwrap_or(f64::NAN),
                    x[key]["p99"].as_f64().unwrap_or(f64::NAN)
                );
            }
            print_exec_split(x);
        },
    },
    Part {
        name: "discovery",
        about: "discovery latency alone, in blocks as side by side (about 1 minute)",
        // N.B. The agent part runs it already.
        in_full_run: false,
        needs: Needs::AgentAndFloor,
        run: |opts, paths| {
            fresh_dir(&paths.work)?;
            let (mut d, work_floor) =
                discovery_interleaved(opts, paths, &[paths.lookout.as_path()])?;
            let mut d = d.pop().unwrap_or_default();
            d["work_floor"] = work_floor;
            Ok(entries([("discovery_us", d)]))
        },
        print: |report| {
            println!("\n| measurement | p50 | p99 |\n|---|---|---|");
            print_discovery_rows(&report["discovery_us"]);
        },
    },
    Part {
        name: "consumers",
        about: "gate subscribers and watchers alone (issue #12)",
        // N.B. The agent part runs it already.
        in_full_run: false,
        needs: Needs::AgentAndFloor,
        run: consumers_part,
        print: |report| consumers::print(&report["consumers"]),
    },
    Part {
        name: "nri",
        about: "NRI mode on a private containerd 1.7",
        in_full_run: false,
        needs: Needs::Agent,
        run: nri_part,
        print: |report| nri::print(&report["nri"]),
    },
    Part {
        name: "inode-map",
        about: "the inode map's modes and a listing through stablefs",
        in_full_run: true,
        needs: Needs::Nothing,
        run: inode_map_part,
        print: |report| print_inode(&report["inode_map"]),
    },
];

/// `--only`'s possible values, from [`PARTS`].
fn part_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        PARTS
            .iter()
            .map(|p| clap::builder::PossibleValue::new(p.name).help(p.about)),
    )
}

/// The parts to run: the one `only` names, or those of a full run.
fn selected(only: Option<&str>) -> anyhow::Result<Vec<&'static Part>> {
    let Some(name) = only else {
        return Ok(PARTS.iter().filter(|p| p.in_full_run).collect());
    };
    match PARTS.iter().find(|p| p.name == name) {
        Some(part) => Ok(vec![part]),
        None => {
            let names: Vec<&str> = PARTS.iter().map(|p| p.name).collect();
            bail!("--only {name}: no such part; use {}", names.join(", "))
        }
    }
}

/// What a part needs built, each level including the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Needs {
    /// Nothing (the inode map builds its own tool).
    Nothing,
    /// The BPF object and the agent (built as the image builds it).
    Agent,
    /// Those, and the floor responders (allow-all, and the work floor).
    AgentAndFloor,
}

/// Builds what `needs` asks for.
fn build(needs: Needs) -> anyhow::Result<()> {
    if needs >= Needs::Agent {
        crate::build_ebpf::build_ebpf(&crate::build_ebpf::Options {
            toolchain: "nightly".into(),
        })?;
        // Built as the image builds it (the list, packed relocations):
        // the figures are those of the agent that ships.
        let root = workspace_root();
        crate::image::build_agent(&root, &root.join(IMAGE_TARGET))?;
    }
    if needs >= Needs::AgentAndFloor {
        build_release(&["-p", "lookout-fanotify", "--example", "allow_all"])?;
        build_release(&["-p", "lookout-runtime-hook", "--example", "work_floor"])?;
    }
    Ok(())
}

/// `cargo build -j2 --release` with `args`.
fn build_release(args: &[&str]) -> anyhow::Result<()> {
    exec(
        "build",
        cargo().args(["build", "-j2", "--release"]).args(args),
        "see the compiler error above",
    )
}

/// The target directory the bench builds its agent in: the image's, so
/// that `cargo xtask image` and the bench share their build.
const IMAGE_TARGET: &str = "target/image/build";

/// The responders measured beside the agent, as floors of its figures.
struct Floors {
    /// The allow-all responder (lookout-fanotify's `allow_all` example):
    /// what any exec-permission listener pays.
    allow_all: PathBuf,
    /// The work floor (lookout-runtime-hook's `work_floor` example): the
    /// agent's work per container on one thread, with none of its safety
    /// boundaries.
    work: PathBuf,
    /// The BPF object the work floor loads (the agent's argv capture).
    bpf_object: PathBuf,
}

/// Where the benchmark finds its binaries and writes its files.
struct Paths {
    /// The agent, built as the image builds it (with its symbols).
    lookout: PathBuf,
    /// The floor responders.
    floors: Floors,
    /// target/bench, where report.json goes.
    out_dir: PathBuf,
    /// target/bench/work, the scratch directory.
    work: PathBuf,
}

impl Paths {
    fn new() -> Paths {
        let root = workspace_root();
        let out_dir = root.join("target/bench");
        Paths {
            lookout: crate::image::agent_binary(&root.join(IMAGE_TARGET)),
            floors: Floors {
                allow_all: root.join("target/release/examples/allow_all"),
                work: root.join("target/release/examples/work_floor"),
                bpf_object: root.join("target/bpf/lookout-ebpf.o"),
            },
            work: out_dir.join("work"),
            out_dir,
        }
    }
}

pub fn bench(opts: &Options) -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "the benchmark needs root (fanotify permission events, BPF, runc): sudo -E cargo xtask bench"
        );
    }
    if opts.agent_cgroup_namespace {
        AgentCgroup::make()?;
    }
    let paths = Paths::new();
    if let Some(out) = &opts.consumers_out {
        let v = consumers::bench_consumers(
            opts.agent.as_deref().unwrap_or(&paths.lookout),
            &paths.floors,
            &paths.work.join("consumers"),
            opts.gate_rounds,
            opts.watch_churn,
        )?;
        std::fs::write(out, serde_json::to_vec(&v)?)
            .with_context(|| format!("writing {}", out.display()))?;
        return Ok(());
    }
    if let Some(rev) = &opts.against {
        return against::bench_against(opts, &paths, rev);
    }
    let parts = selected(opts.only.as_deref())?;
    build(
        parts
            .iter()
            .map(|p| p.needs)
            .max()
            .unwrap_or(Needs::Nothing),
    )?;
    let mut report = Report::new();
    for part in &parts {
        report.extend((part.run)(opts, &paths)?);
    }
    let report = Value::Object(report);
    std::fs::create_dir_all(&paths.out_dir)?;
    let path = paths.out_dir.join("report.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", path.display()))?;
    for part in &parts {
        (part.print)(&report);
    }
    println!("report: {}", path.display());
    Ok(())
}

/// A report with these keys and values.
fn entries<const N: usize>(entries: [(&str, Value); N]) -> Report {
    entries
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
}

/// Empties `dir`, creating it if needed.
fn fresh_dir(dir: &Path) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

/// `path` as UTF-8, for a runtime's arguments.
fn utf8(path: &Path) -> anyhow::Result<&str> {
    path.to_str()
        .with_context(|| format!("not UTF-8: {}", path.display()))
}

/// The `agent` part: each measurement below in order, in a fresh scratch
/// directory, then the consumers.
fn agent_part(opts: &Options, paths: &Paths) -> anyhow::Result<Report> {
    let mut reports = agent_runs(opts, paths, &[paths.lookout.as_path()])?;
    reports.pop().context("one report per agent")
}

/// The `agent` part's measurements for each of `agents` (release builds of
/// `lookout`), interleaved: each measurement runs for every agent before
/// the next one starts, and the order of the agents turns round from one
/// measurement to the next, so that neither always goes first. One report
/// per agent, in the order given.
fn agent_runs(opts: &Options, paths: &Paths, agents: &[&Path]) -> anyhow::Result<Vec<Report>> {
    fresh_dir(&paths.work)?;
    let n = agents.len();
    // The agents' indexes in the order of measurement `turn`.
    let order = |turn: usize| (0..n).map(move |k| (k + turn) % n);
    let mut exec_us = vec![Value::Null; n];
    for k in order(0) {
        exec_us[k] = exec_overhead(opts, paths, agents[k])?;
    }
    let startup_ms = startup(paths, agents)?;
    // The churn's floor is measured before the agents' churns and after
    // them, and the lower kept: one sample alone moves with the machine.
    let first_floor = churn_floor_sample(opts, paths, "before")?;
    // Idle, discovery, churn and memory share one agent, in this order.
    let mut shared = vec![[Value::Null, Value::Null, Value::Null, Value::Null]; n];
    for k in order(1) {
        let (agent, _) = Agent::start(agents[k], &paths.work, &[])?;
        let idle_5s = idle(&agent);
        let discovery_us = discovery(opts, &paths.work, &agent)?;
        let churn = churn(opts, &paths.work, &agent)?;
        let memory = heavy_annotations(opts, &paths.work, &agent)?;
        agent.stop();
        shared[k] = [idle_5s, discovery_us, churn, memory];
    }
    let churn_floor = churn_floor(opts, paths, first_floor)?;
    // Side by side, the discovery rows come from containers interleaved
    // between the agents; the shared agent's run above stays (what the
    // memory row measures follows it) as `discovery_shared_us`.
    // The work floor's lags: in turns with the agents side by side, alone
    // (in the same blocks) otherwise.
    if n > 1 {
        let (interleaved, work_floor) = discovery_interleaved(opts, paths, agents)?;
        for (shared, mut d) in shared.iter_mut().zip(interleaved) {
            d["work_floor"] = work_floor.clone();
            shared[1] = json!({"interleaved": d, "shared": shared[1].take()});
        }
    } else {
        let (_, work_floor) = discovery_interleaved(opts, paths, &[])?;
        for shared in &mut shared {
            shared[1]["work_floor"] = work_floor.clone();
        }
    }
    // Consumers: gate subscribers and watchers (issue #12).
    let mut consumer_reports = vec![Value::Null; n];
    for k in order(2) {
        consumer_reports[k] = consumers::bench_consumers_release(opts, &paths.work, agents[k])?;
    }

    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut reports = Vec::with_capacity(n);
    for (((exec_us, startup_ms), shared), consumer_report) in exec_us
        .into_iter()
        .zip(startup_ms)
        .zip(shared)
        .zip(consumer_reports)
    {
        let [idle_5s, mut discovery_us, churn, memory] = shared;
        let discovery_shared_us = match discovery_us.get_mut("interleaved") {
            Some(d) => {
                let d = d.take();
                std::mem::replace(&mut discovery_us, d)
                    .get_mut("shared")
                    .map(Value::take)
                    .unwrap_or_default()
            }
            None => Value::Null,
        };
        reports.push(entries([
            ("kernel", json!(kernel.trim())),
            ("cpus", json!(cpus)),
            ("exec_us", exec_us),
            ("startup_ms", startup_ms),
            ("idle_5s", idle_5s),
            ("discovery_us", discovery_us),
            ("discovery_shared_us", discovery_shared_us),
            ("churn", churn),
            ("churn_floor", churn_floor.clone()),
            ("memory_heavy_annotations", memory),
            ("consumers", consumer_report),
        ]));
    }
    for r in &mut reports {
        if r.get("discovery_shared_us").is_some_and(Value::is_null) {
            r.remove("discovery_shared_us");
        }
    }
    Ok(reports)
}

/// Exec overhead: the time (us) to fork, exec and wait for a static no-op
/// with no listener, under the allow-all floor responder, and watched by
/// lookout (named `runc`), interleaved in a new random order every round.
fn exec_overhead(opts: &Options, paths: &Paths, lookout: &Path) -> anyhow::Result<Value> {
    let work = &paths.work;
    std::fs::create_dir_all(work.join("bin"))?;
    // A no-op static binary named like a runtime: its exec cost is all
    // fork+exec, so a listener's share is visible.
    let src = work.join("noop.c");
    std::fs::write(&src, "int main(void) { return 0; }\n")?;
    let fake = work.join("bin/runc");
    exec(
        "build noop",
        Command::new("gcc")
            .args(["-O2", "-static", "-o"])
            .arg(&fake)
            .arg(&src),
        "install gcc and libc6-dev",
    )?;
    let fake_s = utf8(&fake)?;

    // Three copies of the no-op (three inodes): one unmarked, one marked by
    // the allow-all floor responder, one watched by lookout. Both listeners
    // run at once and the execs are interleaved, so machine noise hits all
    // three configurations alike.
    std::fs::create_dir_all(work.join("floor"))?;
    std::fs::create_dir_all(work.join("none"))?;
    let floor_noop = work.join("floor/noop");
    let none_noop = work.join("none/noop");
    lookout_testsupport::install_executable(&fake, &floor_noop)?;
    lookout_testsupport::install_executable(&fake, &none_noop)?;
    say(
        "bench",
        &format!(
            "exec overhead: {} interleaved execs per configuration",
            opts.rounds * opts.execs
        ),
    );
    // The work floor takes the BPF record and parses argv as the agent
    // does; named apart, so that neither's programs capture the other's
    // execs (the agent's filter has every default runtime's name).
    std::fs::create_dir_all(work.join("work-floor"))?;
    let work_noop = work.join("work-floor/runc-wf");
    lookout_testsupport::install_executable(&fake, &work_noop)?;
    let f = Floor::start(&paths.floors.allow_all, &[&floor_noop], &work.join("floor"))?;
    let wf = Floor::start_work(&paths.floors, &work_noop, &work.join("work-floor"))?;
    let (a, _) = Agent::start(lookout, work, &["--runtime-path", fake_s])?;
    // The three files must be in the same page-cache state: a file that
    // `cp` or the linker just wrote sits in the cache in other folio sizes
    // than one that exec faulted in, and that alone moved an exec by
    // +-30 us here (more than the listeners cost). Drop them, then let
    // exec fault all three in the same way.
    for p in [&none_noop, &floor_noop, &work_noop, &fake] {
        drop_page_cache(p)?;
    }
    for _ in 0..50 {
        for p in [&none_noop, &floor_noop, &work_noop, &fake] {
            let _ = exec_times(p, 1); // warm up
        }
    }
    let (mut none, mut floor, mut work_t, mut agent_t) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let answer_cpu_ns = thread_cpu_ns(a.pid(), "lookout-answer");
    let floor_cpu_ns = thread_cpu_ns(f.pid(), "");
    let work_cpu_ns = thread_cpu_ns(wf.pid(), "");
    // A new random order every iteration (see `shuffle`).
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..opts.rounds * opts.execs {
        let mut order = [0usize, 1, 2, 3];
        shuffle(&mut rng, &mut order);
        for k in order {
            match k {
                0 => none.extend(exec_times(&none_noop, 1)),
                1 => floor.extend(exec_times(&floor_noop, 1)),
                2 => work_t.extend(exec_times(&work_noop, 1)),
                _ => agent_t.extend(exec_times(&fake, 1)),
            }
        }
    }
    let answer_cpu_ns =
        answer_cpu_ns.and_then(|before| Some(thread_cpu_ns(a.pid(), "lookout-answer")? - before));
    let floor_cpu_ns = floor_cpu_ns.and_then(|before| Some(thread_cpu_ns(f.pid(), "")? - before));
    let work_cpu_ns = work_cpu_ns.and_then(|before| Some(thread_cpu_ns(wf.pid(), "")? - before));
    let n = agent_t.len().max(1) as f64;
    drop(f);
    drop(wf);
    // Where the agent's share goes, off the timed loop: its BPF programs
    // in the exec'ing process (kernel statistics, on only for this), and
    // the answering thread's CPU above.
    let bpf = bpf_cost_per_exec(a.pid(), &fake, &none_noop, opts.execs.max(200) * 10);
    a.stop();
    let med = |v: &[f64]| pct(&mut v.to_vec(), 0.5);
    Ok(json!({
        "none": stats(&none), "floor": stats(&floor), "lookout": stats(&agent_t),
        "work_floor": stats(&work_t),
        "overhead_floor_p50_us": med(&floor) - med(&none),
        "overhead_work_floor_p50_us": med(&work_t) - med(&none),
        "overhead_lookout_p50_us": med(&agent_t) - med(&none),
        "work_floor_cpu_us_per_exec": work_cpu_ns.map(|ns| ns as f64 / work_t.len().max(1) as f64 / 1e3),
        "lookout_vs_floor_total_p50": med(&agent_t) / med(&floor),
        "answer_thread_cpu_us_per_exec": answer_cpu_ns.map(|ns| ns as f64 / n / 1e3),
        "floor_cpu_us_per_exec": floor_cpu_ns.map(|ns| ns as f64 / floor.len().max(1) as f64 / 1e3),
        "bpf": bpf,
    }))
}

/// CPU time (ns) that thread `name` of process `pid` (its main thread for
/// "") has used, from its `schedstat` (on-CPU ns, not clock ticks).
fn thread_cpu_ns(pid: u32, name: &str) -> Option<u64> {
    let (_, dir) = threads(pid).into_iter().find(|(tid, dir)| {
        if name.is_empty() {
            *tid == pid
        } else {
            std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim() == name)
        }
    })?;
    schedstat_ns(&dir)
}

/// Run time (ns) and runs of the tracepoint programs agent `pid` holds,
/// summed, from `/proc/<pid>/fdinfo` (kernel.bpf_stats_enabled must be on).
fn bpf_prog_stats(pid: u32) -> (u64, u64) {
    let mut total = (0, 0);
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return total;
    };
    for fd in fds.flatten() {
        let info = std::fs::read_to_string(fd.path()).unwrap_or_default();
        let field = |k: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        // 5: BPF_PROG_TYPE_TRACEPOINT.
        if field("prog_type:") == Some(5) {
            total.0 += field("run_time_ns:").unwrap_or(0);
            total.1 += field("run_cnt:").unwrap_or(0);
        }
    }
    total
}

/// The agent's BPF programs' kernel time per exec (ns): `n` execs of
/// `watched` (a runtime's name: the argv is captured) and `n` of `other`
/// (any other exec on the node: the programs leave early), each with its
/// exit. Statistics are switched on for this only and set back after.
/// `null` when the kernel keeps none.
fn bpf_cost_per_exec(pid: u32, watched: &Path, other: &Path, n: usize) -> Value {
    const KNOB: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let Ok(was) = std::fs::read_to_string(KNOB) else {
        return Value::Null;
    };
    if std::fs::write(KNOB, "1").is_err() {
        return Value::Null;
    }
    let per_exec = |bin: &Path| {
        let (t0, _) = bpf_prog_stats(pid);
        let _ = exec_times(bin, n);
        let (t1, _) = bpf_prog_stats(pid);
        t1.saturating_sub(t0) as f64 / n as f64
    };
    let watched_ns = per_exec(watched);
    let other_ns = per_exec(other);
    let _ = std::fs::write(KNOB, was.trim());
    json!({ "execs": n, "watched_ns": watched_ns, "other_ns": other_ns })
}

/// Starts of each agent in the start-up measurement.
const STARTS: usize = 5;

/// Start-up: spawn to the agent's `ready` log line, [`STARTS`] starts of
/// each of `agents` (interleaved), in ms; and each phase's p50 from the
/// agent's `start-up phases` debug line (probe, BPF load, marks, scan, ...),
/// with `outside` the time spawn to ready that the agent did not count
/// (exec, the dynamic loader, the log's way to the benchmark). An agent
/// too old to log its phases has none.
fn startup(paths: &Paths, agents: &[&Path]) -> anyhow::Result<Vec<Value>> {
    say(
        "bench",
        &format!("start-up time to ready ({STARTS} starts per agent)"),
    );
    let mut times = vec![Vec::new(); agents.len()];
    let mut phases: Vec<Vec<(String, f64)>> = vec![Vec::new(); agents.len()];
    for round in 0..STARTS {
        for k in (0..agents.len()).map(|k| (k + round) % agents.len()) {
            let (a, t) = Agent::start(agents[k], &paths.work, &[])?;
            let ms = t.as_secs_f64() * 1e3;
            times[k].push(ms);
            let log = a.stderr();
            a.stop();
            let laps = startup_phases(&log);
            if let Some((_, total)) = laps.iter().find(|(name, _)| name == "total") {
                phases[k].push(("outside".to_owned(), ms - total));
            }
            phases[k].extend(laps);
        }
    }
    Ok(times
        .iter()
        .zip(phases)
        .map(|(times, laps)| {
            let mut by_phase: Vec<(String, Vec<f64>)> = Vec::new();
            for (name, ms) in laps {
                match by_phase.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, v)) => v.push(ms),
                    None => by_phase.push((name, vec![ms])),
                }
            }
            let p50: serde_json::Map<String, Value> = by_phase
                .into_iter()
                .map(|(name, mut v)| (name, json!(pct(&mut v, 0.5))))
                .collect();
            let mut v = stats(times);
            v["phases_p50"] = Value::Object(p50);
            v
        })
        .collect())
}

/// The phases of the agent's `start-up phases: probe=12.3ms ... total=..ms`
/// line in `log`, in order, in ms; none if it has no such line.
fn startup_phases(log: &str) -> Vec<(String, f64)> {
    let Some(line) = log.lines().find(|l| l.contains("start-up phases: ")) else {
        return Vec::new();
    };
    let rest = line.split("start-up phases: ").nth(1).unwrap_or_default();
    rest.split_whitespace()
        .filter_map(|pair| {
            let (name, ms) = pair.split_once('=')?;
            Some((name.to_owned(), ms.strip_suffix("ms")?.parse().ok()?))
        })
        .collect()
}

/// Idle cost: `agent`'s CPU ticks and voluntary context switches over 5 s
/// with nothing happening, and its RSS then.
fn idle(agent: &Agent) -> Value {
    say("bench", "idle for 5 s");
    let s0 = proc_sample(agent.pid());
    std::thread::sleep(Duration::from_secs(5));
    let s1 = proc_sample(agent.pid());
    let (anon, file) = rss_split(agent.pid());
    json!({
        "cpu_ticks": s1.0 - s0.0, "voluntary_ctxt_switches": s1.1 - s0.1, "rss_kb": s1.2,
        "rss_anon_kb": anon, "rss_file_kb": file,
    })
}

/// Discovery latency (us), over `opts.latency` sequential runc containers
/// (`sleep 0.05`): `runc create` exec -> `Added`, `runc create` exit ->
/// `Added`, container exit -> `Removed`; all CLOCK_MONOTONIC.
fn discovery(opts: &Options, work: &Path, agent: &Agent) -> anyhow::Result<Value> {
    say(
        "bench",
        &format!(
            "discovery latency: {} containers, one at a time",
            opts.latency
        ),
    );
    let bundle = latency_bundle(work)?;
    Ok(discovery_block(work, &bundle, &agent.out, "bench-lat", opts.latency)?.report())
}

/// Blocks the agents take turns in for the interleaved discovery
/// measurement, and containers per block each agent starts with and does
/// not count (the first after a start faults its code in).
const DISCOVERY_BLOCKS: usize = 10;
const DISCOVERY_WARM_UP: usize = 2;

/// Discovery latency of each of `agents`, their containers interleaved:
/// `opts.latency` per agent in [`DISCOVERY_BLOCKS`] blocks, the agents
/// taking turns block by block (each started afresh for its block, the
/// order turning round), so that what the machine does meanwhile falls on
/// both alike. Measured for `--against`: one agent's 200 sequential
/// containers after the other's moved both the lags and their floor by
/// more than the agents differ.
fn discovery_interleaved(
    opts: &Options,
    paths: &Paths,
    agents: &[&Path],
) -> anyhow::Result<(Vec<Value>, Value)> {
    let n = agents.len();
    let per = opts.latency.div_ceil(DISCOVERY_BLOCKS).max(1);
    say(
        "bench",
        &format!(
            "discovery latency, interleaved: {} containers per agent and for the work floor, in \
             {DISCOVERY_BLOCKS} blocks of {per} they take turns in",
            per * DISCOVERY_BLOCKS
        ),
    );
    let bundle = latency_bundle(&paths.work)?;
    let runc = in_path("runc")?;
    // The agents, then the work floor (index n).
    let mut all: Vec<Lags> = (0..=n).map(|_| Lags::default()).collect();
    for b in 0..DISCOVERY_BLOCKS {
        for k in (0..=n).map(|k| (k + b) % (n + 1)) {
            // The work floor marks the runc the agents watch, named runc:
            // no agent runs during its block.
            let (agent, floor, events) = if k < n {
                let (agent, _) = Agent::start(agents[k], &paths.work, &[])?;
                let out = agent.out.clone();
                (Some(agent), None, out)
            } else {
                let dir = paths.work.join("discovery-work-floor");
                let floor = Floor::start_work(&paths.floors, &runc, &dir)?;
                (None, Some(floor), dir.join("floor.out"))
            };
            discovery_block(
                &paths.work,
                &bundle,
                &events,
                &format!("bench-ilat-w{b}-{k}"),
                DISCOVERY_WARM_UP,
            )?;
            let lags = discovery_block(
                &paths.work,
                &bundle,
                &events,
                &format!("bench-ilat{b}-{k}"),
                per,
            )?;
            if let Some(agent) = agent {
                agent.stop();
            }
            drop(floor);
            all[k].extend(lags);
        }
    }
    let mut reports: Vec<Value> = all.into_iter().map(|l| l.report()).collect();
    let work_floor = reports.pop().unwrap_or_default();
    Ok((reports, work_floor))
}

/// What a discovery run measured, in microseconds.
#[derive(Default)]
struct Lags {
    create_exec_to_added: Vec<f64>,
    create_exit_to_added: Vec<f64>,
    exit_to_removed: Vec<f64>,
    floor_added: Vec<f64>,
    floor_removed: Vec<f64>,
    kernel: KernelLags,
    missing_added: usize,
    missing_removed: usize,
}

/// The same lags from the kernel's time of each exit (see
/// [`exits::ExitClock`]), in microseconds.
#[derive(Default)]
struct KernelLags {
    /// `runc create`'s last thread began to exit -> `Added`.
    create_exit_to_added: Vec<f64>,
    /// The container's init began to exit -> `Removed`.
    exit_to_removed: Vec<f64>,
    /// ... -> the benchmark's own pidfd woke (the other rows' reference).
    exit_to_reference: Vec<f64>,
    /// ... -> the floor's thread woke.
    exit_to_floor_woken: Vec<f64>,
    /// Exits the rings had no room for.
    lost: u64,
}

impl Lags {
    fn extend(&mut self, o: Lags) {
        self.create_exec_to_added.extend(o.create_exec_to_added);
        self.create_exit_to_added.extend(o.create_exit_to_added);
        self.exit_to_removed.extend(o.exit_to_removed);
        self.floor_added.extend(o.floor_added);
        self.floor_removed.extend(o.floor_removed);
        let (k, o_k) = (&mut self.kernel, o.kernel);
        k.create_exit_to_added.extend(o_k.create_exit_to_added);
        k.exit_to_removed.extend(o_k.exit_to_removed);
        k.exit_to_reference.extend(o_k.exit_to_reference);
        k.exit_to_floor_woken.extend(o_k.exit_to_floor_woken);
        k.lost += o_k.lost;
        self.missing_added += o.missing_added;
        self.missing_removed += o.missing_removed;
    }

    fn report(&self) -> Value {
        let k = &self.kernel;
        json!({
            "missing": {"added": self.missing_added, "removed": self.missing_removed},
            "create_exec_to_added": stats(&self.create_exec_to_added),
            "create_exit_to_added": stats(&self.create_exit_to_added),
            "exit_to_removed": stats(&self.exit_to_removed),
            "floor": {
                "create_exit_to_state_read": stats(&self.floor_added),
                "exit_to_woken": stats(&self.floor_removed),
            },
            "from_kernel_exit": {
                "create_exit_to_added": stats(&k.create_exit_to_added),
                "exit_to_removed": stats(&k.exit_to_removed),
                "exit_to_reference": stats(&k.exit_to_reference),
                "exit_to_floor_woken": stats(&k.exit_to_floor_woken),
                "lost_samples": k.lost,
            },
        })
    }
}

/// The discovery containers' bundle (`sleep 0.05`), made once per run.
fn latency_bundle(work: &Path) -> anyhow::Result<PathBuf> {
    let b = work.join("bundle-lat");
    busybox_bundle(&b, &["sleep", "0.05"])?;
    Ok(b)
}

/// `count` sequential runc containers of `bundle` (ids `<prefix>-<i>`)
/// under `agent`, and the lags of its events behind them; then deleted.
fn discovery_block(
    work: &Path,
    bundle: &Path,
    events: &Path,
    prefix: &str,
    count: usize,
) -> anyhow::Result<Lags> {
    let bs = utf8(bundle)?;
    let mut created_at = HashMap::new();
    let mut exec_at = HashMap::new();
    let mut exited_at = HashMap::new();
    // The floor of both lags: a thread that waits for the same exits and
    // does the least the agent must (reads the state file after create).
    let mut floor_added = Vec::new();
    // The kernel's time of each exit: by container id, the pids of its
    // `runc create` and of its init, and when the floor's thread woke.
    let mut clock = match exits::ExitClock::open() {
        Ok(c) => Some(c),
        Err(e) => {
            say(
                "bench",
                &format!("no kernel exit times, the kernel rows stay empty: {e:#}"),
            );
            None
        }
    };
    let mut pids: HashMap<String, (u32, u32)> = HashMap::new();
    let mut floor_woke_at = HashMap::new();
    for i in 0..count {
        let id = format!("{prefix}-{i}");
        let pidfile = work.join(format!("{id}.pid"));
        exec_at.insert(id.clone(), now_ns());
        let mut create = Command::new("runc")
            .args(["create", "--bundle", bs, "--pid-file", utf8(&pidfile)?, &id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("runc create")?;
        let state = PathBuf::from(format!("/run/runc/{id}/state.json"));
        let observer = Observer::arm(create.id(), Some(state));
        if !create.wait().is_ok_and(|s| s.success()) {
            bail!("runc create failed");
        }
        let created = now_ns();
        created_at.insert(id.clone(), created);
        let cpid: u32 = std::fs::read_to_string(&pidfile)?
            .trim()
            .parse()
            .with_context(|| format!("pid in {}", pidfile.display()))?;
        floor_added.extend(
            observer
                .and_then(Observer::woke)
                .map(|t| lag_us(created, t)),
        );
        pids.insert(id.clone(), (create.id(), cpid));
        let observer = Observer::arm(cpid, None);
        runc(&["start", &id]);
        if let Some(t) = wait_exit(cpid) {
            exited_at.insert(id.clone(), t);
            if let Some(w) = observer.and_then(Observer::woke) {
                floor_woke_at.insert(id.clone(), w);
            }
        }
    }
    // Every event in, or 5 s: a lost event shows as `missing`, not as a
    // lag the run cut short.
    let missing = |ev: &Events| {
        (
            without(ev, created_at.keys(), Kind::Added),
            without(ev, exited_at.keys(), Kind::Removed),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while missing(&events_in(events)) != (0, 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let ev = events_in(events);
    let (missing_added, missing_removed) = missing(&ev);
    // By container id: when its `runc create` and its init began to exit.
    let (mut kernel_create_exit, mut kernel_exit) = (HashMap::new(), HashMap::new());
    let mut kernel_lost = 0;
    if let Some(clock) = clock.as_mut() {
        let exits = clock.drain();
        for (id, (create, init)) in &pids {
            if let Some(&t) = exits.get(create) {
                kernel_create_exit.insert(id.clone(), t);
            }
            if let Some(&t) = exits.get(init) {
                kernel_exit.insert(id.clone(), t);
            }
        }
        kernel_lost = clock.lost();
    }
    // From each container's time in `from` to its time in `to`.
    let between = |from: &HashMap<String, u64>, to: &HashMap<String, u64>| -> Vec<f64> {
        from.iter()
            .filter_map(|(id, &a)| Some(lag_us(a, *to.get(id)?)))
            .collect()
    };
    let lags = Lags {
        create_exec_to_added: lags(&exec_at, &ev, Kind::Added),
        create_exit_to_added: lags(&created_at, &ev, Kind::Added),
        exit_to_removed: lags(&exited_at, &ev, Kind::Removed),
        floor_added,
        floor_removed: between(&exited_at, &floor_woke_at),
        kernel: KernelLags {
            create_exit_to_added: lags(&kernel_create_exit, &ev, Kind::Added),
            exit_to_removed: lags(&kernel_exit, &ev, Kind::Removed),
            exit_to_reference: between(&kernel_exit, &exited_at),
            exit_to_floor_woken: between(&kernel_exit, &floor_woke_at),
            lost: kernel_lost,
        },
        missing_added,
        missing_removed,
    };
    for id in created_at.keys() {
        runc(&["delete", "--force", id]);
    }
    Ok(lags)
}

/// Events by container id: (added ns, removed ns), as [`Agent::events`]
/// returns them.
type Events = HashMap<String, (Vec<u64>, Vec<u64>)>;

/// The events in `out`, JSON lines as the agent and the work floor print
/// them.
fn events_in(out: &Path) -> Events {
    let mut m = Events::new();
    let Ok(f) = std::fs::File::open(out) else {
        return m;
    };
    for line in std::io::BufReader::new(f).lines().map_while(Result::ok) {
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let id = v["container"]["id"].as_str().unwrap_or_default().to_owned();
        let ns = v["monotonic_ns"].as_u64().unwrap_or(0);
        let e = m.entry(id).or_default();
        if v["event"] == "added" {
            e.0.push(ns);
        } else {
            e.1.push(ns);
        }
    }
    m
}

/// Which of a container's events.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Added,
    Removed,
}

/// How many of `ids` have no `kind` event.
fn without<'a>(events: &Events, ids: impl IntoIterator<Item = &'a String>, kind: Kind) -> usize {
    ids.into_iter()
        .filter(|id| {
            events.get(*id).is_none_or(|(a, r)| match kind {
                Kind::Added => a.is_empty(),
                Kind::Removed => r.is_empty(),
            })
        })
        .count()
}

/// Microseconds from each container's time in `at` to its first `kind`
/// event, for the containers that have one.
fn lags(at: &HashMap<String, u64>, events: &Events, kind: Kind) -> Vec<f64> {
    at.iter()
        .filter_map(|(id, &t)| {
            let (added, removed) = events.get(id)?;
            let &e = match kind {
                Kind::Added => added,
                Kind::Removed => removed,
            }
            .first()?;
            Some((e as f64 - t as f64) / 1e3)
        })
        .collect()
}

/// Churn: `opts.churn` runc containers (`sleep 20`) created and started by
/// [`WORKERS`] threads; events missed, stuck or doubled, how many are
/// tracked at once, and `agent`'s CPU time and peak RSS meanwhile.
fn churn(opts: &Options, work: &Path, agent: &Agent) -> anyhow::Result<Value> {
    say(
        "bench",
        &format!("churn: {} containers by {WORKERS} workers", opts.churn),
    );
    let b = work.join("bundle-churn");
    busybox_bundle(&b, &["sleep", "20"])?;
    let bs = utf8(&b)?;
    let ids = container_ids("bench-churn", opts.churn);
    let pid = agent.pid();
    let c0 = proc_sample(pid);
    let clock0 = cpu_clock_s(pid);
    let sampler = PeakRss::start(pid);
    let t = Instant::now();
    let failed = std::sync::atomic::AtomicUsize::new(0);
    on_workers(&ids, |id| {
        if !create_and_start(bs, id) {
            failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let create_secs = t.elapsed().as_secs_f64();
    let tracked_peak = tracked(&agent.events(), &ids);
    wait_until(Duration::from_millis(200), || {
        let e = agent.events();
        ids.iter()
            .all(|i| e.get(i).is_some_and(|(_, r)| !r.is_empty()))
    });
    let churn_peak = sampler.stop();
    let c1 = proc_sample(pid);
    let clock = cpu_clock_s(pid) - clock0;
    let e = agent.events();
    let missed = without(&e, &ids, Kind::Added);
    let stuck = without(&e, &ids, Kind::Removed);
    let dupes = ids
        .iter()
        .filter(|i| e.get(*i).is_some_and(|(a, r)| a.len() > 1 || r.len() > 1))
        .count();
    on_workers(&ids, delete);
    let rss_after = proc_sample(pid).2;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(json!({
        "containers": opts.churn, "create_start_failed": failed.into_inner(),
        "create_start_per_s": opts.churn as f64 / create_secs,
        "missed_added": missed, "missing_removed": stuck, "duplicates": dupes,
        "tracked_at_end_of_creation": tracked_peak,
        "cpu_s": (c1.0 - c0.0) as f64 / hz, "cpu_clock_s": clock, "wall_s": create_secs,
        "peak_rss_kb": churn_peak, "rss_after_kb": rss_after,
    }))
}

/// One sample of the churn's floors: the same number of containers created
/// and started by the same workers with no agent, under each floor
/// responder alone marking runc, and its CPU per container. The allow-all
/// responder answers runc's execs (create, init, start) and nothing else:
/// what any exec-permission listener pays per container on this machine,
/// below which the agent's churn CPU cannot go. The work floor does the
/// agent's work for each container (argv, config.json, state file, /proc,
/// an `added` line) on its one thread, with none of the agent's safety
/// boundaries.
fn churn_floor_sample(opts: &Options, paths: &Paths, when: &str) -> anyhow::Result<Value> {
    say(
        "bench",
        &format!(
            "churn floors ({when} the agents'): {} containers by {WORKERS} workers under the allow-all responder alone, then under the work floor",
            opts.churn
        ),
    );
    let runc = in_path("runc")?;
    let b = paths.work.join("bundle-floor");
    busybox_bundle(&b, &["sleep", "20"])?;
    let bs = utf8(&b)?;
    let mut samples = Vec::new();
    for work in [false, true] {
        let dir = paths.work.join(if work { "work-floor" } else { "floor" });
        let floor = if work {
            Floor::start_work(&paths.floors, &runc, &dir)?
        } else {
            Floor::start(&paths.floors.allow_all, &[&runc], &dir)?
        };
        let prefix = format!("bench-floor-{when}-{}", if work { "w" } else { "a" });
        let ids = container_ids(&prefix, opts.churn);
        let failed = std::sync::atomic::AtomicUsize::new(0);
        let c0 = floor.cpu_s();
        on_workers(&ids, |id| {
            if !create_and_start(bs, id) {
                failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        let cpu = floor.cpu_s() - c0;
        drop(floor);
        on_workers(&ids, delete);
        let failed = failed.into_inner();
        // Per container that was created and started (a failed one may
        // have cost the responder less).
        let done = opts.churn.saturating_sub(failed).max(1);
        let mut v = json!({
            "create_start_failed": failed,
            "cpu_s": cpu,
            "cpu_per_container_ms": cpu * 1e3 / done as f64,
        });
        if work {
            // It did the work: an `added` line for each container (a
            // work floor that skipped it would be a floor too low).
            let added = work_floor_lines(&dir, "added", &prefix);
            v["added_lines"] = json!(added);
            if added < opts.churn - failed {
                say(
                    "bench",
                    &format!(
                        "WARNING: the work floor printed {added} added lines for {} containers: its churn figure is left out",
                        opts.churn - failed
                    ),
                );
                v["cpu_per_container_ms"] = Value::Null;
            }
        }
        samples.push(v);
    }
    let (mut v, work) = (samples.remove(0), samples.remove(0));
    v["when"] = json!(when);
    v["work"] = work;
    Ok(v)
}

/// The churn's floor: `first` (taken before the agents' churns) and a
/// second sample after them; the lower of the two is the floor.
fn churn_floor(opts: &Options, paths: &Paths, first: Value) -> anyhow::Result<Value> {
    let second = churn_floor_sample(opts, paths, "after")?;
    let per = |v: &Value| v["cpu_per_container_ms"].as_f64().unwrap_or(f64::NAN);
    let (a, b) = (per(&first), per(&second));
    let (wa, wb) = (per(&first["work"]), per(&second["work"]));
    Ok(json!({
        "containers": opts.churn,
        "cpu_per_container_ms": a.min(b),
        "work_cpu_per_container_ms": wa.min(wb),
        "samples": [first, second],
    }))
}

/// Memory: `opts.heavy` runc containers (`sleep 60`) whose config.json
/// carries 64 KiB of annotations each (16 of 4 KiB), all tracked at once;
/// `agent`'s RSS then and its peak.
fn heavy_annotations(opts: &Options, work: &Path, agent: &Agent) -> anyhow::Result<Value> {
    say(
        "bench",
        &format!(
            "memory: {} containers with 64 KiB of annotations each",
            opts.heavy
        ),
    );
    let hb = work.join("bundle-heavy");
    busybox_bundle(&hb, &["sleep", "60"])?;
    {
        let p = hb.join("config.json");
        let mut c: Value = serde_json::from_slice(&std::fs::read(&p)?)?;
        let annotations: serde_json::Map<String, Value> = (0..16)
            .map(|i| (format!("bench.lookout/a{i:02}"), json!("x".repeat(4096))))
            .collect();
        c["annotations"] = Value::Object(annotations);
        std::fs::write(&p, serde_json::to_vec(&c)?)?;
    }
    let hbs = utf8(&hb)?;
    let ids = container_ids("bench-heavy", opts.heavy);
    let pid = agent.pid();
    let sampler = PeakRss::start(pid);
    on_workers(&ids, |id| {
        let _ = create_and_start(hbs, id);
    });
    wait_until(Duration::from_millis(100), || {
        let e = agent.events();
        ids.iter()
            .all(|i| e.get(i).is_some_and(|(a, _)| !a.is_empty()))
    });
    let heavy_tracked = tracked(&agent.events(), &ids);
    let heavy_rss = proc_sample(pid).2;
    let (heavy_anon, heavy_file) = rss_split(pid);
    let heavy_peak = sampler.stop();
    on_workers(&ids, delete);
    Ok(json!({
        "containers": opts.heavy, "annotation_bytes_each": 16 * 4096,
        "tracked": heavy_tracked,
        "rss_all_tracked_kb": heavy_rss,
        "rss_anon_kb": heavy_anon, "rss_file_kb": heavy_file,
        "peak_rss_kb": heavy_peak,
    }))
}

/// Threads that create, start and delete the churn and memory containers.
const WORKERS: usize = 10;

/// `prefix-0` .. `prefix-{n-1}`.
fn container_ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Calls `f` on every id, split among [`WORKERS`] threads.
fn on_workers(ids: &[String], f: impl Fn(&str) + Sync) {
    let f = &f;
    std::thread::scope(|s| {
        for chunk in ids.chunks(ids.len().div_ceil(WORKERS).max(1)) {
            s.spawn(move || {
                for id in chunk {
                    f(id);
                }
            });
        }
    });
}

/// `runc create` and `runc start` of container `id` from `bundle`; whether
/// both succeeded.
fn create_and_start(bundle: &str, id: &str) -> bool {
    runc(&["create", "--bundle", bundle, id]) && runc(&["start", id])
}

/// `runc delete --force` of container `id`.
fn delete(id: &str) {
    runc(&["delete", "--force", id]);
}

/// How many of `ids` have been added and not removed.
fn tracked(events: &Events, ids: &[String]) -> usize {
    ids.iter()
        .filter(|i| {
            events
                .get(*i)
                .is_some_and(|(a, r)| !a.is_empty() && r.is_empty())
        })
        .count()
}

/// Polls `done` every `every` until it holds or 60 s have passed.
fn wait_until(every: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() && Instant::now() < deadline {
        std::thread::sleep(every);
    }
}

/// The `consumers` part alone, in a fresh scratch directory.
fn consumers_part(opts: &Options, paths: &Paths) -> anyhow::Result<Report> {
    fresh_dir(&paths.work)?;
    let v = consumers::bench_consumers_release(opts, &paths.work, &paths.lookout)?;
    Ok(entries([("consumers", v)]))
}

/// The `nri` part: see [`nri`].
fn nri_part(_opts: &Options, paths: &Paths) -> anyhow::Result<Report> {
    let v = nri::bench_nri(&paths.lookout, &paths.work.join("nri"))?;
    Ok(entries([("nri", v)]))
}

/// The `inode-map` part: insert, lookup and memory per entry in each mode,
/// and a listing through stablefs.
fn inode_map_part(opts: &Options, paths: &Paths) -> anyhow::Result<Report> {
    std::fs::create_dir_all(&paths.work)?;
    let v = crate::bench_inode::bench_inode_map(&paths.work, opts.inode_entries)?;
    Ok(entries([("inode_map", v)]))
}

/// The exec overhead over no listener, and where the agent's share goes.
fn print_exec_split(x: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "exec overhead over no listener (p50): floor {:.1} us, lookout {:.1} us; of lookout's: \
         its BPF programs {:.2} us per watched exec ({:.2} us on every other exec), \
         its answering thread's CPU {:.2} us per exec (the allow-all responder's: {:.2} us)",
        g(x, "overhead_floor_p50_us"),
        g(x, "overhead_lookout_p50_us"),
        g(&x["bpf"], "watched_ns") / 1e3,
        g(&x["bpf"], "other_ns") / 1e3,
        g(x, "answer_thread_cpu_us_per_exec"),
        g(x, "floor_cpu_us_per_exec"),
    );
    if x["work_floor"].is_object() {
        println!(
            "exec overhead of the work floor (the BPF record taken and argv parsed on one thread, as the agent's answering thread does): {:.1} us p50 over no listener, {:.1} us beyond the allow-all floor; its CPU {:.2} us per exec",
            g(x, "overhead_work_floor_p50_us"),
            g(x, "overhead_work_floor_p50_us") - g(x, "overhead_floor_p50_us"),
            g(x, "work_floor_cpu_us_per_exec"),
        );
    }
}

/// Prints the `agent` part's table and lines, then the consumers'.
/// The discovery rows of a report's `discovery_us`, as table rows.
fn print_discovery_rows(d: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let p50_p99 = |name: &str, v: &Value| {
        println!("| {name} | {:.0} | {:.0} |", g(v, "p50"), g(v, "p99"));
    };
    for (name, key) in [
        ("runc create exec -> Added (us)", "create_exec_to_added"),
        ("runc create exit -> Added (us)", "create_exit_to_added"),
        ("container exit -> Removed (us)", "exit_to_removed"),
    ] {
        p50_p99(name, &d[key]);
    }
    for (name, key) in [
        (
            "work floor: create exit -> its added line (us)",
            "create_exit_to_added",
        ),
        (
            "work floor: container exit -> its removed line (us)",
            "exit_to_removed",
        ),
    ] {
        if d["work_floor"].is_object() {
            p50_p99(name, &d["work_floor"][key]);
        }
    }
    for (name, key) in [
        (
            "floor: create exit -> another thread read the state (us)",
            "create_exit_to_state_read",
        ),
        (
            "floor: container exit -> another thread woke (us)",
            "exit_to_woken",
        ),
    ] {
        p50_p99(name, &d["floor"][key]);
    }
    // From the kernel's time of each exit (`sched_process_exit`), which
    // the rows above, timed from the benchmark's own wake-up, leave out.
    let k = &d["from_kernel_exit"];
    if k.is_object() {
        for (name, key) in [
            (
                "from the kernel: runc create began to exit -> Added (us)",
                "create_exit_to_added",
            ),
            (
                "from the kernel: container began to exit -> Removed (us)",
                "exit_to_removed",
            ),
            (
                "from the kernel: container began to exit -> the benchmark's reference woke (us)",
                "exit_to_reference",
            ),
            (
                "from the kernel: container began to exit -> the floor's thread woke (us)",
                "exit_to_floor_woken",
            ),
        ] {
            p50_p99(name, &k[key]);
        }
        let wk = &d["work_floor"]["from_kernel_exit"];
        if wk.is_object() {
            p50_p99(
                "from the kernel: container began to exit -> the work floor's removed line (us)",
                &wk["exit_to_removed"],
            );
        }
    }
    println!(
        "| discovery events missing after 5 s (added, removed) | {} | {} |",
        d["missing"]["added"], d["missing"]["removed"]
    );
    if k["lost_samples"].as_u64().is_some_and(|n| n > 0) {
        println!(
            "kernel exit samples lost: {} (the kernel rows are short)",
            k["lost_samples"]
        );
    }
}

fn print_agent(report: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let p50_p99 = |name: &str, v: &Value| {
        println!("| {name} | {:.0} | {:.0} |", g(v, "p50"), g(v, "p99"));
    };
    let x = &report["exec_us"];
    println!("\n| measurement | p50 | p99 |\n|---|---|---|");
    for (name, key) in [
        ("exec, no listener (us)", "none"),
        ("exec, allow-all floor (us)", "floor"),
        ("exec, work floor (us)", "work_floor"),
        ("exec, lookout (us)", "lookout"),
    ] {
        p50_p99(name, &x[key]);
    }
    print_discovery_rows(&report["discovery_us"]);
    println!(
        "| start-up to ready (ms) | {:.0} | {:.0} |",
        g(&report["startup_ms"], "p50"),
        g(&report["startup_ms"], "max")
    );
    println!();
    if let Some(phases) = report["startup_ms"]["phases_p50"]
        .as_object()
        .filter(|p| !p.is_empty())
    {
        let line: Vec<String> = phases
            .iter()
            .map(|(name, ms)| format!("{name} {:.1}", ms.as_f64().unwrap_or(f64::NAN)))
            .collect();
        println!("start-up phases, p50 (ms): {}", line.join(", "));
    }
    print_exec_split(x);
    let i = &report["idle_5s"];
    println!(
        "idle 5 s: {} CPU ticks, {} wakeups, RSS {} kB (anonymous {} kB, file {} kB)",
        i["cpu_ticks"],
        i["voluntary_ctxt_switches"],
        i["rss_kb"],
        i["rss_anon_kb"],
        i["rss_file_kb"]
    );
    let ch = &report["churn"];
    println!(
        "churn {}: {:.1} containers/s, missed {}, stuck {}, duplicates {}, tracked at once {}, agent CPU {:.2} s, peak RSS {} kB",
        ch["containers"],
        g(ch, "create_start_per_s"),
        ch["missed_added"],
        ch["missing_removed"],
        ch["duplicates"],
        ch["tracked_at_end_of_creation"],
        g(ch, "cpu_s"),
        ch["peak_rss_kb"]
    );
    let fl = &report["churn_floor"];
    println!(
        "churn floor: {} containers under the allow-all responder alone: {:.3} ms per container, the lower of {:.3} and {:.3} (the agent, CPU clock: {:.3} ms)",
        fl["containers"],
        g(fl, "cpu_per_container_ms"),
        g(&fl["samples"][0], "cpu_per_container_ms"),
        g(&fl["samples"][1], "cpu_per_container_ms"),
        g(ch, "cpu_clock_s") * 1e3 / g(ch, "containers"),
    );
    println!(
        "churn work floor: the same containers under the work floor alone (the agent's work on one thread, no safety boundaries): {:.3} ms per container, the lower of {:.3} and {:.3} ({} and {} added lines)",
        g(fl, "work_cpu_per_container_ms"),
        g(&fl["samples"][0]["work"], "cpu_per_container_ms"),
        g(&fl["samples"][1]["work"], "cpu_per_container_ms"),
        fl["samples"][0]["work"]["added_lines"],
        fl["samples"][1]["work"]["added_lines"],
    );
    let m = &report["memory_heavy_annotations"];
    println!(
        "memory: {} containers with 64 KiB of annotations each, {} tracked at once: RSS {} kB (anonymous {} kB, file {} kB), peak {} kB",
        m["containers"],
        m["tracked"],
        m["rss_all_tracked_kb"],
        m["rss_anon_kb"],
        m["rss_file_kb"],
        m["peak_rss_kb"]
    );
    consumers::print(&report["consumers"]);
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        opts: Options,
    }

    fn only(name: &str) -> Result<Option<String>, clap::Error> {
        Cli::try_parse_from(["bench", "--only", name]).map(|cli| cli.opts.only)
    }

    #[test]
    fn only_takes_each_part_by_name() {
        Cli::command().debug_assert();
        let names: Vec<&str> = PARTS.iter().map(|p| p.name).collect();
        // The names docs/benchmarks.md uses; they must not change.
        assert_eq!(
            names,
            [
                "agent",
                "exec",
                "discovery",
                "consumers",
                "nri",
                "inode-map"
            ]
        );
        for name in names {
            let parsed = only(name).expect("a part's name parses");
            let parts = selected(parsed.as_deref()).expect("a part's name selects it");
            assert_eq!(parts.iter().map(|p| p.name).collect::<Vec<_>>(), [name]);
        }
    }

    #[test]
    fn only_rejects_an_unknown_name_listing_the_parts() {
        let err = only("inode").expect_err("not a part").to_string();
        let msg = selected(Some("inode")).err().map(|e| e.to_string());
        for name in PARTS.iter().map(|p| p.name) {
            assert!(err.contains(name), "{err}");
            assert!(msg.as_deref().is_some_and(|m| m.contains(name)), "{msg:?}");
        }
    }

    #[test]
    fn switches_are_counted_per_container_by_thread_and_a_new_thread_from_zero() {
        let before = vec![
            (1, "lookout".to_owned(), 10, 4),
            (2, "lookout-answer".to_owned(), 7, 0),
        ];
        let after = vec![
            (1, "lookout".to_owned(), 30, 6),
            (2, "lookout-answer".to_owned(), 17, 2),
            // Born between the samples; a thread that exited is gone.
            (3, "lookout-config".to_owned(), 10, 0),
        ];
        let v = switches_between(&before, &after, 10);
        assert_eq!(v["voluntary_per_container"], json!(4.0));
        assert_eq!(v["involuntary_per_container"], json!(0.4));
        assert_eq!(
            v["voluntary_per_container_by_thread"],
            json!({"lookout": 2.0, "lookout-answer": 1.0, "lookout-config": 1.0})
        );
        // This process's own threads can be read.
        let me = thread_switches(std::process::id());
        assert!(me.iter().any(|t| t.0 == std::process::id()), "{me:?}");
    }

    #[test]
    fn the_start_up_phases_are_read_from_the_agents_debug_line() {
        let log = "2026-12-03T03:00:00Z  INFO lookout_agent::serve: serving\n\
                   2026-12-03T03:00:00Z DEBUG lookout_agent::run::startup: start-up phases: \
                   runtimes=0.4ms probe=31.5ms bpf=120.0ms total=160.2ms\n";
        let phases = startup_phases(log);
        let names: Vec<&str> = phases.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["runtimes", "probe", "bpf", "total"]);
        assert_eq!(phases[1].1, 31.5);
        assert!(startup_phases("ready\n").is_empty());
        assert!(startup_phases("start-up phases: probe=x total=1ms").len() == 1);
    }

    #[test]
    fn a_full_run_is_agent_then_inode_map() {
        let parts = selected(None).expect("no --only");
        let names: Vec<&str> = parts.iter().map(|p| p.name).collect();
        assert_eq!(names, ["agent", "inode-map"]);
    }
}
