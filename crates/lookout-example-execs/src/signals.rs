//! SIGINT and SIGTERM, taken synchronously: blocked, then waited for with
//! a timeout between two ticks. No handler, no thread, no async runtime.

use std::io;
use std::time::Duration;

/// SIGINT and SIGTERM, blocked in this thread (and in threads it starts
/// afterwards) so that they stay pending until [`Stop::wait`] takes them.
///
/// N.B. Block before any other thread exists: a thread started earlier
/// keeps both unblocked, and the kernel may deliver the signal to it,
/// which kills the process.
pub struct Stop {
    set: libc::sigset_t,
}

impl Stop {
    /// Blocks SIGINT and SIGTERM (`pthread_sigmask(2)`).
    pub fn block() -> io::Result<Stop> {
        // SAFETY: sigset_t is plain data; sigemptyset initialises it below
        // before any other use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid, exclusively borrowed sigset_t; these
        // calls only write it and cannot fail for valid signal numbers.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
        }
        // SAFETY: `set` is initialised; a null old set is allowed.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(Stop { set })
    }

    /// Waits at most `timeout` for SIGINT or SIGTERM (`sigtimedwait(2)`).
    /// Returns the signal's number, or `None` when the time ran out (or
    /// another signal interrupted the wait: the caller looks at the clock
    /// and waits again).
    pub fn wait(&self, timeout: Duration) -> io::Result<Option<i32>> {
        let timeout = libc::timespec {
            // Saturates: a wait of more than 2^63 s is as good as forever.
            tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        // SAFETY: `self.set` is an initialised sigset_t, `timeout` a valid
        // timespec, and a null siginfo pointer is allowed.
        let signal = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &timeout) };
        if signal >= 0 {
            return Ok(Some(signal));
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
            _ => Err(error),
        }
    }
}
