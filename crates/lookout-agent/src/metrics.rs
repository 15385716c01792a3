//! The agent's Prometheus metrics (through prometheus-client), and the
//! helpers every metric of the agent is made with: [`register`] and
//! [`exponential_buckets`]. A leaf: the hub's metrics, the endpoints that
//! serve them and every module that counts import it, never the reverse.

use std::sync::atomic::AtomicI64;
use std::time::Duration;

use lookout_model::{ContainerEvent, EventKind};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: String,
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HookLabels {
    stage: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MissedLabels {
    runtime: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: String,
}

/// The agent's metrics.
pub struct Metrics {
    duplicates: Counter,
    registry: Registry,
    events: Family<EventLabels, Counter>,
    mode: Family<ModeLabels, Gauge>,
    answered: Counter,
    answer_seconds: Histogram,
    errors: Family<ErrorLabels, Counter>,
    tracked: Gauge<i64, AtomicI64>,
    stdout_late: Counter,
    stdout_dropped: Counter,
    log_dropped: Counter,
    /// The log writer's drop count as `log_dropped` has it.
    log_dropped_seen: std::sync::atomic::AtomicU64,
    nri_late: Counter,
    nri_disconnects: Counter,
    nri_dropped: Counter,
    recovered: Counter,
    without_argv: Counter,
    argv_waits: Counter,
    missed: Family<MissedLabels, Counter>,
    ignored: Family<ReasonLabels, Counter>,
    http_refused: Counter,
    oldest_unanswered: Gauge<f64, std::sync::atomic::AtomicU64>,
    argv_waiting: Gauge,
    k8s_events_dropped: Counter,
    docker_lookups: Family<OutcomeLabels, Counter>,
    hooks: Family<HookLabels, Counter>,
}

/// Registers `metric` in `registry` as `name`, described by `help`, and
/// returns it: the returned handle and the registered one share their
/// value. Every metric of the agent is made this way, named once.
pub(crate) fn register<M: Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Metrics {
    /// The agent's metrics, in a registry of their own.
    #[cfg(test)]
    pub fn new() -> Metrics {
        Metrics::with(|_| ()).0
    }

    /// The agent's metrics, and those `more` registers after them in the
    /// same registry (`lookout run` registers the hub's there).
    pub fn with<T>(more: impl FnOnce(&mut Registry) -> T) -> (Metrics, T) {
        let mut registry = Registry::with_prefix("lookout");
        registry.register(
            "build",
            "The agent's build (1, labelled by version)",
            prometheus_client::metrics::info::Info::new(vec![(
                "version".to_owned(),
                env!("CARGO_PKG_VERSION").to_owned(),
            )]),
        );
        let r = &mut registry;
        let mut metrics = Metrics {
            events: register(
                r,
                "events",
                "Container events emitted, by event and source",
                Family::<EventLabels, Counter>::default(),
            ),
            mode: register(
                r,
                "mode_info",
                "The discovery mode in use (1, labelled by mode)",
                Family::<ModeLabels, Gauge>::default(),
            ),
            answered: register(
                r,
                "permission_events_answered",
                "fanotify permission events answered",
                Counter::default(),
            ),
            // 1 us .. ~16 s
            answer_seconds: register(
                r,
                "permission_answer_seconds",
                "Time from reading a permission event to answering it",
                Histogram::new(exponential_buckets(1e-6, 4.0, 13)),
            ),
            errors: register(
                r,
                "errors",
                "Errors logged and skipped, by kind",
                Family::<ErrorLabels, Counter>::default(),
            ),
            tracked: register(
                r,
                "containers_tracked",
                "Containers added and not yet removed",
                Gauge::<i64, AtomicI64>::default(),
            ),
            hooks: register(
                r,
                "hooks",
                "OCI hooks run, by stage (prestart, createRuntime, createContainer, \
             startContainer, poststart, poststop) and outcome (ok, failed, timed_out, not_run)",
                Family::<HookLabels, Counter>::default(),
            ),
            nri_late: register(
                r,
                "nri_late_starts",
                "NRI: container starts that went on before their barrier (prestart hooks, gates) \
             decided, at the plugin's deadline under the runtime's request timeout",
                Counter::default(),
            ),
            nri_disconnects: register(
                r,
                "nri_disconnects",
                "NRI: connections to the runtime that ended (each is followed by a reconnect and a \
             resynchronization)",
                Counter::default(),
            ),
            nri_dropped: register(
                r,
                "nri_events_dropped",
                "NRI: events that found the agent's queue full; each ended the connection, and the \
             Synchronize after the reconnect reported what they carried",
                Counter::default(),
            ),
            stdout_late: register(
                r,
                "stdout_late_events",
                "Starts that went on before their added line was on stdout (--event-deadline ran out, or stdout was stuck)",
                Counter::default(),
            ),
            stdout_dropped: register(
                r,
                "stdout_dropped_events",
                "Events dropped because the stdout queue was full",
                Counter::default(),
            ),
            log_dropped: register(
                r,
                "log_lines_dropped",
                "Log lines dropped because stderr was not taking them (4096 were waiting)",
                Counter::default(),
            ),
            log_dropped_seen: std::sync::atomic::AtomicU64::new(0),
            duplicates: register(
                r,
                "duplicate_events_suppressed",
                "Events for a container another source already reported (hook and informer), not printed",
                Counter::default(),
            ),
            missed: register(
                r,
                "missed_containers",
                "Containers a runtime made that lookout could not report, by runtime and reason \
             (unreadable-state, state-timeout, not-a-container-process); each is also a warning \
             in the log",
                Family::<MissedLabels, Counter>::default(),
            ),
            without_argv: register(
                r,
                "runtime_execs_without_argv",
                "Runtime execs that came without a BPF argv record and were followed through /proc \
             (every one in fanotify mode; with BPF, a runtime re-exec not recognised or a caller \
             other than host root)",
                Counter::default(),
            ),
            argv_waits: register(
                r,
                "argv_record_waits",
                "runtime execs by host root whose BPF argv record was not committed yet: the \
             permission thread looked again for up to 2 ms (other callers are never waited for)",
                Counter::default(),
            ),
            recovered: register(
                r,
                "containers_recovered",
                "Containers found only by reconciling the state directories after runtime execs \
             whose argv could not be read (fanotify mode without BPF); reported late",
                Counter::default(),
            ),
            ignored: register(
                r,
                "runtime_execs_ignored",
                "Runtime execs allowed at once and not followed, by reason (non-root: the caller is \
             not host root and cannot make a rootful container; pid-namespace: root in a pid \
             namespace other than the node's, such as a container's)",
                Family::<ReasonLabels, Counter>::default(),
            ),
            http_refused: register(
                r,
                "http_connections_refused",
                "HTTP connections closed at accept because MAX_CONNECTIONS (64) were open",
                Counter::default(),
            ),
            oldest_unanswered: register(
                r,
                "permission_oldest_unanswered_seconds",
                "Age of the oldest runtime exec (create, run, start) waiting for lookout's answer, \
             0 when none waits; a start held for prestart hooks counts",
                Gauge::<f64, std::sync::atomic::AtomicU64>::default(),
            ),
            argv_waiting: register(
                r,
                "argv_records_waiting",
                "BPF argv records waiting for their exec's permission event (a few normally; \
             hundreds that stay: execs of a watched name that never reach a marked binary)",
                Gauge::default(),
            ),
            k8s_events_dropped: register(
                r,
                "k8s_events_dropped",
                "Kubernetes Events dropped over --k8s-events-burst/--k8s-events-per-minute",
                Counter::default(),
            ),
            docker_lookups: register(
                r,
                "docker_lookups",
                "Docker containers looked up in dockerd, by outcome: found, unknown (not dockerd's), \
             unavailable (dockerd stopped, hung or skipped while it is), error (a bad answer), \
             dropped (the lookup queue was full)",
                Family::<OutcomeLabels, Counter>::default(),
            ),
            registry,
        };
        let more = more(&mut metrics.registry);
        (metrics, more)
    }

    pub fn set_mode(&self, mode: &str) {
        self.mode
            .get_or_create(&ModeLabels {
                mode: mode.to_owned(),
            })
            .set(1);
    }

    pub fn event(&self, e: &ContainerEvent) {
        let event = match e.event {
            EventKind::Added => {
                self.tracked.inc();
                "added"
            }
            EventKind::Removed => {
                self.tracked.dec();
                "removed"
            }
            EventKind::Updated => "updated",
        };
        self.events
            .get_or_create(&EventLabels {
                event: event.to_owned(),
                source: e.source.to_string(),
            })
            .inc();
    }

    pub fn duplicate(&self) {
        self.duplicates.inc();
    }

    pub fn stdout_late(&self) {
        self.stdout_late.inc();
    }

    /// One hook of `stage` ran with `outcome` (`ok`, `failed`,
    /// `timed_out`, `not_run`).
    pub fn hook_ran(&self, stage: &str, outcome: &str) {
        self.hooks
            .get_or_create(&HookLabels {
                stage: stage.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    pub fn nri_late(&self) {
        self.nri_late.inc();
    }

    pub fn nri_disconnect(&self) {
        self.nri_disconnects.inc();
    }

    /// `n` more NRI events dropped (a full queue).
    pub fn nri_dropped(&self, n: u64) {
        if n > 0 {
            self.nri_dropped.inc_by(n);
        }
    }

    pub fn stdout_dropped(&self) {
        self.stdout_dropped.inc();
    }

    /// The counter of Kubernetes Events dropped by the rate limit.
    /// Counts one Docker lookup's outcome.
    pub fn docker_lookup(&self, outcome: &str) {
        self.docker_lookups
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    pub fn k8s_events_dropped(&self) -> Counter {
        self.k8s_events_dropped.clone()
    }

    /// An HTTP connection was closed at accept (too many were open).
    pub(crate) fn http_refused(&self) {
        self.http_refused.inc();
    }

    /// The runtime hook's gauges, as its health reads now: the oldest
    /// runtime exec waiting for its answer, and the BPF argv records
    /// waiting for their exec.
    pub(crate) fn hook_progress(&self, oldest_unanswered: Duration, argv_records_waiting: u64) {
        self.oldest_unanswered.set(oldest_unanswered.as_secs_f64());
        self.argv_waiting
            .set(i64::try_from(argv_records_waiting).unwrap_or(i64::MAX));
    }

    /// The Prometheus text of every metric in the registry.
    pub(crate) fn encode(&self) -> String {
        // The log writer counts its own drops; the counter catches up here.
        // (fetch_max: two scrapes at once add each drop once.)
        let dropped = crate::log_lines_dropped();
        let seen = self
            .log_dropped_seen
            .fetch_max(dropped, std::sync::atomic::Ordering::AcqRel);
        if dropped > seen {
            self.log_dropped.inc_by(dropped - seen);
        }
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(%e, "encoding metrics");
        }
        out
    }
}

impl lookout_runtime_hook::Observer for Metrics {
    fn answered(&self, elapsed: Duration) {
        self.answered.inc();
        self.answer_seconds.observe(elapsed.as_secs_f64());
    }

    fn error(&self, kind: &'static str) {
        self.errors
            .get_or_create(&ErrorLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    fn recovered(&self) {
        self.recovered.inc();
    }

    fn without_argv(&self) {
        self.without_argv.inc();
    }

    fn argv_wait(&self) {
        self.argv_waits.inc();
    }

    fn missed(&self, runtime: &str, reason: &'static str) {
        self.missed
            .get_or_create(&MissedLabels {
                runtime: runtime.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    fn ignored(&self, reason: &'static str) {
        self.ignored
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }
}

/// `count` histogram bucket bounds from `start`, each `factor` times the
/// one before: prometheus-client's `exponential_buckets`, by
/// multiplication. Its `powf` would be, with tokio's multi-thread
/// scheduler (which the agent does not use), all the agent takes from
/// libm, and loading libm costs about 0.45 MiB of resident pages (its
/// IFUNC resolvers, run at load, are spread over its text). For a factor
/// that is a power of two the bounds are the same.
pub(crate) fn exponential_buckets(
    start: f64,
    factor: f64,
    count: u16,
) -> impl Iterator<Item = f64> {
    std::iter::successors(Some(start), move |b| Some(b * factor)).take(usize::from(count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_prometheus_clients() {
        for (start, count) in [(1e-6, 13), (1e-5, 11), (1e-4, 10)] {
            let ours: Vec<f64> = exponential_buckets(start, 4.0, count).collect();
            let theirs: Vec<f64> =
                prometheus_client::metrics::histogram::exponential_buckets(start, 4.0, count)
                    .collect();
            assert_eq!(ours, theirs, "start {start}");
        }
    }
}
