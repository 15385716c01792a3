//! A real CRI node: Debian 13's containerd 1.7 (CRI plugin and NRI on),
//! started as root on private sockets, driven like a kubelet.
//!
//! Nothing is shared between two [`CriNode`]s, so parallel tests can each
//! run one: every path (root, state, sockets, runc's state root, the CNI
//! and NRI plugin directories) is in the node's own temporary directory,
//! and containers run through the node's own copy of runc
//! ([`CriNode::runc`]): fanotify marks are per inode, and an agent that
//! watches this copy (`--no-default-runtimes --runtime-path COPY`) sees this
//! node's containers and no other test's.
//!
//! The node has two images, built here without a registry
//! ([`PAUSE_IMAGE`], its sandbox image, and [`BUSYBOX_IMAGE`]), and
//! [`Kubelet`] (blocking) or [`Client`] (async) drive it over CRI.
//!
//! ```no_run
//! use lookout_testsupport::cri::{BUSYBOX_IMAGE, CriNode, PodSpec};
//! let node = CriNode::start().unwrap();
//! println!("CRI on {}, NRI on {}", node.socket().display(), node.nri_socket().display());
//! let mut kubelet = node.kubelet().unwrap();
//! let spec = PodSpec::new("default", "web")
//!     .label("app", "web")
//!     .container("app", BUSYBOX_IMAGE, &["sleep", "60"]);
//! let pod = kubelet.run_pod(&spec).unwrap();
//! kubelet.remove_pod(&pod).unwrap();
//! ```

mod client;
mod image;

pub use client::{Client, ContainerSpec, HostMount, Kubelet, Pod, PodSpec, Status};
pub use image::{BUSYBOX_IMAGE, PAUSE_IMAGE, busybox_archive, pause_archive};

/// The CRI API (kubernetes/cri-api `runtime.v1`, vendored in
/// `proto/api.proto`): messages and the generated tonic clients.
#[allow(missing_docs, clippy::all, clippy::unwrap_used)]
pub mod api {
    tonic::include_proto!("runtime.v1");
}

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long containerd may take to become ready.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Debian 13's containerd 1.7 directory of binaries
/// (`containerd`, `ctr`, `containerd-shim-runc-v2`), which `cargo xtask
/// test` fetches and extracts: `$LOOKOUT_CONTAINERD17` (that directory),
/// else `<cache>/containerd17/root/usr/bin`.
pub fn containerd17() -> PathBuf {
    if let Some(p) = std::env::var_os("LOOKOUT_CONTAINERD17") {
        return p.into();
    }
    crate::cache_dir().join("containerd17/root/usr/bin")
}

/// Whether this test can run a [`CriNode`]: root, runc installed and
/// containerd 1.7 fetched. If not, reports `test` as skipped.
pub fn require_cri(test: &str) -> bool {
    if !crate::require_root(test) || !crate::require_program(test, "runc") {
        return false;
    }
    let bin = containerd17();
    for b in ["containerd", "ctr", "containerd-shim-runc-v2"] {
        if !bin.join(b).is_file() {
            crate::skip(
                test,
                &format!(
                    "{} is missing: `sudo -E cargo xtask test` fetches Debian 13's containerd \
                     (or set LOOKOUT_CONTAINERD17 to its bin directory)",
                    bin.join(b).display()
                ),
            );
            return false;
        }
    }
    true
}

/// A running containerd 1.7 with the CRI plugin and NRI, on private
/// sockets. Dropping it stops containerd, its shims and their containers,
/// and unmounts whatever they left mounted under its directory.
pub struct CriNode {
    child: Option<Child>,
    dir: Option<tempfile::TempDir>,
    bin: PathBuf,
    runc: PathBuf,
    runc_root: PathBuf,
    socket: PathBuf,
    nri_socket: PathBuf,
    root: PathBuf,
    log: PathBuf,
    started_in: Duration,
    ready_in: Duration,
}

