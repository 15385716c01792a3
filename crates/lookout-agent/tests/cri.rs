//! `lookout run` on a real CRI node: containerd 1.7's CRI plugin, driven
//! like a kubelet over gRPC (`lookout_testsupport::cri`), runs pods through
//! the node's own runc copy, which the agent watches in fanotify-ebpf mode.
//! Each test has its own node and agent, so tests run side by side.

use std::time::{Duration, Instant};

use lookout_testsupport::cri::api::ContainerState;
use lookout_testsupport::cri::{BUSYBOX_IMAGE, CriNode, PodSpec, require_cri};
use lookout_testsupport::require_program;
use serde_json::Value;

mod common;
use common::*;

/// An agent that watches only `node`'s runc (see `common::Runtime` for why
/// each test has its own runtime binary).
fn agent_for(node: &CriNode) -> Agent {
    let runc = node.runc().to_str().expect("utf-8 path");
    Agent::start_with(None, &["--runtime-path", runc], &[], None)
}

#[test]
fn a_pod_through_cri_is_reported_created_with_its_kubernetes_identity() {
    const TEST: &str = "cri_pod_identity";
    if !require_cri(TEST) || !require_program(TEST, "busybox") || !require_program(TEST, "gcc") {
        return;
    }
    // Each container's first command stamps CLOCK_MONOTONIC into /stamp,
    // a host directory, then sleeps.
    let stamps = tempfile::tempdir().expect("tempdir");
    lookout_testsupport::bundle::monotonic_stamp(stamps.path());
    let stamped = |name: &str| format!("/stamp/stamp /stamp/{name}.ns && exec sleep 300");
    let t = Instant::now();
    let node = CriNode::start().expect("start the CRI node");
    eprintln!(
        "containerd 1.7: sockets in {:?}, CRI ready with images in {:?} (total {:?})",
        node.started_in(),
        node.ready_in(),
        t.elapsed()
    );
    let agent = agent_for(&node);
    let mut kubelet = node.kubelet().expect("CRI client");
    let version = kubelet.version().expect("CRI Version");
    assert_eq!(version.runtime_name, "containerd");
    assert!(
        version.runtime_version.starts_with("1.7"),
        "{}",
        version.runtime_version
    );

    let spec = PodSpec::new("shop", &format!("cart-{}", std::process::id()))
        .label("app", "cart")
        .container("web", BUSYBOX_IMAGE, &["sh", "-c", &stamped("web")])
        .mount(stamps.path(), "/stamp", false)
        .container("sidecar", BUSYBOX_IMAGE, &["sh", "-c", &stamped("sidecar")])
        .mount(stamps.path(), "/stamp", false);
    // RunPodSandbox creates and starts the sandbox (pause) container;
    // CreateContainer only records the containers: containerd's CRI
    // creates their runc containers in StartContainer, where the agent
    // holds `runc create` until it has reported each.
    // (If the test fails, dropping the node removes what is left.)
    let mut pod = kubelet.create_pod(&spec).expect("create the pod");
    kubelet.start_pod(&mut pod).expect("start the containers");
    eprintln!(
        "RunPodSandbox {:?}; CreateContainer {:?}; StartContainer {:?}",
        pod.sandbox_took, pod.create_took, pod.start_took
    );
    for (c, id) in spec.containers.iter().zip(&pod.container_ids) {
        let added = agent.wait_event(id, "added", Duration::from_secs(10));
        assert_eq!(added["source"], "runtime-hook", "{added}");
        let k = &added["container"]["kubernetes"];
        assert_eq!(added["container"]["status"], "created", "{added}");
        assert_eq!(added["container"]["runtime"], "runc", "{added}");
        assert_eq!(k["namespace"], "shop", "{added}");
        assert_eq!(k["pod"], spec.name.as_str(), "{added}");
        assert_eq!(k["pod_uid"], spec.uid.as_str(), "{added}");
        assert_eq!(k["container"], c.name.as_str(), "{added}");
        assert_eq!(k["image"], BUSYBOX_IMAGE, "{added}");
        // Taken from the runtime's own annotations.
        let a = &added["container"]["annotations"];
        assert_eq!(a["io.kubernetes.cri.container-type"], "container");
        assert_eq!(a["io.kubernetes.cri.sandbox-id"], pod.sandbox_id.as_str());
        assert_eq!(a["io.kubernetes.cri.container-name"], c.name.as_str());
        assert_eq!(a["io.kubernetes.cri.sandbox-uid"], spec.uid.as_str());
        assert_eq!(
            added["container"]["args"],
            serde_json::json!(["sh", "-c", stamped(&c.name)])
        );
        // Reported before the container's first command ran.
        let first = read_stamp(&stamps.path().join(format!("{}.ns", c.name)));
        let added_ns = added["monotonic_ns"].as_u64().expect("monotonic_ns");
        assert!(
            added_ns < first,
            "{}: added at {added_ns}, first command at {first}",
            c.name
        );
        let status = kubelet.container_status(id).expect("ContainerStatus");
        assert_eq!(
            status.state(),
            ContainerState::ContainerRunning,
            "{id}: {status:?}"
        );
    }

    // The sandbox (pause) container is reported too, with the runtime's
    // annotations that say what it is.
    let sandbox = agent.wait_event(&pod.sandbox_id, "added", Duration::from_secs(10));
    assert_eq!(sandbox["source"], "runtime-hook", "{sandbox}");
    assert_eq!(sandbox["container"]["status"], "created", "{sandbox}");
    let sa = &sandbox["container"]["annotations"];
    assert_eq!(
        sa["io.kubernetes.cri.container-type"], "sandbox",
        "{sandbox}"
    );
    assert_eq!(sa["io.kubernetes.cri.sandbox-name"], spec.name.as_str());
    assert_eq!(sa["io.kubernetes.cri.sandbox-namespace"], "shop");
    assert_eq!(sa["io.kubernetes.cri.sandbox-uid"], spec.uid.as_str());
    assert_eq!(
        sandbox["container"]["args"],
        serde_json::json!(["/bin/sleep", "infinity"])
    );
    // A pod's sandbox carries its pod's identity, with no container
    // name, and is marked as one (on every backend: tests/nri.rs).
    assert_eq!(sandbox["container"]["pod_sandbox"], true, "{sandbox}");
    let sk = &sandbox["container"]["kubernetes"];
    assert_eq!(sk["namespace"], "shop", "{sandbox}");
    assert_eq!(sk["pod"], spec.name.as_str(), "{sandbox}");
    assert_eq!(sk["pod_uid"], spec.uid.as_str(), "{sandbox}");
    assert!(sk["container"].is_null(), "{sandbox}");

    // Each reported once, while created; removal reported at teardown.
    kubelet.remove_pod(&pod).expect("remove the pod");
    for id in pod.container_ids.iter().chain([&pod.sandbox_id]) {
        let removed = agent.wait_event(id, "removed", Duration::from_secs(10));
        assert_eq!(removed["container"]["status"], "stopped", "{removed}");
        let added: Vec<Value> = agent
            .events_for(id)
            .into_iter()
            .filter(|e| e["event"] == "added")
            .collect();
        assert_eq!(added.len(), 1, "{id} added once: {added:?}");
    }
    assert!(
        kubelet.list_pod_sandboxes().expect("list").is_empty(),
        "the pod is gone"
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("discovery mode fanotify-ebpf"), "{log}");
}

