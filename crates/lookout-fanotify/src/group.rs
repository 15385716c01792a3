//! The fanotify group: init, marks, reads.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;

use crate::event::{self, Event};
use crate::flags::{Class, MarkFlags, Mask, Report};
use crate::{Error, sys};

/// The smallest read buffer that always fits one event with its records:
/// metadata plus a maximal file handle (`MAX_HANDLE_SZ`) plus a name.
pub const MIN_READ_BUFFER: usize = 4096;

/// A fanotify group (one fd). Marks, events and permission responses all go
/// through it. Closing it (dropping the last clone of its fd) removes every
/// mark and lets the kernel allow all pending permission events.
///
/// Needs `CAP_SYS_ADMIN` in the initial user namespace for permission events
/// and mount/filesystem marks. See
/// [fanotify(7)](https://man7.org/linux/man-pages/man7/fanotify.7.html).
#[derive(Debug)]
pub struct Fanotify {
    // Shared with every `Permission` guard, so a guard can still answer
    // after the group handle was dropped (and the fd stays open until then).
    fd: Arc<OwnedFd>,
}

/// Options for a new group ([`Builder::init`]); start with [`Fanotify::builder`].
#[derive(Debug, Clone)]
pub struct Builder {
    class: Class,
    report: Report,
    nonblock: bool,
    unlimited_queue: bool,
    unlimited_marks: bool,
    event_f_flags: i32,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            class: Class::Notif,
            report: Report::empty(),
            nonblock: true,
            unlimited_queue: false,
            unlimited_marks: false,
            event_f_flags: libc::O_RDONLY | libc::O_LARGEFILE | libc::O_CLOEXEC,
        }
    }
}

impl Builder {
    /// The notification class (default [`Class::Notif`]).
    pub fn class(mut self, class: Class) -> Self {
        self.class = class;
        self
    }

    /// What events report besides the mask (default nothing).
    pub fn report(mut self, report: Report) -> Self {
        self.report = report;
        self
    }

    /// Non-blocking reads (default `true`; required for the async API).
    pub fn nonblock(mut self, yes: bool) -> Self {
        self.nonblock = yes;
        self
    }

    /// `FAN_UNLIMITED_QUEUE`: never drop events (default off: the kernel
    /// queues 16384 and then reports an overflow). Needs `CAP_SYS_ADMIN`.
    pub fn unlimited_queue(mut self, yes: bool) -> Self {
        self.unlimited_queue = yes;
        self
    }

    /// `FAN_UNLIMITED_MARKS` (default off: 8192 marks per group).
    pub fn unlimited_marks(mut self, yes: bool) -> Self {
        self.unlimited_marks = yes;
        self
    }

    /// The `open(2)` flags of the fds in events (default
    /// `O_RDONLY | O_LARGEFILE | O_CLOEXEC`).
    pub fn event_f_flags(mut self, flags: i32) -> Self {
        self.event_f_flags = flags;
        self
    }

    /// The `flags` argument these options give `fanotify_init(2)`.
    pub fn init_flags(&self) -> u32 {
        let mut flags = libc::FAN_CLOEXEC | self.class.bits() | self.report.bits();
        if self.nonblock {
            flags |= libc::FAN_NONBLOCK;
        }
        if self.unlimited_queue {
            flags |= libc::FAN_UNLIMITED_QUEUE;
        }
        if self.unlimited_marks {
            flags |= libc::FAN_UNLIMITED_MARKS;
        }
        flags
    }

    /// Creates the group.
    #[doc(alias = "fanotify_init")]
    pub fn init(self) -> Result<Fanotify, Error> {
        let flags = self.init_flags();
        // N.B. event_f_flags are open(2) flags: non-negative by construction.
        let fd = sys::fanotify_init(flags, self.event_f_flags as u32)
            .map_err(|source| Error::Init { flags, source })?;
        Ok(Fanotify { fd: Arc::new(fd) })
    }
}

impl Fanotify {
    /// Options for a new group.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// Another handle on the same group (the same open file, not a `dup`):
    /// for example one thread reads and answers events while another adds
    /// marks. The group closes when the last handle and the last
    /// [`Permission`](crate::Permission) guard are gone.
    pub fn share(&self) -> Fanotify {
        Fanotify {
            fd: Arc::clone(&self.fd),
        }
    }

    /// Adds `mask` to the mark on `path` (`FAN_MARK_ADD`).
    #[doc(alias = "fanotify_mark")]
    pub fn add_mark(&self, path: &Path, flags: MarkFlags, mask: Mask) -> Result<(), Error> {
        self.mark_at(libc::FAN_MARK_ADD, path, flags, mask)
    }

