//! The plugin: configuration, the reconnect loop and one connection's
//! protocol.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message as _;
use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::Error;
use crate::error::is_disconnect;
use crate::mux::{self, MAX_FRAME, PLUGIN_CONN, RUNTIME_CONN};
use crate::proto;
use crate::socket::Target;
use crate::stats::Stats;
use crate::tracker::Known;
use crate::ttrpc::{self, Decoder, REQUEST, RESPONSE};
use crate::types::{Container, ContainerPhase, Event, Pod, PodPhase, Runtime};

/// Where containerd and CRI-O listen for NRI plugins by default.
pub const DEFAULT_SOCKET: &str = "/var/run/nri/nri.sock";
/// The runtime's default timeout for one plugin request (NRI's
/// `DefaultPluginRequestTimeout`), used when a request carries none.
pub const RUNTIME_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";
const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";

#[derive(Debug, Clone)]
struct Config {
    target: Target,
    name: String,
    index: String,
    budget: Duration,
    backoff: (Duration, Duration),
    queue: usize,
    updates: bool,
    registration_timeout: Duration,
}

/// Configures a [`Plugin`]; [`Plugin::builder`] makes one.
#[derive(Debug, Clone)]
pub struct PluginBuilder {
    cfg: Config,
}

impl PluginBuilder {
    /// The runtime's NRI socket (default [`DEFAULT_SOCKET`]), a path on
    /// the host (see [`host_root`](Self::host_root)).
    pub fn socket(mut self, path: impl Into<PathBuf>) -> Self {
        self.cfg.target.socket = path.into();
        self
    }

    /// Where the host's file system is mounted, for a plugin in a pod
    /// (`/host`). The [socket](Self::socket) path is resolved inside it,
    /// at every connection, as the host resolves it: symlinks (`/var/run`
    /// is `/run`) and `..` stay inside. Default: `/`, the path as it is.
    pub fn host_root(mut self, root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        self.cfg.target.host_root = (root != Path::new("/")).then_some(root);
        self
    }

    /// Connects only to a socket owned by `uid` (the runtime's user, root
    /// for a rootful runtime). A socket someone else made is refused
    /// ([`Error::SocketOwner`]): its maker could describe any pod it likes.
    /// Default: any owner.
    pub fn socket_owner(mut self, uid: u32) -> Self {
        self.cfg.target.owner = Some(uid);
        self
    }

    /// The plugin's name (default `lookout`). The runtime names the plugin
    /// `<index>-<name>` in its logs.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.cfg.name = name.into();
        self
    }

    /// The plugin's index, two digits (default `"10"`): the runtime calls
    /// plugins in ascending index order, so a low index sees a container
    /// before plugins that adjust it.
    pub fn index(mut self, index: impl Into<String>) -> Self {
        self.cfg.index = index.into();
        self
    }

    /// How long the runtime is held for one CreateContainer or
    /// StartContainer while the consumer works on it (default 1.5 s). The
    /// plugin answers when the [`Ack`] is released or at the deadline,
    /// whichever comes first. The deadline is at most three quarters of the
    /// runtime's own timeout for the request (2 s by default), so the answer
    /// always arrives in time and the runtime never drops the plugin.
    pub fn budget(mut self, budget: Duration) -> Self {
        self.cfg.budget = budget;
        self
    }

    /// The reconnect backoff: doubling from `min` to `max` (default 100 ms
    /// to 5 s), back to `min` after a successful registration.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.cfg.backoff = (min, max.max(min));
        self
    }

    /// How many events may wait for the consumer (default 1024). When the
    /// queue is full an event is dropped and counted
    /// ([`Stats::dropped`]) rather than holding the runtime.
    pub fn queue(mut self, capacity: usize) -> Self {
        self.cfg.queue = capacity.max(1);
        self
    }

    /// Also subscribe to UpdateContainer and PostUpdateContainer (resource
    /// changes; default off).
    pub fn updates(mut self, on: bool) -> Self {
        self.cfg.updates = on;
        self
    }

    /// How long registration, Configure and Synchronize may take before the
    /// connection is given up and retried (default 5 s, the runtime's own
    /// registration timeout).
    pub fn registration_timeout(mut self, timeout: Duration) -> Self {
        self.cfg.registration_timeout = timeout;
        self
    }

    /// Checks the name and index and makes the plugin and its event queue.
    /// Nothing connects until [`Plugin::run`].
    pub fn build(self) -> Result<(Plugin, Events), Error> {
        let cfg = self.cfg;
        if cfg.name.is_empty() || cfg.name.contains(['/', '\0']) {
            return Err(Error::Name(cfg.name));
        }
        if cfg.index.len() != 2 || !cfg.index.bytes().all(|b| b.is_ascii_digit()) {
            return Err(Error::Index(cfg.index));
        }
        let (tx, rx) = mpsc::channel(cfg.queue);
        let plugin = Plugin {
            cfg,
            tx,
            stats: Arc::default(),
        };
        Ok((plugin, Events { rx }))
    }
}

