//! The typed pods, containers and events the plugin hands out, mapped from
//! NRI v0.6.1's protobuf messages.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::Error;
use crate::proto;

/// A pod sandbox as the runtime describes it (`PodSandbox`).
///
/// NRI v0.6.1 leaves out the pod's resources, overhead and the sandbox's
/// OCI spec; this keeps the identity and placement fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pod {
    /// The sandbox id (the pause container's id on containerd).
    pub id: String,
    /// The pod's name.
    pub name: String,
    /// The pod's Kubernetes uid.
    pub uid: String,
    /// The pod's Kubernetes namespace.
    pub namespace: String,
    /// The pod's labels.
    pub labels: BTreeMap<String, String>,
    /// The pod's annotations, with the runtime's own
    /// (`io.kubernetes.cri.*` ...).
    pub annotations: BTreeMap<String, String>,
    /// The runtime handler (`runc`, `kata`, `runsc`, ...; empty: the
    /// default).
    pub runtime_handler: String,
    /// The sandbox's process id in the runtime's pid namespace, when the
    /// runtime sends it (containerd 1.7 does once the sandbox runs).
    pub pid: Option<u32>,
    /// The pod's cgroup parent (`kubepods-besteffort-pod<uid>.slice`, ...).
    pub cgroup_parent: String,
    /// The sandbox container's cgroups path.
    pub cgroups_path: String,
    /// The sandbox's Linux namespaces (type and path; an empty path is a
    /// new namespace).
    pub namespaces: Vec<Namespace>,
}

/// A Linux namespace of a pod or container (`LinuxNamespace`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Namespace {
    /// The OCI type: `pid`, `network`, `ipc`, `uts`, `mount`, `cgroup`,
    /// `user`, `time`.
    pub kind: String,
    /// The namespace to join (`/proc/<pid>/ns/net`, ...); empty for a new
    /// one.
    pub path: String,
}

/// A container as the runtime describes it (`Container`).
///
/// NRI v0.6.1 has no exit code or exit time: a stopped container only says
/// [`ContainerState::Stopped`]. Devices, resources, OCI hooks and rlimits
/// are not mapped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Container {
    /// The container id.
    pub id: String,
    /// The id of its pod sandbox ([`Pod::id`]).
    pub pod_sandbox_id: String,
    /// The container's name in its pod.
    pub name: String,
    /// Its state when the event was sent.
    pub state: ContainerState,
    /// The container's labels.
    pub labels: BTreeMap<String, String>,
    /// The container's annotations, with the runtime's own
    /// (`io.kubernetes.cri.container-name`, ...).
    pub annotations: BTreeMap<String, String>,
    /// The process's arguments (entrypoint and command).
    pub args: Vec<String>,
    /// The process's environment, `KEY=value`.
    pub env: Vec<String>,
    /// The container's mounts.
    pub mounts: Vec<Mount>,
    /// The init process's id in the runtime's pid namespace, once there is
    /// one (not at CreateContainer).
    pub pid: Option<u32>,
    /// The container's cgroups path as given to the OCI runtime
    /// (`kubepods-...slice:cri-containerd:<id>` with the systemd driver).
    pub cgroups_path: String,
    /// The container's Linux namespaces.
    pub namespaces: Vec<Namespace>,
    /// The process's OOM score adjustment, when set.
    pub oom_score_adj: Option<i64>,
}

/// A container mount (`Mount`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Mount {
    /// Where it is mounted in the container.
    pub destination: String,
    /// The filesystem type (`bind`, `proc`, `tmpfs`, ...).
    pub kind: String,
    /// The source.
    pub source: String,
    /// Mount options.
    pub options: Vec<String>,
}

/// A container's state (`ContainerState`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ContainerState {
    /// Not given.
    #[default]
    Unknown,
    /// Created, its process not started yet.
    Created,
    /// Paused.
    Paused,
    /// Running.
    Running,
    /// Stopped (exited or killed).
    Stopped,
    /// A value this crate does not know (kept, not rejected).
    Other(i32),
}

/// The runtime NRI runs in, from Configure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Runtime {
    /// Its name (`containerd`, `cri-o`).
    pub name: String,
    /// Its version (`1.7.24~ds1`, ...).
    pub version: String,
}

/// A pod lifecycle step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PodPhase {
    /// RunPodSandbox: the sandbox runs (sent after it started).
    Run,
    /// StopPodSandbox: the sandbox is being stopped.
    Stop,
    /// RemovePodSandbox: the sandbox is being removed.
    Remove,
}

