//! Docker enrichment: a container whose runtime root is Docker's
//! (`<exec-root>/runtime-runc/moby`) is looked up in dockerd, and what
//! dockerd knows of it (name, image, labels; on cri-dockerd nodes, the
//! pod's identity in `io.kubernetes.*` labels) follows its `added` as an
//! `updated` event.
//!
//! Never on the path that answers permission events, and never before
//! `added`: a backend's `emit` only queues the lookup (a `try_send`), and
//! the lookups run on the side runtime's blocking threads, a few at a time,
//! each within `--docker-timeout`. dockerd answers its container list at
//! once even while it starts the container (its inspect would wait for
//! the start, which a gate may be holding), so the update usually comes
//! before the start. A stopped or hung dockerd costs each lookup its
//! deadline once, then lookups are skipped for [`BACK_OFF`]; a warning
//! says so once per outage, and containers are still reported.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lookout_model::{Container, ContainerEvent, Kubernetes, RuntimeKind, Sink, Source};
use tokio::sync::{Semaphore, mpsc};

use crate::metrics::Metrics;

/// Lookups waiting for a slot; more are dropped (and counted).
const QUEUE: usize = 1024;

/// Lookups at once.
const SLOTS: usize = 4;

/// How long lookups are skipped after dockerd did not answer.
pub const BACK_OFF: Duration = Duration::from_secs(5);

/// The largest dockerd answer read (a list entry is 1-10 KiB).
const MAX_BODY: usize = 1 << 20;

/// Queues Docker lookups for the containers that need them.
#[derive(Clone)]
pub struct Enricher {
    tx: mpsc::Sender<(String, RuntimeKind)>,
    metrics: Arc<Metrics>,
}

/// Whether `c` is one dockerd may know: a runtime root of Docker's and a
/// Docker id.
pub fn wants(c: &Container) -> bool {
    c.runtime_root
        .as_deref()
        .is_some_and(lookout_docker::is_docker_root)
        && lookout_docker::is_container_id(&c.id)
}

impl Enricher {
    /// Starts the lookups on `side`, for dockerds at `sockets` (host
    /// paths already resolved under the host root), writing each
    /// `updated` to `out`.
    pub fn start<S>(
        sockets: Vec<PathBuf>,
        timeout: Duration,
        side: &tokio::runtime::Handle,
        out: S,
        metrics: Arc<Metrics>,
    ) -> Enricher
    where
        S: Sink + Clone + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(QUEUE);
        let daemons: Vec<Daemon> = sockets
            .into_iter()
            .map(|s| Daemon {
                client: lookout_docker::Client::new(s)
                    .timeout(timeout)
                    .max_body(MAX_BODY)
                    .owner(0),
                down: Mutex::new(None),
            })
            .collect();
        side.spawn(work(rx, Arc::new(daemons), out, Arc::clone(&metrics)));
        Enricher { tx, metrics }
    }

    /// Queues a lookup of `c` if it is Docker's. Never waits.
    pub fn request(&self, c: &Container) {
        if !wants(c) {
            return;
        }
        if self.tx.try_send((c.id.clone(), c.runtime.clone())).is_err() {
            self.metrics.docker_lookup("dropped");
            tracing::debug!(id = c.id, "Docker lookup queue full; reported without it");
        }
    }
}

/// One dockerd, and since when (and why) it has not answered.
struct Daemon {
    client: lookout_docker::Client,
    down: Mutex<Option<(Instant, String)>>,
}

impl Daemon {
    /// Skipped: it failed less than [`BACK_OFF`] ago.
    fn resting(&self) -> bool {
        self.down
            .lock()
            .ok()
            .and_then(|d| d.as_ref().map(|(at, _)| at.elapsed() < BACK_OFF))
            .unwrap_or(false)
    }

    fn failed(&self, e: &lookout_docker::Error) {
        let Ok(mut d) = self.down.lock() else { return };
        if d.is_none() {
            tracing::warn!(
                socket = %self.client.socket().display(),
                "Docker enrichment unavailable ({e}): Docker's containers are reported without \
                 their name, image and labels until dockerd answers (probe check docker:socket)"
            );
        }
        *d = Some((Instant::now(), e.to_string()));
    }

