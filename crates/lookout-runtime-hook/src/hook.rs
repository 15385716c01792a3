//! The runtime hook: one fanotify group with `FAN_OPEN_EXEC_PERM` marks on
//! the runtime binaries, BPF argv capture, and the container state machine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lookout_fanotify::{Class, Fanotify, MarkFlags, Mask, Report};
pub use lookout_model::Sink;
use lookout_model::{Container, ContainerEvent, RuntimeKind, Source, Status};
use tokio::sync::mpsc;

use crate::argv::{self, Command, Invocation};
use crate::capture::ExecCapture;
use crate::gate::{Exec, Gate, Held, Shared, Unseen};
use crate::oci::OciConfig;
use crate::state::{default_root, leaves_trace, read_pid_file_under, read_state_under};
use crate::{Error, pidfd, proc};

/// Finds the runtime binaries again (for binaries installed after start).
#[derive(Clone)]
pub struct Rescan {
    /// How often.
    pub interval: Duration,
    /// Returns the binaries to watch (paths this process opens).
    pub find: std::sync::Arc<dyn Fn() -> Vec<PathBuf> + Send + Sync>,
}

impl std::fmt::Debug for Rescan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rescan")
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// Sees what the hook does, for metrics. Called on the thread that answers
/// permission events: keep it cheap (atomics).
pub trait Observer: Send + Sync {
    /// A permission event was answered after `elapsed`.
    fn answered(&self, elapsed: Duration);
    /// Something went wrong and was skipped; `kind` is a short stable label
    /// (`argv`, `argv-unread`, `config`, `overflow`, `read`, `mark`).
    fn error(&self, kind: &'static str);
    /// A container was found only by reconciling the state directories
    /// after runtime execs whose argv could not be read (fanotify-only
    /// mode); it was reported late.
    fn recovered(&self) {}
    /// A runtime exec was allowed and not followed, for `reason`
    /// (`non-root`: its caller is not host root).
    fn ignored(&self, reason: &'static str) {
        let _ = reason;
    }
    /// A runtime exec that should have made a container did not yield one
    /// lookout can report, for `reason` (`unreadable-state`: the runtime
    /// left state that cannot be read or parsed, in a layout this version
    /// may not know; `state-timeout`; `not-a-container-process`). Logged at
    /// warn level too.
    fn missed(&self, runtime: &str, reason: &'static str) {
        let _ = (runtime, reason);
    }
    /// A runtime exec came without a BPF argv record (fanotify-only mode,
    /// a caller other than host root, or a runtime re-exec the hook did
    /// not recognise): it was allowed at once and followed through /proc.
    fn without_argv(&self) {}
}

/// What a [`StartBarrier`] decided about a container's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartDecision {
    /// The runtime's `start` goes on.
    Proceed,
    /// The runtime's `start` exec is refused (`EPERM`), and the
    /// container's init process, still waiting for `start` in the
    /// runtime's init, is killed: the container never runs its first
    /// instruction, and is reported removed.
    Deny(String),
}

/// A future a [`StartBarrier`] returns.
pub type StartWait = std::pin::Pin<Box<dyn std::future::Future<Output = StartDecision> + Send>>;

/// Something the runtime's `start` of a container waits for, such as the
/// container's prestart hooks or a consumer's gate. Called on the hook's
/// task right after the container was reported (the `added` event went to
/// the sink).
pub trait StartBarrier: Send + Sync {
    /// A future that completes when `start` of container `id` may go on
    /// (or must not), or `None` to go on at once. The hook waits at most
    /// [`Config::start_barrier_cap`] (then proceeds), without holding up
    /// other execs. The hook polls the future once on its own task (a
    /// barrier that has already decided costs no task), so neither `wait`
    /// nor a poll may block.
    fn wait(&self, id: &str) -> Option<StartWait>;
}

/// How to start the hook.
#[derive(Clone)]
pub struct Config {
    /// Where the host's root is mounted (`/` on the host).
    pub host_root: PathBuf,
    /// Runtime binaries to mark, as paths this process opens.
    pub binaries: Vec<PathBuf>,
    /// The BPF object for argv capture; `None` runs fanotify-only.
    pub bpf_object: Option<Vec<u8>>,
    /// How long a runtime may wait on us for one exec.
    pub answer_deadline: Duration,
    /// Look for newly installed runtime binaries (cheap: a few dozen
    /// `stat`s per rescan).
    pub rescan: Option<Rescan>,
    /// Metrics hooks.
    pub observer: Option<std::sync::Arc<dyn Observer>>,
    /// What `start` waits for (prestart hooks), if anything.
    pub start_barrier: Option<std::sync::Arc<dyn StartBarrier>>,
    /// The longest `start` waits for the barrier.
    pub start_barrier_cap: Duration,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("host_root", &self.host_root)
            .field("binaries", &self.binaries)
            .field("bpf_object", &self.bpf_object.as_ref().map(Vec::len))
            .field("answer_deadline", &self.answer_deadline)
            .field("rescan", &self.rescan)
            .field("observer", &self.observer.is_some())
            .field("start_barrier", &self.start_barrier.is_some())
            .field("start_barrier_cap", &self.start_barrier_cap)
            .finish()
    }
}

