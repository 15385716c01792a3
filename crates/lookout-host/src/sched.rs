//! A scheduling hint for threads that a container runtime waits on.
//!
//! Linux 6.12's EEVDF scheduler lets a `SCHED_OTHER` thread ask for a
//! shorter time slice (`sched_setattr(2)`'s `sched_runtime`). A thread with
//! a short slice gets no more CPU time than before, and no priority over
//! anyone's share: it only runs *sooner* after it wakes, with its virtual
//! deadline earlier than that of a thread that asked for nothing, and is
//! preempted sooner in turn. That suits a thread that sleeps, wakes for
//! tens of microseconds and goes back to sleep, with a runtime's exec or
//! a container's report waiting on it.
//!
//! Measured on this project's 2-vCPU VM (kernel 6.18, see
//! `docs/benchmarks.md`): when a `runc create` exits it wakes its parent
//! and the agent together, and the agent's thread waited up to 260 us
//! behind the parent on the same CPU. With a 100 us slice, the agent
//! reports the container 30-70 us sooner at the median.
//!
//! Kernels before 6.12 take the call and change nothing
//! ([`Slice::Unsupported`]).
//!
//! ```
//! use std::time::Duration;
//! use lookout_host::sched::{request_slice, Slice};
//! // On this thread only; threads it starts later inherit the slice.
//! match request_slice(Duration::from_micros(100)) {
//!     Ok(Slice::Set(d)) => assert!(d >= Duration::from_micros(100)),
//!     Ok(other) => println!("left as it was: {other:?}"),
//!     Err(e) => println!("cannot ask: {e}"),
//! }
//! ```

use std::io;
use std::time::Duration;

/// What [`request_slice`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Slice {
    /// The thread now has this slice (the kernel's bounds applied: 0.1 to
    /// 100 ms).
    Set(Duration),
    /// The kernel has no custom slices (before Linux 6.12): nothing changed.
    Unsupported,
    /// The thread runs under another policy than `SCHED_OTHER` or
    /// `SCHED_BATCH` (an operator made it real-time or idle): left alone.
    OtherPolicy(u32),
}

/// The kernel's bounds on a custom slice (`kernel/sched/syscalls.c`).
const MIN_SLICE_NS: u64 = 100_000;
const MAX_SLICE_NS: u64 = 100_000_000;

/// Asks the kernel to give the calling thread a time slice of `slice`,
/// keeping its policy and nice value. Threads it creates afterwards
/// inherit the slice.
///
/// # Errors
/// What `sched_getattr(2)` or `sched_setattr(2)` returned: `EPERM` under a
/// seccomp profile that refuses them, `ENOSYS` on a kernel before 3.14.
pub fn request_slice(slice: Duration) -> io::Result<Slice> {
    request_slice_of(0, slice)
}

/// [`request_slice`] for thread `tid` (0: the calling thread): another
/// process's threads need `CAP_SYS_NICE` or the same user.
///
/// # Errors
/// As for [`request_slice`], and `ESRCH` for a thread that is gone.
pub fn request_slice_of(tid: u32, slice: Duration) -> io::Result<Slice> {
    let mut attr = get_of(tid)?;
    if attr.sched_policy != libc::SCHED_OTHER as u32
        && attr.sched_policy != libc::SCHED_BATCH as u32
    {
        return Ok(Slice::OtherPolicy(attr.sched_policy));
    }
    let want = u64::try_from(slice.as_nanos())
        .unwrap_or(u64::MAX)
        .clamp(MIN_SLICE_NS, MAX_SLICE_NS);
    // N.B. Not SCHED_FLAG_KEEP_PARAMS: with it the kernel skips the very
    // step that records a custom slice. The nice value read above is
    // written back instead; reset-on-fork is kept, nothing else is set.
    attr.sched_flags &= SCHED_FLAG_RESET_ON_FORK;
    attr.sched_runtime = want;
    set_of(tid, &attr)?;
    // Before 6.12 the kernel ignores `sched_runtime` for these policies and
    // reports 0; since, it reports the slice.
    let now = get_of(tid)?.sched_runtime;
    Ok(if now == want {
        Slice::Set(Duration::from_nanos(now))
    } else {
        Slice::Unsupported
    })
}

/// The calling thread's slice as the kernel reports it: `None` before
/// Linux 6.12, or under a real-time or deadline policy.
///
/// # Errors
/// As for [`request_slice`].
pub fn current_slice() -> io::Result<Option<Duration>> {
    slice_of(0)
}

/// Thread `tid`'s slice, as for [`current_slice`] (0: the calling thread).
///
/// # Errors
/// As for [`request_slice`], and `ESRCH` for a thread that is gone.
pub fn slice_of(tid: u32) -> io::Result<Option<Duration>> {
    let attr = get_of(tid)?;
    let fair = attr.sched_policy == libc::SCHED_OTHER as u32
        || attr.sched_policy == libc::SCHED_BATCH as u32;
    Ok((fair && attr.sched_runtime > 0).then(|| Duration::from_nanos(attr.sched_runtime)))
}

