//! Every transition of [`Lifecycle::step`], driven with inputs and checked
//! by its effects: no root, no runtime, no tokio.

use super::*;
use crate::oci::OciConfig;
use lookout_model::{EventKind, RuntimeKind};
use std::path::PathBuf;

type L = Lifecycle<u32>;

fn pending(at: Instant) -> Pending {
    Pending {
        runtime: RuntimeKind::Runc,
        root: PathBuf::from("/run/runc"),
        bundle: Some(PathBuf::from("/b")),
        pid_file: None,
        config: None,
        status: Status::Created,
        since: at,
        started: None,
    }
}

fn container(id: &str, pid: u32) -> Container {
    let mut c = Container::new(id, RuntimeKind::Runc);
    c.pid = Some(pid);
    c
}

/// A `create` of `id` (runtime pid 100) whose exec was allowed already
/// (fanotify-only mode); returns the number and hand-off of its read.
fn created(l: &mut L, id: &str, at: Instant) -> (u64, Handoff) {
    let mut e = l.step(Input::Created {
        id: id.into(),
        pending: pending(at),
        pid: 100,
        perm: None,
    });
    assert_eq!(trace(&e), [format!("watch-create:{id}:100")]);
    match e.pop() {
        Some(Effect::WatchCreate { read, handoff, .. }) => (read, handoff),
        other => panic!("{other:?}"),
    }
}

/// The end of read `read` of `id`, which found init `pid` (or nothing).
fn read(id: &str, read: u64, pid: Option<u32>) -> Input<u32> {
    Input::Read {
        id: id.into(),
        read,
        container: pid.map(|p| container(id, p)),
    }
}

fn start(id: &str, perm: Option<u32>) -> Input<u32> {
    Input::Start {
        id: id.into(),
        perm,
    }
}

/// The exit of tracked `id`'s init, as its exit watch reports it.
fn exited(l: &L, id: &str, code: Option<i32>) -> Input<u32> {
    Input::Exited {
        id: id.into(),
        watch: l.tracked_watch(id).expect("tracked"),
        pid: l.tracked_pid(id).expect("a pid"),
        code,
    }
}

/// A compact trace of effects: `read:a`, `read-now:a`, `watch:a:7`,
/// `added:a`/`removed:a`, `start:a:<perm>`, `allow:<perm>`.
fn trace(effects: &[Effect<u32>]) -> Vec<String> {
    effects
        .iter()
        .map(|e| match e {
            Effect::Read { id, seen, .. } => {
                format!("read:{id}{}", if seen.is_some() { ":seen" } else { "" })
            }
            Effect::ReadNow { id, .. } => format!("read-now:{id}"),
            Effect::WatchExit { id, pid, .. } => format!("watch:{id}:{pid}"),
            Effect::Emit(ev) => {
                let kind = match ev.event {
                    EventKind::Added => "added",
                    EventKind::Removed => "removed",
                    EventKind::Updated => "updated",
                };
                format!("{kind}:{}", ev.container.id)
            }
            Effect::ReleaseStart { id, perm, .. } => format!("start:{id}:{perm}"),
            Effect::Allow(perm) => format!("allow:{perm}"),
            Effect::WatchCreate { id, pid, .. } => format!("watch-create:{id}:{pid}"),
            Effect::WatchRun { id, pid, .. } => format!("watch-run:{id}:{pid}"),
        })
        .collect()
}

#[test]
fn a_create_hands_all_its_data_to_the_read_that_waits_for_its_exit() {
    let mut l = L::default();
    let mut p = pending(Instant::now());
    p.config = Some(OciConfig {
        hostname: Some("web".into()),
        ..OciConfig::default()
    });
    let e = l.step(Input::Created {
        id: "a".into(),
        pending: p,
        pid: 100,
        perm: Some(1),
    });
    assert_eq!(trace(&e), ["allow:1", "watch-create:a:100"]);
    let Some(Effect::WatchCreate { handoff, .. }) = e.into_iter().nth(1) else {
        panic!("no watch")
    };
    let p = take(&handoff).expect("the data, config and all");
    assert_eq!(p.config.and_then(|c| c.hostname).as_deref(), Some("web"));
    assert_eq!(p.root, PathBuf::from("/run/runc"));
    assert!(take(&handoff).is_none(), "taken once");
    assert!(l.knows("a"), "remembered while its read waits");
}

