//! `lookout run` with NRI, on a real CRI node: containerd 1.7 with NRI on
//! (`lookout_testsupport::cri`), driven like a kubelet over gRPC. Each test
//! has its own node (its own runc copy, sockets and NRI socket) and agent,
//! so tests run side by side.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lookout_client::{Filter, GateOptions, OnFailure};
use lookout_testsupport::cri::{BUSYBOX_IMAGE, CriNode, Pod, PodSpec, require_cri};
use lookout_testsupport::{bundle, require_program};
use serde_json::Value;

mod common;
use common::*;

/// An agent with NRI on `node`'s socket: `--mode nri` (NRI alone), or
/// beside fanotify-ebpf watching the node's runc.
fn agent(node: &CriNode, nri_only: bool, extra: &[&str]) -> Agent {
    let socket = node.nri_socket().to_str().expect("utf-8 path");
    let runc = node.runc().to_str().expect("utf-8 path");
    let mut args = vec!["--nri-socket", socket];
    if nri_only {
        args.extend(["--mode", "nri"]);
    } else {
        args.extend(["--nri", "on", "--runtime-path", runc]);
    }
    args.extend(extra);
    Agent::start_with(None, &args, &[], None)
}

fn pod_spec(name: &str) -> PodSpec {
    PodSpec::new("shop", &format!("{name}-{}", std::process::id()))
        .label("app", name)
        .container("web", BUSYBOX_IMAGE, &["sleep", "300"])
}

/// Every `added` event of `id` the agent printed.
fn added(agent: &Agent, id: &str) -> Vec<Value> {
    agent
        .events_for(id)
        .into_iter()
        .filter(|e| e["event"] == "added")
        .collect()
}

fn assert_pod_identity(e: &Value, spec: &PodSpec) {
    let k = &e["container"]["kubernetes"];
    assert_eq!(k["namespace"], "shop", "{e}");
    assert_eq!(k["pod"], spec.name.as_str(), "{e}");
    assert_eq!(k["pod_uid"], spec.uid.as_str(), "{e}");
}

