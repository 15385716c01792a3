//! 2 and 3. What watchers cost the agent in CPU per event and memory,
//! beside the floors.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use super::floors::{Registration, frame_floor, grpc_floor};
use super::{WATCHERS, Watched, bytes_written, metric_sum, runc_copy, wait_metric, watch};
use crate::containers::{busybox_bundle, runtime};
use crate::floor::{Floor, Floors, work_floor_lines};
use crate::host::{PeakRss, proc_sample, switches_between, thread_switches};
use crate::stats::shuffle;
use crate::util::say;

/// What one agent's counters read at the start or the end of the churn.
struct Sample {
    /// VmRSS, kB.
    rss_kb: u64,
    /// CPU seconds: clock ticks, and the CPU clock.
    cpu: (f64, f64),
    /// Its threads' context switches.
    switches: Vec<(u32, String, u64, u64)>,
    /// Bytes written so far.
    written: u64,
    /// Lines (events) printed so far. Events are counted off stdout, all
    /// of them: the CPU time covers any other container's too (the root
    /// tests' containers are visible to every agent through the shared
    /// /run/runc).
    lines: usize,
}

impl Sample {
    fn of(a: &Watched) -> Sample {
        let pid = a.agent.pid();
        Sample {
            rss_kb: proc_sample(pid).2,
            cpu: a.cpu(),
            switches: thread_switches(pid),
            written: bytes_written(pid),
            lines: a.agent.stdout().lines().count(),
        }
    }
}

/// A floor responder on a copy of runc of its own, and its counters when
/// the churn began.
struct Churned {
    floor: Floor,
    runc: PathBuf,
    cpu0: f64,
    switches0: Vec<(u32, String, u64, u64)>,
}

impl Churned {
    fn start(floor: Floor, runc: PathBuf) -> Churned {
        Churned {
            cpu0: floor.cpu_s(),
            switches0: thread_switches(floor.child.id()),
            floor,
            runc,
        }
    }

    /// Its CPU clock since the start and its context switches per
    /// container of `done`.
    fn since(&self, done: usize) -> (f64, Value) {
        let switches = switches_between(
            &self.switches0,
            &thread_switches(self.floor.child.id()),
            done,
        );
        (self.floor.cpu_s() - self.cpu0, switches)
    }
}

