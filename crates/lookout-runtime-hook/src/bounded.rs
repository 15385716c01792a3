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
                // A container's cgroup is read here, right after its
                // create's exit: read in the host's cgroup namespace from
                // this thread, not handed to the one thread there and back.
                if let Err(e) = lookout_host::proc::enter_host_cgroup_namespace() {
                    tracing::debug!(%e, "a reader stays in the agent's cgroup namespace");
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

/// Readers waiting for a process to exit before they read, at most (see
/// [`after_exit`]): past this, callers wait on their own task and hand the
/// read over after the exit, as for any read.
pub(crate) const MAX_EXIT_WAITERS: usize = 8;

static EXIT_WAITERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A place among the readers that wait for an exit ([`MAX_EXIT_WAITERS`]),
/// given back when dropped.
pub(crate) struct ExitPlace(());

impl Drop for ExitPlace {
    fn drop(&mut self) {
        EXIT_WAITERS.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A place for [`after_exit`], if one is free and no read is stuck past
/// the limit.
pub(crate) fn exit_place() -> Option<ExitPlace> {
    use std::sync::atomic::Ordering;
    if STUCK_READERS.load(Ordering::Acquire) >= MAX_STUCK_READERS {
        return None;
    }
    if EXIT_WAITERS.fetch_add(1, Ordering::AcqRel) >= MAX_EXIT_WAITERS {
        EXIT_WAITERS.fetch_sub(1, Ordering::AcqRel);
        return None;
    }
    Some(ExitPlace(()))
}

/// Runs `f` on a reader thread once the process behind `pidfd` has exited
/// (at once without one), and waits at most `deadline` *from that exit*
/// for it. Saves the hand-over of a read that must follow an exit: the
/// reader is woken by the exit itself, not by a task that was.
///
/// `place` ([`exit_place`]) is held while the reader waits for the exit:
/// a process that never exits holds it, and its reader, until it does.
/// `None` when no reader could start (then `f` is dropped unrun).
pub(crate) fn after_exit<T: Send + 'static>(
    place: ExitPlace,
    pidfd: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    deadline: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<impl std::future::Future<Output = Result<T, &'static str>> + Send + 'static> {
    use std::sync::atomic::Ordering;
    // When the exit came (CLOCK_MONOTONIC ns; 0: not yet).
    let exited = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = std::sync::Arc::clone(&exited);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let reader = Reader::start(
        move || {
            if let Some(fd) = &pidfd {
                wait_readable(fd);
            }
            seen.store(lookout_model::monotonic_ns().max(1), Ordering::Release);
            drop(place);
            f()
        },
        move |out| {
            let _ = tx.send(out);
        },
    )
    .ok()?;
    Some(async move {
        let mut rx = rx;
        // The deadline runs from the exit: until then the reader only
        // waits, and the process may take as long as it likes. Checked
        // once a deadline, without a wake-up per check before that.
        let mut wait = deadline;
        loop {
            match tokio::time::timeout(wait, &mut rx).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(_)) => return Err(NO_ANSWER),
                Err(_) => {
                    let at = exited.load(Ordering::Acquire);
                    if at == 0 {
                        wait = deadline;
                        continue;
                    }
                    let since = std::time::Duration::from_nanos(
                        lookout_model::monotonic_ns().saturating_sub(at),
                    );
                    match deadline.checked_sub(since) {
                        Some(left) if !left.is_zero() => wait = left,
                        _ => {
                            reader.abandon();
                            return Err(TOO_LATE);
                        }
                    }
                }
            }
        }
    })
}

/// Blocks until `fd` (a pidfd) is readable: its process exited. An error
/// other than `EINTR` counts as the exit (the caller reads, and finds out).
fn wait_readable(fd: &std::os::fd::OwnedFd) {
    use std::os::fd::AsFd;
    loop {
        let mut fds = [nix::poll::PollFd::new(
            fd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
            Err(nix::errno::Errno::EINTR) => continue,
            _ => return,
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

    /// A child that lives `secs`, and a pidfd for it.
    fn child(secs: &str) -> (std::process::Child, std::sync::Arc<std::os::fd::OwnedFd>) {
        let c = std::process::Command::new("sleep")
            .arg(secs)
            .spawn()
            .expect("sleep");
        let fd = crate::pidfd::pidfd_open(c.id()).expect("pidfd");
        (c, std::sync::Arc::new(fd))
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn a_read_after_an_exit_waits_for_it_and_its_deadline_runs_from_it() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        use std::time::{Duration, Instant};
        // The process outlives the deadline: the wait is not the read's.
        let (mut c, fd) = child("0.4");
        let t = Instant::now();
        let place = exit_place().expect("a place");
        let done =
            after_exit(place, Some(fd), Duration::from_millis(100), || 42).expect("a reader");
        assert_eq!(block_on(done), Ok(42));
        assert!(
            t.elapsed() >= Duration::from_millis(350),
            "{:?}",
            t.elapsed()
        );
        let _ = c.wait();
        // Without a pidfd (the process was gone): read at once.
        let place = exit_place().expect("a place");
        let done = after_exit(place, None, Duration::from_secs(5), || 7).expect("a reader");
        assert_eq!(block_on(done), Ok(7));
    }

    #[test]
    fn a_read_after_an_exit_that_hangs_is_abandoned_a_deadline_after_the_exit() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        use std::time::{Duration, Instant};
        let before = STUCK_READERS.load(std::sync::atomic::Ordering::Acquire);
        let (mut c, fd) = child("0.2");
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let t = Instant::now();
        let place = exit_place().expect("a place");
        let done = after_exit(place, Some(fd), Duration::from_millis(300), move || {
            let _ = hung.recv();
        })
        .expect("a reader");
        assert_eq!(block_on(done), Err(TOO_LATE));
        // The exit at 0.2 s, the deadline 0.3 s after it.
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(450), "{took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
        assert_eq!(
            STUCK_READERS.load(std::sync::atomic::Ordering::Acquire),
            before + 1
        );
        let _ = c.wait();
        drop(release);
        let t = Instant::now();
        while STUCK_READERS.load(std::sync::atomic::Ordering::Acquire) > before {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the reader never ended"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn readers_waiting_for_exits_are_capped() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        use std::time::Duration;
        let mut waiting = Vec::new();
        let mut children = Vec::new();
        for _ in 0..MAX_EXIT_WAITERS {
            let (c, fd) = child("30");
            let place = exit_place().expect("a place below the cap");
            let done = after_exit(place, Some(fd), Duration::from_secs(1), || 1).expect("reader");
            children.push(c);
            waiting.push(done);
        }
        // Every place is taken by a reader that waits; none is left.
        assert!(exit_place().is_none());
        // An exit gives its place back once its reader wakes.
        let mut first = children.remove(0);
        let _ = first.kill();
        let _ = first.wait();
        assert_eq!(block_on(waiting.remove(0)), Ok(1));
        assert!(exit_place().is_some());
        for mut c in children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for done in waiting {
            assert_eq!(block_on(done), Ok(1));
        }
        assert!(exit_place().is_some());
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
