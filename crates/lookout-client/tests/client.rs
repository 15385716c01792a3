//! The client against `common::FakeAgent`, a stand-in for the agent's API
//! server on a Unix socket in a temporary directory. The agent's real server
//! has its own end-to-end tests.
//!
//! No test sleeps to wait for something: every wait is on an event, bounded
//! by `common::DEADLINE`.

mod common;

use std::time::Duration;

use common::{FakeAgent, container, trace, within};
use futures::StreamExt;
use futures::stream::FusedStream;
use lookout_client::{Client, ConnectOptions, Error, Event, Filter, GateOptions, OnFailure, proto};
use tracing::instrument::WithSubscriber;

/// Retries quickly and long enough for any of these tests.
/// A fake agent keeping `history` changes, on a socket of its own, and a
/// client connected to it.
async fn agent_and_client(history: usize) -> (tempfile::TempDir, FakeAgent, Client) {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, history);
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    (dir, agent, client)
}

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
        .expect("the watcher goes on")
        .expect("an event");
    summary(&event)
}

/// Both streams stay what they were before they were streams: they can be
/// moved to other tasks, shared and polled without pinning.
#[test]
fn the_streams_are_send_sync_and_unpin() {
    fn send_sync_unpin<T: Send + Sync + Unpin>() {}
    send_sync_unpin::<lookout_client::Watcher>();
    send_sync_unpin::<lookout_client::Gate>();
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
    let event = within("removed", watcher.next())
        .await
        .expect("the watcher goes on")
        .expect("an event");
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
    let (_dir, agent, client) = agent_and_client(100).await;
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
    let event = event.expect("the watcher goes on").expect("resumed");
    assert_eq!(summary(&event), (2, "added b".into()));
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

#[tokio::test]
async fn a_watcher_is_a_stream() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    agent.add(container("a", "runc", "default", "web"));
    let client = Client::connect_with(&socket, options())
        .await
        .expect("connect");
    let mut watcher = client.watch(Filter::all()).await.expect("watch");
    agent.add(container("b", "runc", "default", "web"));
    agent.remove("a", 0);
    let events: Vec<(u64, String)> = within(
        "three events",
        watcher
            .by_ref()
            .take(3)
            .map(|event| summary(&event.expect("an event")))
            .collect(),
    )
    .await;
    assert_eq!(
        events,
        [
            (1, "snapshot a".into()),
            (2, "added b".into()),
            (3, "removed a".into())
        ]
    );
    // `by_ref`: the watcher goes on where the combinator stopped.
    assert_eq!(watcher.revision(), 3);
    assert!(!watcher.is_terminated());
}

#[tokio::test]
async fn a_cancelled_next_loses_nothing() {
    let (_dir, agent, client) = agent_and_client(100).await;
    let mut watcher = client.watch(Filter::all()).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (0, "snapshot ".into()));
    // Each `next` is cut short by a timer before the change comes ...
    for _ in 0..3 {
        tokio::select! {
            event = watcher.next() => panic!("no change yet, got {event:?}"),
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    // ... and none of them took one away.
    agent.add(container("a", "runc", "default", "web"));
    agent.add(container("b", "runc", "default", "web"));
    assert_eq!(next(&mut watcher).await, (1, "added a".into()));
    assert_eq!(next(&mut watcher).await, (2, "added b".into()));
    assert_eq!(agent.watch_calls(), [0]);
}

#[tokio::test]
async fn an_outage_longer_than_the_window_is_an_error_and_the_watcher_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let mut agent = FakeAgent::start(&socket, 100);
    agent.add(container("a", "runc", "default", "web"));
    let briefly = options().retry_for(Duration::from_millis(100));
    let client = Client::connect_with(&socket, briefly)
        .await
        .expect("connect");
    let mut watcher = client.watch(Filter::all()).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (1, "snapshot a".into()));

    agent.stop().await;
    agent.add(container("b", "runc", "default", "web"));
    let error = within("the window to pass", watcher.next())
        .await
        .expect("the watcher goes on")
        .expect_err("no agent");
    assert!(matches!(error, Error::SocketMissing { .. }), "{error:?}");
    assert!(error.is_retryable());
    assert!(!watcher.is_terminated());

    // Polled again, it tries anew and resumes where it was.
    agent.serve();
    assert_eq!(next(&mut watcher).await, (2, "added b".into()));
}

#[tokio::test]
async fn a_non_retryable_error_ends_the_watcher() {
    let (_dir, agent, client) = agent_and_client(100).await;
    let mut watcher = client.watch(Filter::all()).await.expect("watch");
    assert_eq!(next(&mut watcher).await, (0, "snapshot ".into()));

    agent.cut(tonic::Code::PermissionDenied);
    let error = within("the error", watcher.next())
        .await
        .expect("the error first")
        .expect_err("refused");
    assert_eq!(error.code(), Some(tonic::Code::PermissionDenied));
    assert!(!error.is_retryable());
    // Then the end, for good: no reconnect.
    assert!(within("the end", watcher.next()).await.is_none());
    assert!(watcher.is_terminated());
    assert!(within("the end", watcher.next()).await.is_none());
    assert_eq!(agent.watch_calls(), [0]);
    assert_eq!(watcher.revision(), 0);
}

