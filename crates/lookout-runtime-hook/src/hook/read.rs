//! Reading a container off the task, bounded: its pid from the state the
//! runtime wrote (or its pid file, or what a `run` watcher saw), checked to
//! be the container's init, and the container filled from it.
//!
//! A `create`'s container is read by a reader thread that waits for the
//! `create`'s exit and reads right after it
//! ([`crate::bounded::after_exit`]): one hand-over fewer than waking the
//! hook's task first, which would then wake a reader. The deadline runs
//! from the exit. Every read ends in one [`Input::Read`].

use std::path::Path;
use std::sync::Arc;

use lookout_host::proc;
use lookout_model::{Container, RuntimeKind};
use tokio::sync::mpsc;

use super::{Notice, RuntimeHook};
use crate::container::{fill, fill_init};
use crate::lifecycle::{self, Handoff, Input, Pending};
use crate::run_watch::Observed;
use crate::state::{leaves_trace, read_pid_file_under, read_state_under};
use crate::stats::Counters;

/// What reading a pending container gave: the container, why there is
/// none, or why the read did not end (a hung file system).
type ReadOutcome = Result<Result<Container, Unresolved>, &'static str>;

impl RuntimeHook {
    /// Watches `create` process `pid` of `id` and, once it has exited,
    /// reads what `handoff` holds (unless a `start` took it), then steps
    /// [`Input::Read`] numbered `read`. The read runs on a reader that
    /// waits for the exit itself, or, with none free to wait
    /// ([`crate::bounded::MAX_EXIT_WAITERS`]), starts when this runtime
    /// sees the exit.
    pub(super) fn watch_create(
        &self,
        id: String,
        pid: u32,
        runtime: RuntimeKind,
        read: u64,
        handoff: Handoff,
    ) {
        let fd = crate::pidfd::pidfd_open(pid).ok().map(Arc::new);
        let deadline = self.config.answer_deadline;
        let (tx, counters) = (self.notices_tx.clone(), Arc::clone(&self.counters));
        if let Some(place) = crate::bounded::exit_place() {
            let (reader, taken, of) = (self.reader(), Arc::clone(&handoff), id.clone());
            let job = move || {
                let p = lifecycle::take(&taken)?;
                Some(reader(&of, p, None))
            };
            if let Some(done) = crate::bounded::after_exit(place, fd.clone(), deadline, job) {
                tokio::spawn(async move {
                    let outcome = match done.await {
                        // A `start` took it first, and reads it.
                        Ok(None) => return,
                        Ok(Some(outcome)) => Ok(outcome),
                        Err(why) => Err(why),
                    };
                    let container = settle(&counters, &runtime, &id, outcome);
                    send(&tx, id, read, container).await;
                });
                return;
            }
        }
        let exited = crate::pidfd::exit_of_fd(fd);
        let reader = self.reader();
        tokio::spawn(async move {
            exited.await;
            if let Some(p) = lifecycle::take(&handoff) {
                read_within(deadline, reader, &counters, &tx, id, read, p, None).await;
            }
        });
    }

    /// Reads pending container `id` now, on a reader for at most the
    /// answer deadline (a pid file on a hung file system costs this
    /// container that much, and nobody else anything: the task goes on
    /// meanwhile), then steps [`Input::Read`] numbered `read`. `seen`: a
    /// `run` watcher saw it alive.
    pub(super) fn read_now(&self, id: String, read: u64, p: Pending, seen: Option<Observed>) {
        let deadline = self.config.answer_deadline;
        let (counters, tx) = (Arc::clone(&self.counters), self.notices_tx.clone());
        let reader = self.reader();
        tokio::spawn(async move {
            read_within(deadline, reader, &counters, &tx, id, read, p, seen).await;
        });
    }

    /// [`resolve`] under this hook's host root, then its enrichment.
    fn reader(
        &self,
    ) -> impl Fn(&str, Pending, Option<Observed>) -> Result<Container, Unresolved> + Send + 'static
    {
        let host_root = self.config.host_root.clone();
        let enrich = self.config.enrich.clone();
        move |id, p, seen| {
            let mut c = resolve(&host_root, id, p, seen)?;
            if let Some(f) = &enrich {
                f(&mut c);
            }
            Ok(c)
        }
    }
}

