//! Discovery latency: how long after a container's `runc create` and its
//! exit the agent (or the work floor) reports it, against a thread that
//! waits for the same exits (the floor), and from the kernel's own exit
//! time ([`exits::ExitClock`]).

mod exits;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::agent::Agent;
use crate::containers::{busybox_bundle, in_path, runc};
use crate::events::{Events, Kind, events_in, lag_us, lags, without};
use crate::floor::Floor;
use crate::host::{AGENT_SLICE, exited, now_ns, pidfd, wait_exit};
use crate::stats::stats;
use crate::util::{say, utf8};
use crate::{Options, Paths};

/// Discovery latency (us), over `opts.latency` sequential runc containers
/// (`sleep 0.05`): `runc create` exec -> `Added`, `runc create` exit ->
/// `Added`, container exit -> `Removed`; all CLOCK_MONOTONIC.
pub(crate) fn discovery(opts: &Options, work: &Path, agent: &Agent) -> anyhow::Result<Value> {
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
pub(crate) const DISCOVERY_BLOCKS: usize = 10;

pub(crate) const DISCOVERY_WARM_UP: usize = 2;

/// Discovery latency of each of `agents`, their containers interleaved:
/// `opts.latency` per agent in [`DISCOVERY_BLOCKS`] blocks, the agents
/// taking turns block by block (each started afresh for its block, the
/// order turning round), so that what the machine does meanwhile falls on
/// both alike. Measured for `--against`: one agent's 200 sequential
/// containers after the other's moved both the lags and their floor by
/// more than the agents differ.
pub(crate) fn discovery_interleaved(
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
pub(crate) struct Lags {
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
pub(crate) struct KernelLags {
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
pub(crate) fn latency_bundle(work: &Path) -> anyhow::Result<PathBuf> {
    let b = work.join("bundle-lat");
    busybox_bundle(&b, &["sleep", "0.05"])?;
    Ok(b)
}

/// `count` sequential runc containers of `bundle` (ids `<prefix>-<i>`)
/// under `agent`, and the lags of its events behind them; then deleted.
pub(crate) fn discovery_block(
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

/// A thread of its own waiting for process `pid` to end, as a listener
/// for container exits does: the floor of the discovery lags.
pub(crate) struct Observer(std::thread::JoinHandle<Option<u64>>);

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
