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

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use lookout_model::{Container, ContainerEvent, EventKind, Sink, Source, Status};
use lookout_model::{StartBarrier, StartDecision, StartWait};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot};

use crate::handover::Book;

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
    }
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
}

/// What a watcher receives.
#[derive(Debug, Clone)]
pub enum WatchItem {
    /// Everything live at `revision` (matching the filter): replace what
    /// you knew.
    Snapshot {
        /// The snapshot's revision.
        revision: u64,
        /// The containers.
        containers: Vec<Live>,
    },
    /// One change after the last item.
    Change(Arc<Change>),
}

/// Why a watch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WatchEnd {
    /// The watcher did not keep up: its buffer filled. Watch again from
    /// the last revision seen.
    #[error(
        "the watcher did not keep up (its buffer of {0} changes filled); watch again from the last revision seen"
    )]
    Lagged(usize),
    /// The agent is shutting down.
    #[error("the agent is shutting down")]
    Closed,
}

/// A watch: a backlog (snapshot or retained changes), then live changes.
pub struct Watch {
    backlog: VecDeque<WatchItem>,
    rx: mpsc::Receiver<Arc<Change>>,
    lagged: Arc<AtomicBool>,
    buffer: usize,
    metrics: HubMetrics,
    /// [`Hub::watches_open`].
    open: Arc<AtomicU64>,
}

impl Watch {
    /// The next item; `Err` when the watch ended.
    pub async fn next(&mut self) -> Result<WatchItem, WatchEnd> {
        if let Some(i) = self.backlog.pop_front() {
            return Ok(i);
        }
        match self.rx.recv().await {
            Some(c) => Ok(WatchItem::Change(c)),
            None if self.lagged.load(Ordering::Acquire) => Err(WatchEnd::Lagged(self.buffer)),
            None => Err(WatchEnd::Closed),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.metrics.watchers.dec();
        self.open.fetch_sub(1, Ordering::Release);
    }
}

/// What happens to a hold that is not answered in time, or whose
/// subscriber goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// The container starts.
    Open,
    /// The container does not start, unless its namespace is exempt.
    Closed,
}

/// A gate subscription.
#[derive(Debug, Clone)]
pub struct Subscription {
    /// Shown in logs, metrics and denial reasons.
    pub name: String,
    /// Which containers it holds.
    pub filter: Filter,
    /// How long a hold waits for the decision.
    ///
    /// A subscriber that lets a hold reach its deadline (or the runtime's,
    /// under NRI, if that comes first) is *overdue*: its next holds are
    /// still sent to it, but no start waits for them (they resolve at once
    /// by [`Subscription::on_failure`]) until it answers one within that
    /// hold's deadline. A stalled subscriber so costs one start its
    /// deadline, not every start on the node: NRI runtimes relay one
    /// request at a time, so there a wait would hold up every pod's
    /// containers.
    pub deadline: Duration,
    /// What an unanswered hold becomes.
    pub on_failure: FailurePolicy,
}

/// A subscriber's verdict on one hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Start.
    Allow,
    /// Do not start, for this reason.
    Deny(String),
}

/// A container handed to a gate subscriber.
#[derive(Debug)]
pub struct HoldRequest {
    /// Unique per agent process; 0 when not held.
    pub hold_id: u64,
    /// The container.
    pub live: Live,
    /// Whether its start waits: send the verdict through `respond`.
    /// `None` when it could not be held (reported by the Pod informer
    /// or a scan, or created and started in one step by `runc run`).
    pub respond: Option<Responder>,
    /// `CLOCK_MONOTONIC` nanoseconds when the hold began.
    pub monotonic_ns: u64,
}

/// Where a gate subscriber sends its verdict on one hold.
///
/// Dropping it unanswered resolves the hold by the subscriber's
/// [`FailurePolicy`] when the container's start comes.
#[derive(Debug)]
pub struct Responder(oneshot::Sender<Answer>);

#[derive(Debug)]
struct Answer {
    verdict: Verdict,
    at: Instant,
}

impl Responder {
    /// Sends the verdict. Gives it back when nobody waits for it any more
    /// (the container was removed, or its start already went on without
    /// it).
    pub fn send(self, verdict: Verdict) -> Result<(), Verdict> {
        self.0
            .send(Answer {
                verdict,
                at: Instant::now(),
            })
            .map_err(|a| a.verdict)
    }

    /// Whether nobody waits for the verdict any more.
    pub fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// A registered gate subscriber's end: the holds it must answer.
pub struct GateSubscriber {
    /// Holds (and not-held notices) for this subscriber.
    pub holds: mpsc::Receiver<HoldRequest>,
    /// The deadline in force (the asked one, bounded).
    pub deadline: Duration,
    _registration: Registration,
}

/// Unregisters a subscriber when dropped.
struct Registration {
    hub: Arc<Hub>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut g = lock(&self.hub.gates);
        g.retain(|s| s.id != self.id);
        self.hub.metrics.subscribers.set(g.len() as i64);
        drop(g);
        self.hub.write_book();
    }
}

