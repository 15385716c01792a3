//! How a runtime exec is answered: allowed or denied, and the wait
//! recorded. The hook's task answers the execs it holds through [`Held`],
//! the answering thread the others through [`allow`]; the metrics only
//! record what was answered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lookout_fanotify::Permission;
use lookout_model::StartDecision;

use crate::stats::{Counters, Slot};

/// Allows `perm`, read at `since`, and records how long the exec waited
/// on us. (Measured before the answer: the write wakes the exec'ing task,
/// which may preempt this thread at once on a small machine, and that time
/// is not the exec's.)
pub(super) fn allow(counters: &Counters, perm: Permission, since: Instant) {
    let waited = since.elapsed();
    if let Err(e) = perm.allow() {
        tracing::warn!(error = %lookout_model::Chain(&e), "answering a permission event");
    }
    counters.answered_after(waited);
}

/// A permission event handed to the hook's task, registered as
/// outstanding until it is answered (or dropped, which allows it).
pub(crate) struct Held {
    perm: Permission,
    _slot: Option<Slot>,
    /// When the event was read, for the answer-latency metric.
    since: Instant,
    counters: Arc<Counters>,
    /// Run once the exec is allowed (watching what it does next), never
    /// when it is denied.
    after_allow: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Held {
    /// `perm`, read at `since`, counted as outstanding until answered.
    pub(super) fn new(perm: Permission, since: Instant, counters: &Arc<Counters>) -> Held {
        Held {
            perm,
            _slot: counters.outstanding.enter(since),
            since,
            counters: Arc::clone(counters),
            after_allow: None,
        }
    }

    /// Runs `then` once the exec is allowed (after the answer, so it costs
    /// the exec nothing), and never if it is denied.
    pub fn after_allow(&mut self, then: impl FnOnce() + Send + Sync + 'static) {
        self.after_allow = Some(Box::new(then));
    }

    /// Allows the exec and records how long it waited.
    pub fn allow(self) {
        allow(&self.counters, self.perm, self.since);
        if let Some(then) = self.after_allow {
            then();
        }
    }

    /// Denies the exec (the runtime sees `EPERM`) and records how long it
    /// waited.
    pub fn deny(self) {
        let waited = self.since.elapsed();
        if let Err(e) = self.perm.deny() {
            tracing::warn!(error = %lookout_model::Chain(&e), "denying a permission event");
        }
        self.counters.answered_after(waited);
    }

    /// Answers a held `start` of `id` with what its barrier decided
    /// (`None`: it did not decide within `cap`, and the container goes
    /// on). A denied container's init `pid` is killed: it waits in the
    /// runtime's init for a `start` that will not come, and a later
    /// `start` must not run it either. Its exit is then seen like any
    /// other.
    pub fn answer_start(
        self,
        id: &str,
        pid: Option<u32>,
        decided: Option<StartDecision>,
        cap: Duration,
    ) {
        match decided {
            Some(StartDecision::Proceed) => self.allow(),
            Some(StartDecision::Deny(reason)) => {
                self.deny();
                tracing::info!(id, reason, "start denied");
                if let Some(pid) = pid
                    && let Err(e) = crate::pidfd::kill(pid)
                {
                    tracing::warn!(id, pid, error = %e, "could not kill the init of a denied container");
                }
            }
            None => {
                tracing::warn!(
                    id,
                    ?cap,
                    "start did not wait longer for the container's barrier"
                );
                self.allow();
            }
        }
    }
}
