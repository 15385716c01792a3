//! The flags of `lookout run`, and the parsers of their values.

use std::path::PathBuf;
use std::time::Duration;

use lookout_probe::Mode;

/// The output format of events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// One JSON object per line.
    Json,
    /// One readable line per event.
    Text,
    /// Nothing: consumers use the API socket (or, embedded, the hub).
    None,
}

/// A requested mode: `auto` or one of the ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    /// The best mode this node supports.
    Auto,
    /// fanotify exec-permission marks + BPF argv capture.
    FanotifyEbpf,
    /// fanotify alone.
    Fanotify,
    /// Watch this node's Pods through the Kubernetes API.
    Podinformer,
    /// Scan runtime state directories.
    Scan,
    /// NRI alone: the CRI runtime's pods and containers, nothing else
    /// (see `--nri` for NRI beside another mode).
    Nri,
}

/// Whether NRI runs beside the discovery mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NriArg {
    /// When the runtime's NRI socket accepts lookout's registration.
    Auto,
    /// Always: a runtime that does not accept it is an error.
    On,
    /// Never.
    Off,
}

impl ModeArg {
    /// The mode asked for; `None` for `auto`.
    pub(crate) fn wanted(self) -> Option<Mode> {
        match self {
            ModeArg::Auto => None,
            ModeArg::FanotifyEbpf => Some(Mode::FanotifyEbpf),
            ModeArg::Fanotify => Some(Mode::Fanotify),
            ModeArg::Podinformer => Some(Mode::PodInformer),
            ModeArg::Scan => Some(Mode::Scan),
            ModeArg::Nri => None,
        }
    }
}

