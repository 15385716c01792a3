//! The floors of "added per watcher and event": a frame written to each
//! watcher's socket ([`frame_floor`]), and a minimal lookout.v1 server
//! ([`grpc_floor`]).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};

use super::{thread_cpu_ns, watch};
use crate::host::{AGENT_SLICE, now_ns, schedstat_ns};
use crate::util::say;

/// The floor of "added per watcher and event": one write of a
/// `frame_bytes` frame to each of `watchers` Unix sockets per event, each
/// read by its own task on the benchmark's runtime (idle between events,
/// as the watchers are between containers), from a thread that does
/// nothing else. The agent cannot write less: each watcher has a stream
/// of its own, and the kernel's work per write (the copy, waking the
/// reader) is per socket. Returns that thread's CPU clock per watcher and
/// event.
pub(super) fn frame_floor(
    rt: &tokio::runtime::Runtime,
    watchers: usize,
    events: usize,
    frame_bytes: usize,
) -> anyhow::Result<Value> {
    use std::io::Write;
    use tokio::io::AsyncReadExt;
    say(
        "bench",
        &format!("frame floor: {events} events of {frame_bytes} bytes to {watchers} sockets"),
    );
    let read = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::with_capacity(watchers);
    for _ in 0..watchers {
        let (w, r) = std::os::unix::net::UnixStream::pair()?;
        r.set_nonblocking(true)?;
        let read = Arc::clone(&read);
        rt.spawn(async move {
            let Ok(mut r) = tokio::net::UnixStream::from_std(r) else {
                return;
            };
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n @ 1..) = r.read(&mut buf).await {
                read.fetch_add(n as u64, Ordering::Release);
            }
        });
        writers.push(w);
    }
    let frame = vec![0x5au8; frame_bytes];
    let mut cpu_ns = 0u64;
    for e in 1..=events {
        let t0 = thread_cpu_ns();
        for w in &mut writers {
            w.write_all(&frame)?;
        }
        cpu_ns += thread_cpu_ns().saturating_sub(t0);
        // Every reader has the event and is idle again before the next.
        let want = (e * watchers * frame_bytes) as u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        while read.load(Ordering::Acquire) < want {
            if Instant::now() > deadline {
                bail!("the frame floor's readers stopped reading at event {e}");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(json!({
        "watchers": watchers,
        "events": events,
        "frame_bytes": frame_bytes,
        "cpu_clock_per_watcher_event_us": cpu_ns as f64 / 1e3 / (events * watchers).max(1) as f64,
    }))
}

/// How [`grpc_floor`]'s server registers its connections.
#[derive(Clone, Copy, Debug)]
pub(super) enum Registration {
    /// `lookout_api::unix::QuietStream`, as the agent does: for reading.
    Quiet,
    /// tokio's own: for reading and writing.
    Tokio,
}

/// The floor of "added per watcher and event" for a gRPC stream per
/// watcher: a server that does nothing but the least a generated tonic
/// server must, on its own current-thread runtime as the agent's API: each
/// event is queued (from another thread, as the agent's hub does) to every
/// watcher's stream, copied into the stream's message and encoded by tonic,
/// and written by h2. Its watchers are the same lookout-client tasks as the
/// agent's, and its message is the size the agent wrote. Returns the
/// server thread's CPU time per watcher and event.
pub(super) fn grpc_floor(
    rt: &tokio::runtime::Runtime,
    work: &Path,
    registration: Registration,
    watchers: usize,
    events: usize,
    frame_bytes: usize,
) -> anyhow::Result<Value> {
    use lookout_api::v1 as pb;
    say(
        "bench",
        &format!(
            "gRPC floor ({registration:?} registration): {events} events of {frame_bytes} bytes to {watchers} watch streams"
        ),
    );
    let socket = work.join(format!("grpc-floor-{registration:?}.sock"));
    let _ = std::fs::remove_file(&socket);
    let listener = std::os::unix::net::UnixListener::bind(&socket)
        .with_context(|| format!("binding {}", socket.display()))?;
    listener.set_nonblocking(true)?;
    let queues: Arc<Mutex<Vec<FloorQueue>>> = Arc::default();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = {
        let queues = Arc::clone(&queues);
        std::thread::Builder::new()
            .name("grpc-floor".into())
            .spawn(move || -> anyhow::Result<()> {
                // "PID/task/TID": this thread's CPU time is read there.
                let me = std::fs::read_link("/proc/thread-self")?;
                let _ = tid_tx.send(me);
                // As the agent's API thread.
                let _ = lookout_host::sched::request_slice(AGENT_SLICE);
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(serve_floor(listener, registration, queues, stopped))
            })?
    };
    let thread = tid_rx
        .recv_timeout(Duration::from_secs(10))
        .context("the gRPC floor's server did not start")?;
    let thread = Path::new("/proc").join(thread);
    let cpu_ns = || -> u64 { schedstat_ns(&thread).unwrap_or(0) };
    let changes = Arc::new(AtomicU64::new(0));
    let snapshots = Arc::new(AtomicU64::new(0));
    for _ in 0..watchers {
        rt.block_on(watch(
            socket.clone(),
            Arc::clone(&changes),
            Arc::clone(&snapshots),
        ))?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while snapshots.load(Ordering::Acquire) < watchers as u64 {
        if Instant::now() > deadline {
            bail!("the gRPC floor's watchers did not all connect");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // A container as the agent sends one; an annotation pads the message
    // to the agent's frame (HTTP/2's 9-byte frame header and gRPC's 5-byte
    // prefix on top).
    let mut container = pb::Container {
        id: "bench-watch0-123".into(),
        runtime: "runc".into(),
        pid: 123_456,
        status: "running".into(),
        bundle: work.join("bundle-watch").display().to_string(),
        cgroup: "/user.slice/bench-watch0-123".into(),
        args: vec!["runc".into(), "create".into(), "--bundle".into()],
        source: "fanotify".into(),
        added_monotonic_ns: now_ns(),
        added_unix_ms: 1_764_806_400_000,
        ..Default::default()
    };
    let base = prost::Message::encoded_len(&pb::WatchEvent {
        kind: pb::watch_event::Kind::Added as i32,
        revision: u64::MAX / 2,
        container: Some(container.clone()),
        monotonic_ns: now_ns(),
        ..Default::default()
    });
    let pad = frame_bytes.saturating_sub(14 + base + 8).max(1);
    container.annotations.insert("p".into(), "x".repeat(pad));
    let t0 = cpu_ns();
    let mut queueing_ns = 0u64;
    for e in 1..=events {
        let event = Arc::new(pb::WatchEvent {
            kind: pb::watch_event::Kind::Added as i32,
            revision: 1 + e as u64,
            container: Some(container.clone()),
            monotonic_ns: now_ns(),
            ..Default::default()
        });
        // Counted too: the agent's hub queues on its own thread.
        let q0 = thread_cpu_ns();
        for q in lock_floor(&queues).iter() {
            q.try_send(Arc::clone(&event))
                .map_err(|_| anyhow::anyhow!("a gRPC floor watcher's queue is full or gone"))?;
        }
        queueing_ns += thread_cpu_ns().saturating_sub(q0);
        // Every watcher has the event and is idle again before the next.
        let want = (e * watchers) as u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        while changes.load(Ordering::Acquire) < want {
            if Instant::now() > deadline {
                bail!("the gRPC floor's watchers stopped reading at event {e}");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let served_ns = cpu_ns().saturating_sub(t0);
    let _ = stop.send(());
    match server.join() {
        Ok(r) => r?,
        Err(_) => bail!("the gRPC floor's server panicked"),
    }
    let _ = std::fs::remove_file(&socket);
    Ok(json!({
        "registration": format!("{registration:?}"),
        "watchers": watchers,
        "events": events,
        "frame_bytes": frame_bytes,
        // The server's thread and the queueing, as the agent's CPU counts
        // its API thread and its hub.
        "cpu_clock_per_watcher_event_us": (served_ns + queueing_ns) as f64 / 1e3 / (events * watchers).max(1) as f64,
        "server_cpu_clock_per_watcher_event_us": served_ns as f64 / 1e3 / (events * watchers).max(1) as f64,
        "queueing_cpu_clock_per_watcher_event_us": queueing_ns as f64 / 1e3 / (events * watchers).max(1) as f64,
    }))
}

/// A gRPC floor watcher's queue.
pub(super) type FloorQueue = tokio::sync::mpsc::Sender<Arc<lookout_api::v1::WatchEvent>>;

pub(super) fn lock_floor(q: &Mutex<Vec<FloorQueue>>) -> std::sync::MutexGuard<'_, Vec<FloorQueue>> {
    q.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`grpc_floor`]'s server: `Watch` only.
pub(super) async fn serve_floor(
    listener: std::os::unix::net::UnixListener,
    registration: Registration,
    queues: Arc<Mutex<Vec<FloorQueue>>>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> anyhow::Result<()> {
    use lookout_api::unix::QuietStream;
    use lookout_api::v1::lookout_server::LookoutServer;
    use tokio_stream::StreamExt;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let service = LookoutServer::new(FloorService { queues });
    let server = tonic::transport::Server::builder().add_service(service);
    // Not a graceful shutdown: that would wait for the watchers, which
    // never end their streams. The runtime's end closes the connections.
    tokio::select! {
        served = async {
            match registration {
                Registration::Quiet => {
                    server
                        .serve_with_incoming(incoming.map(|c| c.and_then(QuietStream::new)))
                        .await
                }
                Registration::Tokio => server.serve_with_incoming(incoming).await,
            }
        } => served?,
        _ = stop => {}
    }
    Ok(())
}

/// The least a `lookout.v1.Lookout` server does for a watcher: an empty
/// snapshot, then each queued event copied into the stream.
pub(super) struct FloorService {
    queues: Arc<Mutex<Vec<FloorQueue>>>,
}

pub(super) type FloorStream<T> =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl lookout_api::v1::lookout_server::Lookout for FloorService {
    async fn list(
        &self,
        _: tonic::Request<lookout_api::v1::ListRequest>,
    ) -> Result<tonic::Response<lookout_api::v1::ListResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the gRPC floor serves Watch only",
        ))
    }

    type WatchStream = FloorStream<lookout_api::v1::WatchEvent>;

    async fn watch(
        &self,
        _: tonic::Request<lookout_api::v1::WatchRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        use lookout_api::v1 as pb;
        use tokio_stream::StreamExt;
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        lock_floor(&self.queues).push(tx);
        let snapshot_end = pb::WatchEvent {
            kind: pb::watch_event::Kind::SnapshotEnd as i32,
            revision: 1,
            ..Default::default()
        };
        let events = tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|e: Arc<pb::WatchEvent>| Ok(pb::WatchEvent::clone(&e)));
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::once(Ok(snapshot_end)).chain(events),
        )))
    }

    type GateStream = FloorStream<lookout_api::v1::GateResponse>;

    async fn gate(
        &self,
        _: tonic::Request<tonic::Streaming<lookout_api::v1::GateRequest>>,
    ) -> Result<tonic::Response<Self::GateStream>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the gRPC floor serves Watch only",
        ))
    }
}
