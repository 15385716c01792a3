//! The agent's and the work floor's events (JSON lines), by container.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;

use serde_json::Value;

/// Events by container id: (added ns, removed ns), as [`Agent::events`]
/// returns them.
pub(crate) type Events = HashMap<String, (Vec<u64>, Vec<u64>)>;

/// The events in `out`, JSON lines as the agent and the work floor print
/// them.
pub(crate) fn events_in(out: &Path) -> Events {
    let mut m = Events::new();
    let Ok(f) = std::fs::File::open(out) else {
        return m;
    };
    for line in std::io::BufReader::new(f).lines().map_while(Result::ok) {
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let id = v["container"]["id"].as_str().unwrap_or_default().to_owned();
        let ns = v["monotonic_ns"].as_u64().unwrap_or(0);
        let e = m.entry(id).or_default();
        if v["event"] == "added" {
            e.0.push(ns);
        } else {
            e.1.push(ns);
        }
    }
    m
}

/// Which of a container's events.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Added,
    Removed,
}

/// How many of `ids` have no `kind` event.
pub(crate) fn without<'a>(
    events: &Events,
    ids: impl IntoIterator<Item = &'a String>,
    kind: Kind,
) -> usize {
    ids.into_iter()
        .filter(|id| {
            events.get(*id).is_none_or(|(a, r)| match kind {
                Kind::Added => a.is_empty(),
                Kind::Removed => r.is_empty(),
            })
        })
        .count()
}

/// Microseconds from each container's time in `at` to its first `kind`
/// event, for the containers that have one.
pub(crate) fn lags(at: &HashMap<String, u64>, events: &Events, kind: Kind) -> Vec<f64> {
    at.iter()
        .filter_map(|(id, &t)| {
            let (added, removed) = events.get(id)?;
            let &e = match kind {
                Kind::Added => added,
                Kind::Removed => removed,
            }
            .first()?;
            Some((e as f64 - t as f64) / 1e3)
        })
        .collect()
}

/// Microseconds from `from` to `to` (negative when `to` came first: two
/// waiters on one exit wake in either order).
pub(crate) fn lag_us(from: u64, to: u64) -> f64 {
    (to as f64 - from as f64) / 1e3
}

/// How many of `ids` have been added and not removed.
pub(crate) fn tracked(events: &Events, ids: &[String]) -> usize {
    ids.iter()
        .filter(|i| {
            events
                .get(*i)
                .is_some_and(|(a, r)| !a.is_empty() && r.is_empty())
        })
        .count()
}
