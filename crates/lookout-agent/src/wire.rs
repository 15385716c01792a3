//! The consumer API's wire forms (`lookout.v1`) of the hub's model, and
//! back: containers, changes, snapshots, filters and policies. Written
//! once here for the server (`grpc`), the encoded `Watch` (`watch_wire`)
//! and the standby's mirror of its predecessor (`handover`).

use std::path::PathBuf;
use std::sync::Arc;

use lookout_api::v1 as pb;
use lookout_api::v1::watch_event::Kind;
use lookout_model::{
    Container, ContainerKind, EventKind, IdMapping, IdMaps, Kubernetes, Namespaces, RuntimeKind,
    Source, Status, Workload,
};

use crate::hub::{Change, FailurePolicy, Filter, Live};

/// The message with which a shutting-down agent ends every `Watch`
/// (`UNAVAILABLE`): a standby that reads it has every change its
/// predecessor made.
pub const CLOSING: &str = "the agent is shutting down";

/// Entries at most in each of a filter's lists and maps: a filter is
/// matched against every event while the hub's table is locked, so its
/// size is the consumer's to keep small.
pub const MAX_FILTER_ENTRIES: usize = 64;

/// Bytes at most in one string of a filter (a Kubernetes label value is
/// at most 63, an annotation key 317).
pub const MAX_FILTER_STRING: usize = 1024;

/// A consumer's filter in the hub's form: refused (`INVALID_ARGUMENT`)
/// past [`MAX_FILTER_ENTRIES`] or [`MAX_FILTER_STRING`], its pairs sorted.
/// No filter matches everything.
pub(crate) fn filter_of(f: Option<pb::Filter>) -> Result<Filter, tonic::Status> {
    let f = f.unwrap_or_default();
    for (what, n) in [
        ("runtimes", f.runtimes.len()),
        ("namespaces", f.namespaces.len()),
        ("pod_labels", f.pod_labels.len()),
        ("annotations", f.annotations.len()),
        ("workloads", f.workloads.len()),
        ("cgroup_ids", f.cgroup_ids.len()),
        ("image_digests", f.image_digests.len()),
    ] {
        if n > MAX_FILTER_ENTRIES {
            return Err(tonic::Status::invalid_argument(format!(
                "filter.{what} has {n} entries; at most {MAX_FILTER_ENTRIES}"
            )));
        }
    }
    let long = f
        .runtimes
        .iter()
        .chain(&f.namespaces)
        .chain(f.pod_labels.iter().flat_map(|(k, v)| [k, v]))
        .chain(f.annotations.iter().flat_map(|(k, v)| [k, v]))
        .chain(&f.workloads)
        .chain(&f.image_digests)
        .any(|s| s.len() > MAX_FILTER_STRING);
    if long {
        return Err(tonic::Status::invalid_argument(format!(
            "a filter string is longer than {MAX_FILTER_STRING} bytes"
        )));
    }
    let mut pod_labels: Vec<(String, String)> = f.pod_labels.into_iter().collect();
    pod_labels.sort();
    let mut annotations: Vec<(String, String)> = f.annotations.into_iter().collect();
    annotations.sort();
    Ok(Filter {
        runtimes: f.runtimes,
        namespaces: f.namespaces,
        pod_labels,
        annotations,
        workloads: f.workloads,
        cgroup_ids: f.cgroup_ids,
        image_digests: f.image_digests,
    })
}