impl Config {
    /// Defaults: host root `/`, no binaries, no BPF, a 2 s deadline.
    pub fn new() -> Config {
        Config {
            host_root: PathBuf::from("/"),
            binaries: Vec::new(),
            bpf_object: None,
            answer_deadline: Duration::from_secs(2),
            rescan: None,
            observer: None,
            start_barrier: None,
            start_barrier_cap: Duration::from_secs(10),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self::new()
    }
}

/// A container seen at `create`/`run`, not yet reported.
#[derive(Debug)]
struct Pending {
    runtime: RuntimeKind,
    root: PathBuf,
    bundle: Option<PathBuf>,
    pid_file: Option<PathBuf>,
    config: Option<OciConfig>,
    status: Status,
    since: Instant,
}

enum Notice {
    /// The `create` process of `id` exited.
    Created(String),
    /// A `run` watcher read the state of a container.
    Observed(crate::run_watch::Observed),
    /// fanotify-only mode: the argv of an exec, read from /proc after it
    /// was allowed.
    LateArgv {
        pid: u32,
        binary: String,
        argv: Vec<String>,
    },
    /// fanotify-only mode: the argv of a runtime exec could not be read;
    /// `why` says why. The state directories are scanned for what it may
    /// have created, now and once it has ended (`after`).
    Unread {
        pid: u32,
        binary: String,
        why: String,
        after: Afterwards,
    },
    /// Scan the state directories again (see [`Afterwards`]).
    Reconcile,
    /// fanotify-only mode: a runtime exec by a caller other than host
    /// root: not a container (see the gate).
    Foreign { pid: u32 },
    /// The init process of a tracked container exited.
    Exited(String, u32),
    /// The runtime was asked to delete container `id`.
    Deleted(String),
    /// A `create`/`run`'s config.json was read (or not) off the task; its
    /// exec, still held when `perm` is set, goes on once it is noted.
    CreateRead(Box<CreateRead>),
    /// A pending container's pid was read (or not) off the task; the
    /// `start` execs waiting for its report go on after it.
    PidRead {
        id: String,
        pending: Pending,
        pid: Option<u32>,
    },
}

/// A `create` or `run` whose config.json was being read.
struct CreateRead {
    pid: u32,
    inv: Invocation,
    perm: Option<Held>,
    cwd: Option<PathBuf>,
    bundle: Option<PathBuf>,
    config: Option<OciConfig>,
}

/// What is known of a runtime exec whose argv could not be read: when has
/// it created whatever it was going to create?
#[derive(Debug)]
enum Afterwards {
    /// It has ended: a scan now sees what it made.
    Ended,
    /// It still runs: scan again when this pidfd says it ended.
    Running(std::os::fd::OwnedFd),
    /// Unknown (no pidfd: the exec came from a thread other than the main
    /// one, whose id vanished with the exec): scan again after
    /// [`RECONCILE_AGAIN`].
    Unknown,
}

/// Counters, for metrics and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Permission events answered.
    pub answered: u64,
    /// Runtime execs without a BPF argv record (in fanotify-only mode,
    /// every runtime exec).
    pub missing_argv: u64,
    /// fanotify-only mode: runtime execs whose argv could not be read from
    /// /proc either (the process ended first, or an exec flood). Each one
    /// triggers a reconciliation from the state directories.
    pub unread_argv: u64,
    /// Containers that only reconciliation found (reported late, source
    /// `state-scan`): without it they would have been missed.
    pub recovered: u64,
    /// Runtime execs allowed and not followed because their caller is not
    /// host root (they cannot make a rootful container).
    pub ignored: u64,
    /// Errors (bad argv, config, state) that were logged and skipped.
    pub errors: u64,
    /// The slowest answer, in microseconds.
    pub slowest_answer_us: u64,
}

