//! Gates: consumers that hold a created container's `start` until they
//! decide. A hold opens when the container is reported; the runtime's
//! `start` waits for every open hold (the hub's start barrier), each
//! bounded by its subscriber's deadline and settled by its failure policy
//! when no answer comes. Subscriptions outlive an agent:
//! they are saved in a [`SubscriptionStore`] and parked for their
//! subscribers at a takeover.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lookout_model::Container;
use tokio::sync::{mpsc, oneshot};

use super::{Filter, Hub, Live, Refused, lock};

/// Where a hub keeps its gate subscriptions for the hub that takes over
/// from it (the next agent's, in a rollout): the serving hub saves those
/// in force whenever they change, and the one that takes over loads them
/// and parks them until their subscribers come back ([`Hub::take_over`]).
pub(crate) trait SubscriptionStore: Send + Sync + 'static {
    /// Saves the subscriptions in force, each with its subscriber's uid.
    fn save(&self, subs: &[(Subscription, u32)]);
    /// The subscriptions the serving hub saved last (none when it saved
    /// none, or they cannot be read).
    fn load(&self) -> Vec<(Subscription, u32)>;
}

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
            self.save_subscriptions();
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
        self.save_subscriptions();
        Ok(GateSubscriber {
            holds: rx,
            deadline,
            _registration: Registration {
                hub: Arc::clone(self),
                id,
            },
        })
    }

    /// Saves the gate subscriptions in `store` for a successor, and loads
    /// a predecessor's from it at the takeover. Set before
    /// [`Hub::stand_by`] or serving; nothing is saved until
    /// [`Hub::save_subscriptions`].
    pub(crate) fn keep_subscriptions(&self, store: impl SubscriptionStore) {
        let _ = self.store.set(Box::new(store));
    }

    /// Saves the gate subscriptions in force (the latest list wins when
    /// two registrations race); nothing while standing by (the store is
    /// the serving hub's) or once closed (the successor's now).
    pub(crate) fn save_subscriptions(&self) {
        let Some(store) = self.store.get() else {
            return;
        };
        {
            let s = lock(&self.state);
            if s.standby.is_some() || s.closed {
                return;
            }
        }
        let (generation, subs) = {
            let g = lock(&self.gates);
            let generation = self.store_generation.fetch_add(1, Ordering::AcqRel) + 1;
            (
                generation,
                g.iter().map(|s| (s.sub.clone(), s.uid)).collect::<Vec<_>>(),
            )
        };
        let mut saved = lock(&self.store_saved);
        if generation > *saved {
            store.save(&subs);
            *saved = generation;
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
                hub.save_subscriptions();
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

    /// What an unanswered hold becomes (`what` happened to the gate).
    pub(super) fn failure(&self, sub: &Subscription, c: &Container, what: &str) -> Verdict {
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

/// A subscriber's verdict, and when it came.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) verdict: Verdict,
    pub(super) at: Instant,
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
        self.hub.save_subscriptions();
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
    pub(super) answer: Option<oneshot::Receiver<Answer>>,
    pub(super) issued: Instant,
    /// The subscriber's overdue mark (set when this hold times out).
    pub(super) overdue: Arc<AtomicBool>,
}