/// A container lifecycle step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ContainerPhase {
    /// CreateContainer: the runtime is about to create the container and
    /// waits for the answer ([`Ack`](crate::Ack)).
    Create,
    /// PostCreateContainer: the container is created (its process exists,
    /// stopped before the user's program).
    PostCreate,
    /// StartContainer: the runtime is about to start the container and
    /// waits for the answer.
    Start,
    /// PostStartContainer: the container was started.
    PostStart,
    /// UpdateContainer: its resources are about to change (only with
    /// [`PluginBuilder::updates`](crate::PluginBuilder::updates)).
    Update,
    /// PostUpdateContainer: its resources changed (only with `updates`).
    PostUpdate,
    /// StopContainer: the container is being stopped, or its process
    /// exited.
    Stop,
    /// RemoveContainer: the container is being removed.
    Remove,
}

impl ContainerPhase {
    /// Whether the runtime holds the container until this event is
    /// answered, before its user program runs: [`Create`](Self::Create)
    /// and [`Start`](Self::Start). For these the plugin waits for the
    /// [`Ack`](crate::Ack), up to its deadline.
    pub fn holds_start(self) -> bool {
        matches!(self, Self::Create | Self::Start)
    }
}

/// What the plugin reports.
#[derive(Debug, Clone)]
#[non_exhaustive]
#[expect(
    clippy::large_enum_variant,
    reason = "events are moved a few times each; boxing would only make matching clumsier"
)]
pub enum Event {
    /// The plugin registered and the runtime sent everything it has (at
    /// start-up and after every reconnect). See [`Snapshot`] for the diff
    /// against what this plugin reported before.
    Synchronized(Snapshot),
    /// A pod changed.
    Pod {
        /// What happened.
        phase: PodPhase,
        /// The pod.
        pod: Pod,
    },
    /// A container changed.
    Container {
        /// What happened.
        phase: ContainerPhase,
        /// Its pod; `None` when the runtime no longer knows it (containerd
        /// sends a container's removal without its pod once the pod is
        /// gone).
        pod: Option<Pod>,
        /// The container.
        container: Container,
    },
    /// The runtime is shutting down (`Shutdown`); the connection closes
    /// next and the plugin reconnects when the runtime is back.
    Shutdown,
    /// A synchronized connection ended; the plugin reconnects with backoff
    /// and sends [`Event::Synchronized`] again. Events the runtime had
    /// while disconnected come as that snapshot's diff.
    Disconnected(Arc<Error>),
}

/// The runtime's state at (re)synchronization, and how it differs from what
/// the plugin had reported.
///
/// The plugin tracks the pods and containers it reported (added by
/// RunPodSandbox/CreateContainer or a snapshot, dropped by
/// RemovePodSandbox/RemoveContainer or a snapshot). After a reconnect,
/// [`new_pods`](Self::new_pods)/[`new_containers`](Self::new_containers)
/// are those created while it was away and [`gone_pods`](Self::gone_pods)/
/// [`gone_containers`](Self::gone_containers) those removed meanwhile; the
/// rest were reported already. On the first synchronization everything is
/// new. A consumer that reports "added" for the new and "removed" for the
/// gone ones reports each container exactly once.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Snapshot {
    /// The runtime, from Configure.
    pub runtime: Runtime,
    /// Whether this follows a reconnect (an earlier snapshot was reported).
    pub resync: bool,
    /// Every pod the runtime has.
    pub pods: Vec<Pod>,
    /// Every container the runtime has.
    pub containers: Vec<Container>,
    /// Ids of [`pods`](Self::pods) not reported before.
    pub new_pods: Vec<String>,
    /// Ids of [`containers`](Self::containers) not reported before.
    pub new_containers: Vec<String>,
    /// Pods reported before that the runtime no longer has (as last seen).
    pub gone_pods: Vec<Pod>,
    /// Containers reported before that the runtime no longer has (as last
    /// seen).
    pub gone_containers: Vec<Container>,
}

fn sorted(m: HashMap<String, String>) -> BTreeMap<String, String> {
    m.into_iter().collect()
}

fn namespaces(ns: Vec<proto::LinuxNamespace>) -> Vec<Namespace> {
    ns.into_iter()
        .map(|n| Namespace {
            kind: n.r#type,
            path: n.path,
        })
        .collect()
}

