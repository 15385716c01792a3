//! Reading a bundle's `config.json`: bounded in size and time, resolved
//! inside the bundle, never a FIFO or device (see [`crate::untrusted`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{Error, Problem};

/// Largest config.json read (runc's own limit is far smaller in practice).
pub const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

/// The parts of an OCI runtime spec lookout reports.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct OciConfig {
    /// `annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `hostname`.
    pub hostname: Option<String>,
    /// `process`.
    pub process: Option<OciProcess>,
}

/// `process` of the spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct OciProcess {
    /// `process.args`.
    pub args: Vec<String>,
}

/// Reads a bundle's config (`config.json`, or crun's `--config` path:
/// relative to the bundle, or absolute). `bundle` is a path this process
/// can open; see [`read_config_under`].
pub fn read_config(bundle: &Path, config: Option<&Path>) -> Result<OciConfig, Error> {
    read_config_under(Path::new("/"), bundle, config)
}

/// Where a bundle's config is: `--config` when given (absolute, or
/// relative to the bundle), else the bundle's `config.json`.
fn config_path(bundle: &Path, config: Option<&Path>) -> PathBuf {
    match config {
        Some(c) if c.is_absolute() => c.to_path_buf(),
        Some(c) => bundle.join(c),
        None => bundle.join("config.json"),
    }
}

/// The bytes of a bundle's config, read as [`read_config_under`] reads
/// them (the one reader of config.json: the agent's hooks use it too, for
/// the whole document).
pub fn read_config_bytes_under(
    host_root: &Path,
    bundle: &Path,
    config: Option<&Path>,
) -> Result<Vec<u8>, Error> {
    let policy = crate::untrusted::Policy {
        max_bytes: MAX_CONFIG_BYTES,
        root_owned: false,
    };
    match config {
        Some(c) if c.is_absolute() => crate::untrusted::read(host_root, c, policy),
        _ => crate::untrusted::open_dir(host_root, bundle).and_then(|dir| {
            crate::untrusted::read_in(&dir, config.unwrap_or(Path::new("config.json")), policy)
        }),
    }
    .map_err(|e| Error::Config {
        path: config_path(bundle, config),
        source: e.into(),
    })
}

/// [`read_config_bytes_under`] on a helper thread, waiting at most
/// `deadline` (see [`read_config_within`] for why and for the cap on
/// stuck readers).
pub async fn read_config_bytes_async(
    host_root: PathBuf,
    bundle: PathBuf,
    config: Option<PathBuf>,
    deadline: std::time::Duration,
) -> Result<Vec<u8>, Error> {
    let path = config_path(&bundle, config.as_deref());
    bounded_async(deadline, move || {
        read_config_bytes_under(&host_root, &bundle, config.as_deref())
    })
    .await
    .unwrap_or_else(|why| {
        Err(Error::Config {
            path,
            source: Problem::NotInTime(why),
        })
    })
}

/// Reads a bundle's config: `bundle` is a host path resolved under
/// `host_root`, `config.json` is resolved inside the bundle (a symlink
/// cannot lead out of it), and an absolute `--config` under the host root.
/// The file must be a regular file of at most [`MAX_CONFIG_BYTES`], opened
/// without following a last symlink and without blocking on a FIFO (see
/// [`crate::untrusted`]).
pub fn read_config_under(
    host_root: &Path,
    bundle: &Path,
    config: Option<&Path>,
) -> Result<OciConfig, Error> {
    let bytes = read_config_bytes_under(host_root, bundle, config)?;
    let path = config_path(bundle, config);
    let err = |source: Problem| Error::Config {
        path: path.clone(),
        source,
    };
    let (cfg, dropped) = parse_config(&bytes).map_err(err)?;
    if let Some(dropped) = dropped {
        tracing::warn!(
            path = %path.display(),
            dropped,
            "config.json annotations beyond {MAX_ANNOTATION_BYTES} bytes or {MAX_ANNOTATIONS} entries were dropped"
        );
    }
    Ok(cfg)
}

