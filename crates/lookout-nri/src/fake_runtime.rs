//! Tests of the whole plugin against a scripted runtime on a real Unix
//! socket (no root, no containerd): the protocol as the Go side speaks it,
//! held answers, and what a malformed frame does.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers: a panic is how they report a failure"
)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use prost::Message as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::mux::{self, MAX_FRAME, PLUGIN_CONN, RUNTIME_CONN};
use crate::ttrpc::{self, Decoder, REQUEST, RESPONSE};
use crate::{ContainerPhase, Error, Event, Events, Plugin, PodPhase, Stats, proto};

/// Test deadline for any one wait.
const WAIT: Duration = Duration::from_secs(10);

struct Runtime {
    stream: UnixStream,
    from_plugin: Decoder,
    from_runtime_conn: Decoder,
    next_stream: u32,
}

impl Runtime {
    async fn accept(l: &UnixListener) -> Runtime {
        let (stream, _) = tokio::time::timeout(WAIT, l.accept())
            .await
            .expect("plugin connects in time")
            .expect("accept");
        Runtime {
            stream,
            from_plugin: Decoder::default(),
            from_runtime_conn: Decoder::default(),
            next_stream: 1,
        }
    }

    /// The next ttRPC message on `want` (channel).
    async fn message(&mut self, want: u32) -> ttrpc::Message {
        loop {
            let dec = if want == PLUGIN_CONN {
                &mut self.from_plugin
            } else {
                &mut self.from_runtime_conn
            };
            if let Some(m) = dec.next_message().unwrap() {
                return m;
            }
            let (conn, bytes) =
                tokio::time::timeout(WAIT, mux::read_frame(&mut self.stream, MAX_FRAME))
                    .await
                    .expect("plugin writes in time")
                    .expect("frame");
            match conn {
                PLUGIN_CONN => self.from_plugin.push(&bytes),
                RUNTIME_CONN => self.from_runtime_conn.push(&bytes),
                other => panic!("frame on channel {other}"),
            }
        }
    }

    async fn write(&mut self, conn: u32, msg: Vec<u8>) {
        let mut out = Vec::new();
        mux::encode_frames(conn, &msg, &mut out);
        self.stream.write_all(&out).await.unwrap();
    }

    /// Answers the plugin's RegisterPlugin; returns (name, index).
    async fn registration(&mut self) -> (String, String) {
        let m = self.message(RUNTIME_CONN).await;
        assert_eq!(m.kind, REQUEST);
        let req = ttrpc::Request::decode(&m.payload[..]).unwrap();
        assert_eq!(
            (req.service.as_str(), req.method.as_str()),
            ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin")
        );
        let r = proto::RegisterPluginRequest::decode(&req.payload[..]).unwrap();
        let resp = ttrpc::Response {
            status: None,
            payload: proto::Empty::default().encode_to_vec(),
        };
        self.write(
            RUNTIME_CONN,
            ttrpc::encode(m.stream_id, RESPONSE, 0, &resp.encode_to_vec()),
        )
        .await;
        (r.plugin_name, r.plugin_idx)
    }

    /// Calls `method` on the plugin like the runtime (2 s timeout); the
    /// response payload and how long it took.
    async fn call(&mut self, method: &str, payload: Vec<u8>) -> (Vec<u8>, Duration) {
        let id = self.next_stream;
        self.next_stream += 2;
        let req = ttrpc::Request {
            service: "nri.pkg.api.v1alpha1.Plugin".into(),
            method: method.into(),
            payload,
            timeout_nano: 2_000_000_000,
            metadata: Vec::new(),
        };
        let t = Instant::now();
        self.write(
            PLUGIN_CONN,
            ttrpc::encode(id, REQUEST, 0, &req.encode_to_vec()),
        )
        .await;
        let m = self.message(PLUGIN_CONN).await;
        let took = t.elapsed();
        assert_eq!((m.stream_id, m.kind), (id, RESPONSE));
        let r = ttrpc::Response::decode(&m.payload[..]).unwrap();
        assert!(r.status.is_none_or(|s| s.code == 0));
        (r.payload, took)
    }

