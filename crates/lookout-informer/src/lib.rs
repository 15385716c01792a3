//! The Pod-informer backend: this node's containers, from the Kubernetes
//! API server.
//!
//! # Overview
//!
//! [`Informer`] watches the Pods whose `spec.nodeName` is this node (a
//! field selector, so the API server filters) with `kube::runtime::watcher`
//! and the default backoff. Each Pod becomes container changes through the
//! [`Tracker`]: a container whose status is `running` with a `containerID`
//! (init, regular and ephemeral containers alike) is added; a restart (a new
//! `containerID`) removes the old id, with its exit code from `lastState`,
//! and adds the new one; a terminated container, a completed or failed pod
//! and a deleted pod remove theirs. After a relist (start-up, `410 Gone`),
//! pods that did not come back are removed.
//!
//! The host pid of each added container is found by matching its id in
//! `/proc/*/cgroup` ([`find_pids`]), so no CRI socket is needed; with the
//! host's `/proc` (a DaemonSet with `hostPID: true`) the events carry pids,
//! namespaces and cgroups like the runtime hook's.
//!
//! Only the fields used are kept in memory: each Pod is reduced to its
//! running containers' identity (with each one's kind and image digest,
//! [`parse_image_id`]) as it arrives, and to its labels, its workload and
//! its containers' kinds by name.
//!
//! Each pod's workload is the controller at the top of its owner chain
//! (Pod → ReplicaSet → Deployment, Pod → Job → CronJob), read with
//! metadata-only GETs of ReplicaSets and Jobs (RBAC: `get` on
//! `replicasets` in `apps` and `jobs` in `batch`); what cannot be read
//! leaves the deepest owner known and the reason in the container's
//! `unresolved["kubernetes.workload"]`.
//!
//! [`Index`] answers "which pod is container X / pod uid Y" for enriching
//! containers found by other backends.
//!
//! ```no_run
//! # async fn f() -> Result<(), lookout_informer::Error> {
//! use lookout_informer::{Config, Informer};
//! let client = lookout_informer::client().await?;
//! let informer = Informer::new(client, Config::new("node-a"));
//! let mut print = |e: lookout_model::ContainerEvent| println!("{e:?}");
//! informer.run(&mut print, std::future::pending()).await;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod pids;
mod tracker;
mod workload;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use lookout_model::{Container, ContainerEvent, ContainerKind, Kubernetes, Sink, Source, Workload};

pub use pids::{container_id_from_cgroup, find_pids};
pub use tracker::{Change, Tracker, parse_container_id, parse_image_id};