/// Parses the bytes of a `config.json` (the fields lookout uses), keeping
/// annotations within [`MAX_ANNOTATION_BYTES`] and [`MAX_ANNOTATIONS`];
/// returns the config and how many annotations were dropped, if any.
pub fn parse_config(bytes: &[u8]) -> Result<(OciConfig, Option<usize>), Problem> {
    let mut cfg: OciConfig = serde_json::from_slice(bytes)?;
    let dropped = bound_annotations(&mut cfg.annotations);
    Ok((cfg, dropped))
}

/// The most annotation bytes (keys and values) kept per container: the
/// Kubernetes API's own limit for one object.
pub const MAX_ANNOTATION_BYTES: usize = 256 * 1024;
/// The most annotations kept per container.
pub const MAX_ANNOTATIONS: usize = 1024;
/// Set on a container whose annotations were cut: how many were dropped.
pub const TRUNCATED_ANNOTATION: &str = "io.lookout.annotations-dropped";

/// Keeps annotations in key order while they fit the limits; returns how
/// many were dropped, and records that number under
/// [`TRUNCATED_ANNOTATION`].
fn bound_annotations(a: &mut BTreeMap<String, String>) -> Option<usize> {
    let mut total = 0usize;
    let mut cut = None;
    for (kept, (k, v)) in a.iter().enumerate() {
        total += k.len() + v.len();
        if total > MAX_ANNOTATION_BYTES || kept == MAX_ANNOTATIONS {
            cut = Some(k.clone());
            break;
        }
    }
    let cut = cut?;
    let dropped = a.split_off(&cut).len();
    a.insert(TRUNCATED_ANNOTATION.to_owned(), dropped.to_string());
    Some(dropped)
}

/// [`read_config`] on a helper thread, waiting at most `deadline`.
///
/// A bundle on a hung file system (a FUSE daemon that stopped answering, an
/// NFS server gone away) blocks `open`/`read` in the kernel where no signal
/// or timeout reaches it. The runtime's exec waits on lookout while the
/// config is read, so the read must not be allowed to take longer than the
/// deadline: the caller then goes on without the config. The helper thread
/// stays blocked until the file system answers; at most
/// [`MAX_STUCK_READERS`] such threads exist at once.
pub fn read_config_within(
    host_root: &Path,
    bundle: &Path,
    config: Option<&Path>,
    deadline: std::time::Duration,
) -> Result<OciConfig, Error> {
    let path = config_path(bundle, config);
    let (host_root, bundle, config) = (
        host_root.to_path_buf(),
        bundle.to_path_buf(),
        config.map(Path::to_path_buf),
    );
    bounded(deadline, move || {
        read_config_under(&host_root, &bundle, config.as_deref())
    })
    .unwrap_or_else(|why| {
        Err(Error::Config {
            path,
            source: Problem::NotInTime(why),
        })
    })
}

/// [`read_config_within`] without blocking the caller: the read runs on a
/// helper thread (the same cap on stuck readers) and the returned future
/// waits for it at most `deadline`.
pub async fn read_config_async(
    host_root: PathBuf,
    bundle: PathBuf,
    config: Option<PathBuf>,
    deadline: std::time::Duration,
) -> Result<OciConfig, Error> {
    let path = config_path(&bundle, config.as_deref());
    bounded_async(deadline, move || {
        read_config_under(&host_root, &bundle, config.as_deref())
    })
    .await
    .unwrap_or_else(|why| {
        Err(Error::Config {
            path,
            source: Problem::NotInTime(why),
        })
    })
}