#[test]
fn nri_alone_reports_containers_before_their_first_instruction_and_the_sandbox() {
    const TEST: &str = "nri_pod";
    if !require_cri(TEST) || !require_program(TEST, "busybox") || !require_program(TEST, "gcc") {
        return;
    }
    let stamps = tempfile::tempdir().expect("tempdir");
    bundle::monotonic_stamp(stamps.path());
    let stamped = |name: &str| format!("/stamp/stamp /stamp/{name}.ns && exec sleep 300");
    let node = CriNode::start().expect("start the CRI node");
    let agent = agent(&node, true, &[]);
    let mut kubelet = node.kubelet().expect("CRI client");
    let spec = PodSpec::new("shop", &format!("cart-{}", std::process::id()))
        .label("app", "cart")
        .container("web", BUSYBOX_IMAGE, &["sh", "-c", &stamped("web")])
        .mount(stamps.path(), "/stamp", false)
        .container("sidecar", BUSYBOX_IMAGE, &["sh", "-c", &stamped("sidecar")])
        .mount(stamps.path(), "/stamp", false);
    let pod = kubelet.run_pod(&spec).expect("run the pod");
    for (c, id) in spec.containers.iter().zip(&pod.container_ids) {
        let e = agent.wait_event(id, "added", Duration::from_secs(10));
        assert_eq!(e["source"], "nri", "{e}");
        assert_eq!(e["container"]["status"], "created", "{e}");
        assert_pod_identity(&e, &spec);
        let k = &e["container"]["kubernetes"];
        assert_eq!(k["container"], c.name.as_str(), "{e}");
        // NRI gives the pod's labels, which config.json does not carry.
        assert_eq!(k["labels"]["app"], "cart", "{e}");
        assert!(e["container"]["pid"].as_u64().is_some_and(|p| p > 1), "{e}");
        assert!(e["container"].get("pod_sandbox").is_none(), "{e}");
        // Reported while the runtime held StartContainer: before the
        // container's first command ran.
        let first = read_stamp(&stamps.path().join(format!("{}.ns", c.name)));
        let added_ns = e["monotonic_ns"].as_u64().expect("monotonic_ns");
        assert!(
            added_ns < first,
            "{}: added at {added_ns}, first command at {first}",
            c.name
        );
    }
    // The sandbox: marked, with the pod's identity and no container name.
    let s = agent.wait_event(&pod.sandbox_id, "added", Duration::from_secs(10));
    assert_eq!(s["source"], "nri", "{s}");
    assert_eq!(s["container"]["pod_sandbox"], true, "{s}");
    assert_pod_identity(&s, &spec);
    assert!(s["container"]["kubernetes"]["container"].is_null(), "{s}");

    kubelet.remove_pod(&pod).expect("remove the pod");
    for id in pod.container_ids.iter().chain([&pod.sandbox_id]) {
        agent.wait_event(id, "removed", Duration::from_secs(10));
        assert_eq!(added(&agent, id).len(), 1, "{id} added once");
    }
    let metrics = agent.metrics();
    assert_eq!(metric(&metrics, "lookout_nri_late_starts_total"), Some(0.0));
    assert!(
        metrics.contains(r#"lookout_mode_info{mode="nri"} 1"#),
        "{metrics}"
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("discovery mode nri"), "{log}");
}

#[test]
fn pods_that_ran_before_the_agent_come_from_synchronize() {
    const TEST: &str = "nri_sync";
    if !require_cri(TEST) {
        return;
    }
    let node = CriNode::start().expect("start the CRI node");
    let mut kubelet = node.kubelet().expect("CRI client");
    let spec = pod_spec("early");
    let pod = kubelet.run_pod(&spec).expect("run the pod");
    let agent = agent(&node, true, &[]);
    for id in pod.container_ids.iter().chain([&pod.sandbox_id]) {
        let e = agent.wait_event(id, "added", Duration::from_secs(10));
        assert_eq!(e["source"], "nri-sync", "{e}");
        assert_eq!(e["container"]["status"], "running", "{e}");
        assert_pod_identity(&e, &spec);
    }
    kubelet.remove_pod(&pod).expect("remove the pod");
    agent.wait_event(&pod.container_ids[0], "removed", Duration::from_secs(10));
}

#[test]
fn a_killed_agent_holds_up_no_pod_and_resynchronizes_without_duplicates() {
    const TEST: &str = "nri_restart";
    if !require_cri(TEST) {
        return;
    }
    let node = CriNode::start().expect("start the CRI node");
    let mut kubelet = node.kubelet().expect("CRI client");
    let first = agent(&node, true, &[]);
    let before = kubelet.run_pod(&pod_spec("before")).expect("pod before");
    first.wait_event(&before.container_ids[0], "added", Duration::from_secs(10));
    // SIGKILL: the plugin's connection drops mid-flight.
    drop(first);
    // The runtime goes on without lookout: pods run, one goes away.
    let t = Instant::now();
    let during = kubelet
        .run_pod(&pod_spec("during"))
        .expect("pod while lookout is dead");
    let gone = kubelet.run_pod(&pod_spec("gone")).expect("another pod");
    kubelet.remove_pod(&gone).expect("remove it");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the runtime waited for a dead plugin: {:?}",
        t.elapsed()
    );
    let second = agent(&node, true, &[]);
    let after = kubelet.run_pod(&pod_spec("after")).expect("pod after");
    let live: Vec<&Pod> = vec![&before, &during, &after];
    for pod in &live {
        for id in pod.container_ids.iter().chain([&pod.sandbox_id]) {
            second.wait_event(id, "added", Duration::from_secs(10));
        }
    }
    // Everything that runs was reported by the second agent once; what
    // came and went while it was dead is not reported at all.
    let sandboxes = kubelet.list_pod_sandboxes().expect("list");
    assert_eq!(sandboxes.len(), 3, "{sandboxes:?}");
    for pod in &live {
        for id in pod.container_ids.iter().chain([&pod.sandbox_id]) {
            assert_eq!(added(&second, id).len(), 1, "{id} added once");
        }
    }
    for id in gone.container_ids.iter().chain([&gone.sandbox_id]) {
        assert!(second.events_for(id).is_empty(), "{id} never ran for it");
    }
    // containerd closed the killed agent's plugin, and only that one.
    assert_eq!(
        node.log().matches("closing plugin").count(),
        1,
        "{}",
        node.log()
    );
}