/// An NRI plugin that reports pods and containers.
///
/// [`run`](Self::run) connects to the runtime's socket, registers,
/// subscribes to every pod and container lifecycle event, answers each
/// request (never with an error and never with an adjustment), and hands
/// the events to [`Events`] in the runtime's order. When the connection
/// ends it reconnects with backoff and resynchronizes.
#[derive(Debug)]
pub struct Plugin {
    cfg: Config,
    tx: mpsc::Sender<Delivery>,
    stats: Arc<Stats>,
}

impl Plugin {
    /// A builder with the defaults: socket [`DEFAULT_SOCKET`], name
    /// `lookout`, index `10`, budget 1.5 s.
    pub fn builder() -> PluginBuilder {
        PluginBuilder {
            cfg: Config {
                target: Target {
                    socket: DEFAULT_SOCKET.into(),
                    host_root: None,
                    owner: None,
                },
                name: "lookout".into(),
                index: "10".into(),
                budget: Duration::from_millis(1500),
                backoff: (Duration::from_millis(100), Duration::from_secs(5)),
                queue: 1024,
                updates: false,
                registration_timeout: Duration::from_secs(5),
            },
        }
    }

    /// The plugin's counters, live.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Runs until the [`Events`] are dropped: connects, serves, and after
    /// every disconnect or failed attempt waits (backoff) and connects
    /// again. Never returns an error: each connection's error is logged and,
    /// if the connection had synchronized, reported as
    /// [`Event::Disconnected`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future closes the connection; the runtime then drops
    /// the plugin and goes on without it.
    pub async fn run(self) {
        let mut known = Known::default();
        let mut backoff = self.cfg.backoff.0;
        let mut failures = 0u32;
        loop {
            let mut session = Session::new(&self.cfg, &self.tx, &self.stats, &mut known);
            let result = session.serve(false).await;
            let synchronized = session.synchronized;
            match result {
                Ok(_) => return,
                Err(e) if synchronized => {
                    self.stats
                        .disconnects
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    warn!(error = %crate::Chain(&e), "NRI connection ended; reconnecting");
                    backoff = self.cfg.backoff.0;
                    failures = 0;
                    if let Error::Overflow { .. } = e {
                        // Reconnecting into a full queue would only drop
                        // the Synchronize: wait until half of it is free.
                        let half = (self.tx.max_capacity() / 2).max(1);
                        tokio::select! {
                            room = self.tx.reserve_many(half) => if room.is_err() { return },
                            () = self.tx.closed() => return,
                        }
                    }
                    if let Err(mpsc::error::TrySendError::Closed(_)) = self
                        .tx
                        .try_send(Delivery::new(Event::Disconnected(Arc::new(e))))
                    {
                        return;
                    }
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        warn!(error = %crate::Chain(&e), socket = %self.cfg.target.display_path().display(), "NRI not available; retrying with backoff");
                    } else {
                        debug!(error = %crate::Chain(&e), failures, "NRI attempt failed");
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = self.tx.closed() => return,
            }
            backoff = (backoff * 2).min(self.cfg.backoff.1);
        }
    }
}

/// Checks that the runtime at `socket` accepts an NRI plugin: connects,
/// registers as `<index>-<name>`, answers Configure (subscribing to
/// nothing) and Synchronize, then disconnects. Returns the runtime's name
/// and version, or why not within `timeout`.
pub async fn probe(
    socket: impl AsRef<Path>,
    name: &str,
    index: &str,
    timeout: Duration,
) -> Result<Runtime, Error> {
    Plugin::builder()
        .socket(socket.as_ref())
        .name(name)
        .index(index)
        .probe(timeout)
        .await
}

impl PluginBuilder {
    /// [`probe`] with this configuration (socket, host root, owner, name
    /// and index): whether the runtime accepts the plugin, within
    /// `timeout`.
    pub async fn probe(self, timeout: Duration) -> Result<Runtime, Error> {
        probe_with(self.registration_timeout(timeout)).await
    }
}

async fn probe_with(builder: PluginBuilder) -> Result<Runtime, Error> {
    let (plugin, _events) = builder.build()?;
    let mut known = Known::default();
    let mut session = Session::new(&plugin.cfg, &plugin.tx, &plugin.stats, &mut known);
    match session.serve(true).await? {
        Some(runtime) => Ok(runtime),
        None => Err(Error::Closed),
    }
}

/// The queue of events from a [`Plugin`], in the runtime's order.
#[derive(Debug)]
pub struct Events {
    rx: mpsc::Receiver<Delivery>,
}

impl Events {
    /// The next event; `None` once the plugin is gone.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe (an event is not lost if the future is dropped).
    pub async fn recv(&mut self) -> Option<Delivery> {
        self.rx.recv().await
    }
}

/// One event and the [`Ack`] the runtime may be waiting for.
#[derive(Debug)]
#[non_exhaustive]
pub struct Delivery {
    /// What happened.
    pub event: Event,
    /// Release it (or drop it) when done with the event.
    pub ack: Ack,
}

impl Delivery {
    fn new(event: Event) -> Delivery {
        let now = Instant::now();
        Delivery {
            event,
            ack: Ack {
                tx: None,
                received: now,
                deadline: now,
            },
        }
    }
}

/// Holds the runtime on a CreateContainer or StartContainer until released
/// or dropped, or until its [deadline](Self::deadline): the container does
/// not go on before. For other events the runtime already has its answer
/// and releasing does nothing.
///
/// A consumer that must act before a container's program runs (attach a
/// tracer, record its identity) does so, then drops the `Ack`. Past the
/// deadline the plugin answers anyway (fail open) and counts it
/// ([`Stats::late`]).
#[derive(Debug)]
pub struct Ack {
    tx: Option<oneshot::Sender<()>>,
    received: Instant,
    deadline: Instant,
}

impl Ack {
    /// Whether the runtime is waiting for this event's answer.
    pub fn holds(&self) -> bool {
        self.tx.as_ref().is_some_and(|tx| !tx.is_closed())
    }

