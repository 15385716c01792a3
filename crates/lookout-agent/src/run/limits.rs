//! Process limits and memory the agent adjusts for itself at start-up.

/// Raises the soft open-file limit to the hard one. The agent's fds grow
/// with tracked containers (a pidfd each), running hooks, queued permission
/// events and HTTP connections; when fanotify cannot install an event's fd
/// the kernel answers the permission event with a *deny*, and runtime execs
/// fail across the node. Failing to raise it is logged, not fatal.
pub(super) fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::info!(from = soft, to = hard, "raised the open-file limit"),
            Err(e) => tracing::warn!(%e, soft, hard, "cannot raise the open-file limit"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(%e, "cannot read the open-file limit"),
    }
}

/// Lifts the locked-memory limit, which kernels before 5.11 charge BPF
/// maps to (later ones charge the memory cgroup and ignore it). Raising
/// the hard limit takes `CAP_SYS_RESOURCE`; without it, BPF maps on such
/// kernels fail to load and the agent steps down to `fanotify`.
pub(super) fn raise_memlock_limit() {
    use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, hard)) if soft == RLIM_INFINITY && hard == RLIM_INFINITY => {}
        Ok((soft, hard)) => match setrlimit(Resource::RLIMIT_MEMLOCK, RLIM_INFINITY, RLIM_INFINITY)
        {
            Ok(()) => tracing::debug!(soft, hard, "lifted the locked-memory limit"),
            Err(e) if kernel_before(5, 11) => tracing::warn!(
                %e,
                soft,
                hard,
                "cannot lift the locked-memory limit, which BPF maps need on this kernel \
                 (grant CAP_SYS_RESOURCE)"
            ),
            Err(e) => tracing::debug!(%e, soft, hard, "cannot lift the locked-memory limit"),
        },
        Err(e) => tracing::debug!(%e, "cannot read the locked-memory limit"),
    }
}

/// Whether the running kernel is older than `major.minor` (unknown: no).
fn kernel_before(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(a), Some(b)) => (a, b) < (major, minor),
        _ => false,
    }
}

/// Start-up parses the kernel's BTF (tens of MB, inside aya) and verifier
/// logs; give the freed heap back to the kernel so that the agent's
/// resident size reflects what it keeps. The embedded BPF object (about
/// 440 KB of the binary's read-only data, read whole by each load) is not
/// needed once loaded: its pages leave the agent's resident set too (they
/// stay in the page cache, and come back from the binary if a later load
/// reads them).
pub(super) fn release_startup_memory(bpf_object: Option<&'static [u8]>) {
    // SAFETY: malloc_trim only walks glibc's own heap; no pointers passed.
    unsafe { libc::malloc_trim(0) };
    if let Some(object) = bpf_object {
        drop_resident_pages(object);
    }
}

/// `madvise(MADV_DONTNEED)` on the whole pages inside `bytes`, a static in
/// the binary's read-only data: a private file mapping never written, so
/// a later read faults the same bytes back in from the file.
fn drop_resident_pages(bytes: &'static [u8]) {
    let page = 4096usize;
    let start = (bytes.as_ptr() as usize).div_ceil(page) * page;
    let end = (bytes.as_ptr() as usize + bytes.len()) / page * page;
    if end <= start {
        return;
    }
    // SAFETY: the range is whole pages inside a 'static read-only slice;
    // MADV_DONTNEED on a private, unwritten file mapping only drops this
    // process's page table entries (the contents stay the file's).
    let r = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    if r == 0 {
        tracing::debug!(
            kib = (end - start) / 1024,
            "the BPF object's pages left the resident set"
        );
    } else {
        tracing::debug!(error = %std::io::Error::last_os_error(), "the BPF object's pages stay resident");
    }
}
