use super::*;
use lookout_model::{Kubernetes, RuntimeKind};
use lookout_model::{StartBarrier, StartWait};
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

fn hub(window: usize, buffer: usize) -> Arc<Hub> {
    let mut r = Registry::default();
    Hub::new(
        HubConfig {
            window,
            watch_buffer: buffer,
            ..HubConfig::default()
        },
        HubMetrics::register(&mut r),
    )
}

/// A [`SubscriptionStore`] in memory.
#[derive(Clone, Default)]
struct Saved(Arc<Mutex<Vec<(Subscription, u32)>>>);

impl SubscriptionStore for Saved {
    fn save(&self, subs: &[(Subscription, u32)]) {
        *lock(&self.0) = subs.to_vec();
    }

    fn load(&self) -> Vec<(Subscription, u32)> {
        lock(&self.0).clone()
    }
}

fn added(id: &str, status: Status) -> ContainerEvent {
    let mut c = Container::new(id, RuntimeKind::Runc);
    c.status = status;
    c.pid = Some(7);
    ContainerEvent::added(Source::RuntimeHook, c)
}

fn removed(id: &str) -> ContainerEvent {
    ContainerEvent::removed(
        Source::RuntimeHook,
        Container::new(id, RuntimeKind::Runc),
        Some(0),
    )
}

fn feed(h: &Arc<Hub>, e: ContainerEvent) {
    let mut s = HubSink::new(Arc::clone(h), |_e: ContainerEvent| {});
    s.emit(e);
}

fn now() -> impl std::future::Future<Output = ()> {
    tokio::time::sleep(Duration::ZERO)
}

#[tokio::test]
async fn watch_resumes_from_a_revision_without_loss_or_duplicate() {
    let h = hub(100, 100);
    feed(&h, added("a", Status::Running));
    let (rev, list) = h.list(&Filter::default());
    assert_eq!(list.len(), 1);
    feed(&h, added("b", Status::Running));
    feed(&h, removed("a"));
    let mut w = h.watch(rev, Filter::default()).expect("watch");
    let mut got = Vec::new();
    for _ in 0..2 {
        match w.next().await.expect("item") {
            WatchItem::Change(c) => got.push((c.revision - rev, c.live.container.id.clone())),
            WatchItem::Snapshot { .. } => panic!("no snapshot for a retained revision"),
        }
    }
    assert_eq!(got, [(1, "b".to_owned()), (2, "a".to_owned())]);
    now().await;
}

#[tokio::test]
async fn an_update_fills_a_live_container_and_stays_in_its_removal() {
    let h = hub(100, 100);
    let printed = Arc::new(Mutex::new(Vec::new()));
    let p = Arc::clone(&printed);
    let mut sink = HubSink::new(Arc::clone(&h), move |e: ContainerEvent| {
        lock(&p).push(e.event);
    });
    let mut w = h.watch(0, Filter::default()).expect("watch");
    sink.emit(added("a", Status::Created));
    let mut known = Container::new("a", RuntimeKind::Runc);
    known.name = Some("web1".into());
    known.labels.insert("app".into(), "shop".into());
    sink.emit(ContainerEvent::updated(Source::Docker, known.clone()));
    // The same again (a late second lookup): nothing new, no change.
    sink.emit(ContainerEvent::updated(Source::Docker, known));
    sink.emit(removed("a"));
    // An update of a container that is gone is no change, and no line.
    let mut late = Container::new("a", RuntimeKind::Runc);
    late.name = Some("late".into());
    sink.emit(ContainerEvent::updated(Source::Docker, late));
    let mut kinds = Vec::new();
    while kinds.len() < 3 {
        let item = tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("three changes");
        match item.expect("item") {
            WatchItem::Change(c) => {
                kinds.push(c.kind);
                if c.kind != EventKind::Added {
                    // The update, and the removal after it, carry the name.
                    assert_eq!(c.live.container.name.as_deref(), Some("web1"));
                    assert_eq!(c.live.container.labels["app"], "shop");
                    // The source and the time of `added` stay, and
                    // so does the pid: an update brings identity only.
                    assert_eq!(c.live.source, Source::RuntimeHook);
                    if c.kind == EventKind::Updated {
                        assert_eq!(c.live.container.pid, Some(7));
                    }
                }
            }
            WatchItem::Snapshot { .. } => {}
        }
    }
    assert_eq!(
        kinds,
        [EventKind::Added, EventKind::Updated, EventKind::Removed]
    );
    assert_eq!(
        *lock(&printed),
        [EventKind::Added, EventKind::Updated, EventKind::Removed]
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(50), w.next())
            .await
            .is_err()
    );
}

