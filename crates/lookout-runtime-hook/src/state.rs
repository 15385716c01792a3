//! Runtime state directories: where runtimes keep what they know about a
//! container.
//!
//! | runtime | file | versions read |
//! |---|---|---|
//! | runc, youki | `<root>/<id>/state.json`: `id`, `init_process_pid`, `init_process_start`, `config.labels` (`bundle=`) | runc 1.0.0-rc93, 1.1.5, 1.1.15 (Debian 11, 12, 13; `tests/fixtures/runc-*.state.json` are real ones) |
//! | crun | `<root>/<id>/status`: `pid`, `process-start-time`, `bundle` | crun 0.17, 1.8.1, 1.21 (Debian 11, 12, 13; `tests/fixtures/crun-*.status`) |
//! | runsc (gVisor) | `<root>/<id>_sandbox:<sandbox id>.state`: `id`, `bundleDir`, `sandbox.pid` (the sandbox's host process) | 20221219 (Debian 12), 20240729 (Debian 13): the same fields; `tests/fixtures/runsc-*.state` are real ones |

use std::path::{Path, PathBuf};

use lookout_model::RuntimeKind;
use serde::Deserialize;

use crate::{Error, Problem};

/// Largest state file read.
const MAX_STATE_BYTES: u64 = 4 * 1024 * 1024;

/// The default `--root` of a runtime running as root.
pub fn default_root(runtime: &RuntimeKind) -> PathBuf {
    PathBuf::from(match runtime {
        RuntimeKind::Crun => "/run/crun",
        // runsc's default is /var/run/runsc; /var/run is a symlink to /run
        // on every distribution lookout supports.
        RuntimeKind::Runsc => "/run/runsc",
        RuntimeKind::Youki => "/run/youki",
        _ => "/run/runc",
    })
}

/// The state roots the start-up scan looks in (host paths). containerd
/// uses one root per namespace, so `/run/containerd/runc/*` is expanded.
pub fn scan_roots(host_root: &Path) -> Vec<(RuntimeKind, PathBuf)> {
    let mut roots = vec![
        (RuntimeKind::Runc, PathBuf::from("/run/runc")),
        (RuntimeKind::Crun, PathBuf::from("/run/crun")),
        (
            RuntimeKind::Runc,
            PathBuf::from("/run/docker/runtime-runc/moby"),
        ),
        (RuntimeKind::Youki, PathBuf::from("/run/youki")),
        (RuntimeKind::Runsc, PathBuf::from("/run/runsc")),
    ];
    // containerd's shims use one root per containerd namespace.
    for base in [
        "/run/containerd/runc",
        "/run/containerd/crun",
        "/run/containerd/runsc",
    ] {
        let kind = if base.ends_with("crun") {
            RuntimeKind::Crun
        } else if base.ends_with("runsc") {
            RuntimeKind::Runsc
        } else {
            RuntimeKind::Runc
        };
        if let Ok(rd) = std::fs::read_dir(host_root.join(base.trim_start_matches('/'))) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    roots.push((kind.clone(), Path::new(base).join(e.file_name())));
                }
            }
        }
    }
    roots
}

/// What a state file says about a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerState {
    /// The container id.
    pub id: String,
    /// Host pid of its init process.
    pub pid: u32,
    /// Its start time (clock ticks since boot), to detect pid reuse.
    pub start_time: Option<u64>,
    /// The bundle, when the state records it.
    pub bundle: Option<PathBuf>,
}

#[derive(Deserialize)]
struct RunscState {
    id: String,
    #[serde(default, rename = "bundleDir")]
    bundle_dir: Option<PathBuf>,
    sandbox: RunscSandbox,
}

#[derive(Deserialize)]
struct RunscSandbox {
    pid: u32,
}

#[derive(Deserialize)]
struct RuncState {
    id: String,
    init_process_pid: u32,
    #[serde(default)]
    init_process_start: Option<u64>,
    #[serde(default)]
    config: RuncConfig,
}

#[derive(Deserialize, Default)]
struct RuncConfig {
    #[serde(default)]
    labels: Vec<String>,
}

