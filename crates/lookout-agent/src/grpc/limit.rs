//! How many connections the consumer API holds, and from whom: each one
//! holds an fd the agent's fanotify group may need.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::server::UdsConnectInfo;

use crate::hub::lock;

/// The consumer API's limits on connections from peers other than root
/// and the agent's own user (`--api-max-connections`, and
/// `--api-max-connections-per-uid` so that one uid cannot lock the others
/// out): each connection holds an fd, and when fanotify cannot install an
/// event's fd the kernel denies the runtime's exec.
pub(crate) struct ConnectionLimit {
    permits: Arc<tokio::sync::Semaphore>,
    max: usize,
    per_uid: usize,
    /// Slots taken, by uid (`u32::MAX`: peers whose credentials could not
    /// be read).
    taken: std::sync::Mutex<HashMap<u32, usize>>,
    /// The agent's own uid: its standby connects as it.
    me: u32,
    refused: std::sync::atomic::AtomicU64,
    logged: std::sync::Mutex<Option<std::time::Instant>>,
    /// When a connection that could not be registered was last logged.
    unregistered_logged: std::sync::Mutex<Option<std::time::Instant>>,
    /// `lookout_api_connections`, `lookout_api_connections_refused_total`.
    metrics: crate::hub::HubMetrics,
}

/// How long a new connection may take to send its first bytes (the HTTP/2
/// preface) before it is closed: an idle socket must not keep a slot.
const PREFACE_DEADLINE: Duration = Duration::from_secs(5);

/// At most one warning about refused connections this often.
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);

impl ConnectionLimit {
    pub(crate) fn new(
        max: usize,
        per_uid: usize,
        metrics: crate::hub::HubMetrics,
    ) -> ConnectionLimit {
        ConnectionLimit {
            permits: Arc::new(tokio::sync::Semaphore::new(max)),
            max,
            per_uid,
            taken: std::sync::Mutex::new(HashMap::new()),
            me: nix::unistd::geteuid().as_raw(),
            refused: std::sync::atomic::AtomicU64::new(0),
            logged: std::sync::Mutex::new(None),
            unregistered_logged: std::sync::Mutex::new(None),
            metrics,
        }
    }

    /// `stream` with its slot, or `None` (the connection is closed) when
    /// its uid has taken its share, or the others every slot. Never
    /// waits. A connection is registered with the runtime only once it is
    /// admitted: one refused costs no more than its accept.
    pub(super) fn admit(self: &Arc<Self>, stream: tokio::net::UnixStream) -> Option<Admitted> {
        let cred = stream.peer_cred().ok();
        let uid = cred.map(|c| c.uid());
        let slot = if uid.is_some_and(|u| u == 0 || u == self.me) {
            None
        } else {
            Some(self.take(uid, cred.and_then(|c| c.pid()))?)
        };
        let stream = match lookout_api::unix::QuietStream::new(stream) {
            Ok(s) => s,
            Err(e) => {
                // Its slot, if any, goes back as it drops. Logged at most
                // every 10 s: what fails here (ENOMEM, the epoll watch
                // limit) fails for every connection until it clears.
                self.metrics.api_refused("register");
                if due(&self.unregistered_logged) {
                    tracing::warn!(
                        %e,
                        uid,
                        "consumer API: cannot register a connection; closed \
                         (lookout_api_connections_refused_total{{reason=\"register\"}} counts them)"
                    );
                }
                return None;
            }
        };
        Some(Admitted {
            stream,
            _slot: slot,
            _open: Open::new(&self.metrics.api_connections),
            preface: Some(Box::pin(tokio::time::sleep(PREFACE_DEADLINE))),
        })
    }

    /// A slot for a peer of `uid` (`None`: unknown), or `None` when it is
    /// refused (counted, and logged at most every [`REFUSED_LOG_EVERY`]).
    fn take(self: &Arc<Self>, uid: Option<u32>, pid: Option<i32>) -> Option<Slot> {
        let key = uid.unwrap_or(u32::MAX);
        let mut taken = lock(&self.taken);
        let mine = taken.get(&key).copied().unwrap_or(0);
        let (why, reason) = if mine >= self.per_uid {
            ("this uid holds --api-max-connections-per-uid", "per-uid")
        } else {
            match Arc::clone(&self.permits).try_acquire_owned() {
                Ok(permit) => {
                    taken.insert(key, mine + 1);
                    return Some(Slot {
                        limit: Arc::clone(self),
                        uid: key,
                        _permit: permit,
                    });
                }
                Err(_) => ("peers other than root hold --api-max-connections", "total"),
            }
        };
        self.metrics.api_refused(reason);
        let top = taken.iter().max_by_key(|(_, n)| **n).map(|(u, n)| (*u, *n));
        drop(taken);
        let n = self
            .refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if due(&self.logged) {
            tracing::warn!(
                uid,
                pid,
                holder_uid = top.map(|t| t.0),
                holder_connections = top.map(|t| t.1),
                max = self.max,
                per_uid = self.per_uid,
                refused_since_start = n,
                "consumer API connection refused: {why}"
            );
        }
        None
    }
}

/// Whether a warning last logged at `*last` is due again
/// ([`REFUSED_LOG_EVERY`]); if so, it is taken as logged now.
fn due(last: &std::sync::Mutex<Option<std::time::Instant>>) -> bool {
    let mut last = lock(last);
    if last.is_none_or(|t| t.elapsed() >= REFUSED_LOG_EVERY) {
        *last = Some(std::time::Instant::now());
        true
    } else {
        false
    }
}

/// A connection counted in `lookout_api_connections` until it closes.
struct Open(prometheus_client::metrics::gauge::Gauge);

impl Open {
    fn new(gauge: &prometheus_client::metrics::gauge::Gauge) -> Open {
        gauge.inc();
        Open(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A connection's slot under the [`ConnectionLimit`], given back when it
/// closes.
struct Slot {
    limit: Arc<ConnectionLimit>,
    uid: u32,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut taken = lock(&self.limit.taken);
        if let Some(n) = taken.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                taken.remove(&self.uid);
            }
        }
    }
}

/// An accepted connection: its slot (none for root and the agent's own
/// uid), and the deadline of its first bytes.
pub(super) struct Admitted {
    stream: lookout_api::unix::QuietStream,
    _slot: Option<Slot>,
    _open: Open,
    preface: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl tokio::io::AsyncRead for Admitted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        match &read {
            std::task::Poll::Ready(Ok(())) if buf.filled().len() > before => this.preface = None,
            std::task::Poll::Pending => {
                if let Some(deadline) = &mut this.preface
                    && deadline.as_mut().poll(cx).is_ready()
                {
                    return std::task::Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no HTTP/2 preface within 5 s",
                    )));
                }
            }
            _ => {}
        }
        read
    }
}

impl tokio::io::AsyncWrite for Admitted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Admitted {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> UdsConnectInfo {
        self.stream.connect_info()
    }
}
