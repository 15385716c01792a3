//! The only place where this crate calls into the kernel. Every wrapper is a
//! thin, commented shim over one syscall that turns `-1` into `io::Error`.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// `fanotify_init(2)`.
pub(crate) fn fanotify_init(flags: u32, event_f_flags: u32) -> io::Result<OwnedFd> {
    // SAFETY: fanotify_init takes two integers and returns a new fd or -1.
    let fd = unsafe { libc::fanotify_init(flags, event_f_flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fanotify_mark(2)`. `dirfd` is `AT_FDCWD` when `None`; `path` is
/// resolved relative to it (or names `dirfd` itself when `None`).
pub(crate) fn fanotify_mark(
    group: BorrowedFd<'_>,
    flags: u32,
    mask: u64,
    dirfd: Option<BorrowedFd<'_>>,
    path: Option<&CStr>,
) -> io::Result<()> {
    let dirfd: RawFd = dirfd.map_or(libc::AT_FDCWD, |fd| fd.as_raw_fd());
    let path = path.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: all fds are borrowed and open for the duration of the call, and
    // `path` is either null or a NUL-terminated string that outlives the call.
    let rc = unsafe { libc::fanotify_mark(group.as_raw_fd(), flags, mask, dirfd, path) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `read(2)` on the group fd into `buf`. Returns the number of bytes read.
pub(crate) fn read(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // N.B. n >= 0 was just checked, so the cast cannot wrap.
    Ok(n as usize)
}

/// `fcntl(F_GETFL)`: the open file's status flags.
pub(crate) fn status_flags(fd: BorrowedFd<'_>) -> io::Result<i32> {
    // SAFETY: F_GETFL takes no argument and only reads the borrowed fd.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(flags)
}

/// `fcntl(F_SETFL, flags)`.
pub(crate) fn set_status_flags(fd: BorrowedFd<'_>, flags: i32) -> io::Result<()> {
    // SAFETY: F_SETFL takes an int and changes only the borrowed fd's open
    // file's status flags.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Writes one `struct fanotify_response` to the group fd.
pub(crate) fn write_response(
    group: BorrowedFd<'_>,
    event_fd: RawFd,
    response: u32,
) -> io::Result<()> {
    let resp = libc::fanotify_response {
        fd: event_fd,
        response,
    };
    let len = std::mem::size_of::<libc::fanotify_response>();
    // SAFETY: `resp` is a plain C struct that lives across the call and is
    // exactly `len` bytes long.
    let n = unsafe { libc::write(group.as_raw_fd(), (&raw const resp).cast(), len) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != len {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short write of fanotify_response",
        ));
    }
    Ok(())
}

/// Adopts an fd number that the kernel installed in our table as part of an
/// fanotify event.
///
/// # Safety
/// `fd` must be an open fd that no other owner will close.
pub(crate) unsafe fn adopt_fd(fd: RawFd) -> OwnedFd {
    // SAFETY: forwarded to the caller.
    unsafe { OwnedFd::from_raw_fd(fd) }
}