#[derive(Deserialize)]
struct CrunStatus {
    pid: u32,
    #[serde(default, rename = "process-start-time")]
    process_start_time: Option<u64>,
    #[serde(default)]
    bundle: Option<PathBuf>,
}

/// The state file of `id` under `root` (a path this process can open).
/// For runsc, whose file name also holds the sandbox's id, the pattern
/// `<id>_sandbox:*.state` (see [`runsc_state_name`]).
pub fn state_file(runtime: &RuntimeKind, root: &Path, id: &str) -> PathBuf {
    match runtime {
        RuntimeKind::Crun => root.join(id).join("status"),
        RuntimeKind::Runsc => root.join(format!("{id}_sandbox:*.state")),
        _ => root.join(id).join("state.json"),
    }
}

/// Among the names of a runsc root's entries, the state file of container
/// `id`: `<id>_sandbox:<sandbox id>.state`.
pub fn runsc_state_name<'a>(id: &str, names: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    names.into_iter().find(|n| {
        n.strip_suffix(".state")
            .and_then(|n| n.split_once("_sandbox:"))
            .is_some_and(|(c, sandbox)| c == id && !sandbox.is_empty())
    })
}

/// The container id in a runsc state file's name, if it is one.
pub fn runsc_container_of(name: &str) -> Option<&str> {
    let (c, sandbox) = name.strip_suffix(".state")?.split_once("_sandbox:")?;
    (!c.is_empty() && !sandbox.is_empty()).then_some(c)
}

/// Whether the runtime root `root` holds anything of container `id` (its
/// directory, or a runsc file named after it): a create that made
/// something, as opposed to one that failed before it did.
pub fn leaves_trace(host_root: &Path, root: &Path, id: &str) -> bool {
    let prefix = format!("{id}_sandbox:");
    root_entries(host_root, root)
        .is_ok_and(|names| names.iter().any(|n| n == id || n.starts_with(&prefix)))
}

/// Entries of a runtime root read at most when looking for one state file.
const MAX_ROOT_ENTRIES: usize = 65_536;

/// The names in the runtime root `root` (a host path under `host_root`),
/// resolved as [`crate::untrusted`] resolves paths; at most
/// 65,536.
pub fn root_entries(host_root: &Path, root: &Path) -> Result<Vec<String>, Problem> {
    use std::os::fd::AsRawFd;
    let dir = crate::untrusted::open_dir(host_root, root)?;
    // An O_PATH handle cannot be listed; its /proc link reopens it.
    let listing = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))
        .map_err(|e| Problem::Refused(crate::untrusted::Refused::Read(e)))?;
    Ok(listing
        .take(MAX_ROOT_ENTRIES)
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect())
}

/// Reads the state of `id` (`root`: a path this process can open).
pub fn read_state(runtime: &RuntimeKind, root: &Path, id: &str) -> Result<ContainerState, Error> {
    read_state_under(Path::new("/"), runtime, root, id)
}

/// Reads the state of `id` in the runtime root `root`, a host path resolved
/// under `host_root` (see [`crate::untrusted`]): a regular file owned by
/// root, at most 4 MiB, opened without following a last symlink and
/// without blocking on a FIFO.
pub fn read_state_under(
    host_root: &Path,
    runtime: &RuntimeKind,
    root: &Path,
    id: &str,
) -> Result<ContainerState, Error> {
    let mut path = state_file(runtime, root, id);
    if *runtime == RuntimeKind::Runsc {
        let names = root_entries(host_root, root).map_err(|source| Error::State {
            path: path.clone(),
            source,
        })?;
        let name =
            runsc_state_name(id, names.iter().map(String::as_str)).ok_or_else(|| Error::State {
                path: path.clone(),
                source: Problem::Invalid("no such file".into()),
            })?;
        path = root.join(name);
    }
    let bytes =
        crate::untrusted::read(host_root, &path, STATE_POLICY).map_err(|e| Error::State {
            path: path.clone(),
            source: e.into(),
        })?;
    parse_state(runtime, id, &bytes).map_err(|source| Error::State { path, source })
}

