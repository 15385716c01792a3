//! Typed reads of a [`proto::Container`]'s fields whose wire form has a
//! "not known" value (`0`, `""`, unset): [`ContainerExt`].

use std::fmt;

use lookout_api::v1 as proto;

/// What a container is to its pod (`Container.kind` on the wire).
///
/// `#[non_exhaustive]`: a later agent may send a kind this client does not
/// know, which [`ContainerExt::kind`] reads as `None`; the raw string stays
/// in `container.kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ContainerKind {
    /// One of the pod's `spec.containers`.
    Regular,
    /// One of `spec.initContainers` (a sidecar, an init container with
    /// `restartPolicy: Always`, is one too).
    Init,
    /// One of `spec.ephemeralContainers` (`kubectl debug`).
    Ephemeral,
    /// The pod's sandbox (pause) container (`Container.pod_sandbox`).
    Sandbox,
}

impl ContainerKind {
    /// The kind named as on the wire (`regular`, `init`, `ephemeral`,
    /// `sandbox`); `None` for any other string, the empty one included.
    pub fn from_name(name: &str) -> Option<ContainerKind> {
        match name {
            "regular" => Some(ContainerKind::Regular),
            "init" => Some(ContainerKind::Init),
            "ephemeral" => Some(ContainerKind::Ephemeral),
            "sandbox" => Some(ContainerKind::Sandbox),
            _ => None,
        }
    }

    /// The name as on the wire.
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

/// The inode numbers of a container's init's namespaces (`st_ino` of
/// `/proc/<pid>/ns/<name>`, what a BPF program reads as
/// `task->nsproxy->mnt_ns->ns.inum` and its kin); `None` when the agent
/// did not know it (`0` on the wire).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct NamespaceInodes {
    /// Mount namespace.
    pub mnt: Option<u64>,
    /// Network namespace.
    pub net: Option<u64>,
    /// Pid namespace.
    pub pid: Option<u64>,
    /// User namespace (the host's unless the container has its own; then
    /// `id_maps` is set).
    pub user: Option<u64>,
    /// Cgroup namespace.
    pub cgroup: Option<u64>,
    /// IPC namespace.
    pub ipc: Option<u64>,
    /// UTS (host name) namespace.
    pub uts: Option<u64>,
    /// Time namespace (Linux 5.6 and later).
    pub time: Option<u64>,
}

impl From<&proto::Namespaces> for NamespaceInodes {
    fn from(n: &proto::Namespaces) -> NamespaceInodes {
        NamespaceInodes {
            mnt: known(n.mnt),
            net: known(n.net),
            pid: known(n.pid),
            user: known(n.user),
            cgroup: known(n.cgroup),
            ipc: known(n.ipc),
            uts: known(n.uts),
            time: known(n.time),
        }
    }
}

fn known(x: u64) -> Option<u64> {
    (x != 0).then_some(x)
}

fn some(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for lookout_api::v1::Container {}
}

/// Typed reads of a [`proto::Container`]: "not known" (`0`, `""`, an
/// unset message) is `None`, and the kind is an enum.
///
/// Import it to call these on any container a [`Client`](crate::Client),
/// [`Watcher`](crate::Watcher) or [`Gate`](crate::Gate) hands out. It is
/// sealed: only `proto::Container` implements it, so methods can be added.
///
/// ```
/// use lookout_client::proto::{self, IdMapping, IdMaps};
/// use lookout_client::{ContainerExt, ContainerKind};
///
/// let c = proto::Container {
///     id: "4f1c".into(),
///     cgroup_id: 7_301,
///     kind: "regular".into(),
///     image_digest: "registry.example/api@sha256:9b2e".into(),
///     kubernetes: Some(proto::Kubernetes {
///         workload: Some(proto::Workload {
///             kind: "Deployment".into(),
///             namespace: "shop".into(),
///             name: "api".into(),
///             ..Default::default()
///         }),
///         ..Default::default()
///     }),
///     namespaces: Some(proto::Namespaces { mnt: 4_026_532_301, ..Default::default() }),
///     // A pod with hostUsers: false.
///     id_maps: Some(IdMaps {
///         uid: vec![IdMapping { container_id: 0, host_id: 100_000, size: 65_536 }],
///         gid: vec![IdMapping { container_id: 0, host_id: 100_000, size: 65_536 }],
///     }),
///     unresolved: [("kubernetes.workload".to_owned(), "no pod watch".to_owned())].into(),
///     ..Default::default()
/// };
/// assert_eq!(c.cgroup_id(), Some(7_301));
/// assert_eq!(c.kind(), Some(ContainerKind::Regular));
/// assert_eq!(c.workload_key().as_deref(), Some("Deployment/shop/api"));
/// assert_eq!(c.image_digest(), Some("registry.example/api@sha256:9b2e"));
/// assert_eq!(c.namespace_inodes().mnt, Some(4_026_532_301));
/// assert_eq!(c.namespace_inodes().net, None);
/// assert_eq!(c.host_uid(1000), Some(101_000));
/// assert_eq!(c.host_gid(70_000), None);
/// assert_eq!(c.unresolved("kubernetes.workload"), Some("no pod watch"));
/// assert_eq!(c.unresolved("cgroup_id"), None);
///
/// // A container in the host's user namespace: ids are the host's.
/// let host = proto::Container {
///     namespaces: Some(proto::Namespaces { user: 4_026_531_837, ..Default::default() }),
///     ..Default::default()
/// };
/// assert_eq!(host.host_uid(1000), Some(1000));
/// // Maps that could not be read, or a user namespace not known: no answer.
/// assert_eq!(proto::Container::default().host_uid(0), None);
/// ```
pub trait ContainerExt: sealed::Sealed {
    /// The inode number of the container's cgroup v2 directory, which is
    /// what `bpf_get_current_cgroup_id()` returns in its processes. `None`
    /// on a cgroup v1 node or when the agent could not read it:
    /// [`unresolved("cgroup_id")`](ContainerExt::unresolved) says why.
    fn cgroup_id(&self) -> Option<u64>;

