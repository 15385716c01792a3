//! Probe what a Linux node supports for container discovery, and choose the
//! best discovery mode, with a reason for every better mode refused.
//!
//! # Overview
//!
//! [`probe`] runs every check once and returns a [`ProbeReport`]:
//!
//! - fanotify: `fanotify_init(FAN_CLASS_CONTENT)`, a `FAN_OPEN_EXEC_PERM`
//!   mark on a real runtime binary, `FAN_REPORT_TID`, `FAN_REPORT_DFID_NAME`;
//! - BPF: the agent's embedded object, BTF, a ring buffer map, a tracepoint
//!   program that must deliver one event end to end;
//! - the kernel, capabilities, pid and user namespaces, sandboxes (gVisor);
//! - runtime binaries under the host root ([`find_runtimes`]);
//! - Kubernetes configuration and `NODE_NAME`; the cgroup layout.
//!
//! From these, [`Facts::decide`] walks the [`Mode::LADDER`]
//! (fanotify-ebpf → fanotify → podinformer → scan) and picks the first mode
//! whose requirements hold. Checks never fail the probe: a failing check is
//! a finding, with the errno and its likely cause in its detail.
//!
//! Probing leaves nothing behind: every fanotify group and BPF program it
//! creates is closed before [`probe`] returns. The exec-permission mark on
//! the runtime binary lives for two syscalls, and the group is drained
//! (allowing any exec it caught) before it closes.
//!
//! # Example
//!
//! ```no_run
//! let report = lookout_probe::probe(&lookout_probe::ProbeOptions::new());
//! println!("{report}");
//! println!("{}", report.summary());
//! ```
#![deny(missing_docs)]

mod bpf;
mod decide;
mod errno;
mod fanotify;
mod mode;
mod pinned;
mod report;
mod runtimes;
mod system;
mod tracefs;

use std::path::{Path, PathBuf};

pub use bpf::BpfFacts;
pub use decide::Facts;
pub use errno::{describe as describe_io_error, errno_name};
pub use fanotify::{FanotifyFacts, explain_init as explain_fanotify_init};
pub use mode::{Mode, Refusal, UnknownMode};
pub use report::{Check, Fail, ProbeReport, Status};
pub use runtimes::{
    KNOWN_RUNTIME_PATHS, RUNTIME_NAMES, RuntimeBinary, candidate_paths, find_runtimes,
};
pub use tracefs::{TRACEFS_PATHS, Tracefs, ensure_tracefs, tracefs_path};

/// Where containerd and CRI-O put their NRI socket by default.
pub const DEFAULT_NRI_SOCKET: &str = "/var/run/nri/nri.sock";

/// How an environment variable is looked up (replaceable in tests).
type EnvLookup = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Inputs of a probe run.
pub struct ProbeOptions<'a> {
    host_root: PathBuf,
    bpf_object: Option<&'a [u8]>,
    runtime_paths: Vec<PathBuf>,
    default_runtimes: bool,
    nri_socket: PathBuf,
    docker_sockets: Vec<PathBuf>,
    bpf_pin_dir: Option<PathBuf>,
    env: EnvLookup,
}

impl Default for ProbeOptions<'_> {
    fn default() -> Self {
        ProbeOptions {
            host_root: PathBuf::from("/"),
            bpf_object: None,
            runtime_paths: Vec::new(),
            default_runtimes: true,
            nri_socket: PathBuf::from(DEFAULT_NRI_SOCKET),
            docker_sockets: vec![PathBuf::from(lookout_docker::DEFAULT_SOCKET)],
            bpf_pin_dir: None,
            env: Box::new(|k| std::env::var(k).ok()),
        }
    }
}

impl std::fmt::Debug for ProbeOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeOptions")
            .field("host_root", &self.host_root)
            .field("bpf_object", &self.bpf_object.map(<[u8]>::len))
            .field("runtime_paths", &self.runtime_paths)
            .field("default_runtimes", &self.default_runtimes)
            .field("nri_socket", &self.nri_socket)
            .field("docker_sockets", &self.docker_sockets)
            .field("bpf_pin_dir", &self.bpf_pin_dir)
            .finish()
    }
}

