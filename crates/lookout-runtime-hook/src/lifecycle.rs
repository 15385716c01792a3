//! The container lifecycle as a pure state machine.
//!
//! The hook's task turns what it sees (runtime execs, a read's result, an
//! init's exit) into [`Input`]s, and [`Lifecycle::step`] returns the
//! [`Effect`]s to carry out (answer an exec, watch a `create` and read its
//! container once it exits, read a container now, watch an exit, emit an
//! event, let a `start` go on): the whole create → start → exit story is
//! here, reads included. `step` does no I/O and reads no clock, so every
//! transition is unit-tested (`lifecycle/tests.rs`) without root, a
//! runtime or a tokio runtime.
//!
//! ```text
//!            Created               Start / Observed
//!   (none) ──────────▶ waiting ─────────────────────▶ resolving
//!     ▲                 │    │                            │
//!     │ Sweep (the TTL) │    │ Read (its number)          │ Read (its number)
//!     └─────────────────┘    ▼                            ▼
//!                         tracked ◀──────────────────────┘
//!   Found (a state scan) ──▶ tracked
//!   tracked ── Exited (its own watch) / Deleted (shared sandbox) ──▶ (none)
//! ```
//!
//! A `create`'s container is read by a reader that waits for the
//! `create`'s exit and reads right after it ([`Effect::WatchCreate`]), so
//! its data goes to that reader in a [`Handoff`] when the `create` is
//! seen. Whoever takes the data from the hand-off reads it: the waiting
//! reader after the exit, or the hook's task at once for a `start` that
//! comes while the `create` still runs ([`Effect::ReadNow`]). Either way
//! one [`Input::Read`] comes back, numbered: a read of an earlier `create`
//! of the same id carries another number and is dropped.
//!
//! The one ordering rule: a `start` held while its container is waiting or
//! resolving is released only *after* the container's `added` event (the
//! effects come in that order), so no container runs its first
//! instruction before it is reported.
//!
//! The held exec is a type parameter (`P`): the hook passes its held
//! permission events, the tests plain numbers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lookout_model::{Container, ContainerEvent, Source, Status};

use crate::run_watch::Observed;

mod io;
#[cfg(test)]
mod tests;

pub(crate) use io::{Effect, Handoff, Input, Pending, take};

/// With this many containers waiting, a `create` drops the ones older
/// than [`PENDING_TTL`] first.
pub(crate) const MAX_PENDING: usize = 4096;
/// A waiting container whose `create` never ended is forgotten after this.
pub(crate) const PENDING_TTL: Duration = Duration::from_secs(60);

/// A container seen at `create`/`run` whose read nobody asked for yet.
#[derive(Debug)]
enum Waiting {
    /// A `run`: its data, until its watcher sees the init (or a `start`).
    Run(Pending),
    /// A `create`: its data is in `handoff`, with the reader that waits
    /// for the exit ([`Effect::WatchCreate`]).
    Exit {
        read: u64,
        handoff: Handoff,
        since: Instant,
    },
}

impl Waiting {
    fn since(&self) -> Instant {
        match self {
            Waiting::Run(p) => p.since,
            Waiting::Exit { since, .. } => *since,
        }
    }
}

