//! Discovery through NRI: the runtime (containerd 1.7+, CRI-O 1.30+)
//! calls lookout's plugin for every pod and container of the CRI.
//!
//! - StartContainer (held by the plugin, within its budget under the
//!   runtime's 2 s request timeout): the container is reported `added`
//!   (status `created`: its task exists, its process has not started),
//!   then its start waits for the same barrier the runtime hook uses
//!   (prestart hooks, consumer gates) until the plugin's deadline. Past it
//!   the start goes on (fail open) and is counted.
//! - RunPodSandbox: the pod's sandbox is reported, marked `pod_sandbox`,
//!   with the pod's identity.
//! - Stop/Remove of a container or pod: `removed` (NRI v0.6.1 carries no
//!   exit code).
//! - Synchronize (registration, and again after every reconnect): what
//!   runs and was not reported is reported with source `nri-sync`; what
//!   is gone is removed. Beside the runtime hook, the merger reports each
//!   container once, whoever comes first.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lookout_model::{Container, ContainerEvent, Kubernetes, RuntimeKind, Sink, Source, Status};
use lookout_model::{StartBarrier, StartDecision};
use lookout_nri::{ContainerPhase, Delivery, Event, Events, PodPhase};

/// Time kept back from the plugin's deadline for answering.
const ANSWER_MARGIN: Duration = Duration::from_millis(50);

/// Time before the answer by which the barrier is asked to decide, so
/// that a gate's policy (fail-closed: deny), not the plugin's timeout,
/// settles a start whose subscriber did not answer.
const DECIDE_MARGIN: Duration = Duration::from_millis(20);

