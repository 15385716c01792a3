//! Kernel, privileges, namespaces, sandbox, cgroups and Kubernetes
//! configuration: everything the probe learns without touching fanotify or
//! BPF.

use std::path::Path;

use crate::report::{Check, Fail, Status};

/// The inode of the initial pid namespace (`PROC_PID_INIT_INO`), fixed by
/// the kernel.
const PROC_PID_INIT_INO: u64 = 0xEFFF_FFFC;
/// The inode of the initial user namespace (`PROC_USER_INIT_INO`).
const PROC_USER_INIT_INO: u64 = 0xEFFF_FFFD;

/// The capabilities lookout's modes use, with their numbers and why.
pub const CAPABILITIES: [(&str, u32, &str); 5] = [
    (
        "CAP_SYS_ADMIN",
        21,
        "fanotify permission events and BPF on older kernels",
    ),
    ("CAP_BPF", 39, "loading BPF programs and maps"),
    ("CAP_PERFMON", 38, "attaching tracepoint programs"),
    (
        "CAP_SYS_PTRACE",
        19,
        "reading /proc/<pid> of other users' processes",
    ),
    (
        "CAP_DAC_READ_SEARCH",
        2,
        "reading runtime state directories and opening file handles",
    ),
];

/// `uname -r`.
pub fn kernel_release() -> Result<String, Fail> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .map_err(|e| Fail::error(format!("reading /proc/sys/kernel/osrelease: {e}")))
}

/// The effective capability mask from `/proc/self/status`.
pub fn effective_caps() -> Result<u64, Fail> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| Fail::error(format!("reading /proc/self/status: {e}")))?;
    parse_cap_eff(&status).ok_or_else(|| Fail::error("no CapEff line in /proc/self/status"))
}

fn parse_cap_eff(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
}

/// One check per capability in [`CAPABILITIES`].
pub fn capability_checks(caps: &Result<u64, Fail>) -> Vec<Check> {
    CAPABILITIES
        .iter()
        .map(|(name, bit, why)| {
            let check_name = format!("capability:{name}");
            match caps {
                Ok(mask) if mask & (1u64 << bit) != 0 => {
                    Check::new(check_name, Status::Ok, format!("held ({why})"))
                }
                Ok(_) => Check::new(
                    check_name,
                    Status::Unsupported,
                    format!("missing (needed for {why})"),
                ),
                Err(f) => Check::new(check_name, f.status, f.reason.clone()),
            }
        })
        .collect()
}

fn ns_inode(link: &str) -> Result<u64, Fail> {
    let target =
        std::fs::read_link(link).map_err(|e| Fail::error(format!("readlink {link}: {e}")))?;
    let s = target.to_string_lossy();
    s.split('[')
        .nth(1)
        .and_then(|r| r.trim_end_matches(']').parse().ok())
        .ok_or_else(|| Fail::error(format!("unexpected {link} target {s:?}")))
}

/// Whether we run in the initial (host) pid namespace.
pub fn host_pid_namespace() -> Result<String, Fail> {
    let ino = ns_inode("/proc/self/ns/pid")?;
    if ino == PROC_PID_INIT_INO {
        Ok("host (initial) pid namespace".into())
    } else {
        Err(Fail::unsupported(format!(
            "pid namespace {ino} is not the host's: fanotify reports pid 0 for host processes \
             (run with hostPID: true)"
        )))
    }
}

/// Whether we run in the initial user namespace.
pub fn host_user_namespace() -> Result<String, Fail> {
    let ino = ns_inode("/proc/self/ns/user")?;
    if ino == PROC_USER_INIT_INO {
        Ok("initial user namespace".into())
    } else {
        Err(Fail::unsupported(format!(
            "user namespace {ino} is not the initial one: capabilities do not reach host \
             files, so fanotify_init(FAN_CLASS_CONTENT) fails with EPERM"
        )))
    }
}

