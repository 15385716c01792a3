//! What a container is in Kubernetes: its pod's identity and workload,
//! and its kind.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// What a container is to its pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ContainerKind {
    /// One of `spec.containers` (a sidecar, `spec.initContainers` with
    /// `restartPolicy: Always`, is `init`).
    Regular,
    /// One of `spec.initContainers`.
    Init,
    /// One of `spec.ephemeralContainers` (`kubectl debug`).
    Ephemeral,
    /// The pod's sandbox (pause) container: [`Container::pod_sandbox`].
    Sandbox,
}

impl ContainerKind {
    /// The name as printed (`regular`, `init`, `ephemeral`, `sandbox`).
    pub fn as_str(&self) -> &'static str {
        match self {
            ContainerKind::Regular => "regular",
            ContainerKind::Init => "init",
            ContainerKind::Ephemeral => "ephemeral",
            ContainerKind::Sandbox => "sandbox",
        }
    }
}

impl fmt::Display for ContainerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The controller at the top of a pod's owner chain: Pod → ReplicaSet →
/// Deployment gives the Deployment, Pod → Job → CronJob the CronJob. A pod
/// without a controller is its own workload.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[non_exhaustive]
pub struct Workload {
    /// `Deployment`, `StatefulSet`, `DaemonSet`, `CronJob`, `Job`,
    /// `ReplicaSet`, `Pod`, or any controller's kind.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Its namespace (the pod's: namespaced owners are in the same
    /// namespace); empty for a static pod's Node.
    pub namespace: String,
    /// `apps/v1`, `batch/v1`, `v1`, ...
    pub api_version: String,
    /// Its UID, when known.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub uid: Option<String>,
}

impl Workload {
    /// The workload's key as filters take it: `Kind/namespace/name`
    /// (`Deployment/shop/api`).
    pub fn key(&self) -> String {
        format!("{}/{}/{}", self.kind, self.namespace, self.name)
    }

    /// The API group of Kubernetes' own kind `kind` (`apps` for a
    /// Deployment, `batch` for a CronJob, `""` for the core group), for the
    /// kinds a key names by kind alone; `None` for any other kind.
    pub fn builtin_group(kind: &str) -> Option<&'static str> {
        match kind {
            "Deployment" | "ReplicaSet" | "StatefulSet" | "DaemonSet" => Some("apps"),
            "Job" | "CronJob" => Some("batch"),
            "Pod" | "ReplicationController" | "Node" => Some(""),
            _ => None,
        }
    }

    /// Whether the workload is what its key says: a kind of Kubernetes'
    /// own in its own API group, or a kind that is not Kubernetes' own. A
    /// pod may name any owner, and `x.example/v1 Deployment` is not a
    /// Deployment: filters by `Deployment/...` never match it.
    ///
    /// ```
    /// let mut w = lookout_model::Workload::default();
    /// w.kind = "Deployment".into();
    /// w.api_version = "apps/v1".into();
    /// assert!(w.is_what_its_key_says());
    /// w.api_version = "x.example/v1".into();
    /// assert!(!w.is_what_its_key_says());
    /// ```
    pub fn is_what_its_key_says(&self) -> bool {
        let group = self
            .api_version
            .rsplit_once('/')
            .map_or("", |(group, _)| group);
        Workload::builtin_group(&self.kind).is_none_or(|g| g == group)
    }
}

/// The Kubernetes identity of a container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[non_exhaustive]
pub struct Kubernetes {
    /// The pod's namespace.
    pub namespace: Option<String>,
    /// The pod's name.
    pub pod: Option<String>,
    /// The pod's UID.
    pub pod_uid: Option<String>,
    /// The container's name in the pod spec.
    pub container: Option<String>,
    /// The container's image.
    pub image: Option<String>,
    /// The pod's labels (from the informer).
    #[serde(skip_serializing_if = "BTreeMap::is_empty", default)]
    pub labels: BTreeMap<String, String>,
    /// The controller at the top of the pod's owner chain (from the
    /// informer), when known.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub workload: Option<Workload>,
}

impl Kubernetes {
    /// Reads the annotations the CRI runtimes put in config.json:
    /// containerd's `io.kubernetes.cri.*` and CRI-O's `io.kubernetes.pod.*`
    /// / `io.kubernetes.container.name`. `None` when there are none (not a
    /// Kubernetes container). A pod sandbox (pause) container gets its
    /// pod's identity, with no container name (see [`is_pod_sandbox`]).
    ///
    /// ```
    /// use std::collections::BTreeMap;
    /// let a = BTreeMap::from([
    ///     ("io.kubernetes.cri.container-type".to_owned(), "container".to_owned()),
    ///     ("io.kubernetes.cri.sandbox-namespace".to_owned(), "default".to_owned()),
    ///     ("io.kubernetes.cri.sandbox-name".to_owned(), "web-0".to_owned()),
    ///     ("io.kubernetes.cri.container-name".to_owned(), "nginx".to_owned()),
    /// ]);
    /// let k = lookout_model::Kubernetes::from_annotations(&a).unwrap();
    /// assert_eq!(k.pod.as_deref(), Some("web-0"));
    /// assert_eq!(k.container.as_deref(), Some("nginx"));
    /// ```
    pub fn from_annotations(a: &BTreeMap<String, String>) -> Option<Kubernetes> {
        let get = |keys: &[&str]| keys.iter().find_map(|k| a.get(*k).cloned());
        let sandbox = is_pod_sandbox(a);
        let k = Kubernetes {
            namespace: get(&[
                "io.kubernetes.cri.sandbox-namespace",
                "io.kubernetes.pod.namespace",
            ]),
            pod: get(&["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"]),
            pod_uid: get(&["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"]),
            container: get(&[
                "io.kubernetes.cri.container-name",
                "io.kubernetes.container.name",
            ])
            .filter(|_| !sandbox),
            image: get(&[
                "io.kubernetes.cri.image-name",
                "io.kubernetes.cri-o.ImageName",
            ]),
            labels: BTreeMap::new(),
            workload: None,
        };
        (k != Kubernetes::default()).then_some(k)
    }
}

/// Whether a container's annotations mark it as a pod's sandbox (pause)
/// container: containerd's `io.kubernetes.cri.container-type: sandbox`,
/// CRI-O's `io.kubernetes.cri-o.ContainerType: sandbox`.
///
/// ```
/// use std::collections::BTreeMap;
/// let a = BTreeMap::from([
///     ("io.kubernetes.cri.container-type".to_owned(), "sandbox".to_owned()),
///     ("io.kubernetes.cri.sandbox-namespace".to_owned(), "default".to_owned()),
///     ("io.kubernetes.cri.sandbox-name".to_owned(), "web-0".to_owned()),
/// ]);
/// assert!(lookout_model::is_pod_sandbox(&a));
/// let k = lookout_model::Kubernetes::from_annotations(&a).unwrap();
/// assert_eq!(k.pod.as_deref(), Some("web-0"));
/// assert_eq!(k.container, None);
/// ```
pub fn is_pod_sandbox(a: &BTreeMap<String, String>) -> bool {
    [
        "io.kubernetes.cri.container-type",
        "io.kubernetes.cri-o.ContainerType",
    ]
    .iter()
    .any(|k| a.get(*k).is_some_and(|t| t == "sandbox"))
}
