//! tracefs: where tracepoint ids come from.
//!
//! Attaching a tracepoint program needs the tracepoint's id, which only
//! tracefs publishes (`events/<category>/<name>/id`). Most distributions
//! mount it at boot (systemd does), but minimal VMs and some container
//! images do not. [`ensure_tracefs`] mounts it at its standard place when it
//! is missing, which is what the node's init would have done.

use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Standard tracefs mount points, in the order the kernel docs give.
pub const TRACEFS_PATHS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// Where tracefs is mounted, if anywhere.
pub fn tracefs_path() -> Option<PathBuf> {
    TRACEFS_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("events").is_dir())
}

/// What [`ensure_tracefs`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tracefs {
    /// It was mounted already, at this path.
    Present(PathBuf),
    /// We mounted it at this path.
    Mounted(PathBuf),
}

/// Makes sure tracefs is mounted, mounting it at `/sys/kernel/tracing` if
/// needed (needs `CAP_SYS_ADMIN`). Returns a readable reason on failure.
pub fn ensure_tracefs() -> Result<Tracefs, String> {
    if let Some(p) = tracefs_path() {
        return Ok(Tracefs::Present(p));
    }
    let target = Path::new(TRACEFS_PATHS[0]);
    if !target.is_dir() {
        return Err(format!(
            "tracefs is not mounted and {} does not exist",
            target.display()
        ));
    }
    let c_target = CString::new(TRACEFS_PATHS[0]).map_err(|e| e.to_string())?;
    let fstype = c"tracefs";
    let source = c"nodev";
    // SAFETY: all pointers are NUL-terminated strings that outlive the call;
    // `data` may be null for tracefs.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            c_target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "tracefs is not mounted and mounting it at {} failed: {} (mount it on the host: \
             mount -t tracefs nodev /sys/kernel/tracing)",
            target.display(),
            crate::errno::describe(&e)
        ));
    }
    Ok(Tracefs::Mounted(target.to_path_buf()))
}
