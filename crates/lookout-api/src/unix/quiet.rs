//! [`QuietStream`]: an accepted connection its clients' reads do not wake.

use std::future::Future;
use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{Interest, ReadBuf};
use tonic::transport::server::{Connected, UdsConnectInfo};

/// Bytes at most read (and zeroed first: h2 hands over an uninitialized
/// buffer each time) in one call; a consumer's requests are small.
const READ_CHUNK: usize = 16 * 1024;

/// How long a blocked write waits before it tries again when no second
/// descriptor could be had to wait on (the process is at its open-file
/// limit): the connection slows down rather than fails.
const RETRY_WITHOUT_FD: std::time::Duration = std::time::Duration::from_millis(20);

/// An accepted connection whose server is not woken when its client reads.
///
/// tokio registers every socket for reading and writing at once
/// (edge-triggered). A Unix socket signals "writable" whenever its peer
/// reads: the kernel's `unix_write_space` wakes every epoll waiter that
/// asked for `EPOLLOUT`. So each client that reads one of the server's
/// frames wakes the server's thread once more, for nothing. In lookout's
/// agent, with 100 watchers, the API's thread slept and woke 6.7-8.2 times
/// per change (each 16-22 us of a vCPU on a small VM), and `perf` put a
/// quarter of its time in the scheduler's switch path; with [`QuietStream`]
/// 1.0-1.2 times.
///
/// [`QuietStream`] registers the connection for reading only. A write goes
/// straight to the socket; only one that would block (a client that
/// stopped reading, with its socket buffer full) registers a duplicate of
/// the descriptor for writing, until a write succeeds again: such a
/// connection holds two descriptors meanwhile (at the open-file limit it
/// tries the write again every 20 ms instead). Nothing else changes: a
/// peer's close still wakes the reader (`EPOLLRDHUP`/`EPOLLHUP`), and a
/// blocked writer.
///
/// ```no_run
/// # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
/// use lookout_api::unix::{AuthorityFix, QuietStream};
/// use tokio_stream::StreamExt;
/// let listener = tokio::net::UnixListener::bind("/tmp/api.sock")?;
/// let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
///     .map(|conn| conn.and_then(QuietStream::new).map(AuthorityFix::new));
/// # let routes = tonic::service::Routes::default();
/// tonic::transport::Server::builder()
///     .add_routes(routes)
///     .serve_with_incoming(incoming)
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct QuietStream {
    read: AsyncFd<UnixStream>,
    /// A duplicate of the descriptor, registered for writing while a write
    /// would block.
    write: Option<AsyncFd<UnixStream>>,
    /// While a write would block and no duplicate could be had: when to
    /// try again.
    retry: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The runtime it was registered with: a blocked write registers there
    /// too, whichever context polls it.
    runtime: tokio::runtime::Handle,
    info: UdsConnectInfo,
}

impl QuietStream {
    /// Takes `stream` off the runtime's registration and registers it
    /// again for reading only. Its peer's credentials and address are read
    /// first, for [`Connected::connect_info`].
    ///
    /// # Errors
    ///
    /// The runtime's reactor could not take the registration (the
    /// descriptor is then closed).
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime with I/O and time enabled.
    pub fn new(stream: tokio::net::UnixStream) -> io::Result<QuietStream> {
        let info = stream.connect_info();
        let stream = stream.into_std()?;
        stream.set_nonblocking(true)?;
        Ok(QuietStream {
            read: register(stream, Interest::READABLE)?,
            write: None,
            retry: None,
            runtime: tokio::runtime::Handle::current(),
            info,
        })
    }

    fn socket(&self) -> &UnixStream {
        self.read.get_ref()
    }

    /// A write would block: wait for the socket to be writable through a
    /// duplicate registered for writing or, with no descriptor to spare,
    /// for a short while.
    fn wait_writable(&mut self) {
        let _runtime = self.runtime.enter();
        // Registering reports the socket writable at once if it became so
        // since the write: no wake-up is lost.
        match self
            .socket()
            .try_clone()
            .and_then(|dup| register(dup, Interest::WRITABLE))
        {
            Ok(w) => self.write = Some(w),
            Err(_) => self.retry = Some(Box::pin(tokio::time::sleep(RETRY_WITHOUT_FD))),
        }
    }
}

/// `stream` on the current runtime's reactor, for `interest` only.
fn register(stream: UnixStream, interest: Interest) -> io::Result<AsyncFd<UnixStream>> {
    // SAFETY: a `UnixStream` owns its descriptor: it stays open, and
    // `as_raw_fd` returns the same one, until the `AsyncFd` that owns the
    // stream drops it.
    Ok(unsafe { AsyncFd::register_with_interest(stream, interest) }?)
}

