//! Counters, statistics and health: what the hook tells metrics. A leaf
//! module: the answering thread (`answer`) and the hook's task (`hook`)
//! both use it, and it uses neither.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Sees what the hook does, for metrics. Called on the thread that answers
/// permission events: keep it cheap (atomics).
pub trait Observer: Send + Sync {
    /// A permission event was answered after `elapsed`.
    fn answered(&self, elapsed: Duration);
    /// Something went wrong and was skipped; `kind` is a short stable label
    /// (`argv`, `argv-unread`, `config`, `overflow`, `read`, `mark`).
    fn error(&self, kind: &'static str);
    /// A container was found only by reconciling the state directories
    /// after runtime execs whose argv could not be read (fanotify-only
    /// mode); it was reported late.
    fn recovered(&self) {}
    /// A runtime exec was allowed and not followed, for `reason`
    /// (`non-root`: its caller is not host root; `pid-namespace`: root in
    /// a pid namespace other than the node's, such as a container's).
    fn ignored(&self, reason: &'static str) {
        let _ = reason;
    }
    /// A runtime exec that should have made a container did not yield one
    /// lookout can report, for `reason` (`unreadable-state`: the runtime
    /// left state that cannot be read or parsed, in a layout this version
    /// may not know; `state-timeout`; `not-a-container-process`;
    /// `run-unobserved`: a `run` whose container ended before its state
    /// could be read). Logged at warn level too.
    fn missed(&self, runtime: &str, reason: &'static str) {
        let _ = (runtime, reason);
    }
    /// A runtime exec came without a BPF argv record (fanotify-only mode,
    /// a caller other than host root, or a runtime re-exec the hook did
    /// not recognise): it was allowed at once and followed through /proc.
    fn without_argv(&self) {}
    /// The permission thread waited (2 ms at most) for a host root exec's
    /// BPF argv record, which another CPU had not committed yet. Execs of
    /// other callers are never waited for: their record never comes.
    fn argv_wait(&self) {}
}

/// Counters, for metrics and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Permission events answered.
    pub answered: u64,
    /// Runtime execs without a BPF argv record (in fanotify-only mode,
    /// every runtime exec).
    pub missing_argv: u64,
    /// fanotify-only mode: runtime execs whose argv could not be read from
    /// /proc either (the process ended first, or an exec flood). Each one
    /// triggers a reconciliation from the state directories.
    pub unread_argv: u64,
    /// Containers that only reconciliation found (reported late, source
    /// `state-scan`): without it they would have been missed.
    pub recovered: u64,
    /// Runtime execs allowed and not followed because their caller is not
    /// host root (they cannot make a rootful container).
    pub ignored: u64,
    /// Errors (bad argv, config, state) that were logged and skipped.
    pub errors: u64,
    /// The slowest answer, in microseconds.
    pub slowest_answer_us: u64,
}

/// Nanoseconds since `base`, plus one (0 marks a free slot).
pub(crate) fn stamp(base: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(base).as_nanos() as u64 + 1
}

/// Permission events handed to the hook's task and not answered yet, in
/// fixed slots of atomics: the permission thread registers one without a
/// lock, whoever answers clears it, and `/healthz` reads the oldest.
pub(crate) struct Outstanding {
    pub(crate) base: Instant,
    slots: Box<[AtomicU64]>,
}

/// One registered event; clears its slot when dropped.
pub(crate) struct Slot {
    registry: Arc<Outstanding>,
    index: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.registry.slots[self.index].store(0, Ordering::Release);
    }
}

impl Outstanding {
    /// Slots: more events outstanding at once are not tracked (the
    /// oldest ones are, which is what health needs).
    const SLOTS: usize = 256;