/// The wire form of a container.
pub(crate) fn container_pb(l: &Live) -> pb::Container {
    let c = &l.container;
    let ns = &c.namespaces;
    pb::Container {
        id: c.id.clone(),
        runtime: c.runtime.to_string(),
        pid: c.pid.unwrap_or(0),
        status: format!("{:?}", c.status).to_lowercase(),
        bundle: c
            .bundle
            .as_ref()
            .map(|b| b.to_string_lossy().into_owned())
            .unwrap_or_default(),
        cgroup: c.cgroup.clone().unwrap_or_default(),
        sandbox: c.sandbox.clone().unwrap_or_default(),
        pod_sandbox: c.pod_sandbox,
        name: c.name.clone().unwrap_or_default(),
        image: c.image.clone().unwrap_or_default(),
        image_id: c.image_id.clone().unwrap_or_default(),
        labels: c.labels.clone().into_iter().collect(),
        annotations: c.annotations.clone().into_iter().collect(),
        args: c.args.clone(),
        kubernetes: c.kubernetes.as_ref().map(|k| pb::Kubernetes {
            namespace: k.namespace.clone().unwrap_or_default(),
            pod: k.pod.clone().unwrap_or_default(),
            pod_uid: k.pod_uid.clone().unwrap_or_default(),
            container: k.container.clone().unwrap_or_default(),
            image: k.image.clone().unwrap_or_default(),
            labels: k.labels.clone().into_iter().collect(),
            workload: k.workload.as_ref().map(|w| pb::Workload {
                kind: w.kind.clone(),
                name: w.name.clone(),
                namespace: w.namespace.clone(),
                api_version: w.api_version.clone(),
                uid: w.uid.clone().unwrap_or_default(),
            }),
        }),
        source: l.source.to_string(),
        added_monotonic_ns: l.added_monotonic_ns,
        added_unix_ms: l.added_unix_ms,
        namespaces: Some(pb::Namespaces {
            mnt: ns.mnt.unwrap_or(0),
            pid: ns.pid.unwrap_or(0),
            net: ns.net.unwrap_or(0),
            user: ns.user.unwrap_or(0),
            uts: ns.uts.unwrap_or(0),
            ipc: ns.ipc.unwrap_or(0),
            cgroup: ns.cgroup.unwrap_or(0),
            time: ns.time.unwrap_or(0),
        }),
        image_digest: c.image_digest.clone().unwrap_or_default(),
        cgroup_id: c.cgroup_id.unwrap_or(0),
        id_maps: c.id_maps.as_ref().map(|m| {
            let lines = |map: &[IdMapping]| {
                map.iter()
                    .map(|l| pb::IdMapping {
                        container_id: l.container_id,
                        host_id: l.host_id,
                        size: l.size,
                    })
                    .collect()
            };
            pb::IdMaps {
                uid: lines(&m.uid),
                gid: lines(&m.gid),
            }
        }),
        kind: c.kind.map(|k| k.as_str().to_owned()).unwrap_or_default(),
        unresolved: c.unresolved.clone().into_iter().collect(),
    }
}

/// The wire form of a change.
pub(crate) fn change_pb(c: &Change) -> pb::WatchEvent {
    pb::WatchEvent {
        kind: match c.kind {
            EventKind::Added => Kind::Added,
            EventKind::Removed => Kind::Removed,
            EventKind::Updated => Kind::Updated,
        } as i32,
        revision: c.revision,
        container: Some(container_pb(&c.live)),
        exit_code: c.exit_code,
        reason: c.reason.clone().unwrap_or_default(),
        monotonic_ns: c.monotonic_ns,
    }
}

/// One container of a snapshot taken at `revision`.
pub(crate) fn snapshot_pb(revision: u64, l: &Live) -> pb::WatchEvent {
    pb::WatchEvent {
        kind: Kind::Snapshot as i32,
        revision,
        container: Some(container_pb(l)),
        ..Default::default()
    }
}

/// The end of a snapshot taken at `revision`: changes follow.
pub(crate) fn snapshot_end_pb(revision: u64) -> pb::WatchEvent {
    pb::WatchEvent {
        kind: Kind::SnapshotEnd as i32,
        revision,
        monotonic_ns: lookout_model::monotonic_ns(),
        ..Default::default()
    }
}

/// A change as the wire carries it, back in the hub's form (`None` for a
/// snapshot's events, kinds this agent does not know, and a change
/// without its container).
pub(crate) fn change_of(e: pb::WatchEvent) -> Option<Change> {
    let kind = match Kind::try_from(e.kind).ok()? {
        Kind::Added => EventKind::Added,
        Kind::Updated => EventKind::Updated,
        Kind::Removed => EventKind::Removed,
        _ => return None,
    };
    Some(Change {
        revision: e.revision,
        kind,
        live: live_of(e.container?),
        exit_code: e.exit_code,
        reason: Some(e.reason).filter(|r| !r.is_empty()),
        monotonic_ns: e.monotonic_ns,
        // The record it replaced is the sending hub's to keep, for its
        // watchers' snapshots; the mirroring hub has no watchers.
        superseded: None,
    })
}

/// A gate subscription's failure policy in the hub's form.
pub(crate) fn failure_policy_of(p: i32) -> Result<FailurePolicy, tonic::Status> {
    match pb::FailurePolicy::try_from(p) {
        Ok(pb::FailurePolicy::FailClosed) => Ok(FailurePolicy::Closed),
        Ok(pb::FailurePolicy::FailOpen) => Ok(FailurePolicy::Open),
        Err(_) => Err(tonic::Status::invalid_argument("unknown on_failure policy")),
    }
}

