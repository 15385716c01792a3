//! Filling a [`Container`] from its init process and its config.json. A
//! leaf module: the hook and the scan both use it.

use lookout_model::{Container, RuntimeKind, Status};

use crate::oci::OciConfig;
use lookout_host::proc;

/// Sets what the init process `pid` and the bundle's `config` tell about
/// `c`: pid, status, namespaces, cgroup and its id, id maps, annotations (and the Kubernetes
/// identity in them), hostname and args, moved out of `config` (a
/// container's annotations can be 256 KiB: they are not copied). Reads
/// /proc: call it off the hook's task. Exported as [`crate::fill_container`].
pub fn fill(c: &mut Container, pid: u32, config: Option<OciConfig>, status: Status) {
    fill_with(c, pid, None, config, status);
}

/// [`fill`] for an init process [`proc::container_init`] checked: its
/// mount namespace is not read again. Exported as
/// [`crate::fill_container_init`].
pub fn fill_init(c: &mut Container, init: &proc::Init, config: Option<OciConfig>, status: Status) {
    fill_with(c, init.pid, Some(init.mnt), config, status);
}

fn fill_with(
    c: &mut Container,
    pid: u32,
    mnt: Option<u64>,
    config: Option<OciConfig>,
    status: Status,
) {
    c.pid = Some(pid);
    c.status = status;
    if c.runtime == RuntimeKind::Runsc {
        c.sandbox = Some("gvisor".into());
    }
    lookout_host::kernel::fill(c, pid, mnt);
    if let Some(cfg) = config {
        c.annotations = cfg.annotations;
        c.kubernetes = lookout_model::Kubernetes::from_annotations(&c.annotations);
        c.pod_sandbox = lookout_model::is_pod_sandbox(&c.annotations);
        if c.pod_sandbox {
            c.kind = Some(lookout_model::ContainerKind::Sandbox);
        }
        c.hostname = cfg.hostname;
        c.args = cfg.process.map(|p| p.args).unwrap_or_default();
    }
}
