//! The runtime hook: one fanotify group with `FAN_OPEN_EXEC_PERM` marks on
//! the runtime binaries, BPF argv capture, and the task that drives the
//! container lifecycle ([`crate::lifecycle`]).
//!
//! The task takes runtime execs from the answering thread and notices from
//! the tasks and threads it started, turns them into lifecycle inputs and
//! carries out the effects; it decides nothing itself. By concern:
//!
//! - `builder`: [`Builder`] and the private `Config` it writes;
//! - `marks`: the runtime binaries marked, and marked again by a rescan;
//! - `scan`: the start-up scan and the reconciliation's scan;
//! - `exec`: a runtime exec turned into an input;
//! - `effects`: the lifecycle's effects carried out;
//! - `read`: reading a container off the task, bounded (a `create`'s right
//!   after its exit);
//! - `exits`: exit watches of tracked containers, and their notices;
//! - `late`: fanotify-only mode's argv read from /proc after the exec.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lookout_fanotify::{Class, Fanotify, Report};
use lookout_model::{Container, RuntimeKind, Sink};
use tokio::sync::mpsc;

use crate::Error;
use crate::answer::{Answerer, Exec, Held, Marked};
use crate::argv::Invocation;
use crate::capture::ExecCapture;
use crate::lifecycle::{Input, Lifecycle};
use crate::oci::OciConfig;
use crate::stats::{Counters, Stats};

mod builder;
mod effects;
mod exec;
mod exits;
mod late;
mod marks;
mod read;
mod scan;
mod started;

use builder::Config;
pub use builder::{Builder, DEFAULT_SCHEDULER_SLICE};

/// What the hook's task hears from the tasks and threads it started.
enum Notice {
    /// An input learned off the task: a read ended (`Read`), a `run`
    /// watcher saw its container (`Observed`), an init exited (`Exited`,
    /// its code filled from BPF when it is handled), a sandboxed container
    /// was deleted (`Deleted`).
    /// Boxed: a notice waits in a queue, an input can be large.
    Step(Box<Input<Held>>),
    /// fanotify-only mode: an exec followed after it was allowed (see
    /// [`late`]).
    Late(late::Late),
    /// A `create`/`run`'s config.json was read (or not) off the task; its
    /// exec, still held when `perm` is set, goes on once it is noted.
    CreateRead(Box<CreateRead>),
}

/// An exit watch of a tracked container.
struct ExitWatch {
    /// The pidfd it waits on (`None`: it could not be opened, and the
    /// watch's notice comes at once). Kept to ask whether an init has
    /// exited before the notice of its exit is handled
    /// ([`RuntimeHook::end_if_exited`]); a pidfd names its process, never
    /// one that reused the pid.
    fd: Option<Arc<OwnedFd>>,
    /// The task that waits: stopped when its container ends otherwise (a
    /// `delete` in a shared sandbox), so that it does not hold a pidfd
    /// until the whole sandbox exits.
    task: tokio::task::AbortHandle,
}

/// A `create` or `run` whose config.json was being read.
struct CreateRead {
    pid: u32,
    /// `run`'s start time (clock ticks since boot), read while its exec was
    /// held.
    started: Option<u64>,
    inv: Invocation,
    perm: Option<Held>,
    cwd: Option<PathBuf>,
    bundle: Option<PathBuf>,
    config: Option<OciConfig>,
}

