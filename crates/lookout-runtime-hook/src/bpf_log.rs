//! The BPF programs' diagnostics (aya-log records) in the agent's log, as
//! `tracing` events of target [`TARGET`].
//!
//! The programs log only what user space cannot see for itself (a runtime
//! exec whose argv record did not fit in the ring, an exit code the map
//! had no room for) and, at `trace`, each runtime exec recorded. Which
//! levels they write is fixed at load from the agent's filter for
//! [`TARGET`] (`AYA_LOG_LEVEL`): a disabled level costs a program one load
//! and a compare, and nothing reaches user space. What arrives is rate
//! limited ([`MAX_PER_SECOND`], a burst of [`BURST`]); what is cut is
//! counted in the next record that goes through.

use std::sync::Mutex;
use std::time::Instant;

/// The `tracing` target of the programs' records (`LOOKOUT_LOG=lookout_ebpf=trace`).
pub const TARGET: &str = "lookout_ebpf";
/// The name of aya-log's ring buffer in the object.
pub const RING: &str = "AYA_LOGS";
/// Its size once loaded (aya-log declares 128 KiB): a record is tens to
/// hundreds of bytes, the programs write only rare ones, and user space
/// drains the ring as soon as it is woken.
pub const RING_BYTES: u32 = 16 * 1024;

/// Records forwarded per second at most, after a burst.
pub const MAX_PER_SECOND: f64 = 10.0;
/// Records forwarded back to back at most.
pub const BURST: f64 = 50.0;

/// The value of the programs' `AYA_LOG_LEVEL`: the most verbose level the
/// agent's subscriber wants for [`TARGET`] (aya-log's numbering: 1 error
/// … 5 trace; 0 writes nothing).
pub(crate) fn level() -> u8 {
    use tracing::Level;
    if tracing::enabled!(target: TARGET, Level::TRACE) {
        5
    } else if tracing::enabled!(target: TARGET, Level::DEBUG) {
        4
    } else if tracing::enabled!(target: TARGET, Level::INFO) {
        3
    } else if tracing::enabled!(target: TARGET, Level::WARN) {
        2
    } else if tracing::enabled!(target: TARGET, Level::ERROR) {
        1
    } else {
        0
    }
}

/// A token bucket: `rate` tokens a second, at most `burst` saved.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
    cut: u64,
}

impl Bucket {
    fn new(now: Instant) -> Bucket {
        Bucket {
            tokens: BURST,
            at: now,
            cut: 0,
        }
    }

    /// Whether a record at `now` goes through; if so, how many were cut
    /// since the last one that did.
    fn admit(&mut self, now: Instant) -> Option<u64> {
        let gained = now.saturating_duration_since(self.at).as_secs_f64() * MAX_PER_SECOND;
        self.tokens = (self.tokens + gained).min(BURST);
        self.at = now;
        if self.tokens < 1.0 {
            self.cut += 1;
            return None;
        }
        self.tokens -= 1.0;
        Some(std::mem::take(&mut self.cut))
    }
}

/// aya-log's records as `tracing` events.
struct Forward {
    bucket: Mutex<Bucket>,
}

impl log::Log for Forward {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let Ok(mut bucket) = self.bucket.lock() else {
            return;
        };
        let Some(cut) = bucket.admit(Instant::now()) else {
            return;
        };
        drop(bucket);
        let (message, program) = (record.args(), record.module_path().unwrap_or("?"));
        match record.level() {
            log::Level::Error => tracing::error!(target: TARGET, program, cut, "{message}"),
            log::Level::Warn => tracing::warn!(target: TARGET, program, cut, "{message}"),
            log::Level::Info => tracing::info!(target: TARGET, program, cut, "{message}"),
            log::Level::Debug => tracing::debug!(target: TARGET, program, cut, "{message}"),
            log::Level::Trace => tracing::trace!(target: TARGET, program, cut, "{message}"),
        }
    }

    fn flush(&self) {}
}

/// The reader of the programs' log ring; [`BpfLog::run`] forwards what
/// they write until dropped.
pub struct BpfLog {
    logger: aya_log::EbpfLogger<Forward>,
}

impl std::fmt::Debug for BpfLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpfLog").finish_non_exhaustive()
    }
}

impl BpfLog {
    /// Takes the log ring of `ebpf`; `None` (said at debug) when the object
    /// has none.
    pub(crate) fn take(ebpf: &mut aya::Ebpf) -> Option<BpfLog> {
        let forward = Forward {
            bucket: Mutex::new(Bucket::new(Instant::now())),
        };
        match aya_log::EbpfLogger::init_with_logger(ebpf, forward) {
            Ok(logger) => Some(BpfLog { logger }),
            Err(e) => {
                tracing::debug!(%e, "the BPF programs' log is not read");
                None
            }
        }
    }

    /// Forwards records as they arrive (woken by the ring buffer), until
    /// the task is dropped.
    pub async fn run(self) {
        // SAFETY: the logger owns its ring buffer map's fd, which stays
        // open and the same for as long as the logger lives, and the
        // `AsyncFd` owns the logger.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(
                self.logger,
                tokio::io::Interest::READABLE,
            )
        };
        let Ok(mut ring) = registered else {
            tracing::debug!("the BPF programs' log cannot be polled");
            return;
        };
        loop {
            let Ok(mut ready) = ring.readable_mut().await else {
                return;
            };
            // aya-log unwraps a record it cannot decode. Only the agent's
            // own programs write the ring, but a panic here would end the
            // diagnostics silently: say it, and stop reading.
            let flushed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                ready.get_inner_mut().flush();
            }));
            if flushed.is_err() {
                tracing::warn!(
                    target: TARGET,
                    "a BPF log record could not be decoded: the programs' diagnostics are no longer read"
                );
                return;
            }
            ready.clear_ready();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_programs_level_is_the_filters_for_the_target() {
        use tracing_subscriber::layer::SubscriberExt;
        let at = |filter: &str| {
            let subscriber =
                tracing_subscriber::registry().with(tracing_subscriber::EnvFilter::new(filter));
            tracing::subscriber::with_default(subscriber, level)
        };
        assert_eq!(at("info,lookout_ebpf=off"), 0);
        assert_eq!(at("warn"), 2);
        assert_eq!(at("info,lookout_ebpf=trace"), 5);
        assert_eq!(at("lookout_ebpf=debug"), 4);
    }

    #[test]
    fn a_burst_goes_through_then_the_rate_and_the_cut_are_counted() {
        let t0 = Instant::now();
        let mut b = Bucket::new(t0);
        let through = (0..200).filter(|_| b.admit(t0).is_some()).count();
        assert_eq!(through, BURST as usize);
        // A second later, ten more; the first says how many were cut.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.admit(t1), Some(200 - BURST as u64));
        let more = (0..100).filter(|_| b.admit(t1).is_some()).count();
        assert_eq!(more, MAX_PER_SECOND as usize - 1);
    }
}
