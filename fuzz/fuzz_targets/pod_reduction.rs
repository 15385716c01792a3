//! The informer's reduction of Pods (from the API server: another party)
//! to container changes: any sequence of adds, updates, deletes and
//! relists keeps "added minus removed" equal to what the tracker says is
//! live, and never reports an id that is not a container id. Every added
//! container has the kind of the status list it came from, an image
//! digest or id only of the shapes `parse_image_id` promises, and a pod's
//! controller reference is followed only when its name is safe in a URL
//! path.
//!
//! Input: a first byte, then (even) a Pod as JSON, applied, applied
//! again, then deleted; or (odd) a structured sequence of operations.
#![no_main]

use std::collections::HashMap;

use arbitrary::{Arbitrary, Unstructured};
use k8s_openapi::api::core::v1::Pod;
use libfuzzer_sys::fuzz_target;
use lookout_informer::{Change, Tracker};
use lookout_model::{Container, ContainerKind};

#[derive(Arbitrary, Debug, Clone)]
enum State {
    Running,
    Terminated(i32),
    Waiting,
    None,
}

#[derive(Arbitrary, Debug, Clone)]
enum ImageId {
    Digest(bool),
    Pullable,
    Bare(bool),
    Empty,
    Raw(String),
}

#[derive(Arbitrary, Debug, Clone)]
struct Owner {
    controller: Option<bool>,
    /// A known kind, or any string.
    kind: Result<u8, String>,
    /// A name from a small set, or any string.
    name: Result<u8, String>,
    api_version: Result<u8, String>,
    uid: Result<u8, String>,
}

#[derive(Arbitrary, Debug, Clone)]
struct Status {
    name: u8,
    image_id: ImageId,
    /// An id from a small set (so that pods collide), or any string.
    id: Result<u8, String>,
    scheme: u8,
    state: State,
    last: Option<(i32, Option<u8>)>,
}

#[derive(Arbitrary, Debug, Clone)]
struct PodSpec {
    ns: u8,
    name: u8,
    uid: Option<u8>,
    init: Vec<Status>,
    main: Vec<Status>,
    ephemeral: Vec<Status>,
    labels: Vec<(String, String)>,
    owners: Vec<Owner>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Apply(PodSpec),
    Delete(PodSpec),
    Init,
    InitDone,
    Raw(Vec<u8>),
    DeleteRaw(Vec<u8>),
}

fn id_of(n: u8) -> String {
    format!("{:064x}", u64::from(n % 8))
}

const HEX: &str = "4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d";

fn image_id(i: &ImageId) -> String {
    match i {
        ImageId::Digest(good) => format!("nginx@sha256:{}", if *good { HEX } else { "12" }),
        ImageId::Pullable => format!("docker-pullable://nginx@sha256:{HEX}"),
        ImageId::Bare(docker) => {
            format!("{}sha256:{HEX}", if *docker { "docker://" } else { "" })
        }
        ImageId::Empty => String::new(),
        ImageId::Raw(s) => s.clone(),
    }
}

fn owner(o: &Owner) -> serde_json::Value {
    let pick = |r: &Result<u8, String>, set: &[&str]| match r {
        Ok(n) => set[usize::from(*n) % set.len()].to_owned(),
        Err(s) => s.clone(),
    };
    serde_json::json!({
        "apiVersion": pick(&o.api_version, &["apps/v1", "batch/v1", "v1", "argoproj.io/v1alpha1"]),
        "kind": pick(&o.kind, &["ReplicaSet", "Job", "StatefulSet", "DaemonSet"]),
        "name": pick(&o.name, &["web-7d9", "../../api/v1/secrets", "a/b", "", "x"]),
        "uid": pick(&o.uid, &["u-1", "", "u 1"]),
        "controller": o.controller,
    })
}

fn spec_of(list: &[Status]) -> Vec<serde_json::Value> {
    list.iter()
        .map(|s| serde_json::json!({"name": format!("c{}", s.name % 4), "image": "busybox"}))
        .collect()
}

fn status(s: &Status) -> serde_json::Value {
    let scheme = ["containerd", "cri-o", "docker", "bogus", ""][usize::from(s.scheme % 5)];
    let id = match &s.id {
        Ok(n) => format!("{scheme}://{}", id_of(*n)),
        Err(raw) => raw.clone(),
    };
    let state = match s.state {
        State::Running => serde_json::json!({"running": {}}),
        State::Terminated(code) => serde_json::json!({"terminated": {"exitCode": code}}),
        State::Waiting => serde_json::json!({"waiting": {}}),
        State::None => serde_json::json!({}),
    };
    let last = s.last.map(|(code, other)| {
        serde_json::json!({"terminated": {
            "exitCode": code,
            "containerID": other.map(|n| format!("containerd://{}", id_of(n))),
        }})
    });
    serde_json::json!({
        "name": format!("c{}", s.name % 4),
        "containerID": id,
        "image": "busybox",
        "imageID": image_id(&s.image_id),
        "ready": false,
        "restartCount": 0,
        "state": state,
        "lastState": last,
    })
}

