//! `lookout run`: discovery, one event per line on stdout.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use lookout_model::{ContainerEvent, EventKind};
use lookout_probe::{Mode, ProbeOptions, ProbeReport};
use lookout_runtime_hook::{RuntimeHook, Scanner, Sink};

use crate::hooks::{EventLimit, Events, HookSettings, HookSink};
use crate::hub::{Barriers, GateBarrier, Hub, HubConfig, HubSink};
use crate::merge;

/// The output format of events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// One JSON object per line.
    Json,
    /// One readable line per event.
    Text,
    /// Nothing: consumers use the API socket (or, embedded, the hub).
    None,
}

/// A requested mode: `auto` or one of the ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    /// The best mode this node supports.
    Auto,
    /// fanotify exec-permission marks + BPF argv capture.
    FanotifyEbpf,
    /// fanotify alone.
    Fanotify,
    /// Watch this node's Pods through the Kubernetes API.
    Podinformer,
    /// Scan runtime state directories.
    Scan,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Discovery mode.
    #[arg(long, value_enum, default_value = "auto")]
    mode: ModeArg,
    /// Event format (default: json when stdout is not a terminal).
    #[arg(long, value_enum)]
    output: Option<Output>,
    /// Where the host's root file system is mounted.
    #[arg(long, env = "LOOKOUT_HOST_ROOT", default_value = "/")]
    host_root: PathBuf,
    /// The host process whose namespaces (mount, network, IPC, UTS) hooks
    /// run in: the host's init by default (a DaemonSet shares the host's
    /// pids). Where pid 1 hides its namespaces (some VM inits), name
    /// another process of the host's.
    #[arg(
        long,
        env = "LOOKOUT_HOST_NAMESPACES_PID",
        default_value_t = 1,
        value_name = "PID"
    )]
    host_namespaces_pid: u32,
    /// An extra runtime binary to watch (an absolute host path). Repeatable.
    #[arg(long = "runtime-path", value_name = "PATH", value_parser = absolute_path)]
    runtime_paths: Vec<PathBuf>,
    /// Watch only the --runtime-path binaries: not the built-in list of
    /// install locations, not PATH (also for binaries installed later).
    #[arg(long)]
    no_default_runtimes: bool,
    /// How often to look for runtime binaries installed after start-up.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    rescan_interval: Duration,
    /// Where to serve /healthz, /readyz and /metrics.
    #[arg(long, default_value = "127.0.0.1:9477")]
    listen: std::net::SocketAddr,
    /// How long a runtime exec may wait for its event to be written to
    /// stdout (a consumer that stops reading must not freeze the node).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    event_deadline: Duration,
    /// Rescan interval of the scan mode.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    scan_interval: Duration,
    /// This node's name, for the Pod informer (from the downward API).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// A kubeconfig file; without it, the usual places (`~/.kube/config`,
    /// then the in-cluster service account).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Run the Pod informer beside a runtime-hook or scan mode, so that
    /// containers the hook cannot see (gVisor, Kata) are still reported,
    /// once. Default: on when a cluster is configured.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    fallback_informer: Option<bool>,
    /// A command run through `sh -c` for every new container, with its OCI
    /// State (status `created`) on stdin, before the runtime may start it.
    /// Repeatable.
    #[arg(long, value_name = "CMD")]
    prestart: Vec<String>,
    /// A command run through `sh -c` after a container exits, with its
    /// State (status `stopped`) on stdin. Repeatable.
    #[arg(long, value_name = "CMD")]
    poststop: Vec<String>,
    /// An oci-hooks(5) directory (CRI-O/podman hooks.d JSON). Repeatable;
    /// a later one overrides an earlier one by file name.
    #[arg(long = "hooks-dir", value_name = "DIR")]
    hooks_dirs: Vec<PathBuf>,
    /// Each hook's timeout (unless its hooks.d file sets one), and the
    /// longest a runtime's `start` waits for a container's prestart hooks.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    hook_timeout: Duration,
    /// The longest a runtime exec waits on lookout for anything but a
    /// container's prestart hooks (reading its config.json and state). A
    /// hung file system costs the one container involved at most this.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    answer_deadline: Duration,
    /// Post a Kubernetes Event (`NewContainerConfig`) on this Node for every
    /// new container.
    #[arg(long)]
    k8s_events: bool,
    /// UNSAFE: Event notes also carry environment variable and annotation
    /// values (secrets), readable by anyone who may list Events.
    #[arg(long)]
    k8s_events_unsafe_values: bool,
    /// At most this many Events at once; the rate limit's burst (at
    /// least 1 with --k8s-events).
    #[arg(long, default_value = "25", value_name = "N")]
    k8s_events_burst: u32,
    /// Events allowed per minute after the burst (0: none). Events over
    /// the limit are dropped, never queued.
    #[arg(long, default_value = "60", value_name = "N")]
    k8s_events_per_minute: u32,
    /// The consumer API's Unix socket (gRPC, lookout.v1; docs/consumers.md).
    #[arg(
        long,
        env = "LOOKOUT_SOCKET",
        default_value = "/run/lookout/lookout.sock",
        value_name = "PATH"
    )]
    socket: PathBuf,
    /// Do not serve the consumer API.
    #[arg(long)]
    no_socket: bool,
    /// Group (name or gid) of the socket and its directory: its members may
    /// List and Watch.
    #[arg(long, value_name = "GROUP")]
    socket_group: Option<String>,
    /// A uid allowed to Gate besides root. Repeatable.
    #[arg(long = "gate-allow-uid", value_name = "UID")]
    gate_allow_uids: Vec<u32>,
    /// A gid allowed to Gate besides root. Repeatable.
    #[arg(long = "gate-allow-gid", value_name = "GID")]
    gate_allow_gids: Vec<u32>,
    /// The deadline of a gate hold whose subscriber asks for none.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    gate_deadline: Duration,
    /// The longest deadline a gate subscriber may ask for.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    gate_max_deadline: Duration,
    /// A namespace where fail-closed gates do not apply (the node must be
    /// able to recover). Repeatable; default kube-system, plus
    /// $POD_NAMESPACE (lookout's own) when set.
    #[arg(long = "gate-exempt-namespace", value_name = "NS")]
    gate_exempt_namespaces: Vec<String>,
    /// Changes buffered per watcher; one that falls this far behind is
    /// disconnected (it resumes from its last revision).
    #[arg(long, default_value = "1024", value_name = "N")]
    watch_buffer: usize,
}

