//! The consumers part of `cargo xtask bench` (issue #12): what gate
//! subscribers add to a container's `runc start`, and what watchers cost
//! the agent in CPU per event and in memory.
//!
//! Every comparison runs side by side in one run. Each agent watches a
//! private copy of runc (`--no-default-runtimes --runtime-path COPY`):
//! fanotify marks are per inode, so one agent's holds never delay another
//! agent's execs. The copies are used in a new random order every round,
//! so machine noise hits every configuration alike. (The copies share the
//! name `runc`, so every agent's BPF program records the argv of every
//! copy's execs: a cost all agents pay alike.)
//!
//! The consumers are tokio tasks in this process, one connection each,
//! using lookout-client. They are part of what is measured, so this runs in
//! a release build of xtask ([`bench_consumers_release`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lookout_client::{Client, Event, Filter, GateOptions, OnFailure};
use serde_json::{Value, json};

use super::{
    Agent, Floor, Floors, PeakRss, busybox_bundle, clock_ns, cpu_clock_s, drop_page_cache, in_path,
    now_ns, pct, proc_sample, runtime, shuffle, stats, switches_between, thread_switches,
    work_floor_lines,
};
use crate::util::{cargo, exec, say, workspace_root};

/// Gate subscribers per agent in the start-latency measurement.
const SUBSCRIBERS: [usize; 3] = [0, 1, 10];
/// Watch clients on the watched agent in the CPU and memory measurement.
const WATCHERS: usize = 100;
/// Gate rounds run first and thrown away (page cache, first connections).
const WARMUP: usize = 5;
/// `List` calls timed as the API's round-trip floor.
const LIST_CALLS: usize = 200;

/// Copies the system's runc to `dir/name` (`dir` made first): each agent
/// and floor marks a copy of its own, since fanotify marks are per inode.
fn runc_copy(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let system = in_path("runc")?;
    let copy = dir.join(name);
    lookout_testsupport::install_executable(&system, &copy)
        .with_context(|| format!("copying {} to {}", system.display(), copy.display()))?;
    Ok(copy)
}

/// A private copy of runc and the agent that watches only it.
struct Watched {
    runc: PathBuf,
    socket: PathBuf,
    /// `host:port` of its /metrics.
    metrics: String,
    agent: Agent,
}