    fn answered(&self) {
        let Ok(mut d) = self.down.lock() else { return };
        if d.take().is_some() {
            tracing::info!(
                socket = %self.client.socket().display(),
                "dockerd answers again: Docker enrichment is back"
            );
        }
    }
}

/// What a lookup found.
enum Outcome {
    Found(lookout_docker::ContainerInfo),
    Unknown,
    Unavailable,
    Error,
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Outcome::Found(_) => "found",
            Outcome::Unknown => "unknown",
            Outcome::Unavailable => "unavailable",
            Outcome::Error => "error",
        }
    }
}

/// Asks each dockerd in turn until one knows `id`.
fn look_up(daemons: &[Daemon], id: &str) -> Outcome {
    let mut outcome = Outcome::Unknown;
    for d in daemons {
        if d.resting() {
            outcome = Outcome::Unavailable;
            continue;
        }
        match d.client.find(id) {
            Ok(Some(info)) => {
                d.answered();
                return Outcome::Found(info);
            }
            Ok(None) => d.answered(),
            Err(e) if e.is_unavailable() => {
                d.failed(&e);
                outcome = Outcome::Unavailable;
            }
            Err(e) => {
                tracing::warn!(
                    id,
                    socket = %d.client.socket().display(),
                    "Docker lookup: {e}"
                );
                outcome = Outcome::Error;
            }
        }
    }
    outcome
}

async fn work<S>(
    mut rx: mpsc::Receiver<(String, RuntimeKind)>,
    daemons: Arc<Vec<Daemon>>,
    out: S,
    metrics: Arc<Metrics>,
) where
    S: Sink + Clone + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(SLOTS));
    while let Some((id, runtime)) = rx.recv().await {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let (daemons, mut out, metrics) = (Arc::clone(&daemons), out.clone(), Arc::clone(&metrics));
        // The lookup (a blocking call to the daemon) and the emit (the
        // merger's and the hub's mutexes) on a blocking thread, never on
        // the side runtime's thread.
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            let outcome = look_up(&daemons, &id);
            metrics.docker_lookup(outcome.label());
            if let Outcome::Found(info) = outcome {
                out.emit(ContainerEvent::updated(
                    Source::Docker,
                    identity(id, runtime, info),
                ));
            }
        });
    }
}

/// What dockerd knows of container `id`, as a container with nothing
/// else: name, image, labels, and the pod's identity from cri-dockerd's
/// labels. The hub folds it into the live container, filling only what
/// that lacks.
///
/// Only the keys kubelet and cri-dockerd write themselves are read
/// (`io.kubernetes.pod.{name,namespace,uid}`, `io.kubernetes.container.name`,
/// `io.kubernetes.docker.type`): cri-dockerd copies a pod's own labels
/// into its sandbox's Docker labels, and those are the pod author's, so a
/// pod labelled `io.kubernetes.cri.sandbox-namespace: kube-system` must not
/// be taken for another pod. kubelet's and cri-dockerd's keys are written
/// after the pod's labels, over any of the same name.
pub fn identity(
    id: String,
    runtime: RuntimeKind,
    info: lookout_docker::ContainerInfo,
) -> Container {
    let mut c = Container::new(id, runtime);
    c.name = info.name;
    c.image = info.image;
    c.image_id = info.image_id;
    c.labels = bounded(info.labels);
    let label = |k: &str| c.labels.get(k).filter(|v| !v.is_empty()).cloned();
    let sandbox = label("io.kubernetes.docker.type").is_some_and(|t| t == "podsandbox");
    let mut k = Kubernetes::default();
    k.namespace = label("io.kubernetes.pod.namespace");
    k.pod = label("io.kubernetes.pod.name");
    k.pod_uid = label("io.kubernetes.pod.uid");
    k.container = label("io.kubernetes.container.name").filter(|_| !sandbox);
    if k != Kubernetes::default() {
        k.image = c.image.clone();
        c.kubernetes = Some(k);
        c.pod_sandbox = sandbox;
        if sandbox {
            c.kind = Some(lookout_model::ContainerKind::Sandbox);
        }
    }
    c
}

