//! A perf reader of one kernel tracepoint on every online CPU, as
//! `perf record -a -e category:name` reads it: which processes hit it, and
//! when (CLOCK_MONOTONIC). Needs root (or CAP_PERFMON) and tracefs at
//! /sys/kernel/tracing.
//!
//! The bench times exits from `sched_process_exit` with it, and the agent's
//! tests check that its BPF programs leave other perf readers their
//! events.

use perf_event::events::Tracepoint;
use perf_event::{Builder, Clock, SampleFlag, Sampler};

/// One sample: the process (thread group), the thread, and the kernel's
/// time of the event (CLOCK_MONOTONIC ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    /// The process (thread group id).
    pub pid: u32,
    /// The thread.
    pub tid: u32,
    /// When, CLOCK_MONOTONIC ns.
    pub time_ns: u64,
}

/// Samples of tracepoint `category/name` on every online CPU, from
/// [`TracepointSampler::open`] until dropped.
pub struct TracepointSampler {
    samplers: Vec<Sampler>,
    lost: u64,
}

impl TracepointSampler {
    /// Starts sampling every hit of `category/name`, with a ring of
    /// `ring_bytes` per CPU (a power of two pages).
    pub fn open(category: &str, name: &str, ring_bytes: usize) -> Result<Self, String> {
        let id_file = format!("/sys/kernel/tracing/events/{category}/{name}/id");
        let id: u64 = std::fs::read_to_string(&id_file)
            .map_err(|e| format!("{id_file}: {e}"))?
            .trim()
            .parse()
            .map_err(|e| format!("the tracepoint id in {id_file}: {e}"))?;
        let list = std::fs::read_to_string("/sys/devices/system/cpu/online")
            .map_err(|e| format!("/sys/devices/system/cpu/online: {e}"))?;
        let mut samplers = Vec::new();
        for cpu in parse_cpu_list(list.trim())? {
            let mut sampler = Builder::new(Tracepoint::with_id(id))
                .any_pid()
                .one_cpu(cpu)
                .include_kernel()
                .sample_period(1)
                .sample(SampleFlag::TID | SampleFlag::TIME)
                .clockid(Clock::MONOTONIC)
                .build()
                .and_then(|c| c.sampled(ring_bytes))
                .map_err(|e| format!("perf_event_open on {category}:{name}, CPU {cpu}: {e}"))?;
            sampler
                .enable()
                .map_err(|e| format!("enabling the sampler of CPU {cpu}: {e}"))?;
            samplers.push(sampler);
        }
        Ok(TracepointSampler { samplers, lost: 0 })
    }

    /// The hits sampled since the last call, CPU by CPU.
    pub fn drain(&mut self) -> Vec<Hit> {
        let mut hits = Vec::new();
        for sampler in &mut self.samplers {
            while let Some(record) = sampler.next_record() {
                match record.parse_record() {
                    Ok(perf_event::data::Record::Sample(s)) => {
                        if let (Some(pid), Some(tid), Some(time_ns)) = (s.pid(), s.tid(), s.time())
                        {
                            hits.push(Hit { pid, tid, time_ns });
                        }
                    }
                    Ok(perf_event::data::Record::Lost(l)) => self.lost += l.lost,
                    _ => {}
                }
            }
        }
        hits
    }

    /// How many samples the rings had no room for, so far.
    pub fn lost(&self) -> u64 {
        self.lost
    }
}

/// A kernel CPU list (`0-3,5`), as /sys/devices/system/cpu/online writes it.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let number = |s: &str| {
            s.parse::<usize>()
                .map_err(|e| format!("CPU list {list:?}: {e}"))
        };
        cpus.extend(number(a)?..=number(b)?);
    }
    if cpus.is_empty() {
        return Err(format!("empty CPU list {list:?}"));
    }
    Ok(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_read_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0-1").expect("a list"), vec![0, 1]);
        assert_eq!(parse_cpu_list("0,2-3,7").expect("a list"), vec![0, 2, 3, 7]);
        assert!(parse_cpu_list("").is_err());
        assert!(parse_cpu_list("0-x").is_err());
    }
}
