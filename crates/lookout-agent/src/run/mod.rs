//! `lookout run`: discovery, one event per line on stdout.
//!
//! - [`args`]: the flags;
//! - [`output`]: the stdout writer;
//! - [`modes`]: choosing the discovery mode, the Kubernetes client;
//! - [`limits`]: process limits;
//! - here: wiring them together, with the hub, hooks, the API socket and
//!   the health endpoints, until a signal (or, embedded, `stop`).

mod api;
mod args;
mod limits;
mod modes;
mod output;
mod startup;

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context;
use lookout_model::StartBarrier;
use lookout_probe::ProbeOptions;
use lookout_runtime_hook::{RuntimeHook, Scanner};

use args::ModeArg;
pub(crate) use args::parse_duration;
pub use args::{Output, RunArgs, absolute_path};
use limits::{raise_memlock_limit, raise_nofile_limit, release_startup_memory};
use modes::{Backends, HEALTH_MARGIN, Kube, Ladder, Primary, choose, start_nri, stop_informer};
use output::StdoutSink;
use startup::StartupClock;

use crate::hooks::{HookSettings, HookSink};
use crate::hub::{Barriers, DenialsReported, GateBarrier, Hub, HubConfig, HubSink};
use crate::k8s_events::{EventLimit, Events};
use crate::merge;
use crate::pinned::{PinSink, Pinned};

/// Installs the SIGTERM and SIGINT handlers now, and returns what
/// waits for either. Installed at once, not when first polled: a signal
/// that arrives while discovery starts (or right after `ready`) must
/// shut the agent down cleanly, not kill it with the default action.
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            // Without signal handlers, run until killed.
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
    }
}

/// What stops `run` and who hears that it is ready.
pub(crate) enum Control {
    /// `lookout run`: SIGTERM or SIGINT stops it.
    Signals,
    /// Embedded (the crate's `Discovery`): `stop` turning true stops it; the
    /// hub is sent on `ready` once discovery runs.
    Embedded {
        stop: tokio::sync::watch::Receiver<bool>,
        ready: std::sync::mpsc::Sender<std::sync::Arc<Hub>>,
    },
}