#[test]
fn prefetch_hit_a_read_after_the_exit_reports_at_once() {
    let (mut l, now) = (L::default(), Instant::now());
    let (n, handoff) = created(&mut l, "a", now);
    // The reader woke at the exit and took the data.
    assert!(take(&handoff).is_some());
    let e = l.step(read("a", n, Some(7)));
    assert_eq!(trace(&e), ["watch:a:7", "added:a"]);
    assert_eq!(l.counts(), (0, 0, 1));
    // A `start` after the report goes on at once.
    assert_eq!(trace(&l.step(start("a", Some(1)))), ["start:a:1"]);
}

#[test]
fn prefetch_miss_a_start_while_the_create_runs_reads_at_once() {
    let (mut l, now) = (L::default(), Instant::now());
    let (n, handoff) = created(&mut l, "a", now);
    let e = l.step(start("a", Some(1)));
    assert_eq!(trace(&e), ["read-now:a"]);
    match &e[0] {
        Effect::ReadNow {
            read, handoff: h, ..
        } => {
            assert_eq!(*read, n, "the same read: whoever takes the data");
            assert!(Arc::ptr_eq(h, &handoff));
            assert!(take(h).is_some(), "the waiting reader has not taken it");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        l.knows("a"),
        "resolving is known: a scan must not report it"
    );
    // A second `start` of the same id waits too, asking for nothing.
    assert!(l.step(start("a", Some(2))).is_empty());
    let e = l.step(read("a", n, Some(7)));
    assert_eq!(
        trace(&e),
        ["watch:a:7", "added:a", "start:a:1", "start:a:2"]
    );
    match &e[2] {
        Effect::ReleaseStart { pid, .. } => assert_eq!(*pid, Some(7)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_start_during_an_in_flight_read_waits_for_it() {
    let (mut l, now) = (L::default(), Instant::now());
    let (n, handoff) = created(&mut l, "a", now);
    // The create exited; its reader took the data and reads.
    let _reading = take(&handoff).expect("data");
    let e = l.step(start("a", Some(1)));
    assert_eq!(trace(&e), ["read-now:a"]);
    // The hook finds the hand-off empty: no second read.
    assert!(take(&handoff).is_none());
    let e = l.step(read("a", n, Some(7)));
    assert_eq!(trace(&e), ["watch:a:7", "added:a", "start:a:1"]);
}

#[test]
fn a_later_create_of_the_same_id_drops_the_earlier_read() {
    let (mut l, now) = (L::default(), Instant::now());
    let (first, _) = created(&mut l, "a", now);
    let (second, _) = created(&mut l, "a", now);
    assert_ne!(first, second);
    assert_eq!(l.counts(), (1, 0, 0), "one entry, the later create's");
    assert!(l.step(read("a", first, Some(6))).is_empty(), "dropped");
    assert!(l.knows("a"), "the later create still waits");
    let e = l.step(read("a", second, Some(7)));
    assert_eq!(trace(&e), ["watch:a:7", "added:a"]);
    assert_eq!(l.tracked_pid("a"), Some(7));
    // Also once a `start` asked for it: the earlier read is no answer.
    let (mut l, now) = (L::default(), Instant::now());
    let (first, _) = created(&mut l, "b", now);
    let (second, _) = created(&mut l, "b", now);
    l.step(start("b", Some(1)));
    assert!(l.step(read("b", first, Some(6))).is_empty());
    let e = l.step(read("b", second, Some(7)));
    assert_eq!(trace(&e), ["watch:b:7", "added:b", "start:b:1"]);
}

#[test]
fn a_late_argv_is_remembered_without_an_answer() {
    // fanotify-only mode: the exec went on before its argv was read.
    let (mut l, now) = (L::default(), Instant::now());
    let (n, _) = created(&mut l, "a", now);
    // Its `start` too: read now, nothing to release.
    assert_eq!(trace(&l.step(start("a", None))), ["read-now:a"]);
    assert_eq!(
        trace(&l.step(read("a", n, Some(7)))),
        ["watch:a:7", "added:a"]
    );
    // A late argv of a `create` whose container a reconciliation reported
    // first asks for nothing.
    l.step(Input::Found(vec![container("b", 8)]));
    let e = l.step(Input::Created {
        id: "b".into(),
        pending: pending(now),
        pid: 100,
        perm: None,
    });
    assert!(e.is_empty(), "{:?}", trace(&e));
}

#[test]
fn the_tracked_record_is_the_one_added_and_removed_carry() {
    let (mut l, now) = (L::default(), Instant::now());
    let (n, _) = created(&mut l, "a", now);
    let mut c = container("a", 7);
    c.annotations.insert("big".into(), "x".repeat(64 * 1024));
    let e = l.step(Input::Read {
        id: "a".into(),
        read: n,
        container: Some(c),
    });
    let added = e
        .iter()
        .find_map(|e| match e {
            Effect::Emit(ev) => Some(Arc::clone(&ev.container)),
            _ => None,
        })
        .expect("added");
    let kept = &l.tracked.get("a").expect("tracked").record;
    assert!(
        Arc::ptr_eq(kept, &added),
        "the table and the event share one record, not two copies"
    );
    drop(e);
    let e = l.step(exited(&l, "a", Some(0)));
    let removed = e
        .iter()
        .find_map(|e| match e {
            Effect::Emit(ev) => Some(Arc::clone(&ev.container)),
            _ => None,
        })
        .expect("removed");
    assert_eq!(removed.status, Status::Stopped);
    assert_eq!(removed.annotations["big"].len(), 64 * 1024);
}

#[test]
fn a_start_of_a_reported_or_unknown_container_goes_on_at_once() {
    let (mut l, now) = (L::default(), Instant::now());
    assert_eq!(trace(&l.step(start("nobody", Some(3)))), ["start:nobody:3"]);
    let (n, _) = created(&mut l, "a", now);
    l.step(read("a", n, Some(7)));
    let e = l.step(start("a", Some(4)));
    assert_eq!(trace(&e), ["start:a:4"]);
    match &e[0] {
        Effect::ReleaseStart { pid, .. } => assert_eq!(*pid, Some(7)),
        other => panic!("{other:?}"),
    }
    // Allowed already (fanotify-only mode): nothing to release.
    assert!(l.step(start("a", None)).is_empty());
}

#[test]
fn a_failed_create_releases_its_starts_and_reports_nothing() {
    let (mut l, now) = (L::default(), Instant::now());
    let (n, _) = created(&mut l, "a", now);
    l.step(start("a", Some(1)));
    let e = l.step(read("a", n, None));
    assert_eq!(trace(&e), ["start:a:1"]);
    match &e[0] {
        Effect::ReleaseStart { pid, .. } => assert_eq!(*pid, None),
        other => panic!("{other:?}"),
    }
    assert!(!l.knows("a"));
    // Nobody waiting: nothing at all.
    let (n, _) = created(&mut l, "b", now);
    assert!(l.step(read("b", n, None)).is_empty());
    assert!(!l.knows("b"));
}

#[test]
fn reconciliation_first_means_no_second_report() {
    let (mut l, now) = (L::default(), Instant::now());
    let (n, _) = created(&mut l, "a", now);
    // The scan skips what is known...
    assert!(l.step(Input::Found(vec![container("a", 7)])).is_empty());
    // ...and a container the scan reported first is not reported again.
    let e = l.step(Input::Found(vec![container("b", 8)]));
    assert_eq!(trace(&e), ["watch:b:8", "added:b"]);
    match &e[1] {
        Effect::Emit(ev) => assert_eq!(ev.source, Source::StateScan),
        other => panic!("{other:?}"),
    }
    let e = l.step(Input::Created {
        id: "b".into(),
        pending: pending(now),
        pid: 100,
        perm: Some(5),
    });
    assert_eq!(
        trace(&e),
        ["allow:5"],
        "a create of a tracked id is not watched"
    );
    assert_eq!(l.counts(), (1, 0, 1), "a tracked id is not waiting");
    let e = l.step(read("a", n, Some(7)));
    assert_eq!(trace(&e), ["watch:a:7", "added:a"]);
    match &e[1] {
        Effect::Emit(ev) => assert_eq!(ev.source, Source::RuntimeHook),
        other => panic!("{other:?}"),
    }
    assert!(l.step(read("a", n, Some(7))).is_empty(), "reported once");
}

#[test]
fn a_create_of_a_resolving_id_goes_on_and_changes_nothing() {
    let (mut l, now) = (L::default(), Instant::now());
    let (n, _) = created(&mut l, "a", now);
    l.step(start("a", Some(1)));
    let e = l.step(Input::Created {
        id: "a".into(),
        pending: pending(now),
        pid: 101,
        perm: Some(2),
    });
    assert_eq!(trace(&e), ["allow:2"]);
    assert_eq!(
        trace(&l.step(read("a", n, Some(7)))),
        ["watch:a:7", "added:a", "start:a:1"]
    );
}

#[test]
fn an_exit_ends_only_the_container_its_watch_was_for() {
    let mut l = L::default();
    l.step(Input::Found(vec![container("a", 7)]));
    let watch = l.tracked_watch("a").expect("tracked");
    // Another watch's exit (an earlier container with this id), even
    // with the same pid, changes nothing.
    for other in [watch + 1, watch.wrapping_sub(1)] {
        let e = l.step(Input::Exited {
            id: "a".into(),
            watch: other,
            pid: 7,
            code: Some(1),
        });
        assert!(e.is_empty(), "{:?}", trace(&e));
    }
    let e = l.step(Input::Exited {
        id: "a".into(),
        watch,
        pid: 7,
        code: Some(3),
    });
    assert_eq!(trace(&e), ["removed:a"]);
    match &e[0] {
        Effect::Emit(ev) => assert_eq!(ev.exit_code, Some(3)),
        other => panic!("{other:?}"),
    }
    assert!(!l.knows("a"));
    // Exactly once.
    assert!(
        l.step(Input::Exited {
            id: "a".into(),
            watch,
            pid: 7,
            code: None
        })
        .is_empty()
    );
}

#[test]
fn run_is_read_from_what_its_watcher_saw() {
    let (mut l, now) = (L::default(), Instant::now());
    let mut p = pending(now);
    p.status = Status::Running;
    p.started = Some(42);
    let e = l.step(Input::Created {
        id: "r".into(),
        pending: p.clone(),
        pid: 200,
        perm: Some(9),
    });
    assert_eq!(trace(&e), ["allow:9", "watch-run:r:200"]);
    match &e[1] {
        Effect::WatchRun { started, root, .. } => {
            assert_eq!(*started, Some(42));
            assert_eq!(root, &PathBuf::from("/run/runc"));
        }
        other => panic!("{other:?}"),
    }
    let seen = Observed {
        id: "r".into(),
        pid: 9,
        namespaces: Default::default(),
        cgroup: None,
    };
    let mut e = l.step(Input::Observed(seen.clone()));
    assert_eq!(trace(&e), ["read:r:seen"]);
    let Some(Effect::Read { read: n, .. }) = e.pop() else {
        panic!("no read")
    };
    // A second observation of the same id asks for nothing.
    assert!(l.step(Input::Observed(seen)).is_empty());
    assert_eq!(
        trace(&l.step(read("r", n, Some(9)))),
        ["watch:r:9", "added:r"]
    );
    // A `start` of a `run` container not yet seen reads its state now.
    l.step(Input::Created {
        id: "s".into(),
        pending: p,
        pid: 201,
        perm: None,
    });
    let mut e = l.step(start("s", Some(4)));
    assert_eq!(trace(&e), ["read:s"]);
    let Some(Effect::Read { read: n, .. }) = e.pop() else {
        panic!("no read")
    };
    assert_eq!(
        trace(&l.step(read("s", n, Some(10)))),
        ["watch:s:10", "added:s", "start:s:4"]
    );
}

#[test]
fn an_observation_of_a_create_is_no_answer() {
    let (mut l, now) = (L::default(), Instant::now());
    created(&mut l, "a", now);
    let seen = Observed {
        id: "a".into(),
        pid: 9,
        namespaces: Default::default(),
        cgroup: None,
    };
    assert!(l.step(Input::Observed(seen)).is_empty());
    assert_eq!(l.counts(), (1, 0, 0));
}

#[test]
fn deleting_a_container_that_shares_its_sandbox_removes_it() {
    let mut l = L::default();
    let mut sandbox = container("pod", 5);
    sandbox.sandbox = Some("gvisor".into());
    let mut app = container("app", 5);
    app.sandbox = Some("gvisor".into());
    let shared = l.shared_pids();
    let shared = || shared.load(std::sync::atomic::Ordering::Acquire);
    l.step(Input::Found(vec![sandbox, app]));
    assert!(l.is_sandboxed("app"));
    assert_eq!(shared(), 1, "two containers on pid 5: a delete matters");
    let e = l.step(Input::Deleted { id: "app".into() });
    assert_eq!(trace(&e), ["removed:app"]);
    assert_eq!(shared(), 0);
    // The last one in the sandbox ends with its init's exit instead.
    assert!(l.step(Input::Deleted { id: "pod".into() }).is_empty());
    // A container with its own init (runc) is never removed by delete.
    l.step(Input::Found(vec![container("own", 11)]));
    assert!(!l.is_sandboxed("own"));
    assert!(l.step(Input::Deleted { id: "own".into() }).is_empty());
    assert_eq!(shared(), 0, "one container per pid: deletes teach nothing");
    // A third container on pod's pid, then both end with its exit.
    l.step(Input::Found(vec![container("side", 5)]));
    assert_eq!(shared(), 1, "side joins pod on pid 5");
    for id in ["pod", "side"] {
        let e = l.step(exited(&l, id, None));
        assert_eq!(trace(&e), [format!("removed:{id}")]);
    }
    assert_eq!(shared(), 0);
}

#[test]
fn stale_waiting_creates_are_swept_and_a_full_table_sweeps_first() {
    let (mut l, t0) = (L::default(), Instant::now());
    let (n, _) = created(&mut l, "old", t0);
    l.step(Input::Sweep {
        now: t0 + PENDING_TTL / 2,
    });
    assert!(l.knows("old"));
    l.step(Input::Sweep {
        now: t0 + PENDING_TTL,
    });
    assert!(!l.knows("old"));
    // Its read, ending late, reports nothing.
    assert!(l.step(read("old", n, Some(7))).is_empty());
    // A resolving container is not swept: a `start` waits on it.
    let (n, _) = created(&mut l, "held", t0);
    l.step(start("held", Some(1)));
    l.step(Input::Sweep {
        now: t0 + PENDING_TTL,
    });
    assert_eq!(
        trace(&l.step(read("held", n, Some(8)))),
        ["watch:held:8", "added:held", "start:held:1"]
    );
    // A full table sweeps before it grows.
    for i in 0..MAX_PENDING {
        created(&mut l, &format!("c{i}"), t0);
    }
    created(&mut l, "extra", t0);
    assert_eq!(l.counts(), (MAX_PENDING + 1, 0, 1));
    created(&mut l, "later", t0 + PENDING_TTL);
    assert!(l.knows("later"));
    assert_eq!(l.counts(), (1, 0, 1));
}

#[test]
fn a_held_create_goes_on_once_its_container_is_remembered_and_its_end_is_watched() {
    let (mut l, now) = (L::default(), Instant::now());
    let e = l.step(Input::Created {
        id: "a".into(),
        pending: pending(now),
        pid: 100,
        perm: Some(1),
    });
    assert!(l.knows("a"), "remembered before the exec goes on");
    assert_eq!(trace(&e), ["allow:1", "watch-create:a:100"]);
}

#[test]
fn other_commands_go_on() {
    let mut l = L::default();
    assert_eq!(trace(&l.step(Input::Other { perm: 4 })), ["allow:4"]);
    assert_eq!(l.counts(), (0, 0, 0));
}

#[test]
fn an_id_used_again_after_its_exit_is_a_new_container() {
    let (mut l, now) = (L::default(), Instant::now());
    l.step(Input::Found(vec![container("a", 7)]));
    let old = l.tracked_watch("a").expect("tracked");
    // What the hook's task steps when the create comes before the
    // notice of the old init's exit: that exit, then the create.
    let e = l.step(exited(&l, "a", None));
    assert_eq!(trace(&e), ["removed:a"]);
    let mut e = l.step(Input::Created {
        id: "a".into(),
        pending: pending(now),
        pid: 100,
        perm: Some(3),
    });
    assert_eq!(trace(&e), ["allow:3", "watch-create:a:100"]);
    let Some(Effect::WatchCreate { read: n, .. }) = e.pop() else {
        panic!("no watch")
    };
    // The new init even has the old one's pid (reused).
    l.step(read("a", n, Some(7)));
    assert_ne!(l.tracked_watch("a"), Some(old), "a watch of its own");
    // The old exit's own notice, handled late, ends nothing new.
    let e = l.step(Input::Exited {
        id: "a".into(),
        watch: old,
        pid: 7,
        code: None,
    });
    assert!(e.is_empty(), "{:?}", trace(&e));
    assert_eq!(l.tracked_pid("a"), Some(7));
    assert!(l.tracked_watch("a").is_some(), "still tracked");
}

#[test]
fn a_create_of_a_reported_id_goes_on_and_is_not_watched() {
    let mut l = L::default();
    l.step(Input::Found(vec![container("a", 7)]));
    let e = l.step(Input::Created {
        id: "a".into(),
        pending: pending(Instant::now()),
        pid: 100,
        perm: Some(2),
    });
    assert_eq!(trace(&e), ["allow:2"]);
    assert_eq!(
        l.counts(),
        (0, 0, 1),
        "still the reported one, nothing waiting"
    );
}
