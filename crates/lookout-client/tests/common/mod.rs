//! `FakeAgent`: an in-process stand-in for the agent's API server, so the
//! client is tested over a real Unix socket and real gRPC without the agent.
//!
//! It implements the generated `Lookout` trait by the contract in
//! `lookout-api/proto/lookout/v1/lookout.proto`: revisions, a bounded change
//! log (a `since` older than it gets a snapshot), filters, a slow consumer
//! disconnected with `RESOURCE_EXHAUSTED`, and the gate's
//! Subscribe/Subscribed/Hold/Decision exchange. The agent's real server has
//! its own end-to-end tests in `crates/lookout-agent/tests`; this fake only
//! stands in for it here, and adds knobs to misbehave on purpose.
#![allow(dead_code, reason = "each test binary uses a part of it")]

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lookout_client::proto::{
    self as v1, gate_request, gate_response,
    lookout_server::{Lookout, LookoutServer},
    watch_event::Kind,
};
use tokio::net::UnixListener;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

/// Every wait in these tests is bounded by this.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Awaits `future`, failing the test after [`DEADLINE`].
pub async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_) => panic!("timed out after {DEADLINE:?} waiting for {what}"),
    }
}

/// A container with Kubernetes identity.
pub fn container(id: &str, runtime: &str, namespace: &str, pod: &str) -> v1::Container {
    v1::Container {
        id: id.to_owned(),
        runtime: runtime.to_owned(),
        pid: 4242,
        status: "created".to_owned(),
        source: "runtime-hook".to_owned(),
        kubernetes: Some(v1::Kubernetes {
            namespace: namespace.to_owned(),
            pod: pod.to_owned(),
            container: "main".to_owned(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What the agent knows: live containers and the recent changes.
#[derive(Debug)]
struct Store {
    revision: u64,
    live: BTreeMap<String, v1::Container>,
    /// The last `retain` changes (ADDED/REMOVED), oldest first.
    log: VecDeque<v1::WatchEvent>,
    retain: usize,
    /// Set by [`FakeAgent::stop`]: new Watch and Gate calls are refused.
    stopping: bool,
}

/// Misbehaviour on purpose.
#[derive(Debug, Default)]
struct Knobs {
    /// On resume, also send this many changes at or before `since` (the
    /// client must not pass them on twice).
    replay_overlap: u64,
    /// Refuse `Gate` with PERMISSION_DENIED (a peer that is not root).
    deny_gate: bool,
}

struct Subscriber {
    filter: v1::Filter,
    responses: mpsc::UnboundedSender<Result<v1::GateResponse, Status>>,
}

/// The server's state, shared by its RPCs and the test.
pub struct State {
    store: Mutex<Store>,
    knobs: Mutex<Knobs>,
    /// Live changes, to every watch stream. A stream that lags behind is
    /// disconnected with RESOURCE_EXHAUSTED, as the contract says.
    changes: broadcast::Sender<v1::WatchEvent>,
    /// Bumped to end every open watch stream with `cut_status`.
    cuts: watch::Sender<(u64, tonic::Code)>,
    /// The `since` of each Watch call, in order.
    watch_calls: Mutex<Vec<u64>>,
    subscribers: Mutex<Vec<Subscriber>>,
    /// How many gate subscriptions were accepted so far.
    subscriptions: watch::Sender<u64>,
    next_hold: AtomicU64,
    decisions_tx: mpsc::UnboundedSender<v1::Decision>,
    decisions: tokio::sync::Mutex<mpsc::UnboundedReceiver<v1::Decision>>,
    /// A message for each gate stream the client ended.
    gate_ends_tx: mpsc::UnboundedSender<String>,
    gate_ends: tokio::sync::Mutex<mpsc::UnboundedReceiver<String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().expect("fake agent state poisoned")
}

impl State {
    fn new(retain: usize) -> Arc<Self> {
        let (decisions_tx, decisions) = mpsc::unbounded_channel();
        let (gate_ends_tx, gate_ends) = mpsc::unbounded_channel();
        Arc::new(Self {
            store: Mutex::new(Store {
                revision: 0,
                live: BTreeMap::new(),
                log: VecDeque::new(),
                retain,
                stopping: false,
            }),
            knobs: Mutex::new(Knobs::default()),
            changes: broadcast::channel(256).0,
            cuts: watch::channel((0, tonic::Code::Ok)).0,
            watch_calls: Mutex::new(Vec::new()),
            subscribers: Mutex::new(Vec::new()),
            subscriptions: watch::channel(0).0,
            next_hold: AtomicU64::new(1),
            decisions_tx,
            decisions: tokio::sync::Mutex::new(decisions),
            gate_ends_tx,
            gate_ends: tokio::sync::Mutex::new(gate_ends),
        })
    }

    /// Ends every open watch stream with `code`. The caller holds the
    /// store's lock (see `watch`).
    fn cut(&self, code: tonic::Code) {
        self.cuts.send_modify(|(n, c)| {
            *n += 1;
            *c = code;
        });
    }

    /// Applies one change to the live set and the log, under one lock.
    fn record(
        &self,
        kind: Kind,
        id: &str,
        new: Option<v1::Container>,
        exit_code: Option<i32>,
    ) -> u64 {
        let mut store = lock(&self.store);
        let container = match new {
            Some(container) => {
                store.live.insert(id.to_owned(), container.clone());
                container
            }
            None => store.live.remove(id).expect("a live container"),
        };
        store.revision += 1;
        let event = v1::WatchEvent {
            kind: kind as i32,
            revision: store.revision,
            container: Some(container),
            exit_code,
            reason: String::new(),
            monotonic_ns: store.revision * 1000,
        };
        store.log.push_back(event.clone());
        while store.log.len() > store.retain {
            store.log.pop_front();
        }
        // N.B. sent under the lock, so a Watch that subscribes under the
        // same lock sees each change exactly once: in its backlog or live.
        let _ = self.changes.send(event);
        store.revision
    }
}

/// Whether `container` matches `filter`, as the contract defines it.
pub fn matches(filter: &v1::Filter, container: &v1::Container) -> bool {
    let k8s = container.kubernetes.as_ref();
    (filter.runtimes.is_empty() || filter.runtimes.contains(&container.runtime))
        && (filter.namespaces.is_empty()
            || k8s.is_some_and(|k| {
                !k.namespace.is_empty() && filter.namespaces.contains(&k.namespace)
            }))
        && filter
            .pod_labels
            .iter()
            .all(|(key, value)| k8s.and_then(|k| k.labels.get(key)) == Some(value))
        && filter
            .annotations
            .iter()
            .all(|(key, value)| container.annotations.get(key) == Some(value))
}

#[tonic::async_trait]
impl Lookout for State {
    async fn list(
        &self,
        request: Request<v1::ListRequest>,
    ) -> Result<Response<v1::ListResponse>, Status> {
        let filter = request.into_inner().filter.unwrap_or_default();
        let store = lock(&self.store);
        Ok(Response::new(v1::ListResponse {
            revision: store.revision,
            containers: store
                .live
                .values()
                .filter(|c| matches(&filter, c))
                .cloned()
                .collect(),
        }))
    }

    type WatchStream = ReceiverStream<Result<v1::WatchEvent, Status>>;

    async fn watch(
        &self,
        request: Request<v1::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let request = request.into_inner();
        let (since, filter) = (request.since, request.filter.unwrap_or_default());
        let overlap = lock(&self.knobs).replay_overlap;
        // Recorded, replayed and subscribed (to changes and to cuts) under
        // the store's lock, which `record` and `FakeAgent::cut` take too: a
        // change or a cut falls wholly before or after each Watch. With the
        // cut subscribed outside it, a watch the test saw called could miss
        // a cut that came in between, and live on.
        let (backlog, mut live, mut cuts) = {
            let store = lock(&self.store);
            lock(&self.watch_calls).push(since);
            if store.stopping {
                return Err(Status::unavailable("the fake agent is stopping"));
            }
            let oldest = store.log.front().map_or(store.revision + 1, |e| e.revision);
            // The changes after `since` are all retained, or there are none.
            let resumable = since != 0
                && since <= store.revision
                && (since == store.revision || oldest <= since + 1);
            let backlog: Vec<v1::WatchEvent> = if resumable {
                let from = since.saturating_sub(overlap);
                store
                    .log
                    .iter()
                    .filter(|e| e.revision > from)
                    .cloned()
                    .collect()
            } else {
                let snapshot = |c: &v1::Container| v1::WatchEvent {
                    kind: Kind::Snapshot as i32,
                    revision: store.revision,
                    container: Some(c.clone()),
                    ..Default::default()
                };
                let end = v1::WatchEvent {
                    kind: Kind::SnapshotEnd as i32,
                    revision: store.revision,
                    ..Default::default()
                };
                store.live.values().map(snapshot).chain([end]).collect()
            };
            let mut cuts = self.cuts.subscribe();
            cuts.mark_unchanged();
            (backlog, self.changes.subscribe(), cuts)
        };
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let wanted = |e: &v1::WatchEvent| {
                e.kind == Kind::SnapshotEnd as i32
                    || e.container.as_ref().is_some_and(|c| matches(&filter, c))
            };
            for event in backlog.into_iter().filter(wanted) {
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
            loop {
                // Biased: a cut ends the stream before any later change.
                let event = tokio::select! {
                    biased;
                    _ = cuts.changed() => {
                        let code = cuts.borrow().1;
                        let _ = tx.send(Err(Status::new(code, "cut by the test"))).await;
                        return;
                    }
                    event = live.recv() => event,
                };
                let event = match event {
                    Ok(event) => event,
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let status = Status::resource_exhausted("consumer too slow");
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                if wanted(&event) && tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type GateStream = UnboundedReceiverStream<Result<v1::GateResponse, Status>>;

    async fn gate(
        &self,
        request: Request<tonic::Streaming<v1::GateRequest>>,
    ) -> Result<Response<Self::GateStream>, Status> {
        if lock(&self.knobs).deny_gate {
            return Err(Status::permission_denied(
                "the gate is for root and allow-listed peers",
            ));
        }
        let mut incoming = request.into_inner();
        let subscribe = match incoming.message().await? {
            Some(v1::GateRequest {
                msg: Some(gate_request::Msg::Subscribe(subscribe)),
            }) => subscribe,
            _ => return Err(Status::invalid_argument("send Subscribe first")),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let deadline_ms = match subscribe.deadline_ms {
            0 => 2000,
            ms => ms.min(10_000),
        };
        let subscribed = v1::GateResponse {
            msg: Some(gate_response::Msg::Subscribed(v1::Subscribed {
                name: subscribe.name.clone(),
                deadline_ms,
            })),
        };
        // Registered before Subscribed goes out: once the client has it,
        // holds reach it.
        let _ = tx.send(Ok(subscribed));
        {
            // Refused once stopping, under the lock `FakeAgent::stop` sets
            // it under: a call still in flight when the stop cleared the
            // subscribers must not add one afterwards (it would outlive
            // the stop and count as a subscription).
            let store = lock(&self.store);
            if store.stopping {
                return Err(Status::unavailable("the fake agent is stopping"));
            }
            lock(&self.subscribers).push(Subscriber {
                filter: subscribe.filter.unwrap_or_default(),
                responses: tx,
            });
            self.subscriptions.send_modify(|n| *n += 1);
        }
        let decisions = self.decisions_tx.clone();
        let ends = self.gate_ends_tx.clone();
        let name = subscribe.name;
        tokio::spawn(async move {
            let end = loop {
                match incoming.message().await {
                    Ok(Some(v1::GateRequest {
                        msg: Some(gate_request::Msg::Decision(decision)),
                    })) => {
                        let _ = decisions.send(decision);
                    }
                    Ok(Some(_)) => break format!("{name}: unexpected request"),
                    Ok(None) => break format!("{name}: ended"),
                    Err(status) => break format!("{name}: {status}"),
                }
            };
            let _ = ends.send(end);
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

/// The fake agent serving on a socket; stop and start it to play a restart.
pub struct FakeAgent {
    pub state: Arc<State>,
    socket: PathBuf,
    server: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

impl FakeAgent {
    /// Serves at `socket`, keeping the last `retain` changes.
    pub fn start(socket: &Path, retain: usize) -> Self {
        let mut agent = Self {
            state: State::new(retain),
            socket: socket.to_owned(),
            server: None,
        };
        agent.serve();
        agent
    }

    /// Starts serving again (after [`FakeAgent::stop`]), same state.
    pub fn serve(&mut self) {
        assert!(self.server.is_none(), "already serving");
        lock(&self.state.store).stopping = false;
        let listener = UnixListener::bind(&self.socket).expect("bind the fake agent's socket");
        let (stop, stopped) = oneshot::channel();
        let service = LookoutServer::from_arc(Arc::clone(&self.state));
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await
                .expect("fake agent server");
        });
        self.server = Some((stop, task));
    }

    /// Stops as an agent does on SIGTERM: every stream ends with
    /// UNAVAILABLE, the server drains, the socket file goes.
    pub async fn stop(&mut self) {
        let (stop, task) = self.server.take().expect("serving");
        {
            // One lock with `watch` and `gate`: every stream open now is
            // cut or cleared, and none opens after.
            let mut store = lock(&self.state.store);
            store.stopping = true;
            self.state.cut(tonic::Code::Unavailable);
            lock(&self.state.subscribers).clear();
        }
        let _ = stop.send(());
        within("the fake agent to drain", task)
            .await
            .expect("server task");
        std::fs::remove_file(&self.socket).expect("remove the socket");
    }

    /// Ends every open watch stream with `code`.
    pub fn cut(&self, code: tonic::Code) {
        // Under the store's lock: see `watch`.
        let _store = lock(&self.state.store);
        self.state.cut(code);
    }

    /// Reports `container`; returns the change's revision.
    pub fn add(&self, container: v1::Container) -> u64 {
        let id = container.id.clone();
        self.state.record(Kind::Added, &id, Some(container), None)
    }

    /// Reports `id` gone; returns the change's revision.
    pub fn remove(&self, id: &str, exit_code: i32) -> u64 {
        self.state.record(Kind::Removed, id, None, Some(exit_code))
    }

    /// The `since` of each Watch call so far.
    pub fn watch_calls(&self) -> Vec<u64> {
        lock(&self.state.watch_calls).clone()
    }

    /// On resume, resend `n` changes the client has already seen.
    pub fn replay_overlap(&self, n: u64) {
        lock(&self.state.knobs).replay_overlap = n;
    }

    /// Refuse the gate with PERMISSION_DENIED.
    pub fn deny_gate(&self) {
        lock(&self.state.knobs).deny_gate = true;
    }

    /// Holds `container`'s start for each matching subscriber; returns the
    /// hold id (0 if not `held`).
    pub fn hold(&self, container: v1::Container, held: bool) -> u64 {
        let hold_id = if held {
            self.state.next_hold.fetch_add(1, Ordering::Relaxed)
        } else {
            0
        };
        let subscribers = lock(&self.state.subscribers);
        assert!(!subscribers.is_empty(), "no gate subscriber");
        for subscriber in subscribers
            .iter()
            .filter(|s| matches(&s.filter, &container))
        {
            let hold = v1::Hold {
                hold_id,
                container: Some(container.clone()),
                held,
                monotonic_ns: 1,
            };
            let response = v1::GateResponse {
                msg: Some(gate_response::Msg::Hold(hold)),
            };
            let _ = subscriber.responses.send(Ok(response));
        }
        hold_id
    }

    /// Waits until `n` gate subscriptions were accepted in all (across
    /// restarts).
    pub async fn wait_subscriptions(&self, n: u64) {
        let mut subscriptions = self.state.subscriptions.subscribe();
        within(
            "gate subscriptions",
            subscriptions.wait_for(|&count| count >= n),
        )
        .await
        .expect("subscriptions channel");
    }

    /// The next decision a subscriber sent.
    pub async fn next_decision(&self) -> v1::Decision {
        let mut decisions = self.state.decisions.lock().await;
        within("a decision", decisions.recv())
            .await
            .expect("decisions channel")
    }

    /// Waits until a gate stream ends on the client's side.
    pub async fn next_gate_end(&self) -> String {
        let mut ends = self.state.gate_ends.lock().await;
        within("a gate stream to end", ends.recv())
            .await
            .expect("gate ends channel")
    }
}

/// Messages of the tracing events emitted while a future runs, so a test
/// can wait for the client to have retried (instead of sleeping).
pub mod trace {
    use super::*;
    use tracing::field::{Field, Visit};
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

    struct Forward(mpsc::UnboundedSender<String>);

    struct Message(String);

    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Forward {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            let mut message = Message(String::new());
            event.record(&mut message);
            let _ = self.0.send(message.0);
        }
    }

    /// A subscriber for `WithSubscriber::with_subscriber`, and the messages
    /// it receives.
    pub fn capture() -> (
        impl tracing::Subscriber + Send + Sync,
        mpsc::UnboundedReceiver<String>,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tracing_subscriber::registry().with(Forward(tx)), rx)
    }

    /// Waits for a message containing `needle`.
    pub async fn wait_for(messages: &mut mpsc::UnboundedReceiver<String>, needle: &str) {
        within(needle, async {
            while let Some(message) = messages.recv().await {
                if message.contains(needle) {
                    return;
                }
            }
            panic!("the traced future ended before logging {needle:?}");
        })
        .await;
    }
}