impl Control {
    fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static + use<> {
        let stop = match self {
            Control::Signals => Err(shutdown_signal()),
            Control::Embedded { stop, .. } => Ok(stop.clone()),
        };
        async move {
            match stop {
                Err(signals) => signals.await,
                Ok(mut s) => {
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

/// Runs `lookout run` until SIGTERM or SIGINT.
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
    let clock = StartupClock::start();
    raise_nofile_limit();
    raise_memlock_limit();
    // Cgroup paths as the host sees them, not relative to a pod's own
    // cgroup namespace.
    match lookout_host::proc::use_host_cgroup_namespace(args.host_namespaces_pid) {
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
    // Cgroup ids (what consumers' BPF programs key by) are the inodes of
    // the host's cgroup v2 directories, under the host root.
    match lookout_host::kernel::find_cgroup2_root(&args.host_root) {
        Ok(root) => {
            tracing::info!(root = %root.display(), "cgroup ids are read under this cgroup v2 root")
        }
        Err(why) => tracing::warn!(why, "containers are reported without cgroup ids"),
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    // Everything that talks to other parties (the Kubernetes API, hook
    // processes, Events) runs on a runtime and thread of its own: the
    // main runtime runs the runtime hook's task, which answers `create`,
    // `run` and `start`, and shares nothing with them that can stall.
    let side = SideRuntime::start()?;
    // This thread runs the hook's task, which answers `create` and `start`.
    // Asked after the side runtime's thread started, which keeps the
    // kernel's default (hook processes, the Kubernetes client); the
    // threads started from here on inherit it.
    if let Some(slice) = args.scheduler_slice.0 {
        use lookout_host::sched::{Slice, request_slice};
        match request_slice(slice) {
            Ok(Slice::Set(d)) => {
                tracing::info!(slice = ?d, "threads that runtimes wait on ask for short scheduler slices")
            }
            Ok(Slice::Unsupported) => tracing::info!(
                "this kernel has no custom scheduler slices (Linux 6.12+): the default slice stays"
            ),
            Ok(Slice::OtherPolicy(policy)) => tracing::info!(
                policy,
                "the agent runs under a scheduling policy of its operator's: its slice stays"
            ),
            Ok(other) => tracing::info!(?other, "scheduler slice left as it was"),
            Err(e) => tracing::info!(%e, "cannot ask for a scheduler slice: the default stays"),
        }
    }
    let result = rt.block_on(run_async(
        args,
        bpf_object,
        side.handle.clone(),
        control,
        clock,
    ));
    // Hook processes and reads stuck on a hung file system must not hold
    // the exit up: their tasks are abandoned.
    side.stop();
    result
}

/// The side runtime: a current-thread runtime that a thread of its own,
/// `lookout-side`, drives until [`SideRuntime::stop`].
///
/// N.B. Not tokio's multi-thread runtime with one worker: that would do
/// the same here, and its scheduler's statistics call `powf`, which makes
/// the agent load libm, about 0.45 MiB of resident pages (see
/// `metrics::exponential_buckets`).
struct SideRuntime {
    handle: tokio::runtime::Handle,
    stop: tokio::sync::oneshot::Sender<()>,
}

impl SideRuntime {
    fn start() -> anyhow::Result<SideRuntime> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .thread_name("lookout-side")
            .enable_all()
            .build()
            .context("starting the side tokio runtime")?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("lookout-side".into())
            .spawn(move || {
                // Ends when `stop` is sent or dropped.
                let _ = rt.block_on(stopped);
                rt.shutdown_background();
            })
            .context("starting the side tokio runtime's thread")?;
        Ok(SideRuntime { handle, stop })
    }

    /// Lets the side runtime's thread drop its tasks and end, without
    /// waiting for it.
    fn stop(self) {
        let _ = self.stop.send(());
    }
}

async fn run_async(
    args: RunArgs,
    bpf_object: Option<&'static [u8]>,
    side: tokio::runtime::Handle,
    control: Control,
    mut clock: StartupClock,
) -> anyhow::Result<()> {
    clock.lap("runtimes");
    let output = args.output.unwrap_or(if std::io::stdout().is_terminal() {
        Output::Text
    } else {
        Output::Json
    });
    let (metrics, (hub_metrics, pin_metrics)) = crate::metrics::Metrics::with(|r| {
        (
            crate::hub::HubMetrics::register(r),
            crate::pinned::PinMetrics::register(r),
        )
    });
    let metrics = std::sync::Arc::new(metrics);
    let shared = std::sync::Arc::new(crate::endpoints::Endpoints {
        metrics: std::sync::Arc::clone(&metrics),
        ready: std::sync::RwLock::new(None),
        hook: std::sync::OnceLock::new(),
    });
    crate::endpoints::spawn(args.listen, std::sync::Arc::clone(&shared));
    let (stdout, stdout_barrier) =
        StdoutSink::new(output, args.event_deadline, std::sync::Arc::clone(&metrics))?;
    let (node_name, kubeconfig) = (args.node_name.clone(), args.kubeconfig.clone());
    let report = lookout_probe::probe(
        &ProbeOptions::new()
            .host_root(&args.host_root)
            .runtime_paths(args.runtime_paths.clone())
            .default_runtimes(!args.no_default_runtimes)
            .nri_socket(&args.nri_socket)
            .docker_sockets(if args.no_docker {
                Vec::new()
            } else {
                args.docker_sockets.clone()
            })
            .bpf_object(bpf_object)
            .bpf_pin_dir((!args.no_pinned_maps).then(|| args.bpf_pin_dir.clone()))
            .env(move |k| match k {
                "NODE_NAME" => node_name.clone(),
                "KUBECONFIG" => kubeconfig
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned()),
                _ => std::env::var(k).ok(),
            }),
    );
    clock.lap("probe");
    let wanted = args.mode.wanted();
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
        on_failure: args.hook_failure.into(),
        host_root: args.host_root.clone(),
        host_namespaces_pid: args.host_namespaces_pid,
    };
    let events = k8s_events(&args, &mut kube, &metrics).await;
    let hooks_wanted = hook_settings.any();
    // Two agents on the node (a surge rollout's) share files beside the
    // socket: the lease, hook and Event claims, the gates' book. Only in a
    // directory nobody else can write to.
    let coordinated = if args.no_socket {
        false
    } else {
        match api::prepare_dir(&args) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "no coordination with another agent on this node ({e:#}): a rollout's \
                     second agent would take the socket at once and run the same hooks again"
                );
                false
            }
        }
    };
    // Hooks and Events run once between this agent and another on the
    // node, through claims.
    let claims = if coordinated {
        crate::handover::Claims::open(&args.socket)
            .map_err(|e| {
                tracing::warn!(
                    "hook claims unavailable ({e:#}): a second agent on this node (a rollout's) \
                     would run the same hooks again"
                );
            })
            .ok()
    } else {
        None
    };
    let hub = Hub::new(hub_config(&args), hub_metrics);
    let pinned = crate::pinned::start(
        (!args.no_pinned_maps).then_some(args.bpf_pin_dir.as_path()),
        args.bpf_map_max_entries,
        &args.host_root,
        pin_metrics,
    );
    let (stack, hooks_barrier) = sink_stack(
        stdout,
        &hub,
        (hook_settings, std::sync::Arc::clone(&metrics)),
        events,
        &side,
        claims.clone(),
        pinned.as_ref().map(|(p, _)| std::sync::Arc::clone(p)),
    );
    let hooks_in_flight = stack.inner().inner().in_flight();
    if coordinated {
        hub.keep_subscriptions(crate::handover::Book::new(&args.socket));
    }
    if let Some(c) = claims {
        // A container's claims stay while it lives: an agent that finds it
        // later (a rollout's start-up scan) must not run its hooks again.
        let hub = std::sync::Arc::downgrade(&hub);
        side.spawn(async move {
            loop {
                tokio::time::sleep(crate::handover::SWEEP_EVERY).await;
                let Some(hub) = hub.upgrade() else { return };
                let live: std::collections::HashSet<String> = hub
                    .known_ids()
                    .iter()
                    .map(|id| crate::handover::claim_prefix(id))
                    .collect();
                drop(hub);
                let swept = c.sweep(|prefix| live.contains(prefix));
                if swept > 0 {
                    tracing::debug!(swept, "claims of gone containers removed");
                }
            }
        });
    }
    let may_stand_by = matches!(control, Control::Signals);
    let api = api::Api::start(&args, &hub, &side, coordinated, may_stand_by);
    let mut barriers: Vec<std::sync::Arc<dyn lookout_model::StartBarrier>> =
        vec![std::sync::Arc::new(GateBarrier(std::sync::Arc::clone(
            &hub,
        )))];
    if hooks_wanted {
        barriers.push(std::sync::Arc::new(DenialsReported(
            hooks_barrier,
            std::sync::Arc::clone(&hub),
        )));
    }
    // A reader of stdout has the container's `added` line before it runs.
    barriers.push(std::sync::Arc::new(stdout_barrier));
    let barrier: std::sync::Arc<dyn StartBarrier> = std::sync::Arc::new(Barriers(barriers));
    // A start waits for prestart hooks, gates and stdout, each within its
    // own deadline.
    let start_cap = args
        .hook_timeout
        .max(args.gate_max_deadline)
        .max(args.event_deadline)
        + Duration::from_secs(1);

