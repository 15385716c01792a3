//! The consumer API end to end: a real agent, real runc containers, and
//! clients speaking lookout.v1 over the agent's Unix socket with the
//! generated gRPC code (as a consumer in any language would).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lookout_api::v1 as pb;
use lookout_api::v1::lookout_client::LookoutClient;
use lookout_testsupport::{bundle, require_program, unprivileged_user};
use tokio::sync::mpsc;
use tonic::transport::Channel;

mod common;
use common::*;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

async fn connect(socket: &Path) -> LookoutClient<Channel> {
    connect_with(socket, None).await
}

/// `window`: HTTP/2 flow-control windows, so small that a client that
/// stops reading stops the agent's sends at once (the default lets
/// megabytes through into the client's buffers).
async fn connect_with(socket: &Path, window: Option<u32>) -> LookoutClient<Channel> {
    LookoutClient::new(
        channel(socket, window)
            .await
            .expect("connect to the agent's socket"),
    )
}

/// An HTTP/2 connection to the agent's socket.
async fn channel(socket: &Path, window: Option<u32>) -> Result<Channel, tonic::transport::Error> {
    let path = socket.to_path_buf();
    tonic::transport::Endpoint::from_static("http://lookout.invalid")
        .initial_stream_window_size(window)
        .initial_connection_window_size(window)
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A gate subscriber on `rt`: subscribes, waits for Subscribed, then hands
/// each hold to the test through the returned channel; decisions go back
/// through the returned sender.
struct Subscriber {
    holds: mpsc::UnboundedReceiver<pb::Hold>,
    decide: mpsc::UnboundedSender<pb::GateRequest>,
    task: tokio::task::JoinHandle<Result<(), tonic::Status>>,
}

fn subscribe(rt: &tokio::runtime::Runtime, socket: &Path, sub: pb::Subscribe) -> Subscriber {
    let socket = socket.to_path_buf();
    let (decide, rx) = mpsc::unbounded_channel::<pb::GateRequest>();
    let (hold_tx, holds) = mpsc::unbounded_channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let first = pb::GateRequest {
        msg: Some(pb::gate_request::Msg::Subscribe(sub)),
    };
    let task = rt.spawn(async move {
        let mut client = connect(&socket).await;
        let outbound = futures_stream(first, rx);
        let mut inbound = client.gate(outbound).await?.into_inner();
        while let Some(m) = inbound.message().await? {
            match m.msg {
                Some(pb::gate_response::Msg::Subscribed(_)) => {
                    let _ = ready_tx.send(());
                }
                Some(pb::gate_response::Msg::Hold(h)) => {
                    let _ = hold_tx.send(h);
                }
                None => {}
            }
        }
        Ok(())
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the agent confirms the subscription");
    Subscriber {
        holds,
        decide,
        task,
    }
}

fn futures_stream(
    first: pb::GateRequest,
    mut rx: mpsc::UnboundedReceiver<pb::GateRequest>,
) -> impl tokio_stream::Stream<Item = pb::GateRequest> {
    async_stream::stream! {
        yield first;
        while let Some(m) = rx.recv().await {
            yield m;
        }
    }
}

fn decision(hold_id: u64, allow: bool, reason: &str) -> pb::GateRequest {
    pb::GateRequest {
        msg: Some(pb::gate_request::Msg::Decision(pb::Decision {
            hold_id,
            allow,
            reason: reason.into(),
        })),
    }
}

fn next_hold(rt: &tokio::runtime::Runtime, s: &mut Subscriber, id: &str) -> pb::Hold {
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let Some(h) = s.holds.recv().await else {
                    let end = (&mut s.task).await;
                    panic!("the subscription ended: {end:?}");
                };
                if h.container.as_ref().is_some_and(|c| c.id == id) {
                    return h;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no hold for {id} within 10 s"))
    })
}

fn busybox_bundle(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let b = dir.join(name);
    bundle::busybox(&b, args, |_| {});
    b
}

/// A subscription to runc containers (each test's agent watches only its
/// own runc copy).
fn sub(name: &str, deadline_ms: u32, policy: pb::FailurePolicy) -> pb::Subscribe {
    pb::Subscribe {
        name: name.into(),
        filter: Some(pb::Filter {
            runtimes: vec!["runc".into()],
            ..Default::default()
        }),
        deadline_ms,
        on_failure: policy as i32,
    }
}

#[test]
fn a_gate_answers_before_the_containers_first_instruction() {
    if !ready("gate_before_start") || !require_program("gate_before_start", "gcc") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let b = d.join("bundle");
    bundle::busybox(&b, &["/stamp", "/stamp.out"], |_| {});
    let stamp = bundle::monotonic_stamp(d);
    lookout_testsupport::install_executable(&stamp, &b.join("rootfs/stamp")).expect("copy stamp");
    let agent = Agent::start(&rt, &[]);
    let tokio = runtime();
    let mut s = subscribe(
        &tokio,
        agent.socket(),
        sub("tracer", 5000, pb::FailurePolicy::FailOpen),
    );
    let id = id("gate-first");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    // `start` waits on the gate: run it beside the subscriber.
    let started = start_beside(&rt, &id);
    let hold = next_hold(&tokio, &mut s, &id);
    assert!(hold.held, "a created container's start is held");
    let c = hold.container.clone().expect("container");
    assert_eq!(c.status, "created");
    assert!(c.pid > 1, "the held container has its init pid: {c:?}");
    // What a tracer would do before the first instruction: look at the
    // init process, then stamp the decision.
    assert!(Path::new(&format!("/proc/{}/ns/mnt", c.pid)).exists());
    let answered = monotonic_ns();
    s.decide
        .send(decision(hold.hold_id, true, "attached"))
        .expect("decide");
    assert!(started.join().expect("join"), "runc start goes on");
    let first_instruction = read_stamp(&b.join("rootfs/stamp.out"));
    assert!(
        answered < first_instruction,
        "the gate answered at {answered}, after the first instruction at {first_instruction}"
    );
    agent.wait_event(&id, "removed", Duration::from_secs(10));
    rt.cleanup(&id);
    let m = agent.metrics();
    assert_eq!(
        metric(
            &m,
            "lookout_gate_decisions_total{subscriber=\"tracer\",outcome=\"allow\"}"
        ),
        Some(1.0),
        "{m}"
    );
    drop(s);
}

/// `start_container` on a thread of its own (it waits on the gate).
fn start_beside(rt: &Runtime, id: &str) -> std::thread::JoinHandle<bool> {
    let (path, id) = (rt.path.clone(), id.to_owned());
    std::thread::spawn(move || start_container(&path, &id))
}

/// Creates and starts `id` from `bundle` with `rt`, returning whether
/// `start` succeeded and how long create and start took together (a hold
/// opens when the created container is reported, and its deadline runs
/// from then).
fn create_and_start(rt: &Runtime, bundle: &Path, id: &str) -> (bool, Duration) {
    let t = Instant::now();
    rt.ok(&["create", "--bundle", bundle.to_str().expect("utf-8"), id]);
    let ok = start_container(&rt.path, id);
    (ok, t.elapsed())
}

#[test]
fn unanswered_holds_follow_the_policy_and_exempt_namespaces_always_start() {
    if !ready("gate_policy") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let b = busybox_bundle(d, "b", &["sleep", "1"]);
    let sys = d.join("sys");
    bundle::busybox(&sys, &["sleep", "1"], |c| {
        c["annotations"] = serde_json::json!({"io.kubernetes.pod.namespace": "kube-system"});
    });
    let agent = Agent::start(&rt, &[]);
    let tokio = runtime();

    // Fail-open: the container starts once the deadline passed.
    let open = subscribe(
        &tokio,
        agent.socket(),
        sub("silent-open", 500, pb::FailurePolicy::FailOpen),
    );
    let a = id("gate-open");
    let (ok, took) = create_and_start(&rt, &b, &a);
    assert!(ok, "fail-open: runc start succeeds");
    assert!(
        took >= Duration::from_millis(500),
        "the start waited for the deadline: {took:?}"
    );
    agent.wait_event(&a, "removed", Duration::from_secs(10));
    rt.cleanup(&a);
    drop(open);

    // Fail-closed: the start is refused and the container removed with
    // the reason.
    let closed = subscribe(
        &tokio,
        agent.socket(),
        sub("silent-closed", 500, pb::FailurePolicy::FailClosed),
    );
    let c = id("gate-closed");
    let (ok, _) = create_and_start(&rt, &b, &c);
    assert!(!ok, "fail-closed: runc start fails");
    let removed = agent.wait_event(&c, "removed", Duration::from_secs(10));
    let reason = removed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("silent-closed") && reason.contains("fail-closed"),
        "{removed}"
    );
    rt.cleanup(&c);

    // ... except in kube-system.
    let k = id("gate-kube-system");
    let (ok, _) = create_and_start(&rt, &sys, &k);
    assert!(
        ok,
        "a kube-system container starts despite a fail-closed gate"
    );
    agent.wait_event(&k, "removed", Duration::from_secs(10));
    rt.cleanup(&k);
    drop(closed);
}

#[test]
fn a_denied_container_never_runs_and_a_vanished_subscriber_releases_at_once() {
    if !ready("gate_deny") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let marker = d.join("ran");
    let b = d.join("b");
    bundle::busybox(&b, &["touch", "/ran"], |_| {});
    let agent = Agent::start(&rt, &[]);
    let tokio = runtime();

    let mut s = subscribe(
        &tokio,
        agent.socket(),
        sub("policy", 10_000, pb::FailurePolicy::FailOpen),
    );
    let denied = id("gate-denied");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &denied]);
    let started = start_beside(&rt, &denied);
    let hold = next_hold(&tokio, &mut s, &denied);
    s.decide
        .send(decision(hold.hold_id, false, "image not signed"))
        .expect("decide");
    assert!(!started.join().expect("join"), "runc start is refused");
    let removed = agent.wait_event(&denied, "removed", Duration::from_secs(10));
    assert_eq!(
        removed["reason"], "denied by gate policy: image not signed",
        "{removed}"
    );
    // A later start cannot run it either: its init was killed.
    assert!(!start_container(&rt.path, &denied));
    assert!(
        !b.join("rootfs/ran").exists() && !marker.exists(),
        "the denied container ran its first instruction"
    );
    rt.cleanup(&denied);

    // The subscriber vanishes while holding a start with a 10 s deadline:
    // the start goes on at once (fail-open), not after 10 s.
    let gone = id("gate-gone");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &gone]);
    let t = Instant::now();
    let started = start_beside(&rt, &gone);
    let _hold = next_hold(&tokio, &mut s, &gone);
    s.task.abort();
    drop(s);
    assert!(started.join().expect("join"));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "released at once: {:?}",
        t.elapsed()
    );
    agent.wait_event(&gone, "removed", Duration::from_secs(10));
    rt.cleanup(&gone);
}