impl RunArgs {
    /// Checks across flags that clap cannot express: what would make a flag
    /// meaningless.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.k8s_events && self.k8s_events_burst == 0 {
            return Err(
                "invalid value '0' for '--k8s-events-burst <N>': with --k8s-events it \
                 must be at least 1 (a burst of 0 would drop every Event)"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

/// Runtime paths are host paths: a relative one would be resolved against
/// the agent's working directory, which is never what was meant.
pub fn absolute_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(format!(
            "{s:?} is not an absolute path (runtime paths are host paths, e.g. /usr/local/bin/runc)"
        ))
    }
}

/// The longest interval or deadline accepted (a larger one would overflow
/// the clock arithmetic of timers).
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// A positive duration: humantime syntax (`500ms`, `2s`, `1m30s`, `1h`), or
/// a bare number of seconds. Zero is refused: every interval and deadline
/// of the agent must let time pass.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let d = if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        s.parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| format!("{s:?} is too large"))?
    } else {
        humantime::parse_duration(s)
            .map_err(|e| format!("invalid duration {s:?}: {e} (e.g. 500ms, 2s, 1m30s)"))?
    };
    if d.is_zero() {
        return Err(format!("{s:?}: must be greater than zero"));
    }
    if d > MAX_DURATION {
        return Err(format!("{s:?}: must be at most 30 days"));
    }
    Ok(d)
}

/// Hands each event to a writer thread that writes it to stdout and
/// flushes, and waits (up to `deadline`) until it is written: a reader has
/// the event before the runtime exec that caused it is allowed. A consumer
/// that stops reading stdout must not freeze the node's runtimes, so after
/// the deadline the hook goes on (the line is still written later, in
/// order); while earlier lines are still unwritten, later events do not
/// wait at all, so a stall costs the runtimes one deadline, not one per
/// event. When even the bounded queue is full, events are dropped and
/// counted.
struct StdoutSink {
    output: Output,
    metrics: std::sync::Arc<crate::serve::Metrics>,
    unwritten: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    queue: std::sync::mpsc::SyncSender<(String, std::sync::mpsc::SyncSender<()>)>,
    deadline: Duration,
    late: u64,
    dropped: u64,
}

