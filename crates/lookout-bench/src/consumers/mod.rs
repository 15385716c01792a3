//! The consumers part of the benchmark (issue #12): what gate
//! subscribers add to a container's `runc start` ([`gates`]), and what
//! watchers cost the agent in CPU per event and in memory ([`watchers`]).
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
//! a release build: the `bench_consumers` binary ([`run_release`]).

mod floors;
pub(crate) mod gates;
mod print;
mod watchers;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lookout_client::{Client, Event, Filter, GateOptions, OnFailure};
use serde_json::{Value, json};

pub(crate) use print::print;

use crate::agent::Agent;
use crate::containers::{in_path, runtime};
use crate::floor::Floors;
use crate::host::{clock_ns, cpu_clock_s, now_ns, proc_sample};
use crate::util::exec;
use crate::{Options, Paths};

/// Gate subscribers per agent in the start-latency measurement.
pub(super) const SUBSCRIBERS: [usize; 3] = [0, 1, 10];

/// Watch clients on the watched agent in the CPU and memory measurement.
pub(super) const WATCHERS: usize = 100;

/// Gate rounds run first and thrown away (page cache, first connections).
pub(super) const WARMUP: usize = 5;

/// `List` calls timed as the API's round-trip floor.
pub(super) const LIST_CALLS: usize = 200;

/// Copies the system's runc to `dir/name` (`dir` made first): each agent
/// and floor marks a copy of its own, since fanotify marks are per inode.
pub(super) fn runc_copy(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let system = in_path("runc")?;
    let copy = dir.join(name);
    lookout_testsupport::install_executable(&system, &copy)
        .with_context(|| format!("copying {} to {}", system.display(), copy.display()))?;
    Ok(copy)
}

/// A private copy of runc and the agent that watches only it.
pub(crate) struct Watched {
    pub(super) runc: PathBuf,
    pub(super) socket: PathBuf,
    /// `host:port` of its /metrics.
    metrics: String,
    pub(super) agent: Agent,
}

impl Watched {
    /// Copies runc into `dir` and starts an agent on it.
    fn start(lookout: &Path, dir: &Path) -> anyhow::Result<Watched> {
        Watched::start_with(lookout, dir, &[])
    }

    /// [`Watched::start`], the agent given `extra` arguments too.
    pub(crate) fn start_with(
        lookout: &Path,
        dir: &Path,
        extra: &[&str],
    ) -> anyhow::Result<Watched> {
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
            ]
            .into_iter()
            .chain(extra.iter().copied())
            .collect::<Vec<_>>(),
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
pub(super) fn metric_sum(page: &str, name: &str, labels: &str) -> f64 {
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
pub(super) fn wait_metric(w: &Watched, name: &str, want: f64) -> anyhow::Result<()> {
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
pub(super) async fn subscribe(
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
pub(super) async fn watch(
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

/// Runs [`run_consumers`] in the release `bench_consumers` binary
/// (`paths.consumers`) with the agent `lookout`, in a scratch directory
/// under `paths.work`.
///
/// N.B. The consumers are part of what is measured, and `cargo xtask`
/// builds the bench without optimisation: there a `List` round trip took
/// 330 us against 120 us optimised, and a hold 420 us against 280 us.
pub(crate) fn run_release(opts: &Options, paths: &Paths, lookout: &Path) -> anyhow::Result<Value> {
    let out = paths.work.join("consumers.json");
    exec(
        "bench",
        std::process::Command::new(&paths.consumers)
            .arg(format!("--gate-rounds={}", opts.gate_rounds))
            .arg(format!("--watch-churn={}", opts.watch_churn))
            .arg("--out")
            .arg(&out)
            .arg("--agent")
            .arg(lookout)
            .arg("--work")
            .arg(paths.work.join("consumers"))
            .arg("--allow-all")
            .arg(&paths.floors.allow_all)
            .arg("--work-floor")
            .arg(&paths.floors.work)
            .arg("--bpf-object")
            .arg(&paths.floors.bpf_object),
        "see the error above",
    )?;
    Ok(serde_json::from_slice(&std::fs::read(&out)?)?)
}

/// Runs both measurements in `work` with the release agent `lookout`:
/// `rounds` timed starts per gate configuration, `churn` containers per
/// agent for the watchers. What the `bench_consumers` binary runs.
pub fn run_consumers(
    lookout: &Path,
    floors: &Floors,
    work: &Path,
    rounds: usize,
    churn: usize,
) -> anyhow::Result<Value> {
    // The agents' BPF file system (agent.rs) goes with this run.
    let _pins = crate::agent::PinFsGuard;
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let gates = gates::gates(lookout, floors, work, &rt, rounds)?;
    let watchers = watchers::watchers(lookout, floors, work, &rt, churn)?;
    rt.shutdown_background();
    Ok(json!({ "gate_start_us": gates, "watchers": watchers }))
}

/// This thread's CPU clock in nanoseconds.
pub(super) fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The bytes `pid` has written so far (`wchar` of /proc/PID/io: every
/// write, to sockets and pipes too); 0 if unreadable.
pub(super) fn bytes_written(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}