/// Sandbox detection. gVisor reports a fixed fake kernel version string and
/// hides `/proc/kallsyms`; either hint with the other is conclusive enough.
pub fn sandbox() -> Result<String, Fail> {
    let version = std::fs::read_to_string("/proc/sys/kernel/version").unwrap_or_default();
    let gvisor_version = version.contains("Sun Jan 10 15:06:54 PST 2016");
    let no_kallsyms = !Path::new("/proc/kallsyms").exists();
    if gvisor_version || (no_kallsyms && version.trim() == "#1 SMP") {
        return Err(Fail::unsupported(
            "gVisor (runsc) sandbox: the host's runtime binaries and fanotify are out of reach",
        ));
    }
    Ok("none detected".into())
}

/// The open-file limit (`RLIMIT_NOFILE`). `lookout run` raises its soft
/// limit to the hard one at start; the fds it needs grow with tracked
/// containers, running hooks and connections, and when fanotify cannot
/// install an event's fd the kernel *denies* the exec.
pub fn nofile_limit() -> Result<String, Fail> {
    // SAFETY: zeroed is a valid rlimit; getrlimit writes into it.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: a valid resource and a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(Fail::error(format!(
            "getrlimit(RLIMIT_NOFILE): {}",
            std::io::Error::last_os_error()
        )));
    }
    let show = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            "unlimited".to_owned()
        } else {
            v.to_string()
        }
    };
    let detail = format!(
        "soft {}, hard {} (lookout run raises the soft limit to the hard one)",
        show(lim.rlim_cur),
        show(lim.rlim_max)
    );
    if lim.rlim_max != libc::RLIM_INFINITY && lim.rlim_max < 1024 {
        return Err(Fail::unsupported(format!(
            "{detail}: below 1024, a busy node can run the agent out of fds"
        )));
    }
    Ok(detail)
}

/// cgroup layout at `/sys/fs/cgroup`.
pub fn cgroup_version() -> Result<String, Fail> {
    let root = statfs_magic("/sys/fs/cgroup")
        .map_err(|e| Fail::error(format!("statfs /sys/fs/cgroup: {e}")))?;
    if root == libc::CGROUP2_SUPER_MAGIC {
        return Ok("v2 (unified)".into());
    }
    match statfs_magic("/sys/fs/cgroup/unified") {
        Ok(m) if m == libc::CGROUP2_SUPER_MAGIC => {
            Ok("hybrid (v1 controllers, v2 at /sys/fs/cgroup/unified)".into())
        }
        _ => Ok("v1".into()),
    }
}

/// `statfs(2)`'s `f_type` of the file system `path` is on.
pub(crate) fn statfs_magic(path: impl AsRef<std::path::Path>) -> std::io::Result<libc::c_long> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_ref().as_os_str().as_bytes())
        .map_err(std::io::Error::other)?;
    // SAFETY: zeroed is a valid bit pattern for the plain C struct statfs.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `buf` is a valid, writable statfs.
    if unsafe { libc::statfs(c.as_ptr(), &mut buf) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(buf.f_type as libc::c_long)
}

/// Where the Kubernetes client configuration would come from.
pub fn kube_config(env: &dyn Fn(&str) -> Option<String>) -> Result<String, Fail> {
    const TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
    if let (Some(host), Some(port)) = (
        env("KUBERNETES_SERVICE_HOST"),
        env("KUBERNETES_SERVICE_PORT"),
    ) {
        if Path::new(TOKEN).exists() {
            return Ok(format!(
                "in-cluster (https://{host}:{port}, service account token)"
            ));
        }
        return Err(Fail::unsupported(format!(
            "KUBERNETES_SERVICE_HOST is set but {TOKEN} is missing (automountServiceAccountToken: false?)"
        )));
    }
    if let Some(kc) = env("KUBECONFIG").filter(|s| !s.is_empty()) {
        let first = std::env::split_paths(&kc).find(|p| p.exists());
        return match first {
            Some(p) => Ok(format!("kubeconfig {}", p.display())),
            None => Err(Fail::unsupported(format!(
                "KUBECONFIG={kc} names no existing file"
            ))),
        };
    }
    if let Some(home) = env("HOME") {
        let p = Path::new(&home).join(".kube/config");
        if p.exists() {
            return Ok(format!("kubeconfig {}", p.display()));
        }
    }
    Err(Fail::unsupported(
        "no cluster: not in a pod (KUBERNETES_SERVICE_HOST unset) and no KUBECONFIG or ~/.kube/config",
    ))
}