/// A removal reported by a backend that read nothing of the init (the
/// Pod informer), or read it once it was gone or its pid reused (NRI at
/// its stop), carries the keys the `added` carried: a watcher that
/// selects by cgroup id sees the container go, and a consumer deletes the
/// map entry it made.
#[tokio::test]
async fn a_removal_carries_the_kernel_view_of_the_live_container() {
    let h = hub(100, 100);
    let mut w = h
        .watch(
            0,
            Filter {
                cgroup_ids: vec![4242],
                ..Filter::default()
            },
        )
        .expect("watch");
    let mut live = Container::new("a", RuntimeKind::Runc);
    live.pid = Some(7);
    live.cgroup_id = Some(4242);
    live.cgroup = Some("/kubepods/a".into());
    live.namespaces.mnt = Some(11);
    live.namespaces.user = Some(12);
    feed(&h, ContainerEvent::added(Source::RuntimeHook, live));
    // Read after the exit: another process has the pid now.
    let mut late = Container::new("a", RuntimeKind::Runc);
    late.pid = Some(7);
    late.cgroup_id = Some(1);
    late.namespaces.mnt = Some(99);
    late.set_unresolved("id_maps", "/proc/7/uid_map cannot be read");
    feed(&h, ContainerEvent::removed(Source::Nri, late, None));
    // And one that never read anything, for another container.
    let mut other = Container::new("b", RuntimeKind::Runc);
    other.pid = Some(8);
    other.cgroup_id = Some(4242);
    feed(&h, ContainerEvent::added(Source::RuntimeHook, other));
    feed(
        &h,
        ContainerEvent::removed(
            Source::Informer,
            Container::new("b", RuntimeKind::Runc),
            None,
        ),
    );
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let item = tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("four changes");
        if let WatchItem::Change(c) = item.expect("item") {
            seen.push((c.kind, Arc::clone(&c.live.container)));
        }
    }
    let kinds: Vec<_> = seen.iter().map(|(k, c)| (*k, c.id.as_str())).collect();
    assert_eq!(
        kinds,
        [
            (EventKind::Added, "a"),
            (EventKind::Removed, "a"),
            (EventKind::Added, "b"),
            (EventKind::Removed, "b")
        ]
    );
    let gone = &seen[1].1;
    assert_eq!(gone.cgroup_id, Some(4242));
    assert_eq!(gone.namespaces.mnt, Some(11));
    assert_eq!(gone.namespaces.user, Some(12));
    assert_eq!(gone.cgroup.as_deref(), Some("/kubepods/a"));
    assert!(gone.unresolved.is_empty(), "{:?}", gone.unresolved);
    assert_eq!(gone.status, Status::Stopped);
    assert_eq!(seen[3].1.pid, Some(8));
    assert_eq!(seen[3].1.cgroup_id, Some(4242));
}

/// What a watcher from `since` gets next: the changes' (revision, id),
/// or the snapshot's revision as (revision, "snapshot").
async fn next_items(h: &Hub, since: u64, n: usize) -> Vec<(u64, String)> {
    let mut w = h.watch(since, Filter::default()).expect("watch");
    let mut got = Vec::new();
    while got.len() < n {
        match w.next().await.expect("item") {
            WatchItem::Change(c) => got.push((c.revision, c.live.container.id.clone())),
            WatchItem::Snapshot { revision, .. } => got.push((revision, "snapshot".into())),
        }
    }
    got
}

/// Feeds `old`'s log from `since` into the standby `new`, as the
/// mirror does.
async fn mirror_all(old: &Hub, new: &Hub) {
    let (rev, live) = old.list(&Filter::default());
    if new.revision_mirrored() == 0 {
        new.mirror_snapshot(rev, live);
    }
    let since = new.revision_mirrored();
    let mut w = old.watch(since, Filter::default()).expect("watch");
    while old.revision() > new.revision_mirrored() {
        if let WatchItem::Change(c) = w.next().await.expect("item") {
            new.mirror_change((*c).clone());
        }
    }
}

#[tokio::test]
async fn a_successor_continues_the_revisions_and_adds_only_what_it_saw_alone() {
    let old = hub(100, 100);
    let new = hub(100, 100);
    feed(&old, added("a", Status::Running));
    feed(&old, added("b", Status::Running));
    new.stand_by();
    mirror_all(&old, &new).await;
    // Both see c; the new one alone saw d (the old one was stopping)
    // and a go.
    feed(&old, added("c", Status::Running));
    feed(&new, added("c", Status::Running));
    feed(&new, added("d", Status::Running));
    feed(&new, removed("a"));
    assert!(new.standing_by());
    assert_eq!(
        new.list(&Filter::default()).1.len(),
        2,
        "own reports kept aside"
    );
    mirror_all(&old, &new).await;
    let last = old.revision();
    // A consumer of the old agent at `last - 1` (it saw a and b).
    let t = new.take_over(true);
    assert_eq!(
        (t.mirrored, t.next, t.added, t.removed),
        (last, last + 1, 1, 1)
    );
    let got = next_items(&new, last - 1, 3).await;
    assert_eq!(
        got,
        [
            (last, "c".to_owned()),
            (last + 1, "a".to_owned()),
            (last + 2, "d".to_owned())
        ]
    );
    let ids: Vec<String> = new
        .list(&Filter::default())
        .1
        .iter()
        .map(|l| l.container.id.clone())
        .collect();
    assert_eq!(ids.len(), 3);
    for id in ["b", "c", "d"] {
        assert!(ids.contains(&id.to_owned()), "{ids:?}");
    }
    now().await;
}

#[tokio::test]
async fn late_own_reports_of_a_container_the_predecessor_removed_change_nothing() {
    let old = hub(100, 100);
    let new = hub(100, 100);
    new.stand_by();
    let early = added("x", Status::Running);
    feed(&old, early.clone());
    mirror_all(&old, &new).await;
    feed(&old, removed("x"));
    mirror_all(&old, &new).await;
    new.take_over(true);
    let rev = new.list(&Filter::default()).0;
    // Its own reports, observed before the takeover, arrive late.
    feed(&new, early);
    feed(&new, removed("x"));
    assert_eq!(new.list(&Filter::default()).0, rev, "no change for them");
    // The same id created again afterwards is another container.
    feed(&new, added("x", Status::Running));
    feed(&new, removed("x"));
    assert_eq!(new.list(&Filter::default()).0, rev + 2);
    now().await;
}

