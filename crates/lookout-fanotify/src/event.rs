//! Events read from a group, their info records, and the permission guard.

use std::ffi::OsString;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::sync::Arc;

use crate::flags::Mask;
use crate::{Error, sys};

/// Size of `struct fanotify_event_metadata`.
pub(crate) const METADATA_LEN: usize = std::mem::size_of::<libc::fanotify_event_metadata>();
const INFO_HEADER_LEN: usize = 4;
/// fsid (8 bytes) + handle_bytes (4) + handle_type (4).
const FID_FIXED_LEN: usize = 16;

/// One event read from a fanotify group.
///
/// An event owns the fd the kernel opened for it (if any). A permission
/// event owns a [`Permission`] guard instead, which answers the kernel when
/// it is dropped, so a permission event can never be left unanswered.
pub struct Event {
    mask: Mask,
    pid: i32,
    file: EventFile,
    info: Vec<InfoRecord>,
    info_error: Option<String>,
}

enum EventFile {
    None,
    Plain(OwnedFd),
    Permission(Permission),
}

impl Event {
    /// What happened. May hold several bits (the kernel merges events).
    pub fn mask(&self) -> Mask {
        self.mask
    }

    /// The process id (or thread id with [`Report::TID`](crate::Report::TID))
    /// of the process that caused the event, as seen from the group's pid
    /// namespace. `0` when that process is not visible there.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether the queue overflowed and events were lost.
    pub fn is_overflow(&self) -> bool {
        self.mask.contains(Mask::Q_OVERFLOW)
    }

    /// The fd the kernel opened on the object of the event, `None` for
    /// overflow events and FID-reporting groups.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.file {
            EventFile::None => None,
            EventFile::Plain(fd) => Some(fd.as_fd()),
            EventFile::Permission(p) => Some(p.fd.as_fd()),
        }
    }

    /// Information records (file handles, names, pidfds) after the metadata.
    pub fn info(&self) -> &[InfoRecord] {
        &self.info
    }

    /// Set when the info records after the metadata could not be parsed; the
    /// event itself (and its permission guard) is still valid.
    pub fn info_error(&self) -> Option<&str> {
        self.info_error.as_deref()
    }

    /// Takes the permission guard out of the event, for example to answer it
    /// from another task. `None` if this is not a permission event (or it was
    /// taken already). After this, [`Event::fd`] returns `None`.
    pub fn take_permission(&mut self) -> Option<Permission> {
        match std::mem::replace(&mut self.file, EventFile::None) {
            EventFile::Permission(p) => Some(p),
            other => {
                self.file = other;
                None
            }
        }
    }

    /// The path of the event's object, read from `/proc/self/fd/N`.
    pub fn path(&self) -> Option<std::path::PathBuf> {
        let fd = self.fd()?;
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("mask", &self.mask)
            .field("pid", &self.pid)
            .field("fd", &self.fd().map(|fd| fd.as_raw_fd()))
            .field("permission", &matches!(self.file, EventFile::Permission(_)))
            .field("info", &self.info)
            .finish()
    }
}

/// The kernel's verdict for a permission event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Response {
    /// Let the operation go ahead.
    #[doc(alias = "FAN_ALLOW")]
    Allow,
    /// Fail the operation with `EPERM`.
    #[doc(alias = "FAN_DENY")]
    Deny,
}

/// A pending permission event. Answer it with [`Permission::allow`] or
/// [`Permission::deny`]; dropping it unanswered allows it.
///
/// While it lives, the process that triggered the event is blocked in the
/// kernel (in `execve`, `open` or `read`). Keep it short.
pub struct Permission {
    group: Arc<OwnedFd>,
    fd: OwnedFd,
    answered: bool,
}

impl Permission {
    /// The fd of the file the permission is asked for.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Allows the operation.
    pub fn allow(self) -> Result<(), Error> {
        self.respond(Response::Allow)
    }

    /// Denies the operation (the caller sees `EPERM`).
    pub fn deny(self) -> Result<(), Error> {
        self.respond(Response::Deny)
    }

    /// Answers with `response`.
    pub fn respond(mut self, response: Response) -> Result<(), Error> {
        self.answered = true;
        write(&self.group, &self.fd, response)
    }
}

