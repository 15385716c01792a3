//! The types every lookout crate shares: a [`Container`], the
//! [`ContainerEvent`]s that announce it, and where they came from.
//!
//! # Overview
//!
//! - [`Container`]: id, runtime, pid, bundle, status, namespaces, cgroup,
//!   OCI annotations and process args.
//! - [`ContainerEvent`]: `added` or `removed`, stamped with
//!   [`monotonic_ns`] (`CLOCK_MONOTONIC`, so latency can be measured from
//!   outside the agent) and the [`Source`] that saw it.
//! - The JSON form is what `lookout run` prints, one object per line,
//!   versioned by [`SCHEMA_VERSION`] (docs/events.md):
//!
//! ```
//! use lookout_model::*;
//! let c = Container::new("abc", RuntimeKind::Runc);
//! let e = ContainerEvent::added(Source::RuntimeHook, c);
//! let line = serde_json::to_string(&e).unwrap();
//! assert!(line.starts_with(r#"{"schema":1,"event":"added","monotonic_ns":"#));
//! assert!(line.contains(r#""source":"runtime-hook""#));
//! ```
#![deny(missing_docs)]

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

mod kernel;
mod kubernetes;

pub use kernel::{IdMapping, IdMaps, Namespaces};
pub use kubernetes::{ContainerKind, Kubernetes, Workload, is_pod_sandbox};

/// Checks a container id the way runc does (`^[\w+-\.]+$`, not `.` or
/// `..`, at most 1024 bytes). Ids become path components (state
/// directories, hook state): every source of ids checks them so.
pub fn valid_container_id(id: &str) -> bool {
    !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= 1024
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_+-.".contains(&b))
}

/// Displays an error with its whole chain of causes, `outer: cause: root`.
///
/// lookout's errors keep their causes as [`std::error::Error::source`] and
/// do not repeat them in their own message; log sites print them with this
/// (as `anyhow`'s `{:#}` does). A cause whose text is already printed is
/// left out: some libraries' errors (kube's, aya's) repeat their cause in
/// their message, and it should not appear twice.
///
/// ```
/// use lookout_model::Chain;
/// #[derive(Debug)]
/// struct ReadConfig(std::io::Error);
/// impl std::fmt::Display for ReadConfig {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("reading config.json")
///     }
/// }
/// impl std::error::Error for ReadConfig {
///     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
///         Some(&self.0)
///     }
/// }
/// let e = ReadConfig(std::io::Error::other("disk on fire"));
/// assert_eq!(Chain(&e).to_string(), "reading config.json: disk on fire");
/// ```
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(e) = cause {
            let text = e.to_string();
            if !out.contains(&text) {
                out.push_str(": ");
                out.push_str(&text);
            }
            cause = e.source();
        }
        f.write_str(&out)
    }
}

impl fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Receives container events from a discovery backend.
///
/// The runtime hook calls it on its own task *before* the runtime exec that
/// caused the event is allowed: keep it quick (hand the event to another
/// thread, with a deadline, as `lookout run` does).
pub trait Sink {
    /// One event.
    fn emit(&mut self, event: ContainerEvent);
}

impl<F: FnMut(ContainerEvent)> Sink for F {
    fn emit(&mut self, event: ContainerEvent) {
        self(event)
    }
}

/// What a [`StartBarrier`] decided about a container's start.
///
/// Exhaustive on purpose: whoever holds a start must handle every
/// decision, and a new one must be a compile error there, not a silent
/// default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartDecision {
    /// The runtime's `start` goes on.
    Proceed,
    /// The runtime's `start` exec is refused (`EPERM`), and the
    /// container's init process, still waiting for `start` in the
    /// runtime's init, is killed: the container never runs its first
    /// instruction, and is reported removed.
    Deny(String),
}

/// A future a [`StartBarrier`] returns.
pub type StartWait = std::pin::Pin<Box<dyn std::future::Future<Output = StartDecision> + Send>>;

