//! fanotify-only mode: runtime execs followed after they were allowed.
//!
//! Without BPF, an exec's argv is not known when its permission event is
//! answered: the answerer allows it at once and hands it here. Its argv is
//! read from `/proc/<pid>/cmdline` once the exec is through
//! ([`follow_exec`]). An exec whose argv cannot be read in time (it ended
//! first, or a flood of them) is *unread*: the state directories are then
//! reconciled, so that a container it made is still reported, late, with
//! source `state-scan`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use lookout_host::proc;
use lookout_model::Sink;

use super::{Input, Notice, RuntimeHook};
use crate::answer::Unseen;
use crate::pidfd;

/// fanotify-only mode: how long an allowed runtime exec may take to show
/// its own command line in /proc before it counts as unread.
const LATE_ARGV_DEADLINE: Duration = Duration::from_secs(5);
/// fanotify-only mode: at most this many execs are followed at once; more
/// (an exec flood) count as unread and are covered by reconciliation.
const MAX_LATE_READERS: usize = 256;
/// When an unread runtime exec cannot be followed to its end, the state
/// directories are scanned again after these delays (a `create` takes tens
/// of milliseconds, more on a loaded node).
const RECONCILE_AGAIN: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(5)];
/// The longest a reconciliation waits for busy argv readers.
const RECONCILE_SETTLE: Duration = Duration::from_secs(1);
/// The shortest time between two reconciliations.
const RECONCILE_MIN_GAP: Duration = Duration::from_millis(100);
/// Unread execs listed in one reconciliation's log line at most.
const MAX_LISTED: usize = 16;

/// What a follower found out about an exec.
#[derive(Debug)]
pub(super) enum Late {
    /// The exec's argv, read from /proc after it was allowed.
    Argv {
        pid: u32,
        binary: String,
        argv: Vec<String>,
    },
    /// Its argv could not be read; `why` says why. The state directories
    /// are scanned for what it may have created, now and once it has
    /// ended (`after`).
    Unread {
        pid: u32,
        binary: String,
        why: String,
        after: Afterwards,
    },
    /// Scan the state directories again (see [`Afterwards`]).
    Reconcile,
    /// A caller other than host root: not a container (see the answerer).
    /// `reason` is the metric label: `non-root`, or `pid-namespace` for
    /// root in a pid namespace other than the node's (a container's).
    Foreign { pid: u32, reason: &'static str },
}

/// What is known of a runtime exec whose argv could not be read: when has
/// it created whatever it was going to create?
#[derive(Debug)]
pub(super) enum Afterwards {
    /// It has ended: a scan now sees what it made.
    Ended,
    /// It still runs: scan again when this pidfd says it ended.
    Running(std::os::fd::OwnedFd),
    /// Unknown (no pidfd: the exec came from a thread other than the main
    /// one, whose id vanished with the exec): scan again after
    /// [`RECONCILE_AGAIN`].
    Unknown,
}

/// The execs whose argv could not be read since the last reconciliation,
/// and the followers that are still reading.
#[derive(Debug)]
pub(super) struct Unread {
    /// For the reconciliation's log line (at most [`MAX_LISTED`]).
    execs: Vec<String>,
    /// Followers running now (at most [`MAX_LATE_READERS`]).
    readers: Arc<AtomicUsize>,
    /// When the oldest entry of `execs` came.
    since: Instant,
    /// When the last reconciliation ran.
    last_reconcile: Instant,
}

impl Unread {
    pub(super) fn new() -> Unread {
        let now = Instant::now();
        Unread {
            execs: Vec::new(),
            readers: Arc::new(AtomicUsize::new(0)),
            since: now,
            last_reconcile: now,
        }
    }

    /// Whether a reconciliation is owed.
    pub(super) fn is_empty(&self) -> bool {
        self.execs.is_empty()
    }

    /// One more unread exec (or several, in `what`).
    pub(super) fn note(&mut self, what: String) {
        if self.execs.is_empty() {
            self.since = Instant::now();
        }
        if self.execs.len() < MAX_LISTED {
            self.execs.push(what);
        } else if self.execs.len() == MAX_LISTED {
            self.execs.push("...".into());
        }
    }

    /// When to reconcile: once no follower is busy (each one ends with a
    /// notice, which wakes the loop), or at the latest
    /// [`RECONCILE_SETTLE`] after the first unread exec. A scan while
    /// followers are busy would race them: it would report (late, as
    /// `running`) containers whose `create` the hook is about to report
    /// as it should.
    pub(super) fn due(&self) -> impl std::future::Future<Output = ()> + use<> {
        tokio::time::sleep_until(self.due_at(Instant::now()).into())
    }

