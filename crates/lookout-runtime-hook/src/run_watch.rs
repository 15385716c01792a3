//! Catching a container started by `runc run` (create and start in one
//! process): the runtime's state file is the first place its pid shows, and
//! a short-lived container's state is gone a few milliseconds later. A
//! small thread watches the state directory with inotify from the moment
//! the `run` exec is seen, and reads the state the instant it is written.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lookout_model::{Namespaces, RuntimeKind};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::sync::mpsc;

use crate::state::{read_state, state_file};
use lookout_host::proc;

/// What the watcher saw, read at once so that it survives the container.
#[derive(Debug, Clone)]
pub(crate) struct Observed {
    pub id: String,
    pub pid: u32,
    pub namespaces: Namespaces,
    pub cgroup: Option<String>,
}

/// What a `run` watcher found.
#[derive(Debug)]
pub(crate) enum RunSeen {
    /// The container's state, read while it lived.
    Observed(Observed),
    /// The container's directory was there, but its state was gone before
    /// it could be read (a container that ran and ended within the
    /// watcher's start): a container made and not reported.
    Vanished,
}

/// Watches `root` (a path this process opens) for `id`'s state file while
/// the `run` process `tgid` (started at `run_start`, clock ticks since
/// boot) lives, for at most 30 s. Sends nothing when no trace of the
/// container was seen (a `run` that failed).
pub(crate) fn spawn(
    runtime: RuntimeKind,
    root: PathBuf,
    id: String,
    tgid: u32,
    run_start: Option<u64>,
    tx: mpsc::Sender<RunSeen>,
) {
    let spawned = std::thread::Builder::new()
        .name(format!("lookout-run-{id}"))
        .spawn(move || {
            if let Some(seen) = watch(&runtime, &root, &id, tgid, run_start) {
                let _ = tx.blocking_send(seen);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(%e, "cannot start a run watcher thread");
    }
}

fn watch(
    runtime: &RuntimeKind,
    root: &std::path::Path,
    id: &str,
    tgid: u32,
    run_start: Option<u64>,
) -> Option<RunSeen> {
    let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).ok();
    let dir = root.join(id);
    let state = state_file(runtime, root, id);
    // runsc keeps one file per container in the root itself, named after
    // the sandbox too: watch the root for it, and look it up by listing.
    let runsc = *runtime == RuntimeKind::Runsc;
    let mut root_mask = AddWatchFlags::IN_CREATE | AddWatchFlags::IN_ONLYDIR;
    if runsc {
        root_mask |= AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_MOVED_TO;
    }
    let mut root_watched = false;
    let mut dir_watched = false;
    // Whether the container's directory (runsc: a file named after it)
    // was ever seen: a `run` that ends without one made nothing.
    let mut traced = false;
    // Whether the state read was an earlier container's: its directory is
    // then no trace of this run's.
    let mut old = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(ino) = &ino {
            if !root_watched {
                root_watched = ino.add_watch(root, root_mask).is_ok();
            }
            if !dir_watched && dir.is_dir() {
                let mask = AddWatchFlags::IN_MOVED_TO
                    | AddWatchFlags::IN_CLOSE_WRITE
                    | AddWatchFlags::IN_CREATE;
                dir_watched = ino.add_watch(&dir, mask).is_ok();
            }
        }
        // Check after arming the watches: nothing written before is missed.
        let exists = dir.is_dir();
        if (runsc || state.exists())
            && let Ok(s) = read_state(runtime, root, id)
        {
            if !left_before(s.start_time, run_start) {
                return Some(RunSeen::Observed(Observed {
                    id: id.to_owned(),
                    pid: s.pid,
                    namespaces: proc::namespaces(s.pid),
                    cgroup: proc::cgroup(s.pid),
                }));
            }
            // A stopped container not deleted yet: runc refuses this `run`
            // ("container with id exists"), unless the old one is deleted
            // first, which the root's watch sees.
            if !old {
                tracing::debug!(
                    id,
                    pid = s.pid,
                    "`run` of an id whose old state is still there"
                );
            }
            old = true;
        }
        traced |= exists && !old;
        if Instant::now() > deadline || !std::path::Path::new(&format!("/proc/{tgid}")).exists() {
            return traced.then_some(RunSeen::Vanished);
        }
        match &ino {
            // Without a root dir to watch yet (the runtime creates it on
            // first use), or without inotify, look again shortly.
            Some(ino) if root_watched => {
                let mut fds = [PollFd::new(ino.as_fd(), PollFlags::POLLIN)];
                let _ = poll(&mut fds, PollTimeout::from(20u16));
                // A directory (or runsc file) named after the container
                // that came and went between two looks.
                if let Ok(events) = ino.read_events() {
                    let made = events.iter().any(|e| {
                        e.name.as_deref().is_some_and(|n| {
                            let n = n.to_string_lossy();
                            n == id || (runsc && n.contains(id))
                        })
                    });
                    if made {
                        traced = true;
                        // Made anew (the old one deleted): watch the new
                        // directory; its state is judged as any other.
                        dir_watched = false;
                        old = false;
                    }
                }
            }
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Whether a state whose init started at `state_start` (clock ticks since
/// boot) was left by an earlier container with the same id, and not made
/// by the `run` process that started at `run_start`: a container's init is
/// forked after the `run` that makes it. Unknown start times count as this
/// run's: nothing tells them apart. runsc's state has none: the sandbox's
/// start time from /proc would not do, since a `run` that joins an existing
/// sandbox makes a new container in an older sandbox.
fn left_before(state_start: Option<u64>, run_start: Option<u64>) -> bool {
    matches!((state_start, run_start), (Some(init), Some(run)) if init < run)
}

#[cfg(test)]
mod tests {
    use super::left_before;

    #[test]
    fn a_state_is_old_only_when_its_init_started_before_the_run() {
        assert!(left_before(Some(99), Some(100)), "older: left before");
        assert!(!left_before(Some(100), Some(100)), "same tick: this run's");
        assert!(!left_before(Some(101), Some(100)));
        // No start time in the state (runsc), or none for the `run`
        // (fanotify-only mode, the process gone before it was read): no
        // judgement, reported.
        assert!(!left_before(None, Some(100)));
        assert!(!left_before(Some(1), None));
    }
}