/// `NODE_NAME`, which the Pod informer needs to select this node's pods.
pub fn node_name(env: &dyn Fn(&str) -> Option<String>) -> Result<String, Fail> {
    match env("NODE_NAME").filter(|s| !s.is_empty()) {
        Some(n) => Ok(n),
        None => Err(Fail::unsupported(
            "NODE_NAME is not set (set it from the downward API: fieldRef spec.nodeName)",
        )),
    }
}

/// Whether the runtime state directories under the host root are readable
/// (what the scan mode needs).
pub fn state_dirs(host_root: &Path) -> Result<String, Fail> {
    let run = host_root.join("run");
    match std::fs::read_dir(&run) {
        Ok(_) => {
            let known = [
                "runc",
                "crun",
                "containerd/runc",
                "containers",
                "docker/runtime-runc/moby",
            ];
            let present: Vec<&str> = known
                .iter()
                .copied()
                .filter(|d| run.join(d).is_dir())
                .collect();
            if present.is_empty() {
                Ok(format!(
                    "{} readable; no runtime state directory yet",
                    run.display()
                ))
            } else {
                Ok(format!(
                    "{} readable; found {}",
                    run.display(),
                    present.join(", ")
                ))
            }
        }
        Err(e) => Err(Fail::unsupported(format!(
            "cannot read {}: {} (mount the host's /run)",
            run.display(),
            crate::errno::describe(&e)
        ))),
    }
}

/// Whether the runtime's NRI socket (`socket`, a host path) is there, under
/// `host_root`, resolved as the host resolves it (`/var/run` is a symlink
/// to `/run`). Nothing connects to it: a connection that does not
/// register is logged by the runtime as a failed plugin. `lookout run`
/// registers for real (`--nri`).
pub fn nri_socket(host_root: &Path, socket: &Path) -> Result<String, Fail> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let shown = host_root.join(socket.strip_prefix("/").unwrap_or(socket));
    let at = match lookout_host::resolve_in_root(host_root, socket) {
        Ok(at) => at,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Fail::unsupported(format!(
                "no {}: NRI is off or unsupported (containerd before 1.7, or NRI disabled in \
                 its config; CRI-O before 1.30)",
                shown.display()
            )));
        }
        Err(e) => return Err(Fail::unsupported(format!("{}: {e}", shown.display()))),
    };
    match std::fs::symlink_metadata(&at) {
        Ok(m) if m.file_type().is_socket() && m.uid() == 0 => Ok(format!(
            "{} is a socket: the runtime has NRI on (lookout run registers through it)",
            at.display()
        )),
        Ok(m) if m.file_type().is_socket() => Err(Fail::unsupported(format!(
            "{} is a socket owned by uid {}, not root: lookout run refuses it",
            at.display(),
            m.uid()
        ))),
        Ok(_) => Err(Fail::unsupported(format!(
            "{} is not a socket",
            at.display()
        ))),
        Err(e) => Err(Fail::unsupported(format!("{}: {e}", at.display()))),
    }
}