struct Subscriber {
    id: u64,
    sub: Subscription,
    /// Its peer's uid (`SO_PEERCRED`; 0 when embedded): after a rollout
    /// only this uid, or root, takes the subscription back.
    uid: u32,
    tx: mpsc::Sender<HoldRequest>,
    /// It let a hold reach its deadline and has not answered one since.
    overdue: Arc<AtomicBool>,
}

/// Hub limits and policies.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Changes retained for resuming watchers.
    pub window: usize,
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

struct Watcher {
    filter: Filter,
    tx: mpsc::Sender<Arc<Change>>,
    lagged: Arc<AtomicBool>,
}

struct State {
    revision: u64,
    live: HashMap<String, Live>,
    log: VecDeque<Arc<Change>>,
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

/// Takes the first parked subscription named `name` that `pick` accepts.
fn take_parked(
    parked: &mut HashMap<String, Vec<Parked>>,
    name: &str,
    pick: impl Fn(&Parked) -> bool,
) -> Option<Parked> {
    let v = parked.get_mut(name)?;
    let found = v.iter().position(pick).map(|i| v.remove(i));
    if v.is_empty() {
        parked.remove(name);
    }
    found
}

/// A predecessor's gate subscription waiting for its subscriber.
struct Parked {
    id: u64,
    holds: mpsc::Receiver<HoldRequest>,
    uid: u32,
}

/// A standby hub's own reports, for [`Hub::take_over`].
#[derive(Default)]
struct Standby {
    /// Containers reported and not removed since, by id.
    added: HashMap<String, ContainerEvent>,
    /// Containers reported removed, by id.
    removed: HashMap<String, ContainerEvent>,
    /// A snapshot of the serving agent arrived: revisions are its.
    mirrored: bool,
    /// Containers the serving agent reported removed meanwhile.
    mirror_removed: std::collections::HashSet<String>,
}

/// Containers remembered as reported gone by the serving agent while
/// standing by (a bound against a long standby on a busy node).
const MAX_REMEMBERED_GONE: usize = 65536;

/// How long after a takeover this agent's own late reports of containers
/// its predecessor reported gone are dropped.
const GONE_BEFORE_FOR: Duration = Duration::from_secs(30);

/// How far revisions jump when a predecessor ended without a clean
/// handover ([`Hub::take_over`]): more changes than it could have issued
/// that this agent did not see.
pub(crate) const REVISION_GAP: u64 = 1 << 20;

/// What [`Hub::take_over`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TakeOver {
    /// The last revision of the predecessor's log here (0: none).
    pub mirrored: u64,
    /// Containers this agent saw that the predecessor had not reported.
    pub added: usize,
    /// Containers it reported that this agent saw go.
    pub removed: usize,
    /// The first revision this agent issues.
    pub next: u64,
}

/// One subscriber's hold on a created container, opened before the
/// runtime's `start` asks for it.
struct OpenHold {
    subscriber: u64,
    sub: Subscription,
    /// `None`: the subscriber's queue was full; its policy decides.
    answer: Option<oneshot::Receiver<Answer>>,
    issued: Instant,
    /// The subscriber's overdue mark (set when this hold times out).
    overdue: Arc<AtomicBool>,
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
    /// Where the gate subscriptions are recorded for a successor, and
    /// read from a predecessor ([`Hub::keep_book`]).
    book: OnceLock<Book>,
    /// Orders the gates file's writes: (generations taken, written).
    book_generation: AtomicU64,
    book_written: Mutex<u64>,
    /// A predecessor's gate subscriptions, registered at the takeover and
    /// waiting for their subscribers to come back, by name: each one's id,
    /// the receiving end of its queue, and its subscriber's uid.
    parked: Mutex<HashMap<String, Vec<Parked>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // N.B. a poisoned lock only means a consumer's task panicked while
    // holding it; every update leaves the tables consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
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
            book: OnceLock::new(),
            book_generation: AtomicU64::new(0),
            book_written: Mutex::new(0),
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

    /// Every change after `since` (matching `filter`); a snapshot first
    /// when `since` is 0, in the future, or older than the window.
    pub fn watch(&self, since: u64, filter: Filter) -> Result<Watch, Refused> {
        self.watch_as(since, filter, false)
    }

