//! Fanotify checks: permission class, exec-permission marks, TID and
//! DFID_NAME reporting. Every group created here is closed before the check
//! returns; an exec-permission mark lives only between two syscalls, and
//! the group is drained (allowing any exec caught in that window) before it
//! closes.

use std::path::{Path, PathBuf};

use lookout_fanotify::{Class, Error as FanError, Fanotify, MarkFlags, Mask, Report};

use crate::RuntimeBinary;
use crate::errno::errno_name;
use crate::report::Fail;

/// The results of the fanotify checks.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FanotifyFacts {
    /// `fanotify_init(FAN_CLASS_CONTENT)`.
    pub init: Result<String, Fail>,
    /// A `FAN_OPEN_EXEC_PERM` mark on a runtime binary (or a temp file).
    pub exec_mark: Result<String, Fail>,
    /// `FAN_REPORT_TID` with the content class.
    pub report_tid: Result<String, Fail>,
    /// `FAN_REPORT_DFID_NAME` with a directory mark.
    pub dfid_name: Result<String, Fail>,
}

/// Explains a failed `fanotify_init` the way an operator needs it.
pub fn explain_init(err: &FanError) -> String {
    let errno = err.errno().unwrap_or(0);
    let cause = match errno {
        libc::EPERM => {
            "missing CAP_SYS_ADMIN in the initial user namespace, or a seccomp/SELinux/AppArmor \
             policy denies fanotify_init (as on GKE Autopilot)"
        }
        libc::ENOSYS => {
            "fanotify_init is not implemented here: a kernel without CONFIG_FANOTIFY, a seccomp \
             filter, or a sandbox such as gVisor"
        }
        libc::EINVAL => {
            "the kernel rejects the flags: permission events need \
             CONFIG_FANOTIFY_ACCESS_PERMISSIONS, FAN_REPORT_TID needs Linux 4.20, \
             FAN_REPORT_DFID_NAME needs Linux 5.9"
        }
        libc::EMFILE => {
            "too many fanotify groups for this user (fs.fanotify.max_user_groups) or fds"
        }
        libc::ENOMEM => "the kernel is out of memory for a new group",
        _ => "unexpected error",
    };
    format!("fanotify_init: {}: {cause}", errno_name(errno))
}

fn explain_mark(err: &FanError, path: &Path) -> String {
    let errno = err.errno().unwrap_or(0);
    let cause = match errno {
        libc::EINVAL => "the kernel lacks FAN_OPEN_EXEC_PERM (Linux 5.0) or this mark type",
        libc::EXDEV | libc::ENODEV | libc::ENOTSUP => {
            "the file system holding it does not support fanotify marks (no fsid; e.g. some FUSE \
             or overlay setups)"
        }
        libc::EACCES | libc::EPERM => {
            "not allowed to read the file (CAP_DAC_READ_SEARCH?) or a security policy denies the mark"
        }
        libc::ENOENT => "the file vanished",
        libc::ENOSPC => "too many marks (fs.fanotify.max_user_marks)",
        _ => "unexpected error",
    };
    format!(
        "fanotify_mark {}: {}: {cause}",
        path.display(),
        errno_name(errno)
    )
}

/// Runs the fanotify checks. `runtimes` gives the file to mark; with none,
/// a temporary executable stands in.
pub fn probe(runtimes: &[RuntimeBinary], host_root: &Path) -> FanotifyFacts {
    let content = Fanotify::builder().class(Class::Content).init();
    let (init, exec_mark) = match content {
        Err(e) => {
            let reason = explain_init(&e);
            let skipped = Fail::unsupported("not tried: fanotify_init(FAN_CLASS_CONTENT) failed");
            (Err(Fail::unsupported(reason)), Err(skipped))
        }
        Ok(group) => {
            let mark = exec_mark(&group, runtimes);
            // N.B. drop the group here, not at the end of probe(): the
            // kernel then lets through anything the mark window caught.
            let _ = group.drain();
            drop(group);
            (
                Ok("FAN_CLASS_CONTENT group created (permission events available)".to_owned()),
                mark,
            )
        }
    };

    let report_tid = match Fanotify::builder()
        .class(Class::Content)
        .report(Report::TID)
        .init()
    {
        Ok(_) => Ok("FAN_REPORT_TID with FAN_CLASS_CONTENT".to_owned()),
        Err(e) => Err(Fail::unsupported(explain_init(&e))),
    };

    let dfid_name = dfid_name(host_root);
    FanotifyFacts {
        init,
        exec_mark,
        report_tid,
        dfid_name,
    }
}

fn exec_mark(group: &Fanotify, runtimes: &[RuntimeBinary]) -> Result<String, Fail> {
    // Prefer the real binary: marks can fail per file system.
    let (path, _tmp): (PathBuf, Option<tempfile::TempPath>) = match runtimes.first() {
        Some(rt) => (rt.resolved.clone(), None),
        None => {
            let tmp = tempfile::Builder::new()
                .prefix("lookout-probe-exec")
                .tempfile()
                .map_err(|e| Fail::error(format!("creating a temporary file to mark: {e}")))?
                .into_temp_path();
            (tmp.to_path_buf(), Some(tmp))
        }
    };
    group
        .add_mark(&path, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        .map_err(|e| Fail::unsupported(explain_mark(&e, &path)))?;
    // Remove at once: a runtime exec that hits the mark now waits for us.
    let removed = group.remove_mark(&path, MarkFlags::empty(), Mask::OPEN_EXEC_PERM);
    if let Err(e) = removed {
        return Err(Fail::error(format!(
            "removing the probe's mark: {}",
            crate::chain(&e)
        )));
    }
    Ok(format!("FAN_OPEN_EXEC_PERM mark on {}", path.display()))
}

fn dfid_name(host_root: &Path) -> Result<String, Fail> {
    let group = Fanotify::builder()
        .class(Class::Notif)
        .report(Report::DFID_NAME)
        .init()
        .map_err(|e| Fail::unsupported(explain_init(&e)))?;
    let run = host_root.join("run");
    let tmp;
    let dir: &Path = if run.is_dir() {
        &run
    } else {
        tmp = tempfile::tempdir().map_err(|e| Fail::error(format!("temporary directory: {e}")))?;
        tmp.path()
    };
    let mask = Mask::CREATE | Mask::MOVED_TO | Mask::DELETE | Mask::ONDIR;
    group
        .add_mark(dir, MarkFlags::ONLYDIR, mask)
        .map_err(|e| Fail::unsupported(explain_mark(&e, dir)))?;
    Ok(format!(
        "FAN_REPORT_DFID_NAME group with a directory mark on {}",
        dir.display()
    ))
}
