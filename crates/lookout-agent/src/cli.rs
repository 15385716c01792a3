//! `lookout get` and `lookout watch`: the agent's consumer API from the
//! command line, through `lookout-client`.
//!
//! The commands are thin: they connect, then hand what they receive to pure
//! rendering functions ([`render_get`], [`render_event`]) that the tests
//! check line by line; `served.rs` runs the commands against the agent's
//! own consumer API.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lookout_client::proto::Container;
use lookout_client::{Client, ConnectOptions, ContainerExt, Event, Filter, OnFailure, Watcher};
use serde_json::{Value, json};

/// How `lookout get` prints the containers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GetOutput {
    /// ID, RUNTIME, NAMESPACE/POD, CONTAINER, PID, AGE, SOURCE.
    #[default]
    Table,
    /// The table, plus STATUS, KIND, WORKLOAD, CGROUP-ID, IMAGE and BUNDLE.
    Wide,
    /// One JSON object: `{"revision": N, "containers": [...]}`.
    Json,
}

/// How `lookout watch` prints events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum WatchOutput {
    /// `REV KIND ID RUNTIME NAMESPACE/POD PID`, one line per container.
    #[default]
    Text,
    /// One JSON object per event (NDJSON).
    Json,
}

/// The filter flags of `lookout get`, `watch` and `gate`: each is
/// repeatable; any of one flag's values matches, and every flag given must
/// match (the agent applies it, as for any consumer: docs/consumers.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct FilterArgs {
    /// Only containers of this runtime (runc, crun, runsc, youki, ...).
    #[arg(long = "runtime", value_name = "NAME")]
    pub runtimes: Vec<String>,
    /// Only containers in this Kubernetes namespace.
    #[arg(long = "namespace", value_name = "NAMESPACE")]
    pub namespaces: Vec<String>,
    /// Only containers whose pod has this label (all of those given).
    #[arg(long = "pod-label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub pod_labels: Vec<(String, String)>,
    /// Only containers with this OCI annotation (all of those given).
    #[arg(long = "annotation", value_name = "KEY=VALUE", value_parser = key_value)]
    pub annotations: Vec<(String, String)>,
    /// Only containers of this workload, the controller at the top of the
    /// pod's owners: Kind/namespace/name (Deployment/shop/api).
    #[arg(long = "workload", value_name = "KIND/NAMESPACE/NAME", value_parser = workload)]
    pub workloads: Vec<String>,
    /// Only the container of this cgroup id (what bpf_get_current_cgroup_id()
    /// returns in it).
    #[arg(long = "cgroup-id", value_name = "ID")]
    pub cgroup_ids: Vec<u64>,
    /// Only containers of this image: repo@sha256:..., or sha256:... (which
    /// also matches the image id). A Kubernetes container's digest usually
    /// comes in an UPDATED change, after its ADDED and its gate hold.
    #[arg(long = "image-digest", value_name = "DIGEST")]
    pub image_digests: Vec<String>,
}

impl FilterArgs {
    /// The filter the agent is asked to apply.
    pub fn to_filter(&self) -> Filter {
        let mut filter = Filter::all();
        for r in &self.runtimes {
            filter = filter.runtime(r);
        }
        for n in &self.namespaces {
            filter = filter.namespace(n);
        }
        for (k, v) in &self.pod_labels {
            filter = filter.pod_label(k, v);
        }
        for (k, v) in &self.annotations {
            filter = filter.annotation(k, v);
        }
        for w in &self.workloads {
            filter = filter.workload(w);
        }
        for id in &self.cgroup_ids {
            filter = filter.cgroup_id(*id);
        }
        for d in &self.image_digests {
            filter = filter.image_digest(d);
        }
        filter
    }
}

/// `KEY=VALUE` (the value may hold `=`; the key may not be empty).
fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// `Kind/namespace/name`, three parts, none empty (no part of it can hold
/// a `/`): what the agent compares a container's workload with.
fn workload(s: &str) -> Result<String, String> {
    let parts: Vec<&str> = s.split('/').collect();
    if parts.len() == 3 && parts.iter().all(|p| !p.is_empty()) {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not Kind/namespace/name (Deployment/shop/api)"
        ))
    }
}

/// Both commands wait briefly for an agent that is (re)starting. A watch
/// retries each outage this long, warns, and tries again.
fn connect_options() -> ConnectOptions {
    ConnectOptions::new().retry_for(Duration::from_secs(2))
}

/// `lookout get`: lists the containers `filter` matches once.
pub async fn get(socket: &Path, output: GetOutput, filter: Filter) -> anyhow::Result<()> {
    write_get(socket, output, filter, &mut io::stdout()).await
}