const SCHED_FLAG_RESET_ON_FORK: u64 = 0x01;

/// `struct sched_attr`, as far as `SCHED_ATTR_SIZE_VER1` (56 bytes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
    sched_util_min: u32,
    sched_util_max: u32,
}

const ATTR_SIZE: u32 = std::mem::size_of::<SchedAttr>() as u32;

/// A thread id as the syscalls take it.
fn pid_t(tid: u32) -> io::Result<libc::pid_t> {
    libc::pid_t::try_from(tid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))
}

fn get_of(tid: u32) -> io::Result<SchedAttr> {
    let mut attr = SchedAttr::default();
    let tid = pid_t(tid)?;
    // SAFETY: sched_getattr writes at most `ATTR_SIZE` bytes into `attr`,
    // which is that large and lives across the call.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, tid, &raw mut attr, ATTR_SIZE, 0u32) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(attr)
}

fn set_of(tid: u32, attr: &SchedAttr) -> io::Result<()> {
    let attr = SchedAttr {
        size: ATTR_SIZE,
        ..*attr
    };
    let tid = pid_t(tid)?;
    // SAFETY: sched_setattr reads `attr.size` bytes from `attr`, which is
    // that large and lives across the call; pid 0 is the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, tid, &raw const attr, 0u32) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel release, as (major, minor).
    fn kernel() -> (u32, u32) {
        let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut it = r.trim().split(['.', '-']).map(|p| p.parse().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0))
    }

    #[test]
    fn the_struct_is_the_kernels_first_size() {
        assert_eq!(ATTR_SIZE, 56);
    }

    #[test]
    fn a_slice_is_set_on_this_thread_alone_and_inherited_by_its_threads() {
        std::thread::spawn(|| {
            // An operator's nice value (raising it needs no privilege).
            // SAFETY: setpriority takes plain integers; 0 is this thread.
            let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 5) };
            assert_eq!(rc, 0, "setpriority");
            let before_nice = nice_now();
            assert_eq!(before_nice, 5);
            let got = request_slice(Duration::from_micros(250)).expect("sched_setattr");
            if kernel() < (6, 12) {
                assert_eq!(got, Slice::Unsupported);
                eprintln!("SKIPPED (partly): kernel before 6.12 has no custom slices");
                return;
            }
            assert_eq!(got, Slice::Set(Duration::from_micros(250)));
            assert_eq!(
                current_slice().ok().flatten(),
                Some(Duration::from_micros(250))
            );
            // The nice value is kept.
            assert_eq!(nice_now(), before_nice);
            // A thread started now inherits it.
            let child = std::thread::spawn(|| current_slice().ok().flatten())
                .join()
                .expect("child");
            assert_eq!(child, Some(Duration::from_micros(250)));
        })
        .join()
        .expect("test thread");
        // This thread kept its own.
        if kernel() >= (6, 12) {
            assert_ne!(
                current_slice().ok().flatten(),
                Some(Duration::from_micros(250))
            );
        }
    }

    #[test]
    fn a_slice_out_of_the_kernels_bounds_is_brought_within_them() {
        std::thread::spawn(|| {
            if kernel() < (6, 12) {
                eprintln!("SKIPPED: kernel before 6.12 has no custom slices");
                return;
            }
            assert_eq!(
                request_slice(Duration::from_nanos(1)).ok(),
                Some(Slice::Set(Duration::from_micros(100)))
            );
            assert_eq!(
                request_slice(Duration::from_secs(5)).ok(),
                Some(Slice::Set(Duration::from_millis(100)))
            );
        })
        .join()
        .expect("test thread");
    }

    #[test]
    fn another_threads_slice_is_set_by_its_id() {
        if kernel() < (6, 12) {
            eprintln!("SKIPPED: kernel before 6.12 has no custom slices");
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // SAFETY: gettid takes nothing and cannot fail.
            let tid = unsafe { libc::gettid() };
            tx.send(u32::try_from(tid).expect("tid")).expect("send");
            done_rx.recv().expect("recv");
            current_slice().ok().flatten()
        });
        let tid = rx.recv().expect("tid");
        assert_eq!(
            request_slice_of(tid, Duration::from_micros(300)).ok(),
            Some(Slice::Set(Duration::from_micros(300)))
        );
        assert_eq!(
            slice_of(tid).ok().flatten(),
            Some(Duration::from_micros(300))
        );
        done_tx.send(()).expect("send");
        assert_eq!(t.join().expect("thread"), Some(Duration::from_micros(300)));
        // A thread that is gone.
        assert!(request_slice_of(u32::MAX, Duration::from_micros(300)).is_err());
    }

    /// The calling thread's nice value, from sched_getattr.
    fn nice_now() -> i32 {
        get_of(0).map(|a| a.sched_nice).unwrap_or(i32::MIN)
    }
}
