//! The container lifecycle as a pure state machine.
//!
//! The hook's task turns what it sees (runtime execs, the exit of a
//! `create` process, a pid read off the task, an init's exit) into
//! [`Input`]s, and [`Lifecycle::step`] returns the [`Effect`]s to carry out
//! (let a `create` go on and watch it end, watch `run`'s state, read a pid
//! off the task, watch an exit, emit an event, let a `start` go on): the
//! whole create → start → exit story is here. `step` does no I/O and reads no clock, so every transition is
//! unit-tested here without root, a runtime or a tokio runtime.
//!
//! ```text
//!             Created            CreateExited / Start / Observed
//!   (none) ───────────▶ pending ─────────────────────────────────▶ resolving
//!                          │ Sweep (older than the TTL)                 │ Resolved(Some)
//!                          ▼                                            ▼
//!                       (none)        Exited(same watch) / Deleted    tracked
//!                                    ◀────────────────────────────────  │
//!   Found (a state scan) ──────────────────────────────────────────────▶┘
//! ```
//!
//! The one ordering rule: a `start` held while its container is pending or
//! resolving is released only *after* the container's `added` event (the
//! effects come in that order), so no container runs its first
//! instruction before it is reported.
//!
//! The held `start` is a type parameter (`P`): the hook passes its held
//! permission events, the tests plain numbers.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use lookout_model::{Container, ContainerEvent, RuntimeKind, Source, Status};

use crate::oci::OciConfig;
use crate::run_watch::Observed;

/// With this many containers pending, a `create` drops the ones older
/// than [`PENDING_TTL`] first.
pub(crate) const MAX_PENDING: usize = 4096;
/// A pending container whose `create` never ended is forgotten after this.
pub(crate) const PENDING_TTL: Duration = Duration::from_secs(60);

/// A container seen at `create`/`run`, not yet reported.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    /// The runtime that creates it.
    pub runtime: RuntimeKind,
    /// The runtime's state root (`--root`), as the runtime sees it.
    pub root: PathBuf,
    /// The bundle, when known.
    pub bundle: Option<PathBuf>,
    /// The `--pid-file`, as the runtime sees it.
    pub pid_file: Option<PathBuf>,
    /// The bundle's config.json, when it could be read.
    pub config: Option<OciConfig>,
    /// `created` (for `create`) or `running` (for `run`).
    pub status: Status,
    /// When the `create` was seen.
    pub since: Instant,
    /// A `run` process's start time (clock ticks since boot), read while
    /// its exec was held: the container it makes starts later.
    pub started: Option<u64>,
}

/// What the hook learned.
// Moved once, from the notice that carried it to `step`: its size costs
// nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Input<P> {
    /// A `create` or `run` of `id` by runtime process `pid` (its
    /// config.json read, or not). `perm` is the held exec, `None` when it
    /// was allowed already (fanotify-only mode).
    Created {
        id: String,
        pending: Pending,
        pid: u32,
        perm: Option<P>,
    },
    /// The `create` process of `id` ended: the state names the pid now.
    CreateExited { id: String },
    /// A `run` watcher saw `id` running.
    Observed(Observed),
    /// The runtime was asked to `start` `id`. `perm` is the held exec,
    /// `None` when it was allowed already (fanotify-only mode).
    Start { id: String, perm: Option<P> },
    /// The pid of `id` was read and the container filled; `None` when
    /// there is nothing to report (a failed create, unreadable state, a
    /// pid that is no container's).
    Resolved {
        id: String,
        container: Option<Container>,
    },
    /// Containers found in the state directories (a scan or a
    /// reconciliation).
    Found(Vec<Container>),
    /// The init process `pid` of `id` exited, with `code` when known, as
    /// exit watch `watch` ([`Effect::WatchExit`]) saw. Only the container
    /// that watch was for ends: a late notice of an earlier container with
    /// the same id (and even the same pid) ends nothing.
    Exited {
        id: String,
        watch: u64,
        pid: u32,
        code: Option<i32>,
    },
    /// The runtime was asked to delete `id`.
    Deleted { id: String },
    /// Forget pending containers older than [`PENDING_TTL`] at `now`.
    Sweep { now: Instant },
}

