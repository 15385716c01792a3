//! Choosing the discovery mode: the probe's verdict, an explicit `--mode`,
//! and the ladder `fanotify-ebpf` > `fanotify` > `podinformer` > `scan`
//! that steps down when a mode fails to start (a race with the probe, a
//! kernel surprise) instead of exiting. Also the one Kubernetes client
//! the modes and Events share.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use lookout_model::StartBarrier;
use lookout_probe::{Mode, ProbeReport};
use lookout_runtime_hook::RuntimeHook;

use super::args::RunArgs;
use crate::metrics::Metrics;

/// The backend that discovers containers: what actually runs.
pub(super) enum Primary {
    /// `fanotify-ebpf` or `fanotify`: the runtime hook (boxed: it is
    /// large, and moved once).
    Hook { mode: Mode, hook: Box<RuntimeHook> },
    /// `podinformer`: the Pod informer.
    Informer(lookout_informer::Informer),
    /// `scan`: the runtimes' state directories, read every
    /// `--scan-interval`.
    Scan,
    /// `--mode nri`: nothing but the NRI plugin.
    NriOnly,
}

/// What discovery runs with.
pub(super) struct Backends {
    pub primary: Primary,
    /// The modes above the one that runs that were refused, and why.
    pub refused: Vec<String>,
    /// The fallback Pod informer beside a mode other than `podinformer`.
    pub fallback: Option<lookout_informer::Informer>,
    /// The NRI plugin, beside the mode or (`--mode nri`) alone.
    pub nri: Option<(lookout_nri::Plugin, lookout_nri::Events)>,
}

impl Backends {
    /// `--mode nri`: only the plugin, started by the caller.
    pub fn nri_only() -> Backends {
        Backends {
            primary: Primary::NriOnly,
            refused: Vec::new(),
            fallback: None,
            nri: None,
        }
    }

    /// The mode as `/readyz` and `lookout_mode_info` name it:
    /// `fanotify-ebpf`, `fanotify-ebpf+nri`, `nri`, ...
    pub fn label(&self) -> String {
        let mode = match &self.primary {
            Primary::Hook { mode, .. } => *mode,
            Primary::Informer(_) => Mode::PodInformer,
            Primary::Scan => Mode::Scan,
            Primary::NriOnly => return "nri".to_owned(),
        };
        match self.nri {
            Some(_) => format!("{mode}+nri"),
            None => mode.to_string(),
        }
    }

    /// The runtime hook, in the fanotify modes.
    pub fn hook(&self) -> Option<&RuntimeHook> {
        match &self.primary {
            Primary::Hook { hook, .. } => Some(hook),
            _ => None,
        }
    }
}

/// lookout's NRI plugin name and index (`10-lookout` in the runtime's
/// logs): a low index, so that lookout sees a container before plugins
/// that adjust it.
const NRI_NAME: &str = "lookout";
const NRI_INDEX: &str = "10";

/// The NRI plugin, when `--nri` (or `--mode nri`) asks for it and the
/// runtime's socket accepts a registration.
pub(super) async fn start_nri(
    args: &RunArgs,
) -> anyhow::Result<Option<(lookout_nri::Plugin, lookout_nri::Events)>> {
    use super::args::{ModeArg, NriArg};
    let required = args.mode == ModeArg::Nri || args.nri == NriArg::On;
    if !required && args.nri == NriArg::Off {
        return Ok(None);
    }
    // The socket path is resolved inside the host root (`/var/run` is a
    // symlink to `/run` on the host); a rootful agent accepts only a
    // socket root made.
    let mut builder = lookout_nri::Plugin::builder()
        .socket(&args.nri_socket)
        .host_root(&args.host_root)
        .name(NRI_NAME)
        .index(NRI_INDEX)
        .budget(args.nri_budget);
    if nix::unistd::geteuid().is_root() {
        builder = builder.socket_owner(0);
    }
    let socket = lookout_host::host_path(&args.host_root, &args.nri_socket);
    match builder.clone().probe(Duration::from_secs(5)).await {
        Ok(runtime) => tracing::info!(
            socket = %socket.display(),
            runtime = %runtime.name,
            version = %runtime.version,
            "NRI: the runtime accepts lookout's plugin"
        ),
        Err(e) if e.is_absent() && !required => {
            tracing::info!(socket = %socket.display(), "NRI: no socket; not used");
            return Ok(None);
        }
        Err(e) if required => bail!(
            "NRI at {} does not accept lookout's plugin: {}",
            socket.display(),
            lookout_model::Chain(&e)
        ),
        Err(e) => {
            tracing::warn!(
                socket = %socket.display(),
                error = %lookout_model::Chain(&e),
                "NRI: the runtime does not accept lookout's plugin; not used"
            );
            return Ok(None);
        }
    }
    let plugin = builder.build().context("setting up the NRI plugin")?;
    Ok(Some(plugin))
}

