//! The runtime hook: one fanotify group with `FAN_OPEN_EXEC_PERM` marks on
//! the runtime binaries, BPF argv capture, and the container state machine.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lookout_fanotify::{Class, Fanotify, MarkFlags, Mask, Report};
use lookout_model::{Container, RuntimeKind, Sink, StartBarrier, StartDecision, Status};
use tokio::sync::mpsc;

use crate::answer::{Answerer, Exec, Held, Marked};
use crate::argv::{self, Command, Invocation};
use crate::capture::ExecCapture;
use crate::container::{fill, fill_init};
use crate::lifecycle::{Effect, Input, Lifecycle, Pending};
use crate::oci::OciConfig;
use crate::run_watch::{Observed, RunSeen};
use crate::state::{default_root, leaves_trace, read_pid_file_under, read_state_under};
use crate::stats::{Counters, Observer, Stats};
use crate::{Error, pidfd};

mod late;
use lookout_host::proc;

/// Finds the runtime binaries again (for binaries installed after start).
#[derive(Clone)]
struct Rescan {
    /// How often.
    interval: Duration,
    /// Returns the binaries to watch (paths this process opens).
    find: Arc<dyn Fn() -> Vec<PathBuf> + Send + Sync>,
}

impl std::fmt::Debug for Rescan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rescan")
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// How the hook runs; built by [`Builder`].
#[derive(Clone)]
struct Config {
    host_root: PathBuf,
    binaries: Vec<PathBuf>,
    bpf_object: Option<Vec<u8>>,
    answer_deadline: Duration,
    rescan: Option<Rescan>,
    observer: Option<Arc<dyn Observer>>,
    start_barrier: Option<Arc<dyn StartBarrier>>,
    start_barrier_cap: Duration,
    state_roots: Vec<(RuntimeKind, PathBuf)>,
    enrich: Option<Enrich>,
    slice: Option<Duration>,
}

/// [`Builder::scheduler_slice`]'s default: the shortest the kernel takes.
pub const DEFAULT_SCHEDULER_SLICE: Duration = Duration::from_micros(100);

/// What [`Builder::enrich`] keeps.
type Enrich = Arc<dyn Fn(&mut Container) + Send + Sync>;

/// Sets up a [`RuntimeHook`]: get one with [`RuntimeHook::builder`].
///
/// ```no_run
/// # async fn f() -> Result<(), lookout_runtime_hook::Error> {
/// use std::time::Duration;
/// use lookout_runtime_hook::RuntimeHook;
/// let hook = RuntimeHook::builder()
///     .binary("/usr/sbin/runc")
///     .answer_deadline(Duration::from_secs(1))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct Builder {
    config: Config,
}

impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.config;
        f.debug_struct("Builder")
            .field("host_root", &c.host_root)
            .field("binaries", &c.binaries)
            .field("bpf_object", &c.bpf_object.as_ref().map(Vec::len))
            .field("answer_deadline", &c.answer_deadline)
            .field("rescan", &c.rescan)
            .field("observer", &c.observer.is_some())
            .field("start_barrier", &c.start_barrier.is_some())
            .field("start_barrier_cap", &c.start_barrier_cap)
            .field("state_roots", &c.state_roots)
            .field("enrich", &c.enrich.is_some())
            .field("slice", &c.slice)
            .finish()
    }
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            config: Config {
                host_root: PathBuf::from("/"),
                binaries: Vec::new(),
                bpf_object: None,
                answer_deadline: Duration::from_secs(2),
                rescan: None,
                observer: None,
                start_barrier: None,
                start_barrier_cap: Duration::from_secs(10),
                state_roots: Vec::new(),
                enrich: None,
                slice: Some(DEFAULT_SCHEDULER_SLICE),
            },
        }
    }
}

impl Builder {
    /// Where the host's root is mounted (default `/`; `/host` in the
    /// DaemonSet's pod). Runtime state, bundles and pid files are host
    /// paths read under it.
    pub fn host_root(mut self, path: impl Into<PathBuf>) -> Self {
        self.config.host_root = path.into();
        self
    }

