//! [`Builder`]: the hook's configuration, written through a builder into
//! a private [`Config`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lookout_model::{Container, RuntimeKind, StartBarrier};

use super::RuntimeHook;
use crate::Error;
use crate::stats::Observer;

/// Finds the runtime binaries again (for binaries installed after start).
#[derive(Clone)]
pub(super) struct Rescan {
    /// How often.
    pub(super) interval: Duration,
    /// Returns the binaries to watch (paths this process opens).
    pub(super) find: Arc<dyn Fn() -> Vec<PathBuf> + Send + Sync>,
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
pub(super) struct Config {
    pub(super) host_root: PathBuf,
    pub(super) binaries: Vec<PathBuf>,
    pub(super) bpf_object: Option<Vec<u8>>,
    pub(super) answer_deadline: Duration,
    pub(super) rescan: Option<Rescan>,
    pub(super) observer: Option<Arc<dyn Observer>>,
    pub(super) start_barrier: Option<Arc<dyn StartBarrier>>,
    pub(super) start_barrier_cap: Duration,
    pub(super) state_roots: Vec<(RuntimeKind, PathBuf)>,
    pub(super) enrich: Option<Enrich>,
    pub(super) slice: Option<Duration>,
}

/// [`Builder::scheduler_slice`]'s default: the shortest the kernel takes.
pub const DEFAULT_SCHEDULER_SLICE: Duration = Duration::from_micros(100);

/// What [`Builder::enrich`] keeps.
pub(super) type Enrich = Arc<dyn Fn(&mut Container) + Send + Sync>;

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
