//! Safe fanotify for Linux, with an async (tokio) event stream.
//!
//! # Overview
//!
//! - [`Fanotify`] is a group: create it with [`Fanotify::builder`], add
//!   marks with [`Fanotify::add_mark`], read with [`Fanotify::read_events`].
//! - [`Event`] owns the fd the kernel opened for it. A permission event
//!   (`FAN_*_PERM`) holds a [`Permission`] guard that answers "allow" when
//!   dropped, so no code path can leave a process blocked in the kernel.
//! - [`InfoRecord`] decodes FID, DFID, DFID_NAME and pidfd records.
//! - [`AsyncFanotify`] (feature `tokio`, on by default) waits for events on
//!   the tokio reactor.
//!
//! # Example
//!
//! ```no_run
//! use lookout_fanotify::{Class, Fanotify, Mask, MarkFlags, Report};
//! # fn main() -> Result<(), lookout_fanotify::Error> {
//! let group = Fanotify::builder()
//!     .class(Class::Content)
//!     .report(Report::TID)
//!     .nonblock(false)
//!     .init()?; // needs CAP_SYS_ADMIN
//! group.add_mark("/usr/bin/runc".as_ref(), MarkFlags::empty(), Mask::OPEN_EXEC_PERM)?;
//! let mut buf = vec![0; lookout_fanotify::MIN_READ_BUFFER];
//! let mut events = Vec::new();
//! group.read_events(&mut buf, &mut events)?;
//! for mut event in events {
//!     println!("tid {} executes {:?}", event.pid(), event.path());
//!     if let Some(permission) = event.take_permission() {
//!         permission.allow()?;
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # Gotchas
//!
//! - With `FAN_REPORT_TID` the `pid` of an exec event is the thread that
//!   called `execve`; at event time `/proc/<pid>/cmdline` is still the
//!   *parent's* image.
//! - A group sees pid `0` for processes outside its pid namespace.
//! - FID reporting and permission classes cannot be combined on the kernels
//!   we target: use two groups.
//! - Closing the group allows every pending permission event. This is the
//!   safety net if the reader crashes.
//! - ...but only when the *last* reference to the group goes. A child you
//!   fork holds a copy of the group fd until its `execve` succeeds
//!   (`FD_CLOEXEC` acts after the permission check), so a child that execs a
//!   marked file keeps the group alive while it waits on it. Never let the
//!   thread that answers events wait for such a child (`Command::spawn`
//!   waits for the exec!), and close the group fd in `pre_exec` for children
//!   that may exec marked binaries.
//! - A thread blocked in `read` on a blocking group wakes for events
//!   only. To stop it, mark a private file `FAN_MODIFY` in the same group
//!   and write to it; since Linux 6.14 a file from `memfd_create` itself
//!   raises no fsnotify events, the same memfd reopened through
//!   `/proc/self/fd/N` does.
#![deny(missing_docs)]

#[cfg(feature = "tokio")]
mod async_fd;
mod event;
mod flags;
mod group;
mod sys;

#[cfg(feature = "tokio")]
pub use async_fd::AsyncFanotify;
#[cfg(fuzzing)]
#[doc(hidden)]
pub use event::fuzzing;
pub use event::{Event, FidKind, FileHandle, InfoRecord, Permission, Response};
pub use flags::{Class, MarkFlags, Mask, Report};
pub use group::{Builder, Fanotify, MIN_READ_BUFFER};

use std::path::PathBuf;

/// Errors from this crate. `Read` and `Respond` failures on a live group
/// are usually transient; `Init` and `Mark` failures describe the system
/// (missing capability, kernel option, file system) and will repeat.
///
/// The errno is the [`source`](std::error::Error::source), not part of the
/// message: print the error with its sources (anyhow's `{:#}`, or walk
/// [`std::error::Error::source`]), or use [`Error::errno`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `fanotify_init` failed. `EPERM`: no `CAP_SYS_ADMIN`; `EINVAL`: a flag
    /// this kernel lacks (for example `FAN_CLASS_CONTENT` without
    /// `CONFIG_FANOTIFY_ACCESS_PERMISSIONS`); `ENOSYS`: no fanotify at all.
    #[error("fanotify_init(flags={flags:#x}) failed")]
    Init {
        /// The flags passed.
        flags: u32,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
    /// `fanotify_mark` failed for `path`.
    #[error("fanotify_mark on {} failed", path.display())]
    Mark {
        /// The path (or `/proc/self/fd/N`).
        path: PathBuf,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
    /// `read` on the group failed.
    #[error("reading fanotify events failed")]
    Read {
        /// The errno.
        #[source]
        source: std::io::Error,
    },
    /// Reading or setting the group's file status flags (`fcntl`) failed.
    #[error("fcntl on the fanotify group failed")]
    Flags {
        /// The errno.
        #[source]
        source: std::io::Error,
    },
    /// Writing a permission response failed.
    #[error("answering fanotify permission event (fd {fd}) failed")]
    Respond {
        /// The event's fd.
        fd: i32,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
    /// The kernel returned bytes that do not parse as events. Events before
    /// `offset` were delivered.
    #[error("malformed fanotify event at byte {offset}: {reason}")]
    Malformed {
        /// Byte offset in the read buffer.
        offset: usize,
        /// What was wrong.
        reason: String,
    },
    /// The read buffer is smaller than [`MIN_READ_BUFFER`].
    #[error("read buffer of {len} bytes is smaller than {min}")]
    BufferTooSmall {
        /// Given length.
        len: usize,
        /// Required length.
        min: usize,
    },
    /// [`AsyncFanotify`] needs a non-blocking group.
    #[error("the async API needs a non-blocking group (nonblock(true))")]
    Blocking,
}

impl Error {
    /// The OS errno behind this error, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Init { source, .. }
            | Error::Mark { source, .. }
            | Error::Read { source }
            | Error::Flags { source }
            | Error::Respond { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    /// The message and its source, as a chain printer shows them.
    fn chain(e: &Error) -> String {
        let mut s = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            s = format!("{s}: {c}");
            cause = c.source();
        }
        s
    }

    #[test]
    fn messages_leave_the_errno_to_the_source() {
        let errno = std::io::Error::from_raw_os_error(libc::EPERM).to_string();
        let e = Error::Init {
            flags: 4,
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        };
        assert_eq!(e.to_string(), "fanotify_init(flags=0x4) failed");
        assert_eq!(
            chain(&e),
            format!("fanotify_init(flags=0x4) failed: {errno}")
        );
        assert_eq!(e.errno(), Some(libc::EPERM));
        let e = Error::Mark {
            path: PathBuf::from("/usr/bin/runc"),
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        };
        assert_eq!(chain(&e).matches(&errno).count(), 1, "{}", chain(&e));
    }
}