/// A container as the wire carries it, back in the agent's form.
pub(crate) fn live_of(c: pb::Container) -> Live {
    let mut m = Container::new(c.id, RuntimeKind::from_binary_name(&c.runtime));
    m.pid = Some(c.pid).filter(|p| *p != 0);
    m.status = match c.status.as_str() {
        "created" => Status::Created,
        "running" => Status::Running,
        "stopped" => Status::Stopped,
        _ => Status::Running,
    };
    m.bundle = Some(PathBuf::from(c.bundle)).filter(|b| !b.as_os_str().is_empty());
    m.cgroup = Some(c.cgroup).filter(|s| !s.is_empty());
    m.sandbox = Some(c.sandbox).filter(|s| !s.is_empty());
    m.pod_sandbox = c.pod_sandbox;
    m.annotations = c.annotations.into_iter().collect();
    m.args = c.args;
    m.name = Some(c.name).filter(|s| !s.is_empty());
    m.image = Some(c.image).filter(|s| !s.is_empty());
    m.image_id = Some(c.image_id).filter(|s| !s.is_empty());
    m.labels = c.labels.into_iter().collect();
    m.kubernetes = c.kubernetes.map(|k| {
        let mut out = Kubernetes::default();
        let some = |s: String| Some(s).filter(|s| !s.is_empty());
        out.namespace = some(k.namespace);
        out.pod = some(k.pod);
        out.pod_uid = some(k.pod_uid);
        out.container = some(k.container);
        out.image = some(k.image);
        out.labels = k.labels.into_iter().collect();
        out.workload = k.workload.map(|w| {
            let mut out = Workload::default();
            out.kind = w.kind;
            out.name = w.name;
            out.namespace = w.namespace;
            out.api_version = w.api_version;
            out.uid = some(w.uid);
            out
        });
        out
    });
    if let Some(ns) = c.namespaces {
        let known = |x: u64| Some(x).filter(|x| *x != 0);
        let mut n = Namespaces::default();
        n.mnt = known(ns.mnt);
        n.pid = known(ns.pid);
        n.net = known(ns.net);
        n.user = known(ns.user);
        n.uts = known(ns.uts);
        n.ipc = known(ns.ipc);
        n.cgroup = known(ns.cgroup);
        n.time = known(ns.time);
        m.namespaces = n;
    }
    m.image_digest = Some(c.image_digest).filter(|s| !s.is_empty());
    m.cgroup_id = Some(c.cgroup_id).filter(|x| *x != 0);
    m.id_maps = c.id_maps.map(|maps| {
        let lines = |map: Vec<pb::IdMapping>| {
            map.into_iter()
                .map(|l| IdMapping::new(l.container_id, l.host_id, l.size))
                .collect()
        };
        let mut out = IdMaps::default();
        out.uid = lines(maps.uid);
        out.gid = lines(maps.gid);
        out
    });
    m.kind = kind_of(&c.kind);
    m.unresolved = c.unresolved.into_iter().collect();
    Live {
        container: Arc::new(m),
        source: source_of(&c.source),
        added_monotonic_ns: c.added_monotonic_ns,
        added_unix_ms: c.added_unix_ms,
    }
}

fn kind_of(s: &str) -> Option<ContainerKind> {
    [
        ContainerKind::Regular,
        ContainerKind::Init,
        ContainerKind::Ephemeral,
        ContainerKind::Sandbox,
    ]
    .into_iter()
    .find(|k| k.as_str() == s)
}

fn source_of(s: &str) -> Source {
    [
        Source::RuntimeHook,
        Source::StateScan,
        Source::Informer,
        Source::Nri,
        Source::NriSync,
        Source::Docker,
    ]
    .into_iter()
    .find(|x| x.to_string() == s)
    .unwrap_or(Source::StateScan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_too_large_to_match_cheaply_is_refused() {
        let many = |n: usize| (0..n).map(|i| format!("ns{i}")).collect::<Vec<_>>();
        let ok = pb::Filter {
            namespaces: many(MAX_FILTER_ENTRIES),
            ..Default::default()
        };
        assert_eq!(
            filter_of(Some(ok)).expect("at the limit").namespaces.len(),
            MAX_FILTER_ENTRIES
        );
        let wide = pb::Filter {
            namespaces: many(MAX_FILTER_ENTRIES + 1),
            ..Default::default()
        };
        let e = filter_of(Some(wide)).expect_err("too many");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains("filter.namespaces has 65 entries"),
            "{e}"
        );
        let long = pb::Filter {
            pod_labels: [("app".to_string(), "x".repeat(MAX_FILTER_STRING + 1))].into(),
            ..Default::default()
        };
        let e = filter_of(Some(long)).expect_err("too long");
        assert!(e.message().contains("longer than"), "{e}");
        assert!(filter_of(None).is_ok(), "no filter: everything");
    }
}
