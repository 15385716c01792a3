//! `/healthz`, `/readyz` and `/metrics` over HTTP, on a thread and runtime
//! of their own.

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::listen::{accepted, on_own_thread};
use crate::metrics::Metrics;

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
        s.metrics.hook_progress(
            h.oldest_unanswered().unwrap_or_default(),
            h.argv_records_waiting(),
        );
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
    let mut incoming = std::pin::pin!(accepted(listener, "HTTP endpoint"));
    while let Some(stream) = tokio_stream::StreamExt::next(&mut incoming).await {
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            metrics.http_refused();
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

#[cfg(test)]
mod tests {
    use super::*;

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