// --- gate ---

fn subscribe(name: &str, filter: Filter) -> GateOptions {
    GateOptions::new(name)
        .filter(filter)
        .deadline(Duration::from_millis(500))
        .on_failure(OnFailure::FailClosed)
}

#[tokio::test]
async fn gate_holds_are_answered_and_the_agent_sees_the_decisions() {
    let (_dir, agent, client) = agent_and_client(100).await;
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
    let (_dir, agent, client) = agent_and_client(100).await;
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
    let (_dir, agent, client) = agent_and_client(100).await;
    let gate = client
        .gate(subscribe("tracer", Filter::all()))
        .await
        .expect("subscribed");
    drop(gate);
    let end = agent.next_gate_end().await;
    assert!(end.starts_with("tracer: "), "{end}");
}

#[tokio::test]
async fn a_gate_is_a_stream() {
    let (_dir, agent, client) = agent_and_client(100).await;
    let mut gate = client
        .gate(GateOptions::new("tracer"))
        .await
        .expect("subscribed");
    // The agent's defaults: its deadline.
    assert_eq!(gate.deadline(), Duration::from_secs(2));
    let first = agent.hold(container("a", "runc", "default", "web"), true);
    let second = agent.hold(container("b", "runc", "default", "web"), true);
    // `by_ref`: the gate must outlive its guards' answers.
    let guards: Vec<_> = within(
        "two holds",
        gate.by_ref()
            .take(2)
            .map(|guard| guard.expect("a hold"))
            .collect(),
    )
    .await;
    let ids: Vec<u64> = guards.iter().map(|g| g.hold_id()).collect();
    assert_eq!(ids, [first, second]);
    for guard in guards {
        guard.allow().expect("sent");
    }
    let decisions = [agent.next_decision().await, agent.next_decision().await];
    assert!(decisions.iter().all(|d| d.allow), "{decisions:?}");
}

#[tokio::test]
async fn the_gate_ends_when_the_agent_ends_it_and_none_comes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let mut agent = FakeAgent::start(&socket, 100);
    let briefly = options().retry_for(Duration::from_millis(100));
    let client = Client::connect_with(&socket, briefly)
        .await
        .expect("connect");
    let mut gate = client
        .gate(subscribe("tracer", Filter::all()))
        .await
        .expect("subscribed");
    // Polled while the agent stops: the fake ends each gate stream as it
    // stops (and waits for the client's half to end); none takes it again.
    let ended = tokio::spawn(async move {
        let end = gate.next().await;
        (gate, end)
    });
    agent.stop().await;
    let (mut gate, end) = within("the end", ended).await.expect("task");
    assert!(end.is_none(), "{end:?}");
    assert!(gate.is_terminated());
    assert!(within("the end", gate.next()).await.is_none());
    assert_eq!(gate.name(), "tracer");
}

#[tokio::test]
async fn a_gate_refused_on_resubscribing_is_an_error_then_the_end() {
    let (_dir, mut agent, client) = agent_and_client(100).await;
    let mut gate = client
        .gate(subscribe("tracer", Filter::all()))
        .await
        .expect("subscribed");
    // A new agent that does not allow this peer.
    let refused = tokio::spawn(async move {
        let error = gate.next().await;
        (gate, error)
    });
    agent.stop().await;
    agent.deny_gate();
    agent.serve();
    let (mut gate, error) = within("the refusal", refused).await.expect("task");
    let error = error.expect("the error first").expect_err("refused");
    assert_eq!(error.code(), Some(tonic::Code::PermissionDenied));
    assert!(within("the end", gate.next()).await.is_none());
    assert!(gate.is_terminated());
}

#[tokio::test]
async fn the_gate_subscribes_again_to_an_agent_that_comes_back() {
    let (_dir, mut agent, client) = agent_and_client(100).await;
    let mut gate = client
        .gate(subscribe("tracer", Filter::all()))
        .await
        .expect("subscribed");
    let resumed = tokio::spawn(async move {
        let hold = gate.next().await;
        (gate, hold)
    });
    agent.stop().await;
    agent.serve();
    // The first subscription, then the same gate's again.
    agent.wait_subscriptions(2).await;
    let hold_id = agent.hold(container("a", "runc", "default", "web"), true);
    let (gate, hold) = within("the hold", resumed).await.expect("task");
    let guard = hold.expect("the gate goes on").expect("a hold");
    assert_eq!(guard.hold_id(), hold_id);
    guard.allow().expect("sent");
    assert_eq!(agent.next_decision().await.hold_id, hold_id);
    assert!(!gate.is_terminated());
}