fn nonzero(pid: u32) -> Option<u32> {
    (pid != 0).then_some(pid)
}

impl From<proto::PodSandbox> for Pod {
    fn from(p: proto::PodSandbox) -> Pod {
        let linux = p.linux.unwrap_or_default();
        Pod {
            id: p.id,
            name: p.name,
            uid: p.uid,
            namespace: p.namespace,
            labels: sorted(p.labels),
            annotations: sorted(p.annotations),
            runtime_handler: p.runtime_handler,
            pid: nonzero(p.pid),
            cgroup_parent: linux.cgroup_parent,
            cgroups_path: linux.cgroups_path,
            namespaces: namespaces(linux.namespaces),
        }
    }
}

impl From<i32> for ContainerState {
    fn from(v: i32) -> ContainerState {
        match proto::ContainerState::try_from(v) {
            Ok(proto::ContainerState::ContainerUnknown) => ContainerState::Unknown,
            Ok(proto::ContainerState::ContainerCreated) => ContainerState::Created,
            Ok(proto::ContainerState::ContainerPaused) => ContainerState::Paused,
            Ok(proto::ContainerState::ContainerRunning) => ContainerState::Running,
            Ok(proto::ContainerState::ContainerStopped) => ContainerState::Stopped,
            Err(_) => ContainerState::Other(v),
        }
    }
}

impl From<proto::Container> for Container {
    fn from(c: proto::Container) -> Container {
        let linux = c.linux.unwrap_or_default();
        Container {
            id: c.id,
            pod_sandbox_id: c.pod_sandbox_id,
            name: c.name,
            state: c.state.into(),
            labels: sorted(c.labels),
            annotations: sorted(c.annotations),
            args: c.args,
            env: c.env,
            mounts: c
                .mounts
                .into_iter()
                .map(|m| Mount {
                    destination: m.destination,
                    kind: m.r#type,
                    source: m.source,
                    options: m.options,
                })
                .collect(),
            pid: nonzero(c.pid),
            cgroups_path: linux.cgroups_path,
            namespaces: namespaces(linux.namespaces),
            oom_score_adj: linux.oom_score_adj.map(|o| o.value),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_maps_identity_linux_fields_and_zero_pid() {
        let p = proto::PodSandbox {
            id: "sb".into(),
            name: "web-0".into(),
            uid: "u-1".into(),
            namespace: "prod".into(),
            labels: [("app".to_string(), "web".to_string())].into(),
            linux: Some(proto::LinuxPodSandbox {
                cgroup_parent: "/kubepods/pod1".into(),
                namespaces: vec![proto::LinuxNamespace {
                    r#type: "network".into(),
                    path: "/proc/1/ns/net".into(),
                }],
                ..Default::default()
            }),
            pid: 0,
            ..Default::default()
        };
        let pod = Pod::from(p);
        assert_eq!(
            (pod.name.as_str(), pod.namespace.as_str(), pod.uid.as_str()),
            ("web-0", "prod", "u-1")
        );
        assert_eq!(pod.labels.get("app").map(String::as_str), Some("web"));
        assert_eq!(pod.cgroup_parent, "/kubepods/pod1");
        assert_eq!(pod.namespaces[0].kind, "network");
        assert_eq!(pod.pid, None);
    }

    #[test]
    fn container_state_keeps_unknown_values() {
        assert_eq!(ContainerState::from(3), ContainerState::Running);
        assert_eq!(ContainerState::from(4), ContainerState::Stopped);
        assert_eq!(ContainerState::from(42), ContainerState::Other(42));
    }

    #[test]
    fn container_maps_pid_oom_and_mounts() {
        let c = Container::from(proto::Container {
            id: "c1".into(),
            pid: 77,
            state: 1,
            linux: Some(proto::LinuxContainer {
                oom_score_adj: Some(proto::OptionalInt { value: -5 }),
                cgroups_path: "a:b:c1".into(),
                ..Default::default()
            }),
            mounts: vec![proto::Mount {
                destination: "/proc".into(),
                r#type: "proc".into(),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert_eq!(c.pid, Some(77));
        assert_eq!(c.state, ContainerState::Created);
        assert_eq!(c.oom_score_adj, Some(-5));
        assert_eq!(c.cgroups_path, "a:b:c1");
        assert_eq!(c.mounts[0].kind, "proc");
    }
}