    clock.lap("setup");
    let nri = start_nri(&args).await?;
    clock.lap("nri");
    let nri_barrier = std::sync::Arc::clone(&barrier);
    let index = crate::merge::IndexSlot::default();
    let mut backends = if args.mode == ModeArg::Nri {
        let mut only = Backends::nri_only();
        only.fallback = modes::fallback_informer(&args, &report, &mut kube).await;
        only
    } else {
        Ladder {
            args: &args,
            report: &report,
            wanted,
            mode,
            refused,
            bpf_object,
            metrics: &metrics,
            barrier,
            start_cap,
            index: std::sync::Arc::clone(&index),
        }
        .start(&mut kube)
        .await?
    };
    backends.nri = nri;
    clock.lap("backend");
    let label = backends.label();
    if let Some(h) = backends.hook() {
        let t = h.startup_times();
        clock.split_last(&[("bpf", t.bpf), ("marks", t.marks)]);
        stack.inner().inner().close_in_hooks(h.group_fd());
        // A start may wait for prestart hooks and gates, then its state
        // read: past that (and a margin), the hook is stuck.
        let bound = start_cap + args.answer_deadline + HEALTH_MARGIN;
        let _ = shared.hook.set((h.health(), bound));
    }
    release_startup_memory(bpf_object);
    metrics.set_mode(&label);
    // Only a hook with BPF argv capture, or NRI, holds a created
    // container's start.
    hub.set_can_hold(backends.hook().is_some_and(RuntimeHook::has_bpf) || backends.nri.is_some());
    let mut body = format!("mode {label}\n");
    for r in &backends.refused {
        body.push_str(&format!("refused {r}\n"));
    }
    if backends.refused.is_empty() {
        tracing::info!("discovery mode {label}");
    } else {
        let refused = backends.refused.join(" | ");
        tracing::info!("discovery mode {label} (refused: {refused})");
    }
    let ready = || {
        // The maps' reconciliation: after the first scan has written what
        // runs.
        if let Some((_, sweep)) = pinned {
            crate::pinned::spawn_sweep(sweep, &side);
        }
        set_ready(&shared, body);
        control.ready(&hub);
        api.ready();
    };
    // NOT_SERVING from the moment the shutdown begins.
    let stopped = control.stopped();
    let stopped = async {
        stopped.await;
        api.stopping();
        // Discovery, and its holds, go on until a successor serves.
        api.hand_over(&hub).await;
    };
    let runner = Runner {
        args: &args,
        side: &side,
        metrics: &metrics,
        nri_barrier,
        clock,
        index,
    };
    runner.run(backends, stack, ready, stopped).await;
    // Hooks this agent claimed finish before it exits (one cut short
    // would run again, by the other agent), and so do the starts it
    // holds: one a successor let go while standing by is this agent's to
    // decide, by its gates, not by the exit's blanket allow.
    let until = std::time::Instant::now() + args.gate_max_deadline;
    while hub.starts_waiting() > 0 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Decided: the gate subscribers may go to the successor (the one that
    // parked their gates holds its starts for them meanwhile).
    hub.end_gates();
    let until = std::time::Instant::now() + args.hook_timeout;
    while hooks_in_flight.load(std::sync::atomic::Ordering::Acquire) > 0
        && std::time::Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    api.hand_over(&hub).await;
    Ok(())
}

/// What runs discovery's backends: the flags, the side runtime, the
/// metrics, NRI's start barrier and the informer's index slot.
struct Runner<'a> {
    args: &'a RunArgs,
    side: &'a tokio::runtime::Handle,
    metrics: &'a std::sync::Arc<crate::metrics::Metrics>,
    /// What a container's start waits for in NRI.
    nri_barrier: std::sync::Arc<dyn StartBarrier>,
    /// Start-up so far, logged on `ready`.
    clock: StartupClock,
    /// Where the informer's index goes for the hook (see the Ladder).
    index: crate::merge::IndexSlot,
}

