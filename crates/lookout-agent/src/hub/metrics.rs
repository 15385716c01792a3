//! The hub's Prometheus metrics: gate subscribers, holds, decisions and
//! how long starts waited.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::metrics::{exponential_buckets, register};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GateLabels {
    subscriber: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubscriberLabels {
    subscriber: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    reason: &'static str,
}

/// The hub's metrics.
#[derive(Clone)]
pub struct HubMetrics {
    pub(super) watchers: Gauge,
    pub(super) watchers_dropped: Counter,
    pub(super) subscribers: Gauge,
    pub(super) window_changes: Gauge,
    pub(super) window_bytes: Gauge,
    holds: Family<GateLabels, Counter>,
    decisions: Family<GateLabels, Counter>,
    hold_seconds: Family<SubscriberLabels, Histogram>,
    start_wait_seconds: Histogram,
    /// Consumer API connections open (counted by the API's connection
    /// limit).
    pub(crate) api_connections: Gauge,
    api_refused: Family<RefusedLabels, Counter>,
}

impl HubMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(registry: &mut Registry) -> HubMetrics {
        let r = registry;
        HubMetrics {
            watchers: register(
                r,
                "watchers",
                "Consumers watching changes",
                Gauge::default(),
            ),
            watchers_dropped: register(
                r,
                "watchers_dropped",
                "Watchers disconnected because they did not keep up",
                Counter::default(),
            ),
            subscribers: register(
                r,
                "gate_subscribers",
                "Gate subscribers connected",
                Gauge::default(),
            ),
            window_changes: register(
                r,
                "watch_window_changes",
                "Changes kept for watchers that resume from a revision",
                Gauge::default(),
            ),
            window_bytes: register(
                r,
                "watch_window_bytes",
                "Estimated bytes of the containers of the changes kept for resuming watchers",
                Gauge::default(),
            ),
            holds: register(
                r,
                "gate_holds",
                "Containers handed to gate subscribers, by outcome: held, not-held, queue-full",
                Family::default(),
            ),
            decisions: register(
                r,
                "gate_decisions",
                "Holds resolved, by outcome: allow, deny, timeout, overdue, disconnected, queue-full",
                Family::default(),
            ),
            hold_seconds: register(
                r,
                "gate_hold_seconds",
                "Time from a hold's issue (at the container's create) to its subscriber's answer",
                Family::new_with_constructor(|| {
                    // 100 us .. ~26 s
                    Histogram::new(exponential_buckets(1e-4, 4.0, 10))
                }),
            ),
            start_wait_seconds: register(
                r,
                "gate_start_wait_seconds",
                "Time a runtime start waited for the gates' answers still missing when it came",
                // 10 us .. ~10 s
                Histogram::new(exponential_buckets(1e-5, 4.0, 11)),
            ),
            api_connections: register(
                r,
                "api_connections",
                "Connections to the consumer API open, root's included",
                Gauge::default(),
            ),
            api_refused: register(
                r,
                "api_connections_refused",
                "Consumer API connections closed as they were accepted, by reason: per-uid (the peer's uid held --api-max-connections-per-uid), total (peers other than root held --api-max-connections), register (the runtime could not take the socket)",
                Family::default(),
            ),
        }
    }

    /// A consumer API connection was closed at accept, for `reason`.
    pub(crate) fn api_refused(&self, reason: &'static str) {
        self.api_refused
            .get_or_create(&RefusedLabels { reason })
            .inc();
    }

    pub(super) fn hold(&self, subscriber: &str, outcome: &str) {
        self.holds
            .get_or_create(&GateLabels {
                subscriber: subscriber.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    pub(super) fn decided(&self, subscriber: &str, outcome: &str) {
        self.decisions
            .get_or_create(&GateLabels {
                subscriber: subscriber.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    pub(super) fn answered(&self, subscriber: &str, took: Duration) {
        self.hold_seconds
            .get_or_create(&SubscriberLabels {
                subscriber: subscriber.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    pub(super) fn start_waited(&self, waited: Duration) {
        self.start_wait_seconds.observe(waited.as_secs_f64());
    }
}
