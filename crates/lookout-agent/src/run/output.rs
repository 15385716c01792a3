//! Events on stdout: one JSON object or readable line per event, written
//! by a thread of its own so that a reader who stops reading cannot hold a
//! runtime up.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use lookout_model::{ContainerEvent, EventKind, Sink, StartBarrier, StartDecision, StartWait};
use tokio::sync::oneshot;

use super::args::Output;

/// Hands each event to a writer thread that writes it to stdout and
/// flushes, in order, and never waits itself: the thread that emits (the
/// runtime hook's task, the NRI plugin's) goes on at once.
///
/// A reader must have a container's `added` line before the container runs
/// its first instruction: that is [`StdoutBarrier`]'s part, which holds the
/// runtime's `start` (up to `deadline`) until that line, and so every line
/// before it, is written. A consumer that stops reading stdout must not
/// freeze the node's runtimes, so after the deadline the start goes on
/// (the line is still written later, in order); while the writer stays
/// stuck on that line, starts do not wait at all, so a stall costs the
/// runtimes one deadline, not one per container. When even the bounded
/// queue is full, events are dropped and counted.
///
/// N.B. not a non-blocking write on the emitting thread (which would save
/// the writer's wake-up per event): every write to a pipe takes the pipe's
/// lock, and a reader that splices from it (Go's `io.Copy` from a pipe to
/// a socket does) holds that lock for as long as its destination blocks.
/// `pwritev2(RWF_NOWAIT)` fails fast on a full pipe, not on that lock.
///
/// N.B. the emitting thread does not wait for its line to be written: for
/// an exit's `removed`, which no exec waits on, that would be a sleep and
/// a wake-up of the hook's task for nothing, and a stalled consumer would
/// hold every other container's exec on that thread for the deadline.
///
/// The queue holds events, not lines: the record is shared
/// (`Arc<Container>`), and the writer encodes each line into one buffer it
/// keeps, so lines waiting for a slow reader cost no copies of their
/// containers (200 containers of 64 KiB annotations queued at once would
/// be 14 MB of lines), and encoding is off the emitting thread.
///
/// The queue is std's unbounded channel, bounded by [`STDOUT_QUEUE`] from
/// the sink's counters: its blocks are allocated as lines wait and freed as
/// they are written. A `sync_channel` of the same bound allocates and
/// writes every slot up front (256 KiB, resident for the agent's life).
pub(crate) struct StdoutSink {
    output: Output,
    metrics: Arc<crate::metrics::Metrics>,
    progress: Arc<Progress>,
    queue: std::sync::mpsc::Sender<ContainerEvent>,
    /// Events waiting for the writer at most ([`STDOUT_QUEUE`]).
    bound: u64,
    dropped: u64,
}

/// Events waiting for the stdout writer at most (counting the one it is
/// on); more are dropped and counted.
const STDOUT_QUEUE: u64 = 4096;

/// With this many `added` lines remembered for starts that never came (a
/// `run`, a scan's containers), the written ones are forgotten.
const MAX_REMEMBERED_ADDED: usize = 1024;

/// Not stuck ([`Progress::stuck_at`]).
const NOT_STUCK: u64 = u64::MAX;

/// How far the writer is, shared by the sink, its writer and its barrier.
struct Progress {
    /// Lines handed to the writer (one emitter at a time).
    queued: AtomicU64,
    /// Lines the writer is done with (written, or lost to a closed stdout).
    written: AtomicU64,
    /// When (`CLOCK_MONOTONIC` ns) the writer took its latest line.
    taken_at: AtomicU64,
    /// When a line was queued with none waiting before it.
    pending_since: AtomicU64,
    /// `written` when the writer was found on one line for longer than
    /// the deadline ([`NOT_STUCK`] when it was not): stuck until `written`
    /// moves past it. Starts do not wait meanwhile.
    stuck_at: AtomicU64,
    /// How long one line may take before the writer counts as stuck.
    deadline: Duration,
    /// Container id -> its `added` line's number, until its start asks.
    added: Mutex<HashMap<String, u64>>,
    /// Starts waiting for a line number, woken (each once) when the
    /// writer is done with it.
    waiters: Mutex<BTreeMap<u64, Vec<oneshot::Sender<()>>>>,
}

impl Progress {
    fn new(deadline: Duration) -> Progress {
        Progress {
            queued: AtomicU64::new(0),
            written: AtomicU64::new(0),
            taken_at: AtomicU64::new(0),
            pending_since: AtomicU64::new(0),
            stuck_at: AtomicU64::new(NOT_STUCK),
            deadline,
            added: Mutex::new(HashMap::new()),
            waiters: Mutex::new(BTreeMap::new()),
        }
    }