/// The runtime hook. Create with [`RuntimeHook::builder`], report what already
/// runs with [`RuntimeHook::scan`], then drive it with [`RuntimeHook::run`].
pub struct RuntimeHook {
    config: Config,
    group: Fanotify,
    capture: Option<ExecCapture>,
    /// Pending, resolving and tracked containers.
    lifecycle: Lifecycle<Held>,
    /// The exit watches of tracked containers, by watch
    /// ([`Effect::WatchExit`](crate::lifecycle::Effect::WatchExit)).
    exits: HashMap<u64, ExitWatch>,
    notices_tx: mpsc::Sender<Notice>,
    notices_rx: mpsc::Receiver<Notice>,
    counters: Arc<Counters>,
    marked: Arc<Marked>,
    execs: mpsc::Receiver<Exec>,
    answerer: Answerer,
    /// Runtime roots seen in argv (`--root`), scanned by reconciliation
    /// besides the default ones. Bounded by [`MAX_LEARNED_ROOTS`].
    learned_roots: Vec<(RuntimeKind, PathBuf)>,
    /// fanotify-only mode: execs whose argv could not be read, and the
    /// readers that follow them.
    unread: late::Unread,
    /// How long [`Builder::build`] took, by phase.
    startup: StartupTimes,
}

/// How long [`Builder::build`] took, by phase, so that an agent can report
/// which part of its start-up a regression is in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StartupTimes {
    /// Loading and attaching the BPF programs (zero without a BPF object).
    pub bpf: std::time::Duration,
    /// Creating the fanotify group, starting the answerer and marking the
    /// runtime binaries.
    pub marks: std::time::Duration,
}

impl Drop for RuntimeHook {
    fn drop(&mut self) {
        // Closing the channel first lets an answerer blocked on a full channel
        // go on (its message, and the exec in it, is allowed on drop).
        self.execs.close();
        while self.execs.try_recv().is_ok() {}
        self.answerer.stop();
    }
}

impl std::fmt::Debug for RuntimeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeHook")
            .field("marked", &self.marked.paths)
            .field("lifecycle", &self.lifecycle.counts())
            .finish_non_exhaustive()
    }
}

const MAX_LEARNED_ROOTS: usize = 64;

