//! A builder for `lookout.v1.Filter`.

use lookout_api::v1;

/// Which containers to list, watch or gate. Every criterion that is set
/// must match; an empty filter ([`Filter::all`]) matches everything. The
/// agent evaluates it.
///
/// ```
/// use lookout_client::Filter;
/// let filter = Filter::all()
///     .runtime("runc")
///     .runtime("crun") // runc or crun
///     .namespace("payments")
///     .pod_label("app", "api") // and this label
///     .annotation("io.kubernetes.cri.container-type", "container");
/// let proto: lookout_client::proto::Filter = filter.into();
/// assert_eq!(proto.runtimes, ["runc", "crun"]);
///
/// // What a BPF tracer or a policy engine keys by.
/// let by_workload = Filter::all()
///     .workload("Deployment/shop/api")
///     .cgroup_id(7_301)
///     .image_digest("sha256:4f1c...");
/// let proto: lookout_client::proto::Filter = by_workload.into();
/// assert_eq!(proto.workloads, ["Deployment/shop/api"]);
/// assert_eq!(proto.cgroup_ids, [7_301]);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filter {
    inner: v1::Filter,
}

impl Filter {
    /// Matches every container.
    pub fn all() -> Self {
        Self::default()
    }

    /// Adds a runtime (`runc`, `crun`, `runsc`, ...); the container's must
    /// be any of those added.
    pub fn runtime(mut self, runtime: impl Into<String>) -> Self {
        self.inner.runtimes.push(runtime.into());
        self
    }

    /// Adds a Kubernetes namespace; the container's must be any of those
    /// added. Containers without Kubernetes identity then never match.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.inner.namespaces.push(namespace.into());
        self
    }

    /// Requires the pod label `key` with value `value` (all required labels
    /// must match).
    pub fn pod_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.inner.pod_labels.insert(key.into(), value.into());
        self
    }

    /// Requires the OCI annotation `key` with value `value` (all required
    /// annotations must match).
    pub fn annotation(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.inner.annotations.insert(key.into(), value.into());
        self
    }

    /// Adds a workload, as `Kind/namespace/name` (`Deployment/shop/api`,
    /// `CronJob/batch/nightly`, `Pod/default/debug` for a pod without a
    /// controller); the container's pod's must be any of those added.
    /// Containers whose workload is not known never match.
    pub fn workload(mut self, workload: impl Into<String>) -> Self {
        self.inner.workloads.push(workload.into());
        self
    }

    /// Adds a cgroup id (what `bpf_get_current_cgroup_id()` returns in the
    /// container); the container's must be any of those added.
    pub fn cgroup_id(mut self, cgroup_id: u64) -> Self {
        self.inner.cgroup_ids.push(cgroup_id);
        self
    }

    /// Adds an image digest: a whole `repo@sha256:...`, or the
    /// `sha256:...` part alone (which also matches an image id); the
    /// container's must be any of those added. A CRI container's digest
    /// usually arrives in an `UPDATED` change, after its `ADDED` (and
    /// after a gate's hold): see docs/events.md.
    pub fn image_digest(mut self, digest: impl Into<String>) -> Self {
        self.inner.image_digests.push(digest.into());
        self
    }

    /// The protobuf message sent to the agent.
    pub fn into_proto(self) -> v1::Filter {
        self.inner
    }
}

impl From<Filter> for v1::Filter {
    fn from(filter: Filter) -> Self {
        filter.inner
    }
}

impl From<v1::Filter> for Filter {
    fn from(inner: v1::Filter) -> Self {
        Self { inner }
    }
}