fn pod(p: &PodSpec) -> Option<Pod> {
    let v = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "namespace": format!("ns{}", p.ns % 3),
            "name": format!("p{}", p.name % 4),
            "uid": p.uid.map(|u| format!("uid-{}", u % 4)),
            "labels": p.labels.iter().cloned().collect::<HashMap<_, _>>(),
            "ownerReferences": p.owners.iter().map(owner).collect::<Vec<_>>(),
        },
        "spec": {
            "initContainers": spec_of(&p.init),
            "containers": spec_of(&p.main),
            "ephemeralContainers": spec_of(&p.ephemeral),
        },
        "status": {
            "initContainerStatuses": p.init.iter().map(status).collect::<Vec<_>>(),
            "containerStatuses": p.main.iter().map(status).collect::<Vec<_>>(),
            "ephemeralContainerStatuses": p.ephemeral.iter().map(status).collect::<Vec<_>>(),
        },
    });
    serde_json::from_value(v).ok()
}

/// What the reduction promises of one pod, whatever it holds.
fn check_pod(p: &Pod) {
    if let Ok(Some([api_version, kind, name, uid])) = lookout_informer::fuzzing::controller(p) {
        // The name goes into a URL path.
        assert!(!name.is_empty() && name.len() <= 253, "{name:?}");
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'),
            "{name:?}"
        );
        assert!(name != "." && name != "..", "{name:?}");
        assert!(!kind.is_empty() && kind.len() <= 63, "{kind:?}");
        assert!(api_version.len() <= 317 && api_version.matches('/').count() <= 1);
        assert!(!uid.is_empty() && uid.len() <= 128);
    }
    let kinds = lookout_informer::fuzzing::kinds(p);
    assert!(kinds.iter().all(|(_, k)| *k != ContainerKind::Sandbox));
}

/// What an added container from the informer carries.
fn check_added(p: &Pod, c: &Container) {
    let name = c.kubernetes.as_ref().and_then(|k| k.container.as_deref());
    let s = p.status.as_ref();
    let listed = |l: Option<&Vec<k8s_openapi::api::core::v1::ContainerStatus>>| {
        l.into_iter().flatten().any(|st| {
            Some(st.name.as_str()) == name
                && st
                    .container_id
                    .as_deref()
                    .is_some_and(|i| i.ends_with(c.id.as_str()))
        })
    };
    let possible = [
        (
            ContainerKind::Init,
            listed(s.and_then(|s| s.init_container_statuses.as_ref())),
        ),
        (
            ContainerKind::Regular,
            listed(s.and_then(|s| s.container_statuses.as_ref())),
        ),
        (
            ContainerKind::Ephemeral,
            listed(s.and_then(|s| s.ephemeral_container_statuses.as_ref())),
        ),
    ];
    let kind = c.kind.expect("every added container has a kind");
    assert!(
        possible.iter().any(|(k, yes)| *k == kind && *yes),
        "{kind:?} from none of the lists it could come from"
    );
    if let Some(d) = &c.image_digest {
        assert!(
            d.len() <= 1024 && d.contains("@sha256:") && !d.contains("://"),
            "{d:?}"
        );
        assert!(c.image_id.is_none());
    }
    if let Some(i) = &c.image_id {
        assert!(i.starts_with("sha256:") && i.len() == 71, "{i:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let ops = if mode % 2 == 0 {
        vec![
            Op::Raw(rest.to_vec()),
            Op::Raw(rest.to_vec()),
            Op::DeleteRaw(rest.to_vec()),
        ]
    } else {
        match Vec::<Op>::arbitrary_take_rest(Unstructured::new(rest)) {
            Ok(ops) => ops,
            Err(_) => return,
        }
    };
    let mut t = Tracker::new();
    let mut live: HashMap<String, i64> = HashMap::new();
    let mut out = Vec::new();
    // Deserialising a Pod costs ~100 us under ASan: a few dozen
    // operations per input keep the target fast enough to explore.
    for op in ops.iter().take(24) {
        out.clear();
        match op {
            Op::Apply(p) => {
                if let Some(p) = pod(p) {
                    check_pod(&p);
                    t.apply(&p, &mut out);
                    for c in &out {
                        if let Change::Added(c) = c {
                            check_added(&p, c);
                        }
                    }
                }
            }
            Op::Delete(p) => {
                if let Some(p) = pod(p) {
                    t.delete(&p, &mut out);
                }
            }
            Op::Init => t.init(),
            Op::InitDone => t.init_done(&mut out),
            Op::Raw(b) => {
                if let Ok(p) = serde_json::from_slice::<Pod>(b) {
                    check_pod(&p);
                    t.apply(&p, &mut out);
                    for c in &out {
                        if let Change::Added(c) = c {
                            check_added(&p, c);
                        }
                    }
                }
            }
            Op::DeleteRaw(b) => {
                if let Ok(p) = serde_json::from_slice::<Pod>(b) {
                    t.delete(&p, &mut out);
                }
            }
        }
        for c in &out {
            let (id, d) = match c {
                Change::Added(c) => (&c.id, 1),
                Change::Removed(c, _) => (&c.id, -1),
            };
            assert!(lookout_model::valid_container_id(id), "{id:?}");
            *live.entry(id.clone()).or_default() += d;
        }
        live.retain(|_, n| *n != 0);
        let mut now: HashMap<String, i64> = HashMap::new();
        for c in t.live() {
            *now.entry(c.id.clone()).or_default() += 1;
        }
        assert_eq!(live, now, "added minus removed is what is live");
    }
});
