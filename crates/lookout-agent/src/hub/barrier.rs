//! A container's start held for the gates: [`GateBarrier`] waits for
//! every hold opened for it, decides each by its subscriber's answer or,
//! without one in time, by the subscriber's policy; [`Barriers`] joins it
//! with the agent's other start barriers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use lookout_model::{Container, StartBarrier, StartDecision, StartWait};

use super::gate::{Answer, OpenHold, Subscription, Verdict};
use super::{Hub, lock};

impl Hub {
    /// Starts held for gates now (a stopping agent decides them before it
    /// exits).
    pub(crate) fn starts_waiting(&self) -> u64 {
        self.waiting.load(Ordering::Acquire)
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
            // serves: a stopping agent waits for its successor to serve.
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

/// A start barrier of another part (the hooks) whose denials the hub
/// reports: the container's `removed` event carries the reason, as it does
/// for a gate's.
pub struct DenialsReported<B>(pub B, pub Arc<Hub>);

impl<B: StartBarrier> DenialsReported<B> {
    fn reported(&self, id: &str, wait: StartWait) -> StartWait {
        let (hub, id) = (Arc::clone(&self.1), id.to_owned());
        Box::pin(async move {
            let d = wait.await;
            if let StartDecision::Deny(reason) = &d {
                let mut s = lock(&hub.state);
                if s.live.contains_key(&id) {
                    s.denied.entry(id).or_insert_with(|| reason.clone());
                }
            }
            d
        })
    }
}

impl<B: StartBarrier> StartBarrier for DenialsReported<B> {
    fn wait(&self, id: &str) -> Option<StartWait> {
        self.0.wait(id).map(|w| self.reported(id, w))
    }

    fn wait_until(&self, id: &str, until: Instant) -> Option<StartWait> {
        self.0.wait_until(id, until).map(|w| self.reported(id, w))
    }

    fn started(&self, id: &str) {
        self.0.started(id);
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

    fn started(&self, id: &str) {
        for b in &self.0 {
            b.started(id);
        }
    }
}