/// What the hook must do, in this order.
#[derive(Debug)]
// N.B. effects live for one step, a few at a time: boxing the event
// would cost an allocation per event to save stack.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Effect<P> {
    /// Read the pid of `id` (from `seen`, or the runtime's state or pid
    /// file), fill the container, and step [`Input::Resolved`]. Off the
    /// task: the files may be on a hung file system.
    Resolve {
        id: String,
        pending: Pending,
        seen: Option<Observed>,
    },
    /// Watch the exit of `pid`, the init of `id`, and step
    /// [`Input::Exited`] with this `watch` when it comes.
    WatchExit { id: String, pid: u32, watch: u64 },
    /// Hand this event to the sink.
    Emit(ContainerEvent),
    /// Let a held `create` or `run` exec go on: its container is
    /// remembered.
    Allow(P),
    /// Watch the `create` process `pid` of `id`, and step
    /// [`Input::CreateExited`] when it ends.
    WatchCreate { id: String, pid: u32 },
    /// `run` creates and starts in one process: read the state of `id`
    /// under `root` while the runtime process `pid` lives, and step
    /// [`Input::Observed`] when it names the container's init.
    WatchRun {
        id: String,
        pid: u32,
        runtime: RuntimeKind,
        root: PathBuf,
        /// The `run` process's start time, if known.
        started: Option<u64>,
    },
    /// Let the held `start` of `id` go on (after its start barrier).
    /// `pid` is the container's init, to kill if the barrier denies it.
    ReleaseStart {
        id: String,
        pid: Option<u32>,
        perm: P,
    },
}

/// A reported container with a live init.
#[derive(Debug)]
struct Tracked {
    /// The record its `added` carried (one allocation, shared with the
    /// event and whoever keeps it).
    record: Arc<Container>,
    /// The exit watch that ends it: a number no other container gets.
    watch: u64,
}

/// The containers the hook knows, by id, in the three states.
#[derive(Debug)]
pub(crate) struct Lifecycle<P> {
    /// Seen at `create`/`run`, not reported.
    pending: HashMap<String, Pending>,
    /// Their pid is being read; the `start`s that wait for the report.
    resolving: HashMap<String, Vec<P>>,
    /// Reported, with a live init.
    tracked: HashMap<String, Tracked>,
    /// The number the next [`Effect::WatchExit`] gets.
    next_watch: u64,
    /// How many tracked containers have each init pid.
    pids: HashMap<u32, u32>,
    /// How many pids more than one tracked container has ([`Lifecycle::shared_pids`]).
    shared: Arc<AtomicUsize>,
}

