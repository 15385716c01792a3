//! The consumer hub: the node's containers with revisions, a retained
//! window of changes, watchers that follow them, and gates that hold a
//! container's start until their subscribers decide.
//!
//! The hub sits after the merger: every event passes through
//! [`HubSink::emit`] on the task that reported it (the runtime hook's, for
//! a runtime exec that waits on us), so nothing in `emit` may block: a
//! watcher's or a gate subscriber's queue that is full is that consumer's
//! problem (it is dropped, or its hold resolved by its policy), never the
//! runtime's.
//!
//! Here: the table, the window and `Hub::publish`. Beside it, each
//! importing only what is listed:
//!
//! - `watch`: watchers, their snapshots and queues (imports `metrics`);
//! - `gate`: gate subscriptions, the holds opened for them, their
//!   policies, and the `SubscriptionStore` that carries them to a
//!   successor;
//! - `barrier`: a start held until its holds are decided (imports `gate`);
//! - `standby`: standing by while another agent serves, mirroring it, and
//!   the takeover;
//! - `metrics`: the hub's Prometheus metrics.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use lookout_model::StartDecision;
use lookout_model::{Container, ContainerEvent, EventKind, Sink, Source, Status};

mod barrier;
mod gate;
mod metrics;
mod standby;
mod watch;

pub(crate) use barrier::Counted;
pub use barrier::{Barriers, DenialsReported, GateBarrier};
pub(crate) use gate::SubscriptionStore;
pub use gate::{FailurePolicy, GateSubscriber, HoldRequest, Responder, Subscription, Verdict};
use gate::{OpenHold, Parked, Subscriber};
pub use metrics::HubMetrics;
#[cfg(test)]
pub(crate) use standby::REVISION_GAP;
use standby::{GONE_BEFORE_FOR, Standby};
use watch::Watcher;
pub(crate) use watch::WeakLive;
pub use watch::{Watch, WatchEnd, WatchItem};

/// Which containers a consumer wants: every field that is set must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Any of these runtimes (`runc`, `crun`, ...).
    pub runtimes: Vec<String>,
    /// Any of these Kubernetes namespaces.
    pub namespaces: Vec<String>,
    /// All of these pod labels.
    pub pod_labels: Vec<(String, String)>,
    /// All of these OCI annotations.
    pub annotations: Vec<(String, String)>,
    /// Any of these workloads (`Kind/namespace/name`).
    pub workloads: Vec<String>,
    /// Any of these cgroup ids.
    pub cgroup_ids: Vec<u64>,
    /// Any of these image digests: a whole `repo@sha256:...`, or the
    /// `sha256:...` part, which an image id matches too.
    pub image_digests: Vec<String>,
}

impl Filter {
    /// Whether `c` matches.
    pub fn matches(&self, c: &Container) -> bool {
        let k8s = c.kubernetes.as_ref();
        (self.runtimes.is_empty() || self.runtimes.iter().any(|r| r == c.runtime.as_str()))
            && (self.namespaces.is_empty()
                || k8s
                    .and_then(|k| k.namespace.as_ref())
                    .is_some_and(|ns| self.namespaces.contains(ns)))
            && self.pod_labels.iter().all(|(k, v)| {
                k8s.and_then(|x| x.labels.get(k))
                    .is_some_and(|have| have == v)
            })
            && self
                .annotations
                .iter()
                .all(|(k, v)| c.annotations.get(k).is_some_and(|have| have == v))
            && (self.workloads.is_empty()
                || k8s.and_then(|k| k.workload.as_ref()).is_some_and(|w| {
                    self.workloads
                        .iter()
                        .any(|want| workload_is(w, want.as_str()))
                }))
            && (self.cgroup_ids.is_empty()
                || c.cgroup_id.is_some_and(|id| self.cgroup_ids.contains(&id)))
            && (self.image_digests.is_empty() || self.image_digests.iter().any(|d| image_is(c, d)))
    }
}

/// Whether `w` is the workload `Kind/namespace/name` names (compared
/// part by part: no string is built per event). A pod's claim of a kind
/// of Kubernetes' own in another API group is not that kind.
fn workload_is(w: &lookout_model::Workload, want: &str) -> bool {
    let mut parts = want.splitn(3, '/');
    w.is_what_its_key_says()
        && parts.next() == Some(w.kind.as_str())
        && parts.next() == Some(w.namespace.as_str())
        && parts.next() == Some(w.name.as_str())
}