/// Something the runtime's `start` of a container waits for, such as the
/// container's prestart hooks or a consumer's gate. Called right after the container was
/// reported (the `added` event went to the [`Sink`]), by whatever holds the
/// start: lookout-runtime-hook's fanotify gate, or the NRI plugin.
pub trait StartBarrier: Send + Sync {
    /// A future that completes when `start` of container `id` may go on
    /// (or must not), or `None` to go on at once. The hook waits at most
    /// its own cap (then proceeds), without holding up
    /// other execs. The hook polls the future once on its own task (a
    /// barrier that has already decided costs no task), so neither `wait`
    /// nor a poll may block.
    fn wait(&self, id: &str) -> Option<StartWait>;

    /// [`wait`](Self::wait) for a caller that stops waiting at `until`
    /// (an NRI plugin answers the runtime by its request deadline). A
    /// barrier with deadlines of its own should decide by then, so that
    /// its decision, not the caller's timeout, settles the start. The
    /// default ignores `until`.
    fn wait_until(&self, id: &str, until: std::time::Instant) -> Option<StartWait> {
        let _ = until;
        self.wait(id)
    }

    /// The start of container `id` happened: the runtime's `start`
    /// returned with the container's process released (the hook: the
    /// runtime's `start` exited and the container left its exec fifo;
    /// NRI: PostStartContainer). What runs after a start (`poststart`
    /// hooks) starts here. Called on the holder's task: must not block.
    /// The default does nothing.
    fn started(&self, id: &str) {
        let _ = id;
    }
}

/// `CLOCK_MONOTONIC` now, in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// The OCI runtime (or monitor) that runs a container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RuntimeKind {
    /// runc.
    Runc,
    /// crun.
    Crun,
    /// gVisor's runsc.
    Runsc,
    /// youki.
    Youki,
    /// conmon (the monitor CRI-O and podman put in front of the runtime).
    Conmon,
    /// Anything else, by binary name.
    #[serde(untagged)]
    Other(String),
}

impl RuntimeKind {
    /// The kind for a binary's file name (`runc`, `crun`, ...).
    pub fn from_binary_name(name: &str) -> RuntimeKind {
        match name {
            "runc" => RuntimeKind::Runc,
            "crun" => RuntimeKind::Crun,
            "runsc" => RuntimeKind::Runsc,
            "youki" => RuntimeKind::Youki,
            "conmon" => RuntimeKind::Conmon,
            other => RuntimeKind::Other(other.to_owned()),
        }
    }

    /// The name as printed.
    pub fn as_str(&self) -> &str {
        match self {
            RuntimeKind::Runc => "runc",
            RuntimeKind::Crun => "crun",
            RuntimeKind::Runsc => "runsc",
            RuntimeKind::Youki => "youki",
            RuntimeKind::Conmon => "conmon",
            RuntimeKind::Other(s) => s,
        }
    }
}

impl fmt::Display for RuntimeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which part of lookout saw a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Source {
    /// The runtime hook (fanotify on the runtime binaries).
    RuntimeHook,
    /// The start-up scan of runtime state directories.
    StateScan,
    /// The Kubernetes Pod informer.
    Informer,
    /// The runtime, through NRI (CreateContainer, StartContainer, ...).
    Nri,
    /// NRI's Synchronize: what already ran when lookout registered.
    NriSync,
    /// The Docker Engine API (an `updated` event's name, image and labels).
    Docker,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::RuntimeHook => "runtime-hook",
            Source::StateScan => "state-scan",
            Source::Informer => "informer",
            Source::Nri => "nri",
            Source::NriSync => "nri-sync",
            Source::Docker => "docker",
        })
    }
}

/// The OCI status of a container when it was reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Status {
    /// Created, its process waiting to be started.
    Created,
    /// Its process runs.
    Running,
    /// Its process exited.
    Stopped,
}