/// Reads a watch until `want` ADDED and REMOVED events of `ids` came,
/// returning every (kind, revision, id) seen for them.
async fn collect(
    stream: &mut tonic::Streaming<pb::WatchEvent>,
    ids: &std::collections::HashSet<String>,
    want: usize,
) -> Vec<(i32, u64, String)> {
    let mut got = Vec::new();
    match tokio::time::timeout(
        Duration::from_secs(90),
        collect_into(stream, ids, want, &mut got),
    )
    .await
    {
        Ok(()) => got,
        Err(_) => panic!("only {} of {want} events within 90 s: {got:?}", got.len()),
    }
}

async fn collect_into(
    stream: &mut tonic::Streaming<pb::WatchEvent>,
    ids: &std::collections::HashSet<String>,
    want: usize,
    got: &mut Vec<(i32, u64, String)>,
) {
    while got.len() < want {
        let e = stream
            .message()
            .await
            .expect("watch stream ok")
            .expect("watch stream open");
        let Some(c) = &e.container else { continue };
        if ids.contains(&c.id)
            && (e.kind == pb::watch_event::Kind::Added as i32
                || e.kind == pb::watch_event::Kind::Removed as i32)
        {
            got.push((e.kind, e.revision, c.id.clone()));
        }
    }
}