#[tokio::test]
async fn after_an_unclean_end_revisions_jump_and_a_resume_inside_the_gap_gets_a_snapshot() {
    let old = hub(100, 100);
    let new = hub(100, 100);
    feed(&old, added("a", Status::Running));
    new.stand_by();
    mirror_all(&old, &new).await;
    let seen = old.revision();
    // The old agent issued one more change that never reached the new
    // one (it was killed), and a consumer saw it.
    feed(&old, added("b", Status::Running));
    let consumer = old.revision();
    feed(&new, added("b", Status::Running));
    let t = new.take_over(false);
    assert_eq!(t.mirrored, seen);
    assert_eq!(t.next, seen + REVISION_GAP);
    // The consumer that saw b at `consumer` gets a snapshot, not the
    // new agent's next change (which is also b, under another number).
    let got = next_items(&new, consumer, 1).await;
    assert_eq!(got, [(seen + REVISION_GAP, "snapshot".to_owned())]);
    // One that stopped before the gap resumes exactly.
    let got = next_items(&new, seen, 1).await;
    assert_eq!(got, [(seen + REVISION_GAP, "b".to_owned())]);
    now().await;
}

#[tokio::test]
async fn a_predecessors_gates_hold_starts_until_their_own_subscriber_is_back() {
    let store = Saved::default();
    let sub = |name: &str, on_failure| Subscription {
        name: name.into(),
        filter: Filter::default(),
        deadline: Duration::from_millis(300),
        on_failure,
    };
    // What the old agent recorded: two fail-closed gates of uid 1000.
    store.save(&[
        (sub("tracer", FailurePolicy::Closed), 1000),
        (sub("gone", FailurePolicy::Closed), 1000),
    ]);
    let h = hub(100, 100);
    h.keep_subscriptions(store);
    h.stand_by();
    h.take_over(true);
    let barrier = GateBarrier(Arc::clone(&h));
    feed(&h, added("c1", Status::Created));
    let wait = barrier.wait("c1").expect("held for the parked gates");
    // Another uid naming itself alike gets a gate of its own, not the
    // parked one's holds.
    let mut impostor = h
        .gate_as(sub("tracer", FailurePolicy::Open), 2000)
        .expect("gate");
    let mut back = h
        .gate_as(sub("tracer", FailurePolicy::Closed), 1000)
        .expect("gate");
    let hold = back.holds.recv().await.expect("the queued hold");
    assert_eq!(hold.live.container.id, "c1");
    assert!(
        impostor.holds.try_recv().is_err(),
        "no hold for the impostor"
    );
    let _ = hold.respond.expect("held").send(Verdict::Allow);
    // "gone" never came back: its policy at its deadline.
    match wait.await {
        StartDecision::Deny(reason) => {
            assert!(
                reason.contains("gone") && reason.contains("fail-closed"),
                "{reason}"
            )
        }
        d => panic!("fail-closed gate without its subscriber: {d:?}"),
    }
    now().await;
}

#[tokio::test]
async fn a_closed_hub_ends_its_watches_after_their_changes_and_refuses_new_ones() {
    let h = hub(100, 100);
    let mut w = h.watch(h.revision(), Filter::default()).expect("watch");
    feed(&h, added("a", Status::Running));
    h.close();
    assert!(matches!(w.next().await, Ok(WatchItem::Change(_))));
    assert!(matches!(w.next().await, Err(WatchEnd::Closed)));
    assert_eq!(h.watches_open(), 1);
    drop(w);
    assert_eq!(h.watches_open(), 0);
    assert!(matches!(
        h.watch(0, Filter::default()),
        Err(Refused::Closing)
    ));
    now().await;
}

#[tokio::test]
async fn a_revision_older_than_the_window_gets_a_snapshot() {
    let h = hub(2, 100);
    let (rev0, _) = h.list(&Filter::default());
    for id in ["a", "b", "c", "d"] {
        feed(&h, added(id, Status::Running));
    }
    let mut w = h.watch(rev0, Filter::default()).expect("watch");
    match w.next().await.expect("item") {
        WatchItem::Snapshot {
            revision,
            containers,
        } => {
            assert_eq!(revision, rev0 + 4);
            assert_eq!(containers.len(), 4);
        }
        WatchItem::Change(_) => panic!("expected a snapshot"),
    }
    // A revision of an earlier agent process (smaller than this one's
    // start) gets one too, even before this one logged anything.
    let fresh = hub(2, 100);
    assert!(matches!(
        fresh
            .watch(rev0, Filter::default())
            .expect("watch")
            .next()
            .await,
        Ok(WatchItem::Snapshot { .. })
    ));
    let (now, _) = fresh.list(&Filter::default());
    let mut quiet = fresh.watch(now, Filter::default()).expect("watch");
    feed(&fresh, added("e", Status::Running));
    assert!(
        matches!(quiet.next().await, Ok(WatchItem::Change(_))),
        "nothing missed: no snapshot"
    );
    assert!(matches!(
        h.watch(1, Filter::default()).expect("watch").next().await,
        Ok(WatchItem::Snapshot { .. })
    ));
}