/// A container as lookout knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[non_exhaustive]
pub struct Container {
    /// The runtime's container id.
    pub id: String,
    /// The runtime that runs it.
    pub runtime: RuntimeKind,
    /// The host pid of its init process, once known.
    pub pid: Option<u32>,
    /// The OCI bundle directory (host path).
    pub bundle: Option<PathBuf>,
    /// Its status when reported.
    pub status: Status,
    /// Namespace inodes of its init process.
    pub namespaces: Namespaces,
    /// Its cgroup path (from `/proc/<pid>/cgroup`, the unified or first line).
    pub cgroup: Option<String>,
    /// OCI annotations from config.json.
    pub annotations: BTreeMap<String, String>,
    /// `process.args` from config.json.
    pub args: Vec<String>,
    /// `hostname` from config.json.
    pub hostname: Option<String>,
    /// The runtime's state directory root (`--root`), if known.
    pub runtime_root: Option<PathBuf>,
    /// The sandbox that isolates the container from the host's kernel:
    /// `gvisor` for runsc. Absent for runtimes whose containers run on the
    /// host's kernel (runc, crun, youki). For a sandboxed container, `pid`
    /// is the sandbox's host process: its own processes have no host pid.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub sandbox: Option<String>,
    /// Kubernetes identity (pod, container name, labels), when known: from
    /// the CRI annotations in config.json or from the Pod informer.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub kubernetes: Option<Kubernetes>,
    /// A pod's sandbox (the pause container, or NRI's pod sandbox), not
    /// one of its containers: it carries the pod's identity, with no
    /// container name.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub pod_sandbox: bool,
    /// The container's name in its engine (Docker's `--name`), when known.
    /// It may arrive after `added`, in an `updated` event.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub name: Option<String>,
    /// The image as the engine was asked for it (Docker's `Config.Image`:
    /// `nginx:1.27`), when known. A CRI container's is
    /// `kubernetes.image`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub image: Option<String>,
    /// The image's id in the engine (`sha256:...`), when known.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub image_id: Option<String>,
    /// The engine's labels of the container (Docker's `--label`s; on a
    /// cri-dockerd node, `io.kubernetes.*` among them). Not the OCI
    /// annotations, which are in `annotations`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty", default)]
    pub labels: BTreeMap<String, String>,
    /// The image by digest, `repo@sha256:...`, when known (the Pod's
    /// `status.containerStatuses[].imageID`). Docker's containers carry
    /// their engine's `image_id` instead.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub image_digest: Option<String>,
    /// The inode number of the container's cgroup v2 directory: what
    /// `bpf_get_current_cgroup_id()` returns for its processes. Absent
    /// without a cgroup v2 hierarchy (`unresolved` says why).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub cgroup_id: Option<u64>,
    /// For a container in a user namespace of its own: how its ids map to
    /// the host's. Absent for a container in the host's user namespace.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub id_maps: Option<IdMaps>,
    /// What the container is to its pod (regular, init, ephemeral,
    /// sandbox), when known: `sandbox` from the runtime's annotations, the
    /// others from the pod's spec.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub kind: Option<ContainerKind>,
    /// Fields lookout could not fill, or filled only in part, and why:
    /// `{"cgroup_id": "no cgroup v2 hierarchy is mounted"}`. A field
    /// absent without an entry here was not known to its source.
    #[serde(skip_serializing_if = "BTreeMap::is_empty", default)]
    pub unresolved: BTreeMap<String, String>,
}

impl Container {
    /// A container with only an id and a runtime.
    pub fn new(id: impl Into<String>, runtime: RuntimeKind) -> Container {
        Container {
            id: id.into(),
            runtime,
            pid: None,
            bundle: None,
            status: Status::Created,
            namespaces: Namespaces::default(),
            cgroup: None,
            annotations: BTreeMap::new(),
            args: Vec::new(),
            hostname: None,
            runtime_root: None,
            kubernetes: None,
            sandbox: None,
            pod_sandbox: false,
            name: None,
            image: None,
            image_id: None,
            labels: BTreeMap::new(),
            image_digest: None,
            cgroup_id: None,
            id_maps: None,
            kind: None,
            unresolved: BTreeMap::new(),
        }
    }

    /// Records why `field` is unknown or partial (see
    /// [`unresolved`](Self::unresolved)).
    pub fn set_unresolved(&mut self, field: &str, why: impl Into<String>) {
        self.unresolved.insert(field.to_owned(), why.into());
    }

