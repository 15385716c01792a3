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
        std::thread::Builder::new()
            .name("lookout-config".into())
            .spawn(move || {
                let out = f();
                if thread_state.swap(DONE, Ordering::AcqRel) == ABANDONED {
                    STUCK_READERS.fetch_sub(1, Ordering::AcqRel);
                }
                send(out);
            })
            .map_err(|_| "cannot start a reader thread")?;
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
        Ok(Err(_)) => Err("the reader thread ended without an answer"),
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
    rx.recv_timeout(deadline).map_err(|_| {
        reader.abandon();
        TOO_LATE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two tests below share the process-wide count of stuck readers.
    static STUCK_COUNT_USERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
    fn a_read_that_hangs_is_abandoned_at_the_deadline_and_hung_readers_are_capped() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        use std::sync::{Arc, Barrier};
        use std::time::{Duration, Instant};
        // Stand-ins for reads blocked on a hung file system: they wait
        // until the test releases them.
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
    }
}
