//! The plugin against a real containerd 1.7 with NRI (CriNode), with pods
//! run through CRI like a kubelet. Needs root; prints SKIPPED otherwise
//! (and fails under CI).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lookout_nri::{ContainerPhase, Event, Plugin, Snapshot, Stats};
use lookout_testsupport::cri::{BUSYBOX_IMAGE, CriNode, PodSpec, require_cri};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

/// Deadline for any one wait on the runtime.
const WAIT: Duration = Duration::from_secs(30);

/// What the test consumer saw: the event and how long after the request's
/// arrival the consumer had it.
struct Seen {
    event: Event,
    to_consumer: Duration,
}

/// Runs a plugin on `socket` whose consumer holds every CreateContainer
/// for `hold` (zero: releases at once) and forwards what it saw.
fn plugin(
    socket: &Path,
    budget: Duration,
    hold: Duration,
) -> (mpsc::UnboundedReceiver<Seen>, Arc<Stats>) {
    let (plugin, mut events) = Plugin::builder()
        .socket(socket)
        .budget(budget)
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .build()
        .expect("valid plugin");
    let stats = plugin.stats();
    tokio::spawn(plugin.run());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(d) = events.recv().await {
            let to_consumer = d.ack.received().elapsed();
            let create = matches!(
                d.event,
                Event::Container {
                    phase: ContainerPhase::Create,
                    ..
                }
            );
            let event = d.event.clone();
            if create && !hold.is_zero() {
                // Hold the runtime (on a task of its own: the next events
                // still flow).
                tokio::spawn(async move {
                    tokio::time::sleep(hold).await;
                    drop(d);
                });
            } else {
                drop(d);
            }
            if tx.send(Seen { event, to_consumer }).is_err() {
                return;
            }
        }
    });
    (rx, stats)
}

/// The next event matching `want`, skipping others; panics at the deadline.
async fn wait_for(
    rx: &mut mpsc::UnboundedReceiver<Seen>,
    what: &str,
    mut want: impl FnMut(&Event) -> bool,
) -> Seen {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(s)) if want(&s.event) => return s,
            Ok(Some(_)) => continue,
            Ok(None) => panic!("plugin gone while waiting for {what}"),
            Err(_) => panic!("no {what} within {WAIT:?}"),
        }
    }
}

async fn synchronized(rx: &mut mpsc::UnboundedReceiver<Seen>) -> Snapshot {
    match wait_for(rx, "Synchronized", |e| matches!(e, Event::Synchronized(_)))
        .await
        .event
    {
        Event::Synchronized(s) => s,
        _ => unreachable!(),
    }
}

/// Everything received so far.
fn drain(rx: &mut mpsc::UnboundedReceiver<Seen>) -> Vec<Event> {
    let mut out = Vec::new();
    while let Ok(s) = rx.try_recv() {
        out.push(s.event);
    }
    out
}

fn spec(name: &str) -> PodSpec {
    PodSpec::new("nri-test", name).label("app", name).container(
        "main",
        BUSYBOX_IMAGE,
        &["sleep", "300"],
    )
}

