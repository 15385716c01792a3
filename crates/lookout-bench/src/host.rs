//! What the benchmark reads of the machine and its processes: clocks,
//! /proc samples, thread switches, pidfds, the page cache.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::{Value, json};

/// CLOCK_MONOTONIC now, in nanoseconds (the agent's event clock).
pub(crate) fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// `clock` now, in nanoseconds (0 if it cannot be read).
pub(crate) fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec pointer; an unknown clock is an error.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The CPU time of our child `pid` in seconds: its process CPU clock
/// (nanoseconds, all threads, exited ones included); NaN if unreadable.
pub(crate) fn cpu_clock_s(pid: u32) -> f64 {
    let mut clock: libc::clockid_t = 0;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointers; the pid is our own unreaped child.
    unsafe {
        if libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) == 0
            && libc::clock_gettime(clock, &mut ts) == 0
        {
            ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
        } else {
            f64::NAN
        }
    }
}

/// Samples a process's RSS every 50 ms on a thread, keeping the peak.
pub(crate) struct PeakRss {
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl PeakRss {
    pub(crate) fn start(pid: u32) -> PeakRss {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let peak = std::sync::Arc::new(AtomicU64::new(0));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(proc_sample(pid).2, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        PeakRss { peak, stop, thread }
    }

    /// Stops sampling; the peak RSS in kB.
    pub(crate) fn stop(self) -> u64 {
        use std::sync::atomic::Ordering;
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
        self.peak.load(Ordering::Relaxed)
    }
}

/// (utime+stime ticks, voluntary context switches, VmRSS kB).
pub(crate) fn proc_sample(pid: u32) -> (u64, u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (
        ticks,
        status_field(&status, "voluntary_ctxt_switches:"),
        status_field(&status, "VmRSS:"),
    )
}

/// The number after `name` in a /proc/PID/status text (0 when absent).
pub(crate) fn status_field(status: &str, name: &str) -> u64 {
    status
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0)
}

/// Every thread of `pid` now: (tid, name, voluntary, involuntary context
/// switches). A thread that exits between two samples takes its count
/// with it; one born between them counts from 0.
pub(crate) fn thread_switches(pid: u32) -> Vec<(u32, String, u64, u64)> {
    threads(pid)
        .into_iter()
        .filter_map(|(tid, dir)| {
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let name = status
                .lines()
                .find_map(|l| l.strip_prefix("Name:"))
                .unwrap_or("")
                .trim()
                .to_owned();
            Some((
                tid,
                name,
                status_field(&status, "voluntary_ctxt_switches:"),
                status_field(&status, "nonvoluntary_ctxt_switches:"),
            ))
        })
        .collect()
}

/// Every thread of `pid` now: its id and `/proc/<pid>/task/<tid>`.
pub(crate) fn threads(pid: u32) -> Vec<(u32, PathBuf)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| Some((t.file_name().to_str()?.parse().ok()?, t.path())))
        .collect()
}

/// On-CPU time (ns) of the thread whose /proc directory is `dir`, from its
/// `schedstat` (not clock ticks).
pub(crate) fn schedstat_ns(dir: &Path) -> Option<u64> {
    std::fs::read_to_string(dir.join("schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The context switches between two [`thread_switches`] samples, per
/// `per` (containers): voluntary (a thread that waits: one per hand-off
/// it waits for), involuntary (a thread preempted), and the voluntary
/// ones by thread name.
pub(crate) fn switches_between(
    before: &[(u32, String, u64, u64)],
    after: &[(u32, String, u64, u64)],
    per: usize,
) -> Value {
    let per = per.max(1) as f64;
    let (mut voluntary, mut involuntary) = (0u64, 0u64);
    let mut by_thread = std::collections::BTreeMap::<String, u64>::new();
    for (tid, name, v, n) in after {
        let (v0, n0) = before
            .iter()
            .find(|b| b.0 == *tid)
            .map_or((0, 0), |b| (b.2, b.3));
        let dv = v.saturating_sub(v0);
        voluntary += dv;
        involuntary += n.saturating_sub(n0);
        *by_thread.entry(name.clone()).or_default() += dv;
    }
    json!({
        "voluntary_per_container": voluntary as f64 / per,
        "involuntary_per_container": involuntary as f64 / per,
        "voluntary_per_container_by_thread": by_thread
            .into_iter()
            .filter(|(_, v)| *v > 0)
            .map(|(k, v)| (k, json!(v as f64 / per)))
            .collect::<serde_json::Map<_, _>>(),
    })
}

/// The agent's resident memory split (`RssAnon`, `RssFile` in kB): its
/// heap and stacks, against the pages of its binary and libraries that it
/// touched (clean, shared with the page cache, reclaimable).
pub(crate) fn rss_split(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (
        status_field(&status, "RssAnon:"),
        status_field(&status, "RssFile:"),
    )
}

/// CPU time (ns) that thread `name` of process `pid` (its main thread for
/// "") has used, from its `schedstat` (on-CPU ns, not clock ticks).
pub(crate) fn thread_cpu_ns(pid: u32, name: &str) -> Option<u64> {
    let (_, dir) = threads(pid).into_iter().find(|(tid, dir)| {
        if name.is_empty() {
            *tid == pid
        } else {
            std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim() == name)
        }
    })?;
    schedstat_ns(&dir)
}

pub(crate) fn exec_times(bin: &Path, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            let _ = Command::new(bin).status();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect()
}

/// Writes `path` back and drops it from the page cache.
pub(crate) fn drop_page_cache(path: &Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    f.sync_all()?;
    // SAFETY: posix_fadvise on an fd we own; it only advises the kernel.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!("posix_fadvise({}): errno {rc}", path.display());
    }
    Ok(())
}

/// The scheduler slice the agent's threads ask for by default
/// (`--scheduler-slice`), given to the floors' threads too: a floor that
/// waits longer for a CPU after a wake-up than the agent does is no floor.
pub(crate) const AGENT_SLICE: Duration = Duration::from_micros(100);

/// Gives every thread of process `pid` [`AGENT_SLICE`] (a floor, once it
/// is ready; its threads do not start more threads after that).
pub(crate) fn give_agent_slice(pid: u32) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for t in tasks.flatten() {
        if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse().ok()) {
            let _ = lookout_host::sched::request_slice_of(tid, AGENT_SLICE);
        }
    }
}

/// A pidfd for process `pid`, or `None` if it is gone.
pub(crate) fn pidfd(pid: u32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes integers and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
    // SAFETY: a new fd that nothing else owns.
    (fd >= 0).then(|| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// Waits (at most 10 s) for the process of pidfd `fd` to end.
pub(crate) fn exited(fd: &std::os::fd::OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(fd),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    (unsafe { libc::poll(&mut p, 1, 10_000) }) == 1
}

/// When process `pid` ended, as this thread saw it (at most 10 s).
pub(crate) fn wait_exit(pid: u32) -> Option<u64> {
    let fd = pidfd(pid)?;
    exited(&fd).then(now_ns)
}
