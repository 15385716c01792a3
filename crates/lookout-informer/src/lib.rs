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
//! running containers' identity as it arrives.
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use lookout_model::{Container, ContainerEvent, Kubernetes, Sink, Source};

pub use pids::{container_id_from_cgroup, find_pids};
pub use tracker::{Change, Tracker, parse_container_id};

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

#[derive(Debug, Default)]
struct IndexInner {
    by_id: HashMap<String, Kubernetes>,
    labels_by_uid: HashMap<String, BTreeMap<String, String>>,
}

/// What the informer knows, for enriching containers found elsewhere.
/// Cheap to clone; all clones see the same data.
#[derive(Debug, Clone, Default)]
pub struct Index {
    inner: Arc<RwLock<IndexInner>>,
}

impl Index {
    /// Fills in `c.kubernetes` from the informer: by container id, or, when
    /// CRI annotations already named the pod, the pod's labels by uid (a
    /// container reported at `create` is not in any pod status yet, but
    /// its pod is).
    pub fn enrich(&self, c: &mut Container) {
        if let Some(k) = self.enriched(c) {
            c.kubernetes = Some(k);
        }
    }

    /// What [`enrich`](Self::enrich) would set `c.kubernetes` to, or
    /// `None` when it would change nothing: a container record that is
    /// shared (`Arc`) is then copied only when it must be.
    pub fn enriched(&self, c: &Container) -> Option<Kubernetes> {
        let inner = self.inner.read().ok()?;
        let mut mine = c.kubernetes.clone();
        if let Some(k) = inner.by_id.get(&c.id) {
            let m = mine.get_or_insert_with(Kubernetes::default);
            m.namespace = m.namespace.take().or_else(|| k.namespace.clone());
            m.pod = m.pod.take().or_else(|| k.pod.clone());
            m.pod_uid = m.pod_uid.take().or_else(|| k.pod_uid.clone());
            m.container = m.container.take().or_else(|| k.container.clone());
            m.image = m.image.take().or_else(|| k.image.clone());
        }
        if let Some(k) = mine.as_mut()
            && k.labels.is_empty()
            && let Some(labels) = k.pod_uid.as_ref().and_then(|u| inner.labels_by_uid.get(u))
        {
            k.labels = labels.clone();
        }
        (mine != c.kubernetes).then_some(mine).flatten()
    }

    /// The Kubernetes identity of container `id`, if the informer saw it.
    pub fn get(&self, id: &str) -> Option<Kubernetes> {
        self.inner.read().ok()?.by_id.get(id).cloned()
    }

    fn pod(&self, pod: &Pod, present: bool) {
        let Ok(mut inner) = self.inner.write() else {
            return;
        };
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        if present {
            inner
                .labels_by_uid
                .insert(uid, pod.metadata.labels.clone().unwrap_or_default());
        } else {
            inner.labels_by_uid.remove(&uid);
        }
    }

    fn change(&self, change: &Change) {
        let Ok(mut inner) = self.inner.write() else {
            return;
        };
        match change {
            Change::Added(c) => {
                if let Some(k) = &c.kubernetes {
                    inner.by_id.insert(c.id.clone(), k.clone());
                }
            }
            Change::Removed(c, _) => {
                inner.by_id.remove(&c.id);
            }
        }
    }

    fn clear_pods(&self) {
        if let Ok(mut inner) = self.inner.write() {
            inner.labels_by_uid.clear();
        }
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
            match ev {
                Ok(watcher::Event::Init) => {
                    listing = true;
                    tracker.init();
                    self.index.clear_pods();
                }
                Ok(watcher::Event::InitApply(pod)) => {
                    self.index.pod(&pod, true);
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
                    self.index.pod(&pod, true);
                    tracker.apply(&pod, &mut pending);
                }
                Ok(watcher::Event::Delete(pod)) => {
                    self.index.pod(&pod, false);
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
        for change in changes.drain(..) {
            self.index.change(&change);
            match change {
                Change::Added(mut c) => {
                    if let Some(&pid) = pids.get(&c.id) {
                        c.pid = Some(pid);
                        lookout_host::kernel::fill(&mut c, pid, None);
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