/// Whether `c`'s image is `digest`: its whole `image_digest`, or the
/// `sha256:...` after its `@`, or its `image_id`.
fn image_is(c: &Container, digest: &str) -> bool {
    let by_digest = c.image_digest.as_deref().is_some_and(|have| {
        have == digest || have.rsplit_once('@').is_some_and(|(_, sha)| sha == digest)
    });
    by_digest || c.image_id.as_deref() == Some(digest)
}

/// A live container as the hub knows it.
#[derive(Debug, Clone)]
pub struct Live {
    /// The container (as last reported).
    pub container: Arc<Container>,
    /// Who reported it.
    pub source: Source,
    /// `CLOCK_MONOTONIC` nanoseconds when it was reported.
    pub added_monotonic_ns: u64,
    /// Unix milliseconds when it was reported.
    pub added_unix_ms: i64,
}

/// One change, with its revision.
#[derive(Debug, Clone)]
pub struct Change {
    /// Strictly increasing, across agent restarts too (see [`Hub::new`]).
    pub revision: u64,
    /// Added or removed.
    pub kind: EventKind,
    /// The container, with when it was added.
    pub live: Live,
    /// Removed: the exit code, when known.
    pub exit_code: Option<i32>,
    /// Removed: why, when known (a denied start).
    pub reason: Option<String>,
    /// `CLOCK_MONOTONIC` nanoseconds of the change.
    pub monotonic_ns: u64,
    /// The table's record this change replaced (an update's or a removal's
    /// predecessor), kept while the change is in the window: a watcher's
    /// snapshot holds its containers weakly, and one the change superseded
    /// stays there for it until the change itself leaves the window (then
    /// the watcher has truly fallen behind).
    pub(crate) superseded: Option<Arc<Container>>,
}

/// [`record_bytes`] of what a change in the window holds.
pub(crate) fn change_bytes(c: &Change) -> usize {
    record_bytes(&c.live.container) + c.superseded.as_deref().map_or(0, record_bytes)
}

/// Roughly the heap bytes a container's record holds: the struct, its
/// strings, its maps' and lists' entries (each with a few words of the
/// collection's own). What bounds [`HubConfig::window_bytes`]; not exact,
/// and never less than the strings themselves.
pub(crate) fn record_bytes(c: &Container) -> usize {
    const ENTRY: usize = 64;
    let map = |m: &std::collections::BTreeMap<String, String>| {
        m.iter()
            .map(|(k, v)| k.len() + v.len() + ENTRY)
            .sum::<usize>()
    };
    let opt = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    std::mem::size_of::<Container>()
        + c.id.len()
        + map(&c.annotations)
        + map(&c.labels)
        + c.args.iter().map(|a| a.len() + ENTRY).sum::<usize>()
        + opt(&c.cgroup)
        + opt(&c.hostname)
        + opt(&c.sandbox)
        + opt(&c.name)
        + opt(&c.image)
        + opt(&c.image_id)
        + c.bundle.as_ref().map_or(0, |b| b.as_os_str().len())
        + c.runtime_root.as_ref().map_or(0, |b| b.as_os_str().len())
        + c.kubernetes.as_ref().map_or(0, |_| 256)
}

/// Hub limits and policies.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Changes retained for resuming watchers.
    pub window: usize,
    /// Bytes at most (estimated: the containers' strings and entries) of
    /// the containers of the changes retained for resuming watchers. A
    /// removed container's record stays in the window after it is gone:
    /// without a byte bound,
    /// containers with large annotations (up to 256 KiB each are kept)
    /// created and deleted in a loop would hold `window` of them, a GiB.
    /// A watcher that resumes from before the window gets a snapshot.
    pub window_bytes: usize,
    /// Changes buffered per watcher before it is dropped as too slow.
    pub watch_buffer: usize,
    /// Watchers at most.
    pub max_watchers: usize,
    /// Gate subscribers at most.
    pub max_subscribers: usize,
    /// The longest deadline a subscriber may ask for.
    pub max_deadline: Duration,
    /// Namespaces where fail-closed does not apply.
    pub exempt_namespaces: Vec<String>,
    /// Whether the discovery mode holds a created container's `start`
    /// (fanotify with BPF argv capture does; fanotify-only mode allows
    /// execs before it reads their argv, and the informer and scan see
    /// containers after the fact).
    pub can_hold: bool,
}

