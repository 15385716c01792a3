//! Gates: consumers that hold a created container's `start` until they
//! decide. A hold opens when the container is reported; the runtime's
//! `start` waits on [`GateBarrier`] for every open hold, each bounded by
//! its subscriber's deadline and settled by its failure policy when no
//! answer comes. Subscriptions outlive an agent: they are written to the
//! handover book and parked for their subscribers at a takeover.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lookout_model::{Container, StartBarrier, StartDecision, StartWait};
use tokio::sync::{mpsc, oneshot};

use super::{Filter, Hub, Live, Refused, lock};
use crate::handover::Book;

impl Hub {
    /// Whether the discovery mode holds starts (see [`HubConfig::can_hold`](super::HubConfig::can_hold)).
    pub fn set_can_hold(&self, yes: bool) {
        self.can_hold.store(yes, Ordering::Relaxed);
    }

    /// Registers a gate subscriber. Its deadline is bounded by
    /// [`HubConfig::max_deadline`](super::HubConfig::max_deadline).
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
    pub(super) fn register(
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
    pub(super) fn park(self: &Arc<Self>, subs: Vec<(Subscription, u32)>) {
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

    /// Ends every gate subscriber's stream (after its last hold): a
    /// stopping agent that decided the starts it held lets its subscribers
    /// go to its successor.
    pub(crate) fn end_gates(&self) {
        let mut g = lock(&self.gates);
        g.clear();
        self.metrics.subscribers.set(0);
    }

    /// Starts held for gates now (a stopping agent decides them before it
    /// exits).
    pub(crate) fn starts_waiting(&self) -> u64 {
        self.waiting.load(Ordering::Acquire)
    }

    /// Hands `live` to every matching gate subscriber that is not in
    /// `asked`, adding the holds to `out`. Never waits: a full queue
    /// makes a hold its subscriber's policy decides.
    pub(super) fn open_holds(&self, live: &Live, asked: &[u64], out: &mut Vec<OpenHold>) {
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

pub(super) struct Subscriber {
    id: u64,
    pub(super) sub: Subscription,
    /// Its peer's uid (`SO_PEERCRED`; 0 when embedded): after a rollout
    /// only this uid, or root, takes the subscription back.
    pub(super) uid: u32,
    pub(super) tx: mpsc::Sender<HoldRequest>,
    /// It let a hold reach its deadline and has not answered one since.
    pub(super) overdue: Arc<AtomicBool>,
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
pub(super) struct Parked {
    id: u64,
    holds: mpsc::Receiver<HoldRequest>,
    pub(super) uid: u32,
}

/// One subscriber's hold on a created container, opened before the
/// runtime's `start` asks for it.
pub(super) struct OpenHold {
    pub(super) subscriber: u64,
    pub(super) sub: Subscription,
    /// `None`: the subscriber's queue was full; its policy decides.
    answer: Option<oneshot::Receiver<Answer>>,
    pub(super) issued: Instant,
    /// The subscriber's overdue mark (set when this hold times out).
    pub(super) overdue: Arc<AtomicBool>,
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
                        let d = hub.decide(h, cap, &c).await;
                        hub.metrics.decided(&d.subscriber, d.outcome);
                        (d.subscriber, d.verdict)
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
    async fn decide(&self, h: OpenHold, cap: Option<Instant>, c: &Container) -> Decided {
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
        Decided {
            subscriber: sub.name,
            verdict,
            outcome,
        }
    }
}

/// How one hold ended.
struct Decided {
    /// The subscriber's name.
    subscriber: String,
    verdict: Verdict,
    /// The label of `lookout_gate_decisions_total`: `allow`, `deny`,
    /// `timeout`, `overdue`, `disconnected` or `queue-full`.
    outcome: &'static str,
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