/// Whether dockerd answers on one of `sockets` (host paths): Docker's
/// containers then get their name, image and labels.
pub fn docker_sockets(host_root: &Path, sockets: &[std::path::PathBuf]) -> Result<String, Fail> {
    let mut why = Vec::new();
    for socket in sockets {
        let shown = host_root.join(socket.strip_prefix("/").unwrap_or(socket));
        let at = match lookout_host::resolve_in_root(host_root, socket) {
            Ok(at) => at,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                why.push(format!("no {}", shown.display()));
                continue;
            }
            Err(e) => {
                why.push(format!("{}: {e}", shown.display()));
                continue;
            }
        };
        let client = lookout_docker::Client::new(&at)
            .timeout(std::time::Duration::from_secs(1))
            .owner(0);
        match client.version() {
            Ok(v) => {
                return Ok(format!(
                    "Docker {} (API {}) answers at {}: Docker's containers get their name, image \
                     and labels",
                    v.version,
                    v.api_version,
                    at.display()
                ));
            }
            Err(e) => why.push(crate::chain(&e)),
        }
    }
    Err(Fail::unsupported(format!(
        "{}: Docker's containers are reported without their name, image and labels (nothing \
         is missing on a node without Docker; --docker-socket names another socket)",
        why.join("; ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cap_eff() {
        let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001fffeffffff\n";
        assert_eq!(parse_cap_eff(status), Some(0x1fffeffffff));
        assert_eq!(parse_cap_eff("CapEff:\tzz\n"), None);
    }

    #[test]
    fn capability_checks_name_missing_caps() {
        let checks = capability_checks(&Ok(1 << 21));
        assert_eq!(checks[0].name, "capability:CAP_SYS_ADMIN");
        assert_eq!(checks[0].status, Status::Ok);
        assert_eq!(checks[1].status, Status::Unsupported);
        assert!(checks[1].detail.starts_with("missing"));
    }

    #[test]
    fn kube_config_sources() {
        let none = |_: &str| None;
        assert!(kube_config(&none).is_err());
        let kc = |k: &str| (k == "KUBECONFIG").then(|| "/definitely/missing".to_owned());
        assert!(
            kube_config(&kc)
                .expect_err("missing kubeconfig")
                .reason
                .contains("no existing file")
        );
        let node = |k: &str| (k == "NODE_NAME").then(|| "node-1".to_owned());
        assert_eq!(node_name(&node).ok().as_deref(), Some("node-1"));
        assert!(node_name(&none).is_err());
    }

    #[test]
    fn the_nri_socket_is_found_under_the_host_root_without_connecting() {
        let root = tempfile::tempdir().expect("tempdir");
        let at = Path::new("/var/run/nri/nri.sock");
        let e = nri_socket(root.path(), at).expect_err("absent");
        assert!(
            e.reason.contains("NRI is off or unsupported"),
            "{}",
            e.reason
        );
        std::fs::create_dir_all(root.path().join("var/run/nri")).expect("mkdir");
        std::fs::write(root.path().join("var/run/nri/nri.sock"), b"").expect("write");
        let e = nri_socket(root.path(), at).expect_err("a file");
        assert!(e.reason.contains("not a socket"), "{}", e.reason);
        std::fs::remove_file(root.path().join("var/run/nri/nri.sock")).expect("rm");
        let _listener =
            std::os::unix::net::UnixListener::bind(root.path().join("var/run/nri/nri.sock"))
                .expect("bind");
        match nri_socket(root.path(), at) {
            Ok(ok) => assert!(ok.contains("is a socket"), "{ok}"),
            // Not root: the socket is the test's user's.
            Err(e) => assert!(e.reason.contains("not root"), "{}", e.reason),
        }
    }

    #[test]
    fn the_nri_socket_is_found_through_the_hosts_absolute_symlinks() {
        use std::os::unix::fs::MetadataExt;
        // As on a systemd host: var/run -> /run, which must resolve inside
        // the host root, not in the prober's own /run.
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(root.path().join("run/nri")).expect("mkdir");
        std::fs::create_dir_all(root.path().join("var")).expect("mkdir");
        std::os::unix::fs::symlink("/run", root.path().join("var/run")).expect("symlink");
        let sock = root.path().join("run/nri/nri.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
        let at = Path::new("/var/run/../var/run/nri/nri.sock");
        let found = nri_socket(root.path(), at);
        if std::fs::metadata(&sock).expect("stat").uid() == 0 {
            let ok = found.expect("found");
            assert!(ok.contains(&sock.display().to_string()), "{ok}");
        } else {
            let e = found.expect_err("not root's");
            assert!(e.reason.contains("not root"), "{}", e.reason);
        }
        // A symlink loop ends.
        std::os::unix::fs::symlink("/loop", root.path().join("loop")).expect("symlink");
        let e = nri_socket(root.path(), Path::new("/loop/nri.sock")).expect_err("loop");
        assert!(!e.reason.is_empty());
    }
}