    /// Notes that container `id`'s `added` event is line `line`.
    fn remember_added(&self, id: String, line: u64) {
        let Ok(mut added) = self.added.lock() else {
            return;
        };
        if added.len() >= MAX_REMEMBERED_ADDED {
            let written = self.written.load(Ordering::Acquire);
            added.retain(|_, l| *l > written);
        }
        added.insert(id, line);
    }

    /// The writer is done with one more line: wake the starts waiting for
    /// it.
    fn line_done(&self) {
        let written = self.written.fetch_add(1, Ordering::AcqRel) + 1;
        let Ok(mut waiters) = self.waiters.lock() else {
            return;
        };
        // Lines are numbered from 1; those up to `written` are done.
        let later = waiters.split_off(&(written + 1));
        for tx in std::mem::replace(&mut *waiters, later)
            .into_values()
            .flatten()
        {
            let _ = tx.send(());
        }
    }

    /// Whether the writer is on one line for longer than the deadline now
    /// (`now` in `CLOCK_MONOTONIC` ns); if so, and it was not already
    /// known, marks it stuck and returns true (say so once per stall).
    fn check_stuck(&self, now: u64) -> bool {
        let written = self.written.load(Ordering::Acquire);
        if written >= self.queued.load(Ordering::Acquire) {
            return false;
        }
        let since = self
            .taken_at
            .load(Ordering::Acquire)
            .max(self.pending_since.load(Ordering::Acquire));
        if now.saturating_sub(since) <= self.deadline.as_nanos() as u64 {
            return false;
        }
        self.stuck_at.swap(written, Ordering::AcqRel) != written
    }

    /// Whether the writer is still on the line it was found stuck on.
    fn stuck(&self) -> bool {
        let at = self.stuck_at.load(Ordering::Acquire);
        at != NOT_STUCK && self.written.load(Ordering::Acquire) <= at
    }
}

/// Says that stdout is not being read.
fn warn_stuck(id: &str) {
    tracing::warn!(
        id,
        "stdout is not being read: events stay queued, and starts do not wait for their line"
    );
}