/// [`get`], writing to `out`.
pub(crate) async fn write_get(
    socket: &Path,
    output: GetOutput,
    filter: Filter,
    out: &mut (impl Write + Send),
) -> anyhow::Result<()> {
    let client = Client::connect_with(socket, connect_options()).await?;
    let (revision, containers) = client.list(filter).await?;
    let text = render_get(revision, &containers, output, now_unix_ms());
    ignore_closed_pipe(out.write_all(text.as_bytes()).and_then(|()| out.flush()))
}

/// `lookout watch`: prints every change after `since` of the containers
/// `filter` matches (0: those now first, as `SNAPSHOT` lines) until
/// interrupted or stdout closes. Survives agent restarts (see
/// `lookout_client::Watcher`).
pub async fn watch(
    socket: &Path,
    output: WatchOutput,
    since: u64,
    filter: Filter,
) -> anyhow::Result<()> {
    let client = Client::connect_with(socket, connect_options()).await?;
    let watcher = client.watch_since(filter, since).await?;
    print_events(watcher, output, &mut io::stdout()).await
}

/// Writes each event to `out`, flushed, until writing fails. A closed pipe
/// (`lookout watch | head`) ends it quietly; a retryable error is warned
/// about and retried; any other error ends it (the watcher ends after it).
pub(crate) async fn print_events(
    mut watcher: Watcher,
    output: WatchOutput,
    out: &mut (impl Write + Send),
) -> anyhow::Result<()> {
    while let Some(next) = watcher.next().await {
        let event = match next {
            Ok(event) => event,
            Err(error) if error.is_retryable() => {
                let error = anyhow::Error::new(error);
                eprintln!("lookout watch: {error:#}; still trying");
                continue;
            }
            Err(error) => return Err(error.into()),
        };
        let written = out
            .write_all(render_event(&event, output).as_bytes())
            .and_then(|()| out.flush());
        if let Err(error) = written {
            return ignore_closed_pipe(Err(error));
        }
    }
    // N.B. unreached: a watcher ends only after an error that is not
    // retryable, returned above.
    Ok(())
}

/// What `lookout gate` subscribes with and how it answers.
#[derive(Debug, Clone)]
pub struct GateOptions {
    /// The subscription's name.
    pub name: String,
    /// How long the agent waits for each decision (zero: the agent's
    /// default).
    pub deadline: Duration,
    /// Deny when no decision comes in time.
    pub fail_closed: bool,
    /// How long each start stays held before the answer.
    pub hold: Duration,
    /// Deny every start with this reason; allow when `None`.
    pub deny: Option<String>,
    /// How each hold is printed.
    pub output: WatchOutput,
}

/// `lookout gate`: subscribes to the agent's gate for the containers
/// `filter` matches, prints each hold, and answers it after `hold` (each
/// in its own task: one slow answer does not delay the next hold). Runs
/// until the agent goes for good, or stdout closes.
pub async fn gate(socket: &Path, opts: GateOptions, filter: Filter) -> anyhow::Result<()> {
    let client = Client::connect_with(socket, connect_options()).await?;
    answer_holds(&client, opts, filter, &mut io::stdout()).await
}

/// Subscribes and answers holds as [`gate`] says, printing each to `out`.
pub(crate) async fn answer_holds(
    client: &Client,
    opts: GateOptions,
    filter: Filter,
    out: &mut (impl Write + Send),
) -> anyhow::Result<()> {
    let on_failure = if opts.fail_closed {
        OnFailure::FailClosed
    } else {
        OnFailure::FailOpen
    };
    // N.B. `lookout_client::GateOptions`, what the agent is asked for; this
    // module's `GateOptions` also says how the CLI answers.
    let subscription = lookout_client::GateOptions::new(opts.name.clone())
        .filter(filter)
        .deadline(opts.deadline)
        .on_failure(on_failure);
    let mut gate = client.gate(subscription).await?;
    eprintln!(
        "lookout gate: subscribed as {:?}, deadline {} ms",
        gate.name(),
        gate.deadline().as_millis()
    );
    while let Some(next) = gate.next().await {
        let guard = match next {
            Ok(guard) => guard,
            Err(error) if error.is_retryable() => {
                let error = anyhow::Error::new(error);
                eprintln!("lookout gate: {error:#}; still trying");
                continue;
            }
            Err(error) => return Err(error.into()),
        };
        let written = out
            .write_all(render_hold(&guard, opts.output).as_bytes())
            .and_then(|()| out.flush());
        if let Err(error) = written {
            // The guard is dropped unanswered: the agent denies it as
            // "dropped unanswered", or the policy applies when we are gone.
            return ignore_closed_pipe(Err(error));
        }
        let (hold, deny) = (opts.hold, opts.deny.clone());
        tokio::spawn(async move {
            if !hold.is_zero() {
                tokio::time::sleep(hold).await;
            }
            let answered = match deny {
                Some(reason) => guard.deny(reason),
                None => guard.allow_because("lookout gate"),
            };
            if let Err(error) = answered {
                let error = anyhow::Error::new(error);
                eprintln!("lookout gate: {error:#}");
            }
        });
    }
    Ok(())
}