#[test]
fn a_prestart_hook_slower_than_the_runtime_timeout_fails_at_its_deadline_not_the_plugin() {
    const TEST: &str = "nri_slow_hook";
    if !require_cri(TEST) {
        return;
    }
    let node = CriNode::start().expect("start the CRI node");
    let marks = tempfile::tempdir().expect("tempdir");
    let mark = marks.path().join("hook.ns");
    let hook = format!(
        "cat /proc/uptime > {} ; sleep 3",
        mark.to_str().expect("utf-8")
    );
    // warn: a hook past the deadline fails, and fail-open lets the start go.
    let agent = agent(
        &node,
        true,
        &[
            "--prestart",
            &hook,
            "--nri-budget",
            "800ms",
            "--hook-failure",
            "warn",
        ],
    );
    let mut kubelet = node.kubelet().expect("CRI client");
    let t = Instant::now();
    let pod = kubelet.run_pod(&pod_spec("slow")).expect("run the pod");
    let took = t.elapsed();
    let id = &pod.container_ids[0];
    agent.wait_event(id, "added", Duration::from_secs(10));
    // The hook ran (it was started before the start went on) ...
    let deadline = Instant::now() + Duration::from_secs(5);
    while !mark.exists() {
        assert!(Instant::now() < deadline, "the prestart hook never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    // ... and the start went on at the budget, not after the hook's 3 s.
    assert!(took < Duration::from_secs(3), "the pod took {took:?}");
    // The hooks' barrier decided at the runtime's deadline, not the
    // plugin's timeout.
    agent.wait_log("did not finish within", Duration::from_secs(5));
    agent.wait_log("--hook-failure warn", Duration::from_secs(5));
    // The runtime kept the plugin: the next pod is reported through NRI.
    let next = kubelet.run_pod(&pod_spec("next")).expect("next pod");
    let e = agent.wait_event(&next.container_ids[0], "added", Duration::from_secs(10));
    assert_eq!(e["source"], "nri", "{e}");
    assert!(!node.log().contains("closing plugin"), "{}", node.log());
    assert_eq!(
        metric(&agent.metrics(), "lookout_nri_disconnects_total"),
        Some(0.0)
    );
}

/// containerd relays NRI requests one at a time (its NRI adaptation holds
/// one lock across every plugin call), so while one start is held, every
/// other CRI request on the node waits its turn. What lookout owes the
/// node: a hold ends when its hook or gate decides, well inside the
/// budget, and a start that queued behind it is reported and started
/// once, without reaching the budget itself.
#[test]
fn a_start_that_waits_behind_a_held_one_is_reported_once_and_not_late() {
    const TEST: &str = "nri_held_apart";
    if !require_cri(TEST) {
        return;
    }
    let node = CriNode::start().expect("start the CRI node");
    let marks = tempfile::tempdir().expect("tempdir");
    let begun = marks.path().join("begun");
    let release = marks.path().join("release");
    // The hook holds only the container named `held` (its State on stdin
    // names it), until the test releases it (or 4 s).
    let hook = format!(
        "if grep -q '\"held\"'; then touch {b}; i=0; \
         while [ ! -e {r} ] && [ $i -lt 200 ]; do sleep 0.02; i=$((i+1)); done; fi",
        b = begun.to_str().expect("utf-8"),
        r = release.to_str().expect("utf-8"),
    );
    // The default budget (1.5 s): neither start may reach it.
    let agent = agent(&node, true, &["--prestart", &hook]);
    let (mut held_kubelet, mut other_kubelet) = (
        node.kubelet().expect("CRI client"),
        node.kubelet().expect("CRI client"),
    );
    let pid = std::process::id();
    let busy = ["sleep", "300"];
    let held_spec =
        PodSpec::new("shop", &format!("held-{pid}")).container("held", BUSYBOX_IMAGE, &busy);
    let other_spec =
        PodSpec::new("shop", &format!("other-{pid}")).container("other", BUSYBOX_IMAGE, &busy);
    let mut held = held_kubelet.create_pod(&held_spec).expect("create held");
    let mut other = other_kubelet.create_pod(&other_spec).expect("create other");
    let held_start = std::thread::spawn(move || {
        held_kubelet.start_pod(&mut held).expect("start held");
        held
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !begun.exists() {
        assert!(
            Instant::now() < deadline,
            "the held container's hook never ran"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // `other` starts while `held` waits for its hook.
    let other_start = std::thread::spawn(move || {
        other_kubelet.start_pod(&mut other).expect("start other");
        other
    });
    std::fs::write(&release, b"").expect("release");
    let held = held_start.join().expect("held start");
    let other = other_start.join().expect("other start");
    let held_added = agent.wait_event(&held.container_ids[0], "added", Duration::from_secs(10));
    let other_added = agent.wait_event(&other.container_ids[0], "added", Duration::from_secs(10));
    assert_eq!(other_added["source"], "nri", "{other_added}");
    assert!(
        held_added["monotonic_ns"].as_u64().expect("monotonic_ns")
            < other_added["monotonic_ns"].as_u64().expect("monotonic_ns"),
        "held was reported at its StartContainer, before other's: {held_added} {other_added}"
    );
    for id in [&held.container_ids[0], &other.container_ids[0]] {
        assert_eq!(added(&agent, id).len(), 1, "{id} reported once");
    }
    eprintln!(
        "{TEST}: held's start took {:?}, other's (queued behind it) {:?}",
        held.start_took, other.start_took
    );
    // Released by the test, not by the budget; and other's start, queued
    // behind held's, did not use up its own.
    assert_eq!(
        metric(&agent.metrics(), "lookout_nri_late_starts_total"),
        Some(0.0),
        "held's start took {:?}, other's {:?}",
        held.start_took,
        other.start_took
    );
}

/// A gate subscriber for `namespace` with the default deadline (2 s) that
/// takes its holds and never answers (it keeps them: a dropped hold would
/// count as gone, not stalled). Returns once subscribed; yields the id of
/// each held container.
fn stalled_subscriber(
    agent: &Agent,
    name: &str,
    namespace: &str,
    policy: OnFailure,
) -> std::sync::mpsc::Receiver<String> {
    let socket = agent.socket().to_path_buf();
    let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
    let (seen_tx, seen) = std::sync::mpsc::channel::<String>();
    let (name, ns) = (name.to_string(), namespace.to_string());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let client = lookout_client::Client::connect(&socket)
                .await
                .expect("connect");
            // The agent's deadline (none asked).
            let options = GateOptions::new(name)
                .filter(Filter::all().namespace(ns))
                .on_failure(policy);
            let mut gate = client.gate(options).await.expect("subscribe");
            let _ = ready_tx.send(());
            let mut kept = Vec::new();
            while let Some(Ok(hold)) = gate.next().await {
                if hold.held() {
                    let _ = seen_tx.send(hold.container().id.clone());
                    kept.push(hold);
                }
            }
        });
    });
    ready
        .recv_timeout(Duration::from_secs(10))
        .expect("subscribed");
    seen
}

/// A gate decision counted on the agent's `/metrics`.
fn decided(agent: &Agent, subscriber: &str, outcome: &str) -> Option<f64> {
    metric(
        &agent.metrics(),
        &format!(
            "lookout_gate_decisions_total{{subscriber=\"{subscriber}\",outcome=\"{outcome}\"}}"
        ),
    )
}

/// Because the runtime relays one NRI request at a time, a gate subscriber
/// that stops answering would cost every CRI start on the node its
/// deadline. It costs one: after a missed deadline, starts no longer wait
/// for it (its fail-open policy decides at once) until it answers again.
/// Its deadline is the default (2 s), longer than NRI's budget (1.5 s): the
/// runtime's deadline is the one it missed, and the gate's policy, not the
/// plugin's timeout, settled the start.
#[test]
fn a_stalled_gate_subscriber_costs_one_start_not_every_start() {
    const TEST: &str = "nri_stalled_gate";
    if !require_cri(TEST) {
        return;
    }
    let node = CriNode::start().expect("start the CRI node");
    let agent = agent(&node, true, &[]);
    let namespace = format!("stalled-{}", std::process::id());
    let seen = stalled_subscriber(&agent, "stalled", &namespace, OnFailure::FailOpen);
    let mut kubelet = node.kubelet().expect("CRI client");
    let mut pods = Vec::new();
    for i in 0..3 {
        let spec = PodSpec::new(&namespace, &format!("p{i}")).container(
            "web",
            BUSYBOX_IMAGE,
            &["sleep", "300"],
        );
        let pod = kubelet.run_pod(&spec).expect("run the pod");
        agent.wait_event(&pod.container_ids[0], "added", Duration::from_secs(10));
        pods.push(pod);
    }
    // The subscriber still heard of every container.
    for pod in &pods {
        let id = seen
            .recv_timeout(Duration::from_secs(10))
            .expect("the subscriber was asked");
        assert_eq!(id, pod.container_ids[0]);
    }
    let took: Vec<_> = pods.iter().map(|p| p.start_took.clone()).collect();
    eprintln!("{TEST}: starts took {took:?}");
    let m = agent.metrics();
    let timeouts = decided(&agent, "stalled", "timeout");
    assert_eq!(timeouts, Some(1.0), "one start waited: {took:?}\n{m}");
    let overdue = decided(&agent, "stalled", "overdue");
    assert_eq!(overdue, Some(2.0), "the others did not: {took:?}\n{m}");
    assert_eq!(
        metric(&m, "lookout_nri_late_starts_total"),
        Some(0.0),
        "the gate decided before the plugin's deadline: {took:?}"
    );
    assert_eq!(metric(&m, "lookout_nri_events_dropped_total"), Some(0.0));
}

#[test]
fn the_socket_is_found_as_the_host_sees_it_and_a_users_socket_is_refused() {
    const TEST: &str = "nri_host_root";
    if !require_cri(TEST) {
        return;
    }
    let Some(user) = lookout_testsupport::unprivileged_user(TEST) else {
        return;
    };
    let node = CriNode::start().expect("start the CRI node");
    // The host's root as a pod mounts it: var/run -> /run (absolute, as on
    // every systemd host), and the runtime's socket in run/nri (a hard
    // link to the node's socket: the same socket).
    let host = tempfile::tempdir_in(node.dir()).expect("tempdir");
    std::fs::create_dir_all(host.path().join("run/nri")).expect("mkdir");
    std::fs::create_dir_all(host.path().join("var")).expect("mkdir");
    std::os::unix::fs::symlink("/run", host.path().join("var/run")).expect("symlink");
    std::fs::hard_link(node.nri_socket(), host.path().join("run/nri/nri.sock")).expect("link");
    let root = host.path().to_str().expect("utf-8 path");
    let agent = Agent::start_with(
        None,
        &[
            "--mode",
            "nri",
            "--host-root",
            root,
            "--nri-socket",
            "/var/run/nri/nri.sock",
        ],
        &[],
        None,
    );
    let mut kubelet = node.kubelet().expect("CRI client");
    let pod = kubelet.run_pod(&pod_spec("hostroot")).expect("run the pod");
    let e = agent.wait_event(&pod.container_ids[0], "added", Duration::from_secs(10));
    assert_eq!(e["source"], "nri", "{e}");
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");

    // A socket an unprivileged user made, where the agent is told to look:
    // whoever serves it could describe any pod, with any namespace, to
    // root's hooks. It is refused before anything is read from it.
    let planted = host.path().join("run/nri/planted.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&planted).expect("bind");
    std::os::unix::fs::chown(&planted, Some(user.uid), Some(user.gid)).expect("chown");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lookout"))
        .args([
            "run",
            "--mode",
            "nri",
            "--no-socket",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--host-root", root, "--nri-socket", "/run/nri/planted.sock"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn lookout run");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "lookout run did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut log)
        .expect("read stderr");
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains(&format!("owned by uid {}, not uid 0", user.uid)),
        "{log}"
    );
}

#[test]
fn nri_beside_the_hook_reports_cri_and_hand_made_containers_once_each() {
    const TEST: &str = "nri_and_hook";
    if !require_cri(TEST) || !require_program(TEST, "busybox") {
        return;
    }
    let node = CriNode::start().expect("start the CRI node");
    let agent = agent(&node, false, &[]);
    let mut kubelet = node.kubelet().expect("CRI client");
    let spec = pod_spec("both");
    let pod = kubelet.run_pod(&spec).expect("run the pod");
    // A container by hand, through the same runc, with its own state root.
    let dir = tempfile::tempdir().expect("tempdir");
    let b = bundle::busybox(&dir.path().join("b"), &["sleep", "300"], |_| {});
    let root = dir.path().join("state");
    let by_hand = id("nri-by-hand");
    // N.B. no pipes: the container would inherit one and hold it open.
    let runc = |args: &[&str]| {
        let status = std::process::Command::new(node.runc())
            .arg("--root")
            .arg(&root)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("runc");
        assert!(status.success(), "runc {args:?}: {status}");
    };
    runc(&[
        "run",
        "-d",
        "--bundle",
        b.to_str().expect("utf-8"),
        &by_hand,
    ]);
    let e = agent.wait_event(&by_hand, "added", Duration::from_secs(10));
    assert_eq!(e["source"], "runtime-hook", "{e}");
    let mut sources: HashMap<String, String> = HashMap::new();
    for id in pod.container_ids.iter().chain([&pod.sandbox_id]) {
        let e = agent.wait_event(id, "added", Duration::from_secs(10));
        assert_pod_identity(&e, &spec);
        sources.insert(id.clone(), e["source"].as_str().unwrap_or("").to_owned());
    }
    eprintln!("who reported the CRI pod first: {sources:?}");
    runc(&["kill", &by_hand, "KILL"]);
    agent.wait_event(&by_hand, "removed", Duration::from_secs(10));
    runc(&["delete", "--force", &by_hand]);
    kubelet.remove_pod(&pod).expect("remove the pod");
    for id in pod.container_ids.iter().chain([&pod.sandbox_id]) {
        agent.wait_event(id, "removed", Duration::from_secs(10));
    }
    for id in pod.container_ids.iter().chain([&pod.sandbox_id, &by_hand]) {
        assert_eq!(added(&agent, id).len(), 1, "{id} added once");
        let removed = agent
            .events_for(id)
            .into_iter()
            .filter(|e| e["event"] == "removed")
            .count();
        assert_eq!(removed, 1, "{id} removed once");
    }
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("discovery mode fanotify-ebpf+nri"), "{log}");
}

#[test]
fn a_gate_subscriber_answers_through_nri_before_the_first_instruction() {
    const TEST: &str = "nri_gate";
    if !require_cri(TEST) || !require_program(TEST, "busybox") || !require_program(TEST, "gcc") {
        return;
    }
    let stamps = tempfile::tempdir().expect("tempdir");
    bundle::monotonic_stamp(stamps.path());
    let node = CriNode::start().expect("start the CRI node");
    let agent = agent(&node, true, &[]);
    let socket = agent.socket().to_path_buf();
    let namespace = format!("gated-{}", std::process::id());
    // A subscriber for the pod's namespace: it records when it answered,
    // then allows; it reports which containers it was asked about.
    let (asked_tx, asked) = std::sync::mpsc::channel::<(String, bool, u64)>();
    let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
    let ns = namespace.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let client = lookout_client::Client::connect(&socket)
                .await
                .expect("connect");
            let options = GateOptions::new("tracer")
                .filter(Filter::all().namespace(ns))
                .deadline(Duration::from_secs(1))
                .on_failure(OnFailure::FailOpen);
            let mut gate = client.gate(options).await.expect("subscribe");
            let _ = ready_tx.send(());
            while let Some(Ok(hold)) = gate.next().await {
                let c = hold.container().clone();
                // Containers that cannot be held (a running sandbox) are
                // only shown to the subscriber.
                let held = hold.held();
                hold.allow().expect("allow");
                if held {
                    let _ = asked_tx.send((c.id, c.pod_sandbox, read_monotonic_ns()));
                }
            }
        });
    });
    ready
        .recv_timeout(Duration::from_secs(10))
        .expect("subscribed");
    let mut kubelet = node.kubelet().expect("CRI client");
    let spec = PodSpec::new(&namespace, "gated").container(
        "web",
        BUSYBOX_IMAGE,
        &["sh", "-c", "/stamp/stamp /stamp/web.ns && exec sleep 300"],
    );
    let spec = spec.mount(stamps.path(), "/stamp", false);
    let pod = kubelet.run_pod(&spec).expect("run the pod");
    let id = &pod.container_ids[0];
    let (asked_id, sandbox, answered) = asked
        .recv_timeout(Duration::from_secs(10))
        .expect("the gate was asked");
    // Held: the container, not its sandbox, answered before it ran.
    assert_eq!(&asked_id, id);
    assert!(!sandbox, "a pod's sandbox is never held");
    let first = read_stamp(&stamps.path().join("web.ns"));
    assert!(
        answered < first,
        "the gate answered at {answered}, after the first instruction at {first}"
    );
    assert!(asked.try_recv().is_err(), "the gate held nothing else");
    let e = agent.wait_event(id, "added", Duration::from_secs(10));
    assert_eq!(e["source"], "nri", "{e}");
}