    /// [`Unread::due`] as an instant, seen at `now`.
    fn due_at(&self, now: Instant) -> Instant {
        let busy = self.readers.load(Ordering::Relaxed) > 0;
        let at = if busy {
            self.since + RECONCILE_SETTLE
        } else {
            now
        };
        // An exec flood (anyone may exec a runtime, and such execs end
        // before they are read) must not turn into back-to-back scans on
        // the hook's task.
        at.max(self.last_reconcile + RECONCILE_MIN_GAP)
    }

    /// Starts a reconciliation: the execs it covers.
    fn take(&mut self) -> Vec<String> {
        self.last_reconcile = Instant::now();
        std::mem::take(&mut self.execs)
    }
}

impl RuntimeHook {
    /// After runtime execs whose argv could not be read, reports what the
    /// state directories hold that nobody reported.
    pub(super) fn reconcile(&mut self, sink: &mut dyn Sink) {
        let unread = self.unread.take();
        // A container made anew with the id of one whose exit notice is
        // still queued would be skipped as known.
        self.end_all_exited(sink);
        let found = self.scan_untracked();
        for c in &found {
            self.counters.count_recovered();
            tracing::warn!(
                id = c.id,
                pid = c.pid,
                execs = ?unread,
                "container found by reconciliation: the argv of these runtime execs could \
                 not be read (fanotify mode without BPF); reported late, from the state directory"
            );
        }
        self.step(Input::Found(found), sink);
    }

    /// fanotify-only mode: once the exec is allowed and through, the
    /// runtime's own argv is in `/proc/<pid>/cmdline`. Follows the process
    /// until then. If it ends first (a `start` or `delete` takes a few ms;
    /// a `create` on a loaded node can too), or the argv does not appear
    /// within [`LATE_ARGV_DEADLINE`], it is reported as unread and the
    /// state directories are reconciled: a container it created is still
    /// reported, late, with source `state-scan`.
    pub(super) fn follow_late(&self, u: Unseen) {
        let tx = self.notices_tx.clone();
        let readers = Arc::clone(&self.unread.readers);
        if readers.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= MAX_LATE_READERS {
            readers.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            let after = match u.pidfd {
                Some(fd) => Afterwards::Running(fd),
                None => Afterwards::Unknown,
            };
            let _ = tx.try_send(Notice::Late(Late::Unread {
                pid: u.tid,
                binary: u.binary,
                why: format!("more than {MAX_LATE_READERS} runtime execs followed at once"),
                after,
            }));
            return;
        }
        tokio::spawn(async move {
            let late = follow_exec(u).await;
            readers.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            let _ = tx.send(Notice::Late(late)).await;
        });
    }

    /// What a follower found out.
    pub(super) fn on_late(&mut self, late: Late, sink: &mut dyn Sink) {
        match late {
            Late::Argv { pid, binary, argv } => {
                if self.capture.is_some() {
                    self.counters.error("argv-late");
                }
                self.on_argv(pid, &binary, &argv, None, sink)
            }
            Late::Foreign { pid, reason } => {
                self.counters.ignored(reason);
                tracing::debug!(
                    pid,
                    reason,
                    "runtime exec by a caller other than the node's root: not a container"
                );
            }
            Late::Reconcile => {
                if self.unread.is_empty() {
                    self.unread.note("(a later look)".into());
                }
            }
            Late::Unread {
                pid,
                binary,
                why,
                after,
            } => {
                self.counters.count_unread_argv();
                tracing::debug!(
                    pid,
                    binary,
                    why,
                    "runtime exec whose argv could not be read; reconciling from the state directories"
                );
                self.unread.note(format!("{binary}[{pid}]: {why}"));
                // A scan follows at once (the `unread` branch of the loop);
                // one more once the exec has made what it makes.
                let tx = self.notices_tx.clone();
                match after {
                    Afterwards::Ended => {}
                    Afterwards::Running(fd) => {
                        tokio::spawn(async move {
                            let _ = pidfd::wait_exit(fd).await;
                            let _ = tx.send(Notice::Late(Late::Reconcile)).await;
                        });
                    }
                    Afterwards::Unknown => {
                        tokio::spawn(async move {
                            for delay in RECONCILE_AGAIN {
                                tokio::time::sleep(delay).await;
                                let _ = tx.send(Notice::Late(Late::Reconcile)).await;
                            }
                        });
                    }
                }
            }
        }
    }
}

/// Who exec'd as `tid`, from `/proc/<tid>/status`, if it could be read and
/// (with a pidfd taken during the exec) the pid still named that process
/// after the read.
fn caller_of(tid: u32, pidfd: Option<&std::os::fd::OwnedFd>) -> Option<proc::Caller> {
    let caller = proc::caller(tid)?;
    pidfd.is_none_or(pidfd::not_reaped).then_some(caller)
}

/// Why `caller` is not the node's root (the metric label), or `None` if it
/// is. Root in a container without a user namespace is uid 0 as well, but
/// in a pid namespace below the node's; the BPF programs skip it too.
fn foreign(caller: proc::Caller) -> Option<&'static str> {
    if caller.real_uid != 0 {
        Some("non-root")
    } else if caller.nested_pid_ns {
        Some("pid-namespace")
    } else {
        None
    }
}

