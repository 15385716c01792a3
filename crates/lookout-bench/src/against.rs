//! `cargo xtask bench --against REV`: this tree's agent and revision REV's,
//! measured side by side in one run (see [`agent_runs`]), each figure
//! printed for both with their ratio. On these noisy machines a change
//! shows it did not regress only this way: two runs an hour apart differ
//! by more than most changes.
//!
//! The xtask builds REV's agent (its own BPF object, linked as this tree's
//! image links an agent, so that a figure compares code, not builds); the
//! floors are always this tree's.

use std::path::Path;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::discovery::discovery_interleaved;
use crate::parts::{agent_runs, entries, fresh_dir};
use crate::print::{print_agent, print_discovery_rows};
use crate::util::say;
use crate::{Options, Paths};

/// Measures this tree's agent (`paths.lookout`, described as `here`) and
/// `theirs`, revision `rev` (commit `sha`), side by side; writes both
/// reports and the comparison to report.json and prints them. Runs the
/// `agent` part, or with `--only discovery` its discovery rows alone.
pub fn run_against(
    opts: &Options,
    paths: &Paths,
    theirs: &Path,
    here: &str,
    rev: &str,
    sha: &str,
) -> anyhow::Result<()> {
    crate::prepare(opts)?;
    let _pins = crate::agent::PinFsGuard;
    if opts.only.as_deref() == Some("hooks") {
        return hooks_against(opts, paths, theirs, here, rev, sha);
    }
    let discovery_only = discovery_only(opts)?;
    say(
        "bench",
        &format!("this tree ({here}) against {rev} ({sha:.12}), interleaved"),
    );
    let agents = [paths.lookout.as_path(), theirs];
    let mut reports = if discovery_only {
        // The discovery rows alone, in a minute or two: their blocks as
        // the full run interleaves them.
        fresh_dir(&paths.work)?;
        let (lags, work_floor) = discovery_interleaved(opts, paths, &agents)?;
        lags.into_iter()
            .map(|mut d| {
                d["work_floor"] = work_floor.clone();
                entries([("discovery_us", d)])
            })
            .collect()
    } else {
        agent_runs(opts, paths, &agents)?
    };
    let against = reports.pop().context("two reports")?;
    let this = reports.pop().context("two reports")?;
    let (this, against) = (Value::Object(this), Value::Object(against));
    let mut rows = compare(&this, &against);
    if discovery_only {
        // Only the rows this run measured.
        if let Some(rows) = rows.as_array_mut() {
            rows.retain(|r| !r["this"].is_null());
        }
    }
    let report = json!({
        "this": this,
        "this_rev": here,
        "against": against,
        "against_rev": sha,
        "comparison": rows,
    });
    std::fs::create_dir_all(&paths.out_dir)?;
    let path = paths.out_dir.join("report.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", path.display()))?;
    let print = |r: &Value| {
        if discovery_only {
            println!("\n| measurement | p50 | p99 |\n|---|---|---|");
            print_discovery_rows(&r["discovery_us"]);
        } else {
            print_agent(r);
        }
    };
    println!("\n## this tree ({here})");
    print(&report["this"]);
    println!("\n## {rev} ({sha:.12})");
    print(&report["against"]);
    print_comparison(&report["comparison"], &format!("{rev} ({sha:.10})"));
    println!("report: {}", path.display());
    Ok(())
}

/// Whether `--against` measures the discovery rows alone (`--only
/// discovery`) rather than the `agent` part; an error for another part.
pub(crate) fn discovery_only(opts: &Options) -> anyhow::Result<bool> {
    match opts.only.as_deref() {
        None | Some("agent") => Ok(false),
        Some("discovery") => Ok(true),
        Some("hooks") => Ok(false),
        Some(only) => bail!(
            "--against compares the `agent` part (consumers included), the discovery rows \
             alone (--only discovery) or the hooks part (--only hooks); not --only {only}"
        ),
    }
}

/// One figure of the comparison: what it is, its goal (at most), and how
/// to read it from one agent's report.
struct Row {
    name: &'static str,
    goal: Goal,
    read: fn(&Value) -> Option<f64>,
    /// The same figure for the allow-all floor responder, measured in the
    /// same run beside the agents: the least any exec-permission listener
    /// pays, where the benchmark measures one.
    floor: Option<fn(&Value) -> Option<f64>>,
}

/// What a row of the comparison must stay under.
enum Goal {
    /// At most this.
    AtMost(f64),
    /// At most twice the annotations the memory measurement holds.
    TwiceTheData,
    /// None: a figure that explains another.
    Informational,
}