#[tokio::test]
async fn a_watcher_that_stops_reading_is_dropped_without_blocking() {
    let h = hub(100, 4);
    let mut slow = h
        .watch(h.list(&Filter::default()).0, Filter::default())
        .expect("watch");
    for i in 0..10 {
        feed(&h, added(&format!("c{i}"), Status::Running));
    }
    let mut n = 0;
    let end = loop {
        match slow.next().await {
            Ok(_) => n += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(n, 4, "what was buffered is delivered");
    assert_eq!(end, WatchEnd::Lagged(4));
}

#[tokio::test]
async fn filters_select_by_namespace_label_runtime_and_annotation() {
    let mut c = Container::new("x", RuntimeKind::Crun);
    c.annotations.insert("trace".into(), "yes".into());
    c.kubernetes = Some({
        let mut k = Kubernetes::default();
        k.namespace = Some("prod".into());
        k.labels = [("app".to_owned(), "web".to_owned())].into();
        k
    });
    let f = |r: &[&str], ns: &[&str], l: &[(&str, &str)], a: &[(&str, &str)]| Filter {
        runtimes: r.iter().map(|s| s.to_string()).collect(),
        namespaces: ns.iter().map(|s| s.to_string()).collect(),
        pod_labels: l
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        annotations: a
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Filter::default()
    };
    assert!(f(&[], &[], &[], &[]).matches(&c));
    assert!(f(&["crun"], &["prod"], &[("app", "web")], &[("trace", "yes")]).matches(&c));
    assert!(!f(&["runc"], &[], &[], &[]).matches(&c));
    assert!(!f(&[], &["kube-system"], &[], &[]).matches(&c));
    assert!(!f(&[], &[], &[("app", "db")], &[]).matches(&c));
    assert!(!f(&[], &[], &[], &[("trace", "no")]).matches(&c));
}

#[tokio::test]
async fn filters_select_by_workload_cgroup_id_and_image_digest() {
    let mut c = Container::new("x", RuntimeKind::Runc);
    c.cgroup_id = Some(7001);
    c.image_digest = Some("docker.io/library/nginx@sha256:aaa".into());
    c.image_id = Some("sha256:bbb".into());
    c.kubernetes = Some({
        let mut k = Kubernetes::default();
        let mut w = lookout_model::Workload::default();
        w.kind = "Deployment".into();
        w.namespace = "shop".into();
        w.name = "api".into();
        w.api_version = "apps/v1".into();
        k.workload = Some(w);
        k
    });
    let by = |workloads: &[&str], cgroup_ids: &[u64], digests: &[&str]| Filter {
        workloads: workloads.iter().map(|s| s.to_string()).collect(),
        cgroup_ids: cgroup_ids.to_vec(),
        image_digests: digests.iter().map(|s| s.to_string()).collect(),
        ..Filter::default()
    };
    assert!(by(&["Deployment/shop/api"], &[], &[]).matches(&c));
    assert!(by(&["StatefulSet/shop/db", "Deployment/shop/api"], &[], &[]).matches(&c));
    for other in [
        "Deployment/shop/ap",
        "Deployment/shop/api/x",
        "Deployment/shop",
        "ReplicaSet/shop/api",
        "Deployment/shop2/api",
    ] {
        assert!(!by(&[other], &[], &[]).matches(&c), "{other}");
    }
    assert!(by(&[], &[1, 7001], &[]).matches(&c));
    assert!(!by(&[], &[7002], &[]).matches(&c));
    assert!(by(&[], &[], &["docker.io/library/nginx@sha256:aaa"]).matches(&c));
    assert!(by(&[], &[], &["sha256:aaa"]).matches(&c));
    assert!(by(&[], &[], &["sha256:bbb"]).matches(&c), "the image id");
    assert!(!by(&[], &[], &["sha256:ccc"]).matches(&c));
    assert!(!by(&[], &[], &["nginx@sha256:aaa"]).matches(&c));
    // Every criterion that is set must match.
    assert!(!by(&["Deployment/shop/api"], &[7002], &[]).matches(&c));
    // A Deployment of another API group, which any pod may name as its
    // owner, is no Deployment.
    let mut claimed = c.clone();
    if let Some(w) = claimed
        .kubernetes
        .as_mut()
        .and_then(|k| k.workload.as_mut())
    {
        w.api_version = "x.example/v1".into();
    }
    assert!(!by(&["Deployment/shop/api"], &[], &[]).matches(&claimed));
    // A container that does not know a criterion's field never matches it.
    let bare = Container::new("y", RuntimeKind::Runc);
    assert!(!by(&["Deployment/shop/api"], &[], &[]).matches(&bare));
    assert!(!by(&[], &[7001], &[]).matches(&bare));
    assert!(!by(&[], &[], &["sha256:aaa"]).matches(&bare));
}

#[tokio::test]
async fn gates_decide_and_unanswered_holds_follow_the_policy() {
    let h = hub(100, 100);
    feed(&h, added("held", Status::Created));
    let barrier = GateBarrier(Arc::clone(&h));
    assert!(
        barrier.wait("held").is_none(),
        "no subscriber: nothing to wait for"
    );

    let mut deny = h
        .gate(Subscription {
            name: "policy".into(),
            filter: Filter::default(),
            deadline: Duration::from_secs(5),
            on_failure: FailurePolicy::Open,
        })
        .expect("gate");
    let wait = barrier.wait("held").expect("a subscriber holds it");
    let answer = tokio::spawn(async move {
        let h = deny.holds.recv().await.expect("hold");
        assert_eq!(h.live.container.id, "held");
        let _ = h.respond.expect("held").send(Verdict::Deny("no".into()));
        deny
    });
    assert_eq!(
        wait.await,
        StartDecision::Deny("denied by gate policy: no".into())
    );
    let deny = answer.await.expect("task");
    // The removal carries the reason.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut s = HubSink::new(Arc::clone(&h), move |e: ContainerEvent| {
        let _ = tx.send(e);
    });
    s.emit(removed("held"));
    assert_eq!(
        rx.recv().await.and_then(|e| e.reason).as_deref(),
        Some("denied by gate policy: no")
    );
    drop(deny);

    // Fail-closed with a subscriber that goes away: denied at once,
    // except in an exempt namespace.
    let closed = h
        .gate(Subscription {
            name: "strict".into(),
            filter: Filter::default(),
            deadline: Duration::from_secs(30),
            on_failure: FailurePolicy::Closed,
        })
        .expect("gate");
    feed(&h, added("c2", Status::Created));
    let mut sys = added("sys", Status::Created);
    Arc::make_mut(&mut sys.container).kubernetes = Some({
        let mut k = Kubernetes::default();
        k.namespace = Some("kube-system".into());
        k
    });
    feed(&h, sys);
    let w2 = barrier.wait("c2").expect("held");
    let w3 = barrier.wait("sys").expect("held");
    let t = Instant::now();
    drop(closed);
    assert!(matches!(w2.await, StartDecision::Deny(r) if r.contains("went away")));
    assert_eq!(w3.await, StartDecision::Proceed);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "at once, not at the deadline"
    );
}