    /// What the container is to its pod. `None` when the agent does not
    /// know yet (a later `UPDATED` may say) or sent a kind this client
    /// does not know (`container.kind` has the raw string).
    fn kind(&self) -> Option<ContainerKind>;

    /// The pod's workload, the controller at the top of its owner chain
    /// (a Deployment rather than its ReplicaSet), when known.
    fn workload(&self) -> Option<&proto::Workload>;

    /// The workload as `Kind/namespace/name` (`Deployment/shop/api`), the
    /// form [`Filter::workload`](crate::Filter::workload) takes.
    fn workload_key(&self) -> Option<String>;

    /// The image by digest, `repo@sha256:...`, when known. A Kubernetes
    /// container's usually arrives in an `UPDATED` change after its
    /// `ADDED` (the kubelet writes it once the container started).
    fn image_digest(&self) -> Option<&str>;

    /// The init process's namespace inodes, each `None` when not known.
    fn namespace_inodes(&self) -> NamespaceInodes;

    /// The host's uid of `id` inside the container: through `id_maps` for
    /// a container in a user namespace of its own, `id` itself for one
    /// known to be in the host's. `None` when `id_maps` maps no host uid to
    /// it (the kernel shows such an id as the overflow id, 65534), and
    /// when the maps are not known (`unresolved("id_maps")`, or an agent
    /// that read no user namespace): never a guess, as root inside would
    /// be root on the host.
    fn host_uid(&self, id: u32) -> Option<u32>;

    /// [`host_uid`](ContainerExt::host_uid) for a gid.
    fn host_gid(&self, id: u32) -> Option<u32>;

    /// Why the agent could not fill `field` (or filled it only in part):
    /// `field` as the wire names it, `"cgroup_id"`, `"kubernetes.workload"`.
    fn unresolved(&self, field: &str) -> Option<&str>;
}

impl ContainerExt for proto::Container {
    fn cgroup_id(&self) -> Option<u64> {
        known(self.cgroup_id)
    }

    fn kind(&self) -> Option<ContainerKind> {
        ContainerKind::from_name(&self.kind)
    }

    fn workload(&self) -> Option<&proto::Workload> {
        self.kubernetes
            .as_ref()
            .and_then(|k| k.workload.as_ref())
            .filter(|w| !w.kind.is_empty() && !w.name.is_empty())
    }

    fn workload_key(&self) -> Option<String> {
        self.workload()
            .map(|w| format!("{}/{}/{}", w.kind, w.namespace, w.name))
    }

    fn image_digest(&self) -> Option<&str> {
        some(&self.image_digest)
    }

    fn namespace_inodes(&self) -> NamespaceInodes {
        self.namespaces
            .as_ref()
            .map(NamespaceInodes::from)
            .unwrap_or_default()
    }

    fn host_uid(&self, id: u32) -> Option<u32> {
        match &self.id_maps {
            Some(maps) => host_id(&maps.uid, id),
            None => self.in_host_user_namespace().then_some(id),
        }
    }

    fn host_gid(&self, id: u32) -> Option<u32> {
        match &self.id_maps {
            Some(maps) => host_id(&maps.gid, id),
            None => self.in_host_user_namespace().then_some(id),
        }
    }

    fn unresolved(&self, field: &str) -> Option<&str> {
        self.unresolved.get(field).map(String::as_str)
    }
}

/// For [`ContainerExt::host_uid`] without maps.
trait UserNamespace {
    fn in_host_user_namespace(&self) -> bool;
}

impl UserNamespace for proto::Container {
    /// Known to be in the host's user namespace: the agent read the user
    /// namespace and needed no maps. N.B. not when the maps could not be
    /// read (`unresolved["id_maps"]`), nor from an agent that reads no
    /// user namespace: an unknown map must not read as the host's ids,
    /// where container root would be host root.
    fn in_host_user_namespace(&self) -> bool {
        self.namespaces.as_ref().is_some_and(|n| n.user != 0)
            && !self.unresolved.contains_key("id_maps")
    }
}