/// Follows an allowed runtime exec until its own argv is readable (see
/// [`RuntimeHook::follow_late`]).
async fn follow_exec(u: Unseen) -> Late {
    let Unseen {
        tid,
        binary,
        exe,
        pidfd,
        bpf,
    } = u;
    // Only host root makes rootful containers (see the answerer). The real uid
    // does not change across the exec, nor does the pid namespace ever. (A
    // caller already gone is found gone below, and reconciled.)
    if let Some(reason) = caller_of(tid, pidfd.as_ref()).and_then(foreign) {
        return Late::Foreign { pid: tid, reason };
    }
    let deadline = Instant::now() + LATE_ARGV_DEADLINE;
    let mut wait = Duration::from_micros(100);
    loop {
        // Through the exec: /proc/<tid>/exe is the runtime binary (when
        // its identity is known) and cmdline is set.
        let through = exe.is_none_or(|want| {
            nix::sys::stat::stat(format!("/proc/{tid}/exe").as_str())
                .is_ok_and(|st| (st.st_dev, st.st_ino) == want)
        });
        if through
            && let Some(argv) = proc::cmdline(tid)
            && !argv.is_empty()
        {
            // Read while the process lived: the argv is its own, not that
            // of a process that reused the pid.
            let alive = pidfd.as_ref().is_none_or(|fd| !pidfd::has_exited(fd));
            // Who ran it, read while the pid still names it. A caller gone
            // meanwhile is not taken for root: it is found gone below and
            // the state directories are reconciled.
            let caller = if alive {
                caller_of(tid, pidfd.as_ref())
            } else {
                None
            };
            if let Some(reason) = caller.and_then(foreign) {
                return Late::Foreign { pid: tid, reason };
            }
            if caller.is_some() {
                if bpf {
                    tracing::warn!(
                        pid = tid,
                        binary,
                        ?argv,
                        "a root runtime exec without a BPF argv record: read from /proc after \
                         the fact (its container is reported, but was not held before start)"
                    );
                }
                return Late::Argv {
                    pid: tid,
                    binary,
                    argv,
                };
            }
        }
        let gone = match &pidfd {
            Some(fd) => pidfd::has_exited(fd),
            None => proc::start_time(tid).is_none(),
        };
        if gone {
            return Late::Unread {
                pid: tid,
                binary,
                why: "it ended before its command line could be read".into(),
                after: if pidfd.is_some() {
                    Afterwards::Ended
                } else {
                    Afterwards::Unknown
                },
            };
        }
        if Instant::now() >= deadline {
            return Late::Unread {
                pid: tid,
                binary,
                why: format!("its command line did not appear within {LATE_ARGV_DEADLINE:?}"),
                after: pidfd.map_or(Afterwards::Unknown, Afterwards::Running),
            };
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unread_execs_are_listed_up_to_a_bound_and_taken_by_a_reconciliation() {
        let mut u = Unread::new();
        assert!(u.is_empty());
        for i in 0..40 {
            u.note(format!("runc[{i}]: gone"));
        }
        let listed = u.take();
        assert_eq!(listed.len(), MAX_LISTED + 1);
        assert_eq!(listed[0], "runc[0]: gone");
        assert_eq!(listed[MAX_LISTED], "...");
        assert!(u.is_empty(), "a reconciliation covers them all");
    }

    #[test]
    fn a_reconciliation_waits_for_busy_followers_but_not_past_the_settle_time() {
        let mut u = Unread::new();
        u.take();
        let start = u.last_reconcile;
        u.note("runc[1]: gone".into());
        let since = u.since;
        // Nobody busy: at once, but never sooner than the minimum gap.
        let now = start + Duration::from_secs(2);
        assert_eq!(u.due_at(now), now);
        assert_eq!(u.due_at(start), start + RECONCILE_MIN_GAP);
        // A follower still reads: at most the settle time after the first
        // unread exec.
        u.readers.fetch_add(1, Ordering::Relaxed);
        assert_eq!(
            u.due_at(now),
            (since + RECONCILE_SETTLE).max(start + RECONCILE_MIN_GAP)
        );
    }
}