/// The sinks under the merger, outermost first: the pinned container maps
/// (written before the hub, and so before any consumer or start, sees a
/// container), the consumer hub (watchers and gates), the hooks and
/// Kubernetes Events, stdout.
type Stack = PinSink<HubSink<HookSink<StdoutSink>>>;

/// The sink every backend writes to: the merger (one stream from several
/// backends, with Docker's and the Pod informer's identity) on [`Stack`].
type Out = merge::MergeSink<Stack>;

/// Builds [`Stack`] on `stdout`, and the hooks' start barrier (a start
/// waits for its prestart hooks).
fn sink_stack(
    stdout: StdoutSink,
    hub: &std::sync::Arc<Hub>,
    (hooks, metrics): (HookSettings, std::sync::Arc<crate::metrics::Metrics>),
    events: Option<Events>,
    side: &tokio::runtime::Handle,
    claims: Option<crate::handover::Claims>,
    pinned: Option<std::sync::Arc<std::sync::Mutex<Pinned>>>,
) -> (Stack, crate::hooks::Barrier) {
    let (hooks, barrier) =
        HookSink::new(stdout, hooks, events, side.clone(), claims, Some(metrics));
    let hub = HubSink::new(std::sync::Arc::clone(hub), hooks);
    (PinSink::new(hub, pinned), barrier)
}