/// Reads the plugin's events until it stops, reporting into `sink`.
/// `barrier`: what a container's start waits for; `stats`: the plugin's
/// counters (its dropped events become a metric).
pub(crate) async fn report<S: Sink + Send>(
    mut events: Events,
    mut sink: S,
    barrier: Arc<dyn StartBarrier>,
    metrics: Arc<crate::metrics::Metrics>,
    stats: Arc<lookout_nri::Stats>,
    synced: tokio::sync::oneshot::Sender<()>,
) {
    let mut synced = Some(synced);
    // The plugin's dropped events counted so far: each drop ends its
    // connection, and the Synchronize that follows reports what it carried.
    let mut dropped = 0;
    let mut count_dropped = |metrics: &crate::metrics::Metrics| {
        let now = stats.dropped();
        metrics.nri_dropped(now.saturating_sub(dropped));
        dropped = dropped.max(now);
    };
    // The runtime's name until Synchronize says (`containerd`, `cri-o`):
    // the kind of a container whose pod names no runtime handler.
    let mut runtime = RuntimeKind::Other("cri".into());
    while let Some(Delivery { event, ack, .. }) = events.recv().await {
        match event {
            Event::Synchronized(snap) => {
                count_dropped(&metrics);
                if !snap.runtime.name.is_empty() {
                    runtime = RuntimeKind::from_binary_name(&snap.runtime.name);
                }
                tracing::info!(
                    runtime = %snap.runtime.name,
                    version = %snap.runtime.version,
                    pods = snap.pods.len(),
                    containers = snap.containers.len(),
                    resync = snap.resync,
                    "NRI: synchronized"
                );
                let pods: BTreeMap<&str, &lookout_nri::Pod> =
                    snap.pods.iter().map(|p| (p.id.as_str(), p)).collect();
                for id in &snap.new_pods {
                    if let Some(p) = pods.get(id.as_str()) {
                        sink.emit(ContainerEvent::added(
                            Source::NriSync,
                            sandbox_of(p, &runtime, Status::Running),
                        ));
                    }
                }
                for id in &snap.new_containers {
                    if let Some(c) = snap.containers.iter().find(|c| &c.id == id) {
                        let pod = pods.get(c.pod_sandbox_id.as_str()).copied();
                        sink.emit(ContainerEvent::added(
                            Source::NriSync,
                            container_of(c, pod, &runtime, status_of(c)),
                        ));
                    }
                }
                for c in &snap.gone_containers {
                    let pod = pods.get(c.pod_sandbox_id.as_str()).copied();
                    let gone = container_of(c, pod, &runtime, Status::Stopped);
                    sink.emit(ContainerEvent::removed(Source::NriSync, gone, None));
                }
                for p in &snap.gone_pods {
                    let gone = sandbox_of(p, &runtime, Status::Stopped);
                    sink.emit(ContainerEvent::removed(Source::NriSync, gone, None));
                }
                if let Some(tx) = synced.take() {
                    let _ = tx.send(());
                }
            }
            Event::Pod { phase, pod } => match phase {
                PodPhase::Run => sink.emit(ContainerEvent::added(
                    Source::Nri,
                    sandbox_of(&pod, &runtime, Status::Running),
                )),
                PodPhase::Stop | PodPhase::Remove => sink.emit(ContainerEvent::removed(
                    Source::Nri,
                    sandbox_of(&pod, &runtime, Status::Stopped),
                    None,
                )),
                _ => {}
            },
            Event::Container {
                phase,
                pod,
                container,
            } => match phase {
                ContainerPhase::Start => {
                    let c = container_of(&container, pod.as_ref(), &runtime, Status::Created);
                    let (id, pid) = (c.id.clone(), c.pid);
                    // The init's pidfd now, while the pid is surely its
                    // (it waits for its start): a deny kills this process,
                    // never one that reused the pid meanwhile.
                    let init = pid.map(|pid| (pid, lookout_runtime_hook::ProcessHandle::open(pid)));
                    sink.emit(ContainerEvent::added(Source::Nri, c));
                    let until = ack
                        .deadline()
                        .checked_sub(ANSWER_MARGIN + DECIDE_MARGIN)
                        .unwrap_or_else(Instant::now);
                    if let Some(wait) = barrier.wait_until(&id, until) {
                        // The start is held on a task of its own, with its
                        // ack: a container whose hooks or gates take their
                        // time holds up neither the events after it nor the
                        // other containers' starts.
                        let metrics = Arc::clone(&metrics);
                        tokio::spawn(async move {
                            hold(&id, init, wait, &ack, &metrics).await;
                            ack.release();
                        });
                        continue;
                    }
                }
                // The runtime started it: what runs after a start
                // (poststart hooks) goes now, off this task.
                ContainerPhase::PostStart => barrier.started(&container.id),
                ContainerPhase::Stop | ContainerPhase::Remove => {
                    let c = container_of(&container, pod.as_ref(), &runtime, Status::Stopped);
                    sink.emit(ContainerEvent::removed(Source::Nri, c, None));
                }
                _ => {}
            },
            Event::Disconnected(e) => {
                metrics.nri_disconnect();
                count_dropped(&metrics);
                tracing::warn!(
                    error = %lookout_model::Chain(e.as_ref()),
                    "NRI: the runtime closed the connection; reconnecting"
                );
            }
            Event::Shutdown => tracing::info!("NRI: the runtime is shutting down"),
            _ => {}
        }
        ack.release();
    }
}

/// Holds a container's start (its `ack`) until its barrier decides or the
/// plugin's deadline, less the time kept for answering.
async fn hold(
    id: &str,
    init: Option<(u32, std::io::Result<lookout_runtime_hook::ProcessHandle>)>,
    wait: lookout_model::StartWait,
    ack: &lookout_nri::Ack,
    metrics: &crate::metrics::Metrics,
) {
    let left = ack
        .deadline()
        .saturating_duration_since(Instant::now())
        .saturating_sub(ANSWER_MARGIN);
    match tokio::time::timeout(left, wait).await {
        Ok(StartDecision::Deny(reason)) => deny(id, init, &reason),
        Ok(_) => {}
        Err(_) => {
            metrics.nri_late();
            tracing::warn!(
                id,
                ?left,
                "NRI: the start did not wait longer for its barrier \
                 (the runtime's request timeout)"
            );
        }
    }
}