    /// When the request arrived from the runtime.
    pub fn received(&self) -> Instant {
        self.received
    }

    /// When the plugin answers whether or not the `Ack` was released.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Lets the runtime go on (the same as dropping).
    pub fn release(self) {}
}

impl Drop for Ack {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(());
        }
    }
}

/// The event mask of ConfigureResponse: bit `event - 1` per subscribed
/// event (NRI's `EventMask.Set`).
pub(crate) fn event_mask(updates: bool) -> i32 {
    use proto::Event as E;
    let mut events = vec![
        E::RunPodSandbox,
        E::StopPodSandbox,
        E::RemovePodSandbox,
        E::CreateContainer,
        E::PostCreateContainer,
        E::StartContainer,
        E::PostStartContainer,
        E::StopContainer,
        E::RemoveContainer,
    ];
    if updates {
        events.extend([E::UpdateContainer, E::PostUpdateContainer]);
    }
    events.into_iter().fold(0, |m, e| m | 1 << (e as i32 - 1))
}

/// The time the consumer gets for a request with the runtime's `timeout`.
pub(crate) fn hold_for(budget: Duration, timeout: Duration) -> Duration {
    budget.min(timeout * 3 / 4)
}

fn decode<M: prost::Message + Default>(bytes: &[u8], what: &'static str) -> Result<M, Error> {
    M::decode(bytes).map_err(|source| Error::Decode { what, source })
}

