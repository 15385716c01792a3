//! The parts of the benchmark `--only` selects ([`PARTS`]; a full run is
//! `agent`, `hooks`, `pinned-maps`, then `inode-map`), and the `agent` part's measurements, run
//! for one agent or several side by side ([`agent_runs`]).

use std::path::Path;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::agent::Agent;
use crate::churn::{churn, churn_floor, churn_floor_sample, heavy_annotations};
use crate::discovery::{discovery, discovery_interleaved};
use crate::exec::exec_overhead;
use crate::print::{print_agent, print_discovery_rows, print_exec_split, print_inode};
use crate::startup::{idle, startup};
use crate::{Needs, Options, Paths, consumers, inode, nri};

/// What the `agent`, `exec`, `discovery` and `consumers` parts need built.
pub(crate) const AGENT_AND_FLOORS: Needs = Needs {
    agent: true,
    floors: true,
    inode_tools: false,
};

/// The report being built: report.json's top-level keys.
pub(crate) type Report = serde_json::Map<String, Value>;

/// A part of the benchmark, as `--only` names it.
pub(crate) struct Part {
    /// The name `--only` takes.
    pub(crate) name: &'static str,
    /// What it measures, for `--help`.
    pub(crate) about: &'static str,
    /// Whether a run without `--only` includes it.
    pub(crate) in_full_run: bool,
    /// What must be built before it runs.
    pub(crate) needs: Needs,
    /// Measures; returns the part's top-level keys of report.json.
    pub(crate) run: fn(&Options, &Paths) -> anyhow::Result<Report>,
    /// Prints the part's table and lines from the whole report.
    pub(crate) print: fn(&Value),
}

/// The parts `--only` selects from, in the order a full run runs them.
pub(crate) const PARTS: &[Part] = &[
    Part {
        name: "agent",
        about: "exec overhead, start-up, idle, discovery, churn, memory, then consumers",
        in_full_run: true,
        needs: AGENT_AND_FLOORS,
        run: agent_part,
        print: print_agent,
    },
    Part {
        name: "exec",
        about: "exec overhead alone, and where the agent's share goes",
        // N.B. The agent part runs it already.
        in_full_run: false,
        needs: AGENT_AND_FLOORS,
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
        needs: AGENT_AND_FLOORS,
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
        needs: AGENT_AND_FLOORS,
        run: consumers_part,
        print: |report| consumers::print(&report["consumers"]),
    },
    Part {
        name: "hooks",
        about: "`runc start` with no hook, one prestart hook and a hook at every stage (issue #57)",
        in_full_run: true,
        needs: AGENT_AND_FLOORS,
        run: |opts, paths| {
            fresh_dir(&paths.work)?;
            let configs = crate::hooks::configs(&paths.lookout);
            let v = crate::hooks::measure(&paths.work, &configs, opts.gate_rounds)?;
            Ok(entries([("hooks_start_us", v)]))
        },
        print: |report| crate::hooks::print(&report["hooks_start_us"]),
    },
    Part {
        name: "nri",
        about: "NRI mode on a private containerd 1.7",
        in_full_run: false,
        needs: Needs {
            agent: true,
            floors: false,
            inode_tools: false,
        },
        run: nri_part,
        print: |report| nri::print(&report["nri"]),
    },
    Part {
        name: "pinned-maps",
        about: "the pinned container maps: kernel memory at max_entries, a write's cost",
        in_full_run: true,
        needs: Needs {
            agent: false,
            floors: false,
            inode_tools: false,
        },
        run: |_, _| Ok(entries([("pinned_maps", crate::pinned::measure()?)])),
        print: |report| crate::pinned::print(&report["pinned_maps"]),
    },
    Part {
        name: "inode-map",
        about: "the inode map's modes and a listing through stablefs",
        in_full_run: true,
        needs: Needs {
            agent: false,
            floors: false,
            inode_tools: true,
        },
        run: inode_map_part,
        print: |report| print_inode(&report["inode_map"]),
    },
];

/// `--only`'s possible values: the parts' names, each with what it
/// measures.
pub fn part_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        PARTS
            .iter()
            .map(|p| clap::builder::PossibleValue::new(p.name).help(p.about)),
    )
}

/// The parts to run: the one `only` names, or those of a full run.
pub(crate) fn selected(only: Option<&str>) -> anyhow::Result<Vec<&'static Part>> {
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

/// A report with these keys and values.
pub(crate) fn entries<const N: usize>(entries: [(&str, Value); N]) -> Report {
    entries
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
}

/// Empties `dir`, creating it if needed.
pub(crate) fn fresh_dir(dir: &Path) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

/// The `agent` part: each measurement below in order, in a fresh scratch
/// directory, then the consumers.
pub(crate) fn agent_part(opts: &Options, paths: &Paths) -> anyhow::Result<Report> {
    let mut reports = agent_runs(opts, paths, &[paths.lookout.as_path()])?;
    reports.pop().context("one report per agent")
}

/// The `agent` part's measurements for each of `agents` (release builds of
/// `lookout`), interleaved: each measurement runs for every agent before
/// the next one starts, and the order of the agents turns round from one
/// measurement to the next, so that neither always goes first. One report
/// per agent, in the order given.
pub(crate) fn agent_runs(
    opts: &Options,
    paths: &Paths,
    agents: &[&Path],
) -> anyhow::Result<Vec<Report>> {
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
        consumer_reports[k] = consumers::run_release(opts, paths, agents[k])?;
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

/// The `consumers` part alone, in a fresh scratch directory.
pub(crate) fn consumers_part(opts: &Options, paths: &Paths) -> anyhow::Result<Report> {
    fresh_dir(&paths.work)?;
    let v = consumers::run_release(opts, paths, &paths.lookout)?;
    Ok(entries([("consumers", v)]))
}

/// The `nri` part: see [`nri`].
pub(crate) fn nri_part(_opts: &Options, paths: &Paths) -> anyhow::Result<Report> {
    let v = nri::bench_nri(&paths.lookout, &paths.work.join("nri"))?;
    Ok(entries([("nri", v)]))
}

/// The `inode-map` part: insert, lookup and memory per entry in each mode,
/// and a listing through stablefs.
pub(crate) fn inode_map_part(opts: &Options, paths: &Paths) -> anyhow::Result<Report> {
    std::fs::create_dir_all(&paths.work)?;
    let v = inode::bench_inode_map(paths, opts.inode_entries)?;
    Ok(entries([("inode_map", v)]))
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::host::{switches_between, thread_switches};
    use crate::startup::startup_phases;

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
                "hooks",
                "nri",
                "pinned-maps",
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
    fn a_full_run_is_agent_hooks_pinned_maps_then_inode_map() {
        let parts = selected(None).expect("no --only");
        let names: Vec<&str> = parts.iter().map(|p| p.name).collect();
        assert_eq!(names, ["agent", "hooks", "pinned-maps", "inode-map"]);
    }
}
