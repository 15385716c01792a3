//! `cargo xtask bench`: measures the agent against real runtimes and writes
//! target/bench/report.json. Needs root. Ratios are measured side by side
//! in one run; absolute times on shared VMs are noisy.

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
#[path = "bench_consumers.rs"]
mod consumers;
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
    #[arg(long, default_value_t = 50)]
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
    /// Run only one part: `agent` (includes `consumers`), `consumers`, `nri` or
    /// `inode-map`.
    #[arg(long, value_name = "PART")]
    pub only: Option<String>,
    /// Internal: run only the consumers part, in this process, and write
    /// its results to PATH (how a release build of xtask runs it).
    #[arg(long, hide = true, value_name = "PATH")]
    pub consumers_out: Option<PathBuf>,
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
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid timespec pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
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
    json!({"n": v.len(), "p50": pct(&mut v, 0.5), "p99": pct(&mut v, 0.99), "max": pct(&mut v, 1.0)})
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

impl Agent {
    /// Starts the agent with stdout and stderr in `work` and waits for its
    /// `ready` line; returns it and the time to ready.
    fn start(bin: &Path, work: &Path, args: &[&str]) -> anyhow::Result<(Agent, Duration)> {
        let out = work.join("agent.out");
        let err = work.join("agent.err");
        let t = Instant::now();
        let child = Command::new(bin)
            .args(["run", "--output", "json"])
            .args(args)
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
    fn events(&self) -> HashMap<String, (Vec<u64>, Vec<u64>)> {
        let mut m: HashMap<String, (Vec<u64>, Vec<u64>)> = HashMap::new();
        let Ok(f) = std::fs::File::open(&self.out) else {
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

/// (utime+stime ticks, voluntary context switches, VmRSS kB).
fn proc_sample(pid: u32) -> (u64, u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (ticks, field("voluntary_ctxt_switches:"), field("VmRSS:"))
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

fn busybox_bundle(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("rootfs/bin"))?;
    lookout_testsupport::install_executable(
        Path::new("/bin/busybox"),
        &dir.join("rootfs/bin/busybox"),
    )
    .context("busybox-static needed")?;
    for a in ["sh", "sleep", "true"] {
        let _ = std::os::unix::fs::symlink("busybox", dir.join("rootfs/bin").join(a));
    }
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

fn wait_exit(pid: u32) -> Option<u64> {
    // SAFETY: pidfd_open takes integers; the fd is closed below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
    if fd < 0 {
        return None;
    }
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, 10_000) };
    let t = now_ns();
    // SAFETY: our own fd.
    unsafe { libc::close(fd) };
    (n == 1).then_some(t)
}

pub fn bench(opts: &Options) -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "the benchmark needs root (fanotify permission events, BPF, runc): sudo -E cargo xtask bench"
        );
    }
    if let Some(out) = &opts.consumers_out {
        let root = workspace_root();
        let v = consumers::bench_consumers(
            &root.join("target/release/lookout"),
            &root.join("target/bench/work/consumers"),
            opts.gate_rounds,
            opts.watch_churn,
        )?;
        std::fs::write(out, serde_json::to_vec(&v)?)?;
        return Ok(());
    }
    if opts.only.as_deref() == Some("inode-map") {
        let out_dir = workspace_root().join("target/bench");
        let work = out_dir.join("work");
        std::fs::create_dir_all(&work)?;
        let v = crate::bench_inode::bench_inode_map(&work, opts.inode_entries)?;
        let path = out_dir.join("report.json");
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&json!({ "inode_map": v }))?,
        )?;
        print_inode(&v);
        println!("report: {}", path.display());
        return Ok(());
    }
    if let Some(other) = opts
        .only
        .as_deref()
        .filter(|o| !["agent", "consumers", "nri"].contains(o))
    {
        bail!("--only {other}: use agent, consumers, nri or inode-map");
    }
    crate::build_ebpf::build_ebpf(&crate::build_ebpf::Options {
        toolchain: "nightly".into(),
    })?;
    exec(
        "build",
        cargo().args([
            "build",
            "-j2",
            "--release",
            "-p",
            "lookout-agent",
            "--bin",
            "lookout",
        ]),
        "see the compiler error above",
    )?;
    if opts.only.as_deref() == Some("nri") {
        let root = workspace_root();
        let out_dir = root.join("target/bench");
        let v = nri::bench_nri(
            &root.join("target/release/lookout"),
            &out_dir.join("work/nri"),
        )?;
        let path = out_dir.join("report.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&json!({ "nri": v }))?)?;
        nri::print(&v);
        println!("report: {}", path.display());
        return Ok(());
    }
    if opts.only.as_deref() == Some("consumers") {
        let root = workspace_root();
        let out_dir = root.join("target/bench");
        let work = out_dir.join("work");
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work)?;
        let v = consumers::bench_consumers_release(opts, &work)?;
        let path = out_dir.join("report.json");
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&json!({ "consumers": v }))?,
        )?;
        consumers::print(&v);
        println!("report: {}", path.display());
        return Ok(());
    }
    exec(
        "build",
        cargo().args([
            "build",
            "-j2",
            "--release",
            "-p",
            "lookout-fanotify",
            "--example",
            "allow_all",
        ]),
        "see the compiler error above",
    )?;
    let root = workspace_root();
    let lookout = root.join("target/release/lookout");
    let floor_bin = root.join("target/release/examples/allow_all");
    let out_dir = root.join("target/bench");
    let work = out_dir.join("work");
    let _ = std::fs::remove_dir_all(&work);
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
    let fake_s = fake.to_str().context("utf-8 path")?.to_owned();

    // 1. Exec overhead. Three copies of the no-op (three inodes): one
    // unmarked, one marked by the allow-all floor responder, one watched by
    // lookout. Both listeners run at once and the execs are interleaved,
    // so machine noise hits all three configurations alike.
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
    let mut f = Command::new(&floor_bin)
        .arg(&floor_noop)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let (a, _) = Agent::start(&lookout, &work, &["--runtime-path", &fake_s])?;
    std::thread::sleep(Duration::from_millis(200));
    // The three files must be in the same page-cache state: a file that
    // `cp` or the linker just wrote sits in the cache in other folio sizes
    // than one that exec faulted in, and that alone moved an exec by
    // +-30 us here (more than the listeners cost). Drop them, then let
    // exec fault all three in the same way.
    for p in [&none_noop, &floor_noop, &fake] {
        drop_page_cache(p)?;
    }
    for _ in 0..50 {
        for p in [&none_noop, &floor_noop, &fake] {
            let _ = exec_times(p, 1); // warm up
        }
    }
    let (mut none, mut floor, mut agent_t) = (Vec::new(), Vec::new(), Vec::new());
    // A new random order every iteration (see `shuffle`).
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..opts.rounds * opts.execs {
        let mut order = [0usize, 1, 2];
        shuffle(&mut rng, &mut order);
        for k in order {
            match k {
                0 => none.extend(exec_times(&none_noop, 1)),
                1 => floor.extend(exec_times(&floor_noop, 1)),
                _ => agent_t.extend(exec_times(&fake, 1)),
            }
        }
    }
    a.stop();
    let _ = f.kill();
    let _ = f.wait();
    let med = |v: &[f64]| pct(&mut v.to_vec(), 0.5);
    let over_floor = med(&floor) - med(&none);
    let over_agent = med(&agent_t) - med(&none);

    // 2. Start-up, idle cost, discovery latency and churn with real runc.
    say("bench", "start-up time to ready (3 starts)");
    let mut startups = Vec::new();
    for _ in 0..3 {
        let (a, t) = Agent::start(&lookout, &work, &[])?;
        startups.push(t.as_secs_f64() * 1e3);
        a.stop();
    }
    let (agent, _) = Agent::start(&lookout, &work, &[])?;
    let pid = agent.pid();
    say("bench", "idle for 5 s");
    let s0 = proc_sample(pid);
    std::thread::sleep(Duration::from_secs(5));
    let s1 = proc_sample(pid);

    say(
        "bench",
        &format!(
            "discovery latency: {} containers, one at a time",
            opts.latency
        ),
    );
    let b = work.join("bundle-lat");
    busybox_bundle(&b, &["sleep", "0.05"])?;
    let bs = b.to_str().context("utf-8")?.to_owned();
    let mut created_at = HashMap::new();
    let mut exec_at = HashMap::new();
    let mut exited_at = HashMap::new();
    for i in 0..opts.latency {
        let id = format!("bench-lat-{i}");
        let pidfile = work.join(format!("{id}.pid"));
        exec_at.insert(id.clone(), now_ns());
        if !runc(&[
            "create",
            "--bundle",
            &bs,
            "--pid-file",
            pidfile.to_str().context("utf-8")?,
            &id,
        ]) {
            bail!("runc create failed");
        }
        created_at.insert(id.clone(), now_ns());
        let cpid: u32 = std::fs::read_to_string(&pidfile)?.trim().parse()?;
        runc(&["start", &id]);
        if let Some(t) = wait_exit(cpid) {
            exited_at.insert(id.clone(), t);
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let ev = agent.events();
    let (mut add_lag, mut rem_lag, mut exec_lag) = (Vec::new(), Vec::new(), Vec::new());
    for (id, t) in &exec_at {
        if let Some((a, _)) = ev.get(id)
            && let Some(&a) = a.first()
        {
            exec_lag.push((a as f64 - *t as f64) / 1e3);
        }
    }
    for (id, t) in &created_at {
        if let Some((a, _)) = ev.get(id)
            && let Some(&a) = a.first()
        {
            add_lag.push((a as f64 - *t as f64) / 1e3);
        }
    }
    for (id, t) in &exited_at {
        if let Some((_, r)) = ev.get(id)
            && let Some(&r) = r.first()
        {
            rem_lag.push((r as f64 - *t as f64) / 1e3);
        }
    }
    for id in created_at.keys() {
        runc(&["delete", "--force", id]);
    }

    say(
        "bench",
        &format!("churn: {} containers by 10 workers", opts.churn),
    );
    let b = work.join("bundle-churn");
    busybox_bundle(&b, &["sleep", "20"])?;
    let bs = b.to_str().context("utf-8")?.to_owned();
    let ids: Vec<String> = (0..opts.churn)
        .map(|i| format!("bench-churn-{i}"))
        .collect();
    let c0 = proc_sample(pid);
    let sampler = PeakRss::start(pid);
    let t = Instant::now();
    let failed = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for chunk in ids.chunks(opts.churn.div_ceil(10)) {
            let (bs, failed) = (&bs, &failed);
            s.spawn(move || {
                for id in chunk {
                    if !(runc(&["create", "--bundle", bs, id]) && runc(&["start", id])) {
                        failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let create_secs = t.elapsed().as_secs_f64();
    let tracked_peak = {
        let e = agent.events();
        ids.iter()
            .filter(|i| {
                e.get(*i)
                    .is_some_and(|(a, r)| !a.is_empty() && r.is_empty())
            })
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let e = agent.events();
        if ids
            .iter()
            .all(|i| e.get(i).is_some_and(|(_, r)| !r.is_empty()))
            || Instant::now() > deadline
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let churn_peak = sampler.stop();
    let c1 = proc_sample(pid);
    let e = agent.events();
    let missed = ids
        .iter()
        .filter(|i| e.get(*i).is_none_or(|(a, _)| a.is_empty()))
        .count();
    let stuck = ids
        .iter()
        .filter(|i| e.get(*i).is_none_or(|(_, r)| r.is_empty()))
        .count();
    let dupes = ids
        .iter()
        .filter(|i| e.get(*i).is_some_and(|(a, r)| a.len() > 1 || r.len() > 1))
        .count();
    std::thread::scope(|s| {
        for chunk in ids.chunks(opts.churn.div_ceil(10)) {
            s.spawn(move || {
                for id in chunk {
                    runc(&["delete", "--force", id]);
                }
            });
        }
    });
    let rss_after = proc_sample(pid).2;

    // 3. Memory: containers whose config.json carries 64 KiB of annotations
    //    each (16 of 4 KiB), all tracked at once.
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
    let hbs = hb.to_str().context("utf-8")?.to_owned();
    let heavy_ids: Vec<String> = (0..opts.heavy)
        .map(|i| format!("bench-heavy-{i}"))
        .collect();
    let heavy_sampler = PeakRss::start(pid);
    std::thread::scope(|s| {
        for chunk in heavy_ids.chunks(opts.heavy.div_ceil(10).max(1)) {
            let hbs = &hbs;
            s.spawn(move || {
                for id in chunk {
                    let _ = runc(&["create", "--bundle", hbs, id]) && runc(&["start", id]);
                }
            });
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let e = agent.events();
        if heavy_ids
            .iter()
            .all(|i| e.get(i).is_some_and(|(a, _)| !a.is_empty()))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let heavy_tracked = {
        let e = agent.events();
        heavy_ids
            .iter()
            .filter(|i| {
                e.get(*i)
                    .is_some_and(|(a, r)| !a.is_empty() && r.is_empty())
            })
            .count()
    };
    let heavy_rss = proc_sample(pid).2;
    let heavy_peak = heavy_sampler.stop();
    std::thread::scope(|s| {
        for chunk in heavy_ids.chunks(opts.heavy.div_ceil(10).max(1)) {
            s.spawn(move || {
                for id in chunk {
                    runc(&["delete", "--force", id]);
                }
            });
        }
    });
    agent.stop();

    // 4. Consumers: gate subscribers and watchers (issue #12).
    let consumer_report = consumers::bench_consumers_release(opts, &work)?;

    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let report = json!({
        "kernel": kernel.trim(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "exec_us": {
            "none": stats(&none), "floor": stats(&floor), "lookout": stats(&agent_t),
            "overhead_floor_p50_us": over_floor, "overhead_lookout_p50_us": over_agent,
            "lookout_vs_floor_total_p50": med(&agent_t) / med(&floor),
        },
        "startup_ms": stats(&startups),
        "idle_5s": {"cpu_ticks": s1.0 - s0.0, "voluntary_ctxt_switches": s1.1 - s0.1, "rss_kb": s1.2},
        "discovery_us": {
            "create_exec_to_added": stats(&exec_lag),
            "create_exit_to_added": stats(&add_lag),
            "exit_to_removed": stats(&rem_lag),
        },
        "churn": {
            "containers": opts.churn, "create_start_failed": failed.into_inner(),
            "create_start_per_s": opts.churn as f64 / create_secs,
            "missed_added": missed, "missing_removed": stuck, "duplicates": dupes,
            "tracked_at_end_of_creation": tracked_peak,
            "cpu_s": (c1.0 - c0.0) as f64 / hz, "wall_s": create_secs,
            "peak_rss_kb": churn_peak, "rss_after_kb": rss_after,
        },
        "memory_heavy_annotations": {
            "containers": opts.heavy, "annotation_bytes_each": 16 * 4096,
            "tracked": heavy_tracked,
            "rss_all_tracked_kb": heavy_rss,
            "peak_rss_kb": heavy_peak,
        },
        "consumers": consumer_report,
    });
    let inode = if opts.only.is_none() {
        Some(crate::bench_inode::bench_inode_map(
            &work,
            opts.inode_entries,
        )?)
    } else {
        None
    };
    let mut report = report;
    if let Some(v) = &inode {
        report["inode_map"] = v.clone();
    }
    std::fs::create_dir_all(&out_dir)?;
    let path = out_dir.join("report.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;

    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let x = &report["exec_us"];
    println!("\n| measurement | p50 | p99 |\n|---|---|---|");
    for (name, key) in [
        ("exec, no listener (us)", "none"),
        ("exec, allow-all floor (us)", "floor"),
        ("exec, lookout (us)", "lookout"),
    ] {
        println!(
            "| {name} | {:.0} | {:.0} |",
            g(&x[key], "p50"),
            g(&x[key], "p99")
        );
    }
    let d = &report["discovery_us"];
    println!(
        "| runc create exec -> Added (us) | {:.0} | {:.0} |",
        g(&d["create_exec_to_added"], "p50"),
        g(&d["create_exec_to_added"], "p99")
    );
    println!(
        "| runc create exit -> Added (us) | {:.0} | {:.0} |",
        g(&d["create_exit_to_added"], "p50"),
        g(&d["create_exit_to_added"], "p99")
    );
    println!(
        "| container exit -> Removed (us) | {:.0} | {:.0} |",
        g(&d["exit_to_removed"], "p50"),
        g(&d["exit_to_removed"], "p99")
    );
    println!(
        "| start-up to ready (ms) | {:.0} | {:.0} |",
        g(&report["startup_ms"], "p50"),
        g(&report["startup_ms"], "max")
    );
    println!();
    println!(
        "exec overhead over no listener (p50): floor {over_floor:.0} us, lookout {over_agent:.0} us"
    );
    println!(
        "idle 5 s: {} CPU ticks, {} wakeups, RSS {} kB",
        s1.0 - s0.0,
        s1.1 - s0.1,
        s1.2
    );
    let ch = &report["churn"];
    println!(
        "churn {}: {:.1} containers/s, missed {}, stuck {}, duplicates {}, tracked at once {}, agent CPU {:.2} s, peak RSS {} kB",
        opts.churn,
        g(ch, "create_start_per_s"),
        ch["missed_added"],
        ch["missing_removed"],
        ch["duplicates"],
        ch["tracked_at_end_of_creation"],
        g(ch, "cpu_s"),
        ch["peak_rss_kb"]
    );
    let m = &report["memory_heavy_annotations"];
    println!(
        "memory: {} containers with 64 KiB of annotations each, {} tracked at once: RSS {} kB, peak {} kB",
        opts.heavy, m["tracked"], m["rss_all_tracked_kb"], m["peak_rss_kb"]
    );
    consumers::print(&report["consumers"]);
    if let Some(v) = &inode {
        print_inode(v);
    }
    println!("report: {}", path.display());
    Ok(())
}
