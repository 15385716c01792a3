//! Dialling the agent's Unix socket, with retry and backoff.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::Error;

/// Where the agent serves its API unless told otherwise (`lookout run --socket`).
pub const DEFAULT_SOCKET: &str = "/run/lookout/lookout.sock";

/// How [`crate::Client::connect_with`] dials, and how a [`crate::Watcher`]
/// redials after its stream drops.
///
/// ```
/// use std::time::Duration;
/// let options = lookout_client::ConnectOptions::new().retry_for(Duration::from_secs(60));
/// # let _ = options;
/// ```
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    retry_for: Duration,
    initial_backoff: Duration,
    max_backoff: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl ConnectOptions {
    /// Retries for 10 s, backing off from 50 ms to 2 s.
    pub fn new() -> Self {
        Self {
            retry_for: Duration::from_secs(10),
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
        }
    }

    /// How long to keep retrying a retryable failure (a missing socket, a
    /// refused connection, an unavailable agent) before returning it.
    /// [`Duration::ZERO`] tries once. A [`crate::Watcher`] applies it anew to
    /// each outage.
    pub fn retry_for(mut self, retry_for: Duration) -> Self {
        self.retry_for = retry_for;
        self
    }

    /// The first pause between attempts; each next pause doubles, up to
    /// [`ConnectOptions::max_backoff`].
    pub fn initial_backoff(mut self, backoff: Duration) -> Self {
        self.initial_backoff = backoff;
        self
    }

    /// The longest pause between attempts.
    pub fn max_backoff(mut self, backoff: Duration) -> Self {
        self.max_backoff = backoff;
        self
    }

    /// The configured retry window.
    pub fn retry_window(&self) -> Duration {
        self.retry_for
    }

    /// The exponential backoff these options describe.
    pub(crate) fn backoff(&self) -> Backoff {
        Backoff {
            next: self.initial_backoff,
            initial: self.initial_backoff,
            max: self.max_backoff.max(self.initial_backoff),
        }
    }
}

/// Doubling pauses between `initial` and `max`.
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    next: Duration,
    initial: Duration,
    max: Duration,
}

impl Backoff {
    /// The pause to take now; the following one is twice as long.
    pub(crate) fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        pause
    }

    /// Back to the initial pause (after a success).
    pub(crate) fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// Runs `attempt` until it succeeds, fails with a non-retryable error, or
/// `options.retry_for` has passed since the first attempt.
pub(crate) async fn retry<T, F, Fut>(options: &ConnectOptions, mut attempt: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + options.retry_for;
    let mut backoff = options.backoff();
    loop {
        let error = match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        let now = Instant::now();
        if !error.is_retryable() || now >= deadline {
            return Err(error);
        }
        let pause = backoff.next_pause().min(deadline - now);
        tracing::debug!(
            error = %crate::error::chain(&error),
            ?pause,
            "lookout API not reachable yet, retrying"
        );
        tokio::time::sleep(pause).await;
    }
}

/// One attempt: `connect(2)` on `path`, then the HTTP/2 handshake.
///
/// The first stream is dialled here so that its `io::Error` is classified
/// exactly ([`Error::SocketMissing`], [`Error::PermissionDenied`]); tonic
/// redials `path` by itself if that connection later breaks.
pub(crate) async fn dial(path: &Path) -> Result<Channel, Error> {
    let stream = UnixStream::connect(path)
        .await
        .map_err(|e| Error::from_connect(path.to_owned(), e))?;
    let first = Arc::new(Mutex::new(Some(stream)));
    let redial_path: Arc<PathBuf> = Arc::new(path.to_owned());
    let connector = tower::service_fn(move |_: Uri| {
        // N.B. a poisoned lock only means another connect panicked; the
        // stream is then simply dialled again.
        let first = first.lock().ok().and_then(|mut slot| slot.take());
        let path = Arc::clone(&redial_path);
        async move {
            let stream = match first {
                Some(stream) => stream,
                None => UnixStream::connect(path.as_path()).await?,
            };
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        }
    });
    // The URI is required by tonic but never resolved: the connector
    // ignores it. Its authority becomes the HTTP/2 `:authority`.
    Endpoint::from_static("http://lookout.invalid")
        .connect_with_connector(connector)
        .await
        .map_err(|source| Error::Handshake {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_max_and_resets() {
        let options = ConnectOptions::new()
            .initial_backoff(Duration::from_millis(100))
            .max_backoff(Duration::from_millis(350));
        let mut backoff = options.backoff();
        let pauses: Vec<_> = (0..4).map(|_| backoff.next_pause().as_millis()).collect();
        assert_eq!(pauses, [100, 200, 350, 350]);
        backoff.reset();
        assert_eq!(backoff.next_pause(), Duration::from_millis(100));
    }

    #[tokio::test]
    async fn missing_socket_without_retry_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("absent.sock");
        let options = ConnectOptions::new().retry_for(Duration::ZERO);
        let error = retry(&options, || dial(&path))
            .await
            .expect_err("no socket");
        assert!(matches!(error, Error::SocketMissing { .. }), "{error:?}");
    }

    #[tokio::test]
    async fn a_stale_socket_is_refused_and_retryable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("stale.sock");
        // Bound, then closed: the file stays, nobody listens (an agent that
        // died without cleaning up).
        drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
        let error = dial(&path).await.expect_err("nobody listens");
        assert!(matches!(error, Error::Connect { .. }), "{error:?}");
        assert!(error.is_retryable(), "{error:?}");
    }

    /// A listener whose backlog is full (an agent busy, or flooded with
    /// connections by another local user) refuses a non-blocking connect
    /// with `EAGAIN`: it will take connections again, so a client retries.
    #[tokio::test]
    async fn a_full_listen_backlog_is_retryable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("busy.sock");
        let socket = tokio::net::UnixSocket::new_stream().expect("socket");
        socket.bind(&path).expect("bind");
        let _listener = socket.listen(1).expect("listen");
        // Never accepted: the backlog fills after a connection or two.
        let mut held = Vec::new();
        // (As `dial` connects, before its HTTP/2 handshake.)
        let error = loop {
            match UnixStream::connect(&path).await {
                Ok(stream) => {
                    held.push(stream);
                    assert!(held.len() < 64, "the backlog never filled");
                }
                Err(e) => break Error::from_connect(path.clone(), e),
            }
        };
        match &error {
            Error::Connect { source, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::WouldBlock, "{error:?}")
            }
            other => panic!("{other:?}"),
        }
        assert!(error.is_retryable(), "{error:?}");
    }
}