/// 2 and 3. Agent CPU per event and RSS with `WATCHERS` watchers and none,
/// and the floors, given the same containers in the same rounds: the
/// allow-all responder on a third copy of runc, the work floor on a fourth.
pub(super) fn watchers(
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
    let (floor_dir, work_dir) = (work.join("watch-floor"), work.join("watch-work"));
    let (floor, work_floor) = start_floors(floors, &floor_dir, &work_dir)?;
    wait_metric(&agents[0], "lookout_watchers", WATCHERS as f64)?;
    // Let the connections settle before the baseline samples.
    std::thread::sleep(Duration::from_millis(500));
    let before: Vec<Sample> = agents.iter().map(Sample::of).collect();
    let samplers: Vec<PeakRss> = agents
        .iter()
        .map(|a| PeakRss::start(a.agent.pid()))
        .collect();
    let (floor, work_floor) = (
        Churned::start(floor.0, floor.1),
        Churned::start(work_floor.0, work_floor.1),
    );
    let bundle = work.join("bundle-watch");
    busybox_bundle(&bundle, &["true"])?;
    let bs = bundle.to_str().context("utf-8 path")?;
    let t = Instant::now();
    let (ids, failed, floor_failed) =
        churn_all(&agents, [&floor.runc, &work_floor.runc], bs, churn);
    let churn_s = t.elapsed().as_secs_f64();
    let (floor_cpu, floor_switches) = floor.since(churn.saturating_sub(floor_failed[0]));
    let (work_cpu, work_switches) = work_floor.since(churn.saturating_sub(floor_failed[1]));
    let switches: Vec<Value> = agents
        .iter()
        .zip(&before)
        .map(|(a, b)| switches_between(&b.switches, &thread_switches(a.agent.pid()), churn))
        .collect();
    drop(floor);
    let (work_added, work_removed, work_per_event) =
        work_floor_figure(&work_dir, churn, floor_failed[1], work_cpu);
    drop(work_floor);
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
        let expected = (agents[0].agent.stdout().lines().count() - before[0].lines) * WATCHERS;
        if (done && changes.load(Ordering::Relaxed) as usize >= expected)
            || Instant::now() > deadline
        {
            break expected;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let after: Vec<Sample> = agents.iter().map(Sample::of).collect();
    let peaks: Vec<u64> = samplers.into_iter().map(PeakRss::stop).collect();
    let dropped = metric_sum(&agents[0].metrics(), "lookout_watchers_dropped_total", "");
    let per: Vec<Value> = (0..2)
        .map(|k| {
            let row = Row {
                ids: &ids[k],
                before: &before[k],
                after: &after[k],
                peak_kb: peaks[k],
                removed: removed(k),
            };
            row.report(&agents[k], churn, switches[k].clone())
        })
        .collect();
    drop(agents);
    // What the watched agent wrote beyond the other (the same lines on
    // stdout): its HTTP/2 frames, per watcher and event.
    let events0 = (after[0].lines - before[0].lines).max(1);
    let written = |k: usize| after[k].written.saturating_sub(before[k].written);
    let frame_bytes = (written(0).saturating_sub(written(1)) as f64 / (events0 * WATCHERS) as f64)
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

/// The allow-all responder and the work floor, each on a copy of runc of
/// its own in `floor_dir` and `work_dir`.
#[allow(clippy::type_complexity)]
fn start_floors(
    floors: &Floors,
    floor_dir: &Path,
    work_dir: &Path,
) -> anyhow::Result<((Floor, PathBuf), (Floor, PathBuf))> {
    // The floor: what answering the same execs costs with nothing else
    // done (no BPF, no files read, no events). Not named `runc` either:
    // the agents' BPF programs would decode its execs' records, as they do
    // each other's (one agent per node has only its own).
    let floor_runc = runc_copy(floor_dir, "runc-floor")?;
    let floor = Floor::start(&floors.allow_all, &[&floor_runc], floor_dir)?;
    // The work floor: the agent's work for each container (argv, config,
    // state, /proc, its lines) on one thread, with none of its boundaries.
    // Not named `runc`: the agents' BPF programs capture the execs of
    // files by name, and would decode the work floor's too (as the work
    // floor would theirs).
    let work_runc = runc_copy(work_dir, "runc-wf")?;
    let work_floor = Floor::start_work(floors, &work_runc, work_dir)?;
    Ok(((floor, floor_runc), (work_floor, work_runc)))
}

/// `churn` containers through each agent and each floor's runc (in a new
/// random order each round): the agents' container ids, how many of
/// theirs failed, and how many of each floor's.
fn churn_all(
    agents: &[Watched; 2],
    floor_runcs: [&Path; 2],
    bs: &str,
    churn: usize,
) -> ([Vec<String>; 2], usize, [usize; 2]) {
    let mut ids: [Vec<String>; 2] = Default::default();
    let mut failed = 0usize;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut floor_failed = [0usize; 2];
    for i in 0..churn {
        let mut order = [0usize, 1, 2, 3];
        shuffle(&mut rng, &mut order);
        for k in order {
            let id = format!("bench-watch{k}-{i}");
            let run = |args: &[&str]| match agents.get(k) {
                Some(a) => a.run(args),
                None => runtime(floor_runcs[k - 2], args),
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
    (ids, failed, floor_failed)
}

/// The work floor's lines (added, removed) and its CPU per event, left out
/// (null) when it skipped work: a work floor that skipped its work would
/// be a floor too low. It did the work when both lines of each of its
/// containers are there (those of a failed create or start aside); its
/// last exits may be still on their way.
fn work_floor_figure(
    work_dir: &Path,
    churn: usize,
    failed: usize,
    cpu: f64,
) -> (usize, usize, Value) {
    let work_lines = |kind: &str| work_floor_lines(work_dir, kind, "bench-watch3-");
    let deadline = Instant::now() + Duration::from_secs(10);
    while work_lines("removed") + failed < churn && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (added, removed) = (work_lines("added"), work_lines("removed"));
    let done = churn.saturating_sub(failed);
    let per_event = if added < done || removed < done {
        say(
            "bench",
            &format!(
                "WARNING: the work floor printed {added} added and {removed} removed lines for {done} containers: its CPU figure is left out"
            ),
        );
        Value::Null
    } else {
        json!(cpu * 1e6 / (2 * done.max(1)) as f64)
    };
    (added, removed, per_event)
}

/// One agent's figures over the churn.
struct Row<'a> {
    /// The ids of the containers churned through it.
    ids: &'a [String],
    before: &'a Sample,
    after: &'a Sample,
    /// Its peak RSS meanwhile, kB.
    peak_kb: u64,
    /// How many of `ids` it reported removed.
    removed: usize,
}

impl Row<'_> {
    fn report(&self, a: &Watched, churn: usize, switches: Value) -> Value {
        let e = a.agent.events();
        let churned: usize = self
            .ids
            .iter()
            .filter_map(|id| e.get(id))
            .map(|(a, r)| a.len() + r.len())
            .sum();
        let events = self.after.lines - self.before.lines;
        let cpu = self.after.cpu.0 - self.before.cpu.0;
        let clock = self.after.cpu.1 - self.before.cpu.1;
        json!({
            "events": events,
            "events_of_churned_containers": churned,
            "missed_added": self.ids.iter().filter(|id| e.get(*id).is_none_or(|(a, _)| a.is_empty())).count(),
            "missing_removed": churn - self.removed,
            "cpu_s": cpu,
            "cpu_per_event_us": cpu * 1e6 / events.max(1) as f64,
            "cpu_clock_s": clock,
            "cpu_clock_per_event_us": clock * 1e6 / events.max(1) as f64,
            // Each container one create, start and delete after the
            // other: a thread hand-off each, and nothing to batch.
            "context_switches": switches,
            "rss_before_kb": self.before.rss_kb,
            "rss_end_kb": self.after.rss_kb,
            // The sampler runs every 50 ms and may miss the last growth.
            "peak_rss_kb": self.peak_kb.max(self.after.rss_kb),
        })
    }
}
