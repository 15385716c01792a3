//! The engine embedded in-process (`lookout_agent::Discovery`): the same
//! discovery and gates as the binary, through the hub.

use std::time::Duration;

use lookout_agent::{Discovery, FailurePolicy, Filter, Subscription, Verdict, WatchItem};
use lookout_testsupport::bundle;

mod common;
use common::*;

#[test]
fn an_embedded_discovery_reports_containers_and_its_gates_hold_them() {
    if !ready("embed") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = dir.path().join("b");
    bundle::busybox(&b, &["true"], |_| {});
    let d = Discovery::builder()
        .no_default_runtimes()
        .runtime_path(&rt.path)
        .no_socket()
        .start()
        .expect("discovery starts");
    let hub = d.hub().clone();
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio");
    let mut gate = hub
        .gate(Subscription {
            name: "embedded".into(),
            filter: Filter {
                runtimes: vec!["runc".into()],
                ..Filter::default()
            },
            deadline: Duration::from_secs(5),
            on_failure: FailurePolicy::Open,
        })
        .expect("gate");
    let (rev, _) = hub.list(&Filter::default());
    let mut watch = hub.watch(rev, Filter::default()).expect("watch");
    let id = id("embed");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    // `start` waits on our gate: on a thread of its own.
    let start = {
        let (path, id) = (rt.path.clone(), id.clone());
        std::thread::spawn(move || {
            std::process::Command::new(path)
                .args(["start", &id])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .map(|s| s.success())
        })
    };
    tokio.block_on(async {
        let hold = tokio::time::timeout(Duration::from_secs(10), gate.holds.recv())
            .await
            .expect("a hold within 10 s")
            .expect("the gate is open");
        assert_eq!(hold.live.container.id, id);
        let answer = hold.respond.expect("a created container's start is held");
        let _ = answer.send(Verdict::Deny("embedded policy".into()));
    });
    assert!(
        !matches!(start.join().expect("join"), Ok(true)),
        "the denied start must fail"
    );
    let changes = tokio.block_on(async {
        let mut seen = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), async {
            while seen.len() < 2 {
                if let Ok(WatchItem::Change(c)) = watch.next().await
                    && c.live.container.id == id
                {
                    seen.push(c);
                }
            }
        })
        .await
        .expect("added and removed within 10 s");
        seen
    });
    assert_eq!(changes[0].kind, lookout_model::EventKind::Added);
    assert_eq!(changes[1].kind, lookout_model::EventKind::Removed);
    assert_eq!(
        changes[1].reason.as_deref(),
        Some("denied by gate embedded: embedded policy")
    );
    assert!(changes[0].revision < changes[1].revision);
    rt.cleanup(&id);
    d.stop().expect("discovery stops cleanly");
}