/// The runtime hook. Create with [`RuntimeHook::new`], report what already
/// runs with [`RuntimeHook::scan`], then drive it with [`RuntimeHook::run`].
pub struct RuntimeHook {
    config: Config,
    group: Fanotify,
    capture: Option<ExecCapture>,
    pending: HashMap<String, Pending>,
    tracked: HashMap<String, Container>,
    notices_tx: mpsc::Sender<Notice>,
    notices_rx: mpsc::Receiver<Notice>,
    shared: Arc<Shared>,
    execs: mpsc::Receiver<Exec>,
    gate: Gate,
    /// Runtime roots seen in argv (`--root`), scanned by reconciliation
    /// besides the default ones. Bounded by [`MAX_LEARNED_ROOTS`].
    learned_roots: Vec<(RuntimeKind, PathBuf)>,
    /// Runtime execs whose argv could not be read since the last
    /// reconciliation (fanotify-only mode), for its log line.
    unread: Vec<String>,
    /// fanotify-only mode: argv readers running now (bounded).
    late_readers: Arc<std::sync::atomic::AtomicUsize>,
    /// When the oldest entry of `unread` came.
    unread_since: Instant,
    /// When the last reconciliation ran.
    last_reconcile: Instant,
    /// Pending containers whose pid is being read off the task, with the
    /// `start` execs that wait for their report.
    finalizing: HashMap<String, Vec<Held>>,
}

impl Drop for RuntimeHook {
    fn drop(&mut self) {
        // Closing the channel first lets a gate blocked on a full channel
        // go on (its message, and the exec in it, is allowed on drop).
        self.execs.close();
        while self.execs.try_recv().is_ok() {}
        self.gate.stop();
    }
}

impl std::fmt::Debug for RuntimeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeHook")
            .field("marked", &self.shared.marked)
            .field("tracked", &self.tracked.len())
            .field("pending", &self.pending.len())
            .finish()
    }
}

const MAX_PENDING: usize = 4096;
const PENDING_TTL: Duration = Duration::from_secs(60);
/// fanotify-only mode: how long an allowed runtime exec may take to show
/// its own command line in /proc before it counts as unread.
const LATE_ARGV_DEADLINE: Duration = Duration::from_secs(5);
/// fanotify-only mode: at most this many execs are followed at once; more
/// (an exec flood) count as unread and are covered by reconciliation.
const MAX_LATE_READERS: usize = 256;
const MAX_LEARNED_ROOTS: usize = 64;
/// When an unread runtime exec cannot be followed to its end, the state
/// directories are scanned again after these delays (a `create` takes tens
/// of milliseconds, more on a loaded node).
const RECONCILE_AGAIN: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(5)];
/// The longest a reconciliation waits for busy argv readers.
const RECONCILE_SETTLE: Duration = Duration::from_secs(1);
/// The shortest time between two reconciliations.
const RECONCILE_MIN_GAP: Duration = Duration::from_millis(100);

impl RuntimeHook {
    /// Loads the BPF programs (if given), creates the group and marks the
    /// binaries. Must run inside a tokio runtime.
    pub fn new(config: Config) -> Result<RuntimeHook, Error> {
        let names: Vec<String> = config
            .binaries
            .iter()
            .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(str::to_owned))
            .collect();
        // BPF first: once a binary is marked, an exec without a record is
        // one we can only allow blindly.
        let mut capture = match &config.bpf_object {
            Some(obj) => Some(ExecCapture::load(obj, &names)?),
            None => None,
        };
        let group = Fanotify::builder()
            .class(Class::Content)
            .report(Report::TID)
            .init()
            .map_err(Error::Fanotify)?;
        let shared = Arc::new(Shared::new(config.observer.clone(), config.answer_deadline));
        let (exec_tx, execs) = mpsc::channel(1024);
        let ring = capture.as_mut().and_then(ExecCapture::take_ring);
        let gate = Gate::spawn(group.share(), ring, Arc::clone(&shared), exec_tx)
            .map_err(|e| Error::Bpf(format!("starting the permission thread: {e}")))?;
        let (notices_tx, notices_rx) = mpsc::channel(1024);
        let mut hook = RuntimeHook {
            config,
            group,
            capture,
            pending: HashMap::new(),
            tracked: HashMap::new(),
            notices_tx,
            notices_rx,
            shared,
            execs,
            gate,
            learned_roots: Vec::new(),
            unread: Vec::new(),
            late_readers: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            unread_since: Instant::now(),
            last_reconcile: Instant::now(),
            finalizing: HashMap::new(),
        };
        let binaries = hook.config.binaries.clone();
        for b in &binaries {
            hook.watch_binary(b)?;
        }
        Ok(hook)
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
        if let Ok(mut m) = self.shared.marked.write() {
            m.insert(path.to_path_buf());
        }
        let file = nix::sys::stat::stat(path)
            .ok()
            .map(|st| (st.st_dev, st.st_ino));
        if let (Some(file), Ok(mut m)) = (file, self.shared.marked_files.write()) {
            m.insert(file);
        }
        if let Err(e) = self
            .group
            .add_mark(path, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        {
            if let Ok(mut m) = self.shared.marked.write() {
                m.remove(path);
            }
            if let (Some(file), Ok(mut m)) = (file, self.shared.marked_files.write()) {
                m.remove(&file);
            }
            return Err(Error::Fanotify(e));
        }
        tracing::info!(binary = %path.display(), "watching runtime binary");
        Ok(())
    }