    /// Registration, Configure and Synchronize with `containers` in pod
    /// `p1`; returns the event mask.
    async fn handshake(&mut self, containers: &[&str]) -> i32 {
        assert_eq!(self.registration().await, ("lookout".into(), "10".into()));
        let cfg = proto::ConfigureRequest {
            config: String::new(),
            runtime_name: "fake".into(),
            runtime_version: "1".into(),
        };
        let (resp, _) = self.call("Configure", cfg.encode_to_vec()).await;
        let mask = proto::ConfigureResponse::decode(&resp[..]).unwrap().events;
        let sync = proto::SynchronizeRequest {
            pods: vec![pod("p1")],
            containers: containers.iter().map(|c| container(c, "p1")).collect(),
        };
        self.call("Synchronize", sync.encode_to_vec()).await;
        mask
    }

    /// Whether the plugin closed the connection (EOF) within the wait.
    async fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match tokio::time::timeout(WAIT, self.stream.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }
}

fn pod(id: &str) -> proto::PodSandbox {
    proto::PodSandbox {
        id: id.into(),
        name: format!("{id}-name"),
        namespace: "ns".into(),
        uid: format!("{id}-uid"),
        ..Default::default()
    }
}

fn container(id: &str, pod: &str) -> proto::Container {
    proto::Container {
        id: id.into(),
        pod_sandbox_id: pod.into(),
        name: format!("{id}-name"),
        ..Default::default()
    }
}

fn state_change(event: proto::Event, ctr: Option<&str>) -> Vec<u8> {
    proto::StateChangeEvent {
        event: event as i32,
        pod: Some(pod("p1")),
        container: ctr.map(|c| container(c, "p1")),
    }
    .encode_to_vec()
}

type Started = (
    UnixListener,
    tempfile::TempDir,
    Events,
    std::sync::Arc<Stats>,
);

fn start(budget: Duration) -> Started {
    start_with(budget, 1024)
}

fn start_with(budget: Duration, queue: usize) -> Started {
    let dir = tempfile::tempdir().unwrap();
    let sock: PathBuf = dir.path().join("nri.sock");
    let l = UnixListener::bind(&sock).unwrap();
    let (plugin, events) = Plugin::builder()
        .socket(&sock)
        .budget(budget)
        .queue(queue)
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .build()
        .unwrap();
    let stats = plugin.stats();
    tokio::spawn(plugin.run());
    (l, dir, events, stats)
}

async fn next(events: &mut Events) -> crate::Delivery {
    tokio::time::timeout(WAIT, events.recv())
        .await
        .expect("event in time")
        .expect("plugin alive")
}