/// One connection.
struct Session<'a> {
    cfg: &'a Config,
    tx: &'a mpsc::Sender<Delivery>,
    stats: &'a Arc<Stats>,
    known: &'a mut Known,
    runtime: Runtime,
    synchronized: bool,
    consumer_gone: bool,
    /// Events dropped on this connection (the consumer's queue was full).
    dropped: u64,
    answers: JoinSet<(u32, Vec<u8>)>,
}

/// Aborts the frame reader when the session ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<'a> Session<'a> {
    fn new(
        cfg: &'a Config,
        tx: &'a mpsc::Sender<Delivery>,
        stats: &'a Arc<Stats>,
        known: &'a mut Known,
    ) -> Session<'a> {
        Session {
            cfg,
            tx,
            stats,
            known,
            runtime: Runtime::default(),
            synchronized: false,
            consumer_gone: false,
            dropped: 0,
            answers: JoinSet::new(),
        }
    }

    /// Serves one connection. `Ok(None)`: the consumer went away. With
    /// `once`, returns `Ok(Some(runtime))` after answering Synchronize.
    async fn serve(&mut self, once: bool) -> Result<Option<Runtime>, Error> {
        let stream = self.cfg.target.connect().await?;
        let (mut rd, mut wr) = stream.into_split();
        // Frames are read on their own task: a read is not cancel safe, and
        // reading must go on while answers are written.
        let (ftx, mut frames) = mpsc::channel(8);
        let _reader = AbortOnDrop(tokio::spawn(async move {
            loop {
                let frame = mux::read_frame(&mut rd, MAX_FRAME).await;
                let end = frame.is_err();
                if ftx.send(frame).await.is_err() || end {
                    return;
                }
            }
        }));

        let register = ttrpc::Request {
            service: RUNTIME_SERVICE.into(),
            method: "RegisterPlugin".into(),
            payload: proto::RegisterPluginRequest {
                plugin_name: self.cfg.name.clone(),
                plugin_idx: self.cfg.index.clone(),
            }
            .encode_to_vec(),
            timeout_nano: i64::try_from(self.cfg.registration_timeout.as_nanos())
                .unwrap_or(i64::MAX),
            metadata: Vec::new(),
        };
        let register_stream = 1;
        send(
            &mut wr,
            RUNTIME_CONN,
            ttrpc::encode(register_stream, REQUEST, 0, &register.encode_to_vec()),
        )
        .await?;
        let registration_deadline = tokio::time::Instant::now() + self.cfg.registration_timeout;

        let mut plugin_in = Decoder::default();
        let mut runtime_in = Decoder::default();
        loop {
            tokio::select! {
                frame = frames.recv() => {
                    let (conn, bytes) = frame.unwrap_or(Err(Error::Closed))?;
                    match conn {
                        PLUGIN_CONN => {
                            plugin_in.push(&bytes);
                            while let Some(m) = plugin_in.next_message()? {
                                if m.kind != REQUEST {
                                    return Err(Error::UnexpectedMessage { conn, kind: m.kind });
                                }
                                let answer = self.request(m.stream_id, &m.payload)?;
                                if let Some(answer) = answer {
                                    send(&mut wr, PLUGIN_CONN, answer).await?;
                                }
                                if self.consumer_gone {
                                    return Ok(None);
                                }
                                if self.dropped > 0 {
                                    return Err(Error::Overflow { dropped: self.dropped });
                                }
                                if once && self.synchronized {
                                    return Ok(Some(self.runtime.clone()));
                                }
                            }
                        }
                        RUNTIME_CONN => {
                            runtime_in.push(&bytes);
                            while let Some(m) = runtime_in.next_message()? {
                                if m.kind != RESPONSE {
                                    return Err(Error::UnexpectedMessage { conn, kind: m.kind });
                                }
                                let r: ttrpc::Response = decode(&m.payload, "ttRPC response")?;
                                if let Some(s) = r.status.filter(|s| s.code != 0) {
                                    return Err(Error::Refused { code: s.code, message: s.message });
                                }
                                debug!(stream = m.stream_id, "registered with the runtime");
                            }
                        }
                        // Like NRI's own multiplexer: frames for a channel
                        // nobody opened are dropped.
                        other => debug!(conn = other, "frame on an unused multiplexer channel"),
                    }
                }
                Some(answer) = self.answers.join_next() => {
                    if let Ok(answer) = answer {
                        send(&mut wr, PLUGIN_CONN, answer).await?;
                    }
                }
                () = self.tx.closed(), if !once => return Ok(None),
                () = tokio::time::sleep_until(registration_deadline), if !self.synchronized => {
                    return Err(Error::RegistrationTimeout(self.cfg.registration_timeout));
                }
            }
        }
    }

    /// Handles one request from the runtime: the answer to write now, or
    /// `None` when it is written later (held events).
    fn request(&mut self, stream: u32, payload: &[u8]) -> Result<Option<(u32, Vec<u8>)>, Error> {
        let req: ttrpc::Request = decode(payload, "ttRPC request")?;
        let received = Instant::now();
        let timeout = u64::try_from(req.timeout_nano)
            .ok()
            .filter(|n| *n > 0)
            .map_or(RUNTIME_REQUEST_TIMEOUT, Duration::from_nanos);
        let deadline = received + hold_for(self.cfg.budget, timeout);
        if req.service != PLUGIN_SERVICE {
            debug!(
                service = req.service,
                method = req.method,
                "request for an unknown service"
            );
        }
        let p = &req.payload[..];
        let reply = match req.method.as_str() {
            "Configure" => {
                let c: proto::ConfigureRequest = decode(p, "ConfigureRequest")?;
                info!(
                    runtime = c.runtime_name,
                    version = c.runtime_version,
                    plugin = format!("{}-{}", self.cfg.index, self.cfg.name),
                    "NRI plugin registered"
                );
                self.runtime = Runtime {
                    name: c.runtime_name,
                    version: c.runtime_version,
                };
                proto::ConfigureResponse {
                    events: event_mask(self.cfg.updates),
                }
                .encode_to_vec()
            }
            "Synchronize" => {
                let s: proto::SynchronizeRequest = decode(p, "SynchronizeRequest")?;
                // Kept to undo the synchronization if the consumer has no
                // room for it (once per connection).
                let before = self.known.clone();
                let snapshot = self.known.synchronize(
                    self.runtime.clone(),
                    s.pods.into_iter().map(Pod::from).collect(),
                    s.containers.into_iter().map(Container::from).collect(),
                );
                self.synchronized = true;
                self.stats
                    .registrations
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !self.deliver(Event::Synchronized(snapshot), None) {
                    *self.known = before;
                }
                proto::SynchronizeResponse::default().encode_to_vec()
            }
            "Shutdown" => {
                self.deliver(Event::Shutdown, None);
                Vec::new()
            }
            "CreateContainer" => {
                let r: proto::CreateContainerRequest = decode(p, "CreateContainerRequest")?;
                let answer = proto::CreateContainerResponse::default().encode_to_vec();
                let at = (received, deadline);
                return Ok(self.container(
                    ContainerPhase::Create,
                    r.pod,
                    r.container,
                    stream,
                    at,
                    answer,
                ));
            }
            "UpdateContainer" => {
                let r: proto::UpdateContainerRequest = decode(p, "UpdateContainerRequest")?;
                let answer = proto::UpdateContainerResponse::default().encode_to_vec();
                let at = (received, deadline);
                return Ok(self.container(
                    ContainerPhase::Update,
                    r.pod,
                    r.container,
                    stream,
                    at,
                    answer,
                ));
            }
            "StopContainer" => {
                let r: proto::StopContainerRequest = decode(p, "StopContainerRequest")?;
                let answer = proto::StopContainerResponse::default().encode_to_vec();
                let at = (received, deadline);
                return Ok(self.container(
                    ContainerPhase::Stop,
                    r.pod,
                    r.container,
                    stream,
                    at,
                    answer,
                ));
            }
            "StateChange" => {
                let e: proto::StateChangeEvent = decode(p, "StateChangeEvent")?;
                let answer = proto::Empty::default().encode_to_vec();
                match Phase::of(e.event) {
                    Some(Phase::Container(phase)) => {
                        let at = (received, deadline);
                        return Ok(self.container(phase, e.pod, e.container, stream, at, answer));
                    }
                    Some(Phase::Pod(phase)) => {
                        let pod = Pod::from(e.pod.unwrap_or_default());
                        let id = pod.id.clone();
                        let undo = self.known.pod(phase, &pod);
                        if !self.deliver(Event::Pod { phase, pod }, None) {
                            self.known.undo_pod(phase, &id, undo);
                        }
                    }
                    None => debug!(event = e.event, "StateChange of an unknown event"),
                }
                answer
            }
            // An error answer would fail the runtime's operation; an empty
            // message decodes as any response with defaults.
            other => {
                debug!(method = other, "unknown NRI method, answered empty");
                Vec::new()
            }
        };
        Ok(Some(respond(stream, reply)))
    }

    /// A container event: delivered, answered now, or (Create/Start) when
    /// the consumer releases the ack or at the deadline.
    fn container(
        &mut self,
        phase: ContainerPhase,
        pod: Option<proto::PodSandbox>,
        container: Option<proto::Container>,
        stream: u32,
        (received, deadline): (Instant, Instant),
        answer: Vec<u8>,
    ) -> Option<(u32, Vec<u8>)> {
        let container = Container::from(container.unwrap_or_default());
        let id = container.id.clone();
        let previous = self.known.container(phase, &container);
        let event = Event::Container {
            phase,
            pod: pod.map(Pod::from),
            container,
        };
        if !phase.holds_start() {
            if !self.deliver(event, None) {
                self.known.undo_container(phase, &id, previous);
            }
            return Some(respond(stream, answer));
        }
        let (ack_tx, ack_rx) = oneshot::channel();
        if !self.deliver(event, Some((ack_tx, received, deadline))) {
            self.known.undo_container(phase, &id, previous);
        }
        let stats = self.stats.clone();
        self.answers.spawn(async move {
            // Released, dropped (also when the event was dropped) or late.
            let late = tokio::time::timeout_at(deadline.into(), ack_rx)
                .await
                .is_err();
            let took = received.elapsed();
            stats.record_held(took, late);
            if late {
                warn!(
                    ?phase,
                    ?took,
                    "consumer did not release the container in time; answered anyway"
                );
            }
            respond(stream, answer)
        });
        None
    }

    /// Hands `event` to the consumer without waiting; whether it was
    /// queued. One that finds the queue full is dropped and counted, and
    /// the session ends after this request ([`Error::Overflow`]) so that
    /// the next Synchronize reports what the consumer missed.
    fn deliver(
        &mut self,
        event: Event,
        ack: Option<(oneshot::Sender<()>, Instant, Instant)>,
    ) -> bool {
        let mut d = Delivery::new(event);
        if let Some((tx, received, deadline)) = ack {
            d.ack = Ack {
                tx: Some(tx),
                received,
                deadline,
            };
        }
        match self.tx.try_send(d) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(d)) => {
                self.stats
                    .dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.dropped += 1;
                warn!(event = ?d.event, "NRI event queue full; event dropped, resynchronizing");
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.consumer_gone = true;
                false
            }
        }
    }
}

