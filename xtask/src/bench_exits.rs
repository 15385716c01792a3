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

use anyhow::Context;
use perf_event::events::Tracepoint;
use perf_event::{Builder, Clock, SampleFlag, Sampler};

/// The tracepoint's id, as tracefs numbers it.
const EXIT_ID: &str = "/sys/kernel/tracing/events/sched/sched_process_exit/id";

/// Ring buffer per CPU: 32 pages, room for about 5000 exits between two
/// [`ExitClock::drain`]s (a discovery block has a few hundred).
const RING_BYTES: usize = 32 * 4096;

/// Every process exit on the machine, with its kernel time, from
/// [`ExitClock::open`] until it is dropped.
pub(crate) struct ExitClock {
    samplers: Vec<Sampler>,
    lost: u64,
}

impl ExitClock {
    /// Starts sampling the exits on every CPU. Needs root (or CAP_PERFMON)
    /// and tracefs at /sys/kernel/tracing.
    pub(crate) fn open() -> anyhow::Result<ExitClock> {
        let id: u64 = std::fs::read_to_string(EXIT_ID)
            .with_context(|| format!("reading {EXIT_ID}"))?
            .trim()
            .parse()
            .with_context(|| format!("the tracepoint id in {EXIT_ID}"))?;
        let cpus = online_cpus().context("the online CPUs")?;
        let mut samplers = Vec::with_capacity(cpus.len());
        for cpu in cpus {
            let mut sampler = Builder::new(Tracepoint::with_id(id))
                .any_pid()
                .one_cpu(cpu)
                .include_kernel()
                .sample_period(1)
                .sample(SampleFlag::TID | SampleFlag::TIME)
                .clockid(Clock::MONOTONIC)
                .build()
                .and_then(|c| c.sampled(RING_BYTES))
                .with_context(|| format!("perf_event_open, sched_process_exit, CPU {cpu}"))?;
            sampler
                .enable()
                .with_context(|| format!("enabling the exit sampler of CPU {cpu}"))?;
            samplers.push(sampler);
        }
        Ok(ExitClock { samplers, lost: 0 })
    }

    /// The exits sampled since the last call, by process (thread group):
    /// the time its last thread began to exit.
    pub(crate) fn drain(&mut self) -> HashMap<u32, u64> {
        let mut exits = HashMap::new();
        for sampler in &mut self.samplers {
            while let Some(record) = sampler.next_record() {
                match record.parse_record() {
                    Ok(perf_event::data::Record::Sample(s)) => {
                        if let (Some(pid), Some(t)) = (s.pid(), s.time()) {
                            let at = exits.entry(pid).or_insert(t);
                            *at = (*at).max(t);
                        }
                    }
                    Ok(perf_event::data::Record::Lost(l)) => self.lost += l.lost,
                    _ => {}
                }
            }
        }
        exits
    }

    /// How many samples the rings had no room for (0, or the block's
    /// kernel rows are short of containers).
    pub(crate) fn lost(&self) -> u64 {
        self.lost
    }
}

/// The online CPUs, from /sys/devices/system/cpu/online (`0-1`, `0,2-3`).
fn online_cpus() -> anyhow::Result<Vec<usize>> {
    let list = std::fs::read_to_string("/sys/devices/system/cpu/online")?;
    parse_cpu_list(list.trim())
}

/// A kernel CPU list (`0-3,5`).
fn parse_cpu_list(list: &str) -> anyhow::Result<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (
            a.parse().with_context(|| format!("CPU list {list:?}"))?,
            b.parse().with_context(|| format!("CPU list {list:?}"))?,
        );
        cpus.extend(a..=b);
    }
    anyhow::ensure!(!cpus.is_empty(), "empty CPU list");
    Ok(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_read_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0-1").unwrap(), vec![0, 1]);
        assert_eq!(parse_cpu_list("0,2-3,7").unwrap(), vec![0, 2, 3, 7]);
        assert!(parse_cpu_list("").is_err());
        assert!(parse_cpu_list("0-x").is_err());
    }
}