/// A denied start: NRI v0.6.1 cannot refuse one, so the container's init,
/// created and waiting for its start, is killed (through the pidfd opened
/// when the start was reported).
fn deny(
    id: &str,
    init: Option<(u32, std::io::Result<lookout_runtime_hook::ProcessHandle>)>,
    reason: &str,
) {
    tracing::info!(
        id,
        reason,
        "start denied (NRI): killing the container's init"
    );
    match init {
        Some((pid, Ok(init))) => {
            if let Err(e) = init.kill() {
                tracing::warn!(id, pid, error = %e, "could not kill a denied container's init");
            }
        }
        Some((pid, Err(e))) => {
            tracing::warn!(id, pid, error = %e, "a denied container's init was gone when reported");
        }
        None => tracing::warn!(id, "a denied container has no pid to kill"),
    }
}

fn status_of(c: &lookout_nri::Container) -> Status {
    match c.state {
        lookout_nri::ContainerState::Created => Status::Created,
        lookout_nri::ContainerState::Stopped => Status::Stopped,
        _ => Status::Running,
    }
}

/// The model's container for an NRI container (and its pod).
fn container_of(
    n: &lookout_nri::Container,
    pod: Option<&lookout_nri::Pod>,
    runtime: &RuntimeKind,
    status: Status,
) -> Container {
    let mut c = Container::new(n.id.clone(), kind(pod, runtime));
    c.status = status;
    c.annotations = n.annotations.clone();
    c.args = n.args.clone();
    let mut k = Kubernetes::from_annotations(&n.annotations).unwrap_or_default();
    if let Some(p) = pod {
        fill_pod(&mut k, p);
    }
    if k.container.is_none() && !n.name.is_empty() {
        k.container = Some(n.name.clone());
    }
    c.kubernetes = Some(k);
    c.pod_sandbox = lookout_model::is_pod_sandbox(&n.annotations);
    if c.pod_sandbox {
        c.kind = Some(lookout_model::ContainerKind::Sandbox);
    }
    if c.runtime == RuntimeKind::Runsc {
        c.sandbox = Some("gvisor".into());
    }
    if let Some(pid) = n.pid.filter(|p| *p > 0) {
        set_pid(&mut c, pid);
    }
    c
}

/// A pod's sandbox, as a container marked `pod_sandbox`.
fn sandbox_of(p: &lookout_nri::Pod, runtime: &RuntimeKind, status: Status) -> Container {
    let mut c = Container::new(p.id.clone(), kind(Some(p), runtime));
    c.status = status;
    c.annotations = p.annotations.clone();
    c.pod_sandbox = true;
    c.kind = Some(lookout_model::ContainerKind::Sandbox);
    let mut k = Kubernetes::default();
    fill_pod(&mut k, p);
    k.container = None;
    c.kubernetes = Some(k);
    if c.runtime == RuntimeKind::Runsc {
        c.sandbox = Some("gvisor".into());
    }
    if let Some(pid) = p.pid.filter(|p| *p > 0) {
        set_pid(&mut c, pid);
    }
    c
}

/// The OCI runtime of a pod's containers: its runtime handler (`runc`,
/// `runsc`, ...), or the CRI runtime's name for the default handler.
fn kind(pod: Option<&lookout_nri::Pod>, runtime: &RuntimeKind) -> RuntimeKind {
    match pod.map(|p| p.runtime_handler.as_str()) {
        Some("") | None => runtime.clone(),
        Some("gvisor") => RuntimeKind::Runsc,
        Some(handler) => RuntimeKind::from_binary_name(handler),
    }
}

fn fill_pod(k: &mut Kubernetes, p: &lookout_nri::Pod) {
    let set = |v: &str| (!v.is_empty()).then(|| v.to_owned());
    k.namespace = set(&p.namespace).or(k.namespace.take());
    k.pod = set(&p.name).or(k.pod.take());
    k.pod_uid = set(&p.uid).or(k.pod_uid.take());
    k.labels = p.labels.clone();
}

/// The pid NRI names, in the runtime's pid namespace (the host's, for a
/// node agent), with what /proc tells about it.
fn set_pid(c: &mut Container, pid: u32) {
    c.pid = Some(pid);
    lookout_host::kernel::fill(c, pid, None);
}
