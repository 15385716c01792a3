//! Checking what a guest printed between its markers.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::Guest;

/// The console's sections: name to (text, rc).
pub(crate) fn sections(text: &str) -> BTreeMap<String, (String, Option<i32>)> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if let Some(name) = line.strip_prefix("@@lk begin ") {
            current = Some((name.trim().to_owned(), String::new()));
        } else if let Some(rest) = line.strip_prefix("@@lk end ") {
            let rc = rest
                .rsplit_once("rc=")
                .and_then(|(_, n)| n.trim().parse().ok());
            if let Some((name, body)) = current.take() {
                out.insert(name, (body, rc));
            }
        } else if let Some((_, body)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

pub(crate) fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .collect()
}

/// Checks one guest's console; returns its report (problems listed in it).
pub(crate) fn check(guest: &Guest, text: &str) -> Value {
    let s = sections(text);
    let mut problems: Vec<String> = Vec::new();
    if !text.contains("@@lk done") {
        problems.push("the guest did not reach the end of its checks".into());
    }
    let body = |name: &str| s.get(name).map(|(b, _)| b.as_str()).unwrap_or("");
    let uname = body("uname").trim().to_owned();
    let versions = body("versions").trim().to_owned();
    let probe: Value = serde_json::Deserializer::from_str(body("probe"))
        .into_iter::<Value>()
        .next()
        .and_then(Result::ok)
        .unwrap_or(Value::Null);
    let devfd = body("devfd-missing");
    let without_devfd = json!({
        "ran": devfd.contains("stopped"),
        "error": devfd
            .lines()
            .find(|l| l.contains("cloned binary") || l.contains("re-execute"))
            .map(|l| strip_ansi(l).trim().to_owned()),
    });
    if probe.is_null() {
        problems.push(format!("no probe output: {:?}", body("probe")));
    }
    let mut modes = serde_json::Map::new();
    for (mode, containers) in [
        ("auto", &[("rc-auto", 3), ("cr-auto", 5)][..]),
        ("fanotify", &[("rc-fan", 3), ("cr-fan", 5)][..]),
        ("scan", &[("rc-scan", 3), ("cr-scan", 5)][..]),
    ] {
        let seen = Seen {
            events: json_lines(body(&format!("events.{mode}"))),
            watch: json_lines(body(&format!("watch.{mode}"))),
            hook: body(&format!("hook.{mode}")).to_owned(),
            gates: json_lines(body(&format!("gate.{mode}"))),
        };
        let mut results = serde_json::Map::new();
        for (id, code) in containers {
            let r = check_container(&s, mode, id, *code, &seen, &mut problems);
            results.insert((*id).to_owned(), r);
        }
        let log = json_lines(body(&format!("log.{mode}")));
        let chosen = log
            .iter()
            .find_map(|l| l["fields"]["mode"].as_str().map(str::to_owned));
        let warnings: Vec<String> = log
            .iter()
            .filter(|l| l["level"] == "WARN" || l["level"] == "ERROR")
            .map(|l| format!("{}: {}", l["level"].as_str().unwrap_or(""), l["fields"]))
            .collect();
        // The answering thread blocks in read(2), woken to stop by an event
        // on a marked memfd; every kernel here must give that event.
        if let Some(l) = log.iter().find(|l| {
            l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("the answering thread polls its group"))
        }) {
            problems.push(format!("{mode}: {}", l["fields"]));
        }
        let metrics = body(&format!("metrics.{mode}"));
        // The container maps (the guest mounts bpffs at /sys/fs/bpf): an
        // entry written for each container added with a cgroup id, none
        // refused, on every kernel.
        let keyed = results
            .values()
            .filter(|r| r["cgroup_id"].as_u64().is_some())
            .count();
        let writes = metric(
            metrics,
            "pinned_map_writes_total{map=\"containers_by_cgroup\"}",
        );
        let failures = metric(metrics, "pinned_map_write_failures_total");
        if writes.unwrap_or(0.0) < keyed as f64 {
            problems.push(format!(
                "{mode}: {keyed} containers with a cgroup id, {writes:?} pinned map entries written"
            ));
        }
        if failures.unwrap_or(0.0) > 0.0 {
            problems.push(format!("{mode}: pinned map writes failed: {failures:?}"));
        }
        modes.insert(
            mode.to_owned(),
            json!({
                "mode": chosen,
                "containers": results,
                "warnings": warnings,
                "unread_argv": metric(metrics, "unread_argv"),
                "pinned_map_writes": writes,
                "memory_kb": memory_kb(body(&format!("memory.{mode}"))),
            }),
        );
    }
    let states = check_states(&s, &mut problems);
    json!({
        "guest": guest.name,
        "suite": guest.suite,
        "state_files": states,
        "arch": guest.arch.name(),
        "uname": uname,
        "runtimes": versions,
        "probe": probe,
        "without_dev_fd": without_devfd,
        "modes": modes,
        "problems": problems,
    })
}

