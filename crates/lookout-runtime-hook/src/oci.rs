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

/// Reader threads that are stuck on a hung file system at most; past this,
/// [`read_config_within`] does not start another one.
pub const MAX_STUCK_READERS: usize = 8;

static STUCK_READERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

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

/// One read on a helper thread, and whether its waiter gave up on it.
///
/// Only reads that outlived their deadline count against
/// [`MAX_STUCK_READERS`]: many reads in flight at once (a burst of
/// containers) are normal; many reads that never come back are a hung file
/// system, and starting more threads for it would only pile them up.
struct Reader {
    /// 0: running, 1: done, 2: abandoned by its waiter (counted as stuck).
    state: std::sync::Arc<std::sync::atomic::AtomicU8>,
}

const RUNNING: u8 = 0;
const DONE: u8 = 1;
const ABANDONED: u8 = 2;

impl Reader {
    /// Starts `f` on a helper thread that hands its result to `send`, or
    /// says why not.
    fn start<T: Send + 'static>(
        f: impl FnOnce() -> T + Send + 'static,
        send: impl FnOnce(T) + Send + 'static,
    ) -> Result<Reader, &'static str> {
        use std::sync::atomic::Ordering;
        if STUCK_READERS.load(Ordering::Acquire) >= MAX_STUCK_READERS {
            return Err("skipped: earlier reads are still hung on their file systems");
        }
        let state = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(RUNNING));
        let thread_state = std::sync::Arc::clone(&state);
        std::thread::Builder::new()
            .name("lookout-config".into())
            .spawn(move || {
                let out = f();
                if thread_state.swap(DONE, Ordering::AcqRel) == ABANDONED {
                    STUCK_READERS.fetch_sub(1, Ordering::AcqRel);
                }
                send(out);
            })
            .map_err(|_| "cannot start a reader thread")?;
        Ok(Reader { state })
    }

    /// The waiter gives up: a read still running now counts as stuck until
    /// it ends.
    fn abandon(&self) {
        use std::sync::atomic::Ordering;
        if self
            .state
            .compare_exchange(RUNNING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            STUCK_READERS.fetch_add(1, Ordering::AcqRel);
        }
    }
}

const TOO_LATE: &str = "not read within the deadline (a hung file system?)";

/// [`bounded`] for async callers: the task is not blocked while the helper
/// thread reads.
pub(crate) async fn bounded_async<T: Send + 'static>(
    deadline: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, &'static str> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let reader = Reader::start(f, move |out| {
        let _ = tx.send(out);
    })?;
    match tokio::time::timeout(deadline, rx).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err("the reader thread ended without an answer"),
        Err(_) => {
            reader.abandon();
            Err(TOO_LATE)
        }
    }
}

/// Runs `f` on a helper thread and waits at most `deadline` for it. A read
/// that takes longer is abandoned (its thread ends whenever the file system
/// answers); while [`MAX_STUCK_READERS`] abandoned reads still run, no new
/// one starts.
pub(crate) fn bounded<T: Send + 'static>(
    deadline: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, &'static str> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let reader = Reader::start(f, move |out| {
        let _ = tx.send(out);
    })?;
    rx.recv_timeout(deadline).map_err(|_| {
        reader.abandon();
        TOO_LATE
    })
}

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

    /// The two tests below share the process-wide count of stuck readers.
    static STUCK_COUNT_USERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn many_reads_in_flight_at_once_are_not_refused() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        // A burst of containers: 20 reads at once, each slower than none
        // of the deadlines. Only reads that outlive their deadline count
        // against MAX_STUCK_READERS.
        use std::time::Duration;
        let threads: Vec<_> = (0..20)
            .map(|i| {
                std::thread::spawn(move || {
                    bounded(Duration::from_secs(5), move || {
                        std::thread::sleep(Duration::from_millis(50));
                        i
                    })
                })
            })
            .collect();
        for (i, t) in threads.into_iter().enumerate() {
            assert_eq!(t.join().expect("thread"), Ok(i));
        }
    }

    #[test]
    fn a_read_that_hangs_is_abandoned_at_the_deadline_and_hung_readers_are_capped() {
        let _serial = STUCK_COUNT_USERS.lock().unwrap_or_else(|e| e.into_inner());
        use std::sync::{Arc, Barrier};
        use std::time::{Duration, Instant};
        // Stand-ins for reads blocked on a hung file system: they wait
        // until the test releases them.
        let release = Arc::new(Barrier::new(MAX_STUCK_READERS + 1));
        for _ in 0..MAX_STUCK_READERS {
            let r = Arc::clone(&release);
            let t = Instant::now();
            let out = bounded(Duration::from_millis(20), move || {
                r.wait();
            });
            assert!(out.is_err());
            assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        }
        // All slots are taken: the next read is refused without a thread.
        let out = bounded(Duration::from_secs(5), || 1);
        assert_eq!(
            out,
            Err("skipped: earlier reads are still hung on their file systems")
        );
        release.wait();
        // Once the file system answers, the slots come back.
        let t = Instant::now();
        loop {
            if let Ok(v) = bounded(Duration::from_secs(1), || 7) {
                assert_eq!(v, 7);
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(5), "slots never freed");
            std::thread::sleep(Duration::from_millis(5));
        }
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("config.json"), r#"{"hostname":"h"}"#).expect("write");
        let c = read_config_within(Path::new("/"), d.path(), None, Duration::from_secs(2))
            .expect("read");
        assert_eq!(c.hostname.as_deref(), Some("h"));
    }
}
