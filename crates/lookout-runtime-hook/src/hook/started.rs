//! The moment after a container's start: the runtime's `start` exited and
//! the container left its exec fifo (runc and crun remove
//! `<root>/<id>/exec.fifo` once the container's process is released,
//! and call a container with the fifo `created`). Told to the start
//! barrier ([`StartBarrier::started`]), where `poststart` hooks begin.
//!
//! A watcher of its own, beside the lifecycle: it changes no state there
//! and needs none from it, only the `start` exec's process and its
//! command line.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lookout_model::StartBarrier;

/// The longest a `start` is watched: a runtime's `start` returns once the
/// container's process is released (plus the runtime's own
/// `startContainer` hooks, bounded by their timeouts).
const START_RETURN_DEADLINE: Duration = Duration::from_secs(120);

/// How long after `start` returned the container's process may take to
/// exec its program (it is released, and execs at once).
const EXEC_WAIT: Duration = Duration::from_secs(1);

/// Watches the `start` exec `pid` of container `id` (whose exec fifo is
/// `fifo`, as this process sees it, and whose init is `init` when known)
/// and tells `barrier` once it returned with the container started and its
/// process past the exec of its program (the runtime spec: `poststart`
/// runs "after the user-specified process is executed"). The pidfd is
/// opened now, while the exec is held or just allowed, so a reused pid is
/// never watched.
pub(super) fn watch(
    pid: u32,
    init: Option<u32>,
    fifo: PathBuf,
    id: String,
    barrier: Arc<dyn StartBarrier>,
) {
    // The runtime's init program, which the container's process replaces.
    let waiting = init.and_then(|i| exe_of(i).map(|exe| (i, exe)));
    let pidfd = match crate::pidfd::pidfd_open(pid) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::debug!(id, pid, error = %e, "`start` exited before it could be watched");
            // Gone already (fanotify-only mode reads argv after the
            // exec): the fifo alone tells.
            if !fifo_exists(&fifo) {
                barrier.started(&id);
            }
            return;
        }
    };
    tokio::spawn(async move {
        let exited = tokio::time::timeout(START_RETURN_DEADLINE, crate::pidfd::wait_exit(pidfd));
        if !matches!(exited.await, Ok(Ok(()))) {
            tracing::warn!(
                id,
                deadline = ?START_RETURN_DEADLINE,
                "the runtime's `start` did not return: what runs after a start (poststart hooks) does not run"
            );
            return;
        }
        if fifo_exists(&fifo) {
            // Denied, or failed: the container was not released.
            tracing::debug!(id, "`start` returned with the container not started");
            return;
        }
        if let Some((init, before)) = waiting {
            let until = tokio::time::Instant::now() + EXEC_WAIT;
            let mut pause = Duration::from_micros(250);
            while exe_of(init).is_some_and(|now| now == before) {
                if tokio::time::Instant::now() >= until {
                    tracing::debug!(
                        id,
                        init,
                        "the container's process has not exec'd its program yet"
                    );
                    break;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(50));
            }
        }
        barrier.started(&id);
    });
}

/// The file `pid` executes, as its path; `None` once it is gone. A
/// readlink: the link's text comes from the kernel, never from the file
/// system the container's program is on (a stat there could hang on a
/// file system the container chose).
fn exe_of(pid: u32) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/exe")).ok()
}

fn fifo_exists(fifo: &std::path::Path) -> bool {
    // symlink_metadata: a name that is there at all (not followed).
    std::fs::symlink_metadata(fifo).is_ok()
}