#[tokio::test]
async fn full_lifecycle_through_dedicated_calls_and_state_change() {
    let (l, _dir, mut events, stats) = start(Duration::from_millis(1500));
    let mut rt = Runtime::accept(&l).await;
    let mask = rt.handshake(&["c0"]).await;
    assert_eq!(mask, 0b110_0111_1111);
    let d = next(&mut events).await;
    let Event::Synchronized(s) = &d.event else {
        panic!("{:?}", d.event)
    };
    assert_eq!((s.runtime.name.as_str(), s.resync), ("fake", false));
    assert_eq!(s.new_containers, ["c0"]);

    rt.call(
        "StateChange",
        state_change(proto::Event::RunPodSandbox, None),
    )
    .await;
    assert!(matches!(
        next(&mut events).await.event,
        Event::Pod { phase: PodPhase::Run, ref pod } if pod.name == "p1-name" && pod.uid == "p1-uid"
    ));

    // CreateContainer is held while the consumer holds the ack.
    let create = proto::CreateContainerRequest {
        pod: Some(pod("p1")),
        container: Some(container("c1", "p1")),
    };
    let consumer = tokio::spawn(async move {
        let d = next(&mut events).await;
        assert!(d.ack.holds());
        let Event::Container {
            phase,
            ref container,
            ref pod,
        } = d.event
        else {
            panic!("{:?}", d.event)
        };
        assert_eq!(
            (phase, container.id.as_str()),
            (ContainerPhase::Create, "c1")
        );
        assert_eq!(pod.as_ref().map(|p| p.namespace.as_str()), Some("ns"));
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(d);
        events
    });
    let (resp, took) = rt.call("CreateContainer", create.encode_to_vec()).await;
    assert!(
        took >= Duration::from_millis(200),
        "answered after {took:?}"
    );
    assert!(
        took < Duration::from_millis(1500),
        "answered after {took:?}"
    );
    assert_eq!(
        proto::CreateContainerResponse::decode(&resp[..]).unwrap(),
        proto::CreateContainerResponse::default(),
        "no adjustment"
    );
    let mut events = consumer.await.unwrap();

    for (event, phase) in [
        (
            proto::Event::PostCreateContainer,
            ContainerPhase::PostCreate,
        ),
        (proto::Event::StartContainer, ContainerPhase::Start),
        (proto::Event::PostStartContainer, ContainerPhase::PostStart),
    ] {
        // The consumer releases each event as it takes it (StartContainer
        // is held until then).
        let consume = async {
            let d = next(&mut events).await;
            assert!(
                matches!(d.event, Event::Container { phase: p, .. } if p == phase),
                "{:?}",
                d.event
            );
        };
        tokio::join!(
            rt.call("StateChange", state_change(event, Some("c1"))),
            consume
        );
    }
    let stop = proto::StopContainerRequest {
        pod: Some(pod("p1")),
        container: Some(container("c1", "p1")),
    };
    rt.call("StopContainer", stop.encode_to_vec()).await;
    assert!(matches!(
        next(&mut events).await.event,
        Event::Container {
            phase: ContainerPhase::Stop,
            ..
        }
    ));
    rt.call(
        "StateChange",
        state_change(proto::Event::RemoveContainer, Some("c1")),
    )
    .await;
    assert!(matches!(
        next(&mut events).await.event,
        Event::Container {
            phase: ContainerPhase::Remove,
            ..
        }
    ));
    // Unknown methods are answered (an error would fail the runtime's call).
    rt.call("SomethingNew", Vec::new()).await;
    rt.call("Shutdown", Vec::new()).await;
    assert!(matches!(next(&mut events).await.event, Event::Shutdown));
    assert_eq!((stats.held(), stats.late()), (2, 0));
}

#[tokio::test]
async fn a_consumer_past_the_deadline_is_answered_anyway() {
    let (l, _dir, mut events, stats) = start(Duration::from_millis(300));
    let mut rt = Runtime::accept(&l).await;
    rt.handshake(&[]).await;
    let _sync = next(&mut events).await;
    let create = proto::CreateContainerRequest {
        pod: Some(pod("p1")),
        container: Some(container("c1", "p1")),
    };
    let (_, took) = rt.call("CreateContainer", create.encode_to_vec()).await;
    // The consumer never released: kept in `held` below.
    let held = next(&mut events).await;
    assert!(held.ack.holds() || took >= Duration::from_millis(300));
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(1000),
        "answered after {took:?}"
    );
    assert_eq!((stats.held(), stats.late()), (1, 1));
    drop(held);
}