fn read_monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A fail-closed gate keeps its promise through NRI even when its deadline
/// (2 s) is longer than the runtime's: unanswered at NRI's budget, the
/// start is denied (NRI cannot refuse one: the waiting init is killed), and
/// the next start is denied at once (overdue), costing the node nothing.
#[test]
fn a_fail_closed_gate_that_misses_the_runtimes_deadline_denies_the_start() {
    const TEST: &str = "nri_stalled_closed";
    if !require_cri(TEST) {
        return;
    }
    let stamps = tempfile::tempdir().expect("tempdir");
    let node = CriNode::start().expect("start the CRI node");
    let agent = agent(&node, true, &[]);
    let namespace = format!("closed-{}", std::process::id());
    let seen = stalled_subscriber(&agent, "strict", &namespace, OnFailure::FailClosed);
    let mut kubelet = node.kubelet().expect("CRI client");
    let mut pods = Vec::new();
    for i in 0..2 {
        let ran = format!("touch /stamp/ran{i} && exec sleep 300");
        let spec = PodSpec::new(&namespace, &format!("p{i}"))
            .container("web", BUSYBOX_IMAGE, &["sh", "-c", &ran])
            .mount(stamps.path(), "/stamp", false);
        let mut pod = kubelet.create_pod(&spec).expect("create the pod");
        let t = Instant::now();
        let started = kubelet.start_pod(&mut pod);
        eprintln!("{TEST}: start {i} took {:?}: {started:?}", t.elapsed());
        let id = pod.container_ids[0].clone();
        assert_eq!(seen.recv_timeout(Duration::from_secs(10)).as_ref(), Ok(&id));
        // Killed before its start: it exits, never having run.
        let status = kubelet
            .wait_exited(&id, Duration::from_secs(10))
            .expect("the denied container exits");
        assert!(
            !stamps.path().join(format!("ran{i}")).exists(),
            "container {i} ran its first instruction: {status:?}"
        );
        pods.push(pod);
    }
    assert_eq!(decided(&agent, "strict", "timeout"), Some(1.0));
    assert_eq!(decided(&agent, "strict", "overdue"), Some(1.0));
    for pod in &pods {
        kubelet.remove_pod(pod).expect("remove the pod");
        let e = agent.wait_event(&pod.container_ids[0], "removed", Duration::from_secs(10));
        let reason = e["reason"].as_str().unwrap_or_default();
        assert!(reason.starts_with("denied by gate strict:"), "{e}");
    }
}

