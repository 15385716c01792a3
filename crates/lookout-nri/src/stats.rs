//! Counters of one plugin, shared with whoever wants to export them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// The plugin's counters ([`Plugin::stats`](crate::Plugin::stats)). All are
/// totals since the plugin was built.
#[derive(Debug, Default)]
pub struct Stats {
    pub(crate) registrations: AtomicU64,
    pub(crate) disconnects: AtomicU64,
    pub(crate) held: AtomicU64,
    pub(crate) late: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) held_nanos: AtomicU64,
    pub(crate) held_max_nanos: AtomicU64,
}

impl Stats {
    /// Successful registrations (1 + reconnects).
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Relaxed)
    }

    /// Connections that ended after a successful registration.
    pub fn disconnects(&self) -> u64 {
        self.disconnects.load(Relaxed)
    }

    /// CreateContainer and StartContainer requests answered.
    pub fn held(&self) -> u64 {
        self.held.load(Relaxed)
    }

    /// Of those, answered at the deadline because the consumer had not
    /// released the [`Ack`](crate::Ack) (fail open).
    pub fn late(&self) -> u64 {
        self.late.load(Relaxed)
    }

    /// Events dropped because the consumer's queue was full (the request
    /// was answered at once).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }

    /// Total time from the arrival of a CreateContainer/StartContainer
    /// request to its answer, over [`held`](Self::held) requests.
    pub fn held_time(&self) -> Duration {
        Duration::from_nanos(self.held_nanos.load(Relaxed))
    }

    /// The longest time from such a request's arrival to its answer.
    pub fn held_max(&self) -> Duration {
        Duration::from_nanos(self.held_max_nanos.load(Relaxed))
    }

    pub(crate) fn record_held(&self, took: Duration, late: bool) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.held.fetch_add(1, Relaxed);
        self.held_nanos.fetch_add(nanos, Relaxed);
        self.held_max_nanos.fetch_max(nanos, Relaxed);
        if late {
            self.late.fetch_add(1, Relaxed);
        }
    }
}
