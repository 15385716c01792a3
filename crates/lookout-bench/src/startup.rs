//! Start-up to ready, its phases, and the idle cost.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::Paths;
use crate::agent::Agent;
use crate::host::{proc_sample, rss_split};
use crate::stats::{pct, stats};
use crate::util::say;

/// Starts of each agent in the start-up measurement.
pub(crate) const STARTS: usize = 5;

/// Start-up: spawn to the agent's `ready` log line, [`STARTS`] starts of
/// each of `agents` (interleaved), in ms; and each phase's p50 from the
/// agent's `start-up phases` debug line (probe, BPF load, marks, scan, ...),
/// with `outside` the time spawn to ready that the agent did not count
/// (exec, the dynamic loader, the log's way to the benchmark). An agent
/// too old to log its phases has none.
pub(crate) fn startup(paths: &Paths, agents: &[&Path]) -> anyhow::Result<Vec<Value>> {
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
pub(crate) fn startup_phases(log: &str) -> Vec<(String, f64)> {
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
pub(crate) fn idle(agent: &Agent) -> Value {
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
