//! Events on stdout: one JSON object or readable line per event, written
//! by a thread of its own so that a reader who stops reading cannot hold a
//! runtime up.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use lookout_model::Sink;
use lookout_model::{ContainerEvent, EventKind};

use super::args::Output;

/// Hands each event to a writer thread that writes it to stdout and
/// flushes, in order, and never waits itself: the thread that emits (the
/// runtime hook's task, the NRI plugin's) goes on at once.
///
/// A reader must have a container's `added` line before the container runs
/// its first instruction: that is [`StdoutBarrier`]'s part, which holds the
/// runtime's `start` (up to `deadline`) until every line queued so far is
/// written. A consumer that stops reading stdout must not freeze the node's
/// runtimes, so after the deadline the start goes on (the line is still
/// written later, in order); from then until the writer has caught up,
/// starts do not wait at all, so a stall costs the runtimes one deadline,
/// not one per container. When even the bounded queue is full, events are
/// dropped and counted.
///
/// N.B. not a non-blocking write on the emitting thread (which would save
/// the writer's wake-up per event): every write to a pipe takes the pipe's
/// lock, and a reader that splices from it (Go's `io.Copy` from a pipe to
/// a socket does) holds that lock for as long as its destination blocks.
/// `pwritev2(RWF_NOWAIT)` fails fast on a full pipe, not on that lock.
///
/// N.B. the emitting thread used to wait for each line to be written: for
/// an exit's `removed`, which no exec waits on, that was a sleep and a
/// wake-up of the hook's task for nothing, and for a stalled consumer it
/// held every other container's exec on that thread for the deadline.
///
/// The queue holds events, not lines: the record is shared
/// (`Arc<Container>`), and the writer encodes each line into one buffer it
/// keeps, so lines waiting for a slow reader cost no copies of their
/// containers (200 containers of 64 KiB annotations queued at once were
/// 14 MB of lines), and encoding is off the emitting thread.
pub(crate) struct StdoutSink {
    output: Output,
    metrics: std::sync::Arc<crate::serve::Metrics>,
    progress: std::sync::Arc<Progress>,
    queue: std::sync::mpsc::SyncSender<ContainerEvent>,
    /// A writer on one line this long is stalled, start or no start.
    deadline: Duration,
    late: u64,
    dropped: u64,
}

/// With this many `added` lines remembered for starts that never came (a
/// `run`, a scan's containers), the written ones are forgotten.
const MAX_REMEMBERED_ADDED: usize = 1024;

/// How far the writer is, shared by the sink, its writer and its barrier.
struct Progress {
    /// Lines handed to the writer.
    queued: AtomicU64,
    /// Lines the writer is done with (written, or lost to a closed
    /// stdout), for the barrier to wait on.
    written: tokio::sync::watch::Sender<u64>,
    /// A start's wait ran out and the writer has not caught up since: no
    /// start waits.
    stalled: AtomicBool,
    /// The line number of each container's `added` line, until its start
    /// asks for it.
    added: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    /// When (`CLOCK_MONOTONIC` ns) the writer took its latest line.
    taken_at: AtomicU64,
    /// When a line was queued with none waiting before it.
    pending_since: AtomicU64,
}

impl Progress {
    /// Notes that container `id`'s `added` event is line `line`.
    fn remember_added(&self, id: String, line: u64) {
        let Ok(mut added) = self.added.lock() else {
            return;
        };
        if added.len() >= MAX_REMEMBERED_ADDED {
            let written = *self.written.borrow();
            added.retain(|_, l| *l > written);
        }
        added.insert(id, line);
    }

    /// Marks the writer stalled; true if it was not already (say so once
    /// per stall).
    fn stall(&self) -> bool {
        !self.stalled.swap(true, Ordering::AcqRel)
    }

    /// Whether every queued line is written; clears `stalled` if so.
    fn caught_up(&self) -> bool {
        let done = *self.written.borrow() >= self.queued.load(Ordering::Acquire);
        if done {
            self.stalled.store(false, Ordering::Release);
        }
        done
    }
}