impl std::fmt::Debug for CriNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CriNode")
            .field("socket", &self.socket)
            .field("nri_socket", &self.nri_socket)
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl CriNode {
    /// Starts containerd 1.7 (see [`containerd17`]) with its own root,
    /// state, sockets and runc copy, NRI enabled, waits until it answers
    /// CRI (its NRI socket listens by then), and imports
    /// [`PAUSE_IMAGE`] and [`BUSYBOX_IMAGE`]. Needs root. Callable from
    /// async code too (the CRI calls run on a thread of their own).
    pub fn start() -> io::Result<CriNode> {
        let mut node = CriNode::start_bare()?;
        let t0 = Instant::now();
        let deadline = t0 + START_TIMEOUT;
        std::thread::scope(|s| {
            s.spawn(|| node.cri_ready_with_images(deadline))
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the CRI readiness thread panicked")))
        })?;
        node.ready_in = node.started_in + t0.elapsed();
        Ok(node)
    }

    /// Waits until CRI answers `Version`, imports the images and waits
    /// until CRI lists them.
    fn cri_ready_with_images(&self, deadline: Instant) -> io::Result<()> {
        let mut kubelet = self.kubelet()?;
        loop {
            match kubelet.version() {
                Ok(_) => break,
                Err(e) if Instant::now() >= deadline => {
                    return Err(io::Error::other(format!(
                        "CRI never answered Version: {e}; log:\n{}",
                        self.log()
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        for (name, archive) in [
            (PAUSE_IMAGE, pause_archive()?),
            (BUSYBOX_IMAGE, busybox_archive()?),
        ] {
            self.import(name, archive)?;
        }
        for name in [PAUSE_IMAGE, BUSYBOX_IMAGE] {
            loop {
                match kubelet.block_on(async |c: &mut Client| c.has_image(name).await) {
                    Ok(true) => break,
                    other if Instant::now() >= deadline => {
                        return Err(io::Error::other(format!(
                            "CRI does not see the imported {name}: {other:?}; log:\n{}",
                            self.log()
                        )));
                    }
                    _ => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        }
        Ok(())
    }

    /// Imports the OCI archive `archive` into namespace `k8s.io` as
    /// `name` (`ctr image import --index-name NAME -`).
    pub fn import(&self, name: &str, archive: &[u8]) -> io::Result<()> {
        use std::io::Write;
        let err = tempfile::tempfile()?;
        let mut child = Command::new(self.bin.join("ctr"))
            .arg("--address")
            .arg(&self.socket)
            .args(["-n", "k8s.io", "image", "import", "--index-name", name, "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(err.try_clone()?)
            .spawn()?;
        let wrote = child.stdin.take().map(|mut i| i.write_all(archive));
        let status = child.wait()?;
        if !status.success() || !matches!(wrote, Some(Ok(()))) {
            let mut text = String::new();
            let mut err = err;
            let _ = std::io::Seek::rewind(&mut err);
            let _ = std::io::Read::read_to_string(&mut err, &mut text);
            return Err(io::Error::other(format!(
                "ctr image import {name}: {status}, {wrote:?}: {text}"
            )));
        }
        Ok(())
    }

    /// A blocking CRI client on this node (pods' logs under
    /// `<dir>/pods`). Not from inside an async runtime: use
    /// [`CriNode::client`] there.
    pub fn kubelet(&self) -> io::Result<Kubelet> {
        Kubelet::connect(&self.socket, Some(&self.dir().join("pods")))
    }

    /// An async CRI client on this node (pods' logs under `<dir>/pods`).
    pub async fn client(&self) -> io::Result<Client> {
        Ok(Client::connect(&self.socket)
            .await?
            .with_log_root(&self.dir().join("pods")))
    }

    /// [`CriNode::start`] without the CRI readiness and the images: ready
    /// when the containerd socket accepts connections and the NRI socket
    /// exists.
    pub fn start_bare() -> io::Result<CriNode> {
        let bin = containerd17();
        let containerd = bin.join("containerd");
        if !containerd.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{} is missing (cargo xtask test fetches it)",
                    containerd.display()
                ),
            ));
        }
        let system_runc = crate::find_program("runc")
            .or_else(|| Some(PathBuf::from("/usr/sbin/runc")).filter(|p| p.is_file()))
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "runc is not installed"))?;
        // Short paths: a Unix socket's path has at most 107 bytes.
        let dir = tempfile::Builder::new().prefix("cri").tempdir_in("/tmp")?;
        let d = dir.path();
        let path_dir = d.join("bin");
        std::fs::create_dir_all(&path_dir)?;
        // The node's own runc (its own inode: see the module's docs).
        let runc = path_dir.join("runc");
        crate::install_executable(&system_runc, &runc)?;
        let runc_root = d.join("runc");
        let socket = d.join("containerd.sock");
        let nri_socket = d.join("nri.sock");
        let root = d.join("root");
        let state = d.join("state");
        for sub in ["cni/bin", "cni/conf", "nri/plugins", "nri/conf", "opt"] {
            std::fs::create_dir_all(d.join(sub))?;
        }
        let config = d.join("config.toml");
        std::fs::write(
            &config,
            format!(
                r#"version = 2
root = "{root}"
state = "{state}"
# Plugins that cannot work here, or that would share the system's paths.
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = "{nri}"
  plugin_path = "{d}/nri/plugins"
  plugin_config_path = "{d}/nri/conf"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:1"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # These VMs lack CAP_SYS_RESOURCE; without this the pause container's
  # oom_score_adj -998 fails ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  enable_selinux = false
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "{d}/cni/bin"
  conf_dir = "{d}/cni/conf"
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  Root = "{runc_root}"
  SystemdCgroup = false
"#,
                root = root.display(),
                state = state.display(),
                sock = socket.display(),
                nri = nri_socket.display(),
                d = d.display(),
                runc = runc.display(),
                runc_root = runc_root.display(),
            ),
        )?;
        let log = d.join("containerd.log");
        // The shim from the same package first on PATH, then the node's
        // runc, then the system's (mount, for instance).
        let mut path = vec![bin.clone(), path_dir.clone()];
        if let Some(p) = std::env::var_os("PATH") {
            path.extend(std::env::split_paths(&p));
        }
        let t0 = Instant::now();
        let child = Command::new(&containerd)
            .arg("--config")
            .arg(&config)
            .arg("--log-level")
            .arg(std::env::var("LOOKOUT_CONTAINERD_LOG").unwrap_or_else(|_| "info".into()))
            .env(
                "PATH",
                std::env::join_paths(path).map_err(io::Error::other)?,
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        let mut node = CriNode {
            child: Some(child),
            dir: Some(dir),
            bin,
            runc,
            runc_root,
            socket,
            nri_socket,
            root,
            log,
            started_in: Duration::ZERO,
            ready_in: Duration::ZERO,
        };
        node.wait_ready(t0 + START_TIMEOUT)?;
        node.started_in = t0.elapsed();
        node.ready_in = node.started_in;
        Ok(node)
    }

    /// Polls until containerd accepts connections on its socket (which it
    /// does after its NRI socket listens), or fails at `deadline` (or when containerd
    /// exits), with the log.
    fn wait_ready(&mut self, deadline: Instant) -> io::Result<()> {
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                return Err(io::Error::other(format!(
                    "containerd exited ({status}) before it was ready; log:\n{}",
                    self.log()
                )));
            }
            let log = self.log();
            if let Some(line) = log
                .lines()
                .find(|l| l.contains("failed to load plugin io.containerd.grpc.v1.cri"))
            {
                return Err(io::Error::other(format!(
                    "containerd's CRI plugin did not load: {line}\nlog:\n{log}"
                )));
            }
            // containerd serves its socket once every plugin is loaded:
            // NRI listens by then. (A test connection to the NRI socket
            // would be logged as a plugin that failed to register.)
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok()
                && self.nri_socket.exists()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "containerd not ready within {START_TIMEOUT:?}; log:\n{}",
                        self.log()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// containerd's gRPC socket, which also serves CRI
    /// (`runtime.v1.RuntimeService` and `ImageService`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The NRI socket plugins connect to.
    pub fn nri_socket(&self) -> &Path {
        &self.nri_socket
    }

    /// containerd's root directory (content, snapshots, metadata).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The node's directory (everything of the node is under it).
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("the node's directory").path()
    }

    /// The node's own copy of runc, which its containers run through: the
    /// path to give an agent (`--runtime-path`).
    pub fn runc(&self) -> &Path {
        &self.runc
    }

    /// runc's state root for this node's containers (`runc --root`).
    pub fn runc_root(&self) -> &Path {
        &self.runc_root
    }

    /// The directory of containerd 1.7's binaries (`ctr` and the shim).
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// containerd's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The path of containerd's log.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// How long containerd took from spawn to its sockets accepting
    /// connections.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// How long [`CriNode::start`] took from spawn to CRI ready with the
    /// images imported (as [`CriNode::started_in`] for
    /// [`CriNode::start_bare`]).
    pub fn ready_in(&self) -> Duration {
        self.ready_in
    }

    /// The process id of containerd.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// Runs the package's `ctr` against this node in namespace `k8s.io`;
    /// the output, or an error with its stderr when it fails.
    pub fn ctr(&self, args: &[&str]) -> io::Result<String> {
        let out = Command::new(self.bin.join("ctr"))
            .arg("--address")
            .arg(&self.socket)
            .args(["-n", "k8s.io"])
            .args(args)
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "ctr {args:?}: {}{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The shims this node's containerd started (found by their
    /// `-address` argument, which is the node's own socket).
    fn shims(&self) -> Vec<i32> {
        let want = self.socket.as_os_str().as_encoded_bytes();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        procs
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                    return false;
                };
                let mut args = cmdline.split(|b| *b == 0);
                let is_shim = args
                    .next()
                    .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"));
                is_shim && cmdline.split(|b| *b == 0).any(|a| a == want)
            })
            .collect()
    }

    /// The sockets of this node's shims, from the tasks' `address` files
    /// (`<state>/io.containerd.runtime.v2.task/<namespace>/<id>/address`).
    fn shim_sockets(&self) -> Vec<PathBuf> {
        let tasks = self.dir().join("state/io.containerd.runtime.v2.task");
        let dirs = |d: &Path| {
            std::fs::read_dir(d)
                .map(|r| r.flatten().map(|e| e.path()).collect::<Vec<_>>())
                .unwrap_or_default()
        };
        let mut sockets: Vec<PathBuf> = dirs(&tasks)
            .iter()
            .flat_map(|ns| dirs(ns))
            .filter_map(|task| std::fs::read_to_string(task.join("address")).ok())
            .filter_map(|a| a.trim().strip_prefix("unix://").map(PathBuf::from))
            .filter(|p| p.starts_with("/run/containerd/s/"))
            .collect();
        sockets.sort();
        sockets.dedup();
        sockets
    }

    fn cleanup(&mut self) {
        // A killed shim leaves its socket (`/run/containerd/s/<hash>`,
        // named in each task's `address` file).
        let shim_sockets = self.shim_sockets();
        // Containers first (runc through the node's own state root, one
        // directory per containerd namespace), so that no process of the
        // node outlives it.
        let roots = std::fs::read_dir(&self.runc_root)
            .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default();
        for root in roots {
            let runc = |args: &[&str]| {
                Command::new(&self.runc)
                    .arg("--root")
                    .arg(&root)
                    .args(args)
                    .stdin(Stdio::null())
                    .stderr(Stdio::null())
                    .output()
            };
            if let Ok(out) = runc(&["list", "-q"]) {
                for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = runc(&["delete", "--force", id]);
                }
            }
        }
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        }
        let shims = self.shims();
        for &pid in &shims {
            // SAFETY: kill(2) on a shim this node's containerd started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // kill(2) returns before a killed process has run its exit: until
        // then its /proc entry is whole (a caller checking that no shim
        // is left would find it). Gone or a zombie (of init) is dead.
        let dead = |pid: i32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
                s.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X'))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !shims.iter().all(|&p| dead(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for s in shim_sockets {
            let _ = std::fs::remove_file(s);
        }
        if let Some(dir) = self.dir.take() {
            unmount_under(dir.path());
            let path = dir.path().to_path_buf();
            if let Err(e) = dir.close() {
                eprintln!("CriNode: could not remove {}: {e}", path.display());
            }
        }
    }
}

impl Drop for CriNode {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// Unmounts (lazily, deepest first) every mount point under `dir` in
/// this process's mount namespace: overlay root file systems, sandboxes'
/// `/dev/shm` and the like, which containerd and its shims leave behind
/// when they are killed.
pub fn unmount_under(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .filter(|p| p.starts_with(dir) && p != dir)
        .collect();
    // Deepest first; a path mounted twice is unmounted twice.
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: umount2 with a NUL-terminated path we own.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    use std::os::unix::ffi::OsStringExt;
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(
            unescape_mountinfo(r"/tmp/a\040b\134c"),
            PathBuf::from("/tmp/a b\\c")
        );
        assert_eq!(unescape_mountinfo(r"/x\04"), PathBuf::from(r"/x\04"));
    }
}