impl StdoutSink {
    fn new(
        output: Output,
        deadline: Duration,
        metrics: std::sync::Arc<crate::serve::Metrics>,
    ) -> anyhow::Result<StdoutSink> {
        let (queue, rx) =
            std::sync::mpsc::sync_channel::<(String, std::sync::mpsc::SyncSender<()>)>(4096);
        let unwritten = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = std::sync::Arc::clone(&unwritten);
        std::thread::Builder::new()
            .name("lookout-stdout".into())
            .spawn(move || {
                let out = std::io::stdout();
                for (line, ack) in rx {
                    let mut lock = out.lock();
                    if writeln!(lock, "{line}")
                        .and_then(|()| lock.flush())
                        .is_err()
                    {
                        // N.B. a closed stdout must not stop discovery.
                        tracing::debug!("stdout closed; event dropped");
                    }
                    counter.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                    let _ = ack.try_send(());
                }
            })
            .context("starting the stdout writer thread")?;
        Ok(StdoutSink {
            output,
            metrics,
            unwritten,
            queue,
            deadline,
            late: 0,
            dropped: 0,
        })
    }
}

impl Sink for StdoutSink {
    fn emit(&mut self, event: ContainerEvent) {
        self.metrics.event(&event);
        let line = match self.output {
            Output::Json => {
                serde_json::to_string(&event).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
            }
            Output::Text => text_line(&event),
            Output::None => return,
        };
        let (ack_tx, ack_rx) = std::sync::mpsc::sync_channel(1);
        let behind = self
            .unwritten
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel)
            > 0;
        match self.queue.try_send((line, ack_tx)) {
            // The writer is still stuck on earlier lines: do not make the
            // runtime wait again.
            Ok(()) if behind => {
                self.late += 1;
                self.metrics.stdout_late();
            }
            Ok(()) => {
                if ack_rx.recv_timeout(self.deadline).is_err() {
                    self.late += 1;
                    self.metrics.stdout_late();
                    tracing::warn!(
                        late = self.late,
                        id = event.container.id,
                        "stdout is not being read: event queued, the runtime is not kept waiting"
                    );
                }
            }
            Err(_) => {
                self.unwritten
                    .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                self.dropped += 1;
                self.metrics.stdout_dropped();
                tracing::error!(
                    dropped = self.dropped,
                    id = event.container.id,
                    "stdout queue full: event dropped"
                );
            }
        }
    }
}

fn text_line(e: &ContainerEvent) -> String {
    let c = &e.container;
    let kind = match e.event {
        EventKind::Added => "ADDED",
        EventKind::Removed => "REMOVED",
    };
    let mut s = format!(
        "{kind:<8} {:<6} {:<24} pid={:<8} source={}",
        c.runtime.as_str(),
        c.id,
        c.pid.map_or("-".to_owned(), |p| p.to_string()),
        e.source
    );
    if let Some(b) = &c.bundle {
        s.push_str(&format!(" bundle={}", b.display()));
    }
    if let Some(code) = e.exit_code {
        s.push_str(&format!(" exit={code}"));
    }
    s
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers, run until killed.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}

/// What stops `run` and who hears that it is ready.
pub(crate) enum Control {
    /// `lookout run`: SIGTERM or SIGINT stops it.
    Signals,
    /// Embedded ([`crate::Discovery`]): `stop` turning true stops it; the
    /// hub is sent on `ready` once discovery runs.
    Embedded {
        stop: tokio::sync::watch::Receiver<bool>,
        ready: std::sync::mpsc::Sender<std::sync::Arc<Hub>>,
    },
}

