//! What goes in and out of the machine: the [`Input`]s the hook's task
//! steps, the [`Effect`]s it carries out, and the data a read needs.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use lookout_model::{Container, ContainerEvent, RuntimeKind, Status};

use crate::oci::OciConfig;
use crate::run_watch::Observed;

/// A container seen at `create`/`run`, not yet reported: what its read
/// needs.
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

/// A `create`'s [`Pending`], shared by the reader that waits for the
/// `create`'s exit and the hook's task. Whoever takes it reads it; the
/// other finds `None` and reads nothing.
pub(crate) type Handoff = Arc<Mutex<Option<Pending>>>;

/// Takes what `handoff` holds (a reader that panicked holding the lock
/// took nothing: the rest is sound).
pub(crate) fn take(handoff: &Handoff) -> Option<Pending> {
    handoff
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

/// What the hook learned.
// Moved once, from the notice that carried it to `step`: its size costs
// nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Input<P> {
    /// A `create` or `run` of `id` by runtime process `pid` (its
    /// config.json read, or not). `perm` is the held exec, `None` when it
    /// was allowed already (fanotify-only mode: a late argv).
    Created {
        id: String,
        pending: Pending,
        pid: u32,
        perm: Option<P>,
    },
    /// A `run` watcher saw `id` running.
    Observed(Observed),
    /// The runtime was asked to `start` `id`. `perm` is the held exec,
    /// `None` when it was allowed already (fanotify-only mode).
    Start { id: String, perm: Option<P> },
    /// Read number `read` of `id` ended: the container filled, or `None`
    /// when there is nothing to report (a failed create, unreadable state,
    /// a pid that is no container's, a read past its deadline).
    Read {
        id: String,
        read: u64,
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
    /// A held runtime exec that makes no container (`delete`, `state`,
    /// runc's re-exec, a command line that cannot be parsed).
    Other { perm: P },
    /// Forget waiting containers older than [`PENDING_TTL`](super::PENDING_TTL) at `now`.
    Sweep { now: Instant },
}

/// What the hook must do, in this order.
#[derive(Debug)]
// N.B. effects live for one step, a few at a time: boxing the event
// would cost an allocation per event to save stack.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Effect<P> {
    /// Let a held exec go on.
    Allow(P),
    /// Watch the `create` process `pid` of `id`. Once it has exited, read
    /// what `handoff` holds (if nothing took it meanwhile): the pid, from
    /// the runtime's state or pid file, then the container, within the
    /// answer deadline counted from the exit. Then step [`Input::Read`]
    /// with this `read`.
    WatchCreate {
        id: String,
        pid: u32,
        runtime: RuntimeKind,
        read: u64,
        handoff: Handoff,
    },
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
    /// Read `pending` now (the pid from `seen`, or the runtime's state or
    /// pid file), and step [`Input::Read`] with this `read`. Off the task,
    /// within the answer deadline: the files may be on a hung file system.
    Read {
        id: String,
        read: u64,
        pending: Pending,
        seen: Option<Observed>,
    },
    /// A `start` came before the `create`'s exit was read: read what
    /// `handoff` holds now, as [`Effect::Read`] does. If the reader that
    /// waits for the exit took it first, it is reading: do nothing, its
    /// [`Input::Read`] comes.
    ReadNow {
        id: String,
        read: u64,
        handoff: Handoff,
    },
    /// Watch the exit of `pid`, the init of `id`, and step
    /// [`Input::Exited`] with this `watch` when it comes.
    WatchExit { id: String, pid: u32, watch: u64 },
    /// Hand this event to the sink.
    Emit(ContainerEvent),
    /// Let the held `start` of `id` go on (after its start barrier).
    /// `pid` is the container's init, to kill if the barrier denies it.
    ReleaseStart {
        id: String,
        pid: Option<u32>,
        perm: P,
    },
}