#[tokio::test]
async fn holds_open_at_create_so_an_early_answer_costs_the_start_nothing() {
    let h = hub(100, 100);
    let barrier = GateBarrier(Arc::clone(&h));
    let gate = |name: &str, deadline_ms| {
        h.gate(Subscription {
            name: name.into(),
            filter: Filter::default(),
            deadline: Duration::from_millis(deadline_ms),
            on_failure: FailurePolicy::Closed,
        })
        .expect("gate")
    };
    let mut early = gate("early", 5_000);
    feed(&h, added("c", Status::Created));
    // The hold arrives at create, before the runtime's start.
    let hold = early.holds.try_recv().expect("a hold at create");
    assert_eq!(hold.live.container.id, "c");
    hold.respond
        .expect("held")
        .send(Verdict::Allow)
        .expect("sent");
    // A subscriber that came between create and start is asked at
    // start, and only it: the early one is not asked twice.
    let mut late = gate("late", 5_000);
    let wait = barrier.wait("c").expect("the late subscriber holds it");
    assert!(early.holds.try_recv().is_err(), "asked once");
    let hold = late.holds.try_recv().expect("a hold at start");
    hold.respond
        .expect("held")
        .send(Verdict::Allow)
        .expect("sent");
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut wait = wait;
    assert!(
        matches!(
            wait.as_mut().poll(&mut cx),
            std::task::Poll::Ready(StartDecision::Proceed)
        ),
        "both answered before the start: decided on the first poll"
    );
    drop(late);

    // The deadline runs from the hold's issue: a start that comes
    // after it is decided by the policy at once.
    let _silent = gate("silent", 50);
    feed(&h, added("d", Status::Created));
    let hold = early.holds.try_recv().expect("hold for d");
    hold.respond
        .expect("held")
        .send(Verdict::Allow)
        .expect("sent");
    tokio::time::sleep(Duration::from_millis(80)).await;
    let t = Instant::now();
    let decision = barrier.wait("d").expect("held").await;
    assert!(matches!(decision, StartDecision::Deny(r) if r.contains("no answer within")));
    assert!(t.elapsed() < Duration::from_secs(1), "not a fresh deadline");

    // A container removed before its start drops its holds: the
    // subscriber's answer goes nowhere.
    feed(&h, added("e", Status::Created));
    let hold = early.holds.try_recv().expect("hold for e");
    feed(&h, removed("e"));
    assert!(hold.respond.expect("held").send(Verdict::Allow).is_err());
}

/// Polls `wait` once: its decision if it needs no waiting.
fn decided_at_once(wait: &mut StartWait) -> Option<StartDecision> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match wait.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(d) => Some(d),
        std::task::Poll::Pending => None,
    }
}

/// Whether subscriber `name` is overdue, once the hub's tasks ran.
async fn overdue(h: &Hub, name: &str) -> bool {
    // The mark is cleared by a task of the hub's: let it run.
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    lock(&h.gates)
        .iter()
        .any(|s| s.sub.name == name && s.overdue.load(Ordering::Relaxed))
}