impl Control {
    fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static + use<> {
        let stop = match self {
            Control::Signals => None,
            Control::Embedded { stop, .. } => Some(stop.clone()),
        };
        async move {
            match stop {
                None => shutdown_signal().await,
                Some(mut s) => {
                    let _ = s.wait_for(|v| *v).await;
                    tracing::info!("stop requested: shutting down");
                }
            }
        }
    }

    fn ready(&self, hub: &std::sync::Arc<Hub>) {
        if let Control::Embedded { ready, .. } = self {
            let _ = ready.send(std::sync::Arc::clone(hub));
        }
    }
}

pub fn run(args: RunArgs, bpf_object: Option<&'static [u8]>) -> anyhow::Result<()> {
    if let Err(why) = args.check() {
        // Exit 2 with clap's format, like a bad value clap itself refused.
        clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{why}\n")).exit();
    }
    run_with(args, bpf_object, Control::Signals)
}

/// [`run`] under `control`; flags already checked by the caller.
pub(crate) fn run_with(
    args: RunArgs,
    bpf_object: Option<&'static [u8]>,
    control: Control,
) -> anyhow::Result<()> {
    raise_nofile_limit();
    raise_memlock_limit();
    // Cgroup paths as the host sees them, not relative to a pod's own
    // cgroup namespace.
    match lookout_model::proc::use_host_cgroup_namespace(args.host_namespaces_pid) {
        Ok(true) => tracing::info!(
            pid = args.host_namespaces_pid,
            "cgroup paths are read in the host's cgroup namespace"
        ),
        Ok(false) => {}
        Err(e) => tracing::info!(
            pid = args.host_namespaces_pid,
            %e,
            "cannot read cgroup paths in the host's cgroup namespace; they are relative to ours \
             where it differs (--host-namespaces-pid)"
        ),
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    // Everything that talks to other parties (the Kubernetes API, hook
    // processes, Events) runs on a runtime and thread of its own: the
    // main runtime runs the runtime hook's task, which answers `create`,
    // `run` and `start`, and shares nothing with them that can stall.
    let side = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("lookout-side")
        .enable_all()
        .build()
        .context("starting the side tokio runtime")?;
    let result = rt.block_on(run_async(args, bpf_object, side.handle().clone(), control));
    // Hook processes and reads stuck on a hung file system must not hold
    // the exit up: their tasks are abandoned.
    side.shutdown_background();
    result
}

async fn run_async(
    args: RunArgs,
    bpf_object: Option<&'static [u8]>,
    side: tokio::runtime::Handle,
    control: Control,
) -> anyhow::Result<()> {
    let output = args.output.unwrap_or(if std::io::stdout().is_terminal() {
        Output::Text
    } else {
        Output::Json
    });
    let metrics = std::sync::Arc::new(crate::serve::Metrics::new());
    let shared = std::sync::Arc::new(crate::serve::Shared {
        metrics: std::sync::Arc::clone(&metrics),
        ready: std::sync::RwLock::new(None),
        hook: std::sync::OnceLock::new(),
    });
    crate::serve::spawn(args.listen, std::sync::Arc::clone(&shared));
    let stdout = StdoutSink::new(output, args.event_deadline, std::sync::Arc::clone(&metrics))?;
    let (node_name, kubeconfig) = (args.node_name.clone(), args.kubeconfig.clone());
    let report = lookout_probe::probe(
        &ProbeOptions::new()
            .host_root(&args.host_root)
            .runtime_paths(args.runtime_paths.clone())
            .default_runtimes(!args.no_default_runtimes)
            .bpf_object(bpf_object)
            .env(move |k| match k {
                "NODE_NAME" => node_name.clone(),
                "KUBECONFIG" => kubeconfig
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned()),
                _ => std::env::var(k).ok(),
            }),
    );
    let wanted = match args.mode {
        ModeArg::Auto => None,
        ModeArg::FanotifyEbpf => Some(Mode::FanotifyEbpf),
        ModeArg::Fanotify => Some(Mode::Fanotify),
        ModeArg::Podinformer => Some(Mode::PodInformer),
        ModeArg::Scan => Some(Mode::Scan),
    };
    let (mode, refused) = choose(&report, wanted)?;

    // Initialize the chosen hook mode once; if that fails (a race with
    // the probe, a kernel surprise), step down instead of exiting.
    // One connection to the cluster, made when something needs it.
    let mut kube = Kube {
        side: side.clone(),
        result: None,
    };
    let hook_settings = HookSettings {
        prestart: args.prestart.clone(),
        poststop: args.poststop.clone(),
        dirs: args.hooks_dirs.clone(),
        timeout: args.hook_timeout,
        host_root: args.host_root.clone(),
        host_namespaces_pid: args.host_namespaces_pid,
    };
    let events = if args.k8s_events {
        match (kube.client(&args).await, &args.node_name) {
            (Ok(client), Some(node)) => {
                if args.k8s_events_unsafe_values {
                    tracing::warn!(
                        "--k8s-events-unsafe-values: Event notes carry environment variable and \
                         annotation values, secrets included; anyone who may list Events can read them"
                    );
                }
                let dropped = metrics.k8s_events_dropped();
                Some(Events {
                    client,
                    node: node.clone(),
                    unsafe_values: args.k8s_events_unsafe_values,
                    limit: std::sync::Arc::new(EventLimit::new(
                        args.k8s_events_burst,
                        args.k8s_events_per_minute,
                        dropped,
                    )),
                })
            }
            (Err(e), _) => {
                tracing::warn!("--k8s-events: no cluster: {e:#}");
                None
            }
            (_, None) => {
                tracing::warn!("--k8s-events: NODE_NAME is not set");
                None
            }
        }
    } else {
        None
    };
    let hooks_wanted = hook_settings.any();
    let (stdout, barrier) = HookSink::new(stdout, hook_settings, events, side.clone());
    let hub = Hub::new(hub_config(&args), metrics.hub());
    let mut bound = None;
    if !args.no_socket {
        // The API is a consumer like any other: without it discovery goes on.
        match serve_api(&args, std::sync::Arc::clone(&hub)) {
            Ok(id) => bound = Some(id),
            Err(e) => tracing::error!("consumer API not served: {e:#}"),
        }
    }
    let _unbind = Unbind(args.socket.clone(), bound);
    let mut barriers: Vec<std::sync::Arc<dyn lookout_runtime_hook::StartBarrier>> =
        vec![std::sync::Arc::new(GateBarrier(std::sync::Arc::clone(
            &hub,
        )))];
    if hooks_wanted {
        barriers.push(std::sync::Arc::new(barrier));
    }
    let barrier = std::sync::Arc::new(Barriers(barriers));
    // A start waits for prestart hooks and gates, then its state read.
    let start_cap = args.hook_timeout.max(args.gate_max_deadline) + Duration::from_secs(1);
    let stdout = HubSink::new(std::sync::Arc::clone(&hub), stdout);

    let mut refused = refused;
    let mut hook = None;
    let mut informer = None;
    for m in Mode::LADDER.into_iter().filter(|m| *m >= mode) {
        match m {
            Mode::FanotifyEbpf | Mode::Fanotify => {
                if wanted.is_none() && report.requirements(m).is_err() {
                    continue;
                }
                let (interval, find) = rescan(&args);
                let mut builder = RuntimeHook::builder()
                    .host_root(args.host_root.clone())
                    .binaries(report.runtimes.iter().map(|r| r.resolved.clone()))
                    .rescan(interval, find)
                    .observer(std::sync::Arc::clone(&metrics) as _)
                    .start_barrier(std::sync::Arc::clone(&barrier) as _, start_cap)
                    .answer_deadline(args.answer_deadline);
                if m == Mode::FanotifyEbpf
                    && let Some(object) = bpf_object
                {
                    builder = builder.bpf_object(object.to_vec());
                }
                match builder.build() {
                    Ok(h) => {
                        stdout.inner().close_in_hooks(h.group_fd());
                        // A start may wait for prestart hooks and gates,
                        // then its state read: past that (and a margin),
                        // the hook is stuck.
                        let bound = start_cap + args.answer_deadline + HEALTH_MARGIN;
                        let _ = shared.hook.set((h.health(), bound));
                        hook = Some((m, h));
                        break;
                    }
                    Err(e) if wanted.is_some() => bail!("--mode {m} cannot start: {e}"),
                    Err(e) => refused.push(format!("{m}: starting it failed: {e}")),
                }
            }
            Mode::PodInformer => {
                if wanted.is_none() && report.requirements(m).is_err() {
                    continue;
                }
                match start_informer(&args, &mut kube).await {
                    Ok(i) => {
                        informer = Some(i);
                        break;
                    }
                    Err(e) if wanted.is_some() => bail!("--mode {m} cannot start: {e:#}"),
                    Err(e) => refused.push(format!("{m}: {e:#}")),
                }
            }
            Mode::Scan => break,
        }
    }
    let chosen = match (&hook, &informer) {
        (Some((m, _)), _) => *m,
        (None, Some(_)) => Mode::PodInformer,
        (None, None) => Mode::Scan,
    };
    // The fallback informer: on by default when a cluster is configured.
    let fallback = if chosen == Mode::PodInformer {
        None
    } else {
        let cluster = report.requirements(Mode::PodInformer);
        match (args.fallback_informer, cluster) {
            (Some(false), _) | (None, Err(_)) => None,
            (Some(true), Err(why)) => {
                tracing::warn!("--fallback-informer: no cluster to watch: {why}");
                None
            }
            (_, Ok(())) => match start_informer(&args, &mut kube).await {
                Ok(i) => Some(i),
                Err(e) => {
                    tracing::warn!("fallback informer not started: {e:#}");
                    None
                }
            },
        }
    };
    release_startup_memory();
    metrics.set_mode(chosen.as_str());
    // Only a hook with BPF argv capture holds a created container's start.
    hub.set_can_hold(matches!(&hook, Some((_, h)) if h.has_bpf()));
    let mut body = format!("mode {chosen}\n");
    for r in &refused {
        body.push_str(&format!("refused {r}\n"));
    }
    if refused.is_empty() {
        tracing::info!("discovery mode {chosen}");
    } else {
        tracing::info!("discovery mode {chosen} (refused: {})", refused.join(" | "));
    }

    let mut sink = merge::Shared::new(stdout, std::sync::Arc::clone(&metrics), fallback.is_some());
    if let Some(i) = fallback.as_ref().or(informer.as_ref()) {
        sink.set_index(i.index());
        if fallback.is_some() {
            tracing::info!("fallback Pod informer runs beside {chosen}");
        }
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let spawn_informer =
        |i: lookout_informer::Informer, sink: merge::Shared<HubSink<HookSink<StdoutSink>>>| {
            let mut stop = stop_rx.clone();
            side.spawn(async move {
                let mut sink = sink;
                i.run(&mut sink, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            })
        };
    match (hook, informer) {
        (Some((_, mut hook)), _) => {
            hook.scan(&mut sink);
            // After the state scan: what it found is not the informer's.
            let side = fallback.map(|i| spawn_informer(i, sink.clone()));
            set_ready(&shared, body);
            tracing::info!(
                tracked = hook.tracked().count(),
                bpf = hook.has_bpf(),
                "ready"
            );
            control.ready(&hub);
            let stats = hook.run(&mut sink, control.stopped()).await;
            tracing::info!(?stats, "runtime hook stopped; marks removed");
            stop_informer(&stop_tx, side).await;
        }
        (None, Some(informer)) => {
            let task = spawn_informer(informer, sink.clone());
            set_ready(&shared, body);
            tracing::info!("ready");
            control.ready(&hub);
            control.stopped().await;
            stop_informer(&stop_tx, Some(task)).await;
        }
        (None, None) => {
            let side = fallback.map(|i| spawn_informer(i, sink.clone()));
            set_ready(&shared, body);
            tracing::info!("ready");
            control.ready(&hub);
            Scanner::new(args.host_root.clone(), args.scan_interval)
                .run(&mut sink, control.stopped())
                .await;
            stop_informer(&stop_tx, side).await;
        }
    }
    Ok(())
}

fn hub_config(args: &RunArgs) -> HubConfig {
    let mut exempt = if args.gate_exempt_namespaces.is_empty() {
        vec!["kube-system".to_owned()]
    } else {
        args.gate_exempt_namespaces.clone()
    };
    if let Ok(ns) = std::env::var("POD_NAMESPACE")
        && !ns.is_empty()
        && !exempt.contains(&ns)
    {
        exempt.push(ns);
    }
    HubConfig {
        watch_buffer: args.watch_buffer.max(1),
        max_deadline: args.gate_max_deadline,
        exempt_namespaces: exempt,
        ..HubConfig::default()
    }
}

/// Removes the consumer socket when `run` returns.
struct Unbind(PathBuf, Option<(u64, u64)>);

impl Drop for Unbind {
    fn drop(&mut self) {
        crate::grpc::unbind(&self.0, self.1);
    }
}

/// Binds the consumer socket and serves it on its own thread; returns the
/// socket's device and inode.
fn serve_api(args: &RunArgs, hub: std::sync::Arc<Hub>) -> anyhow::Result<(u64, u64)> {
    let group = match &args.socket_group {
        None => None,
        Some(g) => Some(match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => nix::unistd::Group::from_name(g)
                .with_context(|| format!("looking up group {g}"))?
                .with_context(|| format!("--socket-group {g}: no such group"))?
                .gid
                .as_raw(),
        }),
    };
    let listener = crate::grpc::bind(&args.socket, group)?;
    let id = {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(&args.socket)
            .with_context(|| format!("stat {}", args.socket.display()))?;
        (m.dev(), m.ino())
    };
    crate::grpc::spawn(
        listener,
        args.socket.clone(),
        hub,
        crate::grpc::Auth {
            uids: args.gate_allow_uids.clone(),
            gids: args.gate_allow_gids.clone(),
        },
        args.gate_deadline.min(args.gate_max_deadline),
    )?;
    Ok(id)
}

async fn stop_informer(
    stop: &tokio::sync::watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
) {
    let _ = stop.send(true);
    if let Some(t) = task
        && tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .is_err()
    {
        tracing::warn!("the Pod informer did not stop within 5 s");
    }
}

/// The connection to the cluster, made once: the client, or why not.
struct Kube {
    /// Where the client (and its connection workers) live.
    side: tokio::runtime::Handle,
    result: Option<Result<kube::Client, String>>,
}

impl Kube {
    /// Builds the client and checks that the API server answers
    /// (`GET /version`, 10 s): a mode that cannot reach its cluster is
    /// refused at start-up, with the reason, instead of running blind.
    async fn client(&mut self, args: &RunArgs) -> anyhow::Result<kube::Client> {
        if self.result.is_none() {
            // Built on the side runtime, so that kube's connection workers
            // run there too.
            let connected = self
                .side
                .spawn(connect(args.kubeconfig.clone()))
                .await
                .unwrap_or_else(|e| Err(anyhow::anyhow!("connecting: {e}")));
            self.result = Some(connected.map_err(|e| format!("{e:#}")));
        }
        match &self.result {
            Some(Ok(c)) => Ok(c.clone()),
            Some(Err(e)) => Err(anyhow::anyhow!("{e}")),
            None => bail!("not connected"),
        }
    }
}

async fn connect(kubeconfig: Option<PathBuf>) -> anyhow::Result<kube::Client> {
    let client = match &kubeconfig {
        Some(path) => lookout_informer::client_from_kubeconfig(path).await?,
        None => lookout_informer::client().await?,
    };
    let version = tokio::time::timeout(Duration::from_secs(10), client.apiserver_version())
        .await
        .context("the API server did not answer GET /version within 10 s")?
        .context("the API server did not answer GET /version")?;
    tracing::info!(
        server = format!("{}.{}", version.major, version.minor),
        "connected to the Kubernetes API server"
    );
    Ok(client)
}

async fn start_informer(
    args: &RunArgs,
    kube: &mut Kube,
) -> anyhow::Result<lookout_informer::Informer> {
    let node =
        args.node_name.clone().filter(|n| !n.is_empty()).context(
            "NODE_NAME is not set (set it from the downward API: fieldRef spec.nodeName)",
        )?;
    let client = kube.client(args).await?;
    tracing::info!(node, "Pod informer: watching this node's pods");
    Ok(lookout_informer::Informer::new(
        client,
        lookout_informer::Config::new(node),
    ))
}

fn set_ready(shared: &crate::serve::Shared, body: String) {
    if let Ok(mut r) = shared.ready.write() {
        *r = Some(body);
    }
}

/// Finds the runtime binaries the same way the probe did.
/// How often to look for newly installed runtime binaries, and how.
fn rescan(
    args: &RunArgs,
) -> (
    Duration,
    impl Fn() -> Vec<PathBuf> + Send + Sync + 'static + use<>,
) {
    let host_root = args.host_root.clone();
    let extra = args.runtime_paths.clone();
    let defaults = !args.no_default_runtimes;
    let path_env = std::env::var_os("PATH");
    (args.rescan_interval, move || {
        let candidates = if defaults {
            lookout_probe::candidate_paths(path_env.as_deref(), &extra)
        } else {
            extra.clone()
        };
        lookout_probe::find_runtimes(&host_root, &candidates)
            .into_iter()
            .map(|r| r.resolved)
            .collect()
    })
}

/// Added to the longest legitimate wait of a runtime exec before
/// `/healthz` calls the hook stuck.
const HEALTH_MARGIN: Duration = Duration::from_secs(5);

/// Raises the soft open-file limit to the hard one. The agent's fds grow
/// with tracked containers (a pidfd each), running hooks, queued permission
/// events and HTTP connections; when fanotify cannot install an event's fd
/// the kernel answers the permission event with a *deny*, and runtime execs
/// fail across the node. Failing to raise it is logged, not fatal.
fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::info!(from = soft, to = hard, "raised the open-file limit"),
            Err(e) => tracing::warn!(%e, soft, hard, "cannot raise the open-file limit"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(%e, "cannot read the open-file limit"),
    }
}