/// Reads `p` with `reader` on a reader thread within `deadline`, and sends
/// the result.
// N.B. each argument is moved into the read or the notice: a struct for
// them would only be taken apart again.
#[allow(clippy::too_many_arguments)]
async fn read_within(
    deadline: std::time::Duration,
    reader: impl FnOnce(&str, Pending, Option<Observed>) -> Result<Container, Unresolved>
    + Send
    + 'static,
    counters: &Counters,
    tx: &mpsc::Sender<Notice>,
    id: String,
    read: u64,
    p: Pending,
    seen: Option<Observed>,
) {
    let (runtime, of) = (p.runtime.clone(), id.clone());
    let outcome = crate::bounded::bounded_async(deadline, move || reader(&of, p, seen)).await;
    let container = settle(counters, &runtime, &id, outcome);
    send(tx, id, read, container).await;
}

/// Hands the hook's task the end of read `read` of `id`.
async fn send(tx: &mpsc::Sender<Notice>, id: String, read: u64, container: Option<Container>) {
    let input = Input::Read {
        id,
        read,
        container,
    };
    let _ = tx.send(Notice::Step(Box::new(input))).await;
}

/// The container a read gave, or `None`, counted and logged.
fn settle(
    counters: &Counters,
    kind: &RuntimeKind,
    id: &str,
    read: ReadOutcome,
) -> Option<Container> {
    match read {
        Ok(Ok(c)) => Some(c),
        Ok(Err(Unresolved::Failed(why))) => {
            tracing::debug!(id, why, "no pid: the create failed");
            None
        }
        Ok(Err(Unresolved::Missed {
            runtime,
            reason,
            why,
        })) => {
            counters.missed(&runtime, reason);
            if reason == "unreadable-state" {
                tracing::warn!(
                    runtime = %runtime,
                    id,
                    why,
                    "the runtime made a container whose state cannot be read; not reported"
                );
            } else {
                counters.error("state");
                tracing::warn!(
                    runtime = %runtime,
                    id,
                    why,
                    "the runtime's state names no container process; not reported"
                );
            }
            None
        }
        Err(why) => {
            counters.error("state");
            counters.missed(kind, "state-timeout");
            tracing::warn!(
                runtime = %kind,
                id,
                why,
                "cannot read the container's state or pid file; not reported"
            );
            None
        }
    }
}

/// Why a pending container yields nothing to report.
enum Unresolved {
    /// The create failed: nothing of the container is left.
    Failed(String),
    /// The runtime made a container that cannot be reported, for `reason`
    /// (a [`Observer::missed`](crate::Observer::missed) label).
    Missed {
        runtime: RuntimeKind,
        reason: &'static str,
        why: String,
    },
}

/// The pid of pending container `id` (from `seen`, the runtime's state or
/// its pid file), checked to be a container's init, and the container
/// filled from it. Blocking: runs on a helper thread.
fn resolve(
    host_root: &Path,
    id: &str,
    mut p: Pending,
    seen: Option<Observed>,
) -> Result<Container, Unresolved> {
    let missed = |reason, why| Unresolved::Missed {
        runtime: p.runtime.clone(),
        reason,
        why,
    };
    // The pid, and the start time the state recorded for it.
    let (pid, recorded_start) = match &seen {
        Some(obs) => (obs.pid, None),
        None => match read_state_under(host_root, &p.runtime, &p.root, id) {
            Ok(s) => (s.pid, s.start_time),
            Err(e) => match p
                .pid_file
                .as_ref()
                .map(|f| read_pid_file_under(host_root, f))
            {
                Some(Ok(pid)) => (pid, None),
                Some(Err(pe)) => {
                    return Err(unreadable(
                        host_root,
                        &p,
                        id,
                        format!(
                            "no state ({}) and no pid file ({})",
                            lookout_model::Chain(&e),
                            lookout_model::Chain(&pe)
                        ),
                    ));
                }
                None => {
                    return Err(unreadable(
                        host_root,
                        &p,
                        id,
                        format!("no state ({})", lookout_model::Chain(&e)),
                    ));
                }
            },
        },
    };
    let mut c = Container::new(id, p.runtime.clone());
    c.bundle = p.bundle.clone();
    c.runtime_root = Some(p.root.clone());
    match seen {
        // A `run` watcher saw it alive, in its own namespaces, already.
        Some(_) if pid <= 1 => {
            return Err(missed(
                "not-a-container-process",
                format!("pid {pid}: {}", proc::NotInit::HostInit(pid)),
            ));
        }
        Some(obs) => {
            fill(&mut c, pid, p.config.take(), p.status);
            // The container may be gone already: keep what the watcher saw.
            if c.namespaces.mnt.is_none() {
                c.namespaces = obs.namespaces;
            }
            if c.cgroup.is_none() {
                c.cgroup = obs.cgroup;
            }
        }
        // The state names the init process; make sure it is one, and the
        // one the runtime started (as the start-up scan does): a pid that
        // started at another time than the state recorded was reused.
        None => {
            let init = proc::container_init(pid, recorded_start)
                .map_err(|why| missed("not-a-container-process", format!("pid {pid}: {why}")))?;
            fill_init(&mut c, &init, p.config.take(), p.status);
        }
    }
    Ok(c)
}