impl tokio::io::AsyncRead for QuietStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let mut ready = ready!(this.read.poll_read_ready(cx))?;
            let room = buf.remaining().min(READ_CHUNK);
            let into = buf.initialize_unfilled_to(room);
            match ready.try_io(|s| s.get_ref().read(into)) {
                Ok(Ok(n)) => {
                    // Less than asked for: drained (as tokio does; not on
                    // 0, the end, which must stay readable).
                    if n > 0 && n < room {
                        ready.clear_ready();
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // Not readable after all: readiness was cleared; wait again.
                Err(_) => continue,
            }
        }
    }
}

impl QuietStream {
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        mut write: impl FnMut(&UnixStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            if let Some(blocked) = &self.write {
                let mut ready = ready!(blocked.poll_write_ready(cx))?;
                match ready.try_io(|s| write(s.get_ref())) {
                    Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Ok(done) => {
                        // Writable again: quiet until the next full buffer.
                        self.write = None;
                        return Poll::Ready(done);
                    }
                    Err(_) => continue,
                }
            }
            if let Some(retry) = &mut self.retry {
                ready!(retry.as_mut().poll(cx));
                self.retry = None;
            }
            match write(self.socket()) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait_writable(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                done => return Poll::Ready(done),
            }
        }
    }
}

impl tokio::io::AsyncWrite for QuietStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_with(cx, |mut s| s.write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, |mut s| s.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Nothing is buffered here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.socket().shutdown(Shutdown::Write) {
            // The peer is gone already: nothing to shut.
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Poll::Ready(Ok(())),
            r => Poll::Ready(r),
        }
    }
}

impl Connected for QuietStream {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> UdsConnectInfo {
        self.info.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

    /// The epoll interest masks registered in this process for the socket
    /// `fd` refers to, through any descriptor of it (duplicates included):
    /// `/proc/self/fdinfo` of each epoll descriptor lists `tfd: FD events:
    /// MASK data: TOKEN ... ino: INODE`, and the socket's inode tells the
    /// tests running side by side apart. mio keeps two descriptors of one
    /// epoll instance: the same registration (token) is counted once.
    fn interests(fd: i32) -> Vec<u32> {
        use std::os::unix::fs::MetadataExt;
        let socket = std::fs::metadata(format!("/proc/self/fd/{fd}")).expect("the socket");
        let ino = format!("ino:{:x}", socket.ino());
        let mut found = std::collections::BTreeMap::new();
        for e in std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd") {
            let Ok(e) = e else { continue };
            let is_epoll = std::fs::read_link(e.path())
                .is_ok_and(|t| t.to_string_lossy().contains("eventpoll"));
            if !is_epoll {
                continue;
            }
            let info = std::fs::read_to_string(
                std::path::Path::new("/proc/self/fdinfo").join(e.file_name()),
            )
            .unwrap_or_default();
            for line in info.lines() {
                let w: Vec<&str> = line.split_whitespace().collect();
                if let ["tfd:", _, "events:", mask, "data:", token, ..] = w[..]
                    && w.contains(&ino.as_str())
                    && let Ok(mask) = u32::from_str_radix(mask, 16)
                {
                    found.insert(token.to_string(), mask);
                }
            }
        }
        found.into_values().collect()
    }

    const EPOLLOUT: u32 = 0x4;
    const EPOLLIN: u32 = 0x1;

    fn pair() -> (QuietStream, tokio::net::UnixStream) {
        let (a, b) = tokio::net::UnixStream::pair().expect("pair");
        (QuietStream::new(a).expect("quiet"), b)
    }

    /// The point of it: the connection is registered for reading, never
    /// for writing, unless a write would block; and it carries bytes both
    /// ways.
    #[tokio::test(flavor = "current_thread")]
    async fn registered_for_reading_only_and_carries_bytes() {
        let (mut quiet, mut peer) = pair();
        let fd = quiet.socket().as_raw_fd();
        let masks = interests(fd);
        assert_eq!(masks.len(), 1, "one registration: {masks:x?}");
        assert!(masks[0] & EPOLLIN != 0, "{:x}", masks[0]);
        assert!(
            masks[0] & EPOLLOUT == 0,
            "registered for writing: {:x}",
            masks[0]
        );

        quiet.write_all(b"to the peer").await.expect("write");
        let mut got = [0u8; 11];
        peer.read_exact(&mut got).await.expect("peer read");
        assert_eq!(&got, b"to the peer");
        peer.write_all(b"back").await.expect("peer write");
        let mut back = [0u8; 4];
        quiet.read_exact(&mut back).await.expect("read");
        assert_eq!(&back, b"back");
        // A peer that reads made no registration for writing either.
        assert_eq!(interests(fd).len(), 1);

        // The peer closes: the reader sees the end.
        drop(peer);
        let mut rest = Vec::new();
        quiet.read_to_end(&mut rest).await.expect("end");
        assert!(rest.is_empty());
    }

