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
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: String,
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: String,
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
    recovered: Counter,
    ignored: Family<ReasonLabels, Counter>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("lookout");
        let events = Family::<EventLabels, Counter>::default();
        registry.register(
            "events",
            "Container events emitted, by event and source",
            events.clone(),
        );
        let mode = Family::<ModeLabels, Gauge>::default();
        registry.register("mode", "The discovery mode in use (1)", mode.clone());
        let answered = Counter::default();
        registry.register(
            "permission_events_answered",
            "fanotify permission events answered",
            answered.clone(),
        );
        // 1 us .. ~16 s
        let answer_seconds = Histogram::new(exponential_buckets(1e-6, 4.0, 13));
        registry.register(
            "permission_answer_seconds",
            "Time from reading a permission event to answering it",
            answer_seconds.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "errors",
            "Errors logged and skipped, by kind",
            errors.clone(),
        );
        let tracked = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "containers_tracked",
            "Containers added and not yet removed",
            tracked.clone(),
        );
        let stdout_late = Counter::default();
        registry.register(
            "stdout_late_events",
            "Events not written to stdout within --event-deadline",
            stdout_late.clone(),
        );
        let stdout_dropped = Counter::default();
        registry.register(
            "stdout_dropped_events",
            "Events dropped because the stdout queue was full",
            stdout_dropped.clone(),
        );
        let duplicates = Counter::default();
        registry.register(
            "duplicate_events_suppressed",
            "Events for a container another source already reported (hook and informer), not printed",
            duplicates.clone(),
        );
        let recovered = Counter::default();
        registry.register(
            "containers_recovered",
            "Containers found only by reconciling the state directories after runtime execs \
             whose argv could not be read (fanotify mode without BPF); reported late",
            recovered.clone(),
        );
        let ignored = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "runtime_execs_ignored",
            "Runtime execs allowed at once and not followed, by reason (non-root: the caller is \
             not host root and cannot make a rootful container; no-record: no BPF argv record, \
             which only root's execs get)",
            ignored.clone(),
        );
        Metrics {
            ignored,
            recovered,
            duplicates,
            registry,
            events,
            mode,
            answered,
            answer_seconds,
            errors,
            tracked,
            stdout_late,
            stdout_dropped,
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

    pub fn stdout_dropped(&self) {
        self.stdout_dropped.inc();
    }

    fn encode(&self) -> String {
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

    fn ignored(&self, reason: &'static str) {
        self.ignored
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }
}

/// What the endpoints serve.
pub struct Shared {
    pub metrics: Arc<Metrics>,
    /// `None` while starting; then the `/readyz` body.
    pub ready: RwLock<Option<String>>,
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    match s.ready.read().ok().and_then(|r| r.clone()) {
        Some(body) => (StatusCode::OK, body),
        None => (StatusCode::SERVICE_UNAVAILABLE, "starting\n".to_owned()),
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

/// Binds `addr` and serves the endpoints on the current runtime. A bind
/// failure is logged and the agent carries on without them: a busy port
/// must not make a node agent crash-loop.
pub async fn spawn(addr: SocketAddr, shared: Arc<Shared>) {
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%addr, %e, "cannot serve /healthz, /readyz and /metrics; going on without them");
            return;
        }
    };
    let local = listener
        .local_addr()
        .map_or_else(|_| addr.to_string(), |a| a.to_string());
    tracing::info!("serving /healthz, /readyz and /metrics on http://{local}");
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(shared);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(%e, "HTTP server stopped");
        }
    });
}