/// `report[a][b]..` as a number.
fn at(report: &Value, path: &[&str]) -> Option<f64> {
    path.iter().try_fold(report, |v, k| v.get(k))?.as_f64()
}

/// The figures issue #29 sets goals for, in its order.
const ROWS: &[Row] = &[
    Row {
        name: "agent CPU per event, no consumer (us)",
        goal: Goal::AtMost(100.0),
        read: |r| {
            at(
                r,
                &["consumers", "watchers", "without", "cpu_clock_per_event_us"],
            )
        },
        floor: Some(|r| {
            at(
                r,
                &[
                    "consumers",
                    "watchers",
                    "floor",
                    "cpu_clock_per_container_event_us",
                ],
            )
        }),
    },
    Row {
        name: "voluntary context switches per container, no consumer",
        goal: Goal::Informational,
        read: |r| {
            at(
                r,
                &[
                    "consumers",
                    "watchers",
                    "without",
                    "context_switches",
                    "voluntary_per_container",
                ],
            )
        },
        floor: Some(|r| {
            at(
                r,
                &[
                    "consumers",
                    "watchers",
                    "floor",
                    "context_switches",
                    "voluntary_per_container",
                ],
            )
        }),
    },
    Row {
        name: "work floor: the agent's work on one thread, no safety boundaries, CPU per event (us)",
        goal: Goal::Informational,
        read: |r| {
            at(
                r,
                &[
                    "consumers",
                    "watchers",
                    "work_floor",
                    "cpu_clock_per_container_event_us",
                ],
            )
        },
        floor: None,
    },
    Row {
        name: "agent CPU per container, churn (ms)",
        goal: Goal::AtMost(0.2),
        // The CPU clock (ns); an older report has the clock ticks only.
        read: |r| {
            let cpu = at(r, &["churn", "cpu_clock_s"]).or_else(|| at(r, &["churn", "cpu_s"]))?;
            Some(cpu * 1e3 / at(r, &["churn", "containers"])?)
        },
        floor: Some(|r| at(r, &["churn_floor", "cpu_per_container_ms"])),
    },
    Row {
        name: "work floor: the agent's work on one thread, churn CPU per container (ms)",
        goal: Goal::Informational,
        read: |r| at(r, &["churn_floor", "work_cpu_per_container_ms"]),
        floor: None,
    },
    Row {
        name: "added per watcher and event (us)",
        goal: Goal::AtMost(3.0),
        read: |r| {
            at(
                r,
                &[
                    "consumers",
                    "watchers",
                    "added_cpu_clock_per_watcher_event_us",
                ],
            )
        },
        // A gRPC stream per watcher (a report before it: one write).
        floor: Some(|r| {
            at(
                r,
                &[
                    "consumers",
                    "watchers",
                    "grpc_floor",
                    "cpu_clock_per_watcher_event_us",
                ],
            )
            .or_else(|| {
                at(
                    r,
                    &[
                        "consumers",
                        "watchers",
                        "frame_floor",
                        "cpu_clock_per_watcher_event_us",
                    ],
                )
            })
        }),
    },
    Row {
        name: "start-up to ready, p50 (ms)",
        goal: Goal::AtMost(150.0),
        read: |r| at(r, &["startup_ms", "p50"]),
        floor: None,
    },
    Row {
        name: "idle RSS (MB)",
        goal: Goal::AtMost(10.0),
        read: |r| Some(at(r, &["idle_5s", "rss_kb"])? / 1e3),
        floor: None,
    },
    Row {
        name: "RSS, heavy annotations, all tracked (MB)",
        goal: Goal::TwiceTheData,
        read: |r| Some(at(r, &["memory_heavy_annotations", "rss_all_tracked_kb"])? / 1e3),
        floor: None,
    },
    Row {
        name: "idle RSS, anonymous part (MB)",
        goal: Goal::Informational,
        read: |r| Some(at(r, &["idle_5s", "rss_anon_kb"])? / 1e3),
        floor: None,
    },
    Row {
        name: "heavy annotations RSS, anonymous part (MB)",
        goal: Goal::Informational,
        read: |r| Some(at(r, &["memory_heavy_annotations", "rss_anon_kb"])? / 1e3),
        floor: None,
    },
    Row {
        name: "create exit -> Added, p99 (us)",
        goal: Goal::AtMost(300.0),
        read: |r| at(r, &["discovery_us", "create_exit_to_added", "p99"]),
        floor: Some(|r| {
            at(
                r,
                &["discovery_us", "floor", "create_exit_to_state_read", "p99"],
            )
        }),
    },
    Row {
        name: "container exit -> Removed, p99 (us)",
        goal: Goal::AtMost(300.0),
        read: |r| at(r, &["discovery_us", "exit_to_removed", "p99"]),
        floor: Some(|r| at(r, &["discovery_us", "floor", "exit_to_woken", "p99"])),
    },
    Row {
        name: "from the kernel's exit: container -> Removed, p99 (us)",
        goal: Goal::Informational,
        read: |r| kernel_removed(r, &[], "p99"),
        // The work floor's removed line, timed from the same kernel exit.
        floor: Some(|r| kernel_removed(r, &["work_floor"], "p99")),
    },
    Row {
        name: "from the kernel's exit: container -> Removed, p50 (us)",
        goal: Goal::Informational,
        read: |r| kernel_removed(r, &[], "p50"),
        floor: Some(|r| kernel_removed(r, &["work_floor"], "p50")),
    },
    Row {
        name: "work floor: create exit -> its added line, p99 (us)",
        goal: Goal::Informational,
        read: |r| {
            at(
                r,
                &["discovery_us", "work_floor", "create_exit_to_added", "p99"],
            )
        },
        floor: None,
    },
    Row {
        name: "work floor: container exit -> its removed line, p99 (us)",
        goal: Goal::Informational,
        read: |r| at(r, &["discovery_us", "work_floor", "exit_to_removed", "p99"]),
        floor: None,
    },
    Row {
        name: "create exit -> Added, p50 (us)",
        goal: Goal::Informational,
        read: |r| at(r, &["discovery_us", "create_exit_to_added", "p50"]),
        floor: Some(|r| {
            at(
                r,
                &["discovery_us", "floor", "create_exit_to_state_read", "p50"],
            )
        }),
    },
    Row {
        name: "container exit -> Removed, p50 (us)",
        goal: Goal::Informational,
        read: |r| at(r, &["discovery_us", "exit_to_removed", "p50"]),
        floor: Some(|r| at(r, &["discovery_us", "floor", "exit_to_woken", "p50"])),
    },
    Row {
        name: "discovery events missing after 5 s (added + removed)",
        goal: Goal::Informational,
        // An older report has no count (it waited a fixed 200 ms).
        read: |r| {
            Some(
                at(r, &["discovery_us", "missing", "added"])?
                    + at(r, &["discovery_us", "missing", "removed"])?,
            )
        },
        floor: None,
    },
    Row {
        name: "exec beyond the allow-all floor, p50 (us)",
        goal: Goal::AtMost(5.0),
        read: |r| {
            Some(
                at(r, &["exec_us", "overhead_lookout_p50_us"])?
                    - at(r, &["exec_us", "overhead_floor_p50_us"])?,
            )
        },
        floor: None,
    },
    Row {
        name: "work floor: exec beyond the allow-all floor, p50 (us)",
        goal: Goal::Informational,
        read: |r| {
            Some(
                at(r, &["exec_us", "overhead_work_floor_p50_us"])?
                    - at(r, &["exec_us", "overhead_floor_p50_us"])?,
            )
        },
        floor: None,
    },
    Row {
        name: "runc start back to back, 1 subscriber, paired p50 (us)",
        goal: Goal::AtMost(150.0),
        read: |r| {
            at(
                r,
                &[
                    "consumers",
                    "gate_start_us",
                    "subscribers_1",
                    "back_to_back_added_paired_p50_us",
                ],
            )
        },
        // The gate floor: the work floor holding each start until one
        // subscriber (the same client) answers, minus the same floor with
        // none. An older report has only the floor of any answer through
        // the API: a `List` round trip to an agent whose threads were
        // parked, as they are when the hold begins.
        floor: Some(|r| {
            let g = &["consumers", "gate_start_us"];
            at(
                r,
                &[g[0], g[1], "gate_floor", "back_to_back_added_paired_p50_us"],
            )
            .or_else(|| at(r, &[g[0], g[1], "list_round_trip_idle_us", "p50"]))
        }),
    },
    Row {
        name: "held start's wait for 1 subscriber, mean (us)",
        goal: Goal::Informational,
        read: |r| {
            at(
                r,
                &[
                    "consumers",
                    "gate_start_us",
                    "subscribers_1",
                    "start_wait_mean_us",
                ],
            )
        },
        // How long the gate floor kept its starts unanswered, counted as
        // the agent counts them: a steadier figure than the paired start.
        floor: Some(|r| {
            at(
                r,
                &[
                    "consumers",
                    "gate_start_us",
                    "gate_floor",
                    "start_wait_mean_us",
                ],
            )
        }),
    },
];