    /// A runtime binary to mark, as a path this process opens.
    pub fn binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.config.binaries.push(path.into());
        self
    }

    /// Runtime binaries to mark, as paths this process opens.
    pub fn binaries(mut self, paths: impl IntoIterator<Item = PathBuf>) -> Self {
        self.config.binaries.extend(paths);
        self
    }

    /// The BPF object (`lookout-ebpf`) for argv capture. Without one the
    /// hook runs fanotify-only: execs are allowed at once and followed
    /// through /proc, and containers are reported, but not held before
    /// their start.
    pub fn bpf_object(mut self, object: Vec<u8>) -> Self {
        self.config.bpf_object = Some(object);
        self
    }

    /// How long a runtime may wait on the hook for one exec (default 2 s):
    /// the bound on reading a config.json or a state file.
    pub fn answer_deadline(mut self, deadline: Duration) -> Self {
        self.config.answer_deadline = deadline;
        self
    }

    /// Looks for newly installed runtime binaries every `interval`: `find`
    /// returns the binaries to watch (cheap: a few dozen `stat`s).
    pub fn rescan(
        mut self,
        interval: Duration,
        find: impl Fn() -> Vec<PathBuf> + Send + Sync + 'static,
    ) -> Self {
        self.config.rescan = Some(Rescan {
            interval,
            find: Arc::new(find),
        });
        self
    }

    /// Adds what the caller knows of a container (the Kubernetes identity
    /// a Pod informer has, say) before the hook tracks and reports it.
    /// Called off the hook's task (on the thread that read the container's
    /// files, or during a scan), once per container: it must not wait long,
    /// nor start processes (a reader thread may be in the host's cgroup
    /// namespace, see [`lookout_host::proc::enter_host_cgroup_namespace`],
    /// and a child would be there too). The hook's table and the `added`
    /// event then share one record; a sink that filled it in later would
    /// have to copy it.
    pub fn enrich(mut self, f: impl Fn(&mut Container) + Send + Sync + 'static) -> Self {
        self.config.enrich = Some(Arc::new(f));
        self
    }

    /// The scheduler time slice the answering thread and the reader
    /// threads ask for (default 100 us; `None`: the kernel's default).
    ///
    /// Linux 6.12+ only, and no more CPU time: a thread with a short slice
    /// runs sooner after it wakes (see [`lookout_host::sched`]). A runtime's
    /// exec waits on the answering thread, a container's report on the
    /// readers. The thread that drives [`RuntimeHook::run`] is the caller's:
    /// ask for it there too ([`lookout_host::sched::request_slice`]); the
    /// readers started from it inherit it anyway.
    pub fn scheduler_slice(mut self, slice: Option<Duration>) -> Self {
        self.config.slice = slice;
        self
    }

    /// Metrics hooks.
    pub fn observer(mut self, observer: Arc<dyn Observer>) -> Self {
        self.config.observer = Some(observer);
        self
    }

    /// What a container's `start` waits for (prestart hooks, consumer
    /// gates), for at most `cap` (then it proceeds).
    pub fn start_barrier(mut self, barrier: Arc<dyn StartBarrier>, cap: Duration) -> Self {
        self.config.start_barrier = Some(barrier);
        self.config.start_barrier_cap = cap;
        self
    }

    /// Another state root (runc's `--root`, a host path) for the start-up
    /// scan, besides the usual ones: a dockerd with its own `--exec-root`
    /// keeps its containers in `<exec-root>/runtime-runc/moby`. Roots the
    /// runtimes name in their argv are learnt as they run.
    pub fn state_root(mut self, runtime: RuntimeKind, root: impl Into<PathBuf>) -> Self {
        self.config.state_roots.push((runtime, root.into()));
        self
    }

    /// Loads the BPF programs (if given), creates the group and marks the
    /// binaries. Must run inside a tokio runtime.
    pub fn build(self) -> Result<RuntimeHook, Error> {
        RuntimeHook::new(self.config)
    }
}

/// What the hook's task hears from the tasks and threads it started.
enum Notice {
    /// What the lifecycle learned off the task: a `create` process ended
    /// (`CreateExited`), a `run` watcher read the state (`Observed`), a
    /// pid was read (`Resolved`), an init exited (`Exited`, its code
    /// filled from BPF when it is handled), a sandboxed container was
    /// deleted (`Deleted`).
    /// Boxed: a notice waits in a queue, an input can be large.
    Step(Box<Input<Held>>),
    /// fanotify-only mode: an exec followed after it was allowed (see
    /// [`late`]).
    Late(late::Late),
    /// A `create`/`run`'s config.json was read (or not) off the task; its
    /// exec, still held when `perm` is set, goes on once it is noted.
    CreateRead(Box<CreateRead>),
    /// A `create` exited and its container was read, by a reader that
    /// waited for the exit itself (see [`Prefetch`]).
    Prefetched {
        id: String,
        token: u64,
        container: Box<Option<Container>>,
    },
}