impl<'a> ProbeOptions<'a> {
    /// Defaults: host root `/`, no BPF object, the process environment.
    pub fn new() -> Self {
        Self::default()
    }

    /// The runtime's NRI socket, a host path (default
    /// [`DEFAULT_NRI_SOCKET`]), for the `nri:socket` check.
    pub fn nri_socket(mut self, socket: impl Into<PathBuf>) -> Self {
        self.nri_socket = socket.into();
        self
    }

    /// dockerd's sockets, host paths (default `/run/docker.sock`; none:
    /// no check), for the `docker:socket` check.
    pub fn docker_sockets(mut self, sockets: Vec<PathBuf>) -> Self {
        self.docker_sockets = sockets;
        self
    }

    /// The directory where `lookout run` pins its container maps (its
    /// `--bpf-pin-dir`, a path in this mount namespace), for the
    /// `bpf:pinned-maps` check; `None` (the default): no check.
    pub fn bpf_pin_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.bpf_pin_dir = dir;
        self
    }

    /// Where the host's file system is mounted (default `/`; in a pod,
    /// typically `/host`).
    pub fn host_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.host_root = root.into();
        self
    }

    /// The BPF object to try (the agent embeds it); `None` or empty means
    /// it is missing.
    pub fn bpf_object(mut self, object: Option<&'a [u8]>) -> Self {
        self.bpf_object = object;
        self
    }

    /// Extra runtime binary paths (host paths), like `--runtime-path`.
    pub fn runtime_paths(mut self, paths: Vec<PathBuf>) -> Self {
        self.runtime_paths = paths;
        self
    }

    /// Whether to look for runtimes in the built-in list of install
    /// locations and in `PATH` (default `true`). With `false`, only the
    /// [`runtime_paths`](Self::runtime_paths) are looked at: a node whose
    /// runtimes are known, or a test that watches a private copy.
    pub fn default_runtimes(mut self, yes: bool) -> Self {
        self.default_runtimes = yes;
        self
    }

    /// Replaces the environment lookup (`NODE_NAME`, `KUBECONFIG`, ...).
    pub fn env(mut self, lookup: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> Self {
        self.env = Box::new(lookup);
        self
    }
}

/// An error with its causes, each once (see [`lookout_model::Chain`]).
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    lookout_model::Chain(err).to_string()
}

fn unit(r: &Result<String, Fail>) -> Result<(), String> {
    r.as_ref().map(|_| ()).map_err(|f| f.reason.clone())
}