/// A ttRPC response (status OK) with `payload`, for the plugin channel.
fn respond(stream: u32, payload: Vec<u8>) -> (u32, Vec<u8>) {
    let r = ttrpc::Response {
        status: None,
        payload,
    };
    (stream, r.encode_to_vec())
}

async fn send(
    wr: &mut OwnedWriteHalf,
    conn: u32,
    message: impl Into<Outgoing>,
) -> Result<(), Error> {
    let bytes = match message.into() {
        Outgoing::Raw(b) => b,
        Outgoing::Response(stream, payload) => ttrpc::encode(stream, RESPONSE, 0, &payload),
    };
    let mut out = Vec::with_capacity(bytes.len() + 2 * mux::HEADER_LEN);
    mux::encode_frames(conn, &bytes, &mut out);
    wr.write_all(&out).await.map_err(|e| {
        if is_disconnect(&e) {
            Error::Closed
        } else {
            Error::Io {
                op: "write",
                source: e,
            }
        }
    })
}

/// What [`send`] writes: an encoded ttRPC message, or a response to encode.
enum Outgoing {
    Raw(Vec<u8>),
    Response(u32, Vec<u8>),
}

impl From<Vec<u8>> for Outgoing {
    fn from(b: Vec<u8>) -> Outgoing {
        Outgoing::Raw(b)
    }
}