/// What a mode's sections say of its containers.
struct Seen {
    /// The agent's events.
    events: Vec<Value>,
    /// What the API's watcher read.
    watch: Vec<Value>,
    /// What the prestart hook wrote.
    hook: String,
    /// What the API's gate consumer was told.
    gates: Vec<Value>,
}

/// Checks container `id` (which exits with `code`) in `mode`: it ran, was
/// added and removed with its exit code, and the watcher, the gate and
/// the prestart hook saw it; returns its row.
fn check_container(
    s: &BTreeMap<String, (String, Option<i32>)>,
    mode: &str,
    id: &str,
    code: i64,
    seen: &Seen,
    problems: &mut Vec<String>,
) -> Value {
    let run = s
        .get(&format!("run.{mode}.{id}"))
        .map_or("", |(b, _)| b.as_str());
    let ran = run.contains("stopped")
        && s.get(&format!("run.{mode}.{id}"))
            .is_some_and(|(_, rc)| *rc == Some(0));
    let of = |kind: &str| {
        seen.events
            .iter()
            .find(|e| e["event"] == kind && e["container"]["id"] == id)
            .cloned()
    };
    let added = of("added");
    let removed = of("removed");
    let mut r = json!({
        "ran": ran,
        "added": added.is_some(),
        "removed": removed.is_some(),
    });
    if !ran {
        problems.push(format!(
            "{mode}: container {id} did not run: {}",
            run.trim()
        ));
    }
    match &added {
        Some(a) => {
            r["pid"] = a["container"]["pid"].clone();
            r["status"] = a["container"]["status"].clone();
            r["source"] = a["source"].clone();
            r["args"] = a["container"]["args"].clone();
            if a["container"]["pid"].as_u64().unwrap_or(0) == 0 {
                problems.push(format!("{mode}: {id} added without a pid"));
            }
            // What consumers' BPF programs key by, on every kernel: the
            // cgroup v2 id and the eight namespaces (time since 5.6).
            r["cgroup_id"] = a["container"]["cgroup_id"].clone();
            if a["container"]["cgroup_id"].as_u64().is_none() {
                problems.push(format!(
                    "{mode}: {id} added without a cgroup id: {}",
                    a["container"]["unresolved"]
                ));
            }
            let ns = &a["container"]["namespaces"];
            let missing: Vec<&str> = ["mnt", "net", "pid", "user", "cgroup", "ipc", "uts", "time"]
                .into_iter()
                .filter(|n| ns[*n].as_u64().is_none())
                .collect();
            if !missing.is_empty() {
                problems.push(format!("{mode}: {id} added without namespaces {missing:?}"));
            }
            if mode != "scan" && a["container"]["status"] != "created" {
                problems.push(format!(
                    "{mode}: {id} added as {}, not while created",
                    a["container"]["status"]
                ));
            }
        }
        None if ran => problems.push(format!("{mode}: no added event for {id}")),
        None => {}
    }
    match &removed {
        Some(e) => {
            r["exit_code"] = e["exit_code"].clone();
            // Exit codes come from the BPF exit program: the other
            // modes report one only when they learn it.
            let wrong = match e["exit_code"].as_i64() {
                Some(c) => c != code,
                None => mode == "auto",
            };
            if wrong {
                problems.push(format!(
                    "{mode}: {id} removed with exit code {}, not {code}",
                    e["exit_code"]
                ));
            }
        }
        None if ran => problems.push(format!("{mode}: no removed event for {id}")),
        None => {}
    }
    // The consumer API saw it too.
    let watched = seen
        .watch
        .iter()
        .any(|e| e.to_string().contains(&format!("\"{id}\"")));
    r["watched"] = json!(watched);
    if ran && !watched {
        problems.push(format!("{mode}: the API's watcher never saw {id}"));
    }
    // A gate consumer held its start, through the API, where the
    // mode can hold one (BPF reads the runtime's argv before its
    // exec goes on). Without BPF (`fanotify`) the exec is allowed
    // before its argv is read: the gate hears of the container,
    // not held.
    let gate = seen.gates.iter().find(|g| g["id"] == id);
    match mode {
        "auto" => {
            let held = gate.is_some_and(|g| g["held"] == true);
            r["gate_held"] = json!(held);
            if ran && !held {
                problems.push(format!("{mode}: the API's gate never held {id}"));
            }
        }
        "fanotify" => {
            let heard = gate.is_some_and(|g| g["held"] == false);
            r["gate_heard_not_held"] = json!(heard);
            if ran && !heard {
                problems.push(format!(
                    "{mode}: the API's gate did not hear of {id} as not held: {gate:?}"
                ));
            }
        }
        _ => {}
    }
    // The prestart hook ran with the container's state.
    if mode != "scan" {
        let hooked = seen.hook.contains(&format!("\"id\":\"{id}\""));
        r["prestart_hook"] = json!(hooked);
        if ran && !hooked {
            problems.push(format!("{mode}: the prestart hook did not run for {id}"));
        }
    }
    r
}

