//! The runtime hook: one fanotify group with `FAN_OPEN_EXEC_PERM` marks on
//! the runtime binaries, BPF argv capture, and the container state machine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lookout_fanotify::{Class, Fanotify, MarkFlags, Mask, Permission, Report};
pub use lookout_model::Sink;
use lookout_model::{Container, ContainerEvent, RuntimeKind, Source, Status};
use tokio::sync::mpsc;

use crate::argv::{self, Command, Invocation};
use crate::capture::ExecCapture;
use crate::gate::{Exec, Gate, Shared, answer};
use crate::oci::{OciConfig, read_config_within};
use crate::state::{default_root, read_pid_file, read_state};
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
    /// (`argv`, `config`, `overflow`, `read`, `mark`).
    fn error(&self, kind: &'static str);
}

/// Something the runtime's `start` of a container waits for, such as the
/// container's prestart hooks. Called on the hook's task right after the
/// container was reported (the `added` event went to the sink).
pub trait StartBarrier: Send + Sync {
    /// A future that completes when `start` of container `id` may go on,
    /// or `None` to go on at once. The hook waits at most
    /// [`Config::start_barrier_cap`], without holding up other execs.
    fn wait(
        &self,
        id: &str,
    ) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>;
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
    /// The init process of a tracked container exited.
    Exited(String, u32),
}