/// A container whose read was asked for: by a `start` (held in `starts`
/// until the report), a `run` watcher, or the read's own end.
#[derive(Debug)]
struct Resolving<P> {
    /// The read whose [`Input::Read`] ends it.
    read: u64,
    /// The held `start`s, released after the report.
    starts: Vec<P>,
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
    /// Seen at `create`/`run`; read, or being read, for nobody yet.
    waiting: HashMap<String, Waiting>,
    /// Their read was asked for; the `start`s that wait for the report.
    resolving: HashMap<String, Resolving<P>>,
    /// Reported, with a live init.
    tracked: HashMap<String, Tracked>,
    /// The number the next read gets.
    next_read: u64,
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
            waiting: HashMap::new(),
            resolving: HashMap::new(),
            tracked: HashMap::new(),
            next_read: 0,
            next_watch: 0,
            pids: HashMap::new(),
            shared: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl<P> Lifecycle<P> {
    /// Whether `id` is waiting, resolving or tracked (a scan must not
    /// report it again).
    pub fn knows(&self, id: &str) -> bool {
        self.tracked.contains_key(id)
            || self.waiting.contains_key(id)
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

    /// How many containers are waiting, resolving and tracked.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.waiting.len(), self.resolving.len(), self.tracked.len())
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
            } => self.created(id, pending, pid, perm, &mut out),
            Input::Observed(seen) => {
                // Only a `run`'s own entry: a `create` of the id since then
                // has a read of its own.
                if let Some(Waiting::Run(_)) = self.waiting.get(&seen.id)
                    && let Some(Waiting::Run(pending)) = self.waiting.remove(&seen.id)
                {
                    let id = seen.id.clone();
                    self.read(id, pending, Some(seen), None, &mut out);
                }
            }
            Input::Start { id, perm } => self.start(id, perm, &mut out),
            Input::Read {
                id,
                read,
                container,
            } => self.read_ended(id, read, container, &mut out),
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
            Input::Other { perm } => out.push(Effect::Allow(perm)),
            Input::Sweep { now } => self.sweep(now),
        }
        out
    }

    /// A `create`/`run` of `id`: remember it, let the exec go on, and
    /// watch what it makes.
    fn created(
        &mut self,
        id: String,
        pending: Pending,
        pid: u32,
        perm: Option<P>,
        out: &mut Vec<Effect<P>>,
    ) {
        // Reported already (reconciliation was first), or a create that
        // fails: runc refuses an id that exists. (An id used again after
        // its container ended: the hook's task steps that container's
        // `Exited` first.)
        if self.tracked.contains_key(&id) || self.resolving.contains_key(&id) {
            out.extend(perm.map(Effect::Allow));
            return;
        }
        if self.waiting.len() >= MAX_PENDING {
            self.sweep(pending.since);
        }
        // Only host root's execs get here: a root that floods creates is
        // not refused (that would hide a real one). A `create` of an id
        // that waits replaces it: the earlier one's read is dropped when
        // it ends, by its number.
        let watch = match pending.status {
            Status::Running => {
                let watch = Effect::WatchRun {
                    id: id.clone(),
                    pid,
                    runtime: pending.runtime.clone(),
                    root: pending.root.clone(),
                    started: pending.started,
                };
                self.waiting.insert(id, Waiting::Run(pending));
                watch
            }
            _ => {
                let read = self.next_read();
                let (since, runtime) = (pending.since, pending.runtime.clone());
                let handoff = Arc::new(Mutex::new(Some(pending)));
                self.waiting.insert(
                    id.clone(),
                    Waiting::Exit {
                        read,
                        handoff: Arc::clone(&handoff),
                        since,
                    },
                );
                Effect::WatchCreate {
                    id,
                    pid,
                    runtime,
                    read,
                    handoff,
                }
            }
        };
        // Remembered first: what the exec makes is then known.
        out.extend(perm.map(Effect::Allow));
        out.push(watch);
    }

    /// A `start` of `id`: it waits for the report of a container that
    /// waits or resolves (and asks for its read), and goes on at once for
    /// any other.
    fn start(&mut self, id: String, perm: Option<P>, out: &mut Vec<Effect<P>>) {
        if let Some(r) = self.resolving.get_mut(&id) {
            r.starts.extend(perm);
            return;
        }
        match self.waiting.remove(&id) {
            // The `create` still runs, or its reader reads: read now
            // unless that reader took it.
            Some(Waiting::Exit { read, handoff, .. }) => {
                self.resolving.insert(
                    id.clone(),
                    Resolving {
                        read,
                        starts: perm.into_iter().collect(),
                    },
                );
                out.push(Effect::ReadNow { id, read, handoff });
            }
            Some(Waiting::Run(pending)) => self.read(id, pending, None, perm, out),
            None => {
                if let Some(perm) = perm {
                    let pid = self.tracked_pid(&id);
                    out.push(Effect::ReleaseStart { id, pid, perm });
                }
            }
        }
    }

    /// Moves `id` to resolving, with `perm` waiting for it, and asks for a
    /// read of `pending` now.
    fn read(
        &mut self,
        id: String,
        pending: Pending,
        seen: Option<Observed>,
        perm: Option<P>,
        out: &mut Vec<Effect<P>>,
    ) {
        let read = self.next_read();
        self.resolving.insert(
            id.clone(),
            Resolving {
                read,
                starts: perm.into_iter().collect(),
            },
        );
        out.push(Effect::Read {
            id,
            read,
            pending,
            seen,
        });
    }

    /// Read number `read` of `id` gave `container`: report it and release
    /// the `start`s that waited. A read nobody waits for any more (an
    /// earlier `create`'s, or one swept) is dropped.
    fn read_ended(
        &mut self,
        id: String,
        read: u64,
        container: Option<Container>,
        out: &mut Vec<Effect<P>>,
    ) {
        let starts = match (self.resolving.get(&id), self.waiting.get(&id)) {
            (Some(r), _) if r.read == read => self
                .resolving
                .remove(&id)
                .map(|r| r.starts)
                .unwrap_or_default(),
            // Read before anyone asked: the `create` exited and its reader
            // was first.
            (None, Some(Waiting::Exit { read: r, .. })) if *r == read => {
                self.waiting.remove(&id);
                Vec::new()
            }
            _ => return,
        };
        let mut pid = None;
        if let Some(c) = container
            && let Some(p) = c.pid
        {
            pid = Some(p);
            if self.tracked_pid(&id) != Some(p) {
                self.track(c, p, Source::RuntimeHook, out);
            }
        }
        for perm in starts {
            out.push(Effect::ReleaseStart {
                id: id.clone(),
                pid,
                perm,
            });
        }
    }

    fn next_read(&mut self) -> u64 {
        let read = self.next_read;
        self.next_read += 1;
        read
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

    /// Stops tracking `id`; returns its record.
    fn untrack(&mut self, id: &str) -> Option<Arc<Container>> {
        let t = self.tracked.remove(id)?;
        self.release_pid(t.record.pid);
        Some(t.record)
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

    fn sweep(&mut self, now: Instant) {
        let before = self.waiting.len();
        self.waiting
            .retain(|_, w| now.saturating_duration_since(w.since()) < PENDING_TTL);
        if self.waiting.len() < before {
            tracing::debug!(
                dropped = before - self.waiting.len(),
                "dropped stale pending creates"
            );
        }
    }
}