/// What each container of a CRI pod is to its pod, at `added`: the
/// sandbox from containerd's annotations, an init container and a regular
/// one from the pod's spec, which the agent's pod watch has before the
/// kubelet creates the containers (CRI itself does not know an init
/// container from another).
#[test]
fn a_cri_pods_init_container_and_sandbox_are_reported_with_their_kind() {
    const TEST: &str = "cri_pod_kinds";
    if !require_cri(TEST) || !require_program(TEST, "busybox") {
        return;
    }
    let node = CriNode::start().expect("start the CRI node");
    let server = lookout_testsupport::apiserver::ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = server.kubeconfig(dir.path());
    let spec = PodSpec::new("shop", &format!("kinds-{}", std::process::id()))
        // N.B. it does not exit on its own: containerd 1.7 refuses to
        // remove a container whose exit it has not handled yet, and the
        // kind is by name.
        .container("setup", BUSYBOX_IMAGE, &["sleep", "300"])
        .container("web", BUSYBOX_IMAGE, &["sleep", "300"]);
    // The pod as the API server has it once scheduled: `setup` is an init
    // container, and it has no controller (it is its own workload).
    let mut pod = lookout_testsupport::apiserver::PodJson::new(
        &spec.namespace,
        &spec.name,
        &spec.uid,
        "node-a",
    )
    .without_owner()
    .json();
    pod["spec"]["initContainers"] = serde_json::json!([{"name": "setup", "image": BUSYBOX_IMAGE}]);
    pod["spec"]["containers"] = serde_json::json!([{"name": "web", "image": BUSYBOX_IMAGE}]);
    server.apply(pod);
    let runc = node.runc().to_str().expect("utf-8 path");
    let agent = Agent::start_with(
        None,
        &["--runtime-path", runc],
        &[
            ("NODE_NAME", "node-a"),
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
        ],
        None,
    );
    agent.wait_log("pod informer synced", Duration::from_secs(15));
    let mut kubelet = node.kubelet().expect("CRI client");
    let mut pod = kubelet.create_pod(&spec).expect("create the pod");
    kubelet.start_pod(&mut pod).expect("start the containers");

    let sandbox = agent.wait_event(&pod.sandbox_id, "added", Duration::from_secs(10));
    assert_eq!(sandbox["container"]["kind"], "sandbox", "{sandbox}");
    assert_eq!(sandbox["container"]["pod_sandbox"], true, "{sandbox}");
    for (name, kind) in [("setup", "init"), ("web", "regular")] {
        let id = pod.container(name).expect("created");
        let added = agent.wait_event(id, "added", Duration::from_secs(10));
        assert_eq!(added["source"], "runtime-hook", "{added}");
        assert_eq!(added["container"]["status"], "created", "{added}");
        assert_eq!(added["container"]["kind"], kind, "{name}: {added}");
        assert_eq!(
            added["container"]["kubernetes"]["workload"]["kind"], "Pod",
            "{name}: {added}"
        );
        assert_eq!(
            added["container"]["kubernetes"]["workload"]["name"],
            spec.name.as_str(),
            "{name}: {added}"
        );
    }
    kubelet.remove_pod(&pod).expect("remove the pod");
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}