/// At most as many labels, as long, as the agent keeps of annotations.
fn bounded(labels: BTreeMap<String, String>) -> BTreeMap<String, String> {
    const MAX_LABELS: usize = 1024;
    const MAX_BYTES: usize = 256 << 10;
    let mut bytes = 0;
    labels
        .into_iter()
        .take(MAX_LABELS)
        .take_while(|(k, v)| {
            bytes += k.len() + v.len();
            bytes <= MAX_BYTES
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(labels: &[(&str, &str)]) -> lookout_docker::ContainerInfo {
        let mut i = lookout_docker::ContainerInfo::default();
        i.name = Some("k8s_nginx_web-0_default_u1_0".into());
        i.image = Some("nginx:1.27".into());
        i.labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        i
    }

    #[test]
    fn cri_dockerd_labels_give_the_pods_identity() {
        let c = identity(
            "a".repeat(64),
            RuntimeKind::Runc,
            info(&[
                ("io.kubernetes.pod.name", "web-0"),
                ("io.kubernetes.pod.namespace", "default"),
                ("io.kubernetes.pod.uid", "u1"),
                ("io.kubernetes.container.name", "nginx"),
                ("io.kubernetes.docker.type", "container"),
            ]),
        );
        let k = c.kubernetes.as_ref().expect("identity");
        assert_eq!(
            (
                k.namespace.as_deref(),
                k.pod.as_deref(),
                k.container.as_deref()
            ),
            (Some("default"), Some("web-0"), Some("nginx"))
        );
        assert_eq!(k.image.as_deref(), Some("nginx:1.27"));
        assert!(!c.pod_sandbox);

        let s = identity(
            "b".repeat(64),
            RuntimeKind::Runc,
            info(&[
                ("io.kubernetes.pod.name", "web-0"),
                ("io.kubernetes.pod.namespace", "default"),
                ("io.kubernetes.container.name", "POD"),
                ("io.kubernetes.docker.type", "podsandbox"),
            ]),
        );
        assert!(s.pod_sandbox);
        assert_eq!(
            s.kubernetes.as_ref().and_then(|k| k.container.clone()),
            None
        );
    }

    #[test]
    fn a_pods_own_labels_cannot_name_another_pod() {
        // cri-dockerd copies the pod's labels into its sandbox's: those
        // the pod's author chose are not read as its identity.
        let s = identity(
            "d".repeat(64),
            RuntimeKind::Runc,
            info(&[
                ("io.kubernetes.cri.sandbox-namespace", "kube-system"),
                ("io.kubernetes.cri.sandbox-name", "victim"),
                ("io.kubernetes.cri-o.ContainerType", "sandbox"),
                ("io.kubernetes.pod.name", "web-0"),
                ("io.kubernetes.pod.namespace", "shop"),
                ("io.kubernetes.docker.type", "container"),
            ]),
        );
        let k = s.kubernetes.expect("identity");
        assert_eq!(
            (k.namespace.as_deref(), k.pod.as_deref()),
            (Some("shop"), Some("web-0"))
        );
        assert!(!s.pod_sandbox);
    }

    #[test]
    fn plain_docker_labels_give_no_pod_and_only_dockers_roots_are_looked_up() {
        let mut c = identity("c".repeat(64), RuntimeKind::Runc, info(&[("app", "shop")]));
        assert_eq!((c.kubernetes.clone(), c.labels.len()), (None, 1));
        assert!(!wants(&c));
        c.runtime_root = Some("/run/docker/runtime-runc/moby".into());
        assert!(wants(&c));
        c.id = "web1".into();
        assert!(!wants(&c));
    }

    #[test]
    fn labels_are_bounded() {
        let many: BTreeMap<String, String> = (0..5000)
            .map(|i| (format!("k{i:05}"), "v".repeat(100)))
            .collect();
        let kept = bounded(many);
        assert!(kept.len() <= 1024);
        assert!(kept.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() <= 256 << 10);
    }
}
