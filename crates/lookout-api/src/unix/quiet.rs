//! [`QuietStream`]: an accepted connection its clients' reads do not wake.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{Interest, ReadBuf};
use tonic::transport::server::{Connected, UdsConnectInfo};

/// Bytes at most zeroed for one read (`ReadBuf` hands the rest over
/// uninitialized; a read of HTTP/2 frames needs little more).
const READ_CHUNK: usize = 64 * 1024;

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
/// connection holds two descriptors meanwhile. Nothing else changes: a
/// peer's close still wakes the reader (`EPOLLRDHUP`/`EPOLLHUP`).
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
    /// Outside a tokio runtime with I/O enabled, as tokio's own sockets.
    pub fn new(stream: tokio::net::UnixStream) -> io::Result<QuietStream> {
        let info = stream.connect_info();
        let stream = stream.into_std()?;
        stream.set_nonblocking(true)?;
        Ok(QuietStream {
            read: register(stream, Interest::READABLE)?,
            write: None,
            info,
        })
    }

    fn socket(&self) -> &UnixStream {
        self.read.get_ref()
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
            match write(self.socket()) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Registering reports the socket writable at once if it
                    // became so since: no wake-up is lost.
                    let dup = self.socket().try_clone()?;
                    self.write = Some(register(dup, Interest::WRITABLE)?);
                }
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

    /// The epoll interest masks registered for `fd` in this process
    /// (`/proc/self/fdinfo` of each epoll descriptor: `tfd: FD events: MASK
    /// data: TOKEN ... ino: INODE`). Tests run side by side and reuse
    /// descriptor numbers: the socket's inode tells them apart. mio keeps
    /// two descriptors of one epoll instance: the same registration
    /// (token) is counted once.
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
                if let ["tfd:", n, "events:", mask, "data:", token, ..] = w[..]
                    && n.parse::<i32>().ok() == Some(fd)
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
        let masks = interests(blocked);
        assert_eq!(masks.len(), 1, "{masks:x?}");
        assert!(
            masks[0] & EPOLLOUT != 0 && masks[0] & EPOLLIN == 0,
            "{:x}",
            masks[0]
        );
        // The peer's credentials were read before the registration moved.
        use std::os::unix::fs::MetadataExt;
        let me = std::fs::metadata("/proc/self").expect("/proc/self").uid();
        assert_eq!(quiet.connect_info().peer_cred.map(|c| c.uid()), Some(me));
    }
}