/// Runs every check and decides the discovery mode.
pub fn probe(opts: &ProbeOptions<'_>) -> ProbeReport {
    let mut checks = Vec::new();
    let env = |k: &str| (opts.env)(k);

    checks.push(Check::from_result("kernel", &system::kernel_release()));
    checks.extend(system::capability_checks(&system::effective_caps()));
    let pidns = system::host_pid_namespace();
    checks.push(Check::from_result("namespace:pid", &pidns));
    checks.push(Check::from_result(
        "namespace:user",
        &system::host_user_namespace(),
    ));
    let sandbox = system::sandbox();
    checks.push(Check::from_result("sandbox", &sandbox));
    checks.push(Check::from_result("cgroup", &system::cgroup_version()));
    checks.push(Check::from_result("limits:nofile", &system::nofile_limit()));

    let candidates = if opts.default_runtimes {
        candidate_paths(
            env("PATH").as_deref().map(std::ffi::OsStr::new),
            &opts.runtime_paths,
        )
    } else {
        opts.runtime_paths.clone()
    };
    let runtimes = find_runtimes(&opts.host_root, &candidates);
    let runtimes_fact = runtime_checks(&opts.host_root, &candidates, &runtimes, &mut checks);

    let fan = fanotify::probe(&runtimes, &opts.host_root);
    checks.push(Check::from_result("fanotify:init", &fan.init));
    checks.push(Check::from_result(
        "fanotify:exec-permission-mark",
        &fan.exec_mark,
    ));
    checks.push(Check::from_result("fanotify:report-tid", &fan.report_tid));
    checks.push(Check::from_result(
        "fanotify:report-dfid-name",
        &fan.dfid_name,
    ));

    let bpf = bpf::probe(opts.bpf_object);
    checks.push(Check::from_result("bpf:object", &bpf.object));
    checks.push(Check::from_result("bpf:btf", &bpf.btf));
    checks.push(Check::from_result("bpf:ringbuf", &bpf.ringbuf));
    checks.push(Check::from_result("bpf:tracepoint", &bpf.tracepoint));
    if let Some(dir) = &opts.bpf_pin_dir {
        checks.push(Check::from_result("bpf:pinned-maps", &pinned::check(dir)));
    }

    let kube = system::kube_config(&env);
    let node = system::node_name(&env);
    checks.push(Check::from_result("kubernetes:config", &kube));
    checks.push(Check::from_result("kubernetes:node-name", &node));
    checks.push(Check::from_result(
        "state-dirs",
        &system::state_dirs(&opts.host_root),
    ));
    checks.push(Check::from_result(
        "nri:socket",
        &system::nri_socket(&opts.host_root, &opts.nri_socket),
    ));
    if !opts.docker_sockets.is_empty() {
        checks.push(Check::from_result(
            "docker:socket",
            &system::docker_sockets(&opts.host_root, &opts.docker_sockets),
        ));
    }

    let fanotify = unit(&fan.init).and_then(|()| unit(&fan.exec_mark));
    let kube_fact = match (unit(&kube), unit(&node)) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(a), Ok(())) | (Ok(()), Err(a)) => Err(a),
        (Err(a), Err(b)) => Err(format!("{a}; {b}")),
    };
    let facts = Facts {
        fanotify,
        report_tid: unit(&fan.report_tid),
        bpf: bpf.usable(),
        host_pid_ns: unit(&pidns),
        sandbox: unit(&sandbox),
        runtimes: runtimes_fact,
        kube: kube_fact,
    };
    let (mode, refused) = facts.decide();
    ProbeReport {
        host_root: opts.host_root.display().to_string(),
        checks,
        mode,
        refused,
        runtimes,
        facts: Some(facts),
    }
}

fn runtime_checks(
    root: &Path,
    candidates: &[PathBuf],
    found: &[RuntimeBinary],
    checks: &mut Vec<Check>,
) -> Result<(), String> {
    if found.is_empty() {
        let reason = format!(
            "no container runtime binary ({}) found under {} ({} paths checked; add --runtime-path)",
            RUNTIME_NAMES.join(", "),
            root.display(),
            candidates.len()
        );
        checks.push(Check::new("runtimes", Status::Unsupported, reason.clone()));
        return Err(reason);
    }
    for b in found {
        let mut detail = b.host_path.display().to_string();
        if b.resolved != root.join(b.host_path.strip_prefix("/").unwrap_or(&b.host_path)) {
            detail.push_str(&format!(" -> {}", b.resolved.display()));
        }
        if !b.aliases.is_empty() {
            let aliases: Vec<String> = b.aliases.iter().map(|a| a.display().to_string()).collect();
            detail.push_str(&format!(" (also {})", aliases.join(", ")));
        }
        checks.push(Check::new(
            format!("runtime:{}", b.name),
            Status::Ok,
            detail,
        ));
    }
    Ok(())
}

#[cfg(test)]
mod chain_tests {
    use super::chain;

    /// lookout-fanotify leaves the errno to the error's source: the probe's
    /// details must still show it, once.
    #[test]
    fn a_fanotify_error_shows_its_errno_once() {
        let errno = std::io::Error::from_raw_os_error(libc::ENOENT).to_string();
        let e = lookout_fanotify::Error::Mark {
            path: "/usr/bin/runc".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        };
        assert_eq!(
            chain(&e),
            format!("fanotify_mark on /usr/bin/runc failed: {errno}")
        );
        assert_eq!(chain(&e).matches(&errno).count(), 1);
    }
}