fn write(group: &OwnedFd, fd: &OwnedFd, response: Response) -> Result<(), Error> {
    let bits = match response {
        Response::Allow => libc::FAN_ALLOW,
        Response::Deny => libc::FAN_DENY,
    };
    sys::write_response(group.as_fd(), fd.as_raw_fd(), bits).map_err(|source| Error::Respond {
        fd: fd.as_raw_fd(),
        source,
    })
}

impl Drop for Permission {
    fn drop(&mut self) {
        if !self.answered {
            // N.B. an error here means the group is gone or the event was
            // already answered; in both cases the kernel no longer waits.
            let _ = write(&self.group, &self.fd, Response::Allow);
        }
    }
}

impl fmt::Debug for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permission")
            .field("fd", &self.fd.as_raw_fd())
            .field("answered", &self.answered)
            .finish()
    }
}

/// An information record that follows the event metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InfoRecord {
    /// A file handle record (`FAN_EVENT_INFO_TYPE_FID`, `DFID`,
    /// `DFID_NAME`, `OLD_DFID_NAME`, `NEW_DFID_NAME`).
    Fid {
        /// Which kind of record it was.
        kind: FidKind,
        /// The file system id (`statfs.f_fsid`).
        fsid: [i32; 2],
        /// The handle, usable with `open_by_handle_at(2)`.
        handle: FileHandle,
        /// The entry name, for the `*_NAME` kinds.
        name: Option<OsString>,
    },
    /// A pidfd for the acting process (`FAN_REPORT_PIDFD`), or the negative
    /// error the kernel put there.
    Pidfd(i32),
    /// A record type this crate does not parse; kept raw.
    Unknown {
        /// `info_type` from the record header.
        info_type: u8,
        /// The record body after the 4-byte header.
        body: Vec<u8>,
    },
}

/// Which object a file-handle record describes. Non-exhaustive: the
/// kernel adds record types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FidKind {
    /// The object itself.
    Fid,
    /// The parent directory.
    Dfid,
    /// The parent directory and the entry name.
    DfidName,
    /// The old parent and name of a rename.
    OldDfidName,
    /// The new parent and name of a rename.
    NewDfidName,
}

/// A kernel file handle (`struct file_handle`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FileHandle {
    /// `handle_type`.
    pub handle_type: i32,
    /// `f_handle`.
    pub bytes: Vec<u8>,
}

fn u16_at(buf: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes([buf[off], buf[off + 1]])
}
fn u32_at(buf: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
}
fn i32_at(buf: &[u8], off: usize) -> i32 {
    u32_at(buf, off) as i32
}
fn u64_at(buf: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[off..off + 8]);
    u64::from_ne_bytes(b)
}

/// Parses the bytes of one `read(2)` on a group fd into `out`.
///
/// Every fd found in a metadata header is adopted at once (and, for a
/// permission event, wrapped in a [`Permission`]) before anything else is
/// checked, so that even a malformed buffer cannot leak an fd or leave a
/// permission event unanswered. An event with an unknown metadata version
/// is handed out with an `info_error` and parsing goes on after it, so the
/// events behind it are adopted too; only an event whose length cannot be
/// trusted stops the parse (where the next one starts is then unknown).
/// The first problem is returned; every event parsed stays in `out`.
///
/// The buffer must come from `read(2)` on a fanotify fd: the fds in it are
/// taken over (and eventually closed) by the returned events.
pub(crate) fn parse(buf: &[u8], group: &Arc<OwnedFd>, out: &mut Vec<Event>) -> Result<(), Error> {
    parse_with(buf, out, |fd, mask| {
        if fd < 0 {
            return EventFile::None;
        }
        // SAFETY: a non-negative fd in an event read from the group was
        // installed in our fd table by the kernel for us alone (the
        // caller's contract).
        let owned = unsafe { sys::adopt_fd(fd) };
        if mask.is_permission() {
            EventFile::Permission(Permission {
                group: Arc::clone(group),
                fd: owned,
                answered: false,
            })
        } else {
            EventFile::Plain(owned)
        }
    })
}