/// Checks the runc and crun state files the guest kept: each has the
/// fields lookout reads; returns them by runtime.
fn check_states(
    s: &BTreeMap<String, (String, Option<i32>)>,
    problems: &mut Vec<String>,
) -> serde_json::Map<String, Value> {
    let body = |name: &str| s.get(name).map(|(b, _)| b.as_str()).unwrap_or("");
    let mut states = serde_json::Map::new();
    for (id, runtime) in [("rc-auto", "runc"), ("cr-auto", "crun")] {
        let state: Value =
            serde_json::from_str(body(&format!("state.{id}")).trim()).unwrap_or(Value::Null);
        let keys: Vec<&str> = state
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k.as_str())
            .collect();
        // The fields lookout reads (lookout-runtime-hook's state.rs).
        let reads: &[&str] = if runtime == "runc" {
            &["init_process_pid", "init_process_start", "config"]
        } else {
            &["pid", "process-start-time", "bundle"]
        };
        let missing: Vec<&str> = reads
            .iter()
            .copied()
            .filter(|k| state.get(k).is_none())
            .collect();
        if state.is_null() {
            problems.push(format!("no {runtime} state file from the guest"));
        } else if !missing.is_empty() {
            problems.push(format!("{runtime}'s state file lacks {missing:?}"));
        }
        states.insert(
            runtime.to_owned(),
            json!({"keys": keys, "lookout_reads": reads, "missing": missing}),
        );
    }
    states
}

/// `text` without terminal colour sequences (runc colours its errors).
pub(crate) fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // ESC [ ... final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The agent's `/proc/<pid>/status` memory lines (`VmRSS:   9876 kB`) as
/// `{"VmRSS": 9876, ...}`, in KiB; null when the guest printed none.
pub(crate) fn memory_kb(text: &str) -> Value {
    let fields: serde_json::Map<String, Value> = text
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
            Some((name.trim().to_owned(), json!(kb)))
        })
        .collect();
    if fields.is_empty() {
        Value::Null
    } else {
        Value::Object(fields)
    }
}

/// The sum of the samples of every metric whose name contains `name`.
pub(crate) fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(name))
    {
        if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_memory_is_read_from_its_status_lines() {
        let status = "VmRSS:\t    9876 kB\nRssAnon:\t    2048 kB\nRssFile:\t    7828 kB\nRssShmem:\t       0 kB\n";
        let m = memory_kb(status);
        assert_eq!(m["VmRSS"], 9876);
        assert_eq!(m["RssAnon"], 2048);
        assert_eq!(m["RssFile"], 7828);
        assert_eq!(memory_kb(""), Value::Null);
        assert_eq!(memory_kb("grep: /proc/1/status: No such file"), Value::Null);
    }
}