    /// Fills what `self` lacks of the identity lookout learns after
    /// `added` (name, image, image id and digest, labels, kind, Kubernetes
    /// identity and its workload) from `known`: an
    /// earlier report of the same container (a `removed` event built by a
    /// backend that never learnt them still carries them), or an `updated`
    /// one (which changes nothing else: not the pid, not the status).
    pub fn fill_identity_from(&mut self, known: &Container) {
        if self.name.is_none() {
            self.name.clone_from(&known.name);
        }
        if self.image.is_none() {
            self.image.clone_from(&known.image);
        }
        if self.image_id.is_none() {
            self.image_id.clone_from(&known.image_id);
        }
        if self.labels.is_empty() {
            self.labels.clone_from(&known.labels);
        }
        if self.image_digest.is_none() {
            self.image_digest.clone_from(&known.image_digest);
        }
        if self.kind.is_none() {
            self.kind = known.kind;
        }
        match (&mut self.kubernetes, &known.kubernetes) {
            (None, _) => {
                self.kubernetes.clone_from(&known.kubernetes);
                self.pod_sandbox |= known.pod_sandbox;
                if let Some(why) = known.unresolved.get(WORKLOAD_FIELD)
                    && known
                        .kubernetes
                        .as_ref()
                        .is_some_and(|k| k.workload.is_some())
                {
                    self.unresolved
                        .insert(WORKLOAD_FIELD.to_owned(), why.clone());
                }
            }
            (Some(mine), Some(theirs)) if mine.workload.is_none() => {
                mine.workload.clone_from(&theirs.workload);
                // A workload known in part keeps saying so.
                if let Some(why) = known.unresolved.get(WORKLOAD_FIELD)
                    && theirs.workload.is_some()
                {
                    self.unresolved
                        .insert(WORKLOAD_FIELD.to_owned(), why.clone());
                }
            }
            _ => {}
        }
    }

    /// Takes what the kernel said of the container while it lived (its
    /// pid, namespaces, cgroup path and id, id maps, and why any of those
    /// is unknown) from `live`, the record reported at `added` or since.
    /// For a `removed` event built by a backend that never read them (the
    /// Pod informer without the pid) or that reads them once the init is
    /// gone (then they are empty, or another process's if the pid was
    /// reused): a consumer keys its maps by these, and must find the same
    /// keys at `removed` as at `added`. Does nothing when `live` never
    /// knew the pid.
    pub fn take_kernel_view_from(&mut self, live: &Container) {
        if live.pid.is_none() {
            return;
        }
        self.pid = live.pid;
        self.namespaces.clone_from(&live.namespaces);
        self.cgroup.clone_from(&live.cgroup);
        self.cgroup_id = live.cgroup_id;
        self.id_maps.clone_from(&live.id_maps);
        for field in KERNEL_FIELDS {
            match live.unresolved.get(field) {
                Some(why) => self.unresolved.insert(field.to_owned(), why.clone()),
                None => self.unresolved.remove(field),
            };
        }
    }

    /// Whether [`take_kernel_view_from`](Self::take_kernel_view_from)
    /// would change `self`.
    pub fn differs_in_kernel_view(&self, live: &Container) -> bool {
        live.pid.is_some()
            && (self.pid != live.pid
                || self.namespaces != live.namespaces
                || self.cgroup != live.cgroup
                || self.cgroup_id != live.cgroup_id
                || self.id_maps != live.id_maps
                || KERNEL_FIELDS
                    .iter()
                    .any(|f| self.unresolved.get(*f) != live.unresolved.get(*f)))
    }

    /// Whether [`fill_identity_from`](Self::fill_identity_from) would
    /// change `self`: a shared record is copied only when it would.
    pub fn lacks_identity_of(&self, known: &Container) -> bool {
        (self.name.is_none() && known.name.is_some())
            || (self.image.is_none() && known.image.is_some())
            || (self.image_id.is_none() && known.image_id.is_some())
            || (self.labels.is_empty() && !known.labels.is_empty())
            || (self.image_digest.is_none() && known.image_digest.is_some())
            || (self.kind.is_none() && known.kind.is_some())
            || match (&self.kubernetes, &known.kubernetes) {
                (None, theirs) => theirs.is_some() || (known.pod_sandbox && !self.pod_sandbox),
                (Some(mine), Some(theirs)) => mine.workload.is_none() && theirs.workload.is_some(),
                (Some(_), None) => false,
            }
    }
}

