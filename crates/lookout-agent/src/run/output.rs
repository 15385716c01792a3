//! Events on stdout: one JSON object or readable line per event, written
//! by a thread of its own so that a reader who stops reading cannot hold a
//! runtime up.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use lookout_model::Sink;
use lookout_model::{ContainerEvent, EventKind};

use super::args::Output;

/// Hands each event to a writer thread that writes it to stdout and
/// flushes, and waits (up to `deadline`) until it is written: a reader has
/// the event before the runtime exec that caused it is allowed. A consumer
/// that stops reading stdout must not freeze the node's runtimes, so after
/// the deadline the hook goes on (the line is still written later, in
/// order); while earlier lines are still unwritten, later events do not
/// wait at all, so a stall costs the runtimes one deadline, not one per
/// event. When even the bounded queue is full, events are dropped and
/// counted.
///
/// N.B. not a non-blocking write on the emitting thread (which would save
/// two thread wake-ups per event): every write to a pipe takes the pipe's
/// lock, and a reader that splices from it (Go's `io.Copy` from a pipe to
/// a socket does) holds that lock for as long as its destination blocks.
/// `pwritev2(RWF_NOWAIT)` fails fast on a full pipe, not on that lock.
pub(crate) struct StdoutSink {
    output: Output,
    metrics: std::sync::Arc<crate::serve::Metrics>,
    unwritten: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    queue: std::sync::mpsc::SyncSender<(String, std::sync::mpsc::SyncSender<()>)>,
    deadline: Duration,
    late: u64,
    dropped: u64,
}

impl StdoutSink {
    pub(crate) fn new(
        output: Output,
        deadline: Duration,
        metrics: std::sync::Arc<crate::serve::Metrics>,
    ) -> anyhow::Result<StdoutSink> {
        let (queue, rx) =
            std::sync::mpsc::sync_channel::<(String, std::sync::mpsc::SyncSender<()>)>(4096);
        let unwritten = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = std::sync::Arc::clone(&unwritten);
        std::thread::Builder::new()
            .name("lookout-stdout".into())
            .spawn(move || {
                let out = std::io::stdout();
                for (line, ack) in rx {
                    let mut lock = out.lock();
                    if writeln!(lock, "{line}")
                        .and_then(|()| lock.flush())
                        .is_err()
                    {
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