    /// Removes `mask` from the mark on `path` (`FAN_MARK_REMOVE`). The mark
    /// goes away when its mask becomes empty.
    pub fn remove_mark(&self, path: &Path, flags: MarkFlags, mask: Mask) -> Result<(), Error> {
        self.mark_at(libc::FAN_MARK_REMOVE, path, flags, mask)
    }

    /// Adds `mask` to the mark on the object `fd` refers to.
    pub fn add_mark_fd(
        &self,
        fd: BorrowedFd<'_>,
        flags: MarkFlags,
        mask: Mask,
    ) -> Result<(), Error> {
        sys::fanotify_mark(
            self.fd.as_fd(),
            libc::FAN_MARK_ADD | flags.bits(),
            mask.bits(),
            Some(fd),
            None,
        )
        .map_err(|source| Error::Mark {
            path: format!("/proc/self/fd/{}", fd.as_raw_fd()).into(),
            source,
        })
    }

    /// Removes all inode marks (`FAN_MARK_FLUSH`).
    pub fn flush_inode_marks(&self) -> Result<(), Error> {
        sys::fanotify_mark(self.fd.as_fd(), libc::FAN_MARK_FLUSH, 0, None, None).map_err(|source| {
            Error::Mark {
                path: "(flush)".into(),
                source,
            }
        })
    }

    fn mark_at(&self, op: u32, path: &Path, flags: MarkFlags, mask: Mask) -> Result<(), Error> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| Error::Mark {
            path: path.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "path contains a NUL byte",
            ),
        })?;
        sys::fanotify_mark(
            self.fd.as_fd(),
            op | flags.bits(),
            mask.bits(),
            None,
            Some(&c),
        )
        .map_err(|source| Error::Mark {
            path: path.to_owned(),
            source,
        })
    }

    /// Reads the queued events into `out`, using `buf` (at least
    /// [`MIN_READ_BUFFER`] bytes) as scratch space. Returns how many events
    /// were added. On a non-blocking group with nothing queued this returns
    /// `Ok(0)`.
    ///
    /// Permission events come back holding a [`Permission`](crate::Permission)
    /// guard; drop or answer them promptly.
    pub fn read_events(&self, buf: &mut [u8], out: &mut Vec<Event>) -> Result<usize, Error> {
        if buf.len() < MIN_READ_BUFFER {
            return Err(Error::BufferTooSmall {
                len: buf.len(),
                min: MIN_READ_BUFFER,
            });
        }
        let n = match sys::read(self.fd.as_fd(), buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Ok(0);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Ok(0),
            Err(source) => return Err(Error::Read { source }),
        };
        let before = out.len();
        event::parse(&buf[..n], &self.fd, out)?;
        Ok(out.len() - before)
    }

    /// Reads what is queued and answers every permission event with
    /// "allow" at once. Handy for draining a group that is about to close.
    ///
    /// A blocking group is made non-blocking first, and left so, for every
    /// handle on it (see [`set_nonblocking`](Self::set_nonblocking)): a
    /// queued permission event disappears when its process is killed, so a
    /// check that something is queued does not make the next blocking
    /// `read` return.
    pub fn drain(&self) -> Result<usize, Error> {
        self.set_nonblocking(true)?;
        let mut buf = vec![0u8; MIN_READ_BUFFER];
        let mut out = Vec::new();
        let mut total = 0;
        loop {
            out.clear();
            let n = self.read_events(&mut buf, &mut out)?;
            if n == 0 {
                return Ok(total);
            }
            total += n;
        }
    }

    /// Whether reads return at once when nothing is queued (`O_NONBLOCK`
    /// on the group's open file, shared by every handle and `dup`).
    pub fn is_nonblocking(&self) -> bool {
        sys::status_flags(self.fd.as_fd()).is_ok_and(|f| f & libc::O_NONBLOCK != 0)
    }

    /// Sets or clears `O_NONBLOCK` on the group's open file: for every
    /// handle on it ([`share`](Self::share), `dup`), not only this one.
    /// Never clear it under an [`AsyncFanotify`](crate::AsyncFanotify):
    /// its reads would then block the runtime's thread.
    #[doc(alias = "fcntl")]
    pub fn set_nonblocking(&self, yes: bool) -> Result<(), Error> {
        let fd = self.fd.as_fd();
        let flags = sys::status_flags(fd).map_err(|source| Error::Flags { source })?;
        let wanted = if yes {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        if wanted != flags {
            sys::set_status_flags(fd, wanted).map_err(|source| Error::Flags { source })?;
        }
        Ok(())
    }
}

impl AsFd for Fanotify {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Fanotify {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