#[test]
fn a_failing_create_container_hook_stops_the_container_through_nri() {
    const TEST: &str = "nri_hook_fails";
    if !require_cri(TEST) {
        return;
    }
    let stamps = tempfile::tempdir().expect("tempdir");
    let d = stamps.path();
    // The hook runs in the container (its mount namespace), so it writes
    // to the directory mounted there at the same path; `exit 3` fails it.
    let script = d.join("fail.sh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\ntouch {}/hook-ran\nexit 3\n", d.display()),
    )
    .expect("script");
    // A createContainer hook must be static: a shim runs the script with
    // the image's shell.
    let shim = lookout_testsupport::bundle::static_shim(d);
    let hooks = d.join("hooks.d");
    std::fs::create_dir_all(&hooks).expect("mkdir");
    std::fs::write(
        hooks.join("fail.json"),
        serde_json::json!({
            "version": "1.0.0",
            "hook": {"path": shim, "args": ["shim", "/bin/sh", script]},
            "when": {"annotations": {"^io.kubernetes.cri.container-name$": "^web$"}},
            "stages": ["createContainer"],
        })
        .to_string(),
    )
    .expect("hook file");
    let poststop = format!("touch {}/poststop", d.display());
    let node = CriNode::start().expect("start the CRI node");
    let agent = agent(
        &node,
        true,
        &[
            "--hooks-dir",
            hooks.to_str().expect("utf-8"),
            "--poststop",
            &poststop,
        ],
    );
    let mut kubelet = node.kubelet().expect("CRI client");
    let spec = PodSpec::new("shop", &format!("fail-{}", std::process::id()))
        .container(
            "web",
            BUSYBOX_IMAGE,
            &["sh", "-c", "touch /stamp/ran && exec sleep 300"],
        )
        .mount(d, "/stamp", false)
        .mount(d, d.to_str().expect("utf-8"), false);
    let mut pod = kubelet.create_pod(&spec).expect("create the pod");
    let _ = kubelet.start_pod(&mut pod);
    let id = pod.container_ids[0].clone();
    kubelet
        .wait_exited(&id, Duration::from_secs(10))
        .expect("the refused container exits");
    assert!(
        d.join("hook-ran").exists(),
        "the hook never ran:\n{}",
        agent.log()
    );
    assert!(
        !d.join("ran").exists(),
        "the container ran its first instruction"
    );
    kubelet.remove_pod(&pod).expect("remove the pod");
    let e = agent.wait_event(&id, "removed", Duration::from_secs(10));
    let reason = e["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("denied by hooks: createContainer hook fail.json: exit 3"),
        "{e}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d.join("poststop").exists() {
        assert!(Instant::now() < deadline, "no poststop:\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}