/// Percentile `p` of `Removed`'s lag behind the kernel's exit, in the
/// discovery report under `within` (nothing: the agent's; `work_floor`).
fn kernel_removed(report: &Value, within: &[&str], p: &str) -> Option<f64> {
    let d = within
        .iter()
        .try_fold(report.get("discovery_us")?, |v, k| v.get(k))?;
    at(d, &["from_kernel_exit", "exit_to_removed", p])
}

/// The goal of the heavy-annotations row: twice the data held.
fn heavy_goal_mb(report: &Value) -> Option<f64> {
    let m = &report["memory_heavy_annotations"];
    Some(2.0 * m["containers"].as_f64()? * m["annotation_bytes_each"].as_f64()? / 1e6)
}

/// The comparison rows: each figure for both agents, their ratio, the goal.
fn compare(this: &Value, against: &Value) -> Value {
    ROWS.iter()
        .map(|row| {
            let (a, b) = ((row.read)(this), (row.read)(against));
            let goal = match row.goal {
                Goal::AtMost(g) => Some(g),
                Goal::TwiceTheData => heavy_goal_mb(this),
                Goal::Informational => None,
            };
            let floor = row.floor.and_then(|read| read(this));
            json!({
                "measure": row.name,
                "this": a,
                "against": b,
                "ratio": a.zip(b).map(|(a, b)| a / b),
                "goal_at_most": goal,
                "goal_met": a.zip(goal).map(|(a, g)| a <= g),
                "floor": floor,
                // A goal no exec-permission listener can meet here.
                "goal_below_floor": goal.zip(floor).map(|(g, f)| g < f),
            })
        })
        .collect()
}

