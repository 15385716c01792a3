//! Runtime state directories: where runc and crun keep what they know about
//! a container (`<root>/<id>/state.json`, `<root>/<id>/status`).

use std::path::{Path, PathBuf};

use lookout_model::RuntimeKind;
use serde::Deserialize;

use crate::Error;

/// Largest state file read.
const MAX_STATE_BYTES: u64 = 4 * 1024 * 1024;

/// The default `--root` of a runtime running as root.
pub fn default_root(runtime: &RuntimeKind) -> PathBuf {
    PathBuf::from(match runtime {
        RuntimeKind::Crun => "/run/crun",
        RuntimeKind::Runsc => "/var/run/runsc",
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
    ];
    for base in ["/run/containerd/runc", "/run/containerd/crun"] {
        let kind = if base.ends_with("crun") {
            RuntimeKind::Crun
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
pub fn state_file(runtime: &RuntimeKind, root: &Path, id: &str) -> PathBuf {
    match runtime {
        RuntimeKind::Crun => root.join(id).join("status"),
        _ => root.join(id).join("state.json"),
    }
}

/// Reads the state of `id`.
pub fn read_state(runtime: &RuntimeKind, root: &Path, id: &str) -> Result<ContainerState, Error> {
    let path = state_file(runtime, root, id);
    let bytes = read_bounded(&path)?;
    parse_state(runtime, id, &bytes).map_err(|reason| Error::State { path, reason })
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, Error> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| Error::State {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut bytes = Vec::new();
    file.take(MAX_STATE_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::State {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    Ok(bytes)
}

pub(crate) fn parse_state(
    runtime: &RuntimeKind,
    id: &str,
    bytes: &[u8],
) -> Result<ContainerState, String> {
    match runtime {
        RuntimeKind::Crun => {
            let s: CrunStatus =
                serde_json::from_slice(bytes).map_err(|e| format!("invalid crun status: {e}"))?;
            if s.pid == 0 {
                return Err("pid 0".into());
            }
            Ok(ContainerState {
                id: id.to_owned(),
                pid: s.pid,
                start_time: s.process_start_time,
                bundle: s.bundle,
            })
        }
        _ => {
            let s: RuncState = serde_json::from_slice(bytes)
                .map_err(|e| format!("invalid runc state.json: {e}"))?;
            if s.init_process_pid == 0 {
                return Err("pid 0".into());
            }
            if s.id != id {
                return Err(format!("state is for container {:?}", s.id));
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

/// Reads a pid file (`--pid-file`): a decimal pid, optional newline.
pub fn read_pid_file(path: &Path) -> Result<u32, Error> {
    let bytes = read_bounded(path)?;
    let text = std::str::from_utf8(&bytes).map_err(|_| Error::PidFile {
        path: path.to_path_buf(),
        reason: "not UTF-8".into(),
    })?;
    match text.trim().parse::<u32>() {
        Ok(0) | Err(_) => Err(Error::PidFile {
            path: path.to_path_buf(),
            reason: format!("not a pid: {:?}", text.chars().take(32).collect::<String>()),
        }),
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