/// One hold as a line of text (`HOLD hold-id ID RUNTIME NAMESPACE/POD PID`,
/// `SEEN` for a start that could not be held, then what is known of
/// `kind=`, `workload=`, `cgroup_id=` and `digest=`) or JSON.
pub fn render_hold(guard: &lookout_client::HoldGuard, output: WatchOutput) -> String {
    let c = guard.container();
    match output {
        WatchOutput::Text => format!(
            "{} {} {} {} {} {}{}\n",
            if guard.held() { "HOLD" } else { "SEEN" },
            guard.hold_id(),
            cell(&c.id),
            cell(&c.runtime),
            namespace_pod(c),
            pid(c.pid),
            identity(c)
        ),
        WatchOutput::Json => format!(
            "{}\n",
            json!({
                "hold_id": guard.hold_id(),
                "held": guard.held(),
                "monotonic_ns": guard.monotonic_ns(),
                "id": c.id,
                "runtime": c.runtime,
                "pid": c.pid,
                "cgroup_id": c.cgroup_id(),
                "kind": c.kind().map(|k| k.as_str()),
                "workload": c.workload_key(),
                "image_digest": c.image_digest(),
            })
        ),
    }
}

fn ignore_closed_pipe(result: io::Result<()>) -> anyhow::Result<()> {
    match result {
        Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_millis()).ok())
        .unwrap_or(0)
}

/// What `lookout get` prints, given the time now.
pub fn render_get(
    revision: u64,
    containers: &[Container],
    output: GetOutput,
    now_unix_ms: i64,
) -> String {
    match output {
        GetOutput::Table => render_table(containers, now_unix_ms, false),
        GetOutput::Wide => render_table(containers, now_unix_ms, true),
        // `{:#}` pretty-prints a serde_json::Value.
        GetOutput::Json => format!("{:#}\n", list_json(revision, containers)),
    }
}