/// The flags of `lookout run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Discovery mode.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) mode: ModeArg,
    /// Event format (default: json when stdout is not a terminal).
    #[arg(long, value_enum)]
    pub(crate) output: Option<Output>,
    /// Where the host's root file system is mounted.
    #[arg(long, env = "LOOKOUT_HOST_ROOT", default_value = "/")]
    pub(crate) host_root: PathBuf,
    /// The host process whose namespaces (mount, network, IPC, UTS) hooks
    /// run in: the host's init by default (a DaemonSet shares the host's
    /// pids). Where pid 1 hides its namespaces (some VM inits), name
    /// another process of the host's.
    #[arg(
        long,
        env = "LOOKOUT_HOST_NAMESPACES_PID",
        default_value_t = 1,
        value_name = "PID"
    )]
    pub(crate) host_namespaces_pid: u32,
    /// An extra runtime binary to watch (an absolute host path). Repeatable.
    #[arg(long = "runtime-path", value_name = "PATH", value_parser = absolute_path)]
    pub(crate) runtime_paths: Vec<PathBuf>,
    /// Watch only the --runtime-path binaries: not the built-in list of
    /// install locations, not PATH (also for binaries installed later).
    #[arg(long)]
    pub(crate) no_default_runtimes: bool,
    /// How often to look for runtime binaries installed after start-up.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) rescan_interval: Duration,
    /// Where to serve /healthz, /readyz and /metrics.
    #[arg(long, default_value = "127.0.0.1:9477")]
    pub(crate) listen: std::net::SocketAddr,
    /// How long a container's `start` may wait for its `added` line to be
    /// written to stdout (a consumer that stops reading must not freeze
    /// the node).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) event_deadline: Duration,
    /// Rescan interval of the scan mode.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) scan_interval: Duration,
    /// This node's name, for the Pod informer (from the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub(crate) node_name: Option<String>,
    /// A kubeconfig file; without it, the usual places (`~/.kube/config`,
    /// then the in-cluster service account).
    #[arg(long, env = "KUBECONFIG")]
    pub(crate) kubeconfig: Option<PathBuf>,
    /// Run the Pod informer beside a runtime-hook or scan mode, so that
    /// containers the hook cannot see (gVisor, Kata) are still reported,
    /// once. Default: on when a cluster is configured.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub(crate) fallback_informer: Option<bool>,
    /// A command run through `sh -c` for every new container, with its OCI
    /// State (status `created`) on stdin, before the runtime may start it.
    /// Repeatable.
    #[arg(long, value_name = "CMD")]
    pub(crate) prestart: Vec<String>,
    /// A command run through `sh -c` after a container exits, with its
    /// State (status `stopped`) on stdin. Repeatable.
    #[arg(long, value_name = "CMD")]
    pub(crate) poststop: Vec<String>,
    /// An oci-hooks(5) directory (CRI-O/podman hooks.d JSON). Repeatable;
    /// a later one overrides an earlier one by file name.
    #[arg(long = "hooks-dir", value_name = "DIR")]
    pub(crate) hooks_dirs: Vec<PathBuf>,
    /// Each hook's timeout (unless its hooks.d file sets one), and the
    /// longest a runtime's `start` waits for a container's prestart hooks.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) hook_timeout: Duration,
    /// What a failing or timed-out hook before the start (`prestart`,
    /// `createRuntime`, `createContainer`, `startContainer`) does: `stop`
    /// refuses the container's start, as the runtime spec says and runc,
    /// CRI-O and podman do; `warn` only logs and counts it. `poststart` and
    /// `poststop` failures always only warn.
    #[arg(long, value_enum, default_value_t = HookFailureArg::Stop, value_name = "stop|warn")]
    pub(crate) hook_failure: HookFailureArg,
    /// The longest a runtime exec waits on lookout for anything but a
    /// container's prestart hooks (reading its config.json and state). A
    /// hung file system costs the one container involved at most this.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) answer_deadline: Duration,
    /// The scheduler time slice the threads that runtimes wait on ask for
    /// (the one that answers execs, the hook's, the readers', the consumer
    /// API's): 100us to 100ms, or `off` for the kernel's default. Linux
    /// 6.12+; no more CPU time, only a shorter wait for a CPU after a
    /// wake-up (see docs/operations.md).
    #[arg(long, default_value = "100us", value_parser = parse_slice, value_name = "DURATION|off")]
    pub(crate) scheduler_slice: SchedulerSlice,
    /// NRI beside the discovery mode: for CRI pods and containers,
    /// sandboxed runtimes (gVisor, Kata) included, with the runtime's own
    /// view (`--mode nri`: NRI alone).
    #[arg(long, value_enum, default_value = "auto", env = "LOOKOUT_NRI")]
    pub(crate) nri: NriArg,
    /// The runtime's NRI socket, a host path.
    #[arg(
        long,
        env = "LOOKOUT_NRI_SOCKET",
        default_value = lookout_nri::DEFAULT_SOCKET,
        value_parser = absolute_path
    )]
    pub(crate) nri_socket: PathBuf,
    /// dockerd's socket (host path, under --host-root), asked for the
    /// name, image and labels of Docker's containers (those whose runtime
    /// root is `<exec-root>/runtime-runc/moby`); they follow `added` as an
    /// `updated` event. Repeat it for several dockerds. No dockerd there:
    /// Docker's containers are still reported, without them.
    #[arg(
        long = "docker-socket",
        value_name = "PATH",
        default_value = lookout_docker::DEFAULT_SOCKET,
        value_parser = absolute_path
    )]
    pub(crate) docker_sockets: Vec<PathBuf>,
    /// Another runtime state root for the start-up scan (and, in scan
    /// mode, every scan), as `[RUNTIME:]PATH` (host path; runtime `runc`
    /// unless named): a dockerd with its own `--exec-root` keeps its
    /// containers in `<exec-root>/runtime-runc/moby`. The usual roots
    /// (`/run/runc`, `/run/docker/runtime-runc/moby`, containerd's, ...)
    /// are always scanned.
    #[arg(long = "state-root", value_name = "[RUNTIME:]PATH", value_parser = parse_state_root)]
    pub(crate) state_roots: Vec<(lookout_model::RuntimeKind, PathBuf)>,
    /// Ask no dockerd (Docker's containers are reported without their
    /// name, image and labels).
    #[arg(long)]
    pub(crate) no_docker: bool,
    /// The longest one question to dockerd may take (connect, ask, read);
    /// a dockerd that did not answer in time is not asked again for 5 s.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) docker_timeout: Duration,
    /// The longest a container's start waits in NRI for its prestart hooks
    /// and gates; kept under the runtime's request timeout (2 s), past
    /// which the runtime would drop lookout's plugin.
    #[arg(long, default_value = "1500ms", value_parser = parse_duration)]
    pub(crate) nri_budget: Duration,
    /// Post a Kubernetes Event (`NewContainerConfig`) on this Node for every
    /// new container.
    #[arg(long)]
    pub(crate) k8s_events: bool,
    /// UNSAFE: Event notes also carry environment variable and annotation
    /// values (secrets), readable by anyone who may list Events.
    #[arg(long)]
    pub(crate) k8s_events_unsafe_values: bool,
    /// At most this many Events at once; the rate limit's burst (at
    /// least 1 with --k8s-events).
    #[arg(long, default_value = "25", value_name = "N")]
    pub(crate) k8s_events_burst: u32,
    /// Events allowed per minute after the burst (0: none). Events over
    /// the limit are dropped, never queued.
    #[arg(long, default_value = "60", value_name = "N")]
    pub(crate) k8s_events_per_minute: u32,
    /// The consumer API's Unix socket (gRPC, lookout.v1; docs/consumers.md).
    #[arg(
        long,
        env = "LOOKOUT_SOCKET",
        default_value = "/run/lookout/lookout.sock",
        value_name = "PATH"
    )]
    pub(crate) socket: PathBuf,
    /// Do not serve the consumer API.
    #[arg(long)]
    pub(crate) no_socket: bool,
    /// Group (name or gid) of the socket and its directory: its members may
    /// List and Watch.
    #[arg(long, value_name = "GROUP")]
    pub(crate) socket_group: Option<String>,
    /// Connections to the consumer API at once from peers other than root
    /// and the agent's own user; more are closed as they are accepted (each
    /// costs an fd, and the kernel denies an exec when fanotify cannot
    /// install one). At most an eighth of the open-file limit. 0: root only.
    #[arg(long, default_value = "1024", value_name = "N",
          value_parser = clap::value_parser!(u32).range(0..=1_048_576))]
    pub(crate) api_max_connections: u32,
    /// Of those, at most this many per uid: one consumer's uid cannot lock
    /// the others out.
    #[arg(long, default_value = "64", value_name = "N",
          value_parser = clap::value_parser!(u32).range(0..=1_048_576))]
    pub(crate) api_max_connections_per_uid: u32,
    /// A uid allowed to Gate besides root. Repeatable.
    #[arg(long = "gate-allow-uid", value_name = "UID")]
    pub(crate) gate_allow_uids: Vec<u32>,
    /// A gid allowed to Gate besides root. Repeatable.
    #[arg(long = "gate-allow-gid", value_name = "GID")]
    pub(crate) gate_allow_gids: Vec<u32>,
    /// The deadline of a gate hold whose subscriber asks for none.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) gate_deadline: Duration,
    /// The longest deadline a gate subscriber may ask for.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) gate_max_deadline: Duration,
    /// A namespace where fail-closed gates do not apply (the node must be
    /// able to recover). Repeatable; default kube-system, plus
    /// $POD_NAMESPACE (lookout's own) when set.
    #[arg(long = "gate-exempt-namespace", value_name = "NS")]
    pub(crate) gate_exempt_namespaces: Vec<String>,
    /// Changes buffered per watcher; one that falls this far behind, or
    /// behind the resume window, is disconnected (it resumes from its last
    /// revision).
    #[arg(long, default_value = "1024", value_name = "N")]
    pub(crate) watch_buffer: usize,
    /// Where the container maps are pinned (`containers_by_cgroup`,
    /// `containers_by_mntns`; docs/ebpf.md): a directory on a BPF file
    /// system, in the agent's own mount namespace (mount the host's
    /// /sys/fs/bpf there), created mode 0700 when missing. One that is not
    /// root's own directory is moved aside, and the agent makes its own.
    #[arg(
        long,
        env = "LOOKOUT_BPF_PIN_DIR",
        default_value = lookout_ebpf_common::CONTAINER_MAPS_DIR,
        value_name = "DIR",
        value_parser = absolute_path
    )]
    pub(crate) bpf_pin_dir: PathBuf,
    /// Do not write the pinned container maps.
    #[arg(long)]
    pub(crate) no_pinned_maps: bool,
    /// `max_entries` of each container map (a new map's; a pinned map
    /// keeps its own). A full map is counted
    /// (lookout_pinned_map_write_failures) and warned about; the
    /// container is still reported.
    #[arg(long, default_value_t = lookout_ebpf_common::CONTAINER_MAPS_MAX_ENTRIES, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub(crate) bpf_map_max_entries: u32,
}