#[tokio::test]
async fn a_subscriber_that_missed_a_deadline_is_not_waited_for_until_it_answers() {
    let h = hub(100, 100);
    let barrier = GateBarrier(Arc::clone(&h));
    let gate = |name: &str, on_failure, deadline| {
        h.gate(Subscription {
            name: name.into(),
            filter: Filter::default(),
            deadline,
            on_failure,
        })
        .expect("gate")
    };
    // A hold's deadline runs from its issue, on the wall clock. After the
    // first hold, which is meant to miss it, every step of this
    // subscriber's must be in time (a pending first poll, an answer taken):
    // 2 s, so that no stall of a loaded VM between two steps flips one.
    let mut stalled = gate("stalled", FailurePolicy::Open, Duration::from_secs(2));
    // Its first hold waits for the deadline, then the policy decides.
    feed(&h, added("c1", Status::Created));
    let mut w1 = barrier.wait("c1").expect("held");
    assert_eq!(decided_at_once(&mut w1), None, "the first hold waits");
    assert_eq!(w1.await, StartDecision::Proceed);
    assert!(overdue(&h, "stalled").await);
    // An answer too late for its hold changes nothing.
    let c1 = stalled.holds.try_recv().expect("hold for c1");
    assert!(c1.respond.expect("held").send(Verdict::Allow).is_err());
    assert!(overdue(&h, "stalled").await, "a late answer does not count");
    // Overdue: the next start does not wait, yet the subscriber still
    // hears of the container.
    feed(&h, added("c2", Status::Created));
    let mut w2 = barrier.wait("c2").expect("held");
    assert_eq!(decided_at_once(&mut w2), Some(StartDecision::Proceed));
    let c2 = stalled.holds.try_recv().expect("hold for c2");
    assert_eq!(c2.live.container.id, "c2");
    // An answer within that hold's deadline (nobody waits for it any
    // more) shows it answers again: the next start waits for it.
    c2.respond
        .expect("held")
        .send(Verdict::Allow)
        .expect("in time: taken");
    assert!(!overdue(&h, "stalled").await, "answered in time");
    feed(&h, added("c3", Status::Created));
    let mut w3 = barrier.wait("c3").expect("held");
    assert_eq!(decided_at_once(&mut w3), None, "waited for again");
    let c3 = stalled.holds.try_recv().expect("hold for c3");
    c3.respond
        .expect("held")
        .send(Verdict::Deny("no".into()))
        .expect("sent");
    assert_eq!(
        w3.await,
        StartDecision::Deny("denied by gate stalled: no".into())
    );
    drop(stalled);

    // Fail-closed keeps its promise when overdue: denied, at once. (Its
    // only hold is meant to miss the deadline: a short one.)
    let _strict = gate("strict", FailurePolicy::Closed, Duration::from_millis(100));
    feed(&h, added("d1", Status::Created));
    let w = barrier.wait("d1").expect("held");
    assert!(matches!(w.await, StartDecision::Deny(r) if r.contains("no answer within")));
    feed(&h, added("d2", Status::Created));
    let mut w = barrier.wait("d2").expect("held");
    assert!(matches!(
        decided_at_once(&mut w),
        Some(StartDecision::Deny(r)) if r.contains("missed its last deadline")
    ));
}

#[tokio::test]
async fn a_caller_deadline_decides_by_policy_and_a_start_is_gated_once() {
    let h = hub(100, 100);
    let barrier = GateBarrier(Arc::clone(&h));
    // A deadline longer than the caller's (NRI answers the runtime
    // within about 1.5 s; this subscriber asked for 10 s).
    let mut strict = h
        .gate(Subscription {
            name: "strict".into(),
            filter: Filter::default(),
            deadline: Duration::from_secs(10),
            on_failure: FailurePolicy::Closed,
        })
        .expect("gate");
    feed(&h, added("c", Status::Created));
    let t = Instant::now();
    let w = barrier
        .wait_until("c", Instant::now() + Duration::from_millis(100))
        .expect("held");
    let d = w.await;
    assert!(
        matches!(&d, StartDecision::Deny(r) if r.contains("the runtime's deadline")),
        "{d:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "by the caller's deadline"
    );
    assert!(
        overdue(&h, "strict").await,
        "a missed caller's deadline counts"
    );
    // The hook's `runc start` after NRI's StartContainer: the same
    // decision, and no second hold.
    let again = barrier.wait("c").expect("the denial again");
    assert_eq!(again.await, d);
    assert!(strict.holds.try_recv().is_ok(), "one hold for c");
    assert!(strict.holds.try_recv().is_err(), "and only one");
    // Until the container is removed.
    feed(&h, removed("c"));
    feed(&h, added("c", Status::Created));
    assert!(
        strict.holds.try_recv().is_ok(),
        "a new container, a new hold"
    );
}

#[tokio::test]
async fn containers_that_cannot_be_held_are_announced_as_not_held() {
    let h = hub(100, 100);
    let mut g = h
        .gate(Subscription {
            name: "tracer".into(),
            filter: Filter::default(),
            deadline: Duration::from_secs(1),
            on_failure: FailurePolicy::Open,
        })
        .expect("gate");
    feed(&h, added("run", Status::Running));
    let n = g.holds.recv().await.expect("notice");
    assert_eq!((n.hold_id, n.respond.is_none()), (0, true));
}

#[test]
fn the_hub_and_the_output_share_the_reporters_record() {
    let h = hub(100, 100);
    let e = added("a", Status::Running);
    let reported = Arc::clone(&e.container);
    let mut out = Vec::new();
    HubSink::new(Arc::clone(&h), |e: ContainerEvent| out.push(e)).emit(e);
    let (_, list) = h.list(&Filter::default());
    assert!(
        Arc::ptr_eq(&list[0].container, &reported),
        "the live table holds the reporter's record, not a copy"
    );
    assert!(Arc::ptr_eq(&out[0].container, &reported));
    // A removal that lacks nothing the live record knew is not copied
    // for the hub either.
    let gone = ContainerEvent::removed(Source::RuntimeHook, Arc::clone(&reported), Some(0));
    let stopped = Arc::clone(&gone.container);
    let mut out = Vec::new();
    HubSink::new(Arc::clone(&h), |e: ContainerEvent| out.push(e)).emit(gone);
    assert!(Arc::ptr_eq(&out[0].container, &stopped));
    assert_eq!(out[0].container.status, Status::Stopped);
}