fn start_node(test: &str) -> Option<CriNode> {
    if !require_cri(test) {
        return None;
    }
    Some(CriNode::start().expect("containerd 1.7 starts"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_and_synchronizes_what_already_runs() {
    let Some(node) = start_node("registers_and_synchronizes_what_already_runs") else {
        return;
    };
    let mut cri = node.client().await.expect("CRI client");
    let pod = cri.run_pod(&spec("before")).await.expect("pod runs");
    let ctr = pod.container("main").expect("container").to_owned();

    let (mut rx, stats) = plugin(
        node.nri_socket(),
        Duration::from_millis(1500),
        Duration::ZERO,
    );
    let s = synchronized(&mut rx).await;
    assert_eq!(s.runtime.name, "containerd", "{:?}", s.runtime);
    assert!(s.runtime.version.starts_with("1.7"), "{:?}", s.runtime);
    assert!(!s.resync);
    let p = s
        .pods
        .iter()
        .find(|p| p.id == pod.sandbox_id)
        .expect("the sandbox is synchronized");
    assert_eq!(
        (p.namespace.as_str(), p.name.as_str(), p.uid.as_str()),
        ("nri-test", "before", pod.spec.uid.as_str())
    );
    assert_eq!(p.labels.get("app").map(String::as_str), Some("before"));
    let c = s
        .containers
        .iter()
        .find(|c| c.id == ctr)
        .expect("the container is synchronized");
    assert_eq!(
        (c.name.as_str(), c.pod_sandbox_id.as_str()),
        ("main", pod.sandbox_id.as_str())
    );
    assert_eq!(c.state, lookout_nri::ContainerState::Running);
    assert!(c.pid.is_some_and(|p| p > 1), "{:?}", c.pid);
    assert!(s.new_containers.contains(&ctr) && s.new_pods.contains(&pod.sandbox_id));
    assert_eq!(stats.registrations(), 1);
    cri.remove_pod(&pod).await.expect("pod removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_produces_its_lifecycle_in_order() {
    let Some(node) = start_node("a_pod_produces_its_lifecycle_in_order") else {
        return;
    };
    let (mut rx, stats) = plugin(
        node.nri_socket(),
        Duration::from_millis(1500),
        Duration::ZERO,
    );
    synchronized(&mut rx).await;
    let mut cri = node.client().await.expect("CRI client");
    let pod = cri.run_pod(&spec("web")).await.expect("pod runs");
    let ctr = pod.container("main").expect("container").to_owned();
    cri.remove_pod(&pod).await.expect("pod removed");
    let mut seq = Vec::new();
    let mut create_to_consumer = Duration::ZERO;
    loop {
        let s = wait_for(&mut rx, "the pod's events", |_| true).await;
        let step = match &s.event {
            Event::Pod { phase, pod: p } if p.id == pod.sandbox_id => format!("pod:{phase:?}"),
            Event::Container {
                phase,
                pod: p,
                container,
            } if container.id == ctr => {
                let p = p.as_ref().expect("container events carry their pod");
                assert_eq!(
                    (
                        p.namespace.as_str(),
                        p.name.as_str(),
                        p.uid.as_str(),
                        container.name.as_str()
                    ),
                    ("nri-test", "web", pod.spec.uid.as_str(), "main"),
                    "{phase:?}"
                );
                assert_eq!(p.labels.get("app").map(String::as_str), Some("web"));
                if *phase == ContainerPhase::Create {
                    create_to_consumer = s.to_consumer;
                    assert_eq!(container.args, ["sleep", "300"]);
                }
                if *phase == ContainerPhase::PostStart {
                    assert!(container.pid.is_some(), "a started container has a pid");
                }
                format!("container:{phase:?}")
            }
            _ => continue,
        };
        let done = step == "pod:Remove";
        seq.push(step);
        if done {
            break;
        }
    }
    // containerd can send StopContainer twice (the CRI stop and the exit
    // notice); it skips the second when the first got through.
    seq.dedup();
    assert_eq!(
        seq,
        [
            "pod:Run",
            "container:Create",
            "container:PostCreate",
            "container:Start",
            "container:PostStart",
            "container:Stop",
            "container:Remove",
            "pod:Stop",
            "pod:Remove",
        ],
    );
    let held = stats.held();
    assert_eq!(held, 2, "CreateContainer and StartContainer held");
    assert_eq!(stats.late(), 0);
    eprintln!(
        "CreateContainer: request arrival -> consumer {create_to_consumer:?}; \
         arrival -> answer mean {:?}, max {:?} over {held} Create/Start requests",
        stats.held_time() / held as u32,
        stats.held_max()
    );
    assert!(stats.held_max() < Duration::from_millis(500));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_slower_than_the_runtime_timeout_does_not_get_the_plugin_dropped() {
    let test = "a_consumer_slower_than_the_runtime_timeout_does_not_get_the_plugin_dropped";
    let Some(node) = start_node(test) else {
        return;
    };
    // The consumer holds CreateContainer for 5 s, past the runtime's 2 s.
    let budget = Duration::from_millis(800);
    let (mut rx, stats) = plugin(node.nri_socket(), budget, Duration::from_secs(5));
    synchronized(&mut rx).await;
    let mut cri = node.client().await.expect("CRI client");
    for name in ["slow1", "slow2"] {
        let t = Instant::now();
        let pod = cri
            .run_pod(&spec(name))
            .await
            .expect("the container starts");
        let took = t.elapsed();
        let ctr = pod.container("main").expect("container").to_owned();
        let status = cri.container_status(&ctr).await.expect("status");
        assert_eq!(status.state, 1, "running: {status:?}");
        assert!(
            pod.create_took[0] >= budget,
            "held until the deadline: {:?}",
            pod.create_took
        );
        assert!(
            pod.create_took[0] < Duration::from_secs(2),
            "answered in time: {:?}",
            pod.create_took
        );
        eprintln!(
            "{name}: CreateContainer took {:?}, the pod {took:?}",
            pod.create_took[0]
        );
        // Still subscribed: later events of the same connection arrive.
        wait_for(&mut rx, "PostStartContainer", |e| {
            matches!(e, Event::Container { phase: ContainerPhase::PostStart, container, .. } if container.id == ctr)
        })
        .await;
        cri.remove_pod(&pod).await.expect("pod removed");
    }
    assert_eq!(stats.late(), 2);
    assert_eq!((stats.registrations(), stats.disconnects()), (1, 0));
    assert!(
        !drain(&mut rx)
            .iter()
            .any(|e| matches!(e, Event::Disconnected(_)))
    );
    assert!(!node.log().contains("closing plugin"), "{}", node.log());
}

/// A Unix-socket proxy in front of the NRI socket that the test can cut
/// (both sides see the connection close) and keep down (new connections
/// are closed at once) until it is up again.
struct Proxy {
    path: PathBuf,
    up: Arc<AtomicBool>,
    cut: tokio::sync::watch::Sender<u64>,
    _dir: tempfile::TempDir,
}

impl Proxy {
    fn start(target: &Path) -> Proxy {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("proxy.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let up = Arc::new(AtomicBool::new(true));
        let (cut, cuts) = tokio::sync::watch::channel(0u64);
        let (target, up2) = (target.to_owned(), up.clone());
        tokio::spawn(async move {
            while let Ok((mut plugin, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                let mut cuts = cuts.clone();
                cuts.mark_unchanged();
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(mut runtime) = UnixStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut plugin, &mut runtime) => {}
                        _ = cuts.changed() => {}
                    }
                });
            }
        });
        Proxy {
            path,
            up,
            cut,
            _dir: dir,
        }
    }

    fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
    }

    fn up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_and_resynchronizes_without_duplicates() {
    let Some(node) = start_node("reconnects_and_resynchronizes_without_duplicates") else {
        return;
    };
    let proxy = Proxy::start(node.nri_socket());
    let (mut rx, stats) = plugin(&proxy.path, Duration::from_millis(1500), Duration::ZERO);
    let first = synchronized(&mut rx).await;
    assert!(!first.resync);
    let mut cri = node.client().await.expect("CRI client");
    let stays = cri.run_pod(&spec("stays")).await.expect("pod runs");
    let goes = cri.run_pod(&spec("goes")).await.expect("pod runs");
    let goes_ctr = goes.container("main").expect("container").to_owned();
    wait_for(&mut rx, "PostStart of the second pod", |e| {
        matches!(e, Event::Container { phase: ContainerPhase::PostStart, container, .. } if container.id == goes_ctr)
    })
    .await;

    // The connection drops; while the plugin is away, one pod goes and
    // another comes (containerd goes on without the plugin).
    proxy.down();
    let d = wait_for(&mut rx, "Disconnected", |e| {
        matches!(e, Event::Disconnected(_))
    })
    .await;
    eprintln!("disconnected: {:?}", d.event);
    cri.remove_pod(&goes).await.expect("pod removed while away");
    let comes = cri
        .run_pod(&spec("comes"))
        .await
        .expect("pod runs while away");
    let comes_ctr = comes.container("main").expect("container").to_owned();
    let t = Instant::now();
    proxy.up();

    let s = synchronized(&mut rx).await;
    eprintln!(
        "resynchronized {:?} after the runtime was reachable again",
        t.elapsed()
    );
    assert!(s.resync);
    assert_eq!(s.new_containers, std::slice::from_ref(&comes_ctr));
    assert_eq!(s.new_pods, std::slice::from_ref(&comes.sandbox_id));
    let gone: Vec<_> = s.gone_containers.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(gone, [goes_ctr.as_str()]);
    assert_eq!(
        s.gone_pods
            .iter()
            .map(|p| p.id.as_str())
            .collect::<Vec<_>>(),
        [goes.sandbox_id.as_str()]
    );
    assert!(
        s.containers
            .iter()
            .any(|c| Some(c.id.as_str()) == stays.container("main"))
    );
    assert_eq!((stats.registrations(), stats.disconnects()), (2, 1));

    // Live events flow again on the new connection, and nothing was sent
    // twice: no Create for a container reported before.
    cri.remove_pod(&stays).await.expect("pod removed");
    let stays_ctr = stays.container("main").expect("container").to_owned();
    wait_for(&mut rx, "RemoveContainer after the reconnect", |e| {
        matches!(e, Event::Container { phase: ContainerPhase::Remove, container, .. } if container.id == stays_ctr)
    })
    .await;
    let again = drain(&mut rx);
    assert!(
        !again.iter().any(|e| matches!(
            e,
            Event::Container {
                phase: ContainerPhase::Create,
                ..
            }
        )),
        "{again:?}"
    );
    cri.remove_pod(&comes).await.expect("pod removed");
}
