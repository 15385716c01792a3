//! Flag types for `fanotify_init(2)` and `fanotify_mark(2)`.
//!
//! Unknown bits are kept (`from_bits_retain`), never rejected: a newer kernel
//! may report mask bits this crate does not know yet.

use bitflags::bitflags;

bitflags! {
    /// Event mask bits: what a mark asks for and what an event reports.
    ///
    /// See [fanotify_mark(2)](https://man7.org/linux/man-pages/man2/fanotify_mark.2.html).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Mask: u64 {
        /// A file was read.
        const ACCESS = libc::FAN_ACCESS;
        /// A file was modified.
        const MODIFY = libc::FAN_MODIFY;
        /// Metadata changed (needs an FID-reporting group). Since Linux 5.1.
        const ATTRIB = libc::FAN_ATTRIB;
        /// A file opened for writing was closed.
        const CLOSE_WRITE = libc::FAN_CLOSE_WRITE;
        /// A file not opened for writing was closed.
        const CLOSE_NOWRITE = libc::FAN_CLOSE_NOWRITE;
        /// A file or directory was opened.
        const OPEN = libc::FAN_OPEN;
        /// A file was moved out of a marked directory. Since Linux 5.1.
        const MOVED_FROM = libc::FAN_MOVED_FROM;
        /// A file was moved into a marked directory. Since Linux 5.1.
        const MOVED_TO = libc::FAN_MOVED_TO;
        /// A file was created in a marked directory. Since Linux 5.1.
        const CREATE = libc::FAN_CREATE;
        /// A file was deleted from a marked directory. Since Linux 5.1.
        const DELETE = libc::FAN_DELETE;
        /// A marked file or directory was deleted. Since Linux 5.1.
        const DELETE_SELF = libc::FAN_DELETE_SELF;
        /// A marked file or directory was moved. Since Linux 5.1.
        const MOVE_SELF = libc::FAN_MOVE_SELF;
        /// A file was opened for execution. Since Linux 5.0.
        const OPEN_EXEC = libc::FAN_OPEN_EXEC;
        /// The event queue overflowed (reported only).
        const Q_OVERFLOW = libc::FAN_Q_OVERFLOW;
        /// Permission to open a file is asked for.
        const OPEN_PERM = libc::FAN_OPEN_PERM;
        /// Permission to read a file is asked for.
        const ACCESS_PERM = libc::FAN_ACCESS_PERM;
        /// Permission to open a file for execution is asked for. Since Linux 5.0.
        #[doc(alias = "FAN_OPEN_EXEC_PERM")]
        const OPEN_EXEC_PERM = libc::FAN_OPEN_EXEC_PERM;
        /// Report events on the direct children of a marked directory.
        const EVENT_ON_CHILD = libc::FAN_EVENT_ON_CHILD;
        /// Report events on directories too.
        const ONDIR = libc::FAN_ONDIR;
        /// `CLOSE_WRITE | CLOSE_NOWRITE`.
        const CLOSE = Self::CLOSE_WRITE.bits() | Self::CLOSE_NOWRITE.bits();
        /// `MOVED_FROM | MOVED_TO`.
        const MOVE = Self::MOVED_FROM.bits() | Self::MOVED_TO.bits();
        /// Every permission bit: an event with one of these must be answered.
        const ALL_PERM = Self::OPEN_PERM.bits() | Self::ACCESS_PERM.bits() | Self::OPEN_EXEC_PERM.bits();
    }
}

impl Mask {
    /// Whether this mask holds a permission event that must be answered.
    pub fn is_permission(self) -> bool {
        self.intersects(Mask::ALL_PERM)
    }
}

bitflags! {
    /// Where a mark is attached. The default (empty) is the inode itself.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct MarkFlags: u32 {
        /// Do not follow a final symlink.
        const DONT_FOLLOW = libc::FAN_MARK_DONT_FOLLOW;
        /// Fail unless the path is a directory.
        const ONLYDIR = libc::FAN_MARK_ONLYDIR;
        /// Mark the whole mount the path is on.
        const MOUNT = libc::FAN_MARK_MOUNT;
        /// Mark the whole file system the path is on. Since Linux 4.20.
        const FILESYSTEM = libc::FAN_MARK_FILESYSTEM;
        /// The mask is an ignore mask (events to suppress).
        const IGNORED_MASK = libc::FAN_MARK_IGNORED_MASK;
        /// Keep the ignore mask when the file is modified. Without it the
        /// kernel drops the ignore mask on the first write.
        const IGNORED_SURV_MODIFY = libc::FAN_MARK_IGNORED_SURV_MODIFY;
        /// The kernel may evict the mark with the inode. Since Linux 5.19.
        const EVICTABLE = libc::FAN_MARK_EVICTABLE;
    }
}

/// The notification class of a group, which decides which events it may ask
/// for and in which order groups see an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Class {
    /// Notification only: no permission events.
    #[default]
    Notif,
    /// Permission events on final file content (`FAN_*_PERM`). Needs
    /// `CONFIG_FANOTIFY_ACCESS_PERMISSIONS`.
    #[doc(alias = "FAN_CLASS_CONTENT")]
    Content,
    /// Permission events before content is final (HSM-style tools).
    PreContent,
}

impl Class {
    pub(crate) fn bits(self) -> u32 {
        match self {
            Class::Notif => libc::FAN_CLASS_NOTIF,
            Class::Content => libc::FAN_CLASS_CONTENT,
            Class::PreContent => libc::FAN_CLASS_PRE_CONTENT,
        }
    }
}

bitflags! {
    /// What each event reports besides the mask (`fanotify_init` flags).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct Report: u32 {
        /// `pid` is the thread id of the acting thread, not its process id.
        /// Since Linux 4.20.
        #[doc(alias = "FAN_REPORT_TID")]
        const TID = libc::FAN_REPORT_TID;
        /// Events carry a file handle record instead of an fd. Since Linux 5.1.
        const FID = libc::FAN_REPORT_FID;
        /// Events carry the parent directory's handle. Since Linux 5.9.
        const DIR_FID = libc::FAN_REPORT_DIR_FID;
        /// Events carry the entry name (with `DIR_FID`). Since Linux 5.9.
        const NAME = libc::FAN_REPORT_NAME;
        /// `DIR_FID | NAME`.
        #[doc(alias = "FAN_REPORT_DFID_NAME")]
        const DFID_NAME = libc::FAN_REPORT_DFID_NAME;
        /// Events carry a pidfd for the acting process. Since Linux 5.15.
        const PIDFD = libc::FAN_REPORT_PIDFD;
    }
}