/// How long the start-up waits for NRI's Synchronize before the hook's
/// scan of the state directories (which would report CRI containers with
/// less of their identity).
const NRI_SYNC_WAIT: Duration = Duration::from_secs(5);

impl Runner<'_> {
    /// Runs discovery with `backends`, writing through the merger to
    /// `stack`, until `stopped`; `ready` once it runs.
    async fn run(
        self,
        backends: Backends,
        stack: Stack,
        ready: impl FnOnce(),
        stopped: impl std::future::Future<Output = ()>,
    ) {
        let Runner {
            args,
            side,
            metrics,
            nri_barrier,
            mut clock,
            index,
        } = self;
        let label = backends.label();
        let Backends {
            primary,
            fallback,
            nri,
            ..
        } = backends;

        let mut sink = Out::new(stack, std::sync::Arc::clone(metrics), fallback.is_some());
        if !args.no_docker {
            let sockets = args
                .docker_sockets
                .iter()
                .map(|s| host_path(&args.host_root, s))
                .collect();
            sink.set_docker(crate::docker::Enricher::start(
                sockets,
                args.docker_timeout,
                side,
                sink.clone(),
                std::sync::Arc::clone(metrics),
            ));
        }
        let informer = match &primary {
            Primary::Informer(i) => Some(i),
            _ => None,
        };
        if let Some(i) = fallback.as_ref().or(informer) {
            sink.set_index(i.index(), &index);
            if fallback.is_some() {
                tracing::info!("fallback Pod informer runs beside {label}");
            }
        }
        // NRI first: its Synchronize reports the CRI containers that run
        // (source nri-sync, with their pods' identity) before the hook's
        // scan would.
        let nri = nri.map(|(plugin, events)| {
            let (synced_tx, synced) = tokio::sync::oneshot::channel();
            let stats = plugin.stats();
            let plugin = tokio::spawn(plugin.run());
            let (out, barrier, metrics) = (
                sink.clone(),
                std::sync::Arc::clone(&nri_barrier),
                std::sync::Arc::clone(metrics),
            );
            let report = tokio::spawn(async move {
                crate::nri::report(events, out, barrier, metrics, stats, synced_tx).await;
            });
            (plugin, report, synced)
        });
        let nri = match nri {
            Some((plugin, report, synced)) => {
                if tokio::time::timeout(NRI_SYNC_WAIT, synced).await.is_err() {
                    tracing::warn!(
                        "NRI: no Synchronize within {NRI_SYNC_WAIT:?}; going on without it"
                    );
                }
                Some((plugin, report))
            }
            None => None,
        };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let spawn_informer = |i: lookout_informer::Informer, sink: Out| {
            let mut stop = stop_rx.clone();
            side.spawn(async move {
                let mut sink = sink;
                i.run(&mut sink, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            })
        };
        clock.lap("discovery");
        // Ready, and how long it took to be, once per mode below.
        let ready = move |clock: &StartupClock| {
            ready();
            clock.log();
        };
        match primary {
            Primary::Hook { mut hook, .. } => {
                hook.scan(&mut sink);
                clock.lap("scan");
                // After the state scan: what it found is not the informer's.
                let side = fallback.map(|i| spawn_informer(i, sink.clone()));
                ready(&clock);
                tracing::info!(
                    tracked = hook.tracked().count(),
                    bpf = hook.has_bpf(),
                    "ready"
                );
                let stats = run_hook_task(*hook, sink, stopped).await;
                tracing::info!(?stats, "runtime hook stopped; marks removed");
                stop_informer(&stop_tx, side).await;
            }
            Primary::Informer(informer) => {
                let task = spawn_informer(informer, sink.clone());
                ready(&clock);
                tracing::info!("ready");
                stopped.await;
                stop_informer(&stop_tx, Some(task)).await;
            }
            Primary::NriOnly => {
                let side = fallback.map(|i| spawn_informer(i, sink.clone()));
                ready(&clock);
                tracing::info!("ready");
                stopped.await;
                stop_informer(&stop_tx, side).await;
            }
            Primary::Scan => {
                let side = fallback.map(|i| spawn_informer(i, sink.clone()));
                ready(&clock);
                tracing::info!("ready");
                let mut scanner = Scanner::new(args.host_root.clone(), args.scan_interval);
                for (runtime, root) in &args.state_roots {
                    scanner = scanner.state_root(runtime.clone(), root.clone());
                }
                scanner.run(&mut sink, stopped).await;
                stop_informer(&stop_tx, side).await;
            }
        }
        if let Some((plugin, report)) = nri {
            // Dropping the event queue ends the plugin: the runtime then
            // goes on without it.
            report.abort();
            let _ = report.await;
            let _ = tokio::time::timeout(Duration::from_secs(2), plugin).await;
        }
    }
}