/// The [`Container::unresolved`] key of a workload known only in part.
const WORKLOAD_FIELD: &str = "kubernetes.workload";

/// The [`Container::unresolved`] keys of the kernel's view.
const KERNEL_FIELDS: [&str; 2] = ["cgroup_id", "id_maps"];

/// What happened to a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    /// It was created (or found running).
    Added,
    /// Its init process exited.
    Removed,
    /// lookout learnt more of it after `added` (Docker's name, image and
    /// labels, which dockerd gives only once the start is over): the
    /// event carries the whole container as now known. Never after
    /// `removed`.
    Updated,
}

/// The version of the event's JSON form, in every event as `schema`. It
/// grows when a field changes meaning or goes away; added fields keep it
/// (consumers ignore fields they do not know). See docs/events.md.
pub const SCHEMA_VERSION: u32 = 1;

fn schema_version() -> u32 {
    SCHEMA_VERSION
}

/// One event, as printed by `lookout run` (one JSON object per line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[non_exhaustive]
pub struct ContainerEvent {
    /// The version of this JSON form ([`SCHEMA_VERSION`]).
    #[serde(default = "schema_version")]
    pub schema: u32,
    /// Added, updated or removed.
    pub event: EventKind,
    /// `CLOCK_MONOTONIC` nanoseconds when lookout observed it.
    pub monotonic_ns: u64,
    /// Who saw it.
    pub source: Source,
    /// The container, shared: the agent's tables, its consumers and the
    /// events in flight hold one record (a container's annotations can be
    /// 256 KiB). Change it with [`Arc::make_mut`], which copies it only
    /// while someone else holds it too. Serialized as the container
    /// itself.
    #[cfg_attr(feature = "schemars", schemars(description = "The container."))]
    pub container: Arc<Container>,
    /// For `removed`: the exit code, when known.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub exit_code: Option<i32>,
    /// For `removed`: why, when lookout knows more than the exit code (a
    /// gate denied the container's start).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reason: Option<String>,
}

impl ContainerEvent {
    /// An `added` event stamped now.
    pub fn added(source: Source, container: impl Into<Arc<Container>>) -> ContainerEvent {
        ContainerEvent {
            schema: SCHEMA_VERSION,
            event: EventKind::Added,
            monotonic_ns: monotonic_ns(),
            source,
            container: container.into(),
            exit_code: None,
            reason: None,
        }
    }

    /// An `updated` event stamped now: `container` as now known.
    pub fn updated(source: Source, container: impl Into<Arc<Container>>) -> ContainerEvent {
        ContainerEvent {
            schema: SCHEMA_VERSION,
            event: EventKind::Updated,
            monotonic_ns: monotonic_ns(),
            source,
            container: container.into(),
            exit_code: None,
            reason: None,
        }
    }

    /// A `removed` event stamped now, its container's status `stopped`
    /// (copied first if it is shared and not stopped yet).
    pub fn removed(
        source: Source,
        container: impl Into<Arc<Container>>,
        exit_code: Option<i32>,
    ) -> ContainerEvent {
        let mut container = container.into();
        if container.status != Status::Stopped {
            Arc::make_mut(&mut container).status = Status::Stopped;
        }
        ContainerEvent {
            schema: SCHEMA_VERSION,
            event: EventKind::Removed,
            monotonic_ns: monotonic_ns(),
            source,
            container,
            exit_code,
            reason: None,
        }
    }
}

