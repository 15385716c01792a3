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
/// `fifo`, as this process sees it, and whose init is `waiting` when known)
/// and tells `barrier` once it returned with the container started and its
/// process past the exec of its program (the runtime spec: `poststart`
/// runs "after the user-specified process is executed"). Called once the
/// `start` is allowed, which it then runs: its pidfd, opened now, is its
/// (a pid reused later is never watched).
pub(super) fn watch(
    pid: u32,
    waiting: Option<Waiting>,
    fifo: PathBuf,
    id: String,
    barrier: Arc<dyn StartBarrier>,
) {
    // Gone already (it returned before it was watched, or fanotify-only
    // mode read its argv after the exec): the fifo alone tells.
    let pidfd = crate::pidfd::pidfd_open(pid).ok();
    tokio::spawn(async move {
        if let Some(pidfd) = pidfd {
            let exited =
                tokio::time::timeout(START_RETURN_DEADLINE, crate::pidfd::wait_exit(pidfd));
            if !matches!(exited.await, Ok(Ok(()))) {
                tracing::warn!(
                    id,
                    deadline = ?START_RETURN_DEADLINE,
                    "the runtime's `start` did not return: what runs after a start (poststart hooks) does not run"
                );
                return;
            }
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

/// The container's init and the program it runs while it waits for its
/// start (the runtime's init), read before the start is allowed.
pub(super) type Waiting = (u32, PathBuf);

/// The container's init `init` as it waits for its start, if it is there.
pub(super) fn waiting(init: Option<u32>) -> Option<Waiting> {
    init.and_then(|i| exe_of(i).map(|exe| (i, exe)))
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
