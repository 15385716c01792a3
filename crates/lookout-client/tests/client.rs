//! The client against `common::FakeAgent`, a stand-in for the agent's API
//! server on a Unix socket in a temporary directory. The agent's real server
//! has its own end-to-end tests.
//!
//! No test sleeps to wait for something: every wait is on an event, bounded
//! by `common::DEADLINE`.

mod common;

use std::time::Duration;

use common::{FakeAgent, container, trace, within};
use lookout_client::{Client, ConnectOptions, Error, Event, Filter, proto};
use tracing::instrument::WithSubscriber;

/// Retries quickly and long enough for any of these tests.
fn options() -> ConnectOptions {
    ConnectOptions::new()
        .retry_for(common::DEADLINE)
        .initial_backoff(Duration::from_millis(5))
        .max_backoff(Duration::from_millis(100))
}

fn ids(containers: &[proto::Container]) -> Vec<&str> {
    containers.iter().map(|c| c.id.as_str()).collect()
}

/// The revision and kind of an event, for compact assertions.
fn summary(event: &Event) -> (u64, String) {
    match event {
        Event::Snapshot {
            revision,
            containers,
        } => (*revision, format!("snapshot {}", ids(containers).join(","))),
        Event::Added {
            revision,
            container,
            ..
        } => (*revision, format!("added {}", container.id)),
        Event::Removed {
            revision,
            container,
            ..
        } => (*revision, format!("removed {}", container.id)),
        other => panic!("unexpected event {other:?}"),
    }
}

async fn next(watcher: &mut lookout_client::Watcher) -> (u64, String) {
    let event = within("a watch event", watcher.next())
        .await
        .expect("an event");
    summary(&event)
}

// --- connect ---

#[tokio::test]
async fn connect_retries_until_the_socket_appears() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let (subscriber, mut messages) = trace::capture();
    let connecting =
        tokio::spawn(Client::connect_with(socket.clone(), options()).with_subscriber(subscriber));
    // The client has tried and failed at least once before the agent starts.
    trace::wait_for(&mut messages, "retrying").await;
    let agent = FakeAgent::start(&socket, 100);
    agent.add(container("a", "runc", "default", "web"));
    let client = within("connect", connecting)
        .await
        .expect("connect task")
        .expect("connected once the socket appeared");
    let (revision, containers) = client.list(Filter::all()).await.expect("list");
    assert_eq!((revision, ids(&containers)), (1, vec!["a"]));
}

#[tokio::test]
async fn a_missing_socket_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let once = ConnectOptions::new().retry_for(Duration::ZERO);
    let error = Client::connect_with(&socket, once)
        .await
        .expect_err("no agent");
    assert!(matches!(error, Error::SocketMissing { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains(&socket.display().to_string()), "{message}");
    assert!(message.contains("does not exist"), "{message}");

    // With a retry window, the same error once the window has passed.
    let briefly = options().retry_for(Duration::from_millis(200));
    let error = within(
        "the retry window to pass",
        Client::connect_with(&socket, briefly),
    )
    .await
    .expect_err("still no agent");
    assert!(matches!(error, Error::SocketMissing { .. }), "{error:?}");
}

// --- list ---

#[tokio::test]
async fn list_returns_the_revision_and_the_matching_containers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    let mut labelled = container("b", "crun", "payments", "api");
    if let Some(k8s) = labelled.kubernetes.as_mut() {
        k8s.labels.insert("app".into(), "api".into());
    }
    labelled.annotations.insert("team".into(), "core".into());
    agent.add(container("a", "runc", "default", "web"));
    agent.add(labelled);
    agent.add(container("c", "runsc", "payments", "db"));
    agent.add(proto::Container {
        id: "d".into(),
        runtime: "runc".into(),
        ..Default::default()
    });
    agent.remove("d", 0);

    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let list = |filter| {
        let client = client.clone();
        async move {
            let (revision, containers) = client.list(filter).await.expect("list");
            (revision, ids(&containers).join(","))
        }
    };
    assert_eq!(list(Filter::all()).await, (5, "a,b,c".into()));
    assert_eq!(
        list(Filter::all().runtime("runc").runtime("crun")).await,
        (5, "a,b".into())
    );
    assert_eq!(
        list(Filter::all().namespace("payments")).await,
        (5, "b,c".into())
    );
    assert_eq!(
        list(Filter::all().pod_label("app", "api")).await,
        (5, "b".into())
    );
    assert_eq!(
        list(Filter::all().annotation("team", "core")).await,
        (5, "b".into())
    );
    let none = Filter::all().namespace("payments").runtime("runc");
    assert_eq!(list(none).await, (5, String::new()));
}