/// Lifts the locked-memory limit, which kernels before 5.11 charge BPF
/// maps to (later ones charge the memory cgroup and ignore it). Raising
/// the hard limit takes `CAP_SYS_RESOURCE`; without it, BPF maps on such
/// kernels fail to load and the agent steps down to `fanotify`.
fn raise_memlock_limit() {
    use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, hard)) if soft == RLIM_INFINITY && hard == RLIM_INFINITY => {}
        Ok((soft, hard)) => match setrlimit(Resource::RLIMIT_MEMLOCK, RLIM_INFINITY, RLIM_INFINITY)
        {
            Ok(()) => tracing::debug!(soft, hard, "lifted the locked-memory limit"),
            Err(e) if kernel_before(5, 11) => tracing::warn!(
                %e,
                soft,
                hard,
                "cannot lift the locked-memory limit, which BPF maps need on this kernel \
                 (grant CAP_SYS_RESOURCE)"
            ),
            Err(e) => tracing::debug!(%e, soft, hard, "cannot lift the locked-memory limit"),
        },
        Err(e) => tracing::debug!(%e, "cannot read the locked-memory limit"),
    }
}

/// Whether the running kernel is older than `major.minor` (unknown: no).
fn kernel_before(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(a), Some(b)) => (a, b) < (major, minor),
        _ => false,
    }
}

/// Start-up parses the kernel's BTF (tens of MB, inside aya) and verifier
/// logs; give the freed heap back to the kernel so that the agent's
/// resident size reflects what it keeps.
fn release_startup_memory() {
    // SAFETY: malloc_trim only walks glibc's own heap; no pointers passed.
    unsafe { libc::malloc_trim(0) };
}

/// The mode to start with, and the refusals to log. An explicit mode that
/// cannot run is an error naming every reason.
fn choose(report: &ProbeReport, wanted: Option<Mode>) -> anyhow::Result<(Mode, Vec<String>)> {
    let refused: Vec<String> = report
        .refused
        .iter()
        .map(|r| format!("{}: {}", r.mode, r.reason))
        .collect();
    match wanted {
        None => Ok((report.mode, refused)),
        Some(m) => match report.requirements(m) {
            Ok(()) => Ok((m, Vec::new())),
            Err(why) => bail!("--mode {m} cannot run on this node: {why}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        for bad in [
            "x",
            "",
            "0",
            "0s",
            "0ms",
            "-1s",
            "-1",
            "1y2",
            "99999999999999999999",
            "31d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }
}