impl StdoutSink {
    /// Starts the writer thread; returns the sink and the barrier that
    /// holds a start until the lines before it are written (at most
    /// `deadline`).
    pub(crate) fn new(
        output: Output,
        deadline: Duration,
        metrics: std::sync::Arc<crate::serve::Metrics>,
    ) -> anyhow::Result<(StdoutSink, StdoutBarrier)> {
        let (queue, rx) = std::sync::mpsc::sync_channel::<ContainerEvent>(4096);
        let progress = std::sync::Arc::new(Progress {
            queued: AtomicU64::new(0),
            written: tokio::sync::watch::Sender::new(0),
            stalled: AtomicBool::new(false),
            added: std::sync::Mutex::new(std::collections::HashMap::new()),
            taken_at: AtomicU64::new(0),
            pending_since: AtomicU64::new(0),
        });
        let writer = std::sync::Arc::clone(&progress);
        std::thread::Builder::new()
            .name("lookout-stdout".into())
            .spawn(move || {
                let out = std::io::stdout();
                let mut line = Vec::with_capacity(4096);
                for event in rx {
                    writer
                        .taken_at
                        .store(lookout_model::monotonic_ns(), Ordering::Release);
                    // One container's 256 KiB of annotations need not be
                    // kept for the small lines after it.
                    if line.capacity() > 1 << 20 {
                        line = Vec::with_capacity(4096);
                    }
                    line.clear();
                    encode(output, &event, &mut line);
                    drop(event);
                    let mut lock = out.lock();
                    if lock.write_all(&line).and_then(|()| lock.flush()).is_err() {
                        // N.B. a closed stdout must not stop discovery.
                        tracing::debug!("stdout closed; event dropped");
                    }
                    // Wakes a waiting start, if any; nothing otherwise.
                    writer.written.send_modify(|n| *n += 1);
                }
            })
            .context("starting the stdout writer thread")?;
        let sink_deadline = deadline;
        let barrier = StdoutBarrier {
            progress: std::sync::Arc::clone(&progress),
            deadline,
            metrics: std::sync::Arc::clone(&metrics),
        };
        Ok((
            StdoutSink {
                output,
                metrics,
                progress,
                queue,
                deadline: sink_deadline,
                late: 0,
                dropped: 0,
            },
            barrier,
        ))
    }
}

impl Sink for StdoutSink {
    fn emit(&mut self, event: ContainerEvent) {
        self.metrics.event(&event);
        if self.output == Output::None {
            return;
        }
        let p = &self.progress;
        // A writer stuck on a line for the deadline is stalled even when no
        // start waits for it (`run` has none): say so, and count the lines
        // behind it as late.
        let now = lookout_model::monotonic_ns();
        let stalled = if p.caught_up() {
            p.pending_since.store(now, Ordering::Release);
            false
        } else {
            let since = p
                .taken_at
                .load(Ordering::Acquire)
                .max(p.pending_since.load(Ordering::Acquire));
            if now.saturating_sub(since) > self.deadline.as_nanos() as u64 && p.stall() {
                tracing::warn!(
                    id = event.container.id,
                    "stdout is not being read: event queued, the runtime is not kept waiting"
                );
            }
            p.stalled.load(Ordering::Acquire)
        };
        // N.B. one emitter at a time (`&mut self`): the line's number is
        // the count after it.
        let line = self.progress.queued.load(Ordering::Acquire) + 1;
        let added = (event.event == EventKind::Added).then(|| event.container.id.clone());
        let id = event.container.id.clone();
        match self.queue.try_send(event) {
            Ok(()) => {
                self.progress.queued.store(line, Ordering::Release);
                if let Some(id) = added {
                    self.progress.remember_added(id, line);
                }
                // Behind a consumer that stopped reading: this line is late.
                if stalled {
                    self.late += 1;
                    self.metrics.stdout_late();
                }
            }
            Err(_) => {
                self.dropped += 1;
                self.metrics.stdout_dropped();
                tracing::error!(
                    dropped = self.dropped,
                    id,
                    "stdout queue full: event dropped"
                );
            }
        }
    }
}

/// Holds a container's `start` until stdout's reader has its `added` line
/// (and so every line before it), for at most the deadline; not at all
/// once a wait ran out, until the writer catches up.
pub(crate) struct StdoutBarrier {
    progress: std::sync::Arc<Progress>,
    deadline: Duration,
    metrics: std::sync::Arc<crate::serve::Metrics>,
}

impl lookout_model::StartBarrier for StdoutBarrier {
    fn wait(&self, id: &str) -> Option<lookout_model::StartWait> {
        // No line of its own (not an `added` this agent wrote, or one
        // forgotten): nothing to wait for.
        let target = self.progress.added.lock().ok()?.remove(id)?;
        if *self.progress.written.borrow() >= target
            || (self.progress.stalled.load(Ordering::Acquire) && !self.progress.caught_up())
        {
            return None;
        }
        let mut written = self.progress.written.subscribe();
        let (progress, deadline, metrics, id) = (
            std::sync::Arc::clone(&self.progress),
            self.deadline,
            std::sync::Arc::clone(&self.metrics),
            id.to_owned(),
        );
        Some(Box::pin(async move {
            let wait = written.wait_for(|n| *n >= target);
            if tokio::time::timeout(deadline, wait).await.is_err() {
                metrics.stdout_late();
                if progress.stall() {
                    tracing::warn!(
                        id,
                        "stdout is not being read: event queued, the runtime is not kept waiting"
                    );
                }
            }
            lookout_model::StartDecision::Proceed
        }))
    }
}

/// One line for `event`, newline included, in `out`.
fn encode(output: Output, event: &ContainerEvent, out: &mut Vec<u8>) {
    match output {
        Output::Json => {
            if let Err(e) = serde_json::to_writer(&mut *out, event) {
                out.clear();
                let error = serde_json::json!({ "error": e.to_string() });
                let _ = serde_json::to_writer(&mut *out, &error);
            }
        }
        Output::Text => out.extend_from_slice(text_line(event).as_bytes()),
        Output::None => return,
    }
    out.push(b'\n');
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