pub use crate::bounded::MAX_STUCK_READERS;
use crate::bounded::{bounded, bounded_async};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_annotations_args_and_hostname() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            d.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","hostname":"h","process":{"args":["sh","-c","x"]},
               "annotations":{"io.kubernetes.cri.container-name":"web"},"unknown":{"kept":"ignored"}}"#,
        )
        .expect("write");
        let c = read_config(d.path(), None).expect("valid");
        assert_eq!(c.hostname.as_deref(), Some("h"));
        assert_eq!(c.process.expect("process").args, ["sh", "-c", "x"]);
        assert_eq!(c.annotations["io.kubernetes.cri.container-name"], "web");
    }

    #[test]
    fn annotations_are_bounded_per_container() {
        let d = tempfile::tempdir().expect("tempdir");
        let big: BTreeMap<String, String> = (0..100)
            .map(|i| (format!("k{i:03}"), "v".repeat(4096)))
            .collect();
        std::fs::write(
            d.path().join("config.json"),
            serde_json::json!({ "annotations": big }).to_string(),
        )
        .expect("write");
        let c = read_config(d.path(), None).expect("valid");
        let kept: usize = c
            .annotations
            .iter()
            .filter(|(k, _)| k.as_str() != TRUNCATED_ANNOTATION)
            .map(|(k, v)| k.len() + v.len())
            .sum();
        assert!(kept <= MAX_ANNOTATION_BYTES, "{kept}");
        assert_eq!(c.annotations.len(), 63 + 1);
        assert_eq!(c.annotations[TRUNCATED_ANNOTATION], "37");
        assert!(c.annotations.contains_key("k000") && !c.annotations.contains_key("k099"));

        let many: BTreeMap<String, String> = (0..2000)
            .map(|i| (format!("k{i:04}"), String::new()))
            .collect();
        std::fs::write(
            d.path().join("config.json"),
            serde_json::json!({ "annotations": many }).to_string(),
        )
        .expect("write");
        let c = read_config(d.path(), None).expect("valid");
        assert_eq!(c.annotations.len(), MAX_ANNOTATIONS + 1);
    }

    #[test]
    fn malformed_and_escaping_configs_are_errors() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("config.json"), b"{not json").expect("write");
        let e = read_config(d.path(), None).expect_err("invalid");
        // The cause is kept as a source and printed once, by the chain.
        let chain = lookout_model::Chain(&e).to_string();
        assert!(chain.starts_with("config "), "{chain}");
        assert_eq!(chain.matches("invalid JSON").count(), 1, "{chain}");
        assert!(!e.to_string().contains("invalid JSON"), "{e}");
        assert!(
            matches!(
                &e,
                Error::Config {
                    source: Problem::Json(_),
                    ..
                }
            ),
            "{e:?}"
        );

        let outside = tempfile::NamedTempFile::new().expect("tmp");
        std::fs::write(outside.path(), b"{}").expect("write");
        let b = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink(outside.path(), b.path().join("config.json")).expect("symlink");
        let e = read_config(b.path(), None).expect_err("escapes");
        assert!(
            lookout_model::Chain(&e)
                .to_string()
                .contains("a symlink (not followed)"),
            "{e}"
        );
        // A config.json symlinked to an absolute path resolves inside the
        // bundle: the outside file is never read.
        let inside = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(inside.path().join("etc")).expect("mkdir");
        std::os::unix::fs::symlink("/", inside.path().join("up")).expect("symlink");
        let through = Path::new("up").join(outside.path().strip_prefix("/").expect("abs"));
        assert!(read_config(inside.path(), Some(&through)).is_err());

        let missing = tempfile::tempdir().expect("tempdir");
        assert!(read_config(missing.path(), None).is_err());

        // A FIFO must be refused at once, not block the reader.
        let fifo = tempfile::tempdir().expect("tempdir");
        let path = std::ffi::CString::new(
            fifo.path()
                .join("config.json")
                .as_os_str()
                .as_encoded_bytes(),
        )
        .expect("no NUL");
        // SAFETY: mkfifo with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let e = read_config(fifo.path(), None).expect_err("a fifo");
        assert!(
            lookout_model::Chain(&e)
                .to_string()
                .contains("not a regular file"),
            "{e}"
        );
    }

    #[test]
    fn a_config_is_read_within_the_deadline() {
        // A bounded read: refused while the hung-reader test in
        // `bounded.rs` holds every stuck-reader slot.
        let _serial = crate::bounded::tests::STUCK_COUNT_USERS
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        use std::time::Duration;
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("config.json"), r#"{"hostname":"h"}"#).expect("write");
        let c = read_config_within(Path::new("/"), d.path(), None, Duration::from_secs(2))
            .expect("read");
        assert_eq!(c.hostname.as_deref(), Some("h"));
    }
}
