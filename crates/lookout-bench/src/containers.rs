//! runc containers for the measurements: bundles, and the workers that
//! create, start and delete them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// Makes a runc bundle in `dir` whose root file system is busybox (its
/// `sh`, `sleep` and `true`) and whose process runs `args`, with no
/// terminal. Needs busybox-static and runc.
pub fn busybox_bundle(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("rootfs/bin"))?;
    lookout_testsupport::install_executable(
        Path::new("/bin/busybox"),
        &dir.join("rootfs/bin/busybox"),
    )
    .context("busybox-static needed")?;
    for a in ["sh", "sleep", "true"] {
        let _ = std::os::unix::fs::symlink("busybox", dir.join("rootfs/bin").join(a));
    }
    // `runc spec` refuses to overwrite: the bundle of an earlier agent of
    // the same run (`--against`) is made again.
    let _ = std::fs::remove_file(dir.join("config.json"));
    let st = Command::new("runc")
        .args(["spec", "--bundle"])
        .arg(dir)
        .status()?;
    if !st.success() {
        bail!("runc spec failed");
    }
    let p = dir.join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p)?)?;
    c["process"]["terminal"] = false.into();
    c["process"]["args"] = json!(args);
    std::fs::write(&p, serde_json::to_vec(&c)?)?;
    Ok(())
}

/// The runtime binary `name` as found in PATH, symlinks resolved (a mark
/// is on the file, not on a link to it).
pub(crate) fn in_path(name: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} is not in PATH (install it: cargo xtask test does)"))?
        .canonicalize()
        .with_context(|| format!("resolving {name}"))
}

pub(crate) fn runc(args: &[&str]) -> bool {
    runtime(Path::new("runc"), args)
}

/// Runs the runtime `bin` with `args`, output discarded; whether it
/// succeeded. N.B. not a pipe: the container would inherit it.
pub(crate) fn runtime(bin: &Path, args: &[&str]) -> bool {
    Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Threads that create, start and delete the churn and memory containers.
pub(crate) const WORKERS: usize = 10;

/// `prefix-0` .. `prefix-{n-1}`.
pub(crate) fn container_ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Calls `f` on every id, split among [`WORKERS`] threads.
pub(crate) fn on_workers(ids: &[String], f: impl Fn(&str) + Sync) {
    let f = &f;
    std::thread::scope(|s| {
        for chunk in ids.chunks(ids.len().div_ceil(WORKERS).max(1)) {
            s.spawn(move || {
                for id in chunk {
                    f(id);
                }
            });
        }
    });
}

/// `runc create` and `runc start` of container `id` from `bundle`; whether
/// both succeeded.
pub(crate) fn create_and_start(bundle: &str, id: &str) -> bool {
    runc(&["create", "--bundle", bundle, id]) && runc(&["start", id])
}

/// `runc delete --force` of container `id`.
pub(crate) fn delete(id: &str) {
    runc(&["delete", "--force", id]);
}

/// Polls `done` every `every` until it holds or 60 s have passed.
pub(crate) fn wait_until(every: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() && Instant::now() < deadline {
        std::thread::sleep(every);
    }
}