/// What reading a pending container gave: the container, why there is
/// none, or why the read did not end (a hung file system).
type ReadOutcome = Result<Result<Container, Unresolved>, &'static str>;

/// A `create` whose container a reader reads as soon as the `create`
/// exits, woken by the exit itself ([`crate::bounded::after_exit`]): one
/// hand-over fewer than waking this task first, which then wakes a reader.
enum Prefetch {
    /// The reader waits or reads. `slot`: what it reads for, until it takes
    /// it after the exit (a `start` that comes first takes it back and reads
    /// at once, as without a prefetch). `wanted`: the lifecycle asked for
    /// the container already, and waits for this read.
    InFlight {
        token: u64,
        slot: Arc<std::sync::Mutex<Option<Pending>>>,
        wanted: bool,
    },
    /// Read; the lifecycle steps `CreateExited` next and asks for it.
    Ready(Box<Option<Container>>),
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
    /// ([`Effect::WatchExit`]).
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
    /// `create`s read by a reader woken by their exit, by id.
    prefetch: HashMap<String, Prefetch>,
    /// Tells a prefetch from an earlier one of the same id.
    next_prefetch: u64,
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
            prefetch: HashMap::new(),
            next_prefetch: 0,
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
    pub fn watch_binary(&mut self, path: &Path) -> Result<(), Error> {
        if self.is_marked(path) {
            return Ok(());
        }
        if let (Some(c), Some(name)) = (
            self.capture.as_mut(),
            path.file_name().and_then(|n| n.to_str()),
        ) {
            c.watch_name(name)?;
        }
        // Known before the mark exists, so that the first `runc init`
        // through the new binary is recognised.
        if let Ok(mut m) = self.marked.paths.write() {
            m.insert(path.to_path_buf());
        }
        let file = nix::sys::stat::stat(path)
            .ok()
            .map(|st| (st.st_dev, st.st_ino));
        if let (Some(file), Ok(mut m)) = (file, self.marked.files.write()) {
            m.insert(file);
        }
        if let Err(e) = self
            .group
            .add_mark(path, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        {
            if let Ok(mut m) = self.marked.paths.write() {
                m.remove(path);
            }
            if let (Some(file), Ok(mut m)) = (file, self.marked.files.write()) {
                m.remove(&file);
            }
            return Err(Error::Fanotify(e));
        }
        tracing::info!(binary = %path.display(), "watching runtime binary");
        Ok(())
    }

    fn is_marked(&self, path: &Path) -> bool {
        self.marked.paths.read().is_ok_and(|m| m.contains(path))
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

    /// Reports the containers that already run, from the runtimes' state
    /// directories (source `state-scan`). A pid whose start time does not
    /// match the state file (pid reuse) is skipped.
    pub fn scan(&mut self, sink: &mut dyn Sink) {
        self.end_all_exited(sink);
        let found = self.scan_untracked();
        self.step(Input::Found(found), sink);
    }

    /// Containers in the state directories (the default roots and those
    /// seen in argv) that are neither tracked, pending nor being reported.
    fn scan_untracked(&self) -> Vec<Container> {
        let lifecycle = &self.lifecycle;
        let mut found =
            crate::scan::scan_state_in(&self.config.host_root, &self.learned_roots, &|id| {
                lifecycle.knows(id)
            });
        if let Some(f) = &self.config.enrich {
            found.iter_mut().for_each(|c| f(c));
        }
        found
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
                        for path in (r.find)() {
                            if !self.is_marked(&path)
                                && let Err(e) = self.watch_binary(&path)
                            {
                                self.counters.error("mark");
                                tracing::warn!(
                                    error = %lookout_model::Chain(&e),
                                    "cannot watch a newly found runtime binary"
                                );
                            }
                        }
                    }
                }
            }
        }
        // Dropping `self` answers everything still queued (see Drop).
        self.counters.stats()
    }

    /// Applies `input` to the lifecycle and carries out its effects.
    fn step(&mut self, input: Input<Held>, sink: &mut dyn Sink) {
        for effect in self.lifecycle.step(input) {
            match effect {
                Effect::Resolve { id, pending, seen } => self.resolve(id, pending, seen, sink),
                Effect::WatchExit { id, pid, watch } => {
                    if let Some(cap) = self.capture.as_mut() {
                        cap.watch_exit(pid);
                    }
                    let fd = pidfd::pidfd_open(pid).ok().map(Arc::new);
                    let exited = pidfd::exit_of_fd(fd.clone());
                    let task = self.notify_after(async move {
                        exited.await;
                        Input::Exited {
                            id,
                            watch,
                            pid,
                            code: None,
                        }
                    });
                    self.exits.insert(watch, ExitWatch { fd, task });
                }
                Effect::Emit(event) => sink.emit(event),
                Effect::Allow(perm) => perm.allow(),
                Effect::WatchCreate { id, pid } => self.watch_create(id, pid),
                Effect::WatchRun {
                    id,
                    pid,
                    runtime,
                    root,
                    started,
                } => {
                    // `run` creates and starts in one process: catch the
                    // state file while the container lives.
                    let (tx, mut rx) = mpsc::channel(1);
                    let root = lookout_host::host_path(&self.config.host_root, &root);
                    crate::run_watch::spawn(runtime.clone(), root, id.clone(), pid, started, tx);
                    let notices = self.notices_tx.clone();
                    let counters = Arc::clone(&self.counters);
                    tokio::spawn(async move {
                        match rx.recv().await {
                            Some(RunSeen::Observed(obs)) => {
                                let _ = notices
                                    .send(Notice::Step(Box::new(Input::Observed(obs))))
                                    .await;
                            }
                            // N.B. not silent: the container is gone, and
                            // what config.json said is not enough to
                            // report it as having run.
                            Some(RunSeen::Vanished) => {
                                counters.missed(&runtime, "run-unobserved");
                                tracing::warn!(
                                    runtime = %runtime,
                                    id,
                                    "`run` made a container that ended before its state could be read; not reported"
                                );
                            }
                            None => tracing::debug!(id, "`run` ended without a container"),
                        }
                    });
                }
                Effect::ReleaseStart { id, pid, perm } => self.release_start(id, pid, perm),
            }
        }
    }

    /// Steps the input `input` resolves to, on this task, once it is ready.
    fn notify_after(
        &self,
        input: impl std::future::Future<Output = Input<Held>> + Send + 'static,
    ) -> tokio::task::AbortHandle {
        let tx = self.notices_tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(Notice::Step(Box::new(input.await))).await;
        })
        .abort_handle()
    }

    /// A runtime exec handed over by the permission thread.
    fn on_exec(&mut self, exec: Exec, sink: &mut dyn Sink) {
        match exec {
            // The answer's latency is recorded when it is given (`Held`).
            Exec::Command { pid, inv, perm } => self.on_invocation(pid, &inv, Some(perm), sink),
            Exec::Unseen(u) => self.follow_late(u),
            Exec::Deleted(inv) => self.on_invocation(0, &inv, None, sink),
        }
    }

    /// Acts on a runtime command line. `perm` is the exec's pending
    /// permission (answered here, after anything that must precede the
    /// exec), or `None` when the exec was already allowed (fanotify-only
    /// mode reads argv afterwards).
    fn on_argv(
        &mut self,
        pid: u32,
        binary: &str,
        argv: &[String],
        perm: Option<Held>,
        sink: &mut dyn Sink,
    ) {
        match argv::parse(argv, binary) {
            Ok(inv) => self.on_invocation(pid, &inv, perm, sink),
            Err(e) => {
                self.counters.error("argv");
                tracing::warn!(error = %e, ?argv, "cannot parse runtime command line; allowing it");
                if let Some(perm) = perm {
                    perm.allow();
                }
            }
        }
    }

    /// Acts on a parsed runtime command line; `perm` as for `on_argv`.
    fn on_invocation(
        &mut self,
        pid: u32,
        inv: &Invocation,
        perm: Option<Held>,
        sink: &mut dyn Sink,
    ) {
        match &inv.command {
            Command::Create(a) | Command::Run(a) => {
                // config.json is read off this task (a hung file system
                // holds only this exec, for at most the deadline); the
                // exec goes on once it is noted (`Notice::CreateRead`).
                let cwd = proc::cwd(pid);
                // What tells a `run`'s container from an earlier one with
                // its id (see `run_watch`): read while the exec is held,
                // before the container can exist.
                let started = match &inv.command {
                    Command::Run(_) => proc::start_time(pid),
                    _ => None,
                };
                let bundle = inv.bundle(cwd.as_deref());
                let read = bundle.clone().map(|b| {
                    crate::oci::read_config_async(
                        self.config.host_root.clone(),
                        b,
                        a.config.clone(),
                        self.config.answer_deadline,
                    )
                });
                let (tx, counters, id) = (
                    self.notices_tx.clone(),
                    Arc::clone(&self.counters),
                    a.id.clone(),
                );
                let inv = inv.clone();
                tokio::spawn(async move {
                    let config = match read {
                        Some(read) => read
                            .await
                            .map_err(|e| {
                                counters.error("config");
                                tracing::warn!(
                                    id,
                                    error = %lookout_model::Chain(&e),
                                    "cannot read the container's config"
                                );
                            })
                            .ok(),
                        None => None,
                    };
                    let notice = Notice::CreateRead(Box::new(CreateRead {
                        pid,
                        started,
                        inv,
                        perm,
                        cwd,
                        bundle,
                        config,
                    }));
                    // A closed channel (shutting down) drops the notice:
                    // dropping its permission allows the exec.
                    let _ = tx.send(notice).await;
                });
            }
            // The container is still `created`: the lifecycle reports it
            // before its process may run.
            Command::Start { id } => self.step(
                Input::Start {
                    id: id.clone(),
                    perm,
                },
                sink,
            ),
            Command::Delete { id } => {
                if let Some(perm) = perm {
                    perm.allow();
                }
                // Only a container in a shared sandbox needs it (see
                // `Input::Deleted`); a full queue costs that report.
                if self.lifecycle.is_sandboxed(id) {
                    let _ = self
                        .notices_tx
                        .try_send(Notice::Step(Box::new(Input::Deleted { id: id.clone() })));
                }
            }
            Command::ReExec | Command::Other(_) => {
                if let Some(perm) = perm {
                    perm.allow();
                }
            }
        }
    }

    /// Lets `start` of container `id` (init `pid`) go on, after its
    /// prestart hooks (the start barrier), waiting on a task so that other
    /// execs go on.
    fn release_start(&self, id: String, pid: Option<u32>, perm: Held) {
        match self.config.start_barrier.as_ref().and_then(|b| b.wait(&id)) {
            Some(barrier) => {
                let cap = self.config.start_barrier_cap;
                let mut wait = Box::pin(tokio::time::timeout(cap, barrier));
                // Decided already (the gates answered between create and
                // start): answer here, without a task and its wake-up.
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                if let std::task::Poll::Ready(decided) =
                    std::future::Future::poll(wait.as_mut(), &mut cx)
                {
                    finish_start(&id, pid, perm, decided.ok(), cap);
                    return;
                }
                tokio::spawn(async move {
                    finish_start(&id, pid, perm, wait.await.ok(), cap);
                });
            }
            None => perm.allow(),
        }
    }

    /// A `create`/`run` whose config.json was read: remember the container,
    /// let the exec go on, and watch for what it makes.
    fn on_create_read(&mut self, r: CreateRead, sink: &mut dyn Sink) {
        let CreateRead {
            pid,
            started,
            inv,
            perm,
            cwd,
            bundle,
            config,
        } = r;
        let (args, status) = match &inv.command {
            Command::Create(a) => (a, Status::Created),
            Command::Run(a) => (a, Status::Running),
            _ => return,
        };
        let id = args.id.clone();
        let root = inv
            .root
            .clone()
            .unwrap_or_else(|| default_root(&inv.runtime));
        self.learn_root(&inv.runtime, &root);
        let pid_file = args
            .pid_file
            .as_ref()
            .map(|p| match (&cwd, p.is_absolute()) {
                (Some(cwd), false) => cwd.join(p),
                _ => p.clone(),
            });
        let pending = Pending {
            runtime: inv.runtime.clone(),
            root: root.clone(),
            bundle,
            pid_file,
            config,
            status,
            since: Instant::now(),
            started,
        };
        // An id used again (`runc run` under a service manager, a script):
        // the container that had it ended, its init exited and it was
        // deleted, but the notice of that exit can still be queued behind
        // this create (the task takes notices and execs in no fixed order,
        // and the exec comes first when this thread was not scheduled).
        // Ended first, or the lifecycle would take the new container for
        // the one it reported, and never watch it.
        self.end_if_exited(&id, sink);
        self.step(
            Input::Created {
                id,
                pending,
                pid,
                perm,
            },
            sink,
        );
    }

    /// Ends tracked container `id` now if its init has exited, though the
    /// notice of that exit may still be queued (see `on_create_read`). The
    /// notice, handled later, then ends nothing: it is for a watch no
    /// longer tracked. Asks the watch's own pidfd, without waiting.
    fn end_if_exited(&mut self, id: &str, sink: &mut dyn Sink) {
        let (Some(watch), Some(pid)) = (
            self.lifecycle.tracked_watch(id),
            self.lifecycle.tracked_pid(id),
        ) else {
            return;
        };
        if !self.watch_saw_exit(watch) {
            return;
        }
        tracing::debug!(
            id,
            pid,
            "init exited before the notice of its exit was handled"
        );
        let exited = Input::Exited {
            id: id.to_owned(),
            watch,
            pid,
            code: None,
        };
        self.notice(Notice::Step(Box::new(exited)), sink);
    }

    /// Ends every tracked container whose init has exited (as
    /// [`RuntimeHook::end_if_exited`]), before a scan of the state
    /// directories: the scan skips the ids it knows, and a container made
    /// anew with an id whose old exit is still queued would be skipped.
    /// One `poll` per tracked container; scans are rare.
    fn end_all_exited(&mut self, sink: &mut dyn Sink) {
        let ended: Vec<String> = self
            .lifecycle
            .tracked_watches()
            .filter(|&(_, watch)| self.watch_saw_exit(watch))
            .map(|(id, _)| id.to_owned())
            .collect();
        for id in ended {
            self.end_if_exited(&id, sink);
        }
    }

    /// Whether the init behind exit watch `watch` has exited.
    fn watch_saw_exit(&self, watch: u64) -> bool {
        match self.exits.get(&watch).map(|w| &w.fd) {
            Some(Some(fd)) => pidfd::has_exited(fd),
            // No pidfd: its notice comes at once, and ends the container.
            Some(None) => true,
            None => false,
        }
    }

    /// Remembers a `--root` for reconciliation scans.
    fn learn_root(&mut self, runtime: &RuntimeKind, root: &Path) {
        if root == default_root(runtime)
            || self.learned_roots.len() >= MAX_LEARNED_ROOTS
            || self.learned_roots.iter().any(|(_, r)| r == root)
        {
            return;
        }
        self.learned_roots
            .push((runtime.clone(), root.to_path_buf()));
    }

    fn notice(&mut self, n: Notice, sink: &mut dyn Sink) {
        match n {
            Notice::Step(mut input) => match input.as_mut() {
                Input::Exited {
                    id,
                    pid,
                    code,
                    watch,
                } => {
                    // An exit's code is in the BPF capture by the time its
                    // exit is handled. Not for a late notice of an earlier
                    // container, while a newer one has its pid (reused):
                    // that code is the newer one's, to come.
                    let pid = *pid;
                    let ours = self.lifecycle.tracked_watch(id) == Some(*watch)
                        || !self.lifecycle.holds_pid(pid);
                    if ours {
                        *code = self.capture.as_ref().and_then(|cap| cap.exit_code(pid));
                    }
                    // Each watch is for one container: whether its exit
                    // ends it now, or ended nothing (an earlier notice
                    // did), the watch is done.
                    let done = self.exits.remove(watch);
                    self.step(*input, sink);
                    // The clean-up waits until the event is out: the
                    // pidfd's close and two map deletions were a third of
                    // the time from the exit's wake-up to `removed`. No
                    // other input runs in between, so no newer container
                    // can have taken the pid's watch meanwhile.
                    drop(done);
                    if ours && let Some(cap) = self.capture.as_mut() {
                        cap.forget_exit(pid);
                    }
                }
                // A container in a shared sandbox ends with its delete; its
                // watch would wait for the sandbox's exit.
                Input::Deleted { id } => {
                    let id = id.clone();
                    let watch = self.lifecycle.tracked_watch(&id);
                    self.step(*input, sink);
                    if let Some(watch) = watch
                        && self.lifecycle.tracked_watch(&id) != Some(watch)
                        && let Some(w) = self.exits.remove(&watch)
                    {
                        w.task.abort();
                    }
                }
                _ => self.step(*input, sink),
            },
            Notice::CreateRead(r) => self.on_create_read(*r, sink),
            Notice::Late(late) => self.on_late(late, sink),
            Notice::Prefetched {
                id,
                token,
                container,
            } => self.on_prefetched(id, token, container, sink),
        }
    }

    /// Watches a `create` process until it exits: a reader waits for the
    /// exit and reads the container right after (see [`Prefetch`]), or,
    /// with no reader free to wait, a task on this runtime, which then
    /// steps `CreateExited`.
    fn watch_create(&mut self, id: String, pid: u32) {
        let fd = pidfd::pidfd_open(pid).ok().map(Arc::new);
        // An earlier create's, of this id: that create's pending entry is
        // gone (this one replaced it; the lifecycle refuses a create of an
        // id it resolves), and what its reader reads is dropped.
        self.prefetch.remove(&id);
        if let Some(place) = crate::bounded::exit_place()
            && let Some(p) = self.lifecycle.take_for_read(&id)
        {
            let token = self.next_prefetch;
            self.next_prefetch += 1;
            let kind = p.runtime.clone();
            let slot = Arc::new(std::sync::Mutex::new(Some(p)));
            let read = self.read_job_from(id.clone(), Arc::clone(&slot));
            if let Some(done) =
                crate::bounded::after_exit(place, fd.clone(), self.config.answer_deadline, read)
            {
                self.prefetch.insert(
                    id.clone(),
                    Prefetch::InFlight {
                        token,
                        slot,
                        wanted: false,
                    },
                );
                let (tx, counters) = (self.notices_tx.clone(), Arc::clone(&self.counters));
                tokio::spawn(async move {
                    let read = match done.await {
                        // Read elsewhere: a `start` came first.
                        Ok(None) => return,
                        Ok(Some(read)) => Ok(read),
                        Err(why) => Err(why),
                    };
                    let container = Box::new(settle(&counters, &kind, &id, read));
                    let _ = tx
                        .send(Notice::Prefetched {
                            id,
                            token,
                            container,
                        })
                        .await;
                });
                return;
            }
            // No reader could start (no thread now): the config goes back
            // to the pending container, for the read after the exit.
            if let Some(p) = lock_slot(&slot).take() {
                self.lifecycle.restore_config(&id, p.config);
            }
        }
        let exited = pidfd::exit_of_fd(fd);
        self.notify_after(async move {
            exited.await;
            Input::CreateExited { id }
        });
    }

    /// A prefetch ended: the lifecycle asked for its container already, or
    /// learns now that the `create` exited, and asks (see
    /// [`RuntimeHook::resolve`]).
    fn on_prefetched(
        &mut self,
        id: String,
        token: u64,
        container: Box<Option<Container>>,
        sink: &mut dyn Sink,
    ) {
        match self.prefetch.remove(&id) {
            Some(Prefetch::InFlight {
                token: t, wanted, ..
            }) if t == token => {
                if wanted {
                    self.step(
                        Input::Resolved {
                            id,
                            container: *container,
                        },
                        sink,
                    );
                } else {
                    self.prefetch.insert(id.clone(), Prefetch::Ready(container));
                    self.step(Input::CreateExited { id: id.clone() }, sink);
                    // Not asked for (reported first by a reconciliation, or
                    // swept): dropped.
                    self.prefetch.remove(&id);
                }
            }
            // A newer create of this id replaced this one, with a watch of
            // its own: this read is not its, and its create's end is no
            // news to the lifecycle.
            other => {
                if let Some(other) = other {
                    self.prefetch.insert(id, other);
                }
            }
        }
    }

    /// The lifecycle asks for pending container `id`: from its prefetch
    /// when it has one (read, or being read), else read now.
    fn resolve(&mut self, id: String, p: Pending, seen: Option<Observed>, sink: &mut dyn Sink) {
        if seen.is_none() {
            match self.prefetch.remove(&id) {
                Some(Prefetch::Ready(container)) => {
                    self.step(
                        Input::Resolved {
                            id,
                            container: *container,
                        },
                        sink,
                    );
                    return;
                }
                Some(Prefetch::InFlight { token, slot, .. }) => {
                    let waiting = lock_slot(&slot).take();
                    match waiting {
                        // Its reader still waits for the `create` to exit (a
                        // `start` came first): read now, as without a
                        // prefetch, within the deadline from now; the reader
                        // finds nothing left to read.
                        Some(full) => self.spawn_resolve(id, full, None),
                        // Being read: its deadline runs from the exit.
                        None => {
                            self.prefetch.insert(
                                id,
                                Prefetch::InFlight {
                                    token,
                                    slot,
                                    wanted: true,
                                },
                            );
                        }
                    }
                    return;
                }
                None => {}
            }
        }
        self.spawn_resolve(id, p, seen);
    }

    /// Reads the pid of pending container `id` and fills the container, on
    /// a helper thread for at most the answer deadline (a pid file on a
    /// hung file system costs this container that much, and nobody else
    /// anything: the task goes on meanwhile), then steps
    /// `Input::Resolved`. `seen`: a `run` watcher saw it alive.
    fn spawn_resolve(&self, id: String, p: Pending, seen: Option<Observed>) {
        let deadline = self.config.answer_deadline;
        let (counters, tx) = (Arc::clone(&self.counters), self.notices_tx.clone());
        let kind = p.runtime.clone();
        let read = self.read_job(id.clone(), p, seen);
        tokio::spawn(async move {
            let outcome = crate::bounded::bounded_async(deadline, read).await;
            let container = settle(&counters, &kind, &id, outcome);
            let _ = tx
                .send(Notice::Step(Box::new(Input::Resolved { id, container })))
                .await;
        });
    }

    /// [`RuntimeHook::read_job`] for a prefetch: it reads for what is in
    /// `slot` when it runs, and for nothing (`None`) if a `start` took it
    /// back meanwhile.
    fn read_job_from(
        &self,
        id: String,
        slot: Arc<std::sync::Mutex<Option<Pending>>>,
    ) -> impl FnOnce() -> Option<Result<Container, Unresolved>> + Send + 'static {
        let read = self.reader();
        move || {
            let p = lock_slot(&slot).take()?;
            Some(read(&id, p, None))
        }
    }

    /// What a reader runs to read pending container `id` (see [`resolve`]),
    /// enriched.
    fn read_job(
        &self,
        id: String,
        p: Pending,
        seen: Option<Observed>,
    ) -> impl FnOnce() -> Result<Container, Unresolved> + Send + 'static {
        let read = self.reader();
        move || read(&id, p, seen)
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

