//! 2 and 3. What watchers cost the agent in CPU per event and memory,
//! beside the floors.

use std::path::Path;
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