impl Default for HubConfig {
    fn default() -> Self {
        HubConfig {
            window: 4096,
            window_bytes: 16 << 20,
            watch_buffer: 1024,
            max_watchers: 1024,
            max_subscribers: 64,
            max_deadline: Duration::from_secs(10),
            exempt_namespaces: vec!["kube-system".into()],
            can_hold: true,
        }
    }
}

/// Why a consumer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// Too many of them.
    #[error("too many {what} ({max}); try later")]
    Full {
        /// Watchers or subscribers.
        what: &'static str,
        /// The limit.
        max: usize,
    },
    /// The agent is shutting down.
    #[error("the agent is shutting down; its successor serves the socket soon (retry)")]
    Closing,
}

struct State {
    revision: u64,
    live: HashMap<String, Live>,
    log: VecDeque<Arc<Change>>,
    /// [`record_bytes`] of the changes in `log`.
    log_bytes: usize,
    watchers: Vec<Watcher>,
    /// Why a container's start was denied, until its removal is reported.
    denied: HashMap<String, String>,
    /// Holds opened when a container was created, until its `start`.
    open: HashMap<String, Vec<OpenHold>>,
    /// A start's decision, until the container's removal: a second wait
    /// for the same start (NRI, then the hook) gets it without new holds.
    decided: HashMap<String, StartDecision>,
    /// `Some` while another agent serves the consumer socket (this one is
    /// its successor, waiting): this agent's own reports are kept aside,
    /// and the table and log follow the serving agent's (see
    /// [`Hub::mirror_change`]).
    standby: Option<Standby>,
    /// Revisions strictly between these two were never issued here: a
    /// predecessor that died may have issued them to its consumers before
    /// this agent saw them. Resuming from one gets a snapshot.
    gap: Option<(u64, u64)>,
    /// Shutting down: no new watchers.
    closed: bool,
    /// Containers the predecessor reported removed before this agent took
    /// over, and when it took over: this agent's own late reports of them
    /// (for [`GONE_BEFORE_FOR`]) are dropped.
    gone_before: std::collections::HashSet<String>,
    took_over_at: Option<Instant>,
    /// `CLOCK_MONOTONIC` of the takeover (events carry the same clock).
    took_over_ns: u64,
}

/// The hub. See the module docs.
pub struct Hub {
    state: Mutex<State>,
    gates: Mutex<Vec<Subscriber>>,
    config: HubConfig,
    /// [`HubConfig::can_hold`], known once the discovery mode is.
    can_hold: AtomicBool,
    next_id: AtomicU64,
    metrics: HubMetrics,
    /// [`Watch`]es not yet dropped.
    open_watches: Arc<AtomicU64>,
    /// Starts held for gates ([`Hub::starts_waiting`]).
    waiting: Arc<AtomicU64>,
    /// Where the gate subscriptions are saved for a successor, and
    /// loaded from a predecessor ([`Hub::keep_subscriptions`]).
    store: OnceLock<Box<dyn SubscriptionStore>>,
    /// Orders the saves: (generations taken, saved).
    store_generation: AtomicU64,
    store_saved: Mutex<u64>,
    /// A predecessor's gate subscriptions, registered at the takeover and
    /// waiting for their subscribers to come back, by name: each one's id,
    /// the receiving end of its queue, and its subscriber's uid.
    parked: Mutex<HashMap<String, Vec<Parked>>>,
}

/// Locks `m`, poisoned or not.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // N.B. a poisoned lock only means a consumer's task panicked while
    // holding it; every update leaves the tables (and the counts)
    // consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Hub {
    /// The metrics it counts in (the consumer API's too).
    pub(crate) fn metrics(&self) -> &HubMetrics {
        &self.metrics
    }
}