    /// A write that would block waits for the peer to read (through a
    /// registration for writing, which goes away once the write is done),
    /// and loses nothing.
    #[tokio::test(flavor = "current_thread")]
    async fn a_full_socket_waits_for_its_reader_and_loses_nothing() {
        let (mut quiet, mut peer) = pair();
        let fd = quiet.socket().as_raw_fd();
        let total = 4 * 1024 * 1024;
        let data: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        let writer = async {
            quiet.write_all(&data).await.expect("write");
            quiet.shutdown().await.expect("shutdown");
            quiet
        };
        let reader = async {
            // Not reading at first: the socket's buffer fills.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut got = Vec::new();
            peer.read_to_end(&mut got).await.expect("read");
            got
        };
        let (quiet, got) = tokio::time::timeout(Duration::from_secs(30), async {
            tokio::join!(writer, reader)
        })
        .await
        .expect("the blocked writer was never woken");
        assert!(
            got == data,
            "the bytes arrived changed ({} of {total})",
            got.len()
        );
        assert!(quiet.write.is_none(), "still registered for writing");
        assert_eq!(interests(fd).len(), 1, "the write registration stayed");
    }

    /// Blocked writes register a duplicate for writing only.
    #[tokio::test(flavor = "current_thread")]
    async fn a_blocked_write_registers_for_writing() {
        let (mut quiet, _peer) = pair();
        let chunk = vec![7u8; 64 * 1024];
        let blocked = loop {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            match Pin::new(&mut quiet).poll_write(&mut cx, &chunk) {
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => panic!("write: {e}"),
                Poll::Pending => {
                    break quiet
                        .write
                        .as_ref()
                        .expect("registered")
                        .get_ref()
                        .as_raw_fd();
                }
            }
        };
        // The socket's two registrations: the connection's for reading,
        // the duplicate's for writing.
        let mut masks = interests(blocked);
        masks.sort_by_key(|m| m & EPOLLOUT);
        assert_eq!(masks.len(), 2, "{masks:x?}");
        assert!(
            masks[0] & EPOLLIN != 0 && masks[0] & EPOLLOUT == 0,
            "{masks:x?}"
        );
        assert!(
            masks[1] & EPOLLOUT != 0 && masks[1] & EPOLLIN == 0,
            "{masks:x?}"
        );
        // The peer's credentials were read before the registration moved.
        use std::os::unix::fs::MetadataExt;
        let me = std::fs::metadata("/proc/self").expect("/proc/self").uid();
        assert_eq!(quiet.connect_info().peer_cred.map(|c| c.uid()), Some(me));
    }

    /// A peer that goes away while a write waits for it ends the write
    /// with an error (the duplicate registered for writing hears the
    /// hang-up), and leaves no registration behind.
    #[tokio::test(flavor = "current_thread")]
    async fn a_peer_gone_while_a_write_waits_ends_the_write() {
        let (mut quiet, peer) = pair();
        let fd = quiet.socket().as_raw_fd();
        let chunk = vec![7u8; 64 * 1024];
        let mut cx = Context::from_waker(std::task::Waker::noop());
        while let Poll::Ready(r) = Pin::new(&mut quiet).poll_write(&mut cx, &chunk) {
            r.expect("write");
        }
        assert_eq!(interests(fd).len(), 2, "blocked: read and write");
        let write = async {
            let mut n = 0u64;
            loop {
                match quiet.write(&chunk).await {
                    Ok(w) => n += w as u64,
                    Err(e) => return (e, n),
                }
            }
        };
        let close = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(peer);
        };
        let ((e, _), ()) = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(write, close)
        })
        .await
        .expect("a write waited for a peer that had gone");
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ),
            "{e}"
        );
        assert!(quiet.write.is_none(), "still registered for writing");
        assert_eq!(interests(fd).len(), 1, "the write registration stayed");
    }
}