/// Starts the first mode of the ladder, from `mode` down, that starts.
pub(super) struct Ladder<'a> {
    pub args: &'a RunArgs,
    pub report: &'a ProbeReport,
    /// An explicit `--mode`: it must start, or `run` fails.
    pub wanted: Option<Mode>,
    /// Where to start on the ladder.
    pub mode: Mode,
    /// Refusals so far (from the probe).
    pub refused: Vec<String>,
    pub bpf_object: Option<&'static [u8]>,
    pub metrics: &'a Arc<Metrics>,
    /// What a container's start waits for, and for how long at most.
    pub barrier: Arc<dyn StartBarrier>,
    pub start_cap: Duration,
    /// The Pod informer's index once one runs: the hook fills in each
    /// container's Kubernetes identity before it tracks and reports it.
    pub index: crate::merge::IndexSlot,
}

impl Ladder<'_> {
    /// Starts the chosen mode and, beside a mode other than
    /// `podinformer`, the fallback informer when a cluster is configured
    /// (or `--fallback-informer`).
    pub async fn start(self, kube: &mut Kube) -> anyhow::Result<Backends> {
        let Ladder {
            args,
            report,
            wanted,
            mode,
            mut refused,
            bpf_object,
            metrics,
            barrier,
            start_cap,
            index,
        } = self;
        let mut hook = None;
        let mut informer = None;
        for m in Mode::LADDER.into_iter().filter(|m| *m >= mode) {
            match m {
                Mode::FanotifyEbpf | Mode::Fanotify => {
                    if wanted.is_none() && report.requirements(m).is_err() {
                        continue;
                    }
                    let (interval, find) = rescan(args);
                    let mut builder = RuntimeHook::builder()
                        .host_root(args.host_root.clone())
                        .binaries(report.runtimes.iter().map(|r| r.resolved.clone()))
                        .rescan(interval, find)
                        .observer(Arc::clone(metrics) as _)
                        .start_barrier(Arc::clone(&barrier), start_cap)
                        .answer_deadline(args.answer_deadline)
                        .scheduler_slice(args.scheduler_slice.0)
                        .enrich({
                            let index = Arc::clone(&index);
                            move |c| crate::merge::enrich_from(&index, c)
                        });
                    for (runtime, root) in &args.state_roots {
                        builder = builder.state_root(runtime.clone(), root.clone());
                    }
                    if m == Mode::FanotifyEbpf
                        && let Some(object) = bpf_object
                    {
                        builder = builder.bpf_object(object.to_vec());
                    }
                    match builder.build() {
                        Ok(h) => {
                            hook = Some((m, h));
                            break;
                        }
                        Err(e) if wanted.is_some() => {
                            bail!("--mode {m} cannot start: {}", lookout_model::Chain(&e))
                        }
                        Err(e) => refused.push(format!(
                            "{m}: starting it failed: {}",
                            lookout_model::Chain(&e)
                        )),
                    }
                }
                Mode::PodInformer => {
                    if wanted.is_none() && report.requirements(m).is_err() {
                        continue;
                    }
                    match start_informer(args, kube).await {
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
        let primary = match (hook, informer) {
            (Some((mode, hook)), _) => Primary::Hook {
                mode,
                hook: Box::new(hook),
            },
            (None, Some(i)) => Primary::Informer(i),
            (None, None) => Primary::Scan,
        };
        let fallback = if matches!(primary, Primary::Informer(_)) {
            None
        } else {
            fallback_informer(args, report, kube).await
        };
        Ok(Backends {
            primary,
            refused,
            fallback,
            nri: None,
        })
    }
}

/// The Pod informer beside a mode other than `podinformer`, `--mode nri`
/// included: on by default when a cluster is configured. Its index gives
/// every backend's containers what only the API server knows (the pod's
/// labels, workload, the containers' kinds and image digests).
pub(super) async fn fallback_informer(
    args: &RunArgs,
    report: &ProbeReport,
    kube: &mut Kube,
) -> Option<lookout_informer::Informer> {
    match (
        args.fallback_informer,
        report.requirements(Mode::PodInformer),
    ) {
        (Some(false), _) | (None, Err(_)) => None,
        (Some(true), Err(why)) => {
            tracing::warn!("--fallback-informer: no cluster to watch: {why}");
            None
        }
        (_, Ok(())) => match start_informer(args, kube).await {
            Ok(i) => Some(i),
            Err(e) => {
                tracing::warn!("fallback informer not started: {e:#}");
                None
            }
        },
    }
}

/// The mode to start with, and the refusals to log. An explicit mode that
/// cannot run is an error naming every reason.
pub(super) fn choose(
    report: &ProbeReport,
    wanted: Option<Mode>,
) -> anyhow::Result<(Mode, Vec<String>)> {
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

/// Stops an informer task, waiting for it at most 5 s.
pub(super) async fn stop_informer(
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
pub(super) struct Kube {
    /// Where the client (and its connection workers) live.
    pub(super) side: tokio::runtime::Handle,
    pub(super) result: Option<Result<kube::Client, String>>,
}

impl Kube {
    /// Builds the client and checks that the API server answers
    /// (`GET /version`, 10 s): a mode that cannot reach its cluster is
    /// refused at start-up, with the reason, instead of running blind.
    pub(super) async fn client(&mut self, args: &RunArgs) -> anyhow::Result<kube::Client> {
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
pub(super) const HEALTH_MARGIN: Duration = Duration::from_secs(5);