/// Creates and starts `id` (a container that exits at once) and deletes
/// it: `create` is where the hook reports it, so it is never missed.
fn one_shot(rt: &Runtime, bundle: &Path, id: &str) {
    rt.ok(&["create", "--bundle", bundle.to_str().expect("utf-8"), id]);
    rt.ok(&["start", id]);
}

#[test]
fn a_hundred_watchers_see_every_change_once_in_order_and_a_stalled_one_is_dropped() {
    if !ready("watchers") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = busybox_bundle(dir.path(), "b", &["true"]);
    let agent = Agent::start(&rt, &["--watch-buffer", "64"]);
    let tokio = runtime();
    const CONTAINERS: usize = 200;
    let ids: std::collections::HashSet<String> = (0..CONTAINERS)
        .map(|i| format!("{}-{i}", id("watch")))
        .collect();
    let socket = agent.socket().to_path_buf();
    // Each watcher says when it is watching: the containers come after
    // every one listed (one listed after the first containers would see
    // those as listed, not added).
    let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
    let watchers: Vec<_> = (0..100)
        .map(|_| {
            let (socket, ids, ready_tx) = (socket.clone(), ids.clone(), ready_tx.clone());
            tokio.spawn(async move {
                let mut c = connect(&socket).await;
                let (rev, _) = {
                    let l = c.list(pb::ListRequest::default()).await.expect("list");
                    let l = l.into_inner();
                    (l.revision, l.containers)
                };
                let mut s = c
                    .watch(pb::WatchRequest {
                        since: rev,
                        filter: None,
                    })
                    .await
                    .expect("watch")
                    .into_inner();
                let _ = ready_tx.send(());
                collect(&mut s, &ids, 2 * CONTAINERS).await
            })
        })
        .collect();
    // A watcher that never reads after subscribing.
    let stalled = tokio.block_on(stalled_watch(&socket));
    for _ in 0..100 {
        ready
            .recv_timeout(Duration::from_secs(60))
            .expect("every watcher lists and watches within 60 s");
    }
    // Containers from 4 threads at once.
    let ids_v: Vec<String> = ids.iter().cloned().collect();
    std::thread::scope(|scope| {
        for chunk in ids_v.chunks(CONTAINERS / 4) {
            let (rt, b) = (&rt, &b);
            scope.spawn(move || {
                for id in chunk {
                    one_shot(rt, b, id);
                }
            });
        }
    });
    for w in watchers {
        // collect() has its own deadline and says how far it got.
        let got = tokio.block_on(w).expect("watcher task");
        let revs: Vec<u64> = got.iter().map(|g| g.1).collect();
        assert!(revs.windows(2).all(|w| w[0] < w[1]), "revisions in order");
        for id in &ids {
            let added = got
                .iter()
                .filter(|g| g.2 == *id && g.0 == pb::watch_event::Kind::Added as i32)
                .count();
            let removed = got
                .iter()
                .filter(|g| g.2 == *id && g.0 == pb::watch_event::Kind::Removed as i32)
                .count();
            assert_eq!((added, removed), (1, 1), "{id}");
        }
    }
    // The stalled watcher was cut off, with a clear status, once its
    // buffer filled.
    let status = tokio.block_on(end_status(stalled));
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    for id in &ids {
        rt.cleanup(id);
    }
    let m = agent.metrics();
    assert!(
        metric(&m, "lookout_watchers_dropped_total") >= Some(1.0),
        "{m}"
    );
}