impl RunArgs {
    /// Checks across flags that clap cannot express: what would make a flag
    /// meaningless.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.k8s_events && self.k8s_events_burst == 0 {
            return Err(
                "invalid value '0' for '--k8s-events-burst <N>': with --k8s-events it \
                 must be at least 1 (a burst of 0 would drop every Event)"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

/// Runtime paths are host paths: a relative one would be resolved against
/// the agent's working directory, which is never what was meant.
pub fn absolute_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(format!(
            "{s:?} is not an absolute path (runtime paths are host paths, e.g. /usr/local/bin/runc)"
        ))
    }
}

/// The longest interval or deadline accepted (a larger one would overflow
/// the clock arithmetic of timers).
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// A positive duration: humantime syntax (`500ms`, `2s`, `1m30s`, `1h`), or
/// a bare number of seconds. Zero is refused: every interval and deadline
/// of the agent must let time pass.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let d = if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        s.parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| format!("{s:?} is too large"))?
    } else {
        humantime::parse_duration(s)
            .map_err(|e| format!("invalid duration {s:?}: {e} (e.g. 500ms, 2s, 1m30s)"))?
    };
    if d.is_zero() {
        return Err(format!("{s:?}: must be greater than zero"));
    }
    if d > MAX_DURATION {
        return Err(format!("{s:?}: must be at most 30 days"));
    }
    Ok(d)
}