/// A container whose annotations hold `kib` KiB.
fn annotated(id: &str, kib: usize) -> Container {
    let mut c = Container::new(id, RuntimeKind::Runc);
    c.pid = Some(7);
    for i in 0..kib / 4 {
        c.annotations
            .insert(format!("big/{i:03}"), "x".repeat(4096));
    }
    c
}

/// A hub whose window holds `window_bytes` of records, and its registry.
fn byte_bounded_hub(window_bytes: usize) -> (Arc<Hub>, Registry) {
    let mut r = Registry::default();
    let h = Hub::new(
        HubConfig {
            window_bytes,
            ..HubConfig::default()
        },
        HubMetrics::register(&mut r),
    );
    (h, r)
}

/// Adds `c`, then removes a container of its id with as many annotations.
fn add_and_remove(h: &Arc<Hub>, c: Arc<Container>) {
    let id = c.id.clone();
    feed(h, ContainerEvent::added(Source::RuntimeHook, c));
    feed(
        h,
        ContainerEvent::removed(Source::RuntimeHook, annotated(&id, 256), Some(0)),
    );
}

#[tokio::test]
async fn removed_containers_with_large_annotations_cost_the_window_its_bytes_not_more() {
    // Created and deleted in a loop, each with 256 KiB of annotations (the
    // most the agent keeps): the window holds their records after they
    // are gone, up to its byte bound, not up to its 4096 changes.
    let budget = 1 << 20;
    let (h, r) = byte_bounded_hub(budget);
    let (rev0, _) = h.list(&Filter::default());
    let first = Arc::new(annotated("c0", 256));
    let first_weak = Arc::downgrade(&first);
    let one = record_bytes(&first);
    assert!(one > 256 << 10, "at least the strings: {one}");
    add_and_remove(&h, first);
    for i in 1..40 {
        add_and_remove(&h, Arc::new(annotated(&format!("c{i}"), 256)));
    }
    {
        let s = lock(&h.state);
        let held: usize = s.log.iter().map(|c| change_bytes(c)).sum();
        assert_eq!(held, s.log_bytes, "the running count is the log's");
        assert!(s.log_bytes <= budget, "{} > {budget}", s.log_bytes);
        assert!(
            s.log.len() >= 2 && s.log.len() < 8,
            "{} changes",
            s.log.len()
        );
    }
    // The first container's record is freed, not only uncounted.
    assert!(
        first_weak.upgrade().is_none(),
        "still held after the window moved on"
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &r).expect("metrics");
    assert!(text.contains("watch_window_bytes"), "{text}");
    // A watcher from before the window gets a snapshot; one from the last
    // revision but one gets the last change.
    let (now_rev, _) = h.list(&Filter::default());
    assert!(matches!(
        h.watch(rev0, Filter::default())
            .expect("watch")
            .next()
            .await,
        Ok(WatchItem::Snapshot { .. })
    ));
    match h
        .watch(now_rev - 1, Filter::default())
        .expect("watch")
        .next()
        .await
    {
        Ok(WatchItem::Change(c)) => assert_eq!(c.revision, now_rev),
        other => panic!("expected the last change: {other:?}"),
    }
}

#[tokio::test]
async fn a_watcher_that_stops_reading_holds_no_record_the_window_let_go() {
    // A consumer stops reading while containers with 256 KiB of
    // annotations are created and deleted: its queue must not keep their
    // records once the window's byte bound lets them go. It learns it fell
    // behind when it reads again; one that keeps up misses nothing.
    let budget = 1 << 20;
    let (h, r) = byte_bounded_hub(budget);
    let (rev0, _) = h.list(&Filter::default());
    let mut stalled = h.watch(rev0, Filter::default()).expect("watch");
    let mut reader = h.watch(rev0, Filter::default()).expect("watch");
    let mut weak = Vec::new();
    let mut seen = Vec::new();
    for i in 0..40 {
        let c = Arc::new(annotated(&format!("c{i}"), 256));
        weak.push(Arc::downgrade(&c));
        add_and_remove(&h, c);
        for _ in 0..2 {
            match reader.next().await {
                Ok(WatchItem::Change(c)) => seen.push((c.kind, c.live.container.id.clone())),
                other => panic!("the reader that keeps up: {other:?}"),
            }
        }
    }
    assert_eq!(seen.len(), 80, "the reader got every change");
    assert_eq!(seen[0], (EventKind::Added, "c0".to_owned()));
    assert_eq!(seen[79], (EventKind::Removed, "c39".to_owned()));
    // Nothing but the window holds a record: the stalled watcher's 80
    // queued changes did not keep 20 MiB alive.
    let held = weak.iter().filter(|w| w.upgrade().is_some()).count();
    let window = lock(&h.state).log.len();
    assert!(
        held <= window / 2 + 1,
        "{held} records held, window {window}"
    );
    assert!(held < 8, "{held} records held");
    // It reads again: it fell behind the window, and says so at once.
    assert_eq!(
        stalled.next().await.expect_err("behind the window"),
        WatchEnd::Lagged(HubConfig::default().watch_buffer)
    );
    assert_eq!(
        stalled.next().await.expect_err("still ended"),
        WatchEnd::Lagged(HubConfig::default().watch_buffer)
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &r).expect("metrics");
    assert!(text.contains("\nwatchers_dropped_total 1\n"), "{text}");
    // The hub stops queueing for it at the next change.
    feed(&h, added("after", Status::Running));
    assert_eq!(lock(&h.state).watchers.len(), 1, "only the reader is left");
}