// Compiles the README's examples as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_shape_is_stable() {
        let mut c = Container::new("c1", RuntimeKind::Crun);
        c.pid = Some(42);
        let e = ContainerEvent::removed(Source::StateScan, c, Some(3));
        let v: serde_json::Value = serde_json::to_value(&e).expect("serialize");
        assert_eq!(v["event"], "removed");
        assert_eq!(v["source"], "state-scan");
        assert_eq!(v["exit_code"], 3);
        assert_eq!(v["container"]["runtime"], "crun");
        assert_eq!(v["container"]["status"], "stopped");
        assert_eq!(v["container"]["pid"], 42);
        let back: ContainerEvent = serde_json::from_value(v).expect("round trip");
        assert_eq!(back, e);
    }

    /// `lacks_identity_of` says exactly when `fill_identity_from` changes
    /// something: a shared record is copied then and only then.
    #[test]
    fn lacks_identity_of_is_exactly_when_the_fill_changes_something() {
        let variants = |c: &mut Container, bits: u16| {
            if bits & 1 != 0 {
                c.name = Some("n".into());
            }
            if bits & 2 != 0 {
                c.image = Some("i".into());
            }
            if bits & 4 != 0 {
                c.image_id = Some("sha".into());
            }
            if bits & 8 != 0 {
                c.labels.insert("l".into(), "v".into());
            }
            if bits & 16 != 0 {
                c.kubernetes = Some(Kubernetes::default());
            }
            if bits & 32 != 0 {
                c.pod_sandbox = true;
            }
            if bits & 64 != 0 {
                c.image_digest = Some("r@sha256:1".into());
            }
            if bits & 128 != 0 {
                c.kind = Some(ContainerKind::Init);
            }
            if bits & 256 != 0
                && let Some(k) = c.kubernetes.as_mut()
            {
                k.workload = Some(Workload::default());
            }
        };
        for mine in 0..512u16 {
            for theirs in 0..512u16 {
                let mut a = Container::new("c", RuntimeKind::Runc);
                variants(&mut a, mine);
                let mut b = Container::new("c", RuntimeKind::Runc);
                variants(&mut b, theirs);
                let mut filled = a.clone();
                filled.fill_identity_from(&b);
                assert_eq!(
                    a.lacks_identity_of(&b),
                    filled != a,
                    "mine {mine:09b}, theirs {theirs:09b}"
                );
            }
        }
    }

    /// A workload known only in part says so wherever it is copied; the
    /// kernel's view of a removal is the live record's.
    #[test]
    fn a_partial_workload_keeps_its_reason_and_a_removal_the_live_kernel_view() {
        let mut known = Container::new("c", RuntimeKind::Runc);
        known.kubernetes = Some(Kubernetes {
            workload: Some(Workload::default()),
            ..Kubernetes::default()
        });
        known.set_unresolved("kubernetes.workload", "ReplicaSet shop/a not found (404)");
        let mut mine = Container::new("c", RuntimeKind::Runc);
        mine.fill_identity_from(&known);
        assert_eq!(
            mine.unresolved
                .get("kubernetes.workload")
                .map(String::as_str),
            Some("ReplicaSet shop/a not found (404)")
        );

        let mut live = Container::new("c", RuntimeKind::Runc);
        live.pid = Some(7);
        live.cgroup_id = Some(42);
        live.namespaces.user = Some(3);
        let mut gone = Container::new("c", RuntimeKind::Runc);
        gone.pid = Some(7);
        gone.set_unresolved("cgroup_id", "/proc/7/cgroup is unreadable");
        assert!(gone.differs_in_kernel_view(&live));
        gone.take_kernel_view_from(&live);
        assert!(!gone.differs_in_kernel_view(&live));
        assert_eq!((gone.cgroup_id, gone.namespaces.user), (Some(42), Some(3)));
        assert!(gone.unresolved.is_empty());
        // A live record that never knew the pid teaches nothing.
        let blind = Container::new("c", RuntimeKind::Runc);
        assert!(!gone.differs_in_kernel_view(&blind));
    }

    #[test]
    fn other_runtimes_keep_their_name() {
        let k = RuntimeKind::from_binary_name("kata-runtime");
        assert_eq!(serde_json::to_string(&k).expect("ser"), "\"kata-runtime\"");
        assert!(monotonic_ns() > 0);
    }
}