/// A watch from 0 whose client will not read: HTTP/2 windows of 1 KiB stop
/// the agent's sends at once.
async fn stalled_watch(socket: &Path) -> tonic::Streaming<pb::WatchEvent> {
    let mut c = connect_with(socket, Some(1024)).await;
    c.watch(pb::WatchRequest {
        since: 0,
        filter: None,
    })
    .await
    .expect("watch")
    .into_inner()
}

/// How a stalled watcher's stream ends when it reads again: the status it
/// gets after what was sent to it, within 30 s.
async fn end_status(mut s: tonic::Streaming<pb::WatchEvent>) -> tonic::Status {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match s.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stalled watcher's stream ended without a status"),
                Err(st) => return st,
            }
        }
    })
    .await
    .expect("a status within 30 s")
}

/// The agent's resident memory, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the agent's status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .expect("VmRSS in kB")
        / 1024.0
}

#[test]
fn a_stalled_watcher_keeps_no_record_the_window_let_go() {
    // As an attacker would: a consumer stops reading its watch while pods
    // with large annotations are created and deleted. The agent keeps the
    // records of its resume window (16 MiB), not the 300 the stalled
    // watcher has not read (240 KiB each: 70 MiB, under its buffer of 1024
    // changes, so a full buffer never cut it off before).
    if !ready("stalled-memory") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = dir.path().join("big");
    bundle::busybox(&b, &["true"], |c| {
        let big: serde_json::Map<String, serde_json::Value> = (0..60)
            .map(|i| (format!("test.lookout/a{i:02}"), "x".repeat(4096).into()))
            .collect();
        c["annotations"] = big.into();
    });
    let agent = Agent::start(&rt, &[]);
    let tokio = runtime();
    let socket = agent.socket().to_path_buf();
    let stalled = tokio.block_on(stalled_watch(&socket));
    let pid = agent.child.id();
    let before = rss_mib(pid);
    const CONTAINERS: usize = 150;
    let ids: Vec<String> = (0..CONTAINERS)
        .map(|i| format!("{}-{i}", id("stall")))
        .collect();
    std::thread::scope(|scope| {
        for chunk in ids.chunks(CONTAINERS / 3) {
            let (rt, b, agent) = (&rt, &b, &agent);
            scope.spawn(move || {
                for id in chunk {
                    one_shot(rt, b, id);
                    agent.wait_event(id, "removed", Duration::from_secs(30));
                    rt.cleanup(id);
                }
            });
        }
    });
    let grew = rss_mib(pid) - before;
    eprintln!("the agent grew by {grew:.1} MiB over {CONTAINERS} containers, a watcher stalled");
    // Measured: 25-26 MiB here; 75 when the stalled queue held them.
    assert!(
        grew < 48.0,
        "the agent grew by {grew:.1} MiB with a stalled watcher"
    );
    // It reads again: it fell behind the window and is told so.
    let status = tokio.block_on(end_status(stalled));
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("resume window"), "{status:?}");
}

