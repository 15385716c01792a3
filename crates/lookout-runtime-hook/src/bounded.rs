//! Blocking reads with a deadline, for files that may sit on a hung file
//! system: [`bounded`] and [`bounded_async`] run a read on a helper thread
//! and wait for it at most a deadline. Used for every file read on a path a
//! runtime exec waits for: config.json, state files, pid files.
//!
//! What [`crate::untrusted`] cannot prevent alone is a file system that
//! hangs (a dead NFS server, a stopped FUSE daemon): `open` or `read` then
//! blocks in the kernel, where no signal or timeout reaches it. The helper
//! thread stays blocked until the file system answers; the caller goes on
//! at the deadline, without what it read.

/// Reader threads that are stuck on a hung file system at most; past this,
/// no other one starts (and [`read_config_within`](crate::oci::read_config_within)
/// reads no config).
pub const MAX_STUCK_READERS: usize = 8;

static STUCK_READERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One read on a helper thread, and whether its waiter gave up on it.
///
/// Only reads that outlived their deadline count against
/// [`MAX_STUCK_READERS`]: many reads in flight at once (a burst of
/// containers) are normal; many reads that never come back are a hung file
/// system, and starting more threads for it would only pile them up.
struct Reader {
    /// 0: running, 1: done, 2: abandoned by its waiter (counted as stuck).
    state: std::sync::Arc<std::sync::atomic::AtomicU8>,
}

const RUNNING: u8 = 0;
const DONE: u8 = 1;
const ABANDONED: u8 = 2;

impl Reader {
    /// Starts `f` on a helper thread that hands its result to `send`, or
    /// says why not.
    fn start<T: Send + 'static>(
        f: impl FnOnce() -> T + Send + 'static,
        send: impl FnOnce(T) + Send + 'static,
    ) -> Result<Reader, &'static str> {
        use std::sync::atomic::Ordering;
        if STUCK_READERS.load(Ordering::Acquire) >= MAX_STUCK_READERS {
            return Err("skipped: earlier reads are still hung on their file systems");
        }
        let state = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(RUNNING));
        let thread_state = std::sync::Arc::clone(&state);
        let job: Job = Box::new(move || {
            // A read that panics is done too: it must not count as stuck
            // for ever, and its reader stays usable. Its waiter hears that
            // no answer comes (`send` is dropped unused).
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            if thread_state.swap(DONE, Ordering::AcqRel) == ABANDONED {
                STUCK_READERS.fetch_sub(1, Ordering::AcqRel);
            }
            if let Ok(out) = out {
                send(out);
            }
        });
        pool::run(job).map_err(|_| "cannot start a reader thread")?;
        Ok(Reader { state })
    }

    /// The waiter gives up: a read still running now counts as stuck until
    /// it ends.
    fn abandon(&self) {
        use std::sync::atomic::Ordering;
        if self
            .state
            .compare_exchange(RUNNING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            STUCK_READERS.fetch_add(1, Ordering::AcqRel);
        }
    }
}

pub(crate) use pool::set_slice as set_reader_slice;

/// A read, with the hand-over of its result.
type Job = Box<dyn FnOnce() + Send>;

/// Reader threads kept for the next read. A read goes to an idle reader,
/// or to a new thread when none is idle, so a reader blocked on a hung file
/// system holds up only its own read, as one thread per read would; what
/// the pool saves is a thread start and exit per read (a clone, a stack
/// mapped and unmapped, and the wakeups), three times per container.
mod pool {
    use std::sync::Mutex;
    use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
    use std::time::Duration;

    use super::Job;

    /// How long an idle reader waits for a read before it ends.
    const KEEP_ALIVE: Duration = Duration::from_secs(10);

    /// Idle readers kept at most; a burst's extra ones end after their read.
    const MAX_IDLE: usize = 16;

    /// The scheduler slice new readers ask for, in nanoseconds (0: none;
    /// see [`crate::Builder::scheduler_slice`]).
    static SLICE_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    /// Sets the slice readers started from now on ask for.
    pub(crate) fn set_slice(slice: Option<Duration>) {
        let ns = slice.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        SLICE_NS.store(ns, std::sync::atomic::Ordering::Relaxed);
    }

