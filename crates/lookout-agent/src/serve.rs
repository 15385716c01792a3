//! `/healthz`, `/readyz` and `/metrics` (Prometheus text format through
//! prometheus-client).

use std::net::SocketAddr;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
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
struct ModeLabels {
    mode: String,
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

    #[test]
    fn health_fails_past_the_bound_only() {
        let b = Duration::from_secs(10);
        let s = Duration::from_secs;
        assert!(verdict(None, None, None, b).is_ok());
        assert!(verdict(Some(s(9)), Some(s(1)), Some(s(10)), b).is_ok());
        let e = verdict(Some(s(11)), None, None, b).expect_err("stuck answer");
        assert!(e.contains("waited"), "{e}");
        let e = verdict(None, Some(s(11)), None, b).expect_err("stuck thread");
        assert!(e.contains("busy"), "{e}");
        let e = verdict(None, None, Some(s(11)), b).expect_err("stuck read");
        assert!(e.contains("read no event"), "{e}");
    }
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
    hub: crate::hub::HubMetrics,
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
    pub fn new() -> Metrics {
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
        Metrics {
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
            hub: crate::hub::HubMetrics::register(r),
            registry,
        }
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

    /// The consumer hub's metrics (watchers, gates).
    pub fn hub(&self) -> crate::hub::HubMetrics {
        self.hub.clone()
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

    fn encode(&self) -> String {
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

/// What the endpoints serve.
pub struct Endpoints {
    pub metrics: Arc<Metrics>,
    /// `None` while starting; then the `/readyz` body.
    pub ready: RwLock<Option<String>>,
    /// The runtime hook's progress, once a hook mode runs, and the longest
    /// an answer may legitimately take (see [`verdict`]).
    pub hook: std::sync::OnceLock<(lookout_runtime_hook::Health, Duration)>,
}

/// Whether the runtime hook makes progress: the oldest permission event
/// handed to its task has waited less than `bound`, the permission thread
/// has not been busy with one batch for that long either, nor left a
/// probe of its reads unread that long (a `read` stuck in the kernel; see
/// [`lookout_runtime_hook::Health::reads_stalled`]).
pub fn verdict(
    oldest_unanswered: Option<Duration>,
    permission_thread_busy: Option<Duration>,
    reads_stalled: Option<Duration>,
    bound: Duration,
) -> Result<(), String> {
    if let Some(age) = oldest_unanswered.filter(|a| *a > bound) {
        return Err(format!(
            "a runtime exec has waited {age:?} for its answer (bound {bound:?})"
        ));
    }
    if let Some(busy) = permission_thread_busy.filter(|b| *b > bound) {
        return Err(format!(
            "the permission thread has been busy for {busy:?} (bound {bound:?})"
        ));
    }
    if let Some(stalled) = reads_stalled.filter(|s| *s > bound) {
        return Err(format!(
            "the permission thread has read no event for {stalled:?}, a probe waiting \
             (bound {bound:?}): its read is stuck in the kernel, likely opening a runtime \
             binary on a stalled file system"
        ));
    }
    Ok(())
}

async fn healthz(State(s): State<Arc<Endpoints>>) -> impl IntoResponse {
    let check = s.hook.get().map_or(Ok(()), |(h, bound)| {
        verdict(
            h.oldest_unanswered(),
            h.permission_thread_busy(),
            h.reads_stalled(),
            *bound,
        )
    });
    match check {
        Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
        Err(why) => {
            tracing::error!("unhealthy: {why}");
            (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"))
        }
    }
}

async fn readyz(State(s): State<Arc<Endpoints>>) -> impl IntoResponse {
    match s.ready.read().ok().and_then(|r| r.clone()) {
        Some(body) => (StatusCode::OK, body),
        None => (StatusCode::SERVICE_UNAVAILABLE, "starting\n".to_owned()),
    }
}

async fn metrics(State(s): State<Arc<Endpoints>>) -> impl IntoResponse {
    if let Some((h, _)) = s.hook.get() {
        s.metrics
            .oldest_unanswered
            .set(h.oldest_unanswered().unwrap_or_default().as_secs_f64());
        s.metrics
            .argv_waiting
            .set(i64::try_from(h.argv_records_waiting()).unwrap_or(i64::MAX));
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

/// At most this many HTTP connections at once; more are closed at accept.
/// Each holds an fd, and fds must never run out: when fanotify cannot
/// install an event's fd, the kernel denies the runtime's exec.
pub const MAX_CONNECTIONS: usize = 64;
/// A client must send a request's headers within this.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection lives longer than this, busy or not.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// Binds `addr` and serves the endpoints on a thread and tokio runtime of
/// their own, so that HTTP clients share nothing that can stall with the
/// runtime hook. A bind failure is logged and the agent carries on without
/// them: a busy port must not make a node agent crash-loop.
///
/// Bounded by design: at most [`MAX_CONNECTIONS`] connections (more are
/// closed at once and counted), 5 s to send a request's headers (8 KiB at
/// most), 60 s per connection.
pub fn spawn(addr: SocketAddr, shared: Arc<Endpoints>) {
    let listener = match std::net::TcpListener::bind(addr).and_then(|l| {
        l.set_nonblocking(true)?;
        Ok(l)
    }) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%addr, %e, "cannot serve /healthz, /readyz and /metrics; going on without them");
            return;
        }
    };
    let local = listener
        .local_addr()
        .map_or_else(|_| addr.to_string(), |a| a.to_string());
    let spawned = on_own_thread("lookout-http", "the endpoints", move || {
        serve(listener, shared)
    });
    match spawned {
        Ok(_) => tracing::info!("serving /healthz, /readyz and /metrics on http://{local}"),
        Err(e) => {
            tracing::error!(%e, "cannot start the HTTP thread; going on without the endpoints")
        }
    }
}

/// Runs the future `make` returns on a thread named `name` with a
/// current-thread runtime of its own, so that whoever it talks to never
/// shares a thread with discovery. `what` names it in the log if the
/// runtime cannot start (it then does not run; discovery goes on).
pub(crate) fn on_own_thread<F>(
    name: &str,
    what: &'static str,
    make: impl FnOnce() -> F + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: std::future::Future<Output = ()>,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(make()),
                Err(e) => {
                    tracing::error!(%e, "cannot start a runtime for {what}; going on without it")
                }
            }
        })
}

/// `count` histogram bucket bounds from `start`, each `factor` times the
/// one before: prometheus-client's `exponential_buckets`, by
/// multiplication. Its `powf` was, with tokio's multi-thread scheduler, all
/// the agent took from libm, and loading libm costs about 0.45 MiB of
/// resident pages (its IFUNC resolvers, run at load, are spread over its
/// text). For a factor that is a power of two the bounds are the same.
pub(crate) fn exponential_buckets(
    start: f64,
    factor: f64,
    count: u16,
) -> impl Iterator<Item = f64> {
    std::iter::successors(Some(start), move |b| Some(b * factor)).take(usize::from(count))
}

async fn serve(listener: std::net::TcpListener, shared: Arc<Endpoints>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%e, "cannot serve the endpoints");
            return;
        }
    };
    let metrics = Arc::clone(&shared.metrics);
    let app = Router::new()
        .route("/healthz", get(self::healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(self::metrics))
        .with_state(shared);
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut incoming = std::pin::pin!(crate::accept::accepted(listener, "HTTP endpoint"));
    while let Some(stream) = tokio_stream::StreamExt::next(&mut incoming).await {
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            metrics.http_refused.inc();
            drop(stream);
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(8192)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
            drop(permit);
        });
    }
}