/// `id` mapped by the lines of a `uid_map` or `gid_map` (the first line
/// whose range holds it, as the kernel's lines do not overlap).
fn host_id(map: &[proto::IdMapping], id: u32) -> Option<u32> {
    map.iter().find_map(|m| {
        let offset = id.checked_sub(m.container_id)?;
        if offset < m.size {
            m.host_id.checked_add(offset)
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(container_id: u32, host_id: u32, size: u32) -> proto::IdMapping {
        proto::IdMapping {
            container_id,
            host_id,
            size,
        }
    }

    #[test]
    fn zero_and_empty_read_as_not_known() {
        let c = proto::Container::default();
        assert_eq!(c.cgroup_id(), None);
        assert_eq!(c.kind(), None);
        assert_eq!(c.workload(), None);
        assert_eq!(c.workload_key(), None);
        assert_eq!(c.image_digest(), None);
        assert_eq!(c.namespace_inodes(), NamespaceInodes::default());
        assert_eq!(c.unresolved("cgroup_id"), None);
        // A workload message with nothing in it is no workload.
        let c = proto::Container {
            kubernetes: Some(proto::Kubernetes {
                workload: Some(proto::Workload::default()),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(c.workload_key(), None);
    }

    #[test]
    fn every_namespace_is_read() {
        let c = proto::Container {
            namespaces: Some(proto::Namespaces {
                mnt: 1,
                pid: 2,
                net: 3,
                user: 4,
                uts: 5,
                ipc: 6,
                cgroup: 7,
                time: 8,
            }),
            ..Default::default()
        };
        let n = c.namespace_inodes();
        assert_eq!(
            [n.mnt, n.pid, n.net, n.user, n.uts, n.ipc, n.cgroup, n.time],
            [1, 2, 3, 4, 5, 6, 7, 8].map(Some)
        );
    }

    #[test]
    fn kinds_round_trip_and_unknown_ones_are_none() {
        for k in [
            ContainerKind::Regular,
            ContainerKind::Init,
            ContainerKind::Ephemeral,
            ContainerKind::Sandbox,
        ] {
            assert_eq!(ContainerKind::from_name(k.as_str()), Some(k));
            assert_eq!(k.to_string(), k.as_str());
        }
        let c = proto::Container {
            kind: "wasm-module".into(),
            ..Default::default()
        };
        assert_eq!(c.kind(), None);
        assert_eq!(ContainerKind::from_name("Regular"), None);
    }

    #[test]
    fn ids_map_line_by_line_and_unmapped_ones_are_none() {
        let c = proto::Container {
            id_maps: Some(proto::IdMaps {
                uid: vec![mapping(0, 100_000, 1), mapping(1, 200_001, 999)],
                gid: vec![mapping(0, 300_000, 65_536)],
            }),
            ..Default::default()
        };
        assert_eq!(c.host_uid(0), Some(100_000));
        assert_eq!(c.host_uid(1), Some(200_001));
        assert_eq!(c.host_uid(999), Some(200_999));
        assert_eq!(c.host_uid(1000), None);
        assert_eq!(c.host_gid(65_535), Some(365_535));
        assert_eq!(c.host_gid(65_536), None);
        // A line that would pass u32::MAX maps nothing there.
        let c = proto::Container {
            id_maps: Some(proto::IdMaps {
                uid: vec![mapping(0, u32::MAX - 1, 10)],
                gid: vec![],
            }),
            ..Default::default()
        };
        assert_eq!(c.host_uid(1), Some(u32::MAX));
        assert_eq!(c.host_uid(2), None);
        // id_maps set with an empty gid map: no gid is mapped.
        assert_eq!(c.host_gid(0), None);
    }

    #[test]
    fn without_id_maps_ids_are_the_hosts_only_in_the_hosts_user_namespace() {
        let mut c = proto::Container {
            namespaces: Some(proto::Namespaces {
                user: 4_026_531_837,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(c.host_uid(0), Some(0));
        assert_eq!(c.host_gid(u32::MAX), Some(u32::MAX));
        // Its own user namespace, whose maps could not be read: unknown,
        // never root on the host.
        c.unresolved
            .insert("id_maps".into(), "/proc/7/uid_map cannot be read".into());
        assert_eq!(c.host_uid(0), None);
        assert_eq!(c.host_gid(0), None);
        // An agent that read no user namespace.
        assert_eq!(proto::Container::default().host_uid(0), None);
    }

    #[test]
    fn workload_key_is_kind_namespace_name() {
        let c = proto::Container {
            kubernetes: Some(proto::Kubernetes {
                workload: Some(proto::Workload {
                    kind: "CronJob".into(),
                    name: "nightly".into(),
                    namespace: "batch".into(),
                    api_version: "batch/v1".into(),
                    uid: "u".into(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(c.workload_key().as_deref(), Some("CronJob/batch/nightly"));
        assert_eq!(
            c.workload().map(|w| w.api_version.as_str()),
            Some("batch/v1")
        );
    }
}