/// A task aborted when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl RuntimeHook {
    /// Sets up a hook; see [`Builder`].
    pub fn builder() -> Builder {
        Builder::default()
    }

    fn new(config: Config) -> Result<RuntimeHook, Error> {
        let names: Vec<String> = config
            .binaries
            .iter()
            .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(str::to_owned))
            .collect();
        // BPF first: once a binary is marked, an exec without a record is
        // one we can only allow blindly.
        let started = std::time::Instant::now();
        let mut capture = match &config.bpf_object {
            Some(obj) => Some(ExecCapture::load(obj, &names)?),
            None => None,
        };
        let bpf = started.elapsed();
        // Blocking: only the answering thread reads it, in `read(2)`.
        let group = Fanotify::builder()
            .class(Class::Content)
            .report(Report::TID)
            .nonblock(false)
            .init()
            .map_err(Error::Fanotify)?;
        let counters = Arc::new(Counters::new(
            config.observer.clone(),
            config.answer_deadline,
        ));
        let marked = Arc::new(Marked::default());
        crate::bounded::set_reader_slice(config.slice);
        let (exec_tx, execs) = mpsc::channel(1024);
        let ring = capture.as_mut().and_then(ExecCapture::take_ring);
        let lifecycle = Lifecycle::default();
        let answerer = Answerer::spawn(
            group.share(),
            ring,
            Arc::clone(&counters),
            Arc::clone(&marked),
            lifecycle.shared_pids(),
            exec_tx,
            config.slice,
        )
        .map_err(Error::Thread)?;
        crate::untrusted::keep_root(&config.host_root);
        let (notices_tx, notices_rx) = mpsc::channel(1024);
        let learned_roots = config.state_roots.clone();
        let mut hook = RuntimeHook {
            config,
            group,
            capture,
            lifecycle,
            exits: HashMap::new(),
            notices_tx,
            notices_rx,
            counters,
            marked,
            execs,
            answerer,
            learned_roots,
            unread: late::Unread::new(),
            startup: StartupTimes::default(),
        };
        let binaries = hook.config.binaries.clone();
        for b in &binaries {
            hook.watch_binary(b)?;
        }
        hook.startup = StartupTimes {
            bpf,
            marks: started.elapsed().saturating_sub(bpf),
        };
        Ok(hook)
    }

    /// How long [`Builder::build`] took, by phase.
    pub fn startup_times(&self) -> StartupTimes {
        self.startup
    }

    /// Marks another runtime binary (found by a later rescan).
    pub fn watch_binary(&mut self, path: &std::path::Path) -> Result<(), Error> {
        self.mark(path)
    }

    /// Reports the containers that already run, from the runtimes' state
    /// directories (source `state-scan`). A pid whose start time does not
    /// match the state file (pid reuse) is skipped.
    pub fn scan(&mut self, sink: &mut dyn Sink) {
        self.end_all_exited(sink);
        let found = self.scan_untracked();
        self.step(Input::Found(found), sink);
    }

    /// The fanotify group's file descriptor. Processes this agent starts
    /// (hooks) must close it before they exec: see `lookout-fanotify`'s
    /// notes on children that hold a group.
    pub fn group_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.group)
    }

    /// A handle for health checks (see [`Health`](crate::Health)), usable
    /// from any thread after the hook moved into [`RuntimeHook::run`].
    pub fn health(&self) -> crate::Health {
        self.counters.health()
    }

    /// Whether argv is captured by BPF.
    pub fn has_bpf(&self) -> bool {
        self.capture.is_some()
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.counters.stats()
    }

    /// Containers currently tracked.
    pub fn tracked(&self) -> impl Iterator<Item = &Container> {
        self.lifecycle.tracked()
    }

    /// Handles events until `shutdown` completes. Every permission event is
    /// answered; on return the group is closed, which removes the marks.
    ///
    /// The future is `Send` when `shutdown` is, so that it can run as a
    /// task of its own (`tokio::spawn`) rather than inside `block_on`: on a
    /// current-thread runtime, a container's exit then reaches the loop
    /// without a write to the runtime's eventfd and another `epoll_wait`.
    pub async fn run(
        mut self,
        sink: &mut (dyn Sink + Send),
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Stats {
        tokio::pin!(shutdown);
        // The BPF programs' diagnostics, on a task of their own: woken only
        // when a program wrote one.
        let bpf_log = self
            .capture
            .as_mut()
            .and_then(ExecCapture::take_log)
            .map(|log| AbortOnDrop(tokio::spawn(log.run())));
        let mut sweep = tokio::time::interval(Duration::from_secs(10));
        let rescan = self.config.rescan.clone();
        let mut rescan_tick = tokio::time::interval(
            rescan
                .as_ref()
                .map_or(Duration::from_secs(3600), |r| r.interval),
        );
        loop {
            let dropped = self
                .counters
                .unseen_dropped
                .swap(0, std::sync::atomic::Ordering::Relaxed);
            if dropped > 0 {
                self.counters.count_unread_argv();
                self.unread.note(format!(
                    "{dropped} runtime execs not followed: the queue was full"
                ));
            }
            let due = self.unread.due();
            tokio::select! {
                () = &mut shutdown => break,
                Some(x) = self.execs.recv() => self.on_exec(x, sink),
                Some(n) = self.notices_rx.recv() => self.notice(n, sink),
                // Several unread execs cost one scan; see `Unread::due`.
                () = due, if !self.unread.is_empty() => self.reconcile(sink),
                _ = sweep.tick() => self.step(Input::Sweep { now: Instant::now() }, sink),
                _ = rescan_tick.tick(), if rescan.is_some() => {
                    if let Some(r) = &rescan {
                        self.mark_found(&*r.find);
                    }
                }
            }
        }
        drop(bpf_log);
        // Dropping `self` answers everything still queued (see Drop).
        self.counters.stats()
    }

    fn notice(&mut self, n: Notice, sink: &mut dyn Sink) {
        match n {
            Notice::Step(input) => match *input {
                Input::Exited {
                    id,
                    watch,
                    pid,
                    code,
                } => self.on_exit(id, watch, pid, code, sink),
                Input::Deleted { id } => self.on_delete(id, sink),
                input => self.step(input, sink),
            },
            Notice::CreateRead(r) => self.on_create_read(*r, sink),
            Notice::Late(late) => self.on_late(late, sink),
        }
    }
}