impl Hub {
    /// A hub. Revisions start at the current time in microseconds, so
    /// that they keep increasing across agent restarts: a consumer that
    /// resumes with a revision of an earlier process gets a snapshot.
    pub fn new(config: HubConfig, metrics: HubMetrics) -> Arc<Hub> {
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_micros() as u64);
        Arc::new(Hub {
            state: Mutex::new(State {
                revision: start,
                live: HashMap::new(),
                log: VecDeque::new(),
                log_bytes: 0,
                watchers: Vec::new(),
                denied: HashMap::new(),
                decided: HashMap::new(),
                open: HashMap::new(),
                standby: None,
                gap: None,
                closed: false,
                gone_before: std::collections::HashSet::new(),
                took_over_at: None,
                took_over_ns: 0,
            }),
            gates: Mutex::new(Vec::new()),
            can_hold: AtomicBool::new(config.can_hold),
            config,
            next_id: AtomicU64::new(1),
            metrics,
            open_watches: Arc::new(AtomicU64::new(0)),
            waiting: Arc::new(AtomicU64::new(0)),
            store: OnceLock::new(),
            store_generation: AtomicU64::new(0),
            store_saved: Mutex::new(0),
            parked: Mutex::new(HashMap::new()),
        })
    }

    /// The containers now (matching `filter`), and the revision they are
    /// current at.
    pub fn list(&self, filter: &Filter) -> (u64, Vec<Live>) {
        let s = lock(&self.state);
        let mut v: Vec<Live> = s
            .live
            .values()
            .filter(|l| filter.matches(&l.container))
            .cloned()
            .collect();
        v.sort_by_key(|l| l.added_monotonic_ns);
        (s.revision, v)
    }

    /// Records an event: a revision, the live table, the window, every
    /// watcher (without waiting: a full watcher is dropped), and not-held
    /// notices for gate subscribers.
    /// Returns whether the event became a change here (an `updated` of a
    /// container that is not live does not).
    fn publish(&self, event: &mut ContainerEvent) -> bool {
        let mut s = lock(&self.state);
        let id = event.container.id.clone();
        // A container the predecessor reported gone before the takeover:
        // this agent's own late report of it would add it again, or remove
        // it twice.
        if s.standby.is_none() && !s.gone_before.is_empty() {
            if s.took_over_at
                .is_some_and(|t| t.elapsed() > GONE_BEFORE_FOR)
            {
                s.gone_before.clear();
            } else if s.gone_before.contains(&id) {
                // A container created again under the same id since is
                // another one: its Added is observed after the takeover,
                // and its Removed finds it live.
                let late = match event.event {
                    EventKind::Added => event.monotonic_ns < s.took_over_ns,
                    EventKind::Removed | EventKind::Updated => !s.live.contains_key(&id),
                };
                if late {
                    if event.event == EventKind::Removed {
                        s.gone_before.remove(&id);
                    }
                    return false;
                }
            }
        }
        if let Some(sb) = s.standby.as_mut() {
            // Another agent serves the socket and reports this container
            // too: kept for the takeover (its holds are that agent's).
            match event.event {
                EventKind::Added => {
                    sb.removed.remove(&id);
                    sb.added.insert(id, event.clone());
                }
                EventKind::Removed => {
                    sb.added.remove(&id);
                    sb.removed.insert(id, event.clone());
                }
                // The serving agent learns the same and publishes it.
                EventKind::Updated => {
                    if let Some(added) = sb.added.get_mut(&id)
                        && added.container.lacks_identity_of(&event.container)
                    {
                        Arc::make_mut(&mut added.container).fill_identity_from(&event.container);
                    }
                }
            }
            return false;
        }
        let superseded;
        let live = match event.event {
            EventKind::Added => {
                let live = Live {
                    container: Arc::clone(&event.container),
                    source: event.source,
                    added_monotonic_ns: event.monotonic_ns,
                    added_unix_ms: unix_ms(),
                };
                superseded = s.live.insert(id.clone(), live.clone()).map(|l| l.container);
                live
            }
            EventKind::Removed => {
                if event.reason.is_none() {
                    event.reason = s.denied.remove(&id);
                } else {
                    s.denied.remove(&id);
                }
                // Holds still open (the container went before its start)
                // are dropped: their subscribers' answers go nowhere.
                s.open.remove(&id);
                s.decided.remove(&id);
                let added = s.live.remove(&id);
                // What was learnt after `added` (Docker's name, image and
                // labels) stays in the last report of it.
                if let Some(known) = &added
                    && !Arc::ptr_eq(&known.container, &event.container)
                {
                    let known = &known.container;
                    if event.container.lacks_identity_of(known) {
                        Arc::make_mut(&mut event.container).fill_identity_from(known);
                    }
                    // The keys consumers' maps hold (cgroup id, namespaces)
                    // are the live container's: a backend that reads them
                    // at the exit finds the init gone, or its pid reused.
                    if event.container.differs_in_kernel_view(known) {
                        Arc::make_mut(&mut event.container).take_kernel_view_from(known);
                    }
                }
                superseded = added.as_ref().map(|l| Arc::clone(&l.container));
                Live {
                    container: Arc::clone(&event.container),
                    source: event.source,
                    added_monotonic_ns: added.as_ref().map_or(0, |l| l.added_monotonic_ns),
                    added_unix_ms: added.as_ref().map_or(0, |l| l.added_unix_ms),
                }
            }
            EventKind::Updated => {
                // Gone already, or never reported here: nothing to update.
                let Some(known) = s.live.get(&id) else {
                    return false;
                };
                // Only what the live container lacks is taken (name, image,
                // labels, a Kubernetes identity): its pid, status and the
                // rest stay, so an update that comes late (after a restart
                // under the same id) cannot bring back an older process.
                if !known.container.lacks_identity_of(&event.container) {
                    return false;
                }
                let mut merged = (*known.container).clone();
                merged.fill_identity_from(&event.container);
                event.container = Arc::new(merged);
                superseded = Some(Arc::clone(&known.container));
                let live = Live {
                    container: Arc::clone(&event.container),
                    ..known.clone()
                };
                s.live.insert(id.clone(), live.clone());
                live
            }
        };
        s.revision += 1;
        let change = Arc::new(Change {
            revision: s.revision,
            kind: event.event,
            live,
            exit_code: event.exit_code,
            reason: event.reason.clone(),
            monotonic_ns: event.monotonic_ns,
            superseded: superseded.filter(|old| !Arc::ptr_eq(old, &event.container)),
        });
        self.fan_out(&mut s, &change);
        drop(s);
        // A created container whose start the runtime hook or NRI holds;
        // never a pod's sandbox (pause): nothing of the pod runs in it.
        let holdable = self.can_hold.load(Ordering::Relaxed)
            && matches!(event.source, Source::RuntimeHook | Source::Nri)
            && event.container.status == Status::Created
            && !event.container.pod_sandbox;
        if event.event == EventKind::Added && holdable {
            // Ask now, while the runtime is between `create` and `start`:
            // a subscriber that answers before `start` costs the start
            // nothing. `start` waits for whatever is still unanswered.
            let mut holds = Vec::new();
            self.open_holds(&change.live, &[], &mut holds);
            if !holds.is_empty() {
                let mut s = lock(&self.state);
                if s.live.contains_key(&id) {
                    s.open.insert(id, holds);
                }
            }
        } else if event.event == EventKind::Added {
            // Containers whose start cannot be held: their subscribers
            // still hear of them.
            let g = lock(&self.gates);
            for sub in g
                .iter()
                .filter(|s| s.sub.filter.matches(&change.live.container))
            {
                let _ = sub.tx.try_send(HoldRequest {
                    hold_id: 0,
                    live: change.live.clone(),
                    respond: None,
                    monotonic_ns: event.monotonic_ns,
                });
                self.metrics.hold(&sub.sub.name, "not-held");
            }
        }
        true
    }

    /// Shutting down: every watcher gets the changes it has, then the end
    /// of its stream; new watchers and lists are refused.
    pub(crate) fn close(&self) {
        let mut s = lock(&self.state);
        s.closed = true;
        s.watchers.clear();
    }

    /// The ids of the containers known here, this agent's own reports
    /// included while standing by.
    pub(crate) fn known_ids(&self) -> Vec<String> {
        let s = lock(&self.state);
        let mut v: Vec<String> = s.live.keys().cloned().collect();
        if let Some(sb) = &s.standby {
            v.extend(sb.added.keys().cloned());
        }
        v
    }

    /// Whether [`Hub::close`] ran.
    pub(crate) fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Watches not yet ended (their consumers' streams are still being
    /// written).
    pub(crate) fn watches_open(&self) -> u64 {
        self.open_watches.load(Ordering::Acquire)
    }

    /// The current revision.
    #[cfg(test)]
    pub(crate) fn revision(&self) -> u64 {
        lock(&self.state).revision
    }
}

/// A [`Sink`] that records every event in the hub, then hands it on.
pub struct HubSink<S> {
    hub: Arc<Hub>,
    out: S,
}

impl<S> HubSink<S> {
    /// Wraps `out`.
    pub fn new(hub: Arc<Hub>, out: S) -> HubSink<S> {
        HubSink { hub, out }
    }

    /// The wrapped sink.
    pub fn inner(&self) -> &S {
        &self.out
    }
}

impl<S: Sink> Sink for HubSink<S> {
    fn emit(&mut self, mut event: ContainerEvent) {
        let published = self.hub.publish(&mut event);
        // An update of a container that is gone goes nowhere.
        if published || event.event != EventKind::Updated {
            self.out.emit(event);
        }
    }
}

#[cfg(test)]
mod tests;