    fn is_marked(&self, path: &Path) -> bool {
        self.shared.marked.read().is_ok_and(|m| m.contains(path))
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
        self.shared.health()
    }

    /// Whether argv is captured by BPF.
    pub fn has_bpf(&self) -> bool {
        self.capture.is_some()
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    /// Containers currently tracked.
    pub fn tracked(&self) -> impl Iterator<Item = &Container> {
        self.tracked.values()
    }

    fn host(&self, p: &Path) -> PathBuf {
        self.config.host_root.join(p.strip_prefix("/").unwrap_or(p))
    }

    /// Reports the containers that already run, from the runtimes' state
    /// directories (source `state-scan`). A pid whose start time does not
    /// match the state file (pid reuse) is skipped.
    pub fn scan(&mut self, sink: &mut dyn Sink) {
        for c in self.scan_untracked() {
            let Some(pid) = c.pid else { continue };
            self.track(c.clone(), pid);
            sink.emit(ContainerEvent::added(Source::StateScan, c));
        }
    }

    /// Containers in the state directories (the default roots and those
    /// seen in argv) that are neither tracked, pending nor being reported.
    fn scan_untracked(&self) -> Vec<Container> {
        let (tracked, pending, finalizing) = (&self.tracked, &self.pending, &self.finalizing);
        let known = |id: &str| {
            tracked.contains_key(id) || pending.contains_key(id) || finalizing.contains_key(id)
        };
        crate::scan::scan_state_in(&self.config.host_root, &self.learned_roots, &known)
    }

    /// When to reconcile after unread execs: once no argv reader is busy
    /// (each one ends with a notice, which wakes the loop), or at the
    /// latest [`RECONCILE_SETTLE`] after the first unread exec. A scan
    /// while readers are busy would race them: it would report (late, as
    /// `running`) containers whose `create` the hook is about to report
    /// as it should.
    fn reconcile_due(&self) -> impl std::future::Future<Output = ()> + use<> {
        let busy = self.late_readers.load(std::sync::atomic::Ordering::Relaxed) > 0;
        let at = if busy {
            self.unread_since + RECONCILE_SETTLE
        } else {
            Instant::now()
        };
        // An exec flood (anyone may exec a runtime, and such execs end
        // before they are read) must not turn into back-to-back scans on
        // this task.
        let at = at.max(self.last_reconcile + RECONCILE_MIN_GAP);
        tokio::time::sleep_until(at.into())
    }

    /// fanotify-only mode: after runtime execs whose argv could not be
    /// read, reports what the state directories hold that nobody reported.
    fn reconcile(&mut self, sink: &mut dyn Sink) {
        self.last_reconcile = Instant::now();
        let unread = std::mem::take(&mut self.unread);
        for c in self.scan_untracked() {
            let Some(pid) = c.pid else { continue };
            self.shared.count_recovered();
            tracing::warn!(
                id = c.id,
                pid,
                execs = ?unread,
                "container found by reconciliation: the argv of these runtime execs could \
                 not be read (fanotify mode without BPF); reported late, from the state directory"
            );
            self.track(c.clone(), pid);
            sink.emit(ContainerEvent::added(Source::StateScan, c));
        }
    }

    /// Handles events until `shutdown` completes. Every permission event is
    /// answered; on return the group is closed, which removes the marks.
    pub async fn run(
        mut self,
        sink: &mut dyn Sink,
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
                .shared
                .unseen_dropped
                .swap(0, std::sync::atomic::Ordering::Relaxed);
            if dropped > 0 {
                self.shared.count_unread_argv();
                if self.unread.is_empty() {
                    self.unread_since = Instant::now();
                }
                self.unread.push(format!(
                    "{dropped} runtime execs not followed: the queue was full"
                ));
            }
            let due = self.reconcile_due();
            tokio::select! {
                () = &mut shutdown => break,
                Some(x) = self.execs.recv() => self.on_exec(x),
                Some(n) = self.notices_rx.recv() => self.notice(n, sink),
                // Several unread execs cost one scan; see `reconcile_due`.
                () = due, if !self.unread.is_empty() => self.reconcile(sink),
                _ = sweep.tick() => self.sweep(),
                _ = rescan_tick.tick(), if rescan.is_some() => {
                    if let Some(r) = &rescan {
                        for path in (r.find)() {
                            if !self.is_marked(&path)
                                && let Err(e) = self.watch_binary(&path)
                            {
                                self.shared.error("mark");
                                tracing::warn!(%e, "cannot watch a newly found runtime binary");
                            }
                        }
                    }
                }
            }
        }
        // Dropping `self` answers everything still queued (see Drop).
        self.shared.stats()
    }