#[tokio::test]
async fn a_resumed_watchers_backlog_does_not_outlive_the_window() {
    // A watcher resumes from a revision in the window and does not read
    // its backlog while the window moves on: the backlog held the records
    // as strongly as the queue did.
    let (h, _r) = byte_bounded_hub(1 << 20);
    let (rev0, _) = h.list(&Filter::default());
    let c = Arc::new(annotated("c0", 256));
    let first = Arc::downgrade(&c);
    add_and_remove(&h, c);
    let mut resumed = h.watch(rev0, Filter::default()).expect("watch");
    for i in 1..40 {
        add_and_remove(&h, Arc::new(annotated(&format!("c{i}"), 256)));
    }
    assert!(first.upgrade().is_none(), "the backlog kept c0's record");
    assert!(matches!(resumed.next().await, Err(WatchEnd::Lagged(_))));
}

#[tokio::test]
async fn a_snapshot_not_yet_read_does_not_outlive_its_containers_and_the_window() {
    // A watcher connects while containers with 256 KiB of annotations run,
    // and reads nothing: once they are gone and the window let their
    // changes go, its snapshot holds none of their records.
    let (h, _r) = byte_bounded_hub(1 << 20);
    let mut weak = Vec::new();
    for i in 0..3 {
        let c = Arc::new(annotated(&format!("run{i}"), 256));
        weak.push(Arc::downgrade(&c));
        feed(&h, ContainerEvent::added(Source::RuntimeHook, c));
    }
    let mut late = h.watch(0, Filter::default()).expect("watch");
    let mut prompt = h.watch(0, Filter::default()).expect("watch");
    match prompt.next().await {
        Ok(WatchItem::Snapshot { containers, .. }) => assert_eq!(containers.len(), 3),
        other => panic!("a snapshot first: {other:?}"),
    }
    for i in 0..3 {
        feed(
            &h,
            ContainerEvent::removed(
                Source::RuntimeHook,
                annotated(&format!("run{i}"), 256),
                Some(0),
            ),
        );
    }
    for i in 0..20 {
        add_and_remove(&h, Arc::new(annotated(&format!("c{i}"), 256)));
    }
    assert!(
        weak.iter().all(|w| w.upgrade().is_none()),
        "the unread snapshot kept a removed container's record"
    );
    assert!(matches!(late.next().await, Err(WatchEnd::Lagged(_))));
}

#[tokio::test]
async fn a_snapshot_keeps_a_container_removed_or_updated_while_it_is_sent() {
    // Long-running containers, whose `added` changes left the window long
    // ago, are removed or updated between the watch and its first read:
    // the watcher is not behind (the changes that superseded them are in
    // the window), and gets its snapshot, then those changes.
    let h = hub(4, 100);
    feed(&h, added("old", Status::Running));
    feed(&h, added("kept", Status::Running));
    for i in 0..6 {
        feed(&h, added(&format!("filler{i}"), Status::Running));
    }
    let mut w = h.watch(0, Filter::default()).expect("watch");
    feed(&h, removed("old"));
    let mut named = Container::new("kept", RuntimeKind::Runc);
    named.name = Some("now-named".into());
    feed(&h, ContainerEvent::updated(Source::RuntimeHook, named));
    match w.next().await {
        Ok(WatchItem::Snapshot { containers, .. }) => {
            let ids: Vec<&str> = containers.iter().map(|l| l.container.id.as_str()).collect();
            assert!(ids.contains(&"old") && ids.contains(&"kept"), "{ids:?}");
        }
        other => panic!("the snapshot: {other:?}"),
    }
    for kind in [EventKind::Removed, EventKind::Updated] {
        match w.next().await {
            Ok(WatchItem::Change(c)) => assert_eq!(c.kind, kind),
            other => panic!("{kind:?}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_watcher_dropped_for_a_full_queue_and_behind_the_window_is_counted_once() {
    let mut r = Registry::default();
    let h = Hub::new(
        HubConfig {
            window: 2,
            watch_buffer: 3,
            ..HubConfig::default()
        },
        HubMetrics::register(&mut r),
    );
    let (rev, _) = h.list(&Filter::default());
    let mut w = h.watch(rev, Filter::default()).expect("watch");
    for i in 0..8 {
        feed(&h, added(&format!("c{i}"), Status::Running));
    }
    assert!(matches!(w.next().await, Err(WatchEnd::Lagged(3))));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &r).expect("metrics");
    assert!(text.contains("\nwatchers_dropped_total 1\n"), "{text}");
}

#[tokio::test]
async fn after_close_a_watcher_gets_what_it_was_handed_then_closed() {
    // Discovery goes on publishing while a handover flushes the watchers:
    // the window must not move past what they have yet to read.
    let h = hub(3, 100);
    let (rev, _) = h.list(&Filter::default());
    let mut w = h.watch(rev, Filter::default()).expect("watch");
    for i in 0..3 {
        feed(&h, added(&format!("c{i}"), Status::Running));
    }
    h.close();
    for i in 3..10 {
        feed(&h, added(&format!("c{i}"), Status::Running));
    }
    for i in 0..3 {
        match w.next().await {
            Ok(WatchItem::Change(c)) => assert_eq!(c.live.container.id, format!("c{i}")),
            other => panic!("c{i}: {other:?}"),
        }
    }
    assert_eq!(w.next().await.expect_err("the end"), WatchEnd::Closed);
}