impl Watched {
    /// Copies runc into `dir` and starts an agent on it.
    fn start(lookout: &Path, dir: &Path) -> anyhow::Result<Watched> {
        // Named like the original: the agent tells runtimes apart by name.
        let runc = runc_copy(dir, "runc")?;
        let socket = dir.join("lookout.sock");
        let (agent, _) = Agent::start(
            lookout,
            dir,
            &[
                "--no-default-runtimes",
                "--runtime-path",
                runc.to_str().context("utf-8 path")?,
                "--socket",
                socket.to_str().context("utf-8 path")?,
                "--listen",
                "127.0.0.1:0",
            ],
        )?;
        // The port is the kernel's choice: read it from the log.
        let deadline = Instant::now() + Duration::from_secs(10);
        let metrics = loop {
            let log = agent.stderr();
            if let Some(addr) = log
                .split("/metrics on http://")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
            {
                break addr.to_owned();
            }
            if Instant::now() > deadline {
                bail!("the agent never said where it serves /metrics:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        Ok(Watched {
            runc,
            socket,
            metrics,
            agent,
        })
    }

    fn run(&self, args: &[&str]) -> bool {
        runtime(&self.runc, args)
    }

    /// The agent's /metrics page ("" if it cannot be read).
    fn metrics(&self) -> String {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(&self.metrics) else {
            return String::new();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.metrics
        );
        let mut page = String::new();
        let _ = s.read_to_string(&mut page);
        page
    }

    /// Waits until the agent printed an event for `id` (for a created
    /// container: its `Added`, so the hub knows it and a gate can hold its
    /// start).
    fn wait_reported(&self, id: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let quoted = format!("\"{id}\"");
        loop {
            if self.agent.stdout().contains(&quoted) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the agent on {} never reported {id}", self.runc.display());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The agent's CPU time in seconds: utime+stime from /proc/PID/stat
    /// (clock ticks), and the process CPU clock (nanoseconds, all threads,
    /// exited ones included).
    fn cpu(&self) -> (f64, f64) {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let ticks = proc_sample(self.agent.pid()).0 as f64 / hz;
        (ticks, cpu_clock_s(self.agent.pid()))
    }
}

/// The sum of the samples of `name` in a metrics page whose labels
/// contain `labels` (each sample once: `name{...} value`).
fn metric_sum(page: &str, name: &str, labels: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
                && l.contains(labels)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits until `name` in the agent's metrics reaches `want`.
fn wait_metric(w: &Watched, name: &str, want: f64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = metric_sum(&w.metrics(), name, "");
        if got >= want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{name} is {got}, expected {want}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Subscribes to the gate on `socket` as `name`, allowing every hold at
/// once. For each held one, records in `delivered` how long it took from
/// the hold's start in the agent to this task (microseconds; both ends
/// read `CLOCK_MONOTONIC`).
async fn subscribe(
    socket: PathBuf,
    name: String,
    delivered: Arc<Mutex<Vec<f64>>>,
) -> anyhow::Result<()> {
    let client = Client::connect(&socket).await?;
    let options = GateOptions::new(name)
        .deadline(Duration::from_secs(2))
        .on_failure(OnFailure::FailOpen);
    let mut gate = client.gate(options).await?;
    tokio::spawn(async move {
        while let Some(Ok(hold)) = gate.next().await {
            let us = hold
                .held()
                .then(|| now_ns().saturating_sub(hold.monotonic_ns()) as f64 / 1e3);
            // Answer first, record after: the start waits for the answer.
            if hold.allow().is_err() {
                break;
            }
            if let (Some(us), Ok(mut d)) = (us, delivered.lock()) {
                d.push(us);
            }
        }
    });
    Ok(())
}

/// Watches everything on `socket`, reading each event in full; counts
/// changes and snapshots (more snapshots than watchers: a resync).
async fn watch(
    socket: PathBuf,
    changes: Arc<AtomicU64>,
    snapshots: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let client = Client::connect(&socket).await?;
    let mut watcher = client.watch(Filter::all()).await?;
    tokio::spawn(async move {
        // Stops at the first error, as at the end.
        while let Some(Ok(event)) = watcher.next().await {
            match event {
                Event::Snapshot { .. } => {
                    snapshots.fetch_add(1, Ordering::Relaxed);
                }
                Event::Added { container, .. } | Event::Removed { container, .. } => {
                    std::hint::black_box(container);
                    changes.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
    });
    Ok(())
}

/// Runs [`bench_consumers`] in a release build of xtask (built here), with
/// the release agent; `work` is the bench's scratch directory.
///
/// N.B. The consumers are part of what is measured, and `cargo xtask`
/// builds xtask without optimisation: there a `List` round trip took 330 us
/// against 120 us optimised, and a hold 420 us against 280 us.
pub fn bench_consumers_release(
    opts: &super::Options,
    work: &Path,
    lookout: &Path,
) -> anyhow::Result<Value> {
    exec(
        "build",
        cargo().args(["build", "-j2", "--release", "-p", "xtask"]),
        "see the compiler error above",
    )?;
    let out = work.join("consumers.json");
    exec(
        "bench",
        std::process::Command::new(workspace_root().join("target/release/xtask"))
            .arg("bench")
            .arg(format!("--gate-rounds={}", opts.gate_rounds))
            .arg(format!("--watch-churn={}", opts.watch_churn))
            .arg("--consumers-out")
            .arg(&out)
            .arg("--agent")
            .arg(lookout),
        "see the error above",
    )?;
    Ok(serde_json::from_slice(&std::fs::read(&out)?)?)
}

/// Runs both measurements in `work` with the release agent `lookout`:
/// `rounds` timed starts per gate configuration, `churn` containers per
/// agent for the watchers.
pub(super) fn bench_consumers(
    lookout: &Path,
    floors: &Floors,
    work: &Path,
    rounds: usize,
    churn: usize,
) -> anyhow::Result<Value> {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let gates = gates(lookout, floors, work, &rt, rounds)?;
    let watchers = watchers(lookout, floors, work, &rt, churn)?;
    rt.shutdown_background();
    Ok(json!({ "gate_start_us": gates, "watchers": watchers }))
}

/// The work floor serving the least start gate (its `--gate`), on a copy
/// of runc of its own: the gated start's floor.
struct GateFloor {
    runc: PathBuf,
    socket: PathBuf,
    out: PathBuf,
    /// Its log: a `held ID MICROSECONDS` line per start of a held container.
    err: PathBuf,
    _floor: Floor,
}

impl GateFloor {
    fn start(floors: &Floors, dir: &Path) -> anyhow::Result<GateFloor> {
        // Not named `runc`: the agents' BPF programs, which pick execs by
        // file name, then capture none of its execs, nor it theirs.
        let runc = runc_copy(dir, "runc-wf")?;
        let socket = dir.join("floor.sock");
        let gate = format!("--gate={}", socket.to_str().context("utf-8 path")?);
        let out = dir.join("floor.out");
        let floor = Floor::start_with(
            &floors.work,
            &[&floors.bpf_object, Path::new(&gate), &runc],
            dir,
            Some(&out),
        )?;
        Ok(GateFloor {
            runc,
            socket,
            out,
            err: dir.join("floor.err"),
            _floor: floor,
        })
    }

    /// How long each start of a held container waited (microseconds).
    fn start_waits(&self) -> Vec<f64> {
        std::fs::read_to_string(&self.err)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.strip_prefix("held ")?.rsplit(' ').next()?.parse().ok())
            .collect()
    }
}

/// What a gate round does with an agent or a floor.
trait Gated {
    /// Runs its copy of runc with `args`; whether it succeeded.
    fn run(&self, args: &[&str]) -> bool;
    /// Waits until it reported container `id`.
    fn wait_reported(&self, id: &str) -> anyhow::Result<()>;
}

impl Gated for Watched {
    fn run(&self, args: &[&str]) -> bool {
        Watched::run(self, args)
    }

    fn wait_reported(&self, id: &str) -> anyhow::Result<()> {
        Watched::wait_reported(self, id)
    }
}

impl Gated for GateFloor {
    fn run(&self, args: &[&str]) -> bool {
        runtime(&self.runc, args)
    }

    fn wait_reported(&self, id: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let quoted = format!("\"{id}\"");
        while !std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .contains(&quoted)
        {
            if Instant::now() > deadline {
                bail!(
                    "the gate floor on {} never reported {id}",
                    self.runc.display()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

/// 1. `runc start` with 0, 1 and 10 gate subscribers that allow at once,
///    and, in the same rounds, through the gate floor with 0 and 1.
fn gates(
    lookout: &Path,
    floors: &Floors,
    work: &Path,
    rt: &tokio::runtime::Runtime,
    rounds: usize,
) -> anyhow::Result<Value> {
    say(
        "bench",
        &format!(
            "gates: {rounds} rounds of `runc start` with {SUBSCRIBERS:?} subscribers, interleaved"
        ),
    );
    let agents = SUBSCRIBERS
        .iter()
        .map(|n| Watched::start(lookout, &work.join(format!("gate-{n}"))))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let delivered: Vec<Arc<Mutex<Vec<f64>>>> = agents.iter().map(|_| Arc::default()).collect();
    for ((a, &n), delivered) in agents.iter().zip(&SUBSCRIBERS).zip(&delivered) {
        for j in 0..n {
            rt.block_on(subscribe(
                a.socket.clone(),
                format!("bench-{n}-{j}"),
                Arc::clone(delivered),
            ))?;
        }
        wait_metric(a, "lookout_gate_subscribers", n as f64)?;
    }
    // The gate floor, without a subscriber and with one (connected when
    // `subscribe` returns: the floor registers it before it says so).
    let gate_floors = [
        GateFloor::start(floors, &work.join("gate-floor-0"))?,
        GateFloor::start(floors, &work.join("gate-floor-1"))?,
    ];
    let floor_delivered: Arc<Mutex<Vec<f64>>> = Arc::default();
    rt.block_on(subscribe(
        gate_floors[1].socket.clone(),
        "bench-floor".into(),
        Arc::clone(&floor_delivered),
    ))?;
    let targets: Vec<&dyn Gated> = agents
        .iter()
        .map(|a| a as &dyn Gated)
        .chain(gate_floors.iter().map(|f| f as &dyn Gated))
        .collect();
    let labels: Vec<String> = SUBSCRIBERS
        .iter()
        .map(|n| n.to_string())
        .chain(["f0".into(), "f1".into()])
        .collect();
    let bundle = work.join("bundle-gate");
    busybox_bundle(&bundle, &["sleep", "30"])?;
    let bs = bundle.to_str().context("utf-8 path")?;
    // Same page-cache state for the three copies (see the exec overhead).
    for a in &agents {
        drop_page_cache(&a.runc)?;
    }
    for f in &gate_floors {
        drop_page_cache(&f.runc)?;
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
    let mut back_to_back: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for r in 0..WARMUP + rounds {
        let ids: Vec<String> = labels
            .iter()
            .map(|n| format!("bench-gate{n}-{r}"))
            .collect();
        let mut order: Vec<usize> = (0..targets.len()).collect();
        shuffle(&mut rng, &mut order);
        for &k in &order {
            if !targets[k].run(&["create", "--bundle", bs, &ids[k]]) {
                bail!("{} create {} failed", labels[k], ids[k]);
            }
        }
        for (a, id) in targets.iter().zip(&ids) {
            a.wait_reported(id)?;
        }
        shuffle(&mut rng, &mut order);
        for &k in &order {
            let t = Instant::now();
            let ok = targets[k].run(&["start", &ids[k]]);
            let us = t.elapsed().as_secs_f64() * 1e6;
            if !ok {
                bail!("{} start {} failed", labels[k], ids[k]);
            }
            if r >= WARMUP {
                times[k].push(us);
            }
        }
        for (a, id) in targets.iter().zip(&ids) {
            a.run(&["delete", "--force", id]);
        }
        // Back to back: `start` right after `create` exits, as a script
        // would; the subscribers have only the gap between the two execs
        // to answer before the start waits.
        shuffle(&mut rng, &mut order);
        for &k in &order {
            let id = format!("{}-b", ids[k]);
            if !targets[k].run(&["create", "--bundle", bs, &id]) {
                bail!("{} create {id} failed", labels[k]);
            }
            let t = Instant::now();
            let ok = targets[k].run(&["start", &id]);
            let us = t.elapsed().as_secs_f64() * 1e6;
            if !ok {
                bail!("{} start {id} failed", labels[k]);
            }
            if r >= WARMUP {
                back_to_back[k].push(us);
            }
            targets[k].run(&["delete", "--force", &id]);
        }
    }
    let pages: Vec<String> = agents.iter().map(Watched::metrics).collect();
    // The floor of any answer through the API on this machine: a `List`
    // round trip on an idle agent (threads parked, as when a hold begins),
    // and back to back (threads awake).
    let (list_idle_us, list_busy_us) = rt.block_on(async {
        let client = Client::connect(&agents[0].socket).await?;
        let (mut idle, mut busy) = (Vec::new(), Vec::new());
        for i in 0..2 * LIST_CALLS {
            if i % 2 == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let t = Instant::now();
            client.list(Filter::all()).await?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if i % 2 == 0 { &mut idle } else { &mut busy }.push(us);
        }
        anyhow::Ok((idle, busy))
    })?;
    drop(targets);
    let floor_waits = gate_floors[1].start_waits();
    drop(gate_floors);
    drop(agents);

    let p = |v: &[f64], q: f64| pct(&mut v.to_vec(), q);
    let paired =
        |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(a, b)| a - b).collect() };
    let (f0, f1) = (SUBSCRIBERS.len(), SUBSCRIBERS.len() + 1);
    let floor_delivered = floor_delivered
        .lock()
        .map(|d| d.clone())
        .unwrap_or_default();
    let mut out = json!({ "rounds": rounds, "list_round_trip_idle_us": stats(&list_idle_us),
        "list_round_trip_busy_us": stats(&list_busy_us),
        // The work floor with the least gate and one subscriber, minus the
        // same without one: what any gate that holds a start until one
        // subscriber answers through lookout.v1 adds here.
        "gate_floor": {
            "start_us": stats(&times[f1]),
            "start_ungated_us": stats(&times[f0]),
            "added_paired_p50_us": p(&paired(&times[f1], &times[f0]), 0.5),
            "back_to_back_start_us": stats(&back_to_back[f1]),
            "back_to_back_start_ungated_us": stats(&back_to_back[f0]),
            "back_to_back_added_paired_p50_us": p(&paired(&back_to_back[f1], &back_to_back[f0]), 0.5),
            "holds_answered": floor_delivered.len(),
            "hold_to_subscriber_us": stats(&floor_delivered),
            // As the agent's lookout_gate_start_wait_seconds: every start
            // of a held container, 0 for one decided before it came.
            "start_wait_us": stats(&floor_waits),
            "start_wait_mean_us": floor_waits.iter().sum::<f64>() / floor_waits.len().max(1) as f64,
            "held_starts": floor_waits.len(),
        } });
    for (k, n) in SUBSCRIBERS.iter().enumerate() {
        let page = &pages[k];
        let hold_s = metric_sum(page, "lookout_gate_hold_seconds_sum", "");
        let hold_n = metric_sum(page, "lookout_gate_hold_seconds_count", "");
        // Start k minus start 0 of the same round: the pair shares the
        // round's machine state.
        let pairs = paired(&times[k], &times[0]);
        let hold_mean_us = if hold_n > 0.0 {
            hold_s / hold_n * 1e6
        } else {
            0.0
        };
        let wait_s = metric_sum(page, "lookout_gate_start_wait_seconds_sum", "");
        let wait_n = metric_sum(page, "lookout_gate_start_wait_seconds_count", "");
        let b2b_paired = paired(&back_to_back[k], &back_to_back[0]);
        let delivered = delivered[k].lock().map(|d| d.clone()).unwrap_or_default();
        let out_mean_us = delivered.iter().sum::<f64>() / delivered.len().max(1) as f64;
        out[format!("subscribers_{n}")] = json!({
            "start_us": stats(&times[k]),
            "added_p50_us": p(&times[k], 0.5) - p(&times[0], 0.5),
            "added_p99_us": p(&times[k], 0.99) - p(&times[0], 0.99),
            "added_paired_p50_us": p(&pairs, 0.5),
            "holds_answered": delivered.len(),
            "decisions_allow": metric_sum(page, "lookout_gate_decisions_total", "outcome=\"allow\""),
            "decisions_not_allow": metric_sum(page, "lookout_gate_decisions_total", "")
                - metric_sum(page, "lookout_gate_decisions_total", "outcome=\"allow\""),
            "agent_hold_mean_us": hold_mean_us,
            "start_wait_mean_us": if wait_n > 0.0 { wait_s / wait_n * 1e6 } else { 0.0 },
            "held_starts": wait_n,
            "back_to_back_start_us": stats(&back_to_back[k]),
            "back_to_back_added_p50_us": p(&back_to_back[k], 0.5) - p(&back_to_back[0], 0.5),
            "back_to_back_added_p99_us": p(&back_to_back[k], 0.99) - p(&back_to_back[0], 0.99),
            "back_to_back_added_paired_p50_us": p(&b2b_paired, 0.5),
            "hold_to_subscriber_us": stats(&delivered),
            "hold_to_subscriber_mean_us": out_mean_us,
        });
    }
    Ok(out)
}

/// 2 and 3. Agent CPU per event and RSS with `WATCHERS` watchers and none,
/// and the floors, given the same containers in the same rounds: the
/// allow-all responder on a third copy of runc, the work floor on a fourth.
fn watchers(
    lookout: &Path,
    floors: &Floors,
    work: &Path,
    rt: &tokio::runtime::Runtime,
    churn: usize,
) -> anyhow::Result<Value> {
    say(
        "bench",
        &format!(
            "watchers: {churn} containers through each of two agents ({WATCHERS} watchers, none), interleaved"
        ),
    );
    // 0: watched by WATCHERS clients, 1: by none.
    let agents = [
        Watched::start(lookout, &work.join("watch-100"))?,
        Watched::start(lookout, &work.join("watch-0"))?,
    ];
    let changes = Arc::new(AtomicU64::new(0));
    let snapshots = Arc::new(AtomicU64::new(0));
    for _ in 0..WATCHERS {
        rt.block_on(watch(
            agents[0].socket.clone(),
            Arc::clone(&changes),
            Arc::clone(&snapshots),
        ))?;
    }
    // The floor: what answering the same execs costs with nothing else
    // done (no BPF, no files read, no events).
    let floor_dir = work.join("watch-floor");
    // Not named `runc` either: the agents' BPF programs would decode its
    // execs' records, as they do each other's (one agent per node has
    // only its own).
    let floor_runc = runc_copy(&floor_dir, "runc-floor")?;
    let floor = Floor::start(&floors.allow_all, &[&floor_runc], &floor_dir)?;
    // The work floor: the agent's work for each container (argv, config,
    // state, /proc, its lines) on one thread, with none of its boundaries.
    let work_dir = work.join("watch-work");
    // Not named `runc`: the agents' BPF programs capture the execs of
    // files by name, and would decode the work floor's too (as the work
    // floor would theirs).
    let work_runc = runc_copy(&work_dir, "runc-wf")?;
    let work_floor = Floor::start_work(floors, &work_runc, &work_dir)?;
    wait_metric(&agents[0], "lookout_watchers", WATCHERS as f64)?;
    // Let the connections settle before the baseline samples.
    std::thread::sleep(Duration::from_millis(500));
    let rss_before: Vec<u64> = agents
        .iter()
        .map(|a| proc_sample(a.agent.pid()).2)
        .collect();
    let samplers: Vec<PeakRss> = agents
        .iter()
        .map(|a| PeakRss::start(a.agent.pid()))
        .collect();
    let cpu0: Vec<(f64, f64)> = agents.iter().map(Watched::cpu).collect();
    let floor0 = floor.cpu_s();
    let switches0: Vec<_> = agents
        .iter()
        .map(|a| thread_switches(a.agent.pid()))
        .collect();
    let written0: Vec<u64> = agents
        .iter()
        .map(|a| bytes_written(a.agent.pid()))
        .collect();
    let floor_switches0 = thread_switches(floor.child.id());
    let work0 = work_floor.cpu_s();
    let work_switches0 = thread_switches(work_floor.child.id());
    // Events are counted off stdout, all of them: the CPU time covers any
    // other container's too (the root tests' containers are visible to
    // every agent through the shared /run/runc).
    let printed = |a: &Watched| a.agent.stdout().lines().count();
    let lines0: Vec<usize> = agents.iter().map(printed).collect();
    let bundle = work.join("bundle-watch");
    busybox_bundle(&bundle, &["true"])?;
    let bs = bundle.to_str().context("utf-8 path")?;
    let mut ids: [Vec<String>; 2] = Default::default();
    let mut failed = 0usize;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let t = Instant::now();
    let mut floor_failed = [0usize; 2];
    for i in 0..churn {
        let mut order = [0usize, 1, 2, 3];
        shuffle(&mut rng, &mut order);
        for k in order {
            let id = format!("bench-watch{k}-{i}");
            let run = |args: &[&str]| match agents.get(k) {
                Some(a) => a.run(args),
                None if k == 2 => runtime(&floor_runc, args),
                None => runtime(&work_runc, args),
            };
            if !(run(&["create", "--bundle", bs, &id]) && run(&["start", &id])) {
                match ids.get(k) {
                    Some(_) => failed += 1,
                    None => floor_failed[k - 2] += 1,
                }
            }
            run(&["delete", "--force", &id]);
            if let Some(ids) = ids.get_mut(k) {
                ids.push(id);
            }
        }
    }
    let churn_s = t.elapsed().as_secs_f64();
    let floor_cpu = floor.cpu_s() - floor0;
    let floor_switches = switches_between(
        &floor_switches0,
        &thread_switches(floor.child.id()),
        churn.saturating_sub(floor_failed[0]),
    );
    let work_cpu = work_floor.cpu_s() - work0;
    let work_switches = switches_between(
        &work_switches0,
        &thread_switches(work_floor.child.id()),
        churn.saturating_sub(floor_failed[1]),
    );
    let switches: Vec<Value> = agents
        .iter()
        .zip(&switches0)
        .map(|(a, s0)| switches_between(s0, &thread_switches(a.agent.pid()), churn))
        .collect();
    drop(floor);
    // The work floor did the work: both lines of each of its containers
    // (those of a failed create or start aside). Its last exits may be
    // still on their way.
    let work_lines = |kind: &str| work_floor_lines(&work_dir, kind, "bench-watch3-");
    let deadline = Instant::now() + Duration::from_secs(10);
    while work_lines("removed") + floor_failed[1] < churn && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (work_added, work_removed) = (work_lines("added"), work_lines("removed"));
    drop(work_floor);
    // A work floor that skipped its work would be a floor too low.
    let work_done = churn.saturating_sub(floor_failed[1]);
    let work_per_event = if work_added < work_done || work_removed < work_done {
        say(
            "bench",
            &format!(
                "WARNING: the work floor printed {work_added} added and {work_removed} removed lines for {work_done} containers: its CPU figure is left out"
            ),
        );
        Value::Null
    } else {
        json!(work_cpu * 1e6 / (2 * work_done.max(1)) as f64)
    };
    // Every container reported added and removed by its agent, and every
    // change read by every watcher.
    let removed = |k: usize| {
        let e = agents[k].agent.events();
        ids[k]
            .iter()
            .filter(|id| e.get(*id).is_some_and(|(_, r)| !r.is_empty()))
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let expected_changes = loop {
        let done = (0..2).all(|k| removed(k) == churn);
        let expected = (printed(&agents[0]) - lines0[0]) * WATCHERS;
        if (done && changes.load(Ordering::Relaxed) as usize >= expected)
            || Instant::now() > deadline
        {
            break expected;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let cpu1: Vec<(f64, f64)> = agents.iter().map(Watched::cpu).collect();
    let written: Vec<u64> = agents
        .iter()
        .zip(&written0)
        .map(|(a, w0)| bytes_written(a.agent.pid()).saturating_sub(*w0))
        .collect();
    let lines1: Vec<usize> = agents.iter().map(printed).collect();
    let rss_end: Vec<u64> = agents
        .iter()
        .map(|a| proc_sample(a.agent.pid()).2)
        .collect();
    let peaks: Vec<u64> = samplers.into_iter().map(PeakRss::stop).collect();
    let dropped = metric_sum(&agents[0].metrics(), "lookout_watchers_dropped_total", "");

    let mut per = Vec::new();
    for k in 0..2 {
        let e = agents[k].agent.events();
        let churned: usize = ids[k]
            .iter()
            .filter_map(|id| e.get(id))
            .map(|(a, r)| a.len() + r.len())
            .sum();
        let events = lines1[k] - lines0[k];
        let cpu = cpu1[k].0 - cpu0[k].0;
        let clock = cpu1[k].1 - cpu0[k].1;
        per.push(json!({
            "events": events,
            "events_of_churned_containers": churned,
            "missed_added": ids[k].iter().filter(|id| e.get(*id).is_none_or(|(a, _)| a.is_empty())).count(),
            "missing_removed": churn - removed(k),
            "cpu_s": cpu,
            "cpu_per_event_us": cpu * 1e6 / events.max(1) as f64,
            "cpu_clock_s": clock,
            "cpu_clock_per_event_us": clock * 1e6 / events.max(1) as f64,
            // Each container one create, start and delete after the
            // other: a thread hand-off each, and nothing to batch.
            "context_switches": switches[k],
            "rss_before_kb": rss_before[k],
            "rss_end_kb": rss_end[k],
            // The sampler runs every 50 ms and may miss the last growth.
            "peak_rss_kb": peaks[k].max(rss_end[k]),
        }));
    }
    drop(agents);
    // What the watched agent wrote beyond the other (the same lines on
    // stdout): its HTTP/2 frames, per watcher and event.
    let events0 = (lines1[0] - lines0[0]).max(1);
    let frame_bytes = (written[0].saturating_sub(written[1]) as f64 / (events0 * WATCHERS) as f64)
        .round() as usize;
    let frame_floor = frame_floor(rt, WATCHERS, 2 * churn, frame_bytes.max(64))?;
    let grpc_floor = [Registration::Quiet, Registration::Tokio]
        .into_iter()
        .map(|r| grpc_floor(rt, work, r, WATCHERS, 2 * churn, frame_bytes.max(64)))
        .collect::<anyhow::Result<Vec<Value>>>()?;
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let added = g(&per[0], "cpu_per_event_us") - g(&per[1], "cpu_per_event_us");
    let added_clock = g(&per[0], "cpu_clock_per_event_us") - g(&per[1], "cpu_clock_per_event_us");
    Ok(json!({
        "watchers": WATCHERS,
        "containers": churn,
        "create_start_failed": failed,
        "churn_wall_s": churn_s,
        "with_watchers": per[0],
        "without": per[1],
        "added_cpu_per_event_us": added,
        "added_cpu_clock_per_event_us": added_clock,
        "added_cpu_clock_per_watcher_event_us": added_clock / WATCHERS as f64,
        // Per container event as an agent counts them (added, removed).
        "floor": {
            "create_start_failed": floor_failed[0],
            "cpu_clock_s": floor_cpu,
            "cpu_clock_per_container_event_us":
                floor_cpu * 1e6 / (2 * churn.saturating_sub(floor_failed[0]).max(1)) as f64,
            "context_switches": floor_switches,
        },
        "work_floor": {
            "create_start_failed": floor_failed[1],
            "added_lines": work_added,
            "removed_lines": work_removed,
            "cpu_clock_s": work_cpu,
            "cpu_clock_per_container_event_us": work_per_event,
            "context_switches": work_switches,
        },
        "bytes_per_watcher_event": frame_bytes,
        "frame_floor": frame_floor,
        // The agent's own connections are registered as the first.
        "grpc_floor": grpc_floor[0],
        "grpc_floor_tokio_registration": grpc_floor[1],
        "watcher_changes_read": changes.load(Ordering::Relaxed),
        "watcher_changes_expected": expected_changes,
        "watcher_snapshots": snapshots.load(Ordering::Relaxed),
        "watchers_dropped": dropped,
    }))
}

/// The floor of "added per watcher and event": one write of a
/// `frame_bytes` frame to each of `watchers` Unix sockets per event, each
/// read by its own task on the benchmark's runtime (idle between events,
/// as the watchers are between containers), from a thread that does
/// nothing else. The agent cannot write less: each watcher has a stream
/// of its own, and the kernel's work per write (the copy, waking the
/// reader) is per socket. Returns that thread's CPU clock per watcher and
/// event.
fn frame_floor(
    rt: &tokio::runtime::Runtime,
    watchers: usize,
    events: usize,
    frame_bytes: usize,
) -> anyhow::Result<Value> {
    use std::io::Write;
    use tokio::io::AsyncReadExt;
    say(
        "bench",
        &format!("frame floor: {events} events of {frame_bytes} bytes to {watchers} sockets"),
    );
    let read = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::with_capacity(watchers);
    for _ in 0..watchers {
        let (w, r) = std::os::unix::net::UnixStream::pair()?;
        r.set_nonblocking(true)?;
        let read = Arc::clone(&read);
        rt.spawn(async move {
            let Ok(mut r) = tokio::net::UnixStream::from_std(r) else {
                return;
            };
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n @ 1..) = r.read(&mut buf).await {
                read.fetch_add(n as u64, Ordering::Release);
            }
        });
        writers.push(w);
    }
    let frame = vec![0x5au8; frame_bytes];
    let mut cpu_ns = 0u64;
    for e in 1..=events {
        let t0 = thread_cpu_ns();
        for w in &mut writers {
            w.write_all(&frame)?;
        }
        cpu_ns += thread_cpu_ns().saturating_sub(t0);
        // Every reader has the event and is idle again before the next.
        let want = (e * watchers * frame_bytes) as u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        while read.load(Ordering::Acquire) < want {
            if Instant::now() > deadline {
                bail!("the frame floor's readers stopped reading at event {e}");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(json!({
        "watchers": watchers,
        "events": events,
        "frame_bytes": frame_bytes,
        "cpu_clock_per_watcher_event_us": cpu_ns as f64 / 1e3 / (events * watchers).max(1) as f64,
    }))
}

/// How [`grpc_floor`]'s server registers its connections.
#[derive(Clone, Copy, Debug)]
enum Registration {
    /// `lookout_api::unix::QuietStream`, as the agent does: for reading.
    Quiet,
    /// tokio's own: for reading and writing.
    Tokio,
}

/// The floor of "added per watcher and event" for a gRPC stream per
/// watcher: a server that does nothing but the least a generated tonic
/// server must, on its own current-thread runtime as the agent's API: each
/// event is queued (from another thread, as the agent's hub does) to every
/// watcher's stream, copied into the stream's message and encoded by tonic,
/// and written by h2. Its watchers are the same lookout-client tasks as the
/// agent's, and its message is the size the agent wrote. Returns the
/// server thread's CPU time per watcher and event.
fn grpc_floor(
    rt: &tokio::runtime::Runtime,
    work: &Path,
    registration: Registration,
    watchers: usize,
    events: usize,
    frame_bytes: usize,
) -> anyhow::Result<Value> {
    use lookout_api::v1 as pb;
    say(
        "bench",
        &format!(
            "gRPC floor ({registration:?} registration): {events} events of {frame_bytes} bytes to {watchers} watch streams"
        ),
    );
    let socket = work.join(format!("grpc-floor-{registration:?}.sock"));
    let _ = std::fs::remove_file(&socket);
    let listener = std::os::unix::net::UnixListener::bind(&socket)
        .with_context(|| format!("binding {}", socket.display()))?;
    listener.set_nonblocking(true)?;
    let queues: Arc<Mutex<Vec<FloorQueue>>> = Arc::default();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = {
        let queues = Arc::clone(&queues);
        std::thread::Builder::new()
            .name("grpc-floor".into())
            .spawn(move || -> anyhow::Result<()> {
                // "PID/task/TID": this thread's CPU time is read there.
                let me = std::fs::read_link("/proc/thread-self")?;
                let _ = tid_tx.send(me);
                // As the agent's API thread.
                let _ = lookout_host::sched::request_slice(super::AGENT_SLICE);
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(serve_floor(listener, registration, queues, stopped))
            })?
    };
    let thread = tid_rx
        .recv_timeout(Duration::from_secs(10))
        .context("the gRPC floor's server did not start")?;
    let thread = Path::new("/proc").join(thread);
    let cpu_ns = || -> u64 { super::schedstat_ns(&thread).unwrap_or(0) };
    let changes = Arc::new(AtomicU64::new(0));
    let snapshots = Arc::new(AtomicU64::new(0));
    for _ in 0..watchers {
        rt.block_on(watch(
            socket.clone(),
            Arc::clone(&changes),
            Arc::clone(&snapshots),
        ))?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while snapshots.load(Ordering::Acquire) < watchers as u64 {
        if Instant::now() > deadline {
            bail!("the gRPC floor's watchers did not all connect");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // A container as the agent sends one; an annotation pads the message
    // to the agent's frame (HTTP/2's 9-byte frame header and gRPC's 5-byte
    // prefix on top).
    let mut container = pb::Container {
        id: "bench-watch0-123".into(),
        runtime: "runc".into(),
        pid: 123_456,
        status: "running".into(),
        bundle: work.join("bundle-watch").display().to_string(),
        cgroup: "/user.slice/bench-watch0-123".into(),
        args: vec!["runc".into(), "create".into(), "--bundle".into()],
        source: "fanotify".into(),
        added_monotonic_ns: now_ns(),
        added_unix_ms: 1_764_806_400_000,
        ..Default::default()
    };
    let base = prost::Message::encoded_len(&pb::WatchEvent {
        kind: pb::watch_event::Kind::Added as i32,
        revision: u64::MAX / 2,
        container: Some(container.clone()),
        monotonic_ns: now_ns(),
        ..Default::default()
    });
    let pad = frame_bytes.saturating_sub(14 + base + 8).max(1);
    container.annotations.insert("p".into(), "x".repeat(pad));
    let t0 = cpu_ns();
    let mut queueing_ns = 0u64;
    for e in 1..=events {
        let event = Arc::new(pb::WatchEvent {
            kind: pb::watch_event::Kind::Added as i32,
            revision: 1 + e as u64,
            container: Some(container.clone()),
            monotonic_ns: now_ns(),
            ..Default::default()
        });
        // Counted too: the agent's hub queues on its own thread.
        let q0 = thread_cpu_ns();
        for q in lock_floor(&queues).iter() {
            q.try_send(Arc::clone(&event))
                .map_err(|_| anyhow::anyhow!("a gRPC floor watcher's queue is full or gone"))?;
        }
        queueing_ns += thread_cpu_ns().saturating_sub(q0);
        // Every watcher has the event and is idle again before the next.
        let want = (e * watchers) as u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        while changes.load(Ordering::Acquire) < want {
            if Instant::now() > deadline {
                bail!("the gRPC floor's watchers stopped reading at event {e}");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let served_ns = cpu_ns().saturating_sub(t0);
    let _ = stop.send(());
    match server.join() {
        Ok(r) => r?,
        Err(_) => bail!("the gRPC floor's server panicked"),
    }
    let _ = std::fs::remove_file(&socket);
    Ok(json!({
        "registration": format!("{registration:?}"),
        "watchers": watchers,
        "events": events,
        "frame_bytes": frame_bytes,
        // The server's thread and the queueing, as the agent's CPU counts
        // its API thread and its hub.
        "cpu_clock_per_watcher_event_us": (served_ns + queueing_ns) as f64 / 1e3 / (events * watchers).max(1) as f64,
        "server_cpu_clock_per_watcher_event_us": served_ns as f64 / 1e3 / (events * watchers).max(1) as f64,
        "queueing_cpu_clock_per_watcher_event_us": queueing_ns as f64 / 1e3 / (events * watchers).max(1) as f64,
    }))
}

/// A gRPC floor watcher's queue.
type FloorQueue = tokio::sync::mpsc::Sender<Arc<lookout_api::v1::WatchEvent>>;

fn lock_floor(q: &Mutex<Vec<FloorQueue>>) -> std::sync::MutexGuard<'_, Vec<FloorQueue>> {
    q.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`grpc_floor`]'s server: `Watch` only.
async fn serve_floor(
    listener: std::os::unix::net::UnixListener,
    registration: Registration,
    queues: Arc<Mutex<Vec<FloorQueue>>>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> anyhow::Result<()> {
    use lookout_api::unix::QuietStream;
    use lookout_api::v1::lookout_server::LookoutServer;
    use tokio_stream::StreamExt;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let service = LookoutServer::new(FloorService { queues });
    let server = tonic::transport::Server::builder().add_service(service);
    // Not a graceful shutdown: that would wait for the watchers, which
    // never end their streams. The runtime's end closes the connections.
    tokio::select! {
        served = async {
            match registration {
                Registration::Quiet => {
                    server
                        .serve_with_incoming(incoming.map(|c| c.and_then(QuietStream::new)))
                        .await
                }
                Registration::Tokio => server.serve_with_incoming(incoming).await,
            }
        } => served?,
        _ = stop => {}
    }
    Ok(())
}

/// The least a `lookout.v1.Lookout` server does for a watcher: an empty
/// snapshot, then each queued event copied into the stream.
struct FloorService {
    queues: Arc<Mutex<Vec<FloorQueue>>>,
}

type FloorStream<T> =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl lookout_api::v1::lookout_server::Lookout for FloorService {
    async fn list(
        &self,
        _: tonic::Request<lookout_api::v1::ListRequest>,
    ) -> Result<tonic::Response<lookout_api::v1::ListResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the gRPC floor serves Watch only",
        ))
    }

    type WatchStream = FloorStream<lookout_api::v1::WatchEvent>;

    async fn watch(
        &self,
        _: tonic::Request<lookout_api::v1::WatchRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        use lookout_api::v1 as pb;
        use tokio_stream::StreamExt;
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        lock_floor(&self.queues).push(tx);
        let snapshot_end = pb::WatchEvent {
            kind: pb::watch_event::Kind::SnapshotEnd as i32,
            revision: 1,
            ..Default::default()
        };
        let events = tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|e: Arc<pb::WatchEvent>| Ok(pb::WatchEvent::clone(&e)));
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::once(Ok(snapshot_end)).chain(events),
        )))
    }

    type GateStream = FloorStream<lookout_api::v1::GateResponse>;

    async fn gate(
        &self,
        _: tonic::Request<tonic::Streaming<lookout_api::v1::GateRequest>>,
    ) -> Result<tonic::Response<Self::GateStream>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the gRPC floor serves Watch only",
        ))
    }
}

/// This thread's CPU clock in nanoseconds.
fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The bytes `pid` has written so far (`wchar` of /proc/PID/io: every
/// write, to sockets and pipes too); 0 if unreadable.
fn bytes_written(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Prints the consumers' table and lines.
pub fn print(v: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let gs = &v["gate_start_us"];
    println!(
        "\nconsumers: `runc start` with gate subscribers that allow at once, {} interleaved rounds\n",
        gs["rounds"]
    );
    println!("| runc start | p50 (us) | p99 (us) | added p50 | added p99 | added, paired p50 |");
    println!("|---|---|---|---|---|---|");
    for n in SUBSCRIBERS {
        let x = &gs[format!("subscribers_{n}")];
        println!(
            "| {n} subscriber(s) | {:.0} | {:.0} | {:+.0} | {:+.0} | {:+.0} |",
            g(&x["start_us"], "p50"),
            g(&x["start_us"], "p99"),
            g(x, "added_p50_us"),
            g(x, "added_p99_us"),
            g(x, "added_paired_p50_us"),
        );
    }
    println!(
        "\n`runc start` right after `create` exits (back to back), the same rounds\n\n\
         | runc start | p50 (us) | p99 (us) | added p50 | added p99 | added, paired p50 |\n|---|---|---|---|---|---|"
    );
    for n in SUBSCRIBERS {
        let x = &gs[format!("subscribers_{n}")];
        println!(
            "| {n} subscriber(s) | {:.0} | {:.0} | {:+.0} | {:+.0} | {:+.0} |",
            g(&x["back_to_back_start_us"], "p50"),
            g(&x["back_to_back_start_us"], "p99"),
            g(x, "back_to_back_added_p50_us"),
            g(x, "back_to_back_added_p99_us"),
            g(x, "back_to_back_added_paired_p50_us"),
        );
    }
    for n in &SUBSCRIBERS[1..] {
        let x = &gs[format!("subscribers_{n}")];
        println!(
            "{n} subscriber(s): {} holds answered (warm-up included), {:.0} not allowed (timeouts, disconnects); \
             an answer came {:.0} us after its hold on average, which took {:.0} us to reach the subscriber \
             (p50 {:.0}, p99 {:.0}); {:.0} held starts waited {:.1} us on average for answers still missing",
            x["holds_answered"],
            g(x, "decisions_not_allow"),
            g(x, "agent_hold_mean_us"),
            g(x, "hold_to_subscriber_mean_us"),
            g(&x["hold_to_subscriber_us"], "p50"),
            g(&x["hold_to_subscriber_us"], "p99"),
            g(x, "held_starts"),
            g(x, "start_wait_mean_us"),
        );
    }
    let f = &gs["gate_floor"];
    println!(
        "the gate floor (the work floor holding each start for one subscriber): added, paired p50 {:+.0} us; \
         back to back {:+.0} us; {} holds answered, p50 {:.0} us from hold to subscriber; \
         {} held starts waited {:.1} us on average (p50 {:.0}, p99 {:.0})",
        g(f, "added_paired_p50_us"),
        g(f, "back_to_back_added_paired_p50_us"),
        f["holds_answered"],
        g(&f["hold_to_subscriber_us"], "p50"),
        f["held_starts"],
        g(f, "start_wait_mean_us"),
        g(&f["start_wait_us"], "p50"),
        g(&f["start_wait_us"], "p99"),
    );
    println!(
        "a `List` round trip (the API's floor): after 2 ms idle p50 {:.0} us, p99 {:.0} us; \
         right after another p50 {:.0} us, p99 {:.0} us",
        g(&gs["list_round_trip_idle_us"], "p50"),
        g(&gs["list_round_trip_idle_us"], "p99"),
        g(&gs["list_round_trip_busy_us"], "p50"),
        g(&gs["list_round_trip_busy_us"], "p99"),
    );
    let w = &v["watchers"];
    let (a, b) = (&w["with_watchers"], &w["without"]);
    println!(
        "\nwatchers: {} containers through each agent ({} and {} events), {} watchers read {} of {} changes ({} snapshots, {:.0} dropped)",
        w["containers"],
        a["events"],
        b["events"],
        w["watchers"],
        w["watcher_changes_read"],
        w["watcher_changes_expected"],
        w["watcher_snapshots"],
        g(w, "watchers_dropped")
    );
    println!(
        "\n| agent | CPU per event (us) | CPU clock per event (us) | RSS before (kB) | RSS end (kB) | peak RSS (kB) |"
    );
    println!("|---|---|---|---|---|---|");
    for (name, x) in [
        (format!("{} watchers", w["watchers"]), a),
        ("no watcher".to_owned(), b),
    ] {
        println!(
            "| {name} | {:.0} | {:.0} | {} | {} | {} |",
            g(x, "cpu_per_event_us"),
            g(x, "cpu_clock_per_event_us"),
            x["rss_before_kb"],
            x["rss_end_kb"],
            x["peak_rss_kb"]
        );
    }
    println!(
        "added by the watchers: {:.0} us per event (CPU clock: {:.0} us, {:.2} us per watcher and event)",
        g(w, "added_cpu_per_event_us"),
        g(w, "added_cpu_clock_per_event_us"),
        g(w, "added_cpu_clock_per_watcher_event_us"),
    );
    println!(
        "floor: the allow-all responder alone on the same containers: {:.0} us per container event (CPU clock)",
        g(&w["floor"], "cpu_clock_per_container_event_us"),
    );
    let sw = |x: &Value| {
        let c = &x["context_switches"];
        let threads: Vec<String> = c["voluntary_per_container_by_thread"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| format!("{k} {:.1}", v.as_f64().unwrap_or(f64::NAN)))
                    .collect()
            })
            .unwrap_or_default();
        format!(
            "{:.1} voluntary ({}), {:.1} involuntary",
            g(c, "voluntary_per_container"),
            threads.join(", "),
            g(c, "involuntary_per_container")
        )
    };
    println!(
        "floor of a watcher: one {}-byte write per watcher and event to a socket of its own, its reader woken: {:.2} us per watcher and event (CPU clock)",
        w["frame_floor"]["frame_bytes"],
        g(&w["frame_floor"], "cpu_clock_per_watcher_event_us"),
    );
    for (key, how) in [
        ("grpc_floor", "registered for reading, as the agent"),
        ("grpc_floor_tokio_registration", "tokio's registration"),
    ] {
        if w[key].is_object() {
            println!(
                "floor of a gRPC watch stream ({how}): a tonic server that only queues each event to every stream: {:.2} us per watcher and event (CPU clock: {:.2} serving, {:.2} queueing from another thread)",
                g(&w[key], "cpu_clock_per_watcher_event_us"),
                g(&w[key], "server_cpu_clock_per_watcher_event_us"),
                g(&w[key], "queueing_cpu_clock_per_watcher_event_us"),
            );
        }
    }
    println!("context switches per container, no watcher: {}", sw(b));
    println!("context switches per container, floor: {}", sw(&w["floor"]));
    let wf = &w["work_floor"];
    if wf.is_object() {
        println!(
            "work floor: the agent's work for each container on one thread, no safety boundaries: {:.0} us per container event (CPU clock; {} added and {} removed lines)",
            g(wf, "cpu_clock_per_container_event_us"),
            wf["added_lines"],
            wf["removed_lines"],
        );
        println!("context switches per container, work floor: {}", sw(wf));
    }
}
