//! Events on stdout: one JSON object or readable line per event, written
//! by a thread of its own so that a reader who stops reading cannot hold a
//! runtime up.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

use anyhow::Context;
use lookout_model::Sink;
use lookout_model::{ContainerEvent, EventKind};

use super::args::Output;

/// Writes each event to stdout before the runtime exec that caused it is
/// allowed, without ever letting a reader that stops reading hold a
/// runtime up.
///
/// The line is first written on the emitting thread with
/// `pwritev2(RWF_NOWAIT)`: a write that would wait fails at once instead
/// (`EAGAIN`), and the flag is per call, so stdout's file description (it
/// may be shared with stderr or with other processes) is not made
/// non-blocking. When that works (a pipe with room, on Linux 6.1+), the
/// event costs one system call and no thread hand-off. Otherwise (a full
/// pipe, a kernel or file that does not take the flag, a short write) the
/// line, or its unwritten rest, goes to a writer thread of its own, and
/// the emitter waits (up to `deadline`) until it is written. After the
/// deadline the hook goes on (the line is still written later, in order);
/// while earlier lines are still unwritten, later events go to the same
/// queue, in order, and do not wait at all, so a stall costs the runtimes
/// one deadline, not one per event. When even the bounded queue is full,
/// events are dropped and counted.
///
/// N.B. a pipe's writer takes the pipe's lock, which its reader holds only
/// while it copies out: `RWF_NOWAIT` does not cover that wait, so a
/// reader that could stall its own copy inside the kernel could stall the
/// direct write. Reading a buffer whose page faults stall needs
/// privileges (`userfaultfd` of kernel faults) that whoever reads the
/// agent's stdout (the operator's log pipeline, containerd's shim) has
/// anyway.
pub(crate) struct StdoutSink {
    output: Output,
    metrics: std::sync::Arc<crate::serve::Metrics>,
    unwritten: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    queue: std::sync::mpsc::SyncSender<(Vec<u8>, std::sync::mpsc::SyncSender<()>)>,
    deadline: Duration,
    late: u64,
    dropped: u64,
    /// Whether the direct write is still worth trying: cleared for good
    /// when stdout or the kernel refuses `RWF_NOWAIT`.
    direct: bool,
}

impl StdoutSink {
    pub(crate) fn new(
        output: Output,
        deadline: Duration,
        metrics: std::sync::Arc<crate::serve::Metrics>,
    ) -> anyhow::Result<StdoutSink> {
        let (queue, rx) =
            std::sync::mpsc::sync_channel::<(Vec<u8>, std::sync::mpsc::SyncSender<()>)>(4096);
        let unwritten = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = std::sync::Arc::clone(&unwritten);
        std::thread::Builder::new()
            .name("lookout-stdout".into())
            .spawn(move || {
                let out = std::io::stdout();
                for (line, ack) in rx {
                    let mut lock = out.lock();
                    if lock.write_all(&line).and_then(|()| lock.flush()).is_err() {
                        // N.B. a closed stdout must not stop discovery.
                        tracing::debug!("stdout closed; event dropped");
                    }
                    counter.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                    let _ = ack.try_send(());
                }
            })
            .context("starting the stdout writer thread")?;
        Ok(StdoutSink {
            output,
            metrics,
            unwritten,
            queue,
            deadline,
            late: 0,
            dropped: 0,
            direct: true,
        })
    }
}

impl Sink for StdoutSink {
    fn emit(&mut self, event: ContainerEvent) {
        self.metrics.event(&event);
        let line = match self.output {
            Output::Json => {
                serde_json::to_string(&event).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
            }
            Output::Text => text_line(&event),
            Output::None => return,
        };
        let mut line = line.into_bytes();
        line.push(b'\n');
        // Nothing is queued (the sinks emit one at a time, under the
        // merger's lock): a direct write keeps the lines in order.
        if self.direct && self.unwritten.load(std::sync::atomic::Ordering::Acquire) == 0 {
            match write_nowait(std::io::stdout().as_fd(), &line) {
                Ok(n) if n == line.len() => return,
                // A short write (the pipe had room for part of it): the
                // rest, byte for byte, follows through the writer thread.
                Ok(n) => {
                    line.drain(..n);
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    // N.B. a closed stdout must not stop discovery.
                    tracing::debug!("stdout closed; event dropped");
                    return;
                }
                Err(e) => {
                    tracing::debug!(
                        error = %e,
                        "stdout does not take RWF_NOWAIT writes: every line goes through the writer thread"
                    );
                    self.direct = false;
                }
            }
        }
        let (ack_tx, ack_rx) = std::sync::mpsc::sync_channel(1);
        let behind = self
            .unwritten
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel)
            > 0;
        match self.queue.try_send((line, ack_tx)) {
            // The writer is still stuck on earlier lines: do not make the
            // runtime wait again.
            Ok(()) if behind => {
                self.late += 1;
                self.metrics.stdout_late();
            }
            Ok(()) => {
                if ack_rx.recv_timeout(self.deadline).is_err() {
                    self.late += 1;
                    self.metrics.stdout_late();
                    tracing::warn!(
                        late = self.late,
                        id = event.container.id,
                        "stdout is not being read: event queued, the runtime is not kept waiting"
                    );
                }
            }
            Err(_) => {
                self.unwritten
                    .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                self.dropped += 1;
                self.metrics.stdout_dropped();
                tracing::error!(
                    dropped = self.dropped,
                    id = event.container.id,
                    "stdout queue full: event dropped"
                );
            }
        }
    }
}