#[test]
fn watch_resumes_without_loss_and_a_restarted_agent_sends_a_snapshot() {
    if !ready("watch_resume") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = busybox_bundle(dir.path(), "b", &["true"]);
    let socket = dir.path().join("sock/lookout.sock");
    let socket_arg = socket.to_str().expect("utf-8").to_owned();
    let agent = Agent::start(&rt, &["--socket", &socket_arg]);
    let tokio = runtime();
    let ids: Vec<String> = (0..6).map(|i| format!("{}-{i}", id("resume"))).collect();
    let set = |v: &[String]| v.iter().cloned().collect::<std::collections::HashSet<_>>();

    let (first, since) = tokio.block_on(async {
        let mut c = connect(&socket).await;
        let rev = c
            .list(pb::ListRequest::default())
            .await
            .expect("list")
            .into_inner()
            .revision;
        let mut s = c
            .watch(pb::WatchRequest {
                since: rev,
                filter: None,
            })
            .await
            .expect("watch")
            .into_inner();
        for id in &ids[..3] {
            one_shot(&rt, &b, id);
        }
        let got = collect(&mut s, &set(&ids[..3]), 6).await;
        let last = got.last().map(|g| g.1).expect("events");
        (got, last)
        // The stream is dropped here: a consumer that went away.
    });
    for id in &ids[3..] {
        one_shot(&rt, &b, id);
    }
    let resumed = tokio.block_on(async {
        let mut c = connect(&socket).await;
        let mut s = c
            .watch(pb::WatchRequest {
                since,
                filter: None,
            })
            .await
            .expect("watch")
            .into_inner();
        collect(&mut s, &set(&ids[3..]), 6).await
    });
    for id in &ids {
        rt.cleanup(id);
    }
    assert!(resumed.iter().all(|g| g.1 > since), "no duplicate");
    assert_eq!(first.len() + resumed.len(), 12, "no loss");

    // After an agent restart the old revision is unknown: a snapshot.
    drop(agent);
    let agent = Agent::start(&rt, &["--socket", &socket_arg]);
    let kinds = tokio.block_on(async {
        let mut c = connect(&socket).await;
        let mut s = c
            .watch(pb::WatchRequest {
                since,
                filter: None,
            })
            .await
            .expect("watch")
            .into_inner();
        let mut kinds = Vec::new();
        loop {
            let e = s.message().await.expect("ok").expect("open");
            kinds.push(e.kind);
            if e.kind == pb::watch_event::Kind::SnapshotEnd as i32 {
                assert!(e.revision > since, "revisions grow across restarts");
                return kinds;
            }
        }
    });
    assert!(
        kinds
            .iter()
            .all(|k| *k == pb::watch_event::Kind::Snapshot as i32
                || *k == pb::watch_event::Kind::SnapshotEnd as i32),
        "{kinds:?}"
    );
    drop(agent);
}