impl From<(u32, Vec<u8>)> for Outgoing {
    fn from((stream, payload): (u32, Vec<u8>)) -> Outgoing {
        Outgoing::Response(stream, payload)
    }
}

/// What a `StateChange` event is about: a pod or one of its containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Pod(PodPhase),
    Container(ContainerPhase),
}

impl Phase {
    /// The phase of NRI's event number `event`; `None` for an unknown one.
    fn of(event: i32) -> Option<Phase> {
        use proto::Event as E;
        let (pod, ctr) = (Phase::Pod, Phase::Container);
        Some(match E::try_from(event).ok()? {
            E::RunPodSandbox => pod(PodPhase::Run),
            E::StopPodSandbox => pod(PodPhase::Stop),
            E::RemovePodSandbox => pod(PodPhase::Remove),
            E::CreateContainer => ctr(ContainerPhase::Create),
            E::PostCreateContainer => ctr(ContainerPhase::PostCreate),
            E::StartContainer => ctr(ContainerPhase::Start),
            E::PostStartContainer => ctr(ContainerPhase::PostStart),
            E::UpdateContainer => ctr(ContainerPhase::Update),
            E::PostUpdateContainer => ctr(ContainerPhase::PostUpdate),
            E::StopContainer => ctr(ContainerPhase::Stop),
            E::RemoveContainer => ctr(ContainerPhase::Remove),
            E::Unknown | E::Last => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_change_events_name_a_pod_or_a_container_phase() {
        use proto::Event as E;
        assert_eq!(
            Phase::of(E::RunPodSandbox as i32),
            Some(Phase::Pod(PodPhase::Run))
        );
        assert_eq!(
            Phase::of(E::PostStartContainer as i32),
            Some(Phase::Container(ContainerPhase::PostStart))
        );
        assert_eq!(Phase::of(E::Unknown as i32), None);
        assert_eq!(Phase::of(E::Last as i32), None);
        assert_eq!(Phase::of(9999), None);
    }

    #[test]
    fn mask_has_the_nine_lifecycle_events() {
        // RunPodSandbox (1) .. RemoveContainer (11) without Update (8) and
        // PostUpdate (9): bits 0-6, 9, 10.
        assert_eq!(event_mask(false), 0b110_0111_1111);
        assert_eq!(event_mask(true), 0b111_1111_1111);
    }

    #[test]
    fn hold_stays_under_the_runtime_timeout() {
        let two = Duration::from_secs(2);
        assert_eq!(
            hold_for(Duration::from_secs(10), two),
            Duration::from_millis(1500)
        );
        assert_eq!(
            hold_for(Duration::from_millis(100), two),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn builder_checks_name_and_index() {
        assert!(matches!(
            Plugin::builder().index("1").build(),
            Err(Error::Index(_))
        ));
        assert!(matches!(
            Plugin::builder().index("1a").build(),
            Err(Error::Index(_))
        ));
        assert!(matches!(
            Plugin::builder().name("").build(),
            Err(Error::Name(_))
        ));
        assert!(matches!(
            Plugin::builder().name("a/b").build(),
            Err(Error::Name(_))
        ));
        assert!(Plugin::builder().index("99").build().is_ok());
    }
}