// --- watch ---

#[tokio::test]
async fn watch_starts_with_a_snapshot_then_passes_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    agent.add(container("a", "runc", "default", "web"));
    agent.add(container("b", "runc", "default", "web"));
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");

    let mut watcher = client.watch(Filter::all()).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (2, "snapshot a,b".into()));
    agent.add(container("c", "runc", "default", "web"));
    assert_eq!(next(&mut watcher).await, (3, "added c".into()));
    agent.remove("a", 137);
    let event = within("removed", watcher.next()).await.expect("an event");
    match event {
        Event::Removed {
            revision,
            container,
            exit_code,
            ..
        } => assert_eq!(
            (revision, container.id.as_str(), exit_code),
            (4, "a", Some(137))
        ),
        other => panic!("expected Removed, got {other:?}"),
    }
    assert_eq!(watcher.revision(), 4);
}

#[tokio::test]
async fn an_empty_node_is_an_empty_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let mut watcher = client.watch(Filter::all()).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (0, "snapshot ".into()));
    agent.add(container("a", "runc", "default", "web"));
    assert_eq!(next(&mut watcher).await, (1, "added a".into()));
}

#[tokio::test]
async fn list_then_watch_since_goes_on_without_loss_or_duplicate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    agent.add(container("a", "runc", "default", "web"));
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let (revision, _) = client.list(Filter::all()).await.expect("list");
    agent.add(container("b", "runc", "default", "web"));
    let mut watcher = client
        .watch_since(Filter::all(), revision)
        .await
        .expect("watch");
    assert_eq!(next(&mut watcher).await, (2, "added b".into()));
    assert_eq!(agent.watch_calls(), [1]);
}

#[tokio::test]
async fn watch_resumes_after_the_agent_cuts_the_stream() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    // On resume the agent also resends two changes the client has seen.
    agent.replay_overlap(2);
    agent.add(container("a", "runc", "default", "web"));
    agent.add(container("b", "runc", "default", "web"));
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let mut watcher = client.watch(Filter::all()).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (2, "snapshot a,b".into()));

    agent.add(container("c", "runc", "default", "web"));
    assert_eq!(next(&mut watcher).await, (3, "added c".into()));
    // A slow consumer's disconnect; the changes after it come on the
    // resumed stream.
    agent.cut(tonic::Code::ResourceExhausted);
    agent.add(container("d", "runc", "default", "web"));
    agent.add(container("e", "runc", "default", "web"));

    assert_eq!(next(&mut watcher).await, (4, "added d".into()));
    assert_eq!(next(&mut watcher).await, (5, "added e".into()));
    agent.remove("c", 0);
    assert_eq!(next(&mut watcher).await, (6, "removed c".into()));
    assert_eq!(watcher.revision(), 6);

    // One resume, from the last revision seen.
    assert_eq!(agent.watch_calls(), [0, 3]);
}

#[tokio::test]
async fn watch_resumes_across_an_agent_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let mut agent = FakeAgent::start(&socket, 100);
    agent.add(container("a", "runc", "default", "web"));
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let mut watcher = client.watch(Filter::all()).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (1, "snapshot a".into()));

    agent.stop().await;
    assert!(!socket.exists());
    // Changes while the agent is down (as its state file would keep them).
    agent.add(container("b", "runc", "default", "web"));
    let (subscriber, mut messages) = trace::capture();
    let resumed = tokio::spawn(
        async move {
            let event = watcher.next().await;
            (watcher, event)
        }
        .with_subscriber(subscriber),
    );
    // The watcher found the socket gone and keeps trying.
    trace::wait_for(&mut messages, "retrying").await;
    agent.serve();
    let (mut watcher, event) = within("the watcher to resume", resumed)
        .await
        .expect("task");
    assert_eq!(summary(&event.expect("resumed")), (2, "added b".into()));
    agent.add(container("c", "runc", "default", "web"));
    assert_eq!(next(&mut watcher).await, (3, "added c".into()));
    assert_eq!(agent.watch_calls(), [0, 1]);
}