/// Runs in a child process as the unprivileged user (see below).
#[test]
fn peer_as_unprivileged_user() {
    let Ok(socket) = std::env::var("LOOKOUT_TEST_PEER_SOCKET") else {
        return; // Only as the child of the test below.
    };
    let tokio = runtime();
    if std::env::var_os("LOOKOUT_TEST_PEER_ONCE").is_some() {
        // Another uid, while the first holds its share of the connections.
        tokio
            .block_on(try_list(Path::new(&socket)))
            .expect("another uid lists while one holds its share");
        println!("PEER-CHECKED");
        return;
    }
    tokio.block_on(async {
        let mut c = connect(Path::new(&socket)).await;
        c.list(pb::ListRequest::default())
            .await
            .expect("List is open to the socket's group");
        let first = pb::GateRequest {
            msg: Some(pb::gate_request::Msg::Subscribe(pb::Subscribe {
                name: "intruder".into(),
                ..Default::default()
            })),
        };
        let r = c.gate(tokio_stream::iter(vec![first])).await;
        let code = match r {
            Err(s) => s.code(),
            Ok(mut s) => match s.get_mut().message().await {
                Err(st) => st.code(),
                Ok(_) => tonic::Code::Ok,
            },
        };
        assert_eq!(code, tonic::Code::PermissionDenied);
        // The parent started the agent with --api-max-connections-per-uid
        // 4: with `c` and three idle connections this peer holds its
        // share, and a fifth is closed as it is accepted.
        let held: Vec<_> = (0..3)
            .map(|_| std::os::unix::net::UnixStream::connect(&socket).expect("connect"))
            .collect();
        assert!(
            try_list(Path::new(&socket)).await.is_err(),
            "a connection past the limit was served"
        );
        println!("HOLDING");
        // Until the parent, as root, has listed through the full limit.
        let mut rest = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut rest).expect("stdin");
        // The three never sent a byte: the agent closes them after 5 s,
        // and their permits come back.
        let deadline = Instant::now() + Duration::from_secs(15);
        while try_list(Path::new(&socket)).await.is_err() {
            assert!(
                Instant::now() < deadline,
                "idle connections kept their permits"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for mut h in held {
            h.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            // The agent's own SETTINGS frame, then the end.
            let mut b = Vec::new();
            let end = std::io::Read::read_to_end(&mut h, &mut b);
            assert!(
                end.is_ok() || end.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
                "an idle connection was not closed"
            );
        }
        drop(c);
    });
    println!("PEER-CHECKED");
}

/// A `List` on a connection of its own, within 5 s.
async fn try_list(socket: &Path) -> Result<(), String> {
    let attempt = async {
        let channel = channel(socket, None).await.map_err(|e| e.to_string())?;
        LookoutClient::new(channel)
            .list(pb::ListRequest::default())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .map_err(|_| "no answer within 5 s".to_owned())?
}

#[test]
fn an_unprivileged_peer_may_list_but_not_gate() {
    if !ready("peer_gate") {
        return;
    }
    let Some(user) = unprivileged_user("peer_gate") else {
        return;
    };
    let rt = Runtime::runc();
    let dir = tempfile::Builder::new()
        .prefix("lk-peer-")
        .tempdir()
        .expect("tempdir");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let socket = dir.path().join("api/lookout.sock");
    let gid = user.gid.to_string();
    let agent = Agent::start(
        &rt,
        &[
            "--socket",
            socket.to_str().expect("utf-8"),
            "--socket-group",
            &gid,
            "--api-max-connections",
            "8",
            "--api-max-connections-per-uid",
            "4",
        ],
    );
    // This test binary, readable by the user, run as them for one test.
    let exe = std::env::current_exe().expect("current exe");
    let copy = dir.path().join("peer");
    lookout_testsupport::install_executable(&exe, &copy).expect("copy the test binary");
    let mut cmd = std::process::Command::new(&copy);
    cmd.args(["--exact", "peer_as_unprivileged_user", "--nocapture"])
        .env("LOOKOUT_TEST_PEER_SOCKET", &socket)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    user.apply(&mut cmd);
    // The connections open before the peer's (none, unless the agent
    // opened its own).
    let open = |m: &str| metric(m, "lookout_api_connections").unwrap_or(f64::NAN);
    let before = open(&agent.metrics());
    let mut peer = cmd.spawn().expect("run the peer");
    // Its stdout, line by line, to a channel (a peer that hangs fails the
    // wait below, not the test run).
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = peer.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
            all.push_str(&line);
            all.push('\n');
            let _ = lines_tx.send(line);
        }
        all
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) if l.contains("HOLDING") => break,
            Ok(_) => continue,
            Err(_) => panic!(
                "the peer did not say it holds the connection limit (it failed, or hung for 30 s)"
            ),
        }
    }
    // Operators see it too (before the agent closes the three silent
    // connections, 5 s after they came): the refusal counted by reason,
    // the peer's connections in the gauge.
    let m = agent.metrics();
    assert!(
        metric(
            &m,
            "lookout_api_connections_refused_total{reason=\"per-uid\"}"
        )
        .is_some_and(|n| n >= 1.0),
        "{m}"
    );
    assert!(open(&m) >= before + 4.0, "the peer holds four: {m}");
    // Root is not counted: it gets in while the peer holds every permit.
    runtime().block_on(async {
        connect(&socket)
            .await
            .list(pb::ListRequest::default())
            .await
            .expect("root lists past the limit of the others")
    });
    // Another uid (the same group) gets in meanwhile.
    let mut other = std::process::Command::new(&copy);
    other
        .args(["--exact", "peer_as_unprivileged_user", "--nocapture"])
        .env("LOOKOUT_TEST_PEER_SOCKET", &socket)
        .env("LOOKOUT_TEST_PEER_ONCE", "1");
    lookout_testsupport::User {
        uid: user.uid + 1,
        gid: user.gid,
    }
    .apply(&mut other);
    let out = other.output().expect("run the other peer");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("PEER-CHECKED"),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    agent.wait_log(
        "consumer API connection refused: this uid holds --api-max-connections-per-uid",
        Duration::from_secs(5),
    );
    drop(peer.stdin.take());
    let out = peer.wait_with_output().expect("the peer ends");
    // ... and given back as they close.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = agent.metrics();
        if open(&m) <= before {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the peer's connections stayed counted: {m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = reader.join().expect("reader") + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("PEER-CHECKED"),
        "{text}"
    );
    assert!(
        agent
            .log()
            .lines()
            .any(|l| l.contains("connection refused: this uid")
                && l.contains(&format!(" uid={}", user.uid))),
        "the refusal names the peer"
    );
    agent.wait_log("Gate refused", Duration::from_secs(5));
    assert!(
        agent.log().contains(&format!("uid={}", user.uid)),
        "the refusal names the peer"
    );
}