/// No state and no pid file: a failed create, unless something of the
/// container is there (then this version cannot read the runtime's state).
fn unreadable(host_root: &Path, p: &Pending, id: &str, why: String) -> Unresolved {
    if leaves_trace(host_root, &p.root, id) {
        Unresolved::Missed {
            runtime: p.runtime.clone(),
            reason: "unreadable-state",
            why,
        }
    } else {
        Unresolved::Failed(why)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lookout_model::Status;
    use std::time::{Duration, Instant};

    /// A root-owned runc state for `id` under a new root, naming `pid`
    /// started at `start`.
    fn state_naming(id: &str, pid: u32, start: u64) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(root.path().join(id)).expect("mkdir");
        let state = format!(
            r#"{{"id":"{id}","init_process_pid":{pid},"init_process_start":{start},"config":{{"labels":[]}}}}"#
        );
        std::fs::write(root.path().join(id).join("state.json"), state).expect("write state");
        root
    }

    fn pending(root: &Path) -> Pending {
        Pending {
            runtime: RuntimeKind::Runc,
            root: root.to_path_buf(),
            bundle: None,
            pid_file: None,
            config: None,
            status: Status::Created,
            since: Instant::now(),
            started: None,
        }
    }

    #[test]
    fn a_state_naming_a_pid_that_started_at_another_time_gets_no_container() {
        let test = "a_state_naming_a_pid_that_started_at_another_time_gets_no_container";
        if !nix::unistd::geteuid().is_root() {
            let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
            assert!(!ci, "{test}: needs root under CI");
            eprintln!("\n!!! SKIPPED {test}: needs root (a mount namespace)\n");
            return;
        }
        // An init in a mount namespace of its own, as a container's.
        let mut init = std::process::Command::new("unshare")
            .args(["--mount", "sleep", "30"])
            .spawn()
            .expect("unshare");
        let pid = init.id();
        let own = std::fs::read_link("/proc/self/ns/mnt").expect("own mnt");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_link(format!("/proc/{pid}/ns/mnt")).is_ok_and(|ns| ns == own)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        let start = proc::start_time(pid).expect("start time");
        let id = "reused-pid";

        // The state recorded another start: the init it names exited and
        // this process took its pid. Nothing of it is reported.
        let root = state_naming(id, pid, start + 1);
        let reused = resolve(Path::new("/"), id, pending(root.path()), None);
        // The same state with the right start: the container, with the
        // namespaces of that init.
        let root = state_naming(id, pid, start);
        let right = resolve(Path::new("/"), id, pending(root.path()), None);
        let mnt = proc::namespaces(pid).mnt;
        let _ = init.kill();
        let _ = init.wait();

        match reused {
            Err(Unresolved::Missed { reason, why, .. }) => {
                assert_eq!(reason, "not-a-container-process");
                assert!(why.contains("reused"), "{why}");
            }
            Ok(c) => panic!("a reused pid was reported: {c:?}"),
            Err(Unresolved::Failed(why)) => panic!("read as a failed create: {why}"),
        }
        let c = right.unwrap_or_else(|_| panic!("the right start time gets no container"));
        assert_eq!(c.pid, Some(pid));
        assert!(mnt.is_some());
        assert_eq!(c.namespaces.mnt, mnt);
        assert_ne!(c.namespaces.net, None);
        assert_ne!(c.namespaces.pid, None);
    }
}
