//! Churn (many containers at once, and the floors under the same churn)
//! and memory with heavy annotations.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::agent::Agent;
use crate::containers::{
    WORKERS, busybox_bundle, container_ids, create_and_start, delete, in_path, on_workers,
    wait_until,
};
use crate::events::{Kind, tracked, without};
use crate::floor::{Floor, work_floor_lines};
use crate::host::{PeakRss, cpu_clock_s, proc_sample, rss_split};
use crate::util::{say, utf8};
use crate::{Options, Paths};

/// Churn: `opts.churn` runc containers (`sleep 20`) created and started by
/// [`WORKERS`] threads; events missed, stuck or doubled, how many are
/// tracked at once, and `agent`'s CPU time and peak RSS meanwhile.
pub(crate) fn churn(opts: &Options, work: &Path, agent: &Agent) -> anyhow::Result<Value> {
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
pub(crate) fn churn_floor_sample(
    opts: &Options,
    paths: &Paths,
    when: &str,
) -> anyhow::Result<Value> {
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
pub(crate) fn churn_floor(opts: &Options, paths: &Paths, first: Value) -> anyhow::Result<Value> {
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
pub(crate) fn heavy_annotations(
    opts: &Options,
    work: &Path,
    agent: &Agent,
) -> anyhow::Result<Value> {
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
