//! The informer's reduction of Pods (from the API server: another party)
//! to container changes: any sequence of adds, updates, deletes and
//! relists keeps "added minus removed" equal to what the tracker says is
//! live, and never reports an id that is not a container id.
//!
//! Input: a first byte, then (even) a Pod as JSON, applied, applied
//! again, then deleted; or (odd) a structured sequence of operations.
#![no_main]

use std::collections::HashMap;

use arbitrary::{Arbitrary, Unstructured};
use k8s_openapi::api::core::v1::Pod;
use libfuzzer_sys::fuzz_target;
use lookout_informer::{Change, Tracker};

#[derive(Arbitrary, Debug, Clone)]
enum State {
    Running,
    Terminated(i32),
    Waiting,
    None,
}

#[derive(Arbitrary, Debug, Clone)]
struct Status {
    name: u8,
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
    labels: Vec<(String, String)>,
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
        "imageID": "",
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
        },
        "status": {
            "initContainerStatuses": p.init.iter().map(status).collect::<Vec<_>>(),
            "containerStatuses": p.main.iter().map(status).collect::<Vec<_>>(),
        },
    });
    serde_json::from_value(v).ok()
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
                    t.apply(&p, &mut out);
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
                    t.apply(&p, &mut out);
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
