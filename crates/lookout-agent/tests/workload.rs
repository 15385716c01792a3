//! What consumers act on at `added` (#55), end to end: `lookout run` with
//! the runtime hook and the fallback Pod informer against the test API
//! server, and a real runc container carrying the CRI annotations
//! containerd sets. As root (skipped loudly otherwise, never in CI).

use std::time::Duration;

use lookout_testsupport::apiserver::{ApiServer, ObjectJson, PodJson};
use lookout_testsupport::bundle;
use serde_json::json;

mod common;
use common::*;

const DIGEST: &str = "4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d";

#[test]
fn a_hooked_cri_container_has_its_workload_and_kind_at_added_and_its_digest_as_updated() {
    if !ready("workload_at_added") {
        return;
    }
    let rt = Runtime::runc();
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = server.kubeconfig(dir.path());
    let runc_id = id("workload");
    server.put_object(ObjectJson::new("apps/v1", "Deployment", "shop", "web", "uid-d").json());
    server.put_object(
        ObjectJson::new("apps/v1", "ReplicaSet", "shop", "web-7d9", "uid-rs")
            .controlled_by("apps/v1", "Deployment", "web", "uid-d")
            .json(),
    );
    // The pod as the kubelet reports it while its container is created:
    // in the spec, not in any status yet.
    let pod = |running: bool| {
        let p = PodJson::new("shop", "web-7d9-x", "uid-web", "node-a").controlled_by(
            "apps/v1",
            "ReplicaSet",
            "web-7d9",
            "uid-rs",
        );
        let p = if running {
            p.running("nginx", "nginx:1.27", "containerd", &runc_id)
        } else {
            p
        };
        let mut v = p.json();
        v["spec"]["containers"] = json!([{ "name": "nginx", "image": "nginx:1.27" }]);
        v
    };
    server.apply(pod(false));
    let agent = Agent::start_with(
        Some(&rt),
        &[],
        &[
            ("NODE_NAME", "node-a"),
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
        ],
        None,
    );
    agent.wait_log("pod informer synced", Duration::from_secs(15));
    let b = bundle::busybox(&dir.path().join("b"), &["sleep", "30"], |c| {
        c["annotations"] = json!({
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-namespace": "shop",
            "io.kubernetes.cri.sandbox-name": "web-7d9-x",
            "io.kubernetes.cri.sandbox-uid": "uid-web",
            "io.kubernetes.cri.container-name": "nginx",
        });
    });
    rt.ok(&[
        "run",
        "-d",
        "--bundle",
        b.to_str().expect("utf-8"),
        &runc_id,
    ]);
    let added = agent.wait_event(&runc_id, "added", Duration::from_secs(10));
    assert_eq!(added["source"], "runtime-hook");
    let c = &added["container"];
    assert_eq!(
        c["kubernetes"]["workload"],
        json!({
            "kind": "Deployment", "name": "web", "namespace": "shop",
            "api_version": "apps/v1", "uid": "uid-d",
        }),
        "{added}"
    );
    assert_eq!(c["kind"], "regular", "{added}");
    assert!(
        c["image_digest"].is_null(),
        "no status names it yet: {added}"
    );
    assert!(
        c.get("unresolved")
            .is_none_or(|u| u.get("kubernetes.workload").is_none())
    );

    // The kubelet reports it running: the informer's digest arrives as an
    // `updated` of the hook's record.
    server.apply(pod(true));
    let updated = agent.wait_event(&runc_id, "updated", Duration::from_secs(10));
    assert_eq!(updated["source"], "informer");
    let u = &updated["container"];
    assert_eq!(
        u["image_digest"],
        format!("nginx:1.27@sha256:{DIGEST}"),
        "{updated}"
    );
    assert_eq!(u["pid"], c["pid"], "the hook's record, filled: {updated}");
    assert_eq!(u["kubernetes"]["workload"]["kind"], "Deployment");
    rt.cleanup(&runc_id);
    agent.wait_event(&runc_id, "removed", Duration::from_secs(10));
    let ev = agent.events_for(&runc_id);
    let n = |k: &str| ev.iter().filter(|e| e["event"] == k).count();
    assert_eq!(
        (n("added"), n("updated"), n("removed")),
        (1, 1, 1),
        "{ev:?}"
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{status:?}\n{log}");
}
