//! Watch: a consumer's view of the table, a snapshot and then every change
//! after it, through a bounded queue. A watcher that falls behind is
//! dropped (it resumes from its revision), never waited for.
//!
//! A watcher's queue holds its changes weakly ([`Weak`]), and its snapshot
//! its containers: only the resume window (and the table, for containers
//! that run) keeps a record alive. A consumer that stops reading
//! therefore costs a few words per queued change, not the records: without
//! that, a stalled watcher kept up to `watch_buffer` records (1024
//! containers with 256 KiB of annotations: a quarter of a GiB) after the
//! window's byte bound had let them go. A change that left the window
//! before its watcher read it ends the watch as lagged, as a full queue
//! does: the watcher resumes from its last revision (a snapshot).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use tokio::sync::mpsc;

use lookout_model::{Container, Source};

use super::{Change, Filter, Hub, HubMetrics, Live, Refused, State, lock};

impl Hub {
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
            backlog.push_back(Pending::Snapshot {
                revision: s.revision,
                containers: containers.iter().map(WeakLive::new).collect(),
            });
        } else {
            backlog.extend(
                s.log
                    .iter()
                    .filter(|c| c.revision > since && filter.matches(&c.live.container))
                    .map(|c| Pending::Change(Arc::downgrade(c))),
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
            ended: None,
            metrics: self.metrics.clone(),
            open: Arc::clone(&self.open_watches),
        })
    }

    /// Appends `change` to the log and hands it to every matching watcher
    /// (without waiting: a full watcher is dropped).
    pub(super) fn fan_out(&self, s: &mut State, change: &Arc<Change>) {
        // Closed: no watcher is left to hand it to, and none may come. The
        // log stays as it was for the watchers still reading what they were
        // handed before (trimming it would end them as lagged, not closed).
        if s.closed {
            return;
        }
        s.log_bytes += super::change_bytes(change);
        s.log.push_back(Arc::clone(change));
        // The newest change always stays: a watcher at the revision before
        // it resumes without a snapshot.
        while s.log.len() > self.config.window
            || (s.log_bytes > self.config.window_bytes && s.log.len() > 1)
        {
            if let Some(old) = s.log.pop_front() {
                s.log_bytes -= super::change_bytes(&old);
            }
        }
        self.metrics.window_changes.set(s.log.len() as i64);
        self.metrics.window_bytes.set(s.log_bytes as i64);
        let metrics = &self.metrics;
        s.watchers.retain(|w| {
            if !w.filter.matches(&change.live.container) {
                return !w.tx.is_closed();
            }
            match w.tx.try_send(Arc::downgrade(change)) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Closed(_)) => false,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    // Counted once: it may still find, reading its queue,
                    // that the window moved past it (`Watch::fell_behind`).
                    if !w.lagged.swap(true, Ordering::AcqRel) {
                        metrics.watchers_dropped.inc();
                        tracing::warn!(
                            buffer = self.config.watch_buffer,
                            "a watcher did not keep up; disconnected"
                        );
                    }
                    false
                }
            }
        });
    }
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
    /// The watcher did not keep up: its buffer of this many changes
    /// filled, or a change it had not read yet left the resume window.
    /// Watch again from the last revision seen.
    #[error(
        "the watcher did not keep up (its buffer of {0} changes filled, or the agent's resume window moved past what it had not read); watch again from the last revision seen"
    )]
    Lagged(usize),
    /// The agent is shutting down.
    #[error("the agent is shutting down")]
    Closed,
}

/// What a watch has yet to hand out: changes and snapshots are held
/// weakly (see the module docs).
enum Pending {
    Snapshot {
        revision: u64,
        containers: Vec<WeakLive>,
    },
    Change(Weak<Change>),
}

/// A snapshot's container, held weakly until it is sent: while it runs
/// it is the table's (or the window's) record; after it is removed and
/// the window let its changes go, a consumer that stopped reading in the
/// middle of a snapshot keeps none of it alive (see the module docs).
pub(crate) struct WeakLive {
    container: Weak<Container>,
    source: Source,
    added_monotonic_ns: u64,
    added_unix_ms: i64,
}

impl WeakLive {
    /// `live`, held weakly.
    pub(crate) fn new(live: &Live) -> WeakLive {
        WeakLive {
            container: Arc::downgrade(&live.container),
            source: live.source,
            added_monotonic_ns: live.added_monotonic_ns,
            added_unix_ms: live.added_unix_ms,
        }
    }

    /// The container, unless nothing else holds its record any more: the
    /// watcher fell behind the window.
    pub(crate) fn upgrade(&self) -> Option<Live> {
        Some(Live {
            container: self.container.upgrade()?,
            source: self.source,
            added_monotonic_ns: self.added_monotonic_ns,
            added_unix_ms: self.added_unix_ms,
        })
    }
}

/// A watch: a backlog (snapshot or retained changes), then live changes.
pub struct Watch {
    backlog: VecDeque<Pending>,
    rx: mpsc::Receiver<Weak<Change>>,
    lagged: Arc<AtomicBool>,
    buffer: usize,
    /// How it ended, once it did: every later call says the same.
    ended: Option<WatchEnd>,
    metrics: HubMetrics,
    /// [`Hub::watches_open`].
    open: Arc<AtomicU64>,
}

impl Watch {
    /// The next item; `Err` when the watch ended.
    pub async fn next(&mut self) -> Result<WatchItem, WatchEnd> {
        if let Some(end) = self.ended {
            return Err(end);
        }
        let change = match self.backlog.pop_front() {
            Some(Pending::Snapshot {
                revision,
                containers,
            }) => {
                return match containers.iter().map(WeakLive::upgrade).collect() {
                    Some(containers) => Ok(WatchItem::Snapshot {
                        revision,
                        containers,
                    }),
                    None => Err(self.fell_behind()),
                };
            }
            Some(Pending::Change(c)) => c,
            None => match self.rx.recv().await {
                Some(c) => c,
                None => {
                    let end = if self.lagged.load(Ordering::Acquire) {
                        WatchEnd::Lagged(self.buffer)
                    } else {
                        WatchEnd::Closed
                    };
                    self.ended = Some(end);
                    return Err(end);
                }
            },
        };
        match change.upgrade() {
            Some(c) => Ok(WatchItem::Change(c)),
            None => Err(self.fell_behind()),
        }
    }

    /// The window let go of what this watcher had yet to read (a change,
    /// or a container of its snapshot, [`WeakLive`]): it is no longer here
    /// to give it. Ends the watch; says how.
    pub(crate) fn fell_behind(&mut self) -> WatchEnd {
        // Counted once: the hub may have dropped it for a full queue.
        if !self.lagged.swap(true, Ordering::AcqRel) {
            self.metrics.watchers_dropped.inc();
            tracing::warn!(
                "a watcher fell behind the resume window (the changes it had not read are gone); disconnected"
            );
        }
        let end = WatchEnd::Lagged(self.buffer);
        self.ended = Some(end);
        self.backlog.clear();
        // The hub stops queueing for it, and what it queued goes.
        self.rx.close();
        while self.rx.try_recv().is_ok() {}
        end
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.metrics.watchers.dec();
        self.open.fetch_sub(1, Ordering::Release);
    }
}

pub(super) struct Watcher {
    pub(super) filter: Filter,
    pub(super) tx: mpsc::Sender<Weak<Change>>,
    pub(super) lagged: Arc<AtomicBool>,
}