/// Runs the runtime hook's loop as a task of this (current-thread) runtime
/// until `stopped`, and returns its statistics.
///
/// N.B. A task, not part of the `block_on` future that awaits it: a
/// container's exit wakes its watch's task from this thread's I/O driver,
/// and that task wakes the hook's loop. Waking a task of a current-thread
/// runtime from its own thread only queues it; waking the `block_on`
/// future writes the runtime's eventfd and costs another turn through
/// `epoll_wait` before the loop runs (see docs/benchmarks.md, nineteenth
/// pass).
async fn run_hook_task(
    hook: RuntimeHook,
    mut sink: Out,
    stopped: impl std::future::Future<Output = ()>,
) -> lookout_runtime_hook::Stats {
    let (stop, on_stop) = tokio::sync::oneshot::channel::<()>();
    let mut task = tokio::spawn(async move {
        hook.run(&mut sink, async {
            // Sent, or dropped with this future: both end the loop.
            let _ = on_stop.await;
        })
        .await
    });
    let joined = tokio::select! {
        r = &mut task => r,
        () = stopped => {
            let _ = stop.send(());
            task.await
        }
    };
    match joined {
        Ok(stats) => stats,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => {
                tracing::error!(error = %e, "the runtime hook's task was cancelled");
                lookout_runtime_hook::Stats::default()
            }
        },
    }
}

/// The Kubernetes Events of `--k8s-events`, when a cluster and the node's
/// name are known.
async fn k8s_events(
    args: &RunArgs,
    kube: &mut Kube,
    metrics: &crate::metrics::Metrics,
) -> Option<Events> {
    if !args.k8s_events {
        return None;
    }
    {
        match (kube.client(args).await, &args.node_name) {
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
    }
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

/// A host path as this agent reaches it: under the host root, its links
/// followed there (as is, when it cannot be resolved yet: dockerd may not
/// have made its socket).
fn host_path(host_root: &std::path::Path, path: &std::path::Path) -> std::path::PathBuf {
    lookout_host::resolve_in_root(host_root, path)
        .unwrap_or_else(|_| host_root.join(path.strip_prefix("/").unwrap_or(path)))
}

fn set_ready(shared: &crate::endpoints::Endpoints, body: String) {
    if let Ok(mut r) = shared.ready.write() {
        *r = Some(body);
    }
}