    /// [`Hub::watch`] for a `privileged` (root) peer, which the watcher
    /// limit does not apply to: an agent standing by mirrors through one,
    /// and unprivileged consumers that fill the limit must not keep it out.
    pub(crate) fn watch_as(
        &self,
        since: u64,
        filter: Filter,
        privileged: bool,
    ) -> Result<Watch, Refused> {
        let mut s = lock(&self.state);
        if s.closed {
            return Err(Refused::Closing);
        }
        s.watchers.retain(|w| !w.tx.is_closed());
        if s.watchers.len() >= self.config.max_watchers && !privileged {
            return Err(Refused::Full {
                what: "watchers",
                max: self.config.max_watchers,
            });
        }
        // Every change after `since` is still in the log (none missed):
        // the log reaches back to `since + 1`, or `since` is now.
        let retained = match s.log.front() {
            // The log starts right after the gap, and `since` right before.
            Some(first)
                if s.gap
                    .is_some_and(|(lo, hi)| since == lo && first.revision == hi) =>
            {
                true
            }
            Some(first) => since.saturating_add(1) >= first.revision,
            None => since == s.revision,
        };
        // A revision in a gap was issued by a predecessor that died before
        // this agent saw it: what came after it is unknown here.
        let in_gap = s.gap.is_some_and(|(lo, hi)| since > lo && since < hi);
        let mut backlog = VecDeque::new();
        if since == 0 || since > s.revision || !retained || in_gap {
            let mut containers: Vec<Live> = s
                .live
                .values()
                .filter(|l| filter.matches(&l.container))
                .cloned()
                .collect();
            containers.sort_by_key(|l| l.added_monotonic_ns);
            backlog.push_back(WatchItem::Snapshot {
                revision: s.revision,
                containers,
            });
        } else {
            backlog.extend(
                s.log
                    .iter()
                    .filter(|c| c.revision > since && filter.matches(&c.live.container))
                    .map(|c| WatchItem::Change(Arc::clone(c))),
            );
        }
        let (tx, rx) = mpsc::channel(self.config.watch_buffer);
        let lagged = Arc::new(AtomicBool::new(false));
        s.watchers.push(Watcher {
            filter,
            tx,
            lagged: Arc::clone(&lagged),
        });
        self.metrics.watchers.inc();
        self.open_watches.fetch_add(1, Ordering::Release);
        Ok(Watch {
            backlog,
            rx,
            lagged,
            buffer: self.config.watch_buffer,
            metrics: self.metrics.clone(),
            open: Arc::clone(&self.open_watches),
        })
    }

    /// Whether the discovery mode holds starts (see [`HubConfig::can_hold`]).
    pub fn set_can_hold(&self, yes: bool) {
        self.can_hold.store(yes, Ordering::Relaxed);
    }

    /// Registers a gate subscriber. Its deadline is bounded by
    /// [`HubConfig::max_deadline`].
    pub fn gate(self: &Arc<Self>, sub: Subscription) -> Result<GateSubscriber, Refused> {
        self.gate_as(sub, 0)
    }