#[test]
fn lookout_get_and_watch_show_the_nodes_containers() {
    if !ready("get_watch") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = busybox_bundle(dir.path(), "b", &["true"]);
    let agent = Agent::start(&rt, &[]);
    let socket = agent.socket().to_str().expect("utf-8").to_owned();
    // `watch -o json` from before the container exists.
    let mut watch = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_lookout"))
            .args(["watch", "-o", "json", "--socket", &socket])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("lookout watch"),
    );
    let lines = watch.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(lines).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    // The snapshot ends before anything else: then the container.
    let until = |pred: &dyn Fn(&serde_json::Value) -> bool, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("lookout watch printed no {what} within 15 s"));
            let v: serde_json::Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("lookout watch printed {line:?}: {e}"));
            if pred(&v) {
                return v;
            }
        }
    };
    until(
        &|v| v.to_string().to_lowercase().contains("snapshot"),
        "snapshot",
    );
    let id = id("get-and-watch");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    agent.wait_event(&id, "added", Duration::from_secs(10));
    let added = until(&|v| v.to_string().contains(&id), "event for the container");
    assert!(
        added.to_string().to_lowercase().contains("added"),
        "{added}"
    );

    let get = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lookout"))
            .arg("get")
            .args(args)
            .args(["--socket", &socket])
            .output()
            .expect("lookout get");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let table = get(&[]);
    let header = table.lines().next().unwrap_or_default();
    for col in [
        "ID",
        "RUNTIME",
        "NAMESPACE/POD",
        "CONTAINER",
        "PID",
        "AGE",
        "SOURCE",
    ] {
        assert!(header.contains(col), "{table}");
    }
    let row = table
        .lines()
        .find(|l| l.starts_with(&id[..13]))
        .unwrap_or_else(|| panic!("no row for {id}: {table}"));
    assert!(
        row.contains("runc") && row.contains("runtime-hook"),
        "{row}"
    );
    let json: serde_json::Value = serde_json::from_str(&get(&["-o", "json"])).expect("json");
    let c = json["containers"]
        .as_array()
        .and_then(|v| v.iter().find(|c| c["id"] == id.as_str()))
        .unwrap_or_else(|| panic!("{id} not in {json}"))
        .clone();
    assert!(c["pid"].as_u64().unwrap_or(0) > 1, "{c}");
    assert!(json["revision"].as_u64().unwrap_or(0) > 0, "{json}");
    rt.cleanup(&id);
    until(
        &|v| v.to_string().contains(&id) && v.to_string().to_lowercase().contains("removed"),
        "removal",
    );
}
