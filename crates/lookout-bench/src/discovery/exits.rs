//! The kernel's own time of each process exit, for the discovery rows.
//!
//! The benchmark's reference for "the container exited" is one of its own
//! threads woken by the exit (a pidfd, or `waitpid` for `runc create`),
//! which is itself late: by the kernel's exit work and by its own
//! wake-up. [`ExitClock`] samples the `sched/sched_process_exit`
//! tracepoint on every CPU through perf events, stamped with
//! CLOCK_MONOTONIC (the clock of `monotonic_ns`), so that each lag can also
//! be read from the moment the process began to exit: before its files,
//! namespaces and cgroup are released and before its pidfd is readable,
//! which no listener can see earlier.

use std::collections::HashMap;

use lookout_testsupport::perf::TracepointSampler;

/// Ring buffer per CPU: 32 pages, room for about 5000 exits between two
/// [`ExitClock::drain`]s (a discovery block has a few hundred).
const RING_BYTES: usize = 32 * 4096;

/// Every process exit on the machine, with its kernel time, from
/// [`ExitClock::open`] until it is dropped.
pub(crate) struct ExitClock(TracepointSampler);

impl ExitClock {
    /// Starts sampling the exits on every CPU. Needs root (or CAP_PERFMON)
    /// and tracefs at /sys/kernel/tracing.
    pub(crate) fn open() -> anyhow::Result<ExitClock> {
        TracepointSampler::open("sched", "sched_process_exit", RING_BYTES)
            .map(ExitClock)
            .map_err(anyhow::Error::msg)
    }

    /// The exits sampled since the last call, by process (thread group):
    /// the time its last thread began to exit.
    pub(crate) fn drain(&mut self) -> HashMap<u32, u64> {
        let mut exits = HashMap::new();
        for hit in self.0.drain() {
            let at = exits.entry(hit.pid).or_insert(hit.time_ns);
            *at = (*at).max(hit.time_ns);
        }
        exits
    }

    /// How many samples the rings had no room for (0, or the block's
    /// kernel rows are short of containers).
    pub(crate) fn lost(&self) -> u64 {
        self.0.lost()
    }
}