impl<P> Default for Lifecycle<P> {
    fn default() -> Self {
        Lifecycle {
            pending: HashMap::new(),
            resolving: HashMap::new(),
            tracked: HashMap::new(),
            next_watch: 0,
            pids: HashMap::new(),
            shared: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl<P> Lifecycle<P> {
    /// Whether `id` is pending, resolving or tracked (a scan must not
    /// report it again).
    pub fn knows(&self, id: &str) -> bool {
        self.tracked.contains_key(id)
            || self.pending.contains_key(id)
            || self.resolving.contains_key(id)
    }

    /// The reported containers.
    pub fn tracked(&self) -> impl Iterator<Item = &Container> {
        self.tracked.values().map(|t| &*t.record)
    }

    /// The exit watch of tracked container `id`.
    pub fn tracked_watch(&self, id: &str) -> Option<u64> {
        self.tracked.get(id).map(|t| t.watch)
    }

    /// The tracked containers' ids and exit watches.
    pub fn tracked_watches(&self) -> impl Iterator<Item = (&str, u64)> {
        self.tracked.iter().map(|(id, t)| (id.as_str(), t.watch))
    }

    /// Whether a tracked container has init `pid`.
    pub fn holds_pid(&self, pid: u32) -> bool {
        self.pids.contains_key(&pid)
    }

    /// The init pid of tracked container `id`.
    pub fn tracked_pid(&self, id: &str) -> Option<u32> {
        self.tracked.get(id).and_then(|t| t.record.pid)
    }

    /// Whether `id` is tracked and runs in a sandbox (its `delete` matters).
    pub fn is_sandboxed(&self, id: &str) -> bool {
        self.tracked
            .get(id)
            .is_some_and(|t| t.record.sandbox.is_some())
    }

    /// How many init pids more than one tracked container shares, kept
    /// current by every step. Only such a container (in a sandbox it
    /// shares, as runsc's pods) is ended by its `delete`
    /// ([`Input::Deleted`]): while this is 0, a `delete` teaches nothing,
    /// and the answering thread need not wake the hook's task for it.
    pub fn shared_pids(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.shared)
    }

    /// Counts one more tracked container on `pid`.
    fn hold_pid(&mut self, pid: Option<u32>) {
        if let Some(pid) = pid {
            let n = self.pids.entry(pid).or_default();
            *n += 1;
            if *n == 2 {
                self.shared.fetch_add(1, Ordering::Release);
            }
        }
    }

    /// Counts one tracked container fewer on `pid`.
    fn release_pid(&mut self, pid: Option<u32>) {
        let Some(pid) = pid else { return };
        let Some(n) = self.pids.get_mut(&pid) else {
            return;
        };
        *n -= 1;
        match *n {
            0 => {
                self.pids.remove(&pid);
            }
            1 => {
                self.shared.fetch_sub(1, Ordering::Release);
            }
            _ => {}
        }
    }

    /// Stops tracking `id`; returns its record.
    fn untrack(&mut self, id: &str) -> Option<Arc<Container>> {
        let t = self.tracked.remove(id)?;
        self.release_pid(t.record.pid);
        Some(t.record)
    }

    /// Pending container `id`, for a read that starts before the lifecycle
    /// asks for it (see the hook's `Prefetch`): its config moves to the
    /// copy (the read puts it in the container), the rest is cloned.
    pub fn take_for_read(&mut self, id: &str) -> Option<Pending> {
        let p = self.pending.get_mut(id)?;
        let config = p.config.take();
        let mut copy = p.clone();
        copy.config = config;
        Some(copy)
    }

    /// Gives pending container `id` back the config [`Lifecycle::take_for_read`]
    /// took, when that read could not start.
    pub fn restore_config(&mut self, id: &str, config: Option<OciConfig>) {
        if let Some(p) = self.pending.get_mut(id)
            && p.config.is_none()
        {
            p.config = config;
        }
    }

    /// How many containers are pending, resolving and tracked.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.pending.len(), self.resolving.len(), self.tracked.len())
    }

    /// Applies `input` and returns what to do.
    pub fn step(&mut self, input: Input<P>) -> Vec<Effect<P>> {
        let mut out = Vec::new();
        match input {
            Input::Created {
                id,
                pending,
                pid,
                perm,
            } => {
                // Reported already (reconciliation was first), or a create
                // that fails: runc refuses an id that exists. (An id used
                // again after its container ended: the hook's task steps
                // that container's `Exited` first.)
                if self.tracked.contains_key(&id) || self.resolving.contains_key(&id) {
                    out.extend(perm.map(Effect::Allow));
                    return out;
                }
                if self.pending.len() >= MAX_PENDING {
                    self.sweep(pending.since);
                }
                let watch = match pending.status {
                    Status::Running => Effect::WatchRun {
                        id: id.clone(),
                        pid,
                        runtime: pending.runtime.clone(),
                        root: pending.root.clone(),
                        started: pending.started,
                    },
                    _ => Effect::WatchCreate {
                        id: id.clone(),
                        pid,
                    },
                };
                // Only host root's execs get here: a root that floods
                // creates is not refused (that would hide a real one).
                self.pending.insert(id, pending);
                // Remembered first: what the exec makes is then known.
                out.extend(perm.map(Effect::Allow));
                out.push(watch);
            }
            Input::CreateExited { id } => self.resolve(id, None, None, &mut out),
            Input::Observed(seen) => {
                let id = seen.id.clone();
                self.resolve(id, None, Some(seen), &mut out);
            }
            Input::Start { id, perm } => {
                if let Some(waiting) = self.resolving.get_mut(&id) {
                    waiting.extend(perm);
                } else if self.pending.contains_key(&id) {
                    self.resolve(id, perm, None, &mut out);
                } else if let Some(perm) = perm {
                    let pid = self.tracked_pid(&id);
                    out.push(Effect::ReleaseStart { id, pid, perm });
                }
            }
            Input::Resolved { id, container } => {
                let waiting = self.resolving.remove(&id).unwrap_or_default();
                let mut pid = None;
                if let Some(c) = container
                    && let Some(p) = c.pid
                {
                    pid = Some(p);
                    let known = self.tracked_pid(&id) == Some(p);
                    if !known {
                        self.track(c, p, Source::RuntimeHook, &mut out);
                    }
                }
                for perm in waiting {
                    out.push(Effect::ReleaseStart {
                        id: id.clone(),
                        pid,
                        perm,
                    });
                }
            }
            Input::Found(found) => {
                for c in found {
                    if self.knows(&c.id) {
                        continue;
                    }
                    if let Some(p) = c.pid {
                        self.track(c, p, Source::StateScan, &mut out);
                    }
                }
            }
            Input::Exited {
                id, watch, code, ..
            } => {
                if self.tracked_watch(&id) == Some(watch)
                    && let Some(c) = self.untrack(&id)
                {
                    out.push(Effect::Emit(ContainerEvent::removed(
                        Source::RuntimeHook,
                        c,
                        code,
                    )));
                }
            }
            Input::Deleted { id } => {
                // A container in a sandbox it shares with others (a CRI
                // pod on runsc) has no process of its own on the host: the
                // sandbox outlives it, so its exit cannot be seen. Its
                // deletion is the last word on it.
                let shares = self.tracked.get(&id).is_some_and(|t| {
                    let c = &t.record;
                    c.sandbox.is_some()
                        && c.pid.is_some()
                        && self
                            .tracked
                            .values()
                            .any(|o| o.record.id != id && o.record.pid == c.pid)
                });
                if shares && let Some(c) = self.untrack(&id) {
                    out.push(Effect::Emit(ContainerEvent::removed(
                        Source::RuntimeHook,
                        c,
                        None,
                    )));
                }
            }
            Input::Sweep { now } => self.sweep(now),
        }
        out
    }

    /// Moves pending `id` to resolving, with `perm` waiting for it, and
    /// asks for its pid. A `start` for an id that is not pending goes on.
    fn resolve(
        &mut self,
        id: String,
        perm: Option<P>,
        seen: Option<Observed>,
        out: &mut Vec<Effect<P>>,
    ) {
        if self.resolving.contains_key(&id) {
            // Its pid is being read already; `perm` waits for that.
            self.resolving.entry(id).or_default().extend(perm);
            return;
        }
        let Some(pending) = self.pending.remove(&id) else {
            if let Some(perm) = perm {
                let pid = self.tracked_pid(&id);
                out.push(Effect::ReleaseStart { id, pid, perm });
            }
            return;
        };
        self.resolving
            .insert(id.clone(), perm.into_iter().collect());
        out.push(Effect::Resolve { id, pending, seen });
    }

    fn track(&mut self, c: Container, pid: u32, source: Source, out: &mut Vec<Effect<P>>) {
        let watch = self.next_watch;
        self.next_watch += 1;
        out.push(Effect::WatchExit {
            id: c.id.clone(),
            pid,
            watch,
        });
        let c = Arc::new(c);
        self.hold_pid(c.pid);
        let tracked = Tracked {
            record: Arc::clone(&c),
            watch,
        };
        if let Some(old) = self.tracked.insert(c.id.clone(), tracked) {
            self.release_pid(old.record.pid);
        }
        out.push(Effect::Emit(ContainerEvent::added(source, c)));
    }

    fn sweep(&mut self, now: Instant) {
        let before = self.pending.len();
        self.pending
            .retain(|_, p| now.saturating_duration_since(p.since) < PENDING_TTL);
        if self.pending.len() < before {
            tracing::debug!(
                dropped = before - self.pending.len(),
                "dropped stale pending creates"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lookout_model::EventKind;

    type L = Lifecycle<u32>;

    fn pending(at: Instant) -> Pending {
        Pending {
            runtime: RuntimeKind::Runc,
            root: PathBuf::from("/run/runc"),
            bundle: Some(PathBuf::from("/b")),
            pid_file: None,
            config: None,
            status: Status::Created,
            since: at,
            started: None,
        }
    }

    fn container(id: &str, pid: u32) -> Container {
        let mut c = Container::new(id, RuntimeKind::Runc);
        c.pid = Some(pid);
        c
    }

    /// A `create` of `id` (runtime pid 100) whose exec was allowed
    /// already (fanotify-only mode).
    fn created(l: &mut L, id: &str, at: Instant) {
        let e = l.step(Input::Created {
            id: id.into(),
            pending: pending(at),
            pid: 100,
            perm: None,
        });
        assert_eq!(trace(&e), [format!("watch-create:{id}:100")]);
    }

    /// The exit of tracked `id`'s init, as its exit watch reports it.
    fn exited(l: &L, id: &str, code: Option<i32>) -> Input<u32> {
        Input::Exited {
            id: id.into(),
            watch: l.tracked_watch(id).expect("tracked"),
            pid: l.tracked_pid(id).expect("a pid"),
            code,
        }
    }

    /// A compact trace of effects: `resolve:a`, `watch:a:7`,
    /// `added:a`/`removed:a`, `start:a:<perm>`.
    fn trace(effects: &[Effect<u32>]) -> Vec<String> {
        effects
            .iter()
            .map(|e| match e {
                Effect::Resolve { id, seen, .. } => {
                    format!("resolve:{id}{}", if seen.is_some() { ":seen" } else { "" })
                }
                Effect::WatchExit { id, pid, .. } => format!("watch:{id}:{pid}"),
                Effect::Emit(ev) => {
                    let kind = match ev.event {
                        EventKind::Added => "added",
                        EventKind::Removed => "removed",
                        EventKind::Updated => "updated",
                    };
                    format!("{kind}:{}", ev.container.id)
                }
                Effect::ReleaseStart { id, perm, .. } => format!("start:{id}:{perm}"),
                Effect::Allow(perm) => format!("allow:{perm}"),
                Effect::WatchCreate { id, pid } => format!("watch-create:{id}:{pid}"),
                Effect::WatchRun { id, pid, .. } => format!("watch-run:{id}:{pid}"),
            })
            .collect()
    }

    #[test]
    fn a_read_that_starts_early_takes_the_config_and_leaves_the_rest() {
        let mut l = L::default();
        let now = Instant::now();
        let mut p = pending(now);
        p.config = Some(OciConfig {
            hostname: Some("web".into()),
            ..OciConfig::default()
        });
        l.step(Input::Created {
            id: "a".into(),
            pending: p,
            pid: 100,
            perm: None,
        });
        assert!(l.take_for_read("b").is_none());
        let copy = l.take_for_read("a").expect("pending");
        assert_eq!(copy.config.and_then(|c| c.hostname).as_deref(), Some("web"));
        assert_eq!(copy.root, PathBuf::from("/run/runc"));
        // Still pending, its config gone with the copy; asked for as ever.
        let again = l.take_for_read("a").expect("still pending");
        assert!(again.config.is_none());
        // A read that could not start gives it back.
        l.restore_config("a", Some(OciConfig::default()));
        assert!(l.take_for_read("a").expect("pending").config.is_some());
        let e = l.step(Input::CreateExited { id: "a".into() });
        assert_eq!(trace(&e), ["resolve:a"]);
    }

    #[test]
    fn create_then_exit_then_pid_reports_and_tracks() {
        let (mut l, now) = (L::default(), Instant::now());
        created(&mut l, "a", now);
        assert!(l.knows("a"));
        let e = l.step(Input::CreateExited { id: "a".into() });
        assert_eq!(trace(&e), ["resolve:a"]);
        assert!(
            l.knows("a"),
            "resolving is known: a scan must not report it"
        );
        let e = l.step(Input::Resolved {
            id: "a".into(),
            container: Some(container("a", 7)),
        });
        assert_eq!(trace(&e), ["watch:a:7", "added:a"]);
        assert_eq!(l.counts(), (0, 0, 1));
    }

    #[test]
    fn the_tracked_record_is_the_one_added_and_removed_carry() {
        let (mut l, now) = (L::default(), Instant::now());
        created(&mut l, "a", now);
        l.step(Input::CreateExited { id: "a".into() });
        let mut c = container("a", 7);
        c.annotations.insert("big".into(), "x".repeat(64 * 1024));
        let e = l.step(Input::Resolved {
            id: "a".into(),
            container: Some(c),
        });
        let added = e
            .iter()
            .find_map(|e| match e {
                Effect::Emit(ev) => Some(Arc::clone(&ev.container)),
                _ => None,
            })
            .expect("added");
        let kept = &l.tracked.get("a").expect("tracked").record;
        assert!(
            Arc::ptr_eq(kept, &added),
            "the table and the event share one record, not two copies"
        );
        drop(e);
        let e = l.step(exited(&l, "a", Some(0)));
        let removed = e
            .iter()
            .find_map(|e| match e {
                Effect::Emit(ev) => Some(Arc::clone(&ev.container)),
                _ => None,
            })
            .expect("removed");
        assert_eq!(removed.status, Status::Stopped);
        assert_eq!(removed.annotations["big"].len(), 64 * 1024);
    }

    #[test]
    fn a_start_before_the_report_goes_on_only_after_added() {
        let (mut l, now) = (L::default(), Instant::now());
        created(&mut l, "a", now);
        // `start` comes while the create process still runs (or before its
        // exit was seen): it resolves the container and waits.
        let e = l.step(Input::Start {
            id: "a".into(),
            perm: Some(1),
        });
        assert_eq!(trace(&e), ["resolve:a"]);
        // A second `start` of the same id waits too, and the create's exit
        // asks for nothing more.
        assert!(
            l.step(Input::Start {
                id: "a".into(),
                perm: Some(2)
            })
            .is_empty()
        );
        assert!(l.step(Input::CreateExited { id: "a".into() }).is_empty());
        let e = l.step(Input::Resolved {
            id: "a".into(),
            container: Some(container("a", 7)),
        });
        assert_eq!(
            trace(&e),
            ["watch:a:7", "added:a", "start:a:1", "start:a:2"]
        );
        match &e[2] {
            Effect::ReleaseStart { pid, .. } => assert_eq!(*pid, Some(7)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_start_of_a_reported_or_unknown_container_goes_on_at_once() {
        let (mut l, now) = (L::default(), Instant::now());
        let e = l.step(Input::Start {
            id: "nobody".into(),
            perm: Some(3),
        });
        assert_eq!(trace(&e), ["start:nobody:3"]);
        created(&mut l, "a", now);
        l.step(Input::CreateExited { id: "a".into() });
        l.step(Input::Resolved {
            id: "a".into(),
            container: Some(container("a", 7)),
        });
        let e = l.step(Input::Start {
            id: "a".into(),
            perm: Some(4),
        });
        assert_eq!(trace(&e), ["start:a:4"]);
        // Allowed already (fanotify-only mode): nothing to release.
        assert!(
            l.step(Input::Start {
                id: "a".into(),
                perm: None
            })
            .is_empty()
        );
    }

    #[test]
    fn a_failed_create_releases_its_starts_and_reports_nothing() {
        let (mut l, now) = (L::default(), Instant::now());
        created(&mut l, "a", now);
        l.step(Input::Start {
            id: "a".into(),
            perm: Some(1),
        });
        let e = l.step(Input::Resolved {
            id: "a".into(),
            container: None,
        });
        assert_eq!(trace(&e), ["start:a:1"]);
        assert!(!l.knows("a"));
    }

    #[test]
    fn reconciliation_first_means_no_second_report() {
        let (mut l, now) = (L::default(), Instant::now());
        created(&mut l, "a", now);
        l.step(Input::CreateExited { id: "a".into() });
        // The scan skips what is known...
        assert!(l.step(Input::Found(vec![container("a", 7)])).is_empty());
        // ...and a container the scan reported first is not reported again.
        let e = l.step(Input::Found(vec![container("b", 8)]));
        assert_eq!(trace(&e), ["watch:b:8", "added:b"]);
        assert_eq!(e.len(), 2);
        match &e[1] {
            Effect::Emit(ev) => assert_eq!(ev.source, Source::StateScan),
            other => panic!("{other:?}"),
        }
        let e = l.step(Input::Created {
            id: "b".into(),
            pending: pending(now),
            pid: 100,
            perm: None,
        });
        assert!(
            e.is_empty(),
            "a create of a tracked id is not watched: {e:?}"
        );
        assert!(!l.pending.contains_key("b"), "a tracked id is not pending");
        let e = l.step(Input::Resolved {
            id: "a".into(),
            container: Some(container("a", 7)),
        });
        assert_eq!(trace(&e), ["watch:a:7", "added:a"]);
        let e = l.step(Input::Resolved {
            id: "a".into(),
            container: Some(container("a", 7)),
        });
        assert!(e.is_empty(), "same id and pid: reported once, {e:?}");
    }

    #[test]
    fn an_exit_ends_only_the_container_its_watch_was_for() {
        let (mut l, _) = (L::default(), Instant::now());
        l.step(Input::Found(vec![container("a", 7)]));
        let watch = l.tracked_watch("a").expect("tracked");
        // Another watch's exit (an earlier container with this id), even
        // with the same pid, changes nothing.
        for other in [watch + 1, watch.wrapping_sub(1)] {
            let e = l.step(Input::Exited {
                id: "a".into(),
                watch: other,
                pid: 7,
                code: Some(1),
            });
            assert!(e.is_empty(), "{:?}", trace(&e));
        }
        let e = l.step(Input::Exited {
            id: "a".into(),
            watch,
            pid: 7,
            code: Some(3),
        });
        assert_eq!(trace(&e), ["removed:a"]);
        match &e[0] {
            Effect::Emit(ev) => assert_eq!(ev.exit_code, Some(3)),
            other => panic!("{other:?}"),
        }
        assert!(!l.knows("a"));
        // Exactly once.
        assert!(
            l.step(Input::Exited {
                id: "a".into(),
                watch,
                pid: 7,
                code: None
            })
            .is_empty()
        );
    }

    #[test]
    fn run_is_resolved_from_what_its_watcher_saw() {
        let (mut l, now) = (L::default(), Instant::now());
        let mut p = pending(now);
        p.status = Status::Running;
        let e = l.step(Input::Created {
            id: "r".into(),
            pending: p,
            pid: 200,
            perm: Some(9),
        });
        assert_eq!(trace(&e), ["allow:9", "watch-run:r:200"]);
        let seen = Observed {
            id: "r".into(),
            pid: 9,
            namespaces: Default::default(),
            cgroup: None,
        };
        let e = l.step(Input::Observed(seen.clone()));
        assert_eq!(trace(&e), ["resolve:r:seen"]);
        // A second observation of the same id asks for nothing.
        assert!(l.step(Input::Observed(seen)).is_empty());
    }

    #[test]
    fn deleting_a_container_that_shares_its_sandbox_removes_it() {
        let mut l = L::default();
        let mut sandbox = container("pod", 5);
        sandbox.sandbox = Some("gvisor".into());
        let mut app = container("app", 5);
        app.sandbox = Some("gvisor".into());
        let shared = l.shared_pids();
        let shared = || shared.load(std::sync::atomic::Ordering::Acquire);
        l.step(Input::Found(vec![sandbox, app]));
        assert!(l.is_sandboxed("app"));
        assert_eq!(shared(), 1, "two containers on pid 5: a delete matters");
        let e = l.step(Input::Deleted { id: "app".into() });
        assert_eq!(trace(&e), ["removed:app"]);
        assert_eq!(shared(), 0);
        // The last one in the sandbox ends with its init's exit instead.
        assert!(l.step(Input::Deleted { id: "pod".into() }).is_empty());
        // A container with its own init (runc) is never removed by delete.
        l.step(Input::Found(vec![container("own", 11)]));
        assert!(!l.is_sandboxed("own"));
        assert!(l.step(Input::Deleted { id: "own".into() }).is_empty());
        assert_eq!(shared(), 0, "one container per pid: deletes teach nothing");
        // A third container on pod's pid, then both end with its exit.
        l.step(Input::Found(vec![container("side", 5)]));
        assert_eq!(shared(), 1, "side joins pod on pid 5");
        for id in ["pod", "side"] {
            let e = l.step(exited(&l, id, None));
            assert_eq!(trace(&e), [format!("removed:{id}")]);
        }
        assert_eq!(shared(), 0);
    }

    #[test]
    fn stale_pending_creates_are_swept_and_a_full_table_sweeps_first() {
        let (mut l, t0) = (L::default(), Instant::now());
        created(&mut l, "old", t0);
        l.step(Input::Sweep {
            now: t0 + PENDING_TTL / 2,
        });
        assert!(l.knows("old"));
        l.step(Input::Sweep {
            now: t0 + PENDING_TTL,
        });
        assert!(!l.knows("old"));
        // A full table sweeps before it grows.
        for i in 0..MAX_PENDING {
            created(&mut l, &format!("c{i}"), t0);
        }
        created(&mut l, "extra", t0);
        assert_eq!(l.counts(), (MAX_PENDING + 1, 0, 0));
        created(&mut l, "later", t0 + PENDING_TTL);
        assert!(l.knows("later"));
        assert_eq!(l.counts(), (1, 0, 0));
    }

    #[test]
    fn a_held_create_goes_on_once_its_container_is_remembered_and_its_end_is_watched() {
        let (mut l, now) = (L::default(), Instant::now());
        let e = l.step(Input::Created {
            id: "a".into(),
            pending: pending(now),
            pid: 100,
            perm: Some(1),
        });
        assert!(l.knows("a"), "remembered before the exec goes on");
        assert_eq!(trace(&e), ["allow:1", "watch-create:a:100"]);
        let e = l.step(Input::CreateExited { id: "a".into() });
        assert_eq!(trace(&e), ["resolve:a"]);
    }

    #[test]
    fn an_id_used_again_after_its_exit_is_a_new_container() {
        let (mut l, now) = (L::default(), Instant::now());
        l.step(Input::Found(vec![container("a", 7)]));
        let old = l.tracked_watch("a").expect("tracked");
        // What the hook's task steps when the create comes before the
        // notice of the old init's exit: that exit, then the create.
        let e = l.step(exited(&l, "a", None));
        assert_eq!(trace(&e), ["removed:a"]);
        let e = l.step(Input::Created {
            id: "a".into(),
            pending: pending(now),
            pid: 100,
            perm: Some(3),
        });
        assert_eq!(trace(&e), ["allow:3", "watch-create:a:100"]);
        let e = l.step(Input::CreateExited { id: "a".into() });
        assert_eq!(trace(&e), ["resolve:a"]);
        // The new init even has the old one's pid (reused).
        l.step(Input::Resolved {
            id: "a".into(),
            container: Some(container("a", 7)),
        });
        assert_ne!(l.tracked_watch("a"), Some(old), "a watch of its own");
        // The old exit's own notice, handled late, ends nothing new.
        let e = l.step(Input::Exited {
            id: "a".into(),
            watch: old,
            pid: 7,
            code: None,
        });
        assert!(e.is_empty(), "{:?}", trace(&e));
        assert_eq!(l.tracked_pid("a"), Some(7));
        assert!(l.tracked_watch("a").is_some(), "still tracked");
    }

    #[test]
    fn a_create_of_a_reported_id_goes_on_and_is_not_watched() {
        let (mut l, now) = (L::default(), Instant::now());
        l.step(Input::Found(vec![container("a", 7)]));
        let e = l.step(Input::Created {
            id: "a".into(),
            pending: pending(now),
            pid: 100,
            perm: Some(2),
        });
        assert_eq!(trace(&e), ["allow:2"]);
        assert_eq!(
            l.counts(),
            (0, 0, 1),
            "still the reported one, nothing pending"
        );
    }
}
