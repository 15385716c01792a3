//! How the agent's two servers, the consumer API (tonic) and the HTTP
//! endpoints, listen: each on a thread and runtime of its own
//! ([`on_own_thread`]), with an accept loop that backs off when `accept`
//! fails ([`accepted`]).
//!
//! At the open-file limit (`EMFILE`) the connection stays queued and the
//! socket stays readable, so each `accept` fails again at once: a loop that
//! retried at once would spin at full CPU for as long as descriptors stay
//! short. tonic's server does exactly that with an error from its incoming
//! stream (it takes it as one connection lost and asks for the next), so
//! errors never reach it.

use std::future::Future;
use std::time::Duration;

use futures::Stream;

/// How long to wait after an `accept` that failed.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// A failed `accept` is logged at most this often.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);

/// Where connections are accepted from: a listening socket, or a test's
/// stand-in.
pub(crate) trait Acceptor {
    /// An accepted connection.
    type Conn;
    /// The next connection, or why there is none now.
    fn accept(&mut self) -> impl Future<Output = std::io::Result<Self::Conn>> + Send;
}

impl Acceptor for tokio::net::UnixListener {
    type Conn = tokio::net::UnixStream;
    async fn accept(&mut self) -> std::io::Result<tokio::net::UnixStream> {
        tokio::net::UnixListener::accept(self).await.map(|(s, _)| s)
    }
}

impl Acceptor for tokio::net::TcpListener {
    type Conn = tokio::net::TcpStream;
    async fn accept(&mut self) -> std::io::Result<tokio::net::TcpStream> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

/// The connections `from` accepts, without end. A failed `accept` is
/// retried after [`ACCEPT_BACKOFF`] and logged, naming `what`, at most
/// every 10 s.
pub(crate) fn accepted<A>(mut from: A, what: &'static str) -> impl Stream<Item = A::Conn>
where
    A: Acceptor,
{
    async_stream::stream! {
        let mut warned: Option<std::time::Instant> = None;
        loop {
            match from.accept().await {
                Ok(conn) => yield conn,
                Err(e) => {
                    if warned.is_none_or(|t| t.elapsed() >= ACCEPT_WARN_EVERY) {
                        warned = Some(std::time::Instant::now());
                        tracing::warn!(
                            %e,
                            "{what}: cannot accept a connection; trying again every {} ms",
                            ACCEPT_BACKOFF.as_millis()
                        );
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Fails its first `failures` accepts with `EMFILE`, as a socket does
    /// while the process is at its open-file limit, then accepts `42`.
    struct Exhausted {
        failures: usize,
        calls: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Acceptor for Exhausted {
        type Conn = u32;
        async fn accept(&mut self) -> std::io::Result<u32> {
            let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n < self.failures {
                Err(std::io::Error::from_raw_os_error(libc::EMFILE))
            } else {
                Ok(42)
            }
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failing_accept_backs_off_instead_of_spinning() {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stream = accepted(
            Exhausted {
                failures: 4,
                calls: Arc::clone(&calls),
            },
            "a test",
        );
        let mut stream = std::pin::pin!(stream);
        let started = std::time::Instant::now();
        // Nothing comes out while accepts fail, and they are not retried
        // at once: after 120 ms, at most three tries (0, 50 and 100 ms).
        let early = tokio::time::timeout(
            Duration::from_millis(120),
            futures::StreamExt::next(&mut stream),
        )
        .await;
        assert!(early.is_err(), "an error reached the stream: {early:?}");
        let tried = calls.load(std::sync::atomic::Ordering::SeqCst);
        assert!((1..=3).contains(&tried), "{tried} accepts in 120 ms");
        let conn = futures::StreamExt::next(&mut stream).await;
        assert_eq!(conn, Some(42));
        assert!(started.elapsed() >= 4 * ACCEPT_BACKOFF);
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 5);
    }
}