    /// [`Hub::gate`] for a peer of `uid`.
    pub(crate) fn gate_as(
        self: &Arc<Self>,
        mut sub: Subscription,
        uid: u32,
    ) -> Result<GateSubscriber, Refused> {
        sub.deadline = sub.deadline.min(self.config.max_deadline);
        // Handed over: a subscription here would hold nothing once this
        // agent stops; the successor takes it.
        if lock(&self.state).closed {
            return Err(Refused::Closing);
        }
        let mut g = lock(&self.gates);
        let deadline = sub.deadline;
        // A predecessor's subscription of the same name, parked at the
        // takeover: this subscriber takes its place, and the holds queued
        // for it meanwhile.
        // Only its own uid, or root, takes it back: another allow-listed
        // peer naming itself alike does not get its holds.
        let parked = take_parked(&mut lock(&self.parked), &sub.name, |x| {
            x.uid == uid || uid == 0
        });
        // Not counted against the limit: it takes a place it had.
        if parked.is_none() && g.len() >= self.config.max_subscribers {
            return Err(Refused::Full {
                what: "gate subscribers",
                max: self.config.max_subscribers,
            });
        }
        if let Some(Parked { id, holds: rx, .. }) = parked
            && let Some(s) = g.iter_mut().find(|s| s.id == id)
        {
            tracing::info!(gate = sub.name, "gate subscriber back after the takeover");
            s.sub = sub;
            drop(g);
            self.write_book();
            return Ok(GateSubscriber {
                holds: rx,
                deadline,
                _registration: Registration {
                    hub: Arc::clone(self),
                    id,
                },
            });
        }
        let (id, rx) = self.register(&mut g, sub, uid);
        self.metrics.subscribers.set(g.len() as i64);
        drop(g);
        self.write_book();
        Ok(GateSubscriber {
            holds: rx,
            deadline,
            _registration: Registration {
                hub: Arc::clone(self),
                id,
            },
        })
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
                    if let Some(added) = sb.added.get_mut(&id) {
                        added.container.fill_identity_from(&event.container);
                    }
                }
            }
            return false;
        }
        let live = match event.event {
            EventKind::Added => {
                let live = Live {
                    container: Arc::new(event.container.clone()),
                    source: event.source,
                    added_monotonic_ns: event.monotonic_ns,
                    added_unix_ms: unix_ms(),
                };
                s.live.insert(id.clone(), live.clone());
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
                if let Some(known) = &added {
                    event.container.fill_identity_from(&known.container);
                }
                Live {
                    container: Arc::new(event.container.clone()),
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
                let mut merged = (*known.container).clone();
                merged.fill_identity_from(&event.container);
                if merged == *known.container {
                    return false;
                }
                event.container = merged;
                let live = Live {
                    container: Arc::new(event.container.clone()),
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

    /// Appends `change` to the log and hands it to every matching watcher
    /// (without waiting: a full watcher is dropped).
    fn fan_out(&self, s: &mut State, change: &Arc<Change>) {
        s.log.push_back(Arc::clone(change));
        while s.log.len() > self.config.window {
            s.log.pop_front();
        }
        let metrics = &self.metrics;
        s.watchers.retain(|w| {
            if !w.filter.matches(&change.live.container) {
                return !w.tx.is_closed();
            }
            match w.tx.try_send(Arc::clone(change)) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Closed(_)) => false,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    w.lagged.store(true, Ordering::Release);
                    metrics.watchers_dropped.inc();
                    tracing::warn!(
                        buffer = self.config.watch_buffer,
                        "a watcher did not keep up; disconnected"
                    );
                    false
                }
            }
        });
    }

    /// Stands by: another agent serves the consumer socket. This hub's own
    /// reports are kept aside until [`Hub::take_over`]; meanwhile the
    /// serving agent's changes arrive through [`Hub::mirror_snapshot`] and
    /// [`Hub::mirror_change`].
    pub(crate) fn stand_by(&self) {
        lock(&self.state).standby = Some(Standby::default());
    }

    /// Whether the hub stands by.
    pub(crate) fn standing_by(&self) -> bool {
        lock(&self.state).standby.is_some()
    }

    /// The serving agent's last revision mirrored here (0: none yet, or
    /// not standing by).
    pub(crate) fn revision_mirrored(&self) -> u64 {
        let s = lock(&self.state);
        match &s.standby {
            Some(sb) if sb.mirrored => s.revision,
            _ => 0,
        }
    }

    /// The serving agent's table at `revision`: replaces this one's, with
    /// its revision (its log is not known before it).
    pub(crate) fn mirror_snapshot(&self, revision: u64, containers: Vec<Live>) {
        let mut s = lock(&self.state);
        let Some(sb) = s.standby.as_mut() else {
            return;
        };
        sb.mirrored = true;
        s.live = containers
            .into_iter()
            .map(|l| (l.container.id.clone(), l))
            .collect();
        s.revision = revision;
        s.log.clear();
    }

    /// One change of the serving agent, with its revision. Changes at or
    /// below the last one (a resumed stream) are skipped.
    pub(crate) fn mirror_change(&self, change: Change) {
        let mut s = lock(&self.state);
        if !s.standby.as_ref().is_some_and(|sb| sb.mirrored) || change.revision <= s.revision {
            return;
        }
        let id = change.live.container.id.clone();
        match change.kind {
            EventKind::Added => {
                s.live.insert(id, change.live.clone());
            }
            EventKind::Updated => {
                if !s.live.contains_key(&id) {
                    return;
                }
                s.live.insert(id, change.live.clone());
            }
            EventKind::Removed => {
                s.live.remove(&id);
                // Reported gone by the serving agent: nothing of this
                // agent's own reports is left to reconcile.
                if let Some(sb) = s.standby.as_mut() {
                    sb.added.remove(&id);
                    sb.removed.remove(&id);
                    if sb.mirror_removed.len() < MAX_REMEMBERED_GONE {
                        sb.mirror_removed.insert(id);
                    }
                }
            }
        }
        s.revision = change.revision;
        let change = Arc::new(change);
        self.fan_out(&mut s, &change);
    }

    /// Ends standby: this agent now serves the socket. Revisions continue
    /// from the predecessor's last one; with `clean` false (it died, or
    /// its last changes may not have arrived) they jump by
    /// [`REVISION_GAP`] and a consumer resuming inside the gap gets a
    /// snapshot. Then the containers this agent saw that the predecessor's
    /// table lacks are added, and those it saw go are removed, as changes
    /// of their own.
    pub(crate) fn take_over(self: &Arc<Self>, clean: bool) -> TakeOver {
        // The predecessor's gates first: from the instant this hub stops
        // standing by, a start is held for them.
        if let Some(book) = self.book.get() {
            self.park(book.read_gates());
        }
        let (sb, mirrored) = {
            let mut s = lock(&self.state);
            let Some(sb) = s.standby.take() else {
                return TakeOver {
                    mirrored: 0,
                    added: 0,
                    removed: 0,
                    next: s.revision + 1,
                };
            };
            let mirrored = if sb.mirrored { s.revision } else { 0 };
            if sb.mirrored && !clean {
                let hi = s.revision.saturating_add(REVISION_GAP);
                s.gap = Some((s.revision, hi));
                s.revision = hi - 1;
            }
            // Containers the predecessor reported gone: this agent's own
            // reports of them that come late change nothing.
            s.gone_before = sb.mirror_removed.clone();
            s.took_over_at = Some(Instant::now());
            s.took_over_ns = lookout_model::monotonic_ns();
            (sb, mirrored)
        };
        let next = lock(&self.state).revision + 1;
        let mut removed: Vec<ContainerEvent> = sb.removed.into_values().collect();
        removed.sort_by_key(|e| e.monotonic_ns);
        let mut n_removed = 0;
        for mut e in removed {
            if lock(&self.state).live.contains_key(&e.container.id) {
                self.publish(&mut e);
                n_removed += 1;
            }
        }
        let mut added: Vec<ContainerEvent> = sb.added.into_values().collect();
        added.sort_by_key(|e| e.monotonic_ns);
        let mut n_added = 0;
        for mut e in added {
            let id = &e.container.id;
            let known = {
                let s = lock(&self.state);
                s.live.contains_key(id) || sb.mirror_removed.contains(id)
            };
            if !known {
                self.publish(&mut e);
                n_added += 1;
            } else if lock(&self.state).live.contains_key(id) {
                // What this agent learnt of a container the predecessor
                // reported without it (Docker's identity, from a lookup the
                // predecessor never finished) follows as an update.
                let mut u = ContainerEvent::updated(Source::Docker, e.container.clone());
                self.publish(&mut u);
            }
        }
        self.write_book();
        TakeOver {
            mirrored,
            added: n_added,
            removed: n_removed,
            next,
        }
    }

    /// Records gate subscriptions and start decisions in `book`, for a
    /// successor, and reads a predecessor's from it at the takeover. Set
    /// before [`Hub::stand_by`] or serving; nothing is written until
    /// [`Hub::write_book`].
    pub(crate) fn keep_book(&self, book: Book) {
        let _ = self.book.set(book);
    }

    /// Writes the gate subscriptions in force to the book (the latest
    /// list wins when two registrations race); nothing while standing by
    /// (the book is the serving agent's).
    pub(crate) fn write_book(&self) {
        let Some(book) = self.book.get() else {
            return;
        };
        {
            let s = lock(&self.state);
            // Standing by: the serving agent's book, not ours to write.
            // Closed: handed over; the successor's now.
            if s.standby.is_some() || s.closed {
                return;
            }
        }
        let (generation, subs) = {
            let g = lock(&self.gates);
            let generation = self.book_generation.fetch_add(1, Ordering::AcqRel) + 1;
            (
                generation,
                g.iter().map(|s| (s.sub.clone(), s.uid)).collect::<Vec<_>>(),
            )
        };
        let mut written = lock(&self.book_written);
        if generation > *written {
            book.write_gates(&subs);
            *written = generation;
        }
    }

    /// Adds a subscriber to `g`: its id and the receiving end of its queue.
    fn register(
        &self,
        g: &mut Vec<Subscriber>,
        sub: Subscription,
        uid: u32,
    ) -> (u64, mpsc::Receiver<HoldRequest>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(256);
        g.push(Subscriber {
            id,
            sub,
            uid,
            tx,
            overdue: Arc::new(AtomicBool::new(false)),
        });
        (id, rx)
    }

    /// Registers a predecessor's gate subscriptions, each until its
    /// subscriber comes back or [`HubConfig::max_deadline`] (at least
    /// 5 s) passes: meanwhile a start they would hold is held, and decided
    /// by the subscriber, or by its policy at its deadline.
    fn park(self: &Arc<Self>, subs: Vec<(Subscription, u32)>) {
        if subs.is_empty() {
            return;
        }
        // The old agent decides the starts it holds (at most a deadline)
        // before its exit ends its subscribers' streams: room for that,
        // and for them to redial.
        let grace = self.config.max_deadline * 2 + Duration::from_secs(5);
        let mut names = Vec::new();
        {
            let mut g = lock(&self.gates);
            let mut parked = lock(&self.parked);
            for (mut sub, uid) in subs {
                if g.len() >= self.config.max_subscribers {
                    continue;
                }
                sub.deadline = sub.deadline.min(self.config.max_deadline);
                let name = sub.name.clone();
                let (id, rx) = self.register(&mut g, sub, uid);
                names.push((name.clone(), id));
                parked
                    .entry(name)
                    .or_default()
                    .push(Parked { id, holds: rx, uid });
            }
            self.metrics.subscribers.set(g.len() as i64);
        }
        tracing::info!(
            gates = ?names.iter().map(|n| &n.0).collect::<Vec<_>>(),
            ?grace,
            "the predecessor's gates hold starts until their subscribers come back"
        );
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let hub = Arc::downgrade(self);
        rt.spawn(async move {
            tokio::time::sleep(grace).await;
            let Some(hub) = hub.upgrade() else { return };
            for (name, id) in names {
                let Some(rx) = take_parked(&mut lock(&hub.parked), &name, |x| x.id == id) else {
                    continue;
                };
                tracing::warn!(
                    gate = name,
                    ?grace,
                    "gate subscriber did not come back after the takeover; its subscription ends \
                     (its holds follow its policy)"
                );
                let mut g = lock(&hub.gates);
                g.retain(|s| s.id != id);
                hub.metrics.subscribers.set(g.len() as i64);
                drop(g);
                drop(rx);
                hub.write_book();
            }
        });
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

    /// Ends every gate subscriber's stream (after its last hold): a
    /// stopping agent that decided the starts it held lets its subscribers
    /// go to its successor.
    pub(crate) fn end_gates(&self) {
        let mut g = lock(&self.gates);
        g.clear();
        self.metrics.subscribers.set(0);
    }

    /// Watches not yet ended (their consumers' streams are still being
    /// written).
    pub(crate) fn watches_open(&self) -> u64 {
        self.open_watches.load(Ordering::Acquire)
    }

    /// Starts held for gates now (a stopping agent decides them before it
    /// exits).
    pub(crate) fn starts_waiting(&self) -> u64 {
        self.waiting.load(Ordering::Acquire)
    }

    /// The current revision.
    #[cfg(test)]
    pub(crate) fn revision(&self) -> u64 {
        lock(&self.state).revision
    }

    /// Hands `live` to every matching gate subscriber that is not in
    /// `asked`, adding the holds to `out`. Never waits: a full queue
    /// makes a hold its subscriber's policy decides.
    fn open_holds(&self, live: &Live, asked: &[u64], out: &mut Vec<OpenHold>) {
        let g = lock(&self.gates);
        if g.is_empty() {
            return;
        }
        let monotonic_ns = lookout_model::monotonic_ns();
        let issued = Instant::now();
        for s in g
            .iter()
            .filter(|s| !asked.contains(&s.id) && s.sub.filter.matches(&live.container))
        {
            let hold_id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = oneshot::channel();
            let sent = s.tx.try_send(HoldRequest {
                hold_id,
                live: live.clone(),
                respond: Some(Responder(tx)),
                monotonic_ns,
            });
            let answer = if sent.is_ok() {
                self.metrics.hold(&s.sub.name, "held");
                Some(rx)
            } else {
                tracing::warn!(
                    gate = s.sub.name,
                    id = live.container.id,
                    "gate subscriber's queue is full"
                );
                self.metrics.hold(&s.sub.name, "queue-full");
                None
            };
            out.push(OpenHold {
                subscriber: s.id,
                sub: s.sub.clone(),
                answer,
                issued,
                overdue: Arc::clone(&s.overdue),
            });
        }
    }

    fn exempt(&self, c: &Container) -> bool {
        c.kubernetes
            .as_ref()
            .and_then(|k| k.namespace.as_ref())
            .is_some_and(|ns| self.config.exempt_namespaces.contains(ns))
    }

    /// A subscriber's answer, counted.
    fn answered(&self, sub: &Subscription, issued: Instant, a: Answer) -> (Verdict, &'static str) {
        self.metrics.answered(&sub.name, a.at - issued);
        let outcome = match a.verdict {
            Verdict::Allow => "allow",
            Verdict::Deny(_) => "deny",
        };
        (a.verdict, outcome)
    }

    /// What an unanswered hold becomes (`what` happened to the gate).
    fn failure(&self, sub: &Subscription, c: &Container, what: &str) -> Verdict {
        match sub.on_failure {
            FailurePolicy::Open => {
                tracing::warn!(
                    id = c.id,
                    gate = sub.name,
                    what,
                    "gate did not decide; the container starts (fail-open)"
                );
                Verdict::Allow
            }
            FailurePolicy::Closed if self.exempt(c) => {
                tracing::warn!(
                    id = c.id,
                    gate = sub.name,
                    what,
                    "fail-closed gate not applied: the container's namespace is exempt"
                );
                Verdict::Allow
            }
            FailurePolicy::Closed => Verdict::Deny(format!("{what} (fail-closed)")),
        }
    }
}

/// The runtime hook's start barrier: holds a created container's `start`
/// until every matching gate subscriber decided.
pub struct GateBarrier(pub Arc<Hub>);

impl StartBarrier for GateBarrier {
    fn wait(&self, id: &str) -> Option<StartWait> {
        self.wait_capped(id, None)
    }

    fn wait_until(&self, id: &str, until: Instant) -> Option<StartWait> {
        self.wait_capped(id, Some(until))
    }
}

impl GateBarrier {
    /// The start of `id` waits for its gates; a hold still unanswered at
    /// `cap` (the caller's own deadline, NRI's) is decided then, by its
    /// subscriber's policy, as at the subscriber's deadline.
    fn wait_capped(&self, id: &str, cap: Option<Instant>) -> Option<StartWait> {
        let hub = Arc::clone(&self.0);
        if !hub.can_hold.load(Ordering::Relaxed) {
            return None;
        }
        if hub.standing_by() {
            // The serving agent holds this start too, and its gates decide
            // it: the kernel asks one fanotify group after the other, so
            // waiting here for its decision would wait for ever when this
            // group is asked first. It keeps deciding until this agent
            // serves (see crate::run's shutdown order).
            return None;
        }
        // The holds opened at `create`, and holds for subscribers that
        // came since. With neither, the start waits for nothing.
        let (live, mut holds) = {
            let mut s = lock(&hub.state);
            // Decided already (NRI's StartContainer, then `runc start`
            // beside it): the same decision, and no second hold.
            if let Some(d) = s.decided.get(id) {
                return match d {
                    StartDecision::Proceed => None,
                    d => {
                        let d = d.clone();
                        Some(Box::pin(async move { d }))
                    }
                };
            }
            let holds = s.open.remove(id).unwrap_or_default();
            if holds.is_empty() && lock(&hub.gates).is_empty() {
                return None;
            }
            (s.live.get(id).cloned()?, holds)
        };
        let asked: Vec<u64> = holds.iter().map(|h| h.subscriber).collect();
        hub.open_holds(&live, &asked, &mut holds);
        if holds.is_empty() {
            return None;
        }
        let waiting = Counted::new(&hub.waiting);
        Some(Box::pin(async move {
            use futures::StreamExt;
            let _waiting = waiting;
            let started = Instant::now();
            let c = Arc::clone(&live.container);
            let mut decided: futures::stream::FuturesUnordered<_> = holds
                .into_iter()
                .map(|h| {
                    let (hub, c) = (Arc::clone(&hub), Arc::clone(&c));
                    async move {
                        let outcome = hub.decide(h, cap, &c).await;
                        hub.metrics.decided(&outcome.0, outcome.2);
                        (outcome.0, outcome.1)
                    }
                })
                .collect();
            // The first denial decides; the other holds resolve on their
            // own (their subscribers still get an answer slot).
            let decision = loop {
                match decided.next().await {
                    Some((name, Verdict::Deny(reason))) => {
                        let reason = format!("denied by gate {name}: {reason}");
                        lock(&hub.state).denied.insert(c.id.clone(), reason.clone());
                        break StartDecision::Deny(reason);
                    }
                    Some((_, Verdict::Allow)) => {}
                    None => break StartDecision::Proceed,
                }
            };
            {
                let mut s = lock(&hub.state);
                if s.live.contains_key(&c.id) {
                    s.decided.insert(c.id.clone(), decision.clone());
                }
            }
            hub.metrics.start_waited(started.elapsed());
            decision
        }))
    }
}

impl Hub {
    /// One hold's verdict: the subscriber's answer, or its policy when it
    /// has none by its deadline (or by `cap`), went away, or is overdue.
    /// Returns the subscriber's name, the verdict and the outcome label.
    async fn decide(
        &self,
        h: OpenHold,
        cap: Option<Instant>,
        c: &Container,
    ) -> (String, Verdict, &'static str) {
        let sub = h.sub;
        // The deadline runs from the hold's issue.
        let own = h.issued + sub.deadline;
        let until = cap.map_or(own, |cap| cap.min(own));
        let (verdict, outcome) = match h.answer {
            None => (self.failure(&sub, c, "its queue is full"), "queue-full"),
            // Overdue: what it answered by now, or nothing.
            Some(mut rx) if h.overdue.load(Ordering::Relaxed) => match rx.try_recv() {
                Ok(a) => {
                    h.overdue.store(false, Ordering::Relaxed);
                    self.answered(&sub, h.issued, a)
                }
                Err(_) => {
                    // Not waited for; an answer within the hold's own
                    // deadline shows the subscriber answers again.
                    if let Ok(rt) = tokio::runtime::Handle::try_current() {
                        let overdue = Arc::clone(&h.overdue);
                        rt.spawn(async move {
                            let own = tokio::time::Instant::from_std(own);
                            if let Ok(Ok(_)) = tokio::time::timeout_at(own, rx).await {
                                overdue.store(false, Ordering::Relaxed);
                            }
                        });
                    }
                    (
                        self.failure(
                            &sub,
                            c,
                            "it missed its last deadline and has not answered one in time \
                             since (not waited for)",
                        ),
                        "overdue",
                    )
                }
            },
            Some(rx) => {
                match tokio::time::timeout_at(tokio::time::Instant::from_std(until), rx).await {
                    Ok(Ok(a)) => {
                        h.overdue.store(false, Ordering::Relaxed);
                        self.answered(&sub, h.issued, a)
                    }
                    Ok(Err(_)) => (self.failure(&sub, c, "it went away"), "disconnected"),
                    Err(_) => {
                        h.overdue.store(true, Ordering::Relaxed);
                        let what = if until < own {
                            format!(
                                "no answer within {:?}, the runtime's deadline",
                                until.saturating_duration_since(h.issued)
                            )
                        } else {
                            format!("no answer within {:?}", sub.deadline)
                        };
                        (self.failure(&sub, c, &what), "timeout")
                    }
                }
            }
        };
        (sub.name, verdict, outcome)
    }
}

/// Counts one piece of work in a shared counter while it lives (a held
/// start in [`Hub::starts_waiting`], a hook stage in flight): what a
/// stopping agent waits for.
pub(crate) struct Counted(Arc<AtomicU64>);

impl Counted {
    pub(crate) fn new(n: &Arc<AtomicU64>) -> Counted {
        n.fetch_add(1, Ordering::AcqRel);
        Counted(Arc::clone(n))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Every start barrier at once: the start goes on when all proceed, and
/// is denied as soon as one denies.
pub struct Barriers(pub Vec<Arc<dyn StartBarrier>>);

impl Barriers {
    fn all(waits: Vec<StartWait>) -> Option<StartWait> {
        if waits.is_empty() {
            return None;
        }
        Some(Box::pin(async move {
            use futures::StreamExt;
            let mut waits: futures::stream::FuturesUnordered<_> = waits.into_iter().collect();
            while let Some(d) = waits.next().await {
                if let StartDecision::Deny(_) = d {
                    return d;
                }
            }
            StartDecision::Proceed
        }))
    }
}

impl StartBarrier for Barriers {
    fn wait(&self, id: &str) -> Option<StartWait> {
        Barriers::all(self.0.iter().filter_map(|b| b.wait(id)).collect())
    }

    fn wait_until(&self, id: &str, until: Instant) -> Option<StartWait> {
        Barriers::all(
            self.0
                .iter()
                .filter_map(|b| b.wait_until(id, until))
                .collect(),
        )
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GateLabels {
    subscriber: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubscriberLabels {
    subscriber: String,
}

/// The hub's metrics.
#[derive(Clone)]
pub struct HubMetrics {
    watchers: Gauge,
    watchers_dropped: Counter,
    subscribers: Gauge,
    holds: Family<GateLabels, Counter>,
    decisions: Family<GateLabels, Counter>,
    hold_seconds: Family<SubscriberLabels, Histogram>,
    start_wait_seconds: Histogram,
}

impl HubMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(registry: &mut Registry) -> HubMetrics {
        let m = HubMetrics {
            watchers: Gauge::default(),
            watchers_dropped: Counter::default(),
            subscribers: Gauge::default(),
            holds: Family::default(),
            decisions: Family::default(),
            hold_seconds: Family::new_with_constructor(|| {
                // 100 us .. ~26 s
                Histogram::new(exponential_buckets(1e-4, 4.0, 10))
            }),
            // 10 us .. ~10 s
            start_wait_seconds: Histogram::new(exponential_buckets(1e-5, 4.0, 11)),
        };
        registry.register("watchers", "Consumers watching changes", m.watchers.clone());
        registry.register(
            "watchers_dropped",
            "Watchers disconnected because they did not keep up",
            m.watchers_dropped.clone(),
        );
        registry.register(
            "gate_subscribers",
            "Gate subscribers connected",
            m.subscribers.clone(),
        );
        registry.register(
            "gate_holds",
            "Containers handed to gate subscribers, by outcome: held, not-held, queue-full",
            m.holds.clone(),
        );
        registry.register(
            "gate_decisions",
            "Holds resolved, by outcome: allow, deny, timeout, overdue, disconnected, queue-full",
            m.decisions.clone(),
        );
        registry.register(
            "gate_hold_seconds",
            "Time from a hold's issue (at the container's create) to its subscriber's answer",
            m.hold_seconds.clone(),
        );
        registry.register(
            "gate_start_wait_seconds",
            "Time a runtime start waited for the gates' answers still missing when it came",
            m.start_wait_seconds.clone(),
        );
        m
    }

    fn hold(&self, subscriber: &str, outcome: &str) {
        self.holds
            .get_or_create(&GateLabels {
                subscriber: subscriber.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    fn decided(&self, subscriber: &str, outcome: &str) {
        self.decisions
            .get_or_create(&GateLabels {
                subscriber: subscriber.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    fn answered(&self, subscriber: &str, took: Duration) {
        self.hold_seconds
            .get_or_create(&SubscriberLabels {
                subscriber: subscriber.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    fn start_waited(&self, waited: Duration) {
        self.start_wait_seconds.observe(waited.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lookout_model::{Kubernetes, RuntimeKind};

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
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("s.sock");
        let book = Book::new(&socket);
        let sub = |name: &str, on_failure| Subscription {
            name: name.into(),
            filter: Filter::default(),
            deadline: Duration::from_millis(300),
            on_failure,
        };
        // What the old agent recorded: two fail-closed gates of uid 1000.
        book.write_gates(&[
            (sub("tracer", FailurePolicy::Closed), 1000),
            (sub("gone", FailurePolicy::Closed), 1000),
        ]);
        let h = hub(100, 100);
        h.keep_book(book);
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
        };
        assert!(f(&[], &[], &[], &[]).matches(&c));
        assert!(f(&["crun"], &["prod"], &[("app", "web")], &[("trace", "yes")]).matches(&c));
        assert!(!f(&["runc"], &[], &[], &[]).matches(&c));
        assert!(!f(&[], &["kube-system"], &[], &[]).matches(&c));
        assert!(!f(&[], &[], &[("app", "db")], &[]).matches(&c));
        assert!(!f(&[], &[], &[], &[("trace", "no")]).matches(&c));
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
        sys.container.kubernetes = Some({
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
        let gate = |name: &str, on_failure| {
            h.gate(Subscription {
                name: name.into(),
                filter: Filter::default(),
                deadline: Duration::from_millis(100),
                on_failure,
            })
            .expect("gate")
        };
        let mut stalled = gate("stalled", FailurePolicy::Open);
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

        // Fail-closed keeps its promise when overdue: denied, at once.
        let _strict = gate("strict", FailurePolicy::Closed);
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
}