    /// A runtime exec handed over by the permission thread.
    fn on_exec(&mut self, exec: Exec) {
        match exec {
            // The answer's latency is recorded when it is given (`Held`).
            Exec::Command { pid, inv, perm } => self.on_invocation(pid, &inv, Some(perm)),
            Exec::Unseen(u) => self.spawn_late_argv(u),
            Exec::Deleted(inv) => self.on_invocation(0, &inv, None),
        }
    }

    /// Acts on a runtime command line. `perm` is the exec's pending
    /// permission (answered here, after anything that must precede the
    /// exec), or `None` when the exec was already allowed (fanotify-only
    /// mode reads argv afterwards).
    fn on_argv(&mut self, pid: u32, binary: &str, argv: &[String], perm: Option<Held>) {
        match argv::parse(argv, binary) {
            Ok(inv) => self.on_invocation(pid, &inv, perm),
            Err(e) => {
                self.shared.error("argv");
                tracing::warn!(%e, ?argv, "cannot parse runtime command line; allowing it");
                if let Some(perm) = perm {
                    perm.allow();
                }
            }
        }
    }

    /// Acts on a parsed runtime command line; `perm` as for `on_argv`.
    fn on_invocation(&mut self, pid: u32, inv: &Invocation, perm: Option<Held>) {
        match &inv.command {
            Command::Create(a) | Command::Run(a) => {
                // config.json is read off this task (a hung file system
                // holds only this exec, for at most the deadline); the
                // exec goes on once it is noted (`Notice::CreateRead`).
                let cwd = proc::cwd(pid);
                let bundle = inv.bundle(cwd.as_deref());
                let read = bundle.clone().map(|b| {
                    crate::oci::read_config_async(
                        self.config.host_root.clone(),
                        b,
                        a.config.clone(),
                        self.config.answer_deadline,
                    )
                });
                let (tx, shared, id) = (
                    self.notices_tx.clone(),
                    Arc::clone(&self.shared),
                    a.id.clone(),
                );
                let inv = inv.clone();
                tokio::spawn(async move {
                    let config = match read {
                        Some(read) => read
                            .await
                            .map_err(|e| {
                                shared.error("config");
                                tracing::warn!(id, %e, "cannot read the container's config");
                            })
                            .ok(),
                        None => None,
                    };
                    let notice = Notice::CreateRead(Box::new(CreateRead {
                        pid,
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
            Command::Start { id } => {
                // The container is still `created`: report it before its
                // process may run.
                let id = id.clone();
                if let Some(waiting) = self.finalizing.get_mut(&id) {
                    // Its pid is being read: go on after the report.
                    waiting.extend(perm);
                    return;
                }
                if self.pending.contains_key(&id) {
                    self.begin_finalize(&id, perm);
                    return;
                }
                self.release_start(id, perm);
            }
            Command::Delete { id } => {
                if let Some(perm) = perm {
                    perm.allow();
                }
                // Only a container in a shared sandbox needs it (see
                // Notice::Deleted); a full queue costs that report.
                if self.tracked.get(id).is_some_and(|c| c.sandbox.is_some()) {
                    let _ = self.notices_tx.try_send(Notice::Deleted(id.clone()));
                }
            }
            Command::ReExec | Command::Other(_) => {
                if let Some(perm) = perm {
                    perm.allow();
                }
            }
        }
    }

    /// Lets `start` of container `id` go on, after its prestart hooks (the
    /// start barrier), waiting on a task so that other execs go on.
    fn release_start(&self, id: String, perm: Option<Held>) {
        let Some(perm) = perm else { return };
        match self.config.start_barrier.as_ref().and_then(|b| b.wait(&id)) {
            Some(barrier) => {
                let cap = self.config.start_barrier_cap;
                let pid = self.tracked.get(&id).and_then(|c| c.pid);
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
    fn on_create_read(&mut self, r: CreateRead) {
        let CreateRead {
            pid,
            inv,
            perm,
            cwd,
            bundle,
            config,
        } = r;
        let id = match &inv.command {
            Command::Create(a) | Command::Run(a) => a.id.clone(),
            _ => return,
        };
        self.on_create(&inv, cwd, bundle, config);
        if let Some(perm) = perm {
            perm.allow();
        }
        if matches!(inv.command, Command::Create(_)) {
            self.spawn_exit_wait(pid, Notice::Created(id));
        } else {
            self.spawn_state_wait(&inv, id, pid);
        }
    }

    fn on_create(
        &mut self,
        inv: &Invocation,
        cwd: Option<PathBuf>,
        bundle: Option<PathBuf>,
        config: Option<OciConfig>,
    ) {
        let (args, status) = match &inv.command {
            Command::Create(a) => (a, Status::Created),
            Command::Run(a) => (a, Status::Running),
            _ => return,
        };
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
        if self.tracked.contains_key(&args.id) {
            // Reported already (reconciliation was first), or a create
            // that fails: runc refuses an id that exists.
            return;
        }
        if self.pending.len() >= MAX_PENDING {
            self.sweep();
        }
        self.pending.insert(
            args.id.clone(),
            Pending {
                runtime: inv.runtime.clone(),
                root,
                bundle,
                pid_file,
                config,
                status,
                since: Instant::now(),
            },
        );
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

    fn spawn_exit_wait(&self, pid: u32, notice: Notice) {
        let tx = self.notices_tx.clone();
        match pidfd::pidfd_open(pid) {
            Ok(fd) => {
                tokio::spawn(async move {
                    let _ = pidfd::wait_exit(fd).await;
                    let _ = tx.send(notice).await;
                });
            }
            // Already gone: it finished before we looked.
            Err(_) => {
                let _ = tx.try_send(notice);
            }
        }
    }

    fn spawn_state_wait(&self, inv: &Invocation, id: String, tgid: u32) {
        // `run` creates and starts in one process: catch the state file.
        let root = self.host(
            &inv.root
                .clone()
                .unwrap_or_else(|| default_root(&inv.runtime)),
        );
        let (tx, mut rx) = mpsc::channel(1);
        crate::run_watch::spawn(inv.runtime.clone(), root, id, tgid, tx);
        let notices = self.notices_tx.clone();
        tokio::spawn(async move {
            if let Some(obs) = rx.recv().await {
                let _ = notices.send(Notice::Observed(obs)).await;
            }
        });
    }

    /// fanotify-only mode: once the exec is allowed and through, the
    /// runtime's own argv is in /proc/<pid>/cmdline. Follows the process
    /// until then. If it ends first (a `start` or `delete` takes a few ms;
    /// a `create` on a loaded node can too), or the argv does not appear
    /// within [`LATE_ARGV_DEADLINE`], it is reported as unread and the
    /// state directories are reconciled: a container it created is still
    /// reported, late, with source `state-scan`.
    fn spawn_late_argv(&self, u: Unseen) {
        let tx = self.notices_tx.clone();
        let readers = Arc::clone(&self.late_readers);
        if readers.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= MAX_LATE_READERS {
            readers.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            let after = match u.pidfd {
                Some(fd) => Afterwards::Running(fd),
                None => Afterwards::Unknown,
            };
            let _ = tx.try_send(Notice::Unread {
                pid: u.tid,
                binary: u.binary,
                why: format!("more than {MAX_LATE_READERS} runtime execs followed at once"),
                after,
            });
            return;
        }
        tokio::spawn(async move {
            let notice = follow_exec(u).await;
            readers.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            let _ = tx.send(notice).await;
        });
    }

    fn notice(&mut self, n: Notice, sink: &mut dyn Sink) {
        match n {
            Notice::Created(id) => {
                if self.pending.contains_key(&id) && !self.finalizing.contains_key(&id) {
                    self.begin_finalize(&id, None);
                }
            }
            Notice::CreateRead(r) => self.on_create_read(*r),
            Notice::PidRead { id, pending, pid } => {
                let waiting = self.finalizing.remove(&id).unwrap_or_default();
                self.complete(&id, pending, pid, None, sink);
                for perm in waiting {
                    self.release_start(id.clone(), Some(perm));
                }
            }
            Notice::LateArgv { pid, binary, argv } => {
                if self.capture.is_some() {
                    self.shared.error("argv-late");
                }
                self.on_argv(pid, &binary, &argv, None)
            }
            Notice::Foreign { pid } => {
                self.shared.ignored("non-root");
                tracing::debug!(pid, "runtime exec by a non-root caller: not a container");
            }
            Notice::Reconcile => {
                if self.unread.is_empty() {
                    self.unread_since = Instant::now();
                    self.unread.push("(a later look)".into());
                }
            }
            Notice::Unread {
                pid,
                binary,
                why,
                after,
            } => {
                self.shared.count_unread_argv();
                if self.unread.is_empty() {
                    self.unread_since = Instant::now();
                }
                tracing::debug!(
                    pid,
                    binary,
                    why,
                    "runtime exec whose argv could not be read; reconciling from the state directories"
                );
                if self.unread.len() < 16 {
                    self.unread.push(format!("{binary}[{pid}]: {why}"));
                } else if self.unread.len() == 16 {
                    self.unread.push("...".into());
                }
                // A scan follows at once (the `unread` branch of the loop);
                // one more once the exec has made what it makes.
                let tx = self.notices_tx.clone();
                match after {
                    Afterwards::Ended => {}
                    Afterwards::Running(fd) => {
                        tokio::spawn(async move {
                            let _ = pidfd::wait_exit(fd).await;
                            let _ = tx.send(Notice::Reconcile).await;
                        });
                    }
                    Afterwards::Unknown => {
                        tokio::spawn(async move {
                            for delay in RECONCILE_AGAIN {
                                tokio::time::sleep(delay).await;
                                let _ = tx.send(Notice::Reconcile).await;
                            }
                        });
                    }
                }
            }
            Notice::Observed(obs) => {
                if let Some(p) = self.pending.remove(&obs.id) {
                    let (id, pid) = (obs.id.clone(), obs.pid);
                    self.complete(&id, p, Some(pid), Some(obs), sink);
                }
            }
            Notice::Deleted(id) => {
                // A container in a sandbox it shares with others (a CRI
                // pod on runsc) has no process of its own on the host: the
                // sandbox outlives it, so its exit cannot be seen. Its
                // deletion is the last word on it.
                let shared = self.tracked.get(&id).is_some_and(|c| {
                    c.sandbox.is_some()
                        && c.pid.is_some()
                        && self.tracked.values().any(|o| o.id != id && o.pid == c.pid)
                });
                if shared && let Some(c) = self.tracked.remove(&id) {
                    sink.emit(ContainerEvent::removed(Source::RuntimeHook, c, None));
                }
            }
            Notice::Exited(id, pid) => {
                if self.tracked.get(&id).and_then(|c| c.pid) == Some(pid)
                    && let Some(c) = self.tracked.remove(&id)
                {
                    let code = self
                        .capture
                        .as_mut()
                        .and_then(|cap| cap.take_exit_code(pid));
                    sink.emit(ContainerEvent::removed(Source::RuntimeHook, c, code));
                }
            }
        }
    }

    /// Reports pending container `id`: its pid from `seen` (a `run`
    /// watcher that read the state while the container lived) or from the
    /// runtime's state / pid file now.
    /// Reads pending container `id`'s pid off the task, then reports it
    /// (`Notice::PidRead`); `start` (when `perm` is set) and any later
    /// `start` of the same id wait for the report.
    fn begin_finalize(&mut self, id: &str, perm: Option<Held>) {
        let Some(p) = self.pending.remove(id) else {
            if let Some(perm) = perm {
                perm.allow();
            }
            return;
        };
        self.finalizing
            .insert(id.to_owned(), perm.into_iter().collect());
        let read = self.read_pid(id, &p);
        let (tx, id) = (self.notices_tx.clone(), id.to_owned());
        tokio::spawn(async move {
            let pid = read.await;
            let _ = tx
                .send(Notice::PidRead {
                    id,
                    pending: p,
                    pid,
                })
                .await;
        });
    }

    /// Reports pending container `id` with its `pid` (from a `run` watcher
    /// that saw it alive, `seen`, or from the runtime's state / pid file).
    fn complete(
        &mut self,
        id: &str,
        p: Pending,
        pid: Option<u32>,
        seen: Option<crate::run_watch::Observed>,
        sink: &mut dyn Sink,
    ) {
        let Some(pid) = pid else { return };
        // The state names the init process; make sure it is one (a `run`
        // watcher saw it alive, in its own namespaces, already).
        let refused = match &seen {
            None => proc::not_a_container_init(pid),
            Some(_) if pid <= 1 => Some(format!("pid {pid} is the host's init")),
            Some(_) => None,
        };
        if let Some(why) = refused {
            self.shared.error("state");
            self.shared.missed(&p.runtime, "not-a-container-process");
            tracing::warn!(
                runtime = %p.runtime,
                id,
                pid,
                why,
                "the runtime's state names no container process; not reported"
            );
            return;
        }
        if self.tracked.get(id).and_then(|c| c.pid) == Some(pid) {
            // Reconciliation got there first.
            return;
        }
        let mut c = Container::new(id, p.runtime.clone());
        c.bundle = p.bundle.clone();
        c.runtime_root = Some(p.root.clone());
        fill(&mut c, pid, p.config.as_ref(), p.status);
        if let Some(obs) = seen {
            // The container may be gone already: keep what the watcher saw.
            if c.namespaces.mnt.is_none() {
                c.namespaces = obs.namespaces;
            }
            if c.cgroup.is_none() {
                c.cgroup = obs.cgroup;
            }
        }
        self.track(c.clone(), pid);
        sink.emit(ContainerEvent::added(Source::RuntimeHook, c));
    }

    /// The pid of pending container `id`, from the runtime's state or its
    /// pid file, read on a helper thread for at most the answer deadline
    /// (a pid file on a hung file system costs this container that much,
    /// and nobody else anything: the task goes on meanwhile).
    fn read_pid(
        &self,
        id: &str,
        p: &Pending,
    ) -> impl std::future::Future<Output = Option<u32>> + use<> {
        let host_root = self.config.host_root.clone();
        let (runtime, root, pid_file) = (p.runtime.clone(), p.root.clone(), p.pid_file.clone());
        let owned_id = id.to_owned();
        let kind = runtime.clone();
        let read = move || match read_state_under(&host_root, &runtime, &root, &owned_id) {
            Ok(s) => Ok(s.pid),
            Err(e) => {
                let why = match pid_file.map(|f| read_pid_file_under(&host_root, &f)) {
                    Some(Ok(pid)) => return Ok(pid),
                    Some(Err(pe)) => format!("no state ({e}) and no pid file ({pe})"),
                    None => format!("no state ({e})"),
                };
                // Something of the container is there: not a failed
                // create, but state this version cannot read.
                Err((why, leaves_trace(&host_root, &root, &owned_id)))
            }
        };
        let (deadline, shared, id) = (
            self.config.answer_deadline,
            Arc::clone(&self.shared),
            id.to_owned(),
        );
        async move {
            match crate::oci::bounded_async(deadline, read).await {
                Ok(Ok(pid)) => Some(pid),
                Ok(Err((why, false))) => {
                    tracing::debug!(id, why, "no pid: the create failed");
                    None
                }
                Ok(Err((why, true))) => {
                    shared.missed(&kind, "unreadable-state");
                    tracing::warn!(
                        runtime = %kind,
                        id,
                        why,
                        "the runtime made a container whose state cannot be read; not reported"
                    );
                    None
                }
                Err(why) => {
                    shared.error("state");
                    shared.missed(&kind, "state-timeout");
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
    }

    fn track(&mut self, c: Container, pid: u32) {
        if let Some(cap) = self.capture.as_mut() {
            cap.watch_exit(pid);
        }
        self.spawn_exit_wait(pid, Notice::Exited(c.id.clone(), pid));
        self.tracked.insert(c.id.clone(), c);
    }

    fn sweep(&mut self) {
        let before = self.pending.len();
        self.pending.retain(|_, p| p.since.elapsed() < PENDING_TTL);
        if self.pending.len() < before {
            tracing::debug!(
                dropped = before - self.pending.len(),
                "dropped stale pending creates"
            );
        }
    }
}

/// Kills the init process of a container whose start was denied: it waits
/// in the runtime's init for a `start` that will not come, and a later
/// `start` must not run it either. Through a pidfd, so that a recycled pid
/// is never hit; the exit is then seen like any other.
fn kill_init(id: &str, pid: u32) {
    let killed = crate::pidfd::pidfd_open(pid).and_then(|fd| {
        use std::os::fd::AsRawFd;
        // SAFETY: pidfd_send_signal takes an fd, a signal, a null siginfo
        // and flags; the fd is open for the duration of the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    });
    if let Err(e) = killed {
        tracing::warn!(id, pid, %e, "could not kill the init of a denied container");
    }
}

/// Follows an allowed runtime exec until its own argv is readable (see
/// [`RuntimeHook::spawn_late_argv`]).
async fn follow_exec(u: Unseen) -> Notice {
    let Unseen {
        tid,
        binary,
        exe,
        pidfd,
        bpf,
    } = u;
    // Only host root makes rootful containers (see the gate). The real uid
    // does not change across the exec.
    if proc::real_uid(tid).is_some_and(|uid| uid != 0) {
        return Notice::Foreign { pid: tid };
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
            if alive && proc::real_uid(tid) != Some(0) {
                return Notice::Foreign { pid: tid };
            }
            if alive {
                if bpf {
                    tracing::warn!(
                        pid = tid,
                        binary,
                        ?argv,
                        "a root runtime exec without a BPF argv record: read from /proc after \
                         the fact (its container is reported, but was not held before start)"
                    );
                }
                return Notice::LateArgv {
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
            return Notice::Unread {
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
            return Notice::Unread {
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

pub(crate) fn fill(c: &mut Container, pid: u32, config: Option<&OciConfig>, status: Status) {
    c.pid = Some(pid);
    c.status = status;
    if c.runtime == RuntimeKind::Runsc {
        c.sandbox = Some("gvisor".into());
    }
    c.namespaces = proc::namespaces(pid);
    c.cgroup = proc::cgroup(pid);
    if let Some(cfg) = config {
        c.annotations = cfg.annotations.clone();
        c.kubernetes = lookout_model::Kubernetes::from_annotations(&c.annotations);
        c.hostname = cfg.hostname.clone();
        c.args = cfg
            .process
            .as_ref()
            .map(|p| p.args.clone())
            .unwrap_or_default();
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
