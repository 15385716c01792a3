//! A hub that stands by while another agent serves the consumer socket
//! (the old agent of a surge rollout), and takes over from it.
//!
//! Standing by, the hub keeps its own agent's reports aside and follows
//! the serving agent's changes, with their revisions, as they are fed to
//! it ([`Hub::mirror_snapshot`], [`Hub::mirror_change`]). At the takeover
//! ([`Hub::take_over`]) revisions go on from the predecessor's last one,
//! the predecessor's gate subscriptions are parked for their subscribers,
//! and what only this agent saw follows as changes of its own.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lookout_model::{ContainerEvent, EventKind, Source};

use super::{Change, Hub, Live, lock};

/// A standby hub's own reports, for [`Hub::take_over`].
#[derive(Default)]
pub(super) struct Standby {
    /// Containers reported and not removed since, by id.
    pub(super) added: HashMap<String, ContainerEvent>,
    /// Containers reported removed, by id.
    pub(super) removed: HashMap<String, ContainerEvent>,
    /// A snapshot of the serving agent arrived: revisions are its.
    mirrored: bool,
    /// Containers the serving agent reported removed meanwhile.
    mirror_removed: HashSet<String>,
}

/// Containers remembered as reported gone by the serving agent while
/// standing by (a bound against a long standby on a busy node).
const MAX_REMEMBERED_GONE: usize = 65536;

/// How long after a takeover this agent's own late reports of containers
/// its predecessor reported gone are dropped.
pub(super) const GONE_BEFORE_FOR: Duration = Duration::from_secs(30);

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

impl Hub {
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
        s.log_bytes = 0;
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
        if let Some(store) = self.store.get() {
            self.park(store.load());
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
        self.save_subscriptions();
        TakeOver {
            mirrored,
            added: n_added,
            removed: n_removed,
            next,
        }
    }
}