/// Each malformed input ends the connection with its error, the consumer
/// hears of it, and the plugin reconnects and resynchronizes without
/// reporting again what it had reported.
#[tokio::test]
async fn malformed_input_closes_the_connection_and_the_plugin_comes_back() {
    let too_big_frame = {
        let mut f = PLUGIN_CONN.to_be_bytes().to_vec();
        f.extend_from_slice(&(64u32 << 20).to_be_bytes());
        f
    };
    let reserved = {
        let mut f = 0u32.to_be_bytes().to_vec();
        f.extend_from_slice(&1u32.to_be_bytes());
        f.push(0);
        f
    };
    let mut too_big_message = Vec::new();
    let mut header = (5u32 << 20).to_be_bytes().to_vec();
    header.extend_from_slice(&[0, 0, 0, 9, REQUEST, 0]);
    mux::encode_frames(PLUGIN_CONN, &header, &mut too_big_message);
    let mut garbage_request = Vec::new();
    mux::encode_frames(
        PLUGIN_CONN,
        &ttrpc::encode(9, REQUEST, 0, &[0x0a, 0x7f]),
        &mut garbage_request,
    );
    let mut garbage_payload = Vec::new();
    let req = ttrpc::Request {
        service: "nri.pkg.api.v1alpha1.Plugin".into(),
        method: "CreateContainer".into(),
        payload: vec![0x12, 0x50, 0x01],
        ..Default::default()
    };
    mux::encode_frames(
        PLUGIN_CONN,
        &ttrpc::encode(9, REQUEST, 0, &req.encode_to_vec()),
        &mut garbage_payload,
    );
    let mut response_on_plugin_channel = Vec::new();
    mux::encode_frames(
        PLUGIN_CONN,
        &ttrpc::encode(9, RESPONSE, 0, &[]),
        &mut response_on_plugin_channel,
    );

    type Check = fn(&Error) -> bool;
    let cases: [(&str, Vec<u8>, Check); 6] = [
        (
            "oversized frame",
            too_big_frame,
            |e| matches!(e, Error::FrameTooLarge { len, .. } if *len == 64 << 20),
        ),
        ("reserved channel", reserved, |e| {
            matches!(e, Error::ReservedChannel)
        }),
        ("oversized message", too_big_message, |e| {
            matches!(e, Error::MessageTooLarge { .. })
        }),
        ("garbage request", garbage_request, |e| {
            matches!(
                e,
                Error::Decode {
                    what: "ttRPC request",
                    ..
                }
            )
        }),
        ("garbage payload", garbage_payload, |e| {
            matches!(
                e,
                Error::Decode {
                    what: "CreateContainerRequest",
                    ..
                }
            )
        }),
        ("response to the plugin", response_on_plugin_channel, |e| {
            matches!(e, Error::UnexpectedMessage { conn: 1, kind: 2 })
        }),
    ];

    let (l, _dir, mut events, stats) = start(Duration::from_millis(1500));
    let mut rt = Runtime::accept(&l).await;
    rt.handshake(&["c0"]).await;
    assert!(matches!(
        next(&mut events).await.event,
        Event::Synchronized(_)
    ));
    for (i, (name, bytes, check)) in cases.into_iter().enumerate() {
        rt.stream.write_all(&bytes).await.unwrap();
        assert!(rt.closed().await, "{name}: connection not closed");
        let d = next(&mut events).await;
        let Event::Disconnected(e) = &d.event else {
            panic!("{name}: {:?}", d.event)
        };
        assert!(check(e), "{name}: {e:?}");
        assert!(!e.to_string().is_empty());
        // Back: the same state is reported as nothing new.
        rt = Runtime::accept(&l).await;
        rt.handshake(&["c0"]).await;
        let d = next(&mut events).await;
        let Event::Synchronized(s) = &d.event else {
            panic!("{name}: {:?}", d.event)
        };
        assert!(s.resync, "{name}");
        assert!(
            s.new_containers.is_empty() && s.gone_containers.is_empty(),
            "{name}: {s:?}"
        );
        assert_eq!(stats.registrations(), i as u64 + 2);
    }
}

