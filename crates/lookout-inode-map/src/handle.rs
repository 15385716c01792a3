//! File handles (`name_to_handle_at`), for [`Mode::Hashed`](crate::Mode::Hashed).

use std::ffi::CStr;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The file handle of `name` in `dir` (of `dir` itself when `name` is
/// empty), without following a symlink: a symlink's own handle. `None`
/// when the file system has none (`name_to_handle_at` fails).
///
/// [`Mode::Hashed`](crate::Mode::Hashed) numbers files from it: ext4, XFS
/// and btrfs keep a file's handle across mounts and reboots, and give a
/// reused inode a new one (the handle carries a generation).
///
/// ```
/// use std::os::fd::AsFd;
/// let dir = std::fs::File::open(std::env::temp_dir()).unwrap();
/// // Of the directory itself; tmpfs and most disk file systems have them.
/// let handle = lookout_inode_map::file_handle_at(dir.as_fd(), c"");
/// println!("{handle:?}");
/// ```
pub fn file_handle_at(dir: BorrowedFd<'_>, name: &CStr) -> Option<Vec<u8>> {
    const MAX_HANDLE_SZ: usize = 128;
    // struct file_handle { u32 handle_bytes; i32 handle_type; u8 f_handle[]; }
    let mut buf = vec![0u8; 8 + MAX_HANDLE_SZ];
    buf[..4].copy_from_slice(&(MAX_HANDLE_SZ as u32).to_ne_bytes());
    let mut mount_id: libc::c_int = 0;
    let flags = if name.is_empty() {
        libc::AT_EMPTY_PATH
    } else {
        0
    };
    // SAFETY: `buf` is a file_handle with room for MAX_HANDLE_SZ bytes;
    // `dir` is an open fd, `name` is NUL-terminated, mount_id is a valid
    // out-pointer.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            dir.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr(),
            &mut mount_id,
            flags,
        )
    };
    if rc != 0 {
        return None;
    }
    let n = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    buf.truncate(8 + n.min(MAX_HANDLE_SZ));
    Some(buf)
}