/// [`parse`] with the adoption of each event's fd left to `adopt`, called
/// exactly once per event header reached, before anything else about that
/// event is checked.
fn parse_with(
    buf: &[u8],
    out: &mut Vec<Event>,
    mut adopt: impl FnMut(i32, Mask) -> EventFile,
) -> Result<(), Error> {
    let mut off = 0;
    // The first problem found; parsing goes on past an event whose length
    // can still be trusted, so that every later event's fd is adopted (and
    // every permission event answered) too.
    let mut first_error: Option<Error> = None;
    while off < buf.len() {
        let rest = &buf[off..];
        if rest.len() < METADATA_LEN {
            return Err(Error::Malformed {
                offset: off,
                reason: format!("{} trailing bytes, shorter than the metadata", rest.len()),
            });
        }
        // Field offsets of struct fanotify_event_metadata (uapi, version 3).
        let event_len = u32_at(rest, 0) as usize;
        let vers = rest[4];
        let metadata_len = u16_at(rest, 6) as usize;
        let mask = Mask::from_bits_retain(u64_at(rest, 8));
        let fd = i32_at(rest, 16);
        let pid = i32_at(rest, 20);

        let file = adopt(fd, mask);
        let mut event = Event {
            mask,
            pid,
            file,
            info: Vec::new(),
            info_error: None,
        };

        if event_len < METADATA_LEN || event_len > rest.len() {
            // Where the next event starts is unknown: stop here. (Guessing
            // would risk "adopting", and closing, an fd that is not ours.)
            out.push(event);
            return Err(first_error.unwrap_or(Error::Malformed {
                offset: off,
                reason: format!(
                    "event_len {event_len} outside {METADATA_LEN}..={}",
                    rest.len()
                ),
            }));
        }
        if vers != libc::FANOTIFY_METADATA_VERSION {
            // Its length is usable: hand it out (its fd answered) and go on.
            let reason = format!(
                "metadata version {vers}, expected {}",
                libc::FANOTIFY_METADATA_VERSION
            );
            event.info_error = Some(reason.clone());
            out.push(event);
            first_error.get_or_insert(Error::Malformed {
                offset: off,
                reason,
            });
            off += event_len;
            continue;
        }
        if metadata_len < METADATA_LEN || metadata_len > event_len {
            event.info_error = Some(format!("metadata_len {metadata_len} out of range"));
        } else if let Err(reason) = parse_info(&rest[metadata_len..event_len], &mut event.info) {
            event.info_error = Some(reason);
        }
        out.push(event);
        off += event_len;
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The parser, for fuzzing: `cfg(fuzzing)` only (cargo-fuzz sets it).
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// Parses `buf` as if read from a group, without taking any fd: the
    /// events' fds are recorded instead. Returns the fd field of every
    /// event header the parser reached, in order, and whether it accepted
    /// the whole buffer. Panics if an event was handed out without its fd
    /// being seen first, or if the events do not account for the buffer.
    pub fn parse(buf: &[u8]) -> (Vec<i32>, bool) {
        let mut fds = Vec::new();
        let mut out = Vec::new();
        let ok = parse_with(buf, &mut out, |fd, _| {
            fds.push(fd);
            EventFile::None
        })
        .is_ok();
        assert_eq!(out.len(), fds.len(), "every event's fd is seen once");
        for e in &out {
            let _ = (e.mask(), e.pid(), e.info(), e.info_error(), e.path());
        }
        if ok {
            assert!(buf.is_empty() || !out.is_empty());
        }
        (fds, ok)
    }
}

fn parse_info(mut buf: &[u8], out: &mut Vec<InfoRecord>) -> Result<(), String> {
    while !buf.is_empty() {
        if buf.len() < INFO_HEADER_LEN {
            return Err(format!(
                "{} bytes left, shorter than a record header",
                buf.len()
            ));
        }
        let info_type = buf[0];
        let len = u16_at(buf, 2) as usize;
        if len < INFO_HEADER_LEN || len > buf.len() {
            return Err(format!("record length {len} outside 4..={}", buf.len()));
        }
        let body = &buf[INFO_HEADER_LEN..len];
        let kind = match info_type {
            libc::FAN_EVENT_INFO_TYPE_FID => Some(FidKind::Fid),
            libc::FAN_EVENT_INFO_TYPE_DFID => Some(FidKind::Dfid),
            libc::FAN_EVENT_INFO_TYPE_DFID_NAME => Some(FidKind::DfidName),
            libc::FAN_EVENT_INFO_TYPE_OLD_DFID_NAME => Some(FidKind::OldDfidName),
            libc::FAN_EVENT_INFO_TYPE_NEW_DFID_NAME => Some(FidKind::NewDfidName),
            _ => None,
        };
        let record = match (kind, info_type) {
            (Some(kind), _) => parse_fid(kind, body)?,
            (None, libc::FAN_EVENT_INFO_TYPE_PIDFD) if body.len() >= 4 => {
                InfoRecord::Pidfd(i32_at(body, 0))
            }
            (None, _) => InfoRecord::Unknown {
                info_type,
                body: body.to_vec(),
            },
        };
        out.push(record);
        buf = &buf[len..];
    }
    Ok(())
}

fn parse_fid(kind: FidKind, body: &[u8]) -> Result<InfoRecord, String> {
    if body.len() < FID_FIXED_LEN {
        return Err(format!("fid record body of {} bytes", body.len()));
    }
    let fsid = [i32_at(body, 0), i32_at(body, 4)];
    let handle_bytes = u32_at(body, 8) as usize;
    let handle_type = i32_at(body, 12);
    let end = FID_FIXED_LEN
        .checked_add(handle_bytes)
        .filter(|&e| e <= body.len())
        .ok_or_else(|| format!("handle of {handle_bytes} bytes overruns the record"))?;
    let handle = FileHandle {
        handle_type,
        bytes: body[FID_FIXED_LEN..end].to_vec(),
    };
    let name = match kind {
        FidKind::DfidName | FidKind::OldDfidName | FidKind::NewDfidName => {
            // The name is NUL-terminated and the record padded to 4 bytes.
            let tail = &body[end..];
            let n = tail.iter().position(|&b| b == 0).unwrap_or(tail.len());
            Some(OsString::from_vec(tail[..n].to_vec()))
        }
        _ => None,
    };
    Ok(InfoRecord::Fid {
        kind,
        fsid,
        handle,
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group() -> Arc<OwnedFd> {
        // Any fd will do as a stand-in group: these tests never answer.
        Arc::new(OwnedFd::from(
            std::fs::File::open("/dev/null").expect("open /dev/null"),
        ))
    }

    fn metadata(event_len: u32, metadata_len: u16, mask: u64, fd: i32, pid: i32) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&event_len.to_ne_bytes());
        v.push(libc::FANOTIFY_METADATA_VERSION);
        v.push(0);
        v.extend_from_slice(&metadata_len.to_ne_bytes());
        v.extend_from_slice(&mask.to_ne_bytes());
        v.extend_from_slice(&fd.to_ne_bytes());
        v.extend_from_slice(&pid.to_ne_bytes());
        v
    }

    fn dfid_name(name: &[u8]) -> Vec<u8> {
        let handle = [0xaa_u8; 8];
        let mut body = Vec::new();
        body.extend_from_slice(&7_i32.to_ne_bytes());
        body.extend_from_slice(&9_i32.to_ne_bytes());
        body.extend_from_slice(&(handle.len() as u32).to_ne_bytes());
        body.extend_from_slice(&1_i32.to_ne_bytes());
        body.extend_from_slice(&handle);
        body.extend_from_slice(name);
        body.push(0);
        while !(body.len() + INFO_HEADER_LEN).is_multiple_of(4) {
            body.push(0);
        }
        let mut rec = vec![libc::FAN_EVENT_INFO_TYPE_DFID_NAME, 0];
        rec.extend_from_slice(&((body.len() + INFO_HEADER_LEN) as u16).to_ne_bytes());
        rec.extend_from_slice(&body);
        rec
    }

    #[test]
    fn parses_two_events_without_fds() {
        let mut buf = metadata(24, 24, libc::FAN_Q_OVERFLOW, libc::FAN_NOFD, 0);
        let rec = dfid_name(b"init.pid");
        buf.extend(metadata(
            24 + rec.len() as u32,
            24,
            libc::FAN_CREATE,
            libc::FAN_NOFD,
            42,
        ));
        buf.extend(&rec);
        let mut out = Vec::new();
        parse(&buf, &group(), &mut out).expect("valid buffer");
        assert_eq!(out.len(), 2);
        assert!(out[0].is_overflow());
        assert!(out[0].fd().is_none());
        assert_eq!(out[1].pid(), 42);
        assert_eq!(out[1].mask(), Mask::CREATE);
        match &out[1].info()[0] {
            InfoRecord::Fid {
                kind,
                fsid,
                handle,
                name,
                ..
            } => {
                assert_eq!(*kind, FidKind::DfidName);
                assert_eq!(*fsid, [7, 9]);
                assert_eq!(handle.bytes, vec![0xaa; 8]);
                assert_eq!(name.as_deref(), Some(std::ffi::OsStr::new("init.pid")));
            }
            other => panic!("unexpected record {other:?}"),
        }
    }

    #[test]
    fn rejects_event_len_below_metadata() {
        let buf = metadata(8, 24, libc::FAN_OPEN, libc::FAN_NOFD, 1);
        let mut out = Vec::new();
        let err = parse(&buf, &group(), &mut out).expect_err("event_len 8 is invalid");
        assert!(matches!(err, Error::Malformed { offset: 0, .. }), "{err}");
        // The event is still handed out so that its fd would be answered.
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn rejects_event_len_past_buffer_and_truncated_tail() {
        let buf = metadata(4096, 24, libc::FAN_OPEN, libc::FAN_NOFD, 1);
        assert!(parse(&buf, &group(), &mut Vec::new()).is_err());
        let mut buf = metadata(24, 24, libc::FAN_OPEN, libc::FAN_NOFD, 1);
        buf.extend_from_slice(&[0; 10]);
        let mut out = Vec::new();
        assert!(parse(&buf, &group(), &mut out).is_err());
        assert_eq!(out.len(), 1, "the complete first event survives");
    }

    #[test]
    fn keeps_unknown_mask_bits_and_records() {
        let rec = [200u8, 0, 8, 0, 1, 2, 3, 4];
        let mut buf = metadata(32, 24, 1 << 40 | libc::FAN_OPEN, libc::FAN_NOFD, 5);
        buf.extend_from_slice(&rec);
        let mut out = Vec::new();
        parse(&buf, &group(), &mut out).expect("valid");
        assert_eq!(out[0].mask().bits(), 1 << 40 | libc::FAN_OPEN);
        assert_eq!(
            out[0].info(),
            &[InfoRecord::Unknown {
                info_type: 200,
                body: vec![1, 2, 3, 4]
            }]
        );
    }

    #[test]
    fn bad_record_is_reported_on_the_event_not_fatal() {
        let rec = [libc::FAN_EVENT_INFO_TYPE_FID, 0, 200, 0];
        let mut buf = metadata(28, 24, libc::FAN_ATTRIB, libc::FAN_NOFD, 5);
        buf.extend_from_slice(&rec);
        let mut out = Vec::new();
        parse(&buf, &group(), &mut out).expect("the event itself is valid");
        assert!(out[0].info_error().is_some());
    }

    #[test]
    fn events_after_one_with_a_bad_version_are_still_adopted() {
        let fds: Vec<i32> = (0..2)
            .map(|_| {
                let raw = OwnedFd::from(std::fs::File::open("/dev/null").expect("open"));
                let n = raw.as_raw_fd();
                std::mem::forget(raw); // ownership moves into the parsed events
                n
            })
            .collect();
        let mut buf = metadata(24, 24, libc::FAN_OPEN, fds[0], 1);
        buf[4] = 99; // a metadata version we do not know
        buf.extend_from_slice(&metadata(24, 24, libc::FAN_OPEN, fds[1], 2));
        let mut out = Vec::new();
        let err = parse(&buf, &group(), &mut out).expect_err("version 99");
        assert!(matches!(err, Error::Malformed { offset: 0, .. }), "{err}");
        assert_eq!(out.len(), 2, "the event after the bad one is parsed too");
        assert_eq!(out[0].fd().map(|f| f.as_raw_fd()), Some(fds[0]));
        assert!(out[0].info_error().is_some());
        assert_eq!(out[1].fd().map(|f| f.as_raw_fd()), Some(fds[1]));
        assert_eq!(out[1].pid(), 2);
    }

    #[test]
    fn adopts_and_closes_event_fds() {
        let file = std::fs::File::open("/dev/null").expect("open");
        let raw = OwnedFd::from(file);
        let n = raw.as_raw_fd();
        std::mem::forget(raw); // ownership moves into the parsed event
        let buf = metadata(24, 24, libc::FAN_OPEN, n, 1);
        let mut out = Vec::new();
        parse(&buf, &group(), &mut out).expect("valid");
        assert_eq!(out[0].fd().map(|f| f.as_raw_fd()), Some(n));
    }
}
