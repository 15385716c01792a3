//! Waiting for a process that is not our child to exit: `pidfd_open(2)`
//! (Linux 5.3) becomes readable when the process exits.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// `pidfd_open(pid, 0)`.
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns an fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new fd that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Waits until the process behind `pidfd` exits.
///
/// # Cancel safety
/// Cancel safe; dropping the future closes nothing but the registration.
pub async fn wait_exit(pidfd: impl Into<Arc<OwnedFd>>) -> std::io::Result<()> {
    let pidfd: Arc<OwnedFd> = pidfd.into();
    // SAFETY: the `Arc<OwnedFd>` keeps the fd open, and returns it
    // unchanged from `as_raw_fd`, for as long as the AsyncFd holds it.
    let afd = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
        .map_err(std::io::Error::from)?;
    let guard = afd.readable().await?;
    drop(guard);
    debug_assert!(afd.get_ref().as_raw_fd() >= 0);
    Ok(())
}

/// A future that completes when process `pid` exits, or at once if it is
/// gone already. The pidfd is opened now (not when the future is first
/// polled), so that a pid reused meanwhile is never waited for.
pub fn exit_of(pid: u32) -> impl std::future::Future<Output = ()> + Send + 'static {
    exit_of_fd(pidfd_open(pid).ok().map(Arc::new))
}

/// A future that completes when the process behind `fd` exits, or at once
/// without one (the open failed: counted as an exit, see [`exit_of`]).
/// The caller may keep a clone of `fd` to ask [`has_exited`] meanwhile.
pub async fn exit_of_fd(fd: Option<Arc<OwnedFd>>) {
    if let Some(fd) = fd {
        // A registration that fails counts as an exit: the caller rechecks
        // what it tracks, and never waits forever.
        let _ = wait_exit(fd).await;
    }
}

/// Whether the process behind `pidfd` has exited (a zombie counts), without
/// waiting.
pub fn has_exited(pidfd: &OwnedFd) -> bool {
    use std::os::fd::AsFd;
    let mut fds = [nix::poll::PollFd::new(
        pidfd.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    matches!(nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO), Ok(n) if n > 0)
}

/// Whether the process behind `pidfd` has not been reaped yet (a zombie
/// counts): until it is, its pid names it and no other process, so what
/// `/proc/<pid>` said before this returned `true` was its own. Only `ESRCH`
/// says it was reaped; a refusal that cannot tell (a seccomp filter, a
/// kernel without the call) counts as there, which trusts the read as the
/// follower did before it had this check.
pub fn not_reaped(pidfd: &OwnedFd) -> bool {
    // SAFETY: pidfd_send_signal takes an fd, a signal (0: only the checks),
    // a null siginfo and flags; the fd is open for the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    // N.B. EPERM (another uid's process, and no CAP_KILL) and EACCES (an
    // LSM) come from permission checks, which the kernel makes only on a
    // task it found: the process is there. A reaped one gives ESRCH.
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// A process held by a pidfd: a signal sent through it reaches the
/// process it was opened for, or nobody, never one that reused its pid.
/// Open it while the pid is known to be right (when it was reported).
#[derive(Debug)]
pub struct ProcessHandle(OwnedFd);

impl ProcessHandle {
    /// `pidfd_open(pid)`: fails with `ESRCH` if `pid` is gone.
    pub fn open(pid: u32) -> std::io::Result<ProcessHandle> {
        pidfd_open(pid).map(ProcessHandle)
    }

    /// Sends SIGKILL; `ESRCH` once the process has exited.
    pub fn kill(&self) -> std::io::Result<()> {
        // SAFETY: pidfd_send_signal takes an fd, a signal, a null siginfo
        // and flags; the fd is open for the duration of the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// Sends SIGKILL to process `pid` through a pidfd, so that a pid recycled
/// after the open is never hit (the open fails or names the old process).
pub fn kill(pid: u32) -> std::io::Result<()> {
    ProcessHandle::open(pid)?.kill()
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    /// Runs `f` on a thread whose effective capabilities lack CAP_KILL
    /// (capabilities are per thread), as an agent deployed without it.
    fn without_cap_kill<T: Send>(f: impl FnOnce() -> T + Send) -> T {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Default, Clone, Copy)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const CAP_KILL: u32 = 5;
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut header = Header {
                    version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
                    pid: 0,
                };
                let mut data = [Data::default(); 2];
                // SAFETY: capget/capset on this thread with a version-3
                // header and the two data words that version takes.
                unsafe {
                    assert_eq!(
                        libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()),
                        0
                    );
                    data[0].effective &= !(1 << CAP_KILL);
                    assert_eq!(libc::syscall(libc::SYS_capset, &header, data.as_ptr()), 0);
                }
                f()
            })
            .join()
            .expect("the thread without CAP_KILL")
        })
    }

    #[test]
    fn another_uids_process_is_not_reaped_even_to_a_caller_without_cap_kill() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!(
                "SKIPPED another_uids_process_is_not_reaped_even_to_a_caller_without_cap_kill: \
                 needs root, to run a process as another uid"
            );
            return;
        }
        use std::os::unix::process::CommandExt;
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .uid(65534)
            .gid(65534)
            .spawn()
            .expect("run sleep as nobody");
        let fd = super::pidfd_open(child.id()).expect("pidfd_open");
        let (refused, alive) = without_cap_kill(|| {
            // SAFETY: as in `not_reaped`.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    super::AsRawFd::as_raw_fd(&fd),
                    0,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
            let errno = std::io::Error::last_os_error().raw_os_error();
            ((rc, errno), super::not_reaped(&fd))
        });
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(refused, (-1, Some(libc::EPERM)), "signal 0 was not refused");
        assert!(alive, "a live process refused a signal: it is there");
        assert!(
            !without_cap_kill(|| super::not_reaped(&fd)),
            "reaped: ESRCH, whatever the permissions"
        );
    }

    #[test]
    fn a_live_process_has_not_exited_a_zombie_and_a_reaped_one_have() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("run sleep");
        let fd = super::pidfd_open(child.id()).expect("pidfd_open");
        assert!(!super::has_exited(&fd), "alive");
        assert!(super::not_reaped(&fd), "alive");
        child.kill().expect("kill");
        // kill(2) returns before the child has died: a zombie soon.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !super::has_exited(&fd) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(super::has_exited(&fd), "a zombie has exited");
        // A zombie still holds its pid: /proc/<pid> is still its own.
        assert!(super::not_reaped(&fd), "a zombie is not reaped");
        child.wait().expect("reap");
        // The pidfd names the process it was opened for, not its pid: once
        // reaped, it stays exited whatever reuses the number.
        assert!(super::has_exited(&fd), "reaped: still exited");
        assert!(!super::not_reaped(&fd), "reaped");
    }
}