    /// An idle reader: its number and where it takes its next read.
    struct Idle {
        id: u64,
        jobs: SyncSender<Job>,
    }

    static IDLE: Mutex<Vec<Idle>> = Mutex::new(Vec::new());
    static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    /// Readers idle now.
    #[cfg(test)]
    pub(super) fn idle() -> usize {
        IDLE.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Runs `job` on an idle reader, or on a new one.
    pub(super) fn run(mut job: Job) -> std::io::Result<()> {
        loop {
            let idle = IDLE.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some(idle) = idle else { break };
            // N.B. A reader taken off the list is committed to take its
            // read (see `wait`); a send fails only if it is gone.
            match idle.jobs.send(job) {
                Ok(()) => return Ok(()),
                Err(back) => job = back.0,
            }
        }
        let (tx, rx) = sync_channel(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::Builder::new()
            .name("lookout-config".into())
            .spawn(move || {
                match SLICE_NS.load(std::sync::atomic::Ordering::Relaxed) {
                    0 => {}
                    ns => crate::ask_for_slice("reader", Duration::from_nanos(ns)),
                }
                let mut job = job;
                loop {
                    job();
                    match wait(id, &tx, &rx) {
                        Some(next) => job = next,
                        None => return,
                    }
                }
            })
            .map(drop)
    }

    /// After a read: waits, on the idle list, for the next one; `None` when
    /// none came within [`KEEP_ALIVE`] (or the list is full).
    fn wait(id: u64, tx: &SyncSender<Job>, rx: &Receiver<Job>) -> Option<Job> {
        {
            let mut idle = IDLE.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() >= MAX_IDLE {
                return None;
            }
            idle.push(Idle {
                id,
                jobs: tx.clone(),
            });
        }
        if let Ok(job) = rx.recv_timeout(KEEP_ALIVE) {
            return Some(job);
        }
        let mut idle = IDLE.lock().unwrap_or_else(|e| e.into_inner());
        match idle.iter().position(|i| i.id == id) {
            Some(at) => {
                idle.swap_remove(at);
                None
            }
            // Taken off the list by `run` meanwhile: its read is on the way.
            None => {
                drop(idle);
                rx.recv().ok()
            }
        }
    }
}

const NO_ANSWER: &str = "the reader thread ended without an answer";

const TOO_LATE: &str = "not read within the deadline (a hung file system?)";

/// [`bounded`] for async callers: the task is not blocked while the helper
/// thread reads.
pub(crate) async fn bounded_async<T: Send + 'static>(
    deadline: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, &'static str> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let reader = Reader::start(f, move |out| {
        let _ = tx.send(out);
    })?;
    match tokio::time::timeout(deadline, rx).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(NO_ANSWER),
        Err(_) => {
            reader.abandon();
            Err(TOO_LATE)
        }
    }
}

