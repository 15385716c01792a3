//! The hub's Prometheus metrics: gate subscribers, holds, decisions and
//! how long starts waited.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

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
    pub(super) watchers: Gauge,
    pub(super) watchers_dropped: Counter,
    pub(super) subscribers: Gauge,
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