#[tokio::test]
async fn a_refused_registration_is_retried() {
    let (l, _dir, mut events, _stats) = start(Duration::from_millis(1500));
    let mut rt = Runtime::accept(&l).await;
    let m = rt.message(RUNTIME_CONN).await;
    let resp = ttrpc::Response {
        status: Some(ttrpc::Status {
            code: 3,
            message: "invalid plugin index".into(),
        }),
        payload: Vec::new(),
    };
    rt.write(
        RUNTIME_CONN,
        ttrpc::encode(m.stream_id, RESPONSE, 0, &resp.encode_to_vec()),
    )
    .await;
    assert!(rt.closed().await);
    let mut rt = Runtime::accept(&l).await;
    rt.handshake(&[]).await;
    assert!(matches!(next(&mut events).await.event, Event::Synchronized(ref s) if !s.resync));
}

#[tokio::test]
async fn probe_reports_the_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nri.sock");
    let l = UnixListener::bind(&sock).unwrap();
    let probe = tokio::spawn(crate::probe(sock.clone(), "lookout-probe", "99", WAIT));
    let mut rt = Runtime::accept(&l).await;
    rt.registration().await;
    let cfg = proto::ConfigureRequest {
        runtime_name: "fake".into(),
        runtime_version: "2".into(),
        ..Default::default()
    };
    rt.call("Configure", cfg.encode_to_vec()).await;
    rt.call(
        "Synchronize",
        proto::SynchronizeRequest::default().encode_to_vec(),
    )
    .await;
    let runtime = probe.await.unwrap().unwrap();
    assert_eq!(
        (runtime.name.as_str(), runtime.version.as_str()),
        ("fake", "2")
    );
    drop(l);
    let err = crate::probe(sock, "lookout-probe", "99", WAIT)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");
}

#[tokio::test]
async fn a_full_queue_loses_nothing_the_next_synchronize_reports_it() {
    let (l, _dir, mut events, stats) = start_with(Duration::from_millis(1500), 2);
    let mut rt = Runtime::accept(&l).await;
    rt.handshake(&["c0"]).await;
    rt.call(
        "StateChange",
        state_change(proto::Event::RunPodSandbox, None),
    )
    .await;
    // The consumer reads nothing: the queue of two holds Synchronized and
    // the pod, and c1's creation finds no room.
    let req = ttrpc::Request {
        service: "nri.pkg.api.v1alpha1.Plugin".into(),
        method: "StateChange".into(),
        payload: state_change(proto::Event::CreateContainer, Some("c1")),
        timeout_nano: 2_000_000_000,
        metadata: Vec::new(),
    };
    rt.write(
        PLUGIN_CONN,
        ttrpc::encode(99, REQUEST, 0, &req.encode_to_vec()),
    )
    .await;
    assert!(rt.closed().await, "the plugin leaves after a drop");
    assert_eq!(stats.dropped(), 1);
    // While the queue is full the plugin does not come back.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), l.accept())
            .await
            .is_err(),
        "reconnected into a full queue"
    );
    assert!(matches!(
        next(&mut events).await.event,
        Event::Synchronized(_)
    ));
    assert!(matches!(next(&mut events).await.event, Event::Pod { .. }));

    // Room again: the plugin registers, and the runtime's Synchronize
    // reports the container whose creation was dropped, and only it.
    let mut rt = Runtime::accept(&l).await;
    rt.handshake(&["c0", "c1"]).await;
    let d = next(&mut events).await;
    let Event::Disconnected(e) = &d.event else {
        panic!("{:?}", d.event)
    };
    assert!(matches!(**e, Error::Overflow { dropped: 1 }), "{e:?}");
    let d = next(&mut events).await;
    let Event::Synchronized(s) = &d.event else {
        panic!("{:?}", d.event)
    };
    assert!(s.resync);
    assert_eq!(s.new_containers, ["c1"]);
    assert!(s.new_pods.is_empty() && s.gone_containers.is_empty());
    assert_eq!(stats.registrations(), 2);
}