impl StdoutSink {
    /// Starts the writer thread; returns the sink and the barrier that
    /// holds a start until its `added` line is written (at most
    /// `deadline`).
    pub(crate) fn new(
        output: Output,
        deadline: Duration,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> anyhow::Result<(StdoutSink, StdoutBarrier)> {
        Self::with_writer(output, deadline, metrics, std::io::stdout(), STDOUT_QUEUE)
    }

    /// [`StdoutSink::new`] writing to `out`, with at most `bound` events
    /// waiting.
    fn with_writer(
        output: Output,
        deadline: Duration,
        metrics: Arc<crate::metrics::Metrics>,
        mut out: impl Write + Send + 'static,
        bound: u64,
    ) -> anyhow::Result<(StdoutSink, StdoutBarrier)> {
        let (queue, rx) = std::sync::mpsc::channel::<ContainerEvent>();
        let progress = Arc::new(Progress::new(deadline));
        let writer = Arc::clone(&progress);
        std::thread::Builder::new()
            .name("lookout-stdout".into())
            .spawn(move || {
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
                    if out.write_all(&line).and_then(|()| out.flush()).is_err() {
                        // N.B. a closed stdout must not stop discovery.
                        tracing::debug!("stdout closed; event dropped");
                    }
                    writer.line_done();
                }
            })
            .context("starting the stdout writer thread")?;
        let barrier = StdoutBarrier {
            progress: Arc::clone(&progress),
            metrics: Arc::clone(&metrics),
        };
        Ok((
            StdoutSink {
                output,
                metrics,
                progress,
                queue,
                bound,
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
        // A writer on one line for the deadline is stuck even when no
        // start waits for it (`run` has none): say so.
        let now = lookout_model::monotonic_ns();
        if p.written.load(Ordering::Acquire) >= p.queued.load(Ordering::Acquire) {
            p.pending_since.store(now, Ordering::Release);
        } else if p.check_stuck(now) {
            warn_stuck(&event.container.id);
        }
        // N.B. one emitter at a time (`&mut self`): the line's number is
        // the count after it.
        let line = p.queued.load(Ordering::Acquire) + 1;
        let added = (event.event == EventKind::Added).then(|| event.container.id.clone());
        // N.B. `written` only grows, and no line is queued but here.
        let waiting = (line - 1).saturating_sub(p.written.load(Ordering::Acquire));
        let sent = if waiting >= self.bound {
            Err(("the stdout queue is full", event))
        } else {
            self.queue
                .send(event)
                .map_err(|e| ("the stdout writer is gone", e.0))
        };
        match sent {
            Ok(()) => {
                p.queued.store(line, Ordering::Release);
                if let Some(id) = added {
                    p.remember_added(id, line);
                }
            }
            Err((why, event)) => {
                self.dropped += 1;
                self.metrics.stdout_dropped();
                tracing::error!(
                    dropped = self.dropped,
                    id = event.container.id,
                    "{why}: event dropped"
                );
            }
        }
    }
}

/// Holds a container's `start` until stdout's reader has its `added` line
/// (and so every line before it), for at most the deadline (or the
/// caller's, NRI's, if sooner); not at all while the writer is stuck.
pub(crate) struct StdoutBarrier {
    progress: Arc<Progress>,
    metrics: Arc<crate::metrics::Metrics>,
}

impl StdoutBarrier {
    fn wait_for(&self, id: &str, cap: Duration) -> Option<StartWait> {
        // No line of its own (not an `added` this agent wrote, or one
        // forgotten): nothing to wait for.
        let target = self.progress.added.lock().ok()?.remove(id)?;
        let rx = {
            // N.B. `written` is read under the waiters' lock, which the
            // writer takes after it counts a line: no wake-up is lost.
            let mut waiters = self.progress.waiters.lock().ok()?;
            if self.progress.written.load(Ordering::Acquire) >= target {
                return None;
            }
            if self.progress.stuck() {
                // The line will be late: the start does not wait for it.
                self.metrics.stdout_late();
                return None;
            }
            let (tx, rx) = oneshot::channel();
            waiters.entry(target).or_default().push(tx);
            rx
        };
        let (progress, metrics, id) = (
            Arc::clone(&self.progress),
            Arc::clone(&self.metrics),
            id.to_owned(),
        );
        Some(Box::pin(async move {
            if tokio::time::timeout(cap, rx).await.is_err() {
                metrics.stdout_late();
                // Behind is not stuck: only a writer on one line for the
                // deadline stops the starts after this from waiting.
                if progress.check_stuck(lookout_model::monotonic_ns()) {
                    warn_stuck(&id);
                } else {
                    tracing::debug!(id, "stdout is behind: the start went on before its line");
                }
            }
            StartDecision::Proceed
        }))
    }
}

impl StartBarrier for StdoutBarrier {
    fn wait(&self, id: &str) -> Option<StartWait> {
        self.wait_for(id, self.progress.deadline)
    }

    fn wait_until(&self, id: &str, until: Instant) -> Option<StartWait> {
        let left = until.saturating_duration_since(Instant::now());
        self.wait_for(id, self.progress.deadline.min(left))
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

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_millis(100);

    /// A barrier on a writer nobody runs: the tests move it by hand.
    fn barrier() -> (Arc<Progress>, StdoutBarrier) {
        barrier_with(DEADLINE)
    }

    fn barrier_with(deadline: Duration) -> (Arc<Progress>, StdoutBarrier) {
        let progress = Arc::new(Progress::new(deadline));
        let b = StdoutBarrier {
            progress: Arc::clone(&progress),
            metrics: Arc::new(crate::metrics::Metrics::new()),
        };
        (progress, b)
    }

    /// A stdout whose reader takes nothing until `go` is sent (or
    /// dropped), then everything.
    struct HeldReader {
        go: std::sync::mpsc::Receiver<()>,
        held: bool,
        lines: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for HeldReader {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.held {
                let _ = self.go.recv();
                self.held = false;
            }
            self.lines.lock().expect("lines").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Waits (10 s at most) until the writer is done with `n` lines.
    /// (Not lookout-testsupport's `wait_until`: this file is packaged.)
    fn written(sink: &StdoutSink, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while sink.progress.written.load(Ordering::Acquire) < n {
            assert!(Instant::now() < deadline, "{n} lines not written in 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(sink.progress.written.load(Ordering::Acquire), n);
    }

    #[test]
    fn a_reader_that_takes_nothing_costs_events_past_the_bound_not_memory() {
        let (go, held) = std::sync::mpsc::channel();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = HeldReader {
            go: held,
            held: true,
            lines: Arc::clone(&lines),
        };
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let (mut sink, _barrier) = StdoutSink::with_writer(Output::Json, DEADLINE, metrics, out, 3)
            .expect("writer thread");
        let container = Arc::new(lookout_model::Container::new(
            "c",
            lookout_model::RuntimeKind::Runc,
        ));
        for _ in 0..5 {
            sink.emit(ContainerEvent::added(
                lookout_model::Source::RuntimeHook,
                Arc::clone(&container),
            ));
        }
        assert_eq!(sink.dropped, 2, "three wait (one of them being written)");
        drop(go);
        written(&sink, 3);
        // Room again once the reader takes them.
        sink.emit(ContainerEvent::removed(
            lookout_model::Source::RuntimeHook,
            Arc::clone(&container),
            None,
        ));
        assert_eq!(sink.dropped, 2);
        written(&sink, 4);
        let text = String::from_utf8(lines.lock().expect("lines").clone()).expect("JSON lines");
        let kinds: Vec<&str> = text
            .lines()
            .map(|l| {
                if l.contains("\"removed\"") {
                    "removed"
                } else {
                    "added"
                }
            })
            .collect();
        assert_eq!(kinds, ["added", "added", "added", "removed"], "{text}");
    }

    /// Queues `n` lines, the `added` of `id` last, as the sink does.
    fn queue(p: &Progress, n: u64, id: &str) {
        let line = p.queued.load(Ordering::Acquire) + n;
        p.queued.store(line, Ordering::Release);
        p.remember_added(id.to_owned(), line);
        p.taken_at
            .store(lookout_model::monotonic_ns(), Ordering::Release);
    }

    #[tokio::test]
    async fn a_start_waits_for_its_own_line_and_not_for_the_lines_after_it() {
        let (p, b) = barrier();
        queue(&p, 2, "a");
        queue(&p, 3, "b");
        let mut wait = b.wait("a").expect("line 2 is not written yet");
        p.line_done();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(
            wait.as_mut().poll(&mut cx).is_pending(),
            "line 1 is not a's line"
        );
        p.line_done();
        // Lines 3-5 (b's) are still queued: a's start goes on.
        let decided = tokio::time::timeout(DEADLINE / 2, wait).await;
        assert_eq!(decided, Ok(StartDecision::Proceed));
        assert!(b.wait("a").is_none(), "asked once: a's line is forgotten");
        assert!(b.wait("unknown").is_none(), "no line of its own: no wait");
        for _ in 0..3 {
            p.line_done();
        }
        assert!(b.wait("b").is_none(), "already written");
    }

    #[tokio::test]
    async fn a_writer_stuck_on_one_line_holds_one_start_and_then_none() {
        let (p, b) = barrier();
        queue(&p, 1, "a");
        // On line 1 for longer than the deadline already.
        let long_ago = lookout_model::monotonic_ns() - 2 * DEADLINE.as_nanos() as u64;
        p.taken_at.store(long_ago, Ordering::Release);
        p.pending_since.store(long_ago, Ordering::Release);
        let t = Instant::now();
        let wait = b.wait("a").expect("line 1 is not written");
        assert_eq!(wait.await, StartDecision::Proceed);
        assert!(t.elapsed() >= DEADLINE, "waited its deadline");
        assert!(p.stuck(), "one line for the deadline: stuck");
        queue(&p, 1, "b");
        assert!(b.wait("b").is_none(), "a stuck writer holds no more starts");
        assert!(
            !p.check_stuck(lookout_model::monotonic_ns()),
            "said once per stall"
        );
        // It moves again: starts wait again.
        p.line_done();
        assert!(!p.stuck());
        queue(&p, 1, "c");
        assert!(b.wait("c").is_some());
    }

    #[tokio::test]
    async fn a_writer_behind_but_writing_is_not_stuck() {
        // A deadline a stalled test thread does not reach (this test fails
        // if the writer thread below is not scheduled for that long).
        let deadline = Duration::from_secs(1);
        let (p, b) = barrier_with(deadline);
        queue(&p, 50, "a");
        let wait = b.wait("a").expect("line 50 is not written");
        // The writer takes a line every 50 ms, never one for the deadline,
        // and is not done with line 50 before it (49 lines: 2.45 s).
        let writer = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                for _ in 0..49 {
                    p.taken_at
                        .store(lookout_model::monotonic_ns(), Ordering::Release);
                    std::thread::sleep(deadline / 20);
                    p.line_done();
                }
            })
        };
        assert_eq!(wait.await, StartDecision::Proceed);
        writer.join().expect("writer");
        assert!(!p.stuck(), "behind is not stuck");
        queue(&p, 1, "b");
        assert!(
            b.wait("b").is_some(),
            "the next start still waits for its line"
        );
    }

    #[test]
    fn lines_of_starts_that_never_come_are_forgotten_once_written() {
        let (p, _) = barrier();
        for i in 0..MAX_REMEMBERED_ADDED {
            queue(&p, 1, &format!("run-{i}"));
            p.line_done();
        }
        queue(&p, 1, "last");
        let added = p.added.lock().expect("lock");
        assert_eq!(added.len(), 1, "only the unwritten one is kept");
        assert!(added.contains_key("last"));
    }
}