/// A `kubectl get`-style table: a header, one row per container sorted by
/// namespace, pod, container name and id, columns three spaces apart.
pub fn render_table(containers: &[Container], now_unix_ms: i64, wide: bool) -> String {
    let mut header = vec![
        "ID",
        "RUNTIME",
        "NAMESPACE/POD",
        "CONTAINER",
        "PID",
        "AGE",
        "SOURCE",
    ];
    if wide {
        header.extend(["STATUS", "KIND", "WORKLOAD", "CGROUP-ID", "IMAGE", "BUNDLE"]);
    }
    let mut sorted: Vec<&Container> = containers.iter().collect();
    sorted.sort_by(|a, b| {
        let key = |c: &Container| {
            let k8s = c.kubernetes.clone().unwrap_or_default();
            (k8s.namespace, k8s.pod, k8s.container, c.id.clone())
        };
        key(a).cmp(&key(b))
    });
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| (*h).to_owned()).collect()];
    for c in sorted {
        let k8s = c.kubernetes.as_ref();
        let mut row = vec![
            cell(&c.id.chars().take(13).collect::<String>()),
            cell(&c.runtime),
            namespace_pod(c),
            // A pod's container name, or else the engine's (Docker's).
            cell(
                k8s.map(|k| k.container.as_str())
                    .filter(|n| !n.is_empty())
                    .unwrap_or(&c.name),
            ),
            pid(c.pid),
            format_age(c.added_unix_ms, now_unix_ms),
            cell(&c.source),
        ];
        if wide {
            row.extend([
                cell(&c.status),
                cell(c.kind().map_or("", |k| k.as_str())),
                cell(&c.workload_key().unwrap_or_default()),
                c.cgroup_id()
                    .map_or_else(|| "-".to_owned(), |id| id.to_string()),
                cell(
                    k8s.map(|k| k.image.as_str())
                        .filter(|i| !i.is_empty())
                        .unwrap_or(&c.image),
                ),
                cell(&c.bundle),
            ]);
        }
        rows.push(row);
    }
    let columns = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|i| {
            rows.iter()
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut text = String::new();
    for row in rows {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            line.push_str(cell);
            line.extend(std::iter::repeat_n(' ', width - cell.chars().count() + 3));
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

/// A table cell: `-` for empty, control characters escaped so that what
/// a container reports cannot break the table or drive the terminal.
fn cell(value: &str) -> String {
    if value.is_empty() {
        return "-".to_owned();
    }
    value
        .chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// What is known of the container's kind, workload, cgroup id and image
/// digest, as ` kind=init workload=Deployment/shop/api cgroup_id=7301
/// digest=repo@sha256:...` (empty when none is).
fn identity(c: &Container) -> String {
    let mut text = String::new();
    if let Some(kind) = c.kind() {
        text.push_str(&format!(" kind={kind}"));
    }
    if let Some(workload) = c.workload_key() {
        text.push_str(&format!(" workload={}", cell(&workload)));
    }
    if let Some(id) = c.cgroup_id() {
        text.push_str(&format!(" cgroup_id={id}"));
    }
    if let Some(digest) = c.image_digest() {
        text.push_str(&format!(" digest={}", cell(digest)));
    }
    text
}

/// `namespace/pod`, or `-` without Kubernetes identity.
fn namespace_pod(c: &Container) -> String {
    match c.kubernetes.as_ref() {
        Some(k) if !k.pod.is_empty() => cell(&format!("{}/{}", k.namespace, k.pod)),
        _ => "-".to_owned(),
    }
}

fn pid(pid: u32) -> String {
    if pid == 0 {
        "-".to_owned()
    } else {
        pid.to_string()
    }
}

/// The AGE column: the time since `added_unix_ms`, as kubectl shows it;
/// `<unknown>` when the agent did not say (0).
pub fn format_age(added_unix_ms: i64, now_unix_ms: i64) -> String {
    if added_unix_ms <= 0 {
        return "<unknown>".to_owned();
    }
    human_duration(now_unix_ms.saturating_sub(added_unix_ms))
}

/// kubectl's `HumanDuration` (k8s.io/apimachinery/pkg/util/duration): two
/// significant units while they matter (`3m12s`, `2h5m`, `3d4h`), one
/// after (`15m`, `47h`, `30d`). Up to a second in the future is "now"
/// (clock skew); more is `<invalid>`.
pub fn human_duration(ms: i64) -> String {
    let seconds = ms / 1000;
    if seconds < -1 {
        return "<invalid>".to_owned();
    }
    if seconds < 0 {
        return "0s".to_owned();
    }
    if seconds < 60 * 2 {
        return format!("{seconds}s");
    }
    let minutes = seconds / 60;
    if minutes < 10 {
        return match seconds % 60 {
            0 => format!("{minutes}m"),
            s => format!("{minutes}m{s}s"),
        };
    }
    if minutes < 60 * 3 {
        return format!("{minutes}m");
    }
    let hours = minutes / 60;
    if hours < 8 {
        return match minutes % 60 {
            0 => format!("{hours}h"),
            m => format!("{hours}h{m}m"),
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    let days = hours / 24;
    if hours < 24 * 8 {
        return match hours % 24 {
            0 => format!("{days}d"),
            h => format!("{days}d{h}h"),
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{days}d");
    }
    let years = days / 365;
    if hours < 24 * 365 * 8 {
        return match days % 365 {
            0 => format!("{years}y"),
            d => format!("{years}y{d}d"),
        };
    }
    format!("{years}y")
}

/// `lookout get -o json`: the revision and every container.
pub fn list_json(revision: u64, containers: &[Container]) -> Value {
    json!({
        "revision": revision,
        "containers": containers.iter().map(container_json).collect::<Vec<_>>(),
    })
}

/// A map as a JSON object with sorted keys, so the output is stable.
fn sorted(map: &HashMap<String, String>) -> BTreeMap<&str, &str> {
    map.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// A container as JSON, with the proto's field names.
pub fn container_json(c: &Container) -> Value {
    json!({
        "id": c.id,
        "runtime": c.runtime,
        "pid": c.pid,
        "status": c.status,
        "bundle": c.bundle,
        "cgroup": c.cgroup,
        "annotations": sorted(&c.annotations),
        "args": c.args,
        "name": c.name,
        "image": c.image,
        "image_id": c.image_id,
        "labels": sorted(&c.labels),
        "image_digest": c.image_digest,
        "cgroup_id": c.cgroup_id,
        "kind": c.kind,
        "id_maps": c.id_maps.as_ref().map(|m| {
            let lines = |map: &[lookout_client::proto::IdMapping]| {
                map.iter()
                    .map(|l| json!({
                        "container_id": l.container_id,
                        "host_id": l.host_id,
                        "size": l.size,
                    }))
                    .collect::<Vec<_>>()
            };
            json!({"uid": lines(&m.uid), "gid": lines(&m.gid)})
        }),
        "unresolved": sorted(&c.unresolved),
        "kubernetes": c.kubernetes.as_ref().map(|k| json!({
            "namespace": k.namespace,
            "pod": k.pod,
            "pod_uid": k.pod_uid,
            "container": k.container,
            "image": k.image,
            "labels": sorted(&k.labels),
            "workload": k.workload.as_ref().map(|w| json!({
                "kind": w.kind,
                "name": w.name,
                "namespace": w.namespace,
                "api_version": w.api_version,
                "uid": w.uid,
            })),
        })),
        "source": c.source,
        "added_monotonic_ns": c.added_monotonic_ns,
        "added_unix_ms": c.added_unix_ms,
        "namespaces": c.namespaces.as_ref().map(|n| json!({
            "mnt": n.mnt,
            "pid": n.pid,
            "net": n.net,
            "user": n.user,
            "uts": n.uts,
            "ipc": n.ipc,
            "cgroup": n.cgroup,
            "time": n.time,
        })),
    })
}

/// What `lookout watch` prints for one event, newline-terminated (empty for
/// an event kind this build does not know).
///
/// Text: `REV ADDED id runtime ns/pod pid`, then `kind=`, `workload=`,
/// `cgroup_id=` and `digest=` when known; `UPDATED` adds `name=...` and
/// `image=...` when known; `REMOVED` adds `exit=N` and `reason="..."` when
/// known; a snapshot is one `SNAPSHOT` line per
/// container and a closing `REV SNAPSHOT_END count`. JSON: one object per
/// event, with `kind` as in the proto.
pub fn render_event(event: &Event, output: WatchOutput) -> String {
    match output {
        WatchOutput::Text => event_text(event),
        WatchOutput::Json => match event_json(event) {
            Some(value) => format!("{value}\n"),
            None => String::new(),
        },
    }
}

fn event_text(event: &Event) -> String {
    let line = |revision: u64, kind: &str, c: &Container| {
        format!(
            "{revision} {kind} {} {} {} {}{}",
            cell(&c.id),
            cell(&c.runtime),
            namespace_pod(c),
            pid(c.pid),
            identity(c)
        )
    };
    match event {
        Event::Snapshot {
            revision,
            containers,
        } => {
            let mut text = String::new();
            for c in containers {
                text.push_str(&line(*revision, "SNAPSHOT", c));
                text.push('\n');
            }
            text.push_str(&format!("{revision} SNAPSHOT_END {}\n", containers.len()));
            text
        }
        Event::Added {
            revision,
            container,
            ..
        } => format!("{}\n", line(*revision, "ADDED", container)),
        Event::Updated {
            revision,
            container,
            ..
        } => {
            let mut text = line(*revision, "UPDATED", container);
            if !container.name.is_empty() {
                text.push_str(&format!(" name={}", container.name));
            }
            if !container.image.is_empty() {
                text.push_str(&format!(" image={}", container.image));
            }
            text.push('\n');
            text
        }
        Event::Removed {
            revision,
            container,
            exit_code,
            reason,
            ..
        } => {
            let mut text = line(*revision, "REMOVED", container);
            if let Some(code) = exit_code {
                text.push_str(&format!(" exit={code}"));
            }
            if !reason.is_empty() {
                text.push_str(&format!(" reason={reason:?}"));
            }
            text.push('\n');
            text
        }
        _ => String::new(),
    }
}

fn event_json(event: &Event) -> Option<Value> {
    Some(match event {
        Event::Snapshot {
            revision,
            containers,
        } => json!({
            "kind": "SNAPSHOT",
            "revision": revision,
            "containers": containers.iter().map(container_json).collect::<Vec<_>>(),
        }),
        Event::Added {
            revision,
            container,
            monotonic_ns,
        } => json!({
            "kind": "ADDED",
            "revision": revision,
            "monotonic_ns": monotonic_ns,
            "container": container_json(container),
        }),
        Event::Updated {
            revision,
            container,
            monotonic_ns,
        } => json!({
            "kind": "UPDATED",
            "revision": revision,
            "monotonic_ns": monotonic_ns,
            "container": container_json(container),
        }),
        Event::Removed {
            revision,
            container,
            exit_code,
            reason,
            monotonic_ns,
        } => json!({
            "kind": "REMOVED",
            "revision": revision,
            "monotonic_ns": monotonic_ns,
            "exit_code": exit_code,
            "reason": reason,
            "container": container_json(container),
        }),
        _ => return None,
    })
}

#[cfg(test)]
mod served;

#[cfg(test)]
mod tests {
    use super::*;
    use lookout_client::proto::{IdMapping, IdMaps, Kubernetes, Namespaces, Workload};

    const NOW: i64 = 1_800_000_000_000;

    fn pod_container() -> Container {
        Container {
            id: "0123456789abcdef0123".into(),
            runtime: "runc".into(),
            pid: 4242,
            status: "running".into(),
            bundle: "/run/containerd/io.containerd.runtime.v2.task/k8s.io/0123".into(),
            source: "runtime-hook".into(),
            added_unix_ms: NOW - 5_000,
            kubernetes: Some(Kubernetes {
                namespace: "payments".into(),
                pod: "api-7d9f".into(),
                container: "server".into(),
                image: "registry.example/api:1.2".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn bare_container() -> Container {
        Container {
            id: "feed".into(),
            runtime: "crun".into(),
            source: "scan".into(),
            added_unix_ms: NOW - 3 * 3_600_000,
            ..Default::default()
        }
    }

    #[test]
    fn ages_read_like_kubectl() {
        let s = 1000;
        let cases = [
            (5 * s, "5s"),
            (119 * s, "119s"),
            (3 * 60 * s, "3m"),
            ((3 * 60 + 12) * s, "3m12s"),
            (15 * 60 * s, "15m"),
            (179 * 60 * s, "179m"),
            // Minutes up to 3 h, as kubectl.
            (2 * 3600 * s, "120m"),
            (3 * 3600 * s, "3h"),
            ((5 * 3600 + 5 * 60) * s, "5h5m"),
            (47 * 3600 * s, "47h"),
            ((3 * 24 + 4) * 3600 * s, "3d4h"),
            (30 * 24 * 3600 * s, "30d"),
            (730 * 24 * 3600 * s, "2y"),
            (((3 * 365) + 5) * 24 * 3600 * s, "3y5d"),
            (9 * 365 * 24 * 3600 * s, "9y"),
            (-1500, "0s"),
            (-5 * s, "<invalid>"),
        ];
        for (ms, expected) in cases {
            assert_eq!(human_duration(ms), expected, "{ms} ms");
        }
        assert_eq!(format_age(NOW - 5_000, NOW), "5s");
        assert_eq!(format_age(0, NOW), "<unknown>");
    }

    #[test]
    fn the_table_is_sorted_aligned_and_truncates_ids() {
        let table = render_table(&[pod_container(), bare_container()], NOW, false);
        let expected = "\
ID              RUNTIME   NAMESPACE/POD       CONTAINER   PID    AGE   SOURCE
feed            crun      -                   -           -      3h    scan
0123456789abc   runc      payments/api-7d9f   server      4242   5s    runtime-hook
";
        assert_eq!(table, expected);
    }

    #[test]
    fn wide_adds_status_image_and_bundle() {
        let table = render_get(7, &[pod_container()], GetOutput::Wide, NOW);
        let mut lines = table.lines();
        let header: Vec<&str> = lines.next().expect("header").split_whitespace().collect();
        assert_eq!(
            header,
            [
                "ID",
                "RUNTIME",
                "NAMESPACE/POD",
                "CONTAINER",
                "PID",
                "AGE",
                "SOURCE",
                "STATUS",
                "KIND",
                "WORKLOAD",
                "CGROUP-ID",
                "IMAGE",
                "BUNDLE"
            ]
        );
        let row: Vec<&str> = lines.next().expect("row").split_whitespace().collect();
        assert_eq!(
            row[7..],
            [
                "running",
                "-",
                "-",
                "-",
                "registry.example/api:1.2",
                "/run/containerd/io.containerd.runtime.v2.task/k8s.io/0123"
            ]
        );
        assert_eq!(lines.next(), None);
    }

    /// [`pod_container`] once the pod watch and the kernel's reads
    /// resolved it.
    fn resolved_container() -> Container {
        let mut c = pod_container();
        c.cgroup_id = 7301;
        c.kind = "init".into();
        c.image_digest = "registry.example/api@sha256:9b2e".into();
        if let Some(k) = c.kubernetes.as_mut() {
            k.workload = Some(Workload {
                kind: "Deployment".into(),
                name: "api".into(),
                namespace: "payments".into(),
                api_version: "apps/v1".into(),
                uid: "9f3a".into(),
            });
        }
        c.namespaces = Some(Namespaces {
            mnt: 1,
            pid: 2,
            net: 3,
            user: 4,
            uts: 5,
            ipc: 6,
            cgroup: 7,
            time: 8,
        });
        c.id_maps = Some(IdMaps {
            uid: vec![IdMapping {
                container_id: 0,
                host_id: 100_000,
                size: 65_536,
            }],
            gid: vec![],
        });
        c.unresolved
            .insert("kubernetes.image".into(), "not in the pod's spec".into());
        c
    }

    #[test]
    fn the_kind_workload_cgroup_id_and_digest_show_where_identity_does() {
        let c = resolved_container();
        let row = render_get(1, std::slice::from_ref(&c), GetOutput::Wide, NOW);
        let row: Vec<&str> = row
            .lines()
            .nth(1)
            .expect("row")
            .split_whitespace()
            .collect();
        assert_eq!(row[8..11], ["init", "Deployment/payments/api", "7301"]);
        let added = Event::Added {
            revision: 5,
            container: c.clone(),
            monotonic_ns: 1,
        };
        assert_eq!(
            render_event(&added, WatchOutput::Text),
            "5 ADDED 0123456789abcdef0123 runc payments/api-7d9f 4242 kind=init \
             workload=Deployment/payments/api cgroup_id=7301 \
             digest=registry.example/api@sha256:9b2e\n"
        );
        let json = container_json(&c);
        assert_eq!(json["cgroup_id"], 7301);
        assert_eq!(json["kind"], "init");
        assert_eq!(json["image_digest"], "registry.example/api@sha256:9b2e");
        assert_eq!(json["kubernetes"]["workload"]["name"], "api");
        assert_eq!(json["kubernetes"]["workload"]["uid"], "9f3a");
        assert_eq!(json["namespaces"]["time"], 8);
        assert_eq!(json["namespaces"]["user"], 4);
        assert_eq!(json["id_maps"]["uid"][0]["host_id"], 100_000);
        assert_eq!(json["id_maps"]["gid"], serde_json::json!([]));
        assert_eq!(
            json["unresolved"]["kubernetes.image"],
            "not in the pod's spec"
        );
        // Not known: the wire's zero values, as for every other field.
        let json = container_json(&bare_container());
        assert_eq!(json["cgroup_id"], 0);
        assert_eq!(json["kind"], "");
        assert_eq!(json["id_maps"], Value::Null);
        assert_eq!(json["unresolved"], serde_json::json!({}));
    }

    /// The filter flags, as the commands flatten them.
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        filter: FilterArgs,
    }

    fn flags(args: &[&str]) -> Result<FilterArgs, clap::Error> {
        let argv = std::iter::once("lookout").chain(args.iter().copied());
        <Flags as clap::Parser>::try_parse_from(argv).map(|f| f.filter)
    }

    #[test]
    fn filter_flags_repeat_and_become_the_proto_filter() {
        let f = flags(&[
            "--runtime",
            "runc",
            "--runtime",
            "crun",
            "--namespace",
            "shop",
            "--pod-label",
            "app=api",
            "--annotation",
            "a=b=c",
            "--workload",
            "Deployment/shop/api",
            "--workload",
            "CronJob/shop/nightly",
            "--cgroup-id",
            "7301",
            "--cgroup-id",
            "7302",
            "--image-digest",
            "sha256:9b2e",
        ])
        .expect("valid flags");
        let proto = f.to_filter().into_proto();
        assert_eq!(proto.runtimes, ["runc", "crun"]);
        assert_eq!(proto.namespaces, ["shop"]);
        assert_eq!(proto.pod_labels.get("app").map(String::as_str), Some("api"));
        assert_eq!(proto.annotations.get("a").map(String::as_str), Some("b=c"));
        assert_eq!(
            proto.workloads,
            ["Deployment/shop/api", "CronJob/shop/nightly"]
        );
        assert_eq!(proto.cgroup_ids, [7301, 7302]);
        assert_eq!(proto.image_digests, ["sha256:9b2e"]);
        assert_eq!(
            flags(&[]).expect("no flags").to_filter(),
            Filter::all(),
            "no flag: every container"
        );
    }

    #[test]
    fn malformed_filter_flags_are_refused() {
        for args in [
            &["--workload", "Deployment/api"][..],
            &["--workload", "Deployment/shop/api/x"],
            &["--workload", "Deployment//api"],
            &["--cgroup-id", "-1"],
            &["--cgroup-id", "0x1c85"],
            &["--pod-label", "app"],
            &["--annotation", "=v"],
        ] {
            assert!(flags(args).is_err(), "{args:?} accepted");
        }
    }

    #[test]
    fn an_empty_node_is_a_header() {
        let table = render_get(0, &[], GetOutput::Table, NOW);
        assert_eq!(
            table,
            "ID   RUNTIME   NAMESPACE/POD   CONTAINER   PID   AGE   SOURCE\n"
        );
    }

    #[test]
    fn control_characters_cannot_break_the_table() {
        let mut c = bare_container();
        c.runtime = "evil\n\u{1b}[2J".into();
        let table = render_table(&[c], NOW, false);
        assert_eq!(table.lines().count(), 2, "{table}");
        assert!(table.contains("evil\\n\\u{1b}[2J"), "{table}");
    }

    #[test]
    fn json_lists_the_revision_and_every_field() {
        let mut c = pod_container();
        c.annotations.insert("b".into(), "2".into());
        c.annotations.insert("a".into(), "1".into());
        c.namespaces = Some(Namespaces {
            mnt: 4026531841,
            ..Default::default()
        });
        let text = render_get(9, &[c, bare_container()], GetOutput::Json, NOW);
        let value: Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(value["revision"], 9);
        let first = &value["containers"][0];
        assert_eq!(first["id"], "0123456789abcdef0123");
        assert_eq!(first["kubernetes"]["pod"], "api-7d9f");
        assert_eq!(first["namespaces"]["mnt"], 4026531841_u64);
        assert_eq!(first["added_unix_ms"], NOW - 5_000);
        // Sorted, so the output is stable.
        assert!(
            text.find("\"a\": \"1\"") < text.find("\"b\": \"2\""),
            "{text}"
        );
        let second = &value["containers"][1];
        assert_eq!(second["kubernetes"], Value::Null);
        assert_eq!(second["namespaces"], Value::Null);
    }

    #[test]
    fn watch_text_has_one_line_per_container() {
        let snapshot = Event::Snapshot {
            revision: 4,
            containers: vec![pod_container(), bare_container()],
        };
        assert_eq!(
            render_event(&snapshot, WatchOutput::Text),
            "4 SNAPSHOT 0123456789abcdef0123 runc payments/api-7d9f 4242\n\
             4 SNAPSHOT feed crun - -\n\
             4 SNAPSHOT_END 2\n"
        );
        let added = Event::Added {
            revision: 5,
            container: pod_container(),
            monotonic_ns: 1,
        };
        assert_eq!(
            render_event(&added, WatchOutput::Text),
            "5 ADDED 0123456789abcdef0123 runc payments/api-7d9f 4242\n"
        );
        let removed = Event::Removed {
            revision: 6,
            container: bare_container(),
            exit_code: Some(1),
            reason: "denied by gate tracer: \"no\"".into(),
            monotonic_ns: 2,
        };
        assert_eq!(
            render_event(&removed, WatchOutput::Text),
            "6 REMOVED feed crun - - exit=1 reason=\"denied by gate tracer: \\\"no\\\"\"\n"
        );
    }

    #[test]
    fn watch_json_is_one_object_per_line() {
        let removed = Event::Removed {
            revision: 6,
            container: bare_container(),
            exit_code: None,
            reason: String::new(),
            monotonic_ns: 2,
        };
        let line = render_event(&removed, WatchOutput::Json);
        assert_eq!(line.matches('\n').count(), 1);
        let value: Value = serde_json::from_str(&line).expect("valid JSON");
        assert_eq!(value["kind"], "REMOVED");
        assert_eq!(value["revision"], 6);
        assert_eq!(value["exit_code"], Value::Null);
        assert_eq!(value["container"]["id"], "feed");

        let snapshot = Event::Snapshot {
            revision: 4,
            containers: vec![bare_container()],
        };
        let line = render_event(&snapshot, WatchOutput::Json);
        assert_eq!(line.matches('\n').count(), 1);
        let value: Value = serde_json::from_str(&line).expect("valid JSON");
        assert_eq!(value["kind"], "SNAPSHOT");
        assert_eq!(value["containers"][0]["runtime"], "crun");
    }

    #[test]
    fn dockers_name_image_and_labels_show_in_updates_and_tables() {
        let mut c = bare_container();
        c.name = "web1".into();
        c.image = "localhost/bb:1".into();
        c.labels.insert("app".into(), "shop".into());
        let updated = Event::Updated {
            revision: 7,
            container: c.clone(),
            monotonic_ns: 3,
        };
        assert_eq!(
            render_event(&updated, WatchOutput::Text),
            "7 UPDATED feed crun - - name=web1 image=localhost/bb:1\n"
        );
        let value: Value =
            serde_json::from_str(&render_event(&updated, WatchOutput::Json)).expect("valid JSON");
        assert_eq!(value["kind"], "UPDATED");
        assert_eq!(value["container"]["name"], "web1");
        assert_eq!(value["container"]["labels"]["app"], "shop");
        // Without a pod, the CONTAINER and IMAGE columns are the engine's.
        let table = render_get(7, &[c], GetOutput::Wide, NOW);
        let row: Vec<&str> = table
            .lines()
            .nth(1)
            .expect("row")
            .split_whitespace()
            .collect();
        assert!(
            row.contains(&"web1") && row.contains(&"localhost/bb:1"),
            "{row:?}"
        );
    }
}