/// Runs `f` on a helper thread and waits at most `deadline` for it. A read
/// that takes longer is abandoned (its thread ends whenever the file system
/// answers); while [`MAX_STUCK_READERS`] abandoned reads still run, no new
/// one starts.
pub(crate) fn bounded<T: Send + 'static>(
    deadline: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, &'static str> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let reader = Reader::start(f, move |out| {
        let _ = tx.send(out);
    })?;
    rx.recv_timeout(deadline).map_err(|e| match e {
        std::sync::mpsc::RecvTimeoutError::Timeout => {
            reader.abandon();
            TOO_LATE
        }
        std::sync::mpsc::RecvTimeoutError::Disconnected => NO_ANSWER,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Taken by every test that reads through [`bounded`] or depends on
    /// the process-wide count of stuck readers: while the hung-reader test
    /// holds every slot, any other bounded read is refused (`oci.rs`'s
    /// tests take it too).
    pub(crate) static STUCK_COUNT_USERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn many_reads_in_flight_at_once_are_not_refused() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        // A burst of containers: 20 reads at once, each slower than none
        // of the deadlines. Only reads that outlive their deadline count
        // against MAX_STUCK_READERS.
        use std::time::Duration;
        let threads: Vec<_> = (0..20)
            .map(|i| {
                std::thread::spawn(move || {
                    bounded(Duration::from_secs(5), move || {
                        std::thread::sleep(Duration::from_millis(50));
                        i
                    })
                })
            })
            .collect();
        for (i, t) in threads.into_iter().enumerate() {
            assert_eq!(t.join().expect("thread"), Ok(i));
        }
    }

    #[test]
    fn readers_are_kept_for_the_next_read_and_a_busy_one_is_not_waited_for() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        use std::time::Duration;
        let tid = || format!("{:?}", std::thread::current().id());
        // One read after another: a kept reader takes them. (A reader
        // goes idle just after it hands its result over, and other tests'
        // reads may take it: wait for one to be idle, and count threads.)
        let mut threads = std::collections::HashSet::new();
        for _ in 0..20 {
            let t = std::time::Instant::now();
            while pool::idle() == 0 && t.elapsed() < Duration::from_secs(2) {
                std::thread::yield_now();
            }
            threads.insert(bounded(Duration::from_secs(5), tid).expect("read"));
        }
        assert!(
            threads.len() <= 10,
            "{} threads for 20 reads",
            threads.len()
        );
        // A reader that is busy (a hung file system) is not handed the
        // next read: that one runs at once, on another thread.
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let busy = std::thread::spawn(move || {
            bounded(Duration::from_secs(5), move || {
                let _ = release_rx.recv();
                tid()
            })
        });
        for _ in 0..5 {
            let other = bounded(Duration::from_millis(500), tid);
            assert!(other.is_ok(), "a read waited for a busy reader: {other:?}");
        }
        drop(release_tx);
        let busy = busy.join().expect("thread");
        assert!(busy.is_ok());
    }

    #[test]
    fn a_read_that_panics_is_no_answer_and_never_counts_as_stuck() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        use std::sync::atomic::Ordering;
        use std::time::{Duration, Instant};
        let stuck = STUCK_READERS.load(Ordering::Acquire);
        for _ in 0..MAX_STUCK_READERS + 2 {
            let t = Instant::now();
            let out: Result<u8, _> = bounded(Duration::from_secs(5), || panic!("a reader's bug"));
            assert_eq!(out, Err(NO_ANSWER));
            assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        }
        // N.B. not `==`: reads another test abandoned may end meanwhile
        // and leave the count lower; none of these may raise it.
        let now = STUCK_READERS.load(Ordering::Acquire);
        assert!(now <= stuck, "{stuck} stuck before, {now} after");
        // Reads still run afterwards.
        assert_eq!(bounded(Duration::from_secs(5), || 3), Ok(3));
    }

    #[test]
    fn a_read_that_hangs_is_abandoned_at_the_deadline_and_hung_readers_are_capped() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        use std::sync::{Arc, Barrier};
        use std::time::{Duration, Instant};
        // Stand-ins for reads blocked on a hung file system: they wait
        // until the test releases them.
        let before = STUCK_READERS.load(std::sync::atomic::Ordering::Acquire);
        let release = Arc::new(Barrier::new(MAX_STUCK_READERS + 1));
        for _ in 0..MAX_STUCK_READERS {
            let r = Arc::clone(&release);
            let t = Instant::now();
            let out = bounded(Duration::from_millis(20), move || {
                r.wait();
            });
            assert!(out.is_err());
            assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        }
        // All slots are taken: the next read is refused without a thread.
        let out = bounded(Duration::from_secs(5), || 1);
        assert_eq!(
            out,
            Err("skipped: earlier reads are still hung on their file systems")
        );
        release.wait();
        // Once the file system answers, the slots come back.
        let t = Instant::now();
        loop {
            if let Ok(v) = bounded(Duration::from_secs(1), || 7) {
                assert_eq!(v, 7);
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(5), "slots never freed");
            std::thread::sleep(Duration::from_millis(5));
        }
        // Every released read has ended before the next test that counts
        // stuck readers runs (it found 3 still ending once, in CI).
        while STUCK_READERS.load(std::sync::atomic::Ordering::Acquire) > before {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "hung readers never ended"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