#[tokio::test]
async fn a_since_older_than_the_agent_retains_gets_a_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    // The agent keeps only the last two changes.
    let agent = FakeAgent::start(&socket, 2);
    for id in ["a", "b", "c", "d", "e"] {
        agent.add(container(id, "runc", "default", "web"));
    }
    agent.remove("b", 0);
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");

    // 4 and 5 are gone from the log: a snapshot, then live changes.
    let mut watcher = client.watch_since(Filter::all(), 3).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (6, "snapshot a,c,d,e".into()));
    agent.add(container("f", "runc", "default", "web"));
    assert_eq!(next(&mut watcher).await, (7, "added f".into()));

    // 6 and 7 are retained: no snapshot from 5.
    let mut watcher = client.watch_since(Filter::all(), 5).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (6, "removed b".into()));
    assert_eq!(next(&mut watcher).await, (7, "added f".into()));
}

// --- gate ---

fn subscribe(name: &str, filter: Filter) -> proto::Subscribe {
    proto::Subscribe {
        name: name.into(),
        filter: Some(filter.into()),
        deadline_ms: 500,
        on_failure: proto::FailurePolicy::FailClosed.into(),
    }
}

#[tokio::test]
async fn gate_holds_are_answered_and_the_agent_sees_the_decisions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let mut gate = client
        .gate(subscribe("tracer", Filter::all().namespace("payments")))
        .await
        .expect("subscribed");
    assert_eq!(gate.name(), "tracer");
    assert_eq!(gate.deadline(), Duration::from_millis(500));

    let hold_id = agent.hold(container("a", "runc", "payments", "api"), true);
    let guard = within("a hold", gate.next())
        .await
        .expect("open")
        .expect("a hold");
    assert!(guard.held());
    assert_eq!(
        (guard.hold_id(), guard.container().id.as_str()),
        (hold_id, "a")
    );
    guard.deny("not today").expect("sent");
    let decision = agent.next_decision().await;
    assert_eq!(
        decision,
        proto::Decision {
            hold_id,
            allow: false,
            reason: "not today".into(),
        }
    );

    let hold_id = agent.hold(container("b", "runc", "payments", "api"), true);
    let guard = within("a hold", gate.next())
        .await
        .expect("open")
        .expect("a hold");
    guard.allow().expect("sent");
    let decision = agent.next_decision().await;
    assert_eq!((decision.hold_id, decision.allow), (hold_id, true));
}

#[tokio::test]
async fn a_dropped_guard_allows_and_a_not_held_one_sends_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let mut gate = client
        .gate(subscribe("tracer", Filter::all()))
        .await
        .expect("subscribed");

    let dropped = agent.hold(container("a", "runc", "default", "web"), true);
    let guard = within("a hold", gate.next())
        .await
        .expect("open")
        .expect("a hold");
    drop(guard);
    let decision = agent.next_decision().await;
    assert_eq!(
        decision,
        proto::Decision {
            hold_id: dropped,
            allow: true,
            reason: lookout_client::DROPPED_UNANSWERED.into(),
        }
    );

    agent.hold(container("b", "runc", "default", "web"), false);
    let guard = within("a hold", gate.next())
        .await
        .expect("open")
        .expect("a hold");
    assert!(!guard.held());
    assert_eq!(guard.hold_id(), 0);
    guard.deny("too late").expect("nothing to send");
    // The next decision the agent sees is for the next held container: none
    // was sent for "b".
    let held = agent.hold(container("c", "runc", "default", "web"), true);
    let guard = within("a hold", gate.next())
        .await
        .expect("open")
        .expect("a hold");
    guard.allow_because("checked").expect("sent");
    let decision = agent.next_decision().await;
    assert_eq!(
        (decision.hold_id, decision.reason.as_str()),
        (held, "checked")
    );
}

#[tokio::test]
async fn a_gate_refused_by_the_agent_is_not_retried() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    agent.deny_gate();
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let error = within(
        "the refusal",
        client.gate(subscribe("tracer", Filter::all())),
    )
    .await
    .expect_err("refused");
    assert_eq!(
        error.code(),
        Some(tonic::Code::PermissionDenied),
        "{error:?}"
    );
    assert!(!error.is_retryable());
}

#[tokio::test]
async fn dropping_the_gate_ends_the_subscription() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let gate = client
        .gate(subscribe("tracer", Filter::all()))
        .await
        .expect("subscribed");
    drop(gate);
    let end = agent.next_gate_end().await;
    assert!(end.starts_with("tracer: "), "{end}");
}