const STATE_POLICY: crate::untrusted::Policy = crate::untrusted::Policy {
    max_bytes: MAX_STATE_BYTES,
    root_owned: true,
};

/// A pid file holds a pid and a newline.
const PID_POLICY: crate::untrusted::Policy = crate::untrusted::Policy {
    max_bytes: 64,
    root_owned: true,
};

/// Parses a state file's bytes (runc's `state.json`, crun's `status`) for
/// container `id`: its pid (never 0), start time and bundle. A state of
/// another container is an error.
pub fn parse_state(
    runtime: &RuntimeKind,
    id: &str,
    bytes: &[u8],
) -> Result<ContainerState, Problem> {
    match runtime {
        RuntimeKind::Runsc => {
            let s: RunscState = serde_json::from_slice(bytes)?;
            if s.sandbox.pid == 0 {
                return Err(Problem::Invalid("pid 0".into()));
            }
            if s.id != id {
                return Err(Problem::Invalid(format!(
                    "state is for container {:?}",
                    s.id
                )));
            }
            Ok(ContainerState {
                id: s.id,
                // The sandbox's host process: the container's own processes
                // run inside gVisor's kernel, with no host pid of their own.
                pid: s.sandbox.pid,
                start_time: None,
                bundle: s.bundle_dir,
            })
        }
        RuntimeKind::Crun => {
            let s: CrunStatus = serde_json::from_slice(bytes)?;
            if s.pid == 0 {
                return Err(Problem::Invalid("pid 0".into()));
            }
            Ok(ContainerState {
                id: id.to_owned(),
                pid: s.pid,
                start_time: s.process_start_time,
                bundle: s.bundle,
            })
        }
        _ => {
            let s: RuncState = serde_json::from_slice(bytes)?;
            if s.init_process_pid == 0 {
                return Err(Problem::Invalid("pid 0".into()));
            }
            if s.id != id {
                return Err(Problem::Invalid(format!(
                    "state is for container {:?}",
                    s.id
                )));
            }
            let bundle = s
                .config
                .labels
                .iter()
                .find_map(|l| l.strip_prefix("bundle="))
                .map(PathBuf::from);
            Ok(ContainerState {
                id: s.id,
                pid: s.init_process_pid,
                start_time: s.init_process_start,
                bundle,
            })
        }
    }
}

/// Reads a pid file (`--pid-file`): a decimal pid, optional newline
/// (`path`: a path this process can open).
pub fn read_pid_file(path: &Path) -> Result<u32, Error> {
    read_pid_file_under(Path::new("/"), path)
}

/// Reads the pid file `path`, a host path resolved under `host_root` (see
/// [`crate::untrusted`]): a regular file owned by root, at most 64 bytes.
pub fn read_pid_file_under(host_root: &Path, path: &Path) -> Result<u32, Error> {
    let err = |source: Problem| Error::PidFile {
        path: path.to_path_buf(),
        source,
    };
    let bytes = crate::untrusted::read(host_root, path, PID_POLICY).map_err(|e| err(e.into()))?;
    parse_pid(&bytes).map_err(err)
}