/// One `pwritev2(fd, buf, offset -1, RWF_NOWAIT)`: writes at the file's
/// current position, or fails with `EAGAIN` instead of waiting for room.
/// `EOPNOTSUPP` (a pipe before Linux 6.0, a tty, a file system without
/// non-blocking buffered writes) and `ENOSYS` say the flag cannot be used.
fn write_nowait(fd: std::os::fd::BorrowedFd<'_>, buf: &[u8]) -> std::io::Result<usize> {
    let iov = libc::iovec {
        iov_base: buf.as_ptr().cast_mut().cast(),
        iov_len: buf.len(),
    };
    loop {
        // SAFETY: `iov` describes `buf`, which outlives the call and is
        // only read; `fd` is borrowed for the call.
        let n = unsafe { libc::pwritev2(fd.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
        match usize::try_from(n) {
            Ok(n) => return Ok(n),
            Err(_) => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

fn text_line(e: &ContainerEvent) -> String {
    let c = &e.container;
    let kind = match e.event {
        EventKind::Added => "ADDED",
        EventKind::Removed => "REMOVED",
        EventKind::Updated => "UPDATED",
    };
    let mut s = format!(
        "{kind:<8} {:<6} {:<24} pid={:<8} source={}",
        c.runtime.as_str(),
        c.id,
        c.pid.map_or("-".to_owned(), |p| p.to_string()),
        e.source
    );
    if let Some(n) = &c.name {
        s.push_str(&format!(" name={n}"));
    }
    if let Some(i) = &c.image {
        s.push_str(&format!(" image={i}"));
    }
    if let Some(b) = &c.bundle {
        s.push_str(&format!(" bundle={}", b.display()));
    }
    if let Some(code) = e.exit_code {
        s.push_str(&format!(" exit={code}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the direct write relies on: on a full pipe it fails at once
    /// with EAGAIN, and the pipe's descriptor stays blocking.
    #[test]
    fn a_nowait_write_to_a_full_pipe_fails_at_once_and_leaves_the_pipe_blocking() {
        let (r, w) = nix::unistd::pipe().expect("pipe");
        let chunk = [b'x'; 4096];
        let mut written = 0usize;
        let err = loop {
            match write_nowait(w.as_fd(), &chunk) {
                Ok(n) => written += n,
                Err(e) => break e,
            }
            assert!(written <= 64 << 20, "a pipe never filled");
        };
        if err.raw_os_error() == Some(libc::EOPNOTSUPP) {
            // Pipes take RWF_NOWAIT from Linux 6.0 on; before, every line
            // goes through the writer thread (tested by tests/run.rs).
            eprintln!("SKIPPED: this kernel's pipes refuse RWF_NOWAIT ({err})");
            return;
        }
        assert_eq!(err.raw_os_error(), Some(libc::EAGAIN), "{err}");
        assert!(written > 0, "an empty pipe took nothing");
        let fl = nix::fcntl::fcntl(&w, nix::fcntl::FcntlArg::F_GETFL).expect("F_GETFL");
        assert_eq!(fl & libc::O_NONBLOCK, 0, "the descriptor was left blocking");
        // Room again: the next write goes through.
        let mut buf = vec![0u8; 8192];
        let n = nix::unistd::read(&r, &mut buf).expect("read");
        assert!(n > 0);
        assert!(write_nowait(w.as_fd(), b"y\n").expect("room") == 2);
    }
}
