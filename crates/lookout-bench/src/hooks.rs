//! The hooks part (issue #57): what OCI hooks add to a container's
//! `runc start`, side by side in one run: an agent without hooks, one with
//! a single `prestart` hook (busybox's `true` from a hooks.d file), and one
//! with such a hook at every stage (`createContainer` and
//! `startContainer` run in the container's namespaces, `poststart` after
//! the start). With `--against REV`, REV's agent runs beside this tree's
//! with no hooks and with the single `prestart` hook.
//!
//! Each agent watches a private copy of runc; the copies are used in a new
//! random order every round ([`gate_rounds`]), so machine noise falls on
//! every configuration alike.

use std::path::Path;

use anyhow::Context;
use serde_json::{Value, json};

use crate::consumers::Watched;
use crate::consumers::gates::{Gated, gate_rounds};
use crate::containers::busybox_bundle;
use crate::stats::{pct, stats};
use crate::util::say;

/// The stages of the "every stage" configuration.
const STAGES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

/// A hooks.d directory at `dir` with a busybox `true` hook for each of
/// `stages`, for every container.
fn hooks_dir(dir: &Path, stages: &[&str]) -> anyhow::Result<String> {
    std::fs::create_dir_all(dir)?;
    for (i, stage) in stages.iter().enumerate() {
        let file = json!({
            "version": "1.0.0",
            // busybox-static's `true`: static (a createContainer hook
            // must be) and at the same path in the bench's bundle (where
            // startContainer looks it up).
            "hook": {"path": "/bin/busybox", "args": ["true"]},
            "when": {"always": true},
            "stages": [stage],
        });
        std::fs::write(
            dir.join(format!("{i:02}-{stage}.json")),
            serde_json::to_vec(&file)?,
        )?;
    }
    Ok(dir.to_str().context("utf-8 path")?.to_owned())
}

/// An agent configuration measured: its label, binary and arguments.
pub(crate) struct Config<'a> {
    pub(crate) label: String,
    pub(crate) lookout: &'a Path,
    pub(crate) hooks: &'a [&'a str],
}

/// This tree's agent with no hook, one `prestart` hook and every stage.
pub(crate) fn configs(lookout: &Path) -> Vec<Config<'_>> {
    vec![
        Config {
            label: "none".into(),
            lookout,
            hooks: &[],
        },
        Config {
            label: "prestart".into(),
            lookout,
            hooks: &STAGES[..1],
        },
        Config {
            label: "every-stage".into(),
            lookout,
            hooks: &STAGES,
        },
    ]
}

/// `rounds` timed `runc start`s per configuration, interleaved; each
/// configuration's start times (microseconds) and its p50 paired with the
/// first configuration's in the same round.
pub(crate) fn measure(work: &Path, configs: &[Config<'_>], rounds: usize) -> anyhow::Result<Value> {
    say(
        "bench",
        &format!(
            "hooks: {rounds} rounds of `runc start` with {}, interleaved",
            configs
                .iter()
                .map(|c| c.label.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    let mut agents = Vec::new();
    for (k, c) in configs.iter().enumerate() {
        let dir = work.join(format!("hooks-{k}"));
        let mut extra = Vec::new();
        if !c.hooks.is_empty() {
            extra.push("--hooks-dir".to_owned());
            extra.push(hooks_dir(&dir.join("hooks.d"), c.hooks)?);
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        agents.push(Watched::start_with(c.lookout, &dir, &extra)?);
    }
    let targets: Vec<&dyn Gated> = agents.iter().map(|a| a as &dyn Gated).collect();
    let labels: Vec<String> = (0..configs.len()).map(|k| format!("h{k}")).collect();
    let bundle = work.join("bundle-hooks");
    busybox_bundle(&bundle, &["sleep", "30"])?;
    let bs = bundle.to_str().context("utf-8 path")?;
    let (times, back_to_back) = gate_rounds(&targets, &labels, bs, rounds)?;
    drop(targets);
    drop(agents);
    let paired =
        |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(a, b)| a - b).collect() };
    let mut out = serde_json::Map::new();
    out.insert("rounds".into(), json!(rounds));
    for (k, c) in configs.iter().enumerate() {
        out.insert(
            c.label.clone(),
            json!({
                "start_us": stats(&times[k]),
                "back_to_back_start_us": stats(&back_to_back[k]),
                "added_paired_p50_us": pct(&mut paired(&times[k], &times[0]), 0.5),
                "back_to_back_added_paired_p50_us":
                    pct(&mut paired(&back_to_back[k], &back_to_back[0]), 0.5),
            }),
        );
    }
    Ok(Value::Object(out))
}

/// Prints the part's table.
pub(crate) fn print(v: &Value) {
    println!(
        "\n`runc start` with hooks ({} rounds, interleaved; paired: minus the first row's start in the same round)\n",
        v["rounds"]
    );
    println!(
        "| configuration | start p50 (us) | start p99 (us) | added, paired p50 (us) | back to back p50 (us) | added back to back, paired p50 (us) |"
    );
    println!("|---|---|---|---|---|---|");
    if let Some(m) = v.as_object() {
        for (label, r) in m.iter().filter(|(k, _)| *k != "rounds") {
            let f = |p: &[&str]| {
                p.iter()
                    .try_fold(r, |v, k| v.get(k))
                    .and_then(Value::as_f64)
                    .map_or("-".into(), |x| format!("{x:.0}"))
            };
            println!(
                "| {label} | {} | {} | {} | {} | {} |",
                f(&["start_us", "p50"]),
                f(&["start_us", "p99"]),
                f(&["added_paired_p50_us"]),
                f(&["back_to_back_start_us", "p50"]),
                f(&["back_to_back_added_paired_p50_us"]),
            );
        }
    }
}