/// Prints the comparison table.
fn print_comparison(rows: &Value, against: &str) {
    let num = |v: &Value| match v.as_f64() {
        Some(x) if x.abs() >= 100.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.2}"),
        None => "-".to_owned(),
    };
    println!("\n| measure | this tree | {against} | this / that | measured floor | goal | met |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows.as_array().map(Vec::as_slice).unwrap_or_default() {
        println!(
            "| {} | {} | {} | {} | {}{} | {} | {} |",
            r["measure"].as_str().unwrap_or_default(),
            num(&r["this"]),
            num(&r["against"]),
            num(&r["ratio"]),
            num(&r["floor"]),
            if r["goal_below_floor"] == json!(true) {
                " (above the goal)"
            } else {
                ""
            },
            if r["goal_at_most"].is_null() {
                "-".to_owned()
            } else {
                format!("<= {}", num(&r["goal_at_most"]))
            },
            match r["goal_met"].as_bool() {
                Some(true) => "yes",
                Some(false) => "no",
                None => "-",
            }
        );
    }
}

/// `--against REV --only hooks`: `runc start` through this tree's agent and
/// REV's, each with no hook and with one `prestart` hook, interleaved.
fn hooks_against(
    opts: &Options,
    paths: &Paths,
    theirs: &Path,
    here: &str,
    rev: &str,
    sha: &str,
) -> anyhow::Result<()> {
    fresh_dir(&paths.work)?;
    let one = ["prestart"];
    let configs = [
        crate::hooks::Config {
            label: format!("this, none ({here})"),
            lookout: &paths.lookout,
            hooks: &[],
        },
        crate::hooks::Config {
            label: format!("{rev}, none"),
            lookout: theirs,
            hooks: &[],
        },
        crate::hooks::Config {
            label: format!("this, prestart ({here})"),
            lookout: &paths.lookout,
            hooks: &one,
        },
        crate::hooks::Config {
            label: format!("{rev}, prestart"),
            lookout: theirs,
            hooks: &one,
        },
    ];
    let v = crate::hooks::measure(&paths.work, &configs, opts.gate_rounds)?;
    std::fs::create_dir_all(&paths.out_dir)?;
    let path = paths.out_dir.join("report.json");
    let report = json!({ "hooks_start_us": v, "this_rev": here, "against_rev": sha });
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", path.display()))?;
    crate::hooks::print(&report["hooks_start_us"]);
    println!("report: {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_reads_its_figure_and_a_missing_one_is_none() {
        let report = json!({
            "churn": {"cpu_s": 0.5, "containers": 500},
            "churn_floor": {"cpu_per_container_ms": 0.25},
            "startup_ms": {"p50": 200.0},
            "idle_5s": {"rss_kb": 9000},
            "memory_heavy_annotations": {"containers": 200, "annotation_bytes_each": 65536,
                "rss_all_tracked_kb": 30000},
            "exec_us": {"overhead_lookout_p50_us": 12.0, "overhead_floor_p50_us": 9.0},
            "consumers": {"watchers": {
                "without": {"context_switches": {"voluntary_per_container": 14.5}},
                "floor": {"context_switches": {"voluntary_per_container": 5.0}},
            }},
        });
        let rows = compare(&report, &json!({}));
        let by = |name: &str| {
            rows.as_array()
                .and_then(|r| r.iter().find(|r| r["measure"] == name))
                .cloned()
                .unwrap_or_default()
        };
        assert_eq!(
            by("agent CPU per container, churn (ms)")["this"],
            json!(1.0)
        );
        let churn = by("agent CPU per container, churn (ms)");
        assert_eq!(churn["floor"], json!(0.25));
        assert_eq!(
            churn["goal_below_floor"],
            json!(true),
            "0.2 ms is below a floor of 0.25"
        );
        assert!(
            by("agent CPU per event, no consumer (us)")["floor"].is_null(),
            "no floor in this report"
        );
        assert!(by("idle RSS (MB)")["goal_below_floor"].is_null());
        assert_eq!(by("idle RSS (MB)")["goal_met"], json!(true));
        assert!(
            by("idle RSS, anonymous part (MB)")["goal_at_most"].is_null(),
            "an explaining row has no goal of its own"
        );
        assert_eq!(by("start-up to ready, p50 (ms)")["goal_met"], json!(false));
        assert_eq!(
            by("exec beyond the allow-all floor, p50 (us)")["this"],
            json!(3.0)
        );
        let heavy = by("RSS, heavy annotations, all tracked (MB)");
        assert_eq!(heavy["goal_at_most"], json!(26.2144));
        assert_eq!(heavy["goal_met"], json!(false));
        // The other agent's report has none of them: no ratio.
        assert!(
            rows.as_array()
                .is_some_and(|r| r.iter().all(|r| r["ratio"].is_null()))
        );
        assert!(by("added per watcher and event (us)")["this"].is_null());
        let switches = by("voluntary context switches per container, no consumer");
        assert_eq!(switches["this"], json!(14.5));
        assert_eq!(switches["floor"], json!(5.0));
        assert!(switches["goal_at_most"].is_null());
    }

    #[test]
    fn the_kernel_rows_read_the_agent_and_the_work_floor_and_stay_empty_for_an_older_agent() {
        const P99: &str = "from the kernel's exit: container -> Removed, p99 (us)";
        let this = json!({"discovery_us": {
            "from_kernel_exit": {"exit_to_removed": {"p50": 240.0, "p99": 610.0}},
            "work_floor": {"from_kernel_exit": {"exit_to_removed": {"p50": 220.0, "p99": 440.0}}},
        }});
        // An agent before c759113 hid the tracepoint's samples: n = 0.
        let older = json!({"discovery_us": {
            "from_kernel_exit": {"exit_to_removed": {"n": 0, "p50": null, "p99": null}},
        }});
        let rows = compare(&this, &older);
        let row = rows
            .as_array()
            .and_then(|r| r.iter().find(|r| r["measure"] == P99))
            .cloned()
            .unwrap_or_default();
        assert_eq!(row["this"], json!(610.0));
        assert_eq!(row["floor"], json!(440.0));
        assert!(row["against"].is_null() && row["ratio"].is_null());
        assert!(row["goal_at_most"].is_null(), "an explaining row");
    }

    #[test]
    fn the_gated_start_takes_the_gate_floor_and_an_older_report_the_list_round_trip() {
        const ROW: &str = "runc start back to back, 1 subscriber, paired p50 (us)";
        let gate = |extra: Value| {
            let mut g = json!({
                "subscribers_1": {"back_to_back_added_paired_p50_us": 210.0},
                "list_round_trip_idle_us": {"p50": 120.0},
            });
            if let (Some(g), Some(extra)) = (g.as_object_mut(), extra.as_object()) {
                g.extend(extra.clone());
            }
            json!({"consumers": {"gate_start_us": g}})
        };
        let row = |report: &Value| {
            compare(report, &json!({}))
                .as_array()
                .and_then(|r| r.iter().find(|r| r["measure"] == ROW).cloned())
                .unwrap_or_default()
        };
        let with_floor = row(&gate(
            json!({"gate_floor": {"back_to_back_added_paired_p50_us": 180.0}}),
        ));
        assert_eq!(with_floor["this"], json!(210.0));
        assert_eq!(with_floor["floor"], json!(180.0));
        assert_eq!(with_floor["goal_below_floor"], json!(true));
        let older = row(&gate(json!({})));
        assert_eq!(older["floor"], json!(120.0));
        assert_eq!(older["goal_below_floor"], json!(false));
    }
}
