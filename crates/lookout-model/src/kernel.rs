//! What the kernel says a container's init runs in: its namespaces, and
//! a user namespace's id maps. The reads are lookout-host's.

use serde::{Deserialize, Serialize};

/// Namespace inode numbers of the container's init process: the value
/// of `stat(2)`'s `st_ino` on `/proc/<pid>/ns/<name>`, which a BPF program
/// compares with `task->nsproxy->mnt_ns->ns.inum` and its kin.
///
/// `mnt`, `net` and `pid` are written as `null` when unknown (as ever);
/// the others are left out then.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[non_exhaustive]
pub struct Namespaces {
    /// Mount namespace.
    pub mnt: Option<u64>,
    /// Network namespace.
    pub net: Option<u64>,
    /// Pid namespace.
    pub pid: Option<u64>,
    /// User namespace: the host's unless the container has its own (then
    /// [`Container::id_maps`] says how its ids map to the host's).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub user: Option<u64>,
    /// Cgroup namespace.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub cgroup: Option<u64>,
    /// IPC namespace.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub ipc: Option<u64>,
    /// UTS (host name) namespace.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub uts: Option<u64>,
    /// Time namespace (Linux 5.6+).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub time: Option<u64>,
}

/// One line of a user namespace's `uid_map` or `gid_map`: ids
/// `container_id .. container_id + size` inside are `host_id ..` outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[non_exhaustive]
pub struct IdMapping {
    /// The first id inside the container's user namespace.
    pub container_id: u32,
    /// The id it is on the host.
    pub host_id: u32,
    /// How many consecutive ids the line maps.
    pub size: u32,
}

impl IdMapping {
    /// A mapping of `size` ids from `container_id` inside to `host_id` on
    /// the host.
    pub fn new(container_id: u32, host_id: u32, size: u32) -> IdMapping {
        IdMapping {
            container_id,
            host_id,
            size,
        }
    }
}

/// How a container with its own user namespace sees the host's ids (a
/// pod with `hostUsers: false`, a rootless or userns-remapped engine).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[non_exhaustive]
pub struct IdMaps {
    /// `/proc/<pid>/uid_map`, line by line.
    pub uid: Vec<IdMapping>,
    /// `/proc/<pid>/gid_map`, line by line.
    pub gid: Vec<IdMapping>,
}

impl IdMaps {
    /// The host id of `id` inside, by `map` (`uid` or `gid`): `None` when
    /// no line maps it (the kernel shows such an id as the overflow id).
    ///
    /// ```
    /// use lookout_model::{IdMapping, IdMaps};
    /// let mut maps = IdMaps::default();
    /// maps.uid.push(IdMapping::new(0, 100000, 65536));
    /// assert_eq!(IdMaps::host_id(&maps.uid, 0), Some(100000));
    /// assert_eq!(IdMaps::host_id(&maps.uid, 65536), None);
    /// ```
    pub fn host_id(map: &[IdMapping], id: u32) -> Option<u32> {
        map.iter().find_map(|m| {
            let offset = id.checked_sub(m.container_id)?;
            (offset < m.size)
                .then(|| m.host_id.checked_add(offset))
                .flatten()
        })
    }
}