/// A prefetch's slot, locked (a read that panicked holding it left what it
/// took; the rest is still sound).
fn lock_slot(
    slot: &std::sync::Mutex<Option<Pending>>,
) -> std::sync::MutexGuard<'_, Option<Pending>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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
    /// (a [`Observer::missed`] label).
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

/// Kills the init process of a container whose start was denied: it waits
/// in the runtime's init for a `start` that will not come, and a later
/// `start` must not run it either. The exit is then seen like any other.
fn kill_init(id: &str, pid: u32) {
    if let Err(e) = pidfd::kill(pid) {
        tracing::warn!(id, pid, error = %e, "could not kill the init of a denied container");
    }
}

/// Answers a held `start` with what its barrier decided (`None`: it did
/// not decide within `cap`).
fn finish_start(
    id: &str,
    pid: Option<u32>,
    perm: Held,
    decided: Option<StartDecision>,
    cap: Duration,
) {
    match decided {
        Some(StartDecision::Proceed) => perm.allow(),
        Some(StartDecision::Deny(reason)) => {
            perm.deny();
            tracing::info!(id, reason, "start denied");
            if let Some(pid) = pid {
                kill_init(id, pid);
            }
        }
        None => {
            tracing::warn!(
                id,
                ?cap,
                "start did not wait longer for the container's barrier"
            );
            perm.allow();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