/// Counters, for metrics and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Permission events answered.
    pub answered: u64,
    /// Runtime execs without a BPF argv record.
    pub missing_argv: u64,
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
        if let Err(e) = self
            .group
            .add_mark(path, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        {
            if let Ok(mut m) = self.shared.marked.write() {
                m.remove(path);
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
        let tracked = &self.tracked;
        let found = crate::scan::scan_state(&self.config.host_root, &|id| tracked.contains_key(id));
        for c in found {
            let Some(pid) = c.pid else { continue };
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
            tokio::select! {
                () = &mut shutdown => break,
                Some(x) = self.execs.recv() => self.on_exec(x, sink),
                Some(n) = self.notices_rx.recv() => self.notice(n, sink),
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
    fn on_exec(&mut self, exec: Exec, sink: &mut dyn Sink) {
        match exec {
            Exec::Command {
                pid,
                inv,
                perm,
                since,
            } => {
                self.on_invocation(pid, &inv, Some(perm), sink);
                self.shared.answered(since);
            }
            Exec::Unseen {
                tid,
                binary,
                before,
            } => self.spawn_late_argv(tid, binary, before),
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
        perm: Option<Permission>,
        sink: &mut dyn Sink,
    ) {
        match argv::parse(argv, binary) {
            Ok(inv) => self.on_invocation(pid, &inv, perm, sink),
            Err(e) => {
                self.shared.error("argv");
                tracing::warn!(%e, ?argv, "cannot parse runtime command line; allowing it");
                if let Some(perm) = perm {
                    answer(perm);
                }
            }
        }
    }

    /// Acts on a parsed runtime command line; `perm` as for `on_argv`.
    fn on_invocation(
        &mut self,
        pid: u32,
        inv: &Invocation,
        perm: Option<Permission>,
        sink: &mut dyn Sink,
    ) {
        match &inv.command {
            Command::Create(a) | Command::Run(a) => {
                let id = a.id.clone();
                self.on_create(pid, inv);
                if let Some(perm) = perm {
                    answer(perm);
                }
                if matches!(inv.command, Command::Create(_)) {
                    self.spawn_exit_wait(pid, Notice::Created(id));
                } else {
                    self.spawn_state_wait(inv, id, pid);
                }
            }
            Command::Start { id } => {
                // The container is still `created`: report it before its
                // process may run.
                let id = id.clone();
                if self.pending.contains_key(&id) {
                    self.finalize(&id, None, sink);
                }
                let Some(perm) = perm else { return };
                match self.config.start_barrier.as_ref().and_then(|b| b.wait(&id)) {
                    // Wait on a task: other runtime execs go on meanwhile.
                    Some(barrier) => {
                        let cap = self.config.start_barrier_cap;
                        tokio::spawn(async move {
                            if tokio::time::timeout(cap, barrier).await.is_err() {
                                tracing::warn!(
                                    id,
                                    ?cap,
                                    "start did not wait longer for the container's prestart hooks"
                                );
                            }
                            answer(perm);
                        });
                    }
                    None => answer(perm),
                }
            }
            Command::Delete { .. } | Command::ReExec | Command::Other(_) => {
                if let Some(perm) = perm {
                    answer(perm);
                }
            }
        }
    }

    fn on_create(&mut self, tid: u32, inv: &Invocation) {
        let (args, status) = match &inv.command {
            Command::Create(a) => (a, Status::Created),
            Command::Run(a) => (a, Status::Running),
            _ => return,
        };
        let cwd = proc::cwd(tid);
        let bundle = inv.bundle(cwd.as_deref());
        let config = bundle.as_ref().and_then(|b| {
            read_config_within(
                &self.host(b),
                args.config.as_deref(),
                self.config.answer_deadline,
            )
            .map_err(|e| {
                self.shared.error("config");
                tracing::warn!(id = args.id, %e, "cannot read the container's config");
            })
            .ok()
        });
        let root = inv
            .root
            .clone()
            .unwrap_or_else(|| default_root(&inv.runtime));
        let pid_file = args
            .pid_file
            .as_ref()
            .map(|p| match (&cwd, p.is_absolute()) {
                (Some(cwd), false) => cwd.join(p),
                _ => p.clone(),
            });
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

    fn spawn_late_argv(&self, pid: u32, binary: String, before: Option<Vec<String>>) {
        // fanotify-only mode: once the exec is allowed, /proc/<pid>/cmdline
        // turns from the parent's argv into the runtime's. Best effort: a
        // command that ends within ~10 ms (`start`, `delete`) may be gone
        // before we read it; `create` and `run` live longer.
        let tx = self.notices_tx.clone();
        tokio::spawn(async move {
            for _ in 0..50 {
                match proc::cmdline(pid) {
                    None => return,
                    Some(argv) if Some(&argv) != before.as_ref() && !argv.is_empty() => {
                        let _ = tx.send(Notice::LateArgv { pid, binary, argv }).await;
                        return;
                    }
                    Some(_) => tokio::time::sleep(Duration::from_micros(200)).await,
                }
            }
        });
    }

    fn notice(&mut self, n: Notice, sink: &mut dyn Sink) {
        match n {
            Notice::Created(id) => {
                if self.pending.contains_key(&id) {
                    self.finalize(&id, None, sink);
                }
            }
            Notice::LateArgv { pid, binary, argv } => self.on_argv(pid, &binary, &argv, None, sink),
            Notice::Observed(obs) => {
                if self.pending.contains_key(&obs.id) {
                    let id = obs.id.clone();
                    self.finalize(&id, Some(obs), sink);
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
    fn finalize(
        &mut self,
        id: &str,
        seen: Option<crate::run_watch::Observed>,
        sink: &mut dyn Sink,
    ) {
        let Some(p) = self.pending.remove(id) else {
            return;
        };
        let pid = match &seen {
            Some(obs) => Some(obs.pid),
            None => self.read_pid(id, &p),
        };
        let Some(pid) = pid else { return };
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

    fn read_pid(&self, id: &str, p: &Pending) -> Option<u32> {
        match read_state(&p.runtime, &self.host(&p.root), id) {
            Ok(s) => Some(s.pid),
            Err(e) => match p.pid_file.as_ref().map(|f| read_pid_file(&self.host(f))) {
                Some(Ok(pid)) => Some(pid),
                Some(Err(pe)) => {
                    tracing::debug!(id, %e, %pe, "no state and no pid file: the create failed");
                    None
                }
                None => {
                    tracing::debug!(id, %e, "no state: the create failed");
                    None
                }
            },
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

pub(crate) fn fill(c: &mut Container, pid: u32, config: Option<&OciConfig>, status: Status) {
    c.pid = Some(pid);
    c.status = status;
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