/// `--scheduler-slice`: a slice, or none (`off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SchedulerSlice(pub(crate) Option<Duration>);

/// `--scheduler-slice`: `off`, or a duration within the kernel's bounds.
fn parse_slice(s: &str) -> Result<SchedulerSlice, String> {
    if s.trim() == "off" {
        return Ok(SchedulerSlice(None));
    }
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("invalid duration {s:?}: {e} (e.g. 100us, 1ms, or off)"))?;
    if d < Duration::from_micros(100) || d > Duration::from_millis(100) {
        return Err(format!(
            "{s:?}: the kernel takes slices from 100us to 100ms (or off)"
        ));
    }
    Ok(SchedulerSlice(Some(d)))
}

/// `[RUNTIME:]PATH`, an absolute host path.
fn parse_state_root(s: &str) -> Result<(lookout_model::RuntimeKind, PathBuf), String> {
    let (runtime, path) = match s.split_once(':') {
        Some((r, p)) if !r.contains('/') => (lookout_model::RuntimeKind::from_binary_name(r), p),
        _ => (lookout_model::RuntimeKind::Runc, s),
    };
    Ok((runtime, absolute_path(path)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        for bad in [
            "x",
            "",
            "0",
            "0s",
            "0ms",
            "-1s",
            "-1",
            "1y2",
            "99999999999999999999",
            "31d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn scheduler_slices_are_off_or_within_the_kernels_bounds() {
        let us = |n| Ok(SchedulerSlice(Some(Duration::from_micros(n))));
        assert_eq!(parse_slice("100us"), us(100));
        assert_eq!(parse_slice("1ms"), us(1000));
        assert_eq!(parse_slice("100ms"), us(100_000));
        assert_eq!(parse_slice("off"), Ok(SchedulerSlice(None)));
        for bad in ["", "x", "0", "99us", "101ms", "1s", "-1ms", "100"] {
            let e = parse_slice(bad).expect_err(bad);
            assert!(!e.is_empty());
        }
        assert!(parse_slice("50us").is_err_and(|e| e.contains("100us to 100ms")));
    }

    #[test]
    fn state_roots_name_their_runtime_or_are_runc() {
        use lookout_model::RuntimeKind;
        assert_eq!(
            parse_state_root("/d/exec/runtime-runc/moby"),
            Ok((
                RuntimeKind::Runc,
                PathBuf::from("/d/exec/runtime-runc/moby")
            ))
        );
        assert_eq!(
            parse_state_root("crun:/run/x"),
            Ok((RuntimeKind::Crun, PathBuf::from("/run/x")))
        );
        assert!(parse_state_root("crun:relative").is_err());
        assert!(parse_state_root("relative").is_err());
    }
}

/// `--hook-failure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum HookFailureArg {
    /// The container does not start.
    Stop,
    /// Logged and counted; the container starts.
    Warn,
}

impl From<HookFailureArg> for crate::hooks::OnHookFailure {
    fn from(a: HookFailureArg) -> Self {
        match a {
            HookFailureArg::Stop => crate::hooks::OnHookFailure::Stop,
            HookFailureArg::Warn => crate::hooks::OnHookFailure::Warn,
        }
    }
}