/// Parses a pid file's bytes: a decimal pid other than 0, surrounding
/// white space allowed.
pub fn parse_pid(bytes: &[u8]) -> Result<u32, Problem> {
    let text = std::str::from_utf8(bytes).map_err(|_| Problem::Invalid("not UTF-8".into()))?;
    match text.trim().parse::<u32>() {
        Ok(0) | Err(_) => Err(Problem::Invalid(format!(
            "not a pid: {:?}",
            text.chars().take(32).collect::<String>()
        ))),
        Ok(pid) => Ok(pid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_runc_state() {
        let s = br#"{"id":"c1","init_process_pid":42,"init_process_start":777,"created":"x",
            "config":{"labels":["bundle=/b/c1","other=1"]}}"#;
        let st = parse_state(&RuntimeKind::Runc, "c1", s).expect("valid");
        assert_eq!(st.pid, 42);
        assert_eq!(st.start_time, Some(777));
        assert_eq!(st.bundle.as_deref(), Some(Path::new("/b/c1")));
        assert!(parse_state(&RuntimeKind::Runc, "other", s).is_err());
        assert!(parse_state(&RuntimeKind::Runc, "c1", b"{}").is_err());
    }

    #[test]
    fn parses_crun_status() {
        let s = br#"{"pid":9,"process-start-time":5,"cgroup-path":"/x","bundle":"/b","rootfs":"/b/rootfs"}"#;
        let st = parse_state(&RuntimeKind::Crun, "c2", s).expect("valid");
        assert_eq!((st.pid, st.start_time), (9, Some(5)));
        assert!(parse_state(&RuntimeKind::Crun, "c2", b"{\"pid\":0}").is_err());
    }

    #[test]
    fn parses_runsc_state_of_both_debian_releases() {
        for (file, bundle) in [
            ("runsc-20221219.state", "/tmp/rsb"),
            ("runsc-20240729.state", "/tmp/rsb"),
        ] {
            let bytes = std::fs::read(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures")
                    .join(file),
            )
            .expect("fixture");
            let s = parse_state(&RuntimeKind::Runsc, "fixture-c", &bytes).expect(file);
            assert!(s.pid > 1, "{file}: the sandbox's pid");
            assert_eq!(s.bundle.as_deref(), Some(Path::new(bundle)), "{file}");
            assert!(parse_state(&RuntimeKind::Runsc, "other", &bytes).is_err());
        }
        let names = [
            "x.lock",
            "c1_sandbox:c1.lock",
            "c1_sandbox:c1.state",
            "runsc-c1.sock",
        ];
        assert_eq!(runsc_state_name("c1", names), Some("c1_sandbox:c1.state"));
        assert_eq!(runsc_state_name("c", names), None);
        assert_eq!(runsc_container_of("web_sandbox:pod.state"), Some("web"));
        assert_eq!(runsc_container_of("_sandbox:pod.state"), None);
        assert_eq!(runsc_container_of("web_sandbox:pod.lock"), None);
    }

    #[test]
    fn parses_runc_and_crun_state_of_three_debian_releases() {
        // Written by each release in a `cargo xtask vm-test` guest
        // (docs/kernels.md, "Runtime state files by release").
        for (runtime, file, id, bundle) in [
            (
                RuntimeKind::Runc,
                "runc-1.0.0-rc93.state.json",
                "rc-auto",
                "/bundles/exit3",
            ),
            (
                RuntimeKind::Runc,
                "runc-1.1.5.state.json",
                "rc-auto",
                "/bundles/exit3",
            ),
            (
                RuntimeKind::Runc,
                "runc-1.1.15.state.json",
                "rc-auto",
                "/bundles/exit3",
            ),
            (
                RuntimeKind::Crun,
                "crun-0.17.status",
                "cr-auto",
                "/bundles/exit5",
            ),
            (
                RuntimeKind::Crun,
                "crun-1.8.1.status",
                "cr-auto",
                "/bundles/exit5",
            ),
            (
                RuntimeKind::Crun,
                "crun-1.21.status",
                "cr-auto",
                "/bundles/exit5",
            ),
        ] {
            let bytes = std::fs::read(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures")
                    .join(file),
            )
            .expect("fixture");
            let s = parse_state(&runtime, id, &bytes).expect(file);
            assert!(s.pid > 1, "{file}: the init's pid");
            assert!(s.start_time.is_some(), "{file}: the init's start time");
            assert_eq!(s.bundle.as_deref(), Some(Path::new(bundle)), "{file}");
        }
    }

    #[test]
    fn pid_files() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("pid");
        std::fs::write(&p, b"1234\n").expect("write");
        assert_eq!(read_pid_file(&p).expect("valid"), 1234);
        std::fs::write(&p, b"12ab").expect("write");
        assert!(read_pid_file(&p).is_err());
        std::fs::write(&p, b"").expect("write");
        assert!(read_pid_file(&p).is_err());
    }
}