/// Errors of the informer's setup. (Once running, API errors are logged and
/// retried with backoff; they never end the informer.)
///
/// The cause is kept as the [`source`](std::error::Error::source), not
/// repeated in the message: print with `lookout_model::Chain` or `{:#}`
/// (anyhow) to see it. (kube's own errors do repeat their causes in their
/// messages, so a chain through them shows some text twice.)
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No usable Kubernetes configuration: neither `KUBECONFIG`,
    /// `~/.kube/config` nor the in-cluster service account.
    #[error("no Kubernetes configuration")]
    Config(#[source] kube::config::InferConfigError),
    /// The kubeconfig file at `path` could not be read or used.
    #[error("kubeconfig {}", path.display())]
    Kubeconfig {
        /// The file given.
        path: PathBuf,
        /// What was wrong with it.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The client could not be built from the configuration.
    #[error("cannot build the Kubernetes client")]
    Client(#[source] kube::Error),
}

/// Builds a client the usual way: `KUBECONFIG` or `~/.kube/config`, else the
/// in-cluster service account (`KUBERNETES_SERVICE_HOST` and the token in
/// `/var/run/secrets/kubernetes.io/serviceaccount`).
pub async fn client() -> Result<Client, Error> {
    let config = kube::Config::infer().await.map_err(Error::Config)?;
    Client::try_from(config).map_err(Error::Client)
}

/// Builds a client from the kubeconfig file at `path` (its current context).
pub async fn client_from_kubeconfig(path: &std::path::Path) -> Result<Client, Error> {
    let kubeconfig = |source| Error::Kubeconfig {
        path: path.to_path_buf(),
        source,
    };
    let kc = kube::config::Kubeconfig::read_from(path).map_err(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(kubeconfig)?;
    Client::try_from(config).map_err(Error::Client)
}

/// How to run the informer. Start from [`Config::new`] and set fields; more
/// options may be added.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Config {
    /// This node's name (`NODE_NAME` from the downward API).
    pub node_name: String,
    /// Where to look for container processes; `None` skips pid resolution.
    /// Default `/proc`.
    pub proc_root: Option<PathBuf>,
}

impl Config {
    /// Watches `node_name`'s pods, resolving pids in `/proc`.
    pub fn new(node_name: impl Into<String>) -> Config {
        Config {
            node_name: node_name.into(),
            proc_root: Some(PathBuf::from("/proc")),
        }
    }
}

/// What the index keeps of a container the informer saw running: only
/// what enrichment hands out (labels and workload are the pod's).
#[derive(Debug)]
struct Seen {
    kubernetes: Kubernetes,
    kind: Option<ContainerKind>,
    image_digest: Option<String>,
    image_id: Option<String>,
}

/// What the index keeps of a pod: only what enrichment hands out.
#[derive(Debug, Default)]
struct PodInfo {
    labels: BTreeMap<String, String>,
    workload: Option<Workload>,
    /// Why `workload` is not the top of the owner chain, or absent.
    workload_unresolved: Option<String>,
    /// Each container's kind by name, from the spec.
    kinds: Vec<(String, ContainerKind)>,
}

impl PodInfo {
    fn of(pod: &Pod, resolved: workload::Resolved) -> PodInfo {
        let mut kinds = Vec::new();
        if let Some(spec) = &pod.spec {
            let names = |kind, names: &mut dyn Iterator<Item = &String>| {
                names.map(move |n| (n.clone(), kind)).collect::<Vec<_>>()
            };
            kinds.extend(names(
                ContainerKind::Init,
                &mut spec.init_containers.iter().flatten().map(|c| &c.name),
            ));
            kinds.extend(names(
                ContainerKind::Regular,
                &mut spec.containers.iter().map(|c| &c.name),
            ));
            kinds.extend(names(
                ContainerKind::Ephemeral,
                &mut spec.ephemeral_containers.iter().flatten().map(|c| &c.name),
            ));
        }
        PodInfo {
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            workload: resolved.workload,
            workload_unresolved: resolved.unresolved,
            kinds,
        }
    }

    fn kind_of(&self, container: &str) -> Option<ContainerKind> {
        self.kinds
            .iter()
            .find_map(|(n, k)| (n == container).then_some(*k))
    }
}

#[derive(Debug, Default)]
struct IndexInner {
    by_id: HashMap<String, Seen>,
    pods: HashMap<String, PodInfo>,
}

/// What [`Index::enrichment`] would add to a container: build it with
/// the index's lock held for a moment, apply it (to a copy of a shared
/// record, only when there is one) without.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use]
pub struct Enrichment {
    kubernetes: Option<Kubernetes>,
    kind: Option<ContainerKind>,
    image_digest: Option<String>,
    image_id: Option<String>,
    workload_unresolved: Option<String>,
}

impl Enrichment {
    /// Sets what the index knows and `c` lacked.
    pub fn apply(self, c: &mut Container) {
        if let Some(k) = self.kubernetes {
            c.kubernetes = Some(k);
        }
        if let Some(kind) = self.kind {
            c.kind = Some(kind);
        }
        if let Some(d) = self.image_digest {
            c.image_digest = Some(d);
        }
        if let Some(i) = self.image_id {
            c.image_id = Some(i);
        }
        if let Some(why) = self.workload_unresolved {
            c.set_unresolved(workload::FIELD, why);
        }
    }

    fn is_empty(&self) -> bool {
        *self == Enrichment::default()
    }
}

/// What the informer knows, for enriching containers found elsewhere.
/// Cheap to clone; all clones see the same data.
#[derive(Debug, Clone, Default)]
pub struct Index {
    inner: Arc<RwLock<IndexInner>>,
}

impl Index {
    /// Fills in what the informer knows and `c` lacks (see
    /// [`enrichment`](Self::enrichment)).
    pub fn enrich(&self, c: &mut Container) {
        if let Some(e) = self.enrichment(c) {
            e.apply(c);
        }
    }

    /// What [`enrich`](Self::enrich) would set, or `None` when it would
    /// change nothing: a container record that is shared (`Arc`) is then
    /// copied only when it must be.
    ///
    /// By container id (a container the informer saw running): its
    /// Kubernetes identity, kind, and the image digest or id of its
    /// status. By pod uid (from the id, or from the CRI annotations of a
    /// container reported at `create`, before any pod status names it):
    /// the pod's labels and workload (with
    /// `unresolved["kubernetes.workload"]` when the owner chain could not
    /// be climbed to its top), and the kind by container name from the
    /// pod's spec. Never the image by name: a status names the image of
    /// the container it describes, which may be an earlier one of that
    /// name (a restart can run another digest). Only what `c` lacks is
    /// set; a sandbox's kind stays `sandbox`.
    pub fn enrichment(&self, c: &Container) -> Option<Enrichment> {
        let inner = self.inner.read().ok()?;
        let mut e = Enrichment::default();
        let mut mine = c.kubernetes.clone();
        let seen = inner.by_id.get(&c.id);
        if let Some(s) = seen {
            let k = &s.kubernetes;
            let m = mine.get_or_insert_with(Kubernetes::default);
            m.namespace = m.namespace.take().or_else(|| k.namespace.clone());
            m.pod = m.pod.take().or_else(|| k.pod.clone());
            m.pod_uid = m.pod_uid.take().or_else(|| k.pod_uid.clone());
            m.container = m.container.take().or_else(|| k.container.clone());
            m.image = m.image.take().or_else(|| k.image.clone());
            if c.image_digest.is_none() {
                e.image_digest.clone_from(&s.image_digest);
            }
            if c.image_id.is_none() {
                e.image_id.clone_from(&s.image_id);
            }
        }
        let pod = mine
            .as_ref()
            .and_then(|k| k.pod_uid.as_ref())
            .and_then(|u| inner.pods.get(u));
        if let (Some(k), Some(p)) = (mine.as_mut(), pod) {
            if k.labels.is_empty() {
                k.labels.clone_from(&p.labels);
            }
            if k.workload.is_none() {
                k.workload.clone_from(&p.workload);
                if !c.unresolved.contains_key(workload::FIELD) {
                    e.workload_unresolved.clone_from(&p.workload_unresolved);
                }
            }
        }
        if c.kind.is_none() && !c.pod_sandbox {
            e.kind = seen.and_then(|s| s.kind).or_else(|| {
                let name = mine.as_ref()?.container.as_deref()?;
                pod?.kind_of(name)
            });
        }
        if mine != c.kubernetes {
            e.kubernetes = mine;
        }
        (!e.is_empty()).then_some(e)
    }

    /// The Kubernetes identity of container `id`, if the informer saw it
    /// (with its pod's labels and workload).
    pub fn get(&self, id: &str) -> Option<Kubernetes> {
        let inner = self.inner.read().ok()?;
        let mut k = inner.by_id.get(id)?.kubernetes.clone();
        if let Some(p) = k.pod_uid.as_ref().and_then(|u| inner.pods.get(u)) {
            k.labels.clone_from(&p.labels);
            k.workload.clone_from(&p.workload);
        }
        Some(k)
    }

    fn pod(&self, pod: &Pod, resolved: Option<workload::Resolved>) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let Ok(mut inner) = self.inner.write() else {
            return;
        };
        match resolved {
            Some(r) => {
                inner.pods.insert(uid, PodInfo::of(pod, r));
            }
            None => {
                inner.pods.remove(&uid);
            }
        }
    }

    fn change(&self, change: &Change) {
        let Ok(mut inner) = self.inner.write() else {
            return;
        };
        match change {
            Change::Added(c) => {
                if let Some(k) = &c.kubernetes {
                    let mut k = k.clone();
                    // The pod's, kept once per pod.
                    k.labels.clear();
                    k.workload = None;
                    let seen = Seen {
                        kubernetes: k,
                        kind: c.kind,
                        image_digest: c.image_digest.clone(),
                        image_id: c.image_id.clone(),
                    };
                    inner.by_id.insert(c.id.clone(), seen);
                }
            }
            Change::Removed(c, _) => {
                inner.by_id.remove(&c.id);
            }
        }
    }

    fn clear_pods(&self) {
        if let Ok(mut inner) = self.inner.write() {
            inner.pods.clear();
        }
    }
}

/// The informer's reduction of a pod's owners and spec, for `cargo fuzz`
/// (fuzz/fuzz_targets/pod_reduction.rs).
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing {
    use k8s_openapi::api::core::v1::Pod;
    use lookout_model::ContainerKind;

    /// The pod's controller reference as checked: `(apiVersion, kind,
    /// name, uid)`, or why it is refused.
    pub fn controller(pod: &Pod) -> Result<Option<[String; 4]>, String> {
        crate::workload::controller_for_fuzzing(pod)
    }

    /// The kinds the index keeps by container name.
    pub fn kinds(pod: &Pod) -> Vec<(String, ContainerKind)> {
        crate::PodInfo::of(pod, crate::workload::Resolved::default()).kinds
    }
}

/// The Pod informer. See the crate docs.
#[derive(Clone)]
pub struct Informer {
    client: Client,
    config: Config,
    index: Index,
}

impl std::fmt::Debug for Informer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Informer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Informer {
    /// An informer for `config.node_name`'s pods.
    pub fn new(client: Client, config: Config) -> Informer {
        Informer {
            client,
            config,
            index: Index::default(),
        }
    }

    /// A handle on what the informer knows.
    pub fn index(&self) -> Index {
        self.index.clone()
    }

    /// Watches until `shutdown` completes, emitting `added`/`removed` with
    /// source `informer`. API errors are logged and retried with kube-rs's
    /// default backoff (0.8 s doubling to 30 s, with jitter).
    pub async fn run<S: Sink + Send>(
        self,
        sink: &mut S,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let wc =
            watcher::Config::default().fields(&format!("spec.nodeName={}", self.config.node_name));
        let stream = watcher(pods, wc).default_backoff();
        tokio::pin!(stream);
        tokio::pin!(shutdown);
        let mut tracker = Tracker::new();
        // Inline, bounded by its timeouts and cache: see workload.rs.
        let mut resolver = workload::Resolver::new(self.client.clone());
        // Changes of a relist wait for its end, so that a single /proc scan
        // resolves all of their pids.
        let mut pending: Vec<Change> = Vec::new();
        let mut listing = false;
        let mut synced_once = false;
        loop {
            let ev = tokio::select! {
                () = &mut shutdown => break,
                ev = stream.next() => ev,
            };
            let Some(ev) = ev else { break };
            // A shutdown does not wait for owner reads.
            let resolved = match &ev {
                Ok(watcher::Event::InitApply(pod) | watcher::Event::Apply(pod)) => {
                    tokio::select! {
                        () = &mut shutdown => break,
                        r = resolver.resolve(pod) => Some(r),
                    }
                }
                _ => None,
            };
            match ev {
                Ok(watcher::Event::Init) => {
                    listing = true;
                    tracker.init();
                    self.index.clear_pods();
                }
                Ok(watcher::Event::InitApply(pod)) => {
                    self.index.pod(&pod, resolved);
                    tracker.apply(&pod, &mut pending);
                }
                Ok(watcher::Event::InitDone) => {
                    listing = false;
                    tracker.init_done(&mut pending);
                    if !synced_once {
                        synced_once = true;
                        tracing::info!(
                            node = self.config.node_name,
                            containers = tracker.live().count(),
                            "pod informer synced"
                        );
                    }
                }
                Ok(watcher::Event::Apply(pod)) => {
                    self.index.pod(&pod, resolved);
                    tracker.apply(&pod, &mut pending);
                }
                Ok(watcher::Event::Delete(pod)) => {
                    self.index.pod(&pod, None);
                    tracker.delete(&pod, &mut pending);
                }
                Err(e) => {
                    tracing::warn!(
                        error = %lookout_model::Chain(&e),
                        "pod watch failed; retrying with backoff"
                    );
                    continue;
                }
            }
            if !listing && !pending.is_empty() {
                self.flush(&mut pending, sink);
            }
        }
    }

    fn flush<S: Sink>(&self, changes: &mut Vec<Change>, sink: &mut S) {
        let wanted: HashSet<String> = changes
            .iter()
            .filter_map(|c| match c {
                Change::Added(c) => Some(c.id.clone()),
                Change::Removed(..) => None,
            })
            .collect();
        let pids = match &self.config.proc_root {
            Some(root) => find_pids(root, &wanted),
            None => HashMap::new(),
        };
        for mut change in changes.drain(..) {
            // The pod's labels and workload, which the tracker does not
            // keep.
            if let Change::Added(c) = &mut change {
                self.index.enrich(c);
            }
            self.index.change(&change);
            match change {
                Change::Added(mut c) => {
                    // The same checks as the hook's and the scan's: not
                    // pid 1, not a process in the host's (or the agent's)
                    // mount namespace. A pid that fails them is not the
                    // container's, and its kernel view is not either.
                    // (Only against this machine's own /proc: a test's
                    // fixture of one has no process to check.)
                    let host_proc = self.config.proc_root.as_deref() == Some(Path::new("/proc"));
                    match pids.get(&c.id).copied() {
                        Some(pid) if host_proc => {
                            match lookout_host::proc::container_init(pid, None) {
                                Ok(init) => {
                                    c.pid = Some(init.pid);
                                    lookout_host::kernel::fill(&mut c, init.pid, Some(init.mnt));
                                }
                                Err(why) => tracing::debug!(
                                    id = c.id,
                                    %why,
                                    "the process found for this container is not its init"
                                ),
                            }
                        }
                        Some(pid) => {
                            c.pid = Some(pid);
                            lookout_host::kernel::fill(&mut c, pid, None);
                        }
                        None => {}
                    }
                    sink.emit(ContainerEvent::added(Source::Informer, c));
                }
                Change::Removed(c, code) => {
                    sink.emit(ContainerEvent::removed(Source::Informer, c, code));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("connection reset by peer")]
    struct Root;

    #[derive(Debug, thiserror::Error)]
    #[error("client error (SendRequest)")]
    struct Hidden(#[source] Root);

    /// A watch error through kube's layers: each repeats its cause, but the
    /// root cause is only in the chain.
    #[test]
    fn the_chain_prints_each_cause_of_kube_once() {
        let e = watcher::Error::WatchFailed(kube::Error::Service(Box::new(Hidden(Root))));
        assert_eq!(
            lookout_model::Chain(&e).to_string(),
            "watch stream failed: ServiceError: client error (SendRequest): \
             connection reset by peer"
        );
    }

    #[test]
    fn setup_errors_keep_the_cause_out_of_the_message() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("missing");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let Err(e) = rt.block_on(client_from_kubeconfig(&path)) else {
            panic!("a client from a missing kubeconfig");
        };
        assert!(matches!(e, Error::Kubeconfig { .. }), "{e:?}");
        assert_eq!(e.to_string(), format!("kubeconfig {}", path.display()));
        // The cause is in the chain only.
        let chain = lookout_model::Chain(&e).to_string();
        assert!(chain.contains("No such file"), "{chain}");
    }
}