    pub(crate) fn new(base: Instant) -> Outstanding {
        Outstanding {
            base,
            slots: (0..Self::SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(crate) fn enter(self: &Arc<Self>, since: Instant) -> Option<Slot> {
        let v = stamp(self.base, since);
        self.slots.iter().enumerate().find_map(|(index, s)| {
            s.compare_exchange(0, v, Ordering::AcqRel, Ordering::Relaxed)
                .ok()
                .map(|_| Slot {
                    registry: Arc::clone(self),
                    index,
                })
        })
    }

    fn oldest(&self) -> Option<Duration> {
        let min = self
            .slots
            .iter()
            .map(|s| s.load(Ordering::Acquire))
            .filter(|&v| v != 0)
            .min()?;
        let now = stamp(self.base, Instant::now());
        Some(Duration::from_nanos(now.saturating_sub(min)))
    }
}

/// What `/healthz` needs to know about the runtime hook, readable from any
/// thread; the permission thread itself only stores to atomics for it.
/// Get one with [`RuntimeHook::health`](crate::RuntimeHook::health).
#[derive(Clone)]
pub struct Health {
    counters: Arc<Counters>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("oldest_unanswered", &self.oldest_unanswered())
            .field("permission_thread_busy", &self.permission_thread_busy())
            .field("probe_waiting", &self.probe_waiting())
            .finish()
    }
}

impl Health {
    /// How long the oldest permission event handed to the hook's task
    /// (`create`, `run`, `start`) has waited for its answer; `None` when
    /// none waits. A `start` held for prestart hooks waits up to the
    /// start barrier's cap by design.
    pub fn oldest_unanswered(&self) -> Option<Duration> {
        self.counters.outstanding.oldest()
    }

    /// BPF argv records that wait for their exec's permission event, as
    /// the permission thread last left them (0 without BPF). A few at a
    /// time are normal; a count that stays in the hundreds means execs of
    /// a watched name by host root that never reach a marked binary (a
    /// copy of the runtime elsewhere), swept after 30 s and bounded at
    /// 4096.
    pub fn argv_records_waiting(&self) -> u64 {
        self.counters.argv_waiting.load(Ordering::Relaxed)
    }

    /// How long the permission thread has been handling its current batch
    /// of events; `None` while it waits for events. It answers most events
    /// in microseconds: a large value means it is stuck.
    pub fn permission_thread_busy(&self) -> Option<Duration> {
        let since = self.counters.busy_since.load(Ordering::Acquire);
        if since == 0 {
            return None;
        }
        let now = stamp(self.counters.outstanding.base, Instant::now());
        Some(Duration::from_nanos(now.saturating_sub(since)))
    }

    /// How long the permission thread has left a probe of its queue
    /// unread; `None` when no probe waits. Each call without one waiting
    /// sends one (at most one a second, whoever calls): an event queued in
    /// the thread's fanotify group behind every runtime exec already
    /// there, which the thread marks as read when it reads it. A probe
    /// that waits is written again (at most once a second): the kernel
    /// can drop its event (no fd left to open the file for it), and one
    /// lost must not fail health for good; the copy merges with the event
    /// when that still waits. Takes a lock shared with the thread's start
    /// and stop only, and makes one `write(2)` to a memfd.
    ///
    /// This sees what [`permission_thread_busy`](Self::permission_thread_busy)
    /// cannot: the thread blocks in `read(2)` while it waits for events,
    /// and the kernel opens each event's file inside that same `read`, so
    /// a read stuck in that open (a runtime binary on a stalled network or
    /// FUSE file system) looks like an idle thread. It is seen once a probe
    /// sent after the read stuck has waited long enough: a caller that asks
    /// every P seconds, with a bound of B, sees it within about P + B.
    /// Always `None` where the thread polls its group instead (it then
    /// counts itself busy from the moment poll says events wait, before its
    /// read) or no thread runs.
    pub fn reads_stalled(&self) -> Option<Duration> {
        let probe = &self.counters.probe;
        let now = stamp(self.counters.outstanding.base, Instant::now());
        let waited = self.probe_waiting_at(now);
        probe.send(now);
        waited
    }

    fn probe_waiting(&self) -> Option<Duration> {
        self.probe_waiting_at(stamp(self.counters.outstanding.base, Instant::now()))
    }

    fn probe_waiting_at(&self, now: u64) -> Option<Duration> {
        match self.counters.probe.sent.load(Ordering::Acquire) {
            0 => None,
            sent => Some(Duration::from_nanos(now.saturating_sub(sent))),
        }
    }
}

/// The probe of the permission thread's reads (see
/// [`Health::reads_stalled`]).
#[derive(Default)]
pub(crate) struct Probe {
    /// When the probe that waits was sent (a [`stamp`]); 0: none waits.
    sent: AtomicU64,
    /// When a probe was last written, to write at most one a second
    /// whoever asks `/healthz` how often.
    last: AtomicU64,
    /// The answering thread's wake-up file: a write to it queues an event
    /// in its group. `None` while no thread blocks in `read`. Locked only
    /// by health checks and the thread's start and stop, never by the
    /// thread.
    file: Mutex<Option<Arc<File>>>,
}

impl Probe {
    /// At most one write a second: each one wakes the permission thread.
    const INTERVAL_NS: u64 = 1_000_000_000;

    /// Probes through `file` from now on (`None`: no more).
    pub(crate) fn set_file(&self, file: Option<Arc<File>>) {
        *self.file.lock().unwrap_or_else(PoisonError::into_inner) = file;
        self.sent.store(0, Ordering::Release);
    }

    /// Writes a probe at `now` unless one was written within the last
    /// second: a new one if none waits, the one that waits again if not.
    fn send(&self, now: u64) {
        let last = self.last.load(Ordering::Acquire);
        if last != 0 && now.saturating_sub(last) < Self::INTERVAL_NS {
            return;
        }
        // One writer a second, however many ask at once.
        if self
            .last
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let written = {
            let file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(file) = file.as_ref() else {
                return;
            };
            // Stamped before the write: the thread may read the event
            // before this call goes on. A probe already waiting keeps its
            // stamp (it is the one late).
            let new = self
                .sent
                .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            let written = file.write_all_at(b"p", 0);
            if written.is_err() && new {
                // Not sent: not waited for either.
                let _ = self
                    .sent
                    .compare_exchange(now, 0, Ordering::AcqRel, Ordering::Acquire);
            }
            written
        };
        if let Err(e) = written {
            tracing::warn!(%e, "cannot probe the permission thread's reads");
        }
    }

    /// The permission thread read a probe (or an overflow, which may have
    /// taken its place): its reads go on.
    pub(crate) fn read(&self) {
        self.sent.store(0, Ordering::Release);
    }
}

/// The hook's counters and health marks, shared by the permission thread
/// and the hook's task (atomics: no lock on the permission path).
pub(crate) struct Counters {
    pub observer: Option<Arc<dyn Observer>>,
    pub deadline: Duration,
    answered: AtomicU64,
    pub(crate) missing_argv: AtomicU64,
    unread_argv: AtomicU64,
    recovered: AtomicU64,
    ignored: AtomicU64,
    /// See [`Health`].
    pub(crate) outstanding: Arc<Outstanding>,
    /// Execs without argv not handed to the task (its queue was full).
    pub unseen_dropped: AtomicU64,
    /// When the permission thread started its current batch (a
    /// [`stamp`]); 0 while it waits for events.
    pub(crate) busy_since: AtomicU64,
    /// BPF argv records waiting for their exec's permission event, as the
    /// permission thread last left them.
    pub(crate) argv_waiting: AtomicU64,
    /// See [`Health::reads_stalled`].
    pub(crate) probe: Probe,
    errors: AtomicU64,
    slowest_us: AtomicU64,
}

impl Counters {
    pub fn new(observer: Option<Arc<dyn Observer>>, deadline: Duration) -> Counters {
        Counters {
            observer,
            deadline,
            answered: AtomicU64::new(0),
            missing_argv: AtomicU64::new(0),
            unread_argv: AtomicU64::new(0),
            recovered: AtomicU64::new(0),
            ignored: AtomicU64::new(0),
            outstanding: Arc::new(Outstanding::new(Instant::now())),
            busy_since: AtomicU64::new(0),
            argv_waiting: AtomicU64::new(0),
            probe: Probe::default(),
            unseen_dropped: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            slowest_us: AtomicU64::new(0),
        }
    }

    /// Records an exec answered `waited` after it was read.
    pub fn answered_after(&self, waited: Duration) {
        self.record(waited);
    }

    /// Records an exec that was answered `since.elapsed()` after it was read.
    pub fn answered(&self, since: Instant) {
        self.record(since.elapsed());
    }

    fn record(&self, elapsed: Duration) {
        self.answered.fetch_add(1, Ordering::Relaxed);
        self.slowest_us
            .fetch_max(elapsed.as_micros() as u64, Ordering::Relaxed);
        if let Some(o) = &self.observer {
            o.answered(elapsed);
        }
        if elapsed > self.deadline {
            tracing::warn!(
                ?elapsed,
                "a runtime exec waited on lookout longer than the deadline"
            );
        }
    }

    /// Counts a runtime exec whose argv could not be read from /proc
    /// (see [`Stats::unread_argv`]).
    pub fn count_unread_argv(&self) {
        self.unread_argv.fetch_add(1, Ordering::Relaxed);
        self.error("argv-unread");
    }

    /// Counts a container a runtime made and lookout could not report.
    pub fn missed(&self, runtime: &lookout_model::RuntimeKind, reason: &'static str) {
        if let Some(o) = &self.observer {
            o.missed(runtime.as_str(), reason);
        }
    }

    /// Counts a runtime exec that is not followed, for `reason`.
    pub fn ignored(&self, reason: &'static str) {
        self.ignored.fetch_add(1, Ordering::Relaxed);
        if let Some(o) = &self.observer {
            o.ignored(reason);
        }
    }

    /// Counts a container found by reconciliation.
    pub fn count_recovered(&self) {
        self.recovered.fetch_add(1, Ordering::Relaxed);
        if let Some(o) = &self.observer {
            o.recovered();
        }
    }

    /// Counts a skipped error of `kind` (a short stable label).
    pub fn error(&self, kind: &'static str) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if let Some(o) = &self.observer {
            o.error(kind);
        }
    }

    pub fn stats(&self) -> Stats {
        Stats {
            answered: self.answered.load(Ordering::Relaxed),
            missing_argv: self.missing_argv.load(Ordering::Relaxed),
            unread_argv: self.unread_argv.load(Ordering::Relaxed),
            recovered: self.recovered.load(Ordering::Relaxed),
            ignored: self.ignored.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            slowest_answer_us: self.slowest_us.load(Ordering::Relaxed),
        }
    }

    /// The permission thread starts handling a batch of events.
    pub fn begin_batch(&self) {
        self.busy_since.store(
            stamp(self.outstanding.base, Instant::now()),
            Ordering::Release,
        );
    }

    /// The permission thread is done with its batch and waits again.
    pub fn end_batch(&self) {
        self.busy_since.store(0, Ordering::Release);
    }

    /// A handle for health checks.
    pub fn health(self: &Arc<Self>) -> Health {
        Health {
            counters: Arc::clone(self),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe_on(file: File) -> Probe {
        let probe = Probe::default();
        probe.set_file(Some(Arc::new(file)));
        probe
    }

    fn state(p: &Probe) -> (u64, u64) {
        (
            p.sent.load(Ordering::Relaxed),
            p.last.load(Ordering::Relaxed),
        )
    }

    #[test]
    fn a_probe_is_written_once_a_second_and_a_waiting_one_keeps_its_stamp() {
        let probe = probe_on(tempfile::tempfile().expect("tempfile"));
        let s = Probe::INTERVAL_NS;
        probe.send(1);
        assert_eq!(state(&probe), (1, 1), "the first probe");
        probe.send(1 + s / 2);
        assert_eq!(state(&probe), (1, 1), "no second write within the second");
        // Not read yet: written again (its event may have been lost), and
        // still as late as the first write.
        probe.send(1 + s + 1);
        assert_eq!(
            state(&probe),
            (1, 1 + s + 1),
            "written again, first stamp kept"
        );
        probe.read();
        probe.send(1 + s + 2);
        assert_eq!(
            state(&probe),
            (0, 1 + s + 1),
            "none within the second after a read"
        );
        probe.send(2 + 2 * s);
        assert_eq!(state(&probe), (2 + 2 * s, 2 + 2 * s), "the next probe");
        probe.set_file(None);
        probe.send(3 + 4 * s);
        assert_eq!(probe.sent.load(Ordering::Relaxed), 0, "no thread, no probe");
    }

    #[test]
    fn a_probe_that_cannot_be_written_is_not_waited_for() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("wake");
        std::fs::write(&path, b"x").expect("write");
        // Read-only: every write fails.
        let probe = probe_on(File::open(&path).expect("open"));
        probe.send(1);
        assert_eq!(
            state(&probe),
            (0, 1),
            "a failed write leaves no probe waiting"
        );
    }
}
