//! The image that `cargo xtask image` builds, run the way
//! `deploy/kubernetes/daemonset.yaml` runs it: imported into a private
//! containerd and started by `ctr run` with the manifest's args, env,
//! capabilities, seccomp (containerd's default profile, what
//! `RuntimeDefault` means there), read-only root, host pid namespace and
//! volumes, all read from the manifest. Then the seed scenario: the same
//! image without `SYS_ADMIN`, and without `BPF` and `PERFMON`.
//!
//! What the test does not take from the manifest, and why:
//! - the `socket` hostPath (`/run/lookout`) becomes a directory of the
//!   test's own, so that the test never touches the host's socket;
//! - the pod's network namespace is containerd's default (loopback only),
//!   as a pod without `hostNetwork` has; the test reaches `/healthz` from
//!   inside it;
//! - `allowPrivilegeEscalation` and `appArmorProfile` have no `ctr run`
//!   flag; containerd's default spec has no AppArmor profile (Unconfined).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lookout_testsupport::{bundle, require_program, skip};
use serde_json::Value;

mod common;
use common::*;

/// The archive `cargo xtask image` writes.
fn archive() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/image/lookout.oci.tar")
}

fn manifest() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes/daemonset.yaml");
    let text = std::fs::read_to_string(&path).expect("daemonset.yaml");
    serde_saphyr::from_str(&text).expect("daemonset.yaml is YAML")
}

/// Every capability name the kernel knows, for `drop: ["ALL"]`.
const ALL_CAPS: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// Bit of capability `name` (as numbered in linux/capability.h).
fn cap_bit(name: &str) -> u32 {
    ALL_CAPS
        .iter()
        .position(|c| *c == name)
        .unwrap_or_else(|| panic!("unknown capability {name}")) as u32
}

/// This process's bounding set.
fn bounding_set() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .expect("CapBnd")
        .trim();
    u64::from_str_radix(hex, 16).expect("hex")
}

/// The agent container as the manifest describes it.
struct Spec {
    args: Vec<String>,
    /// A seccomp profile in place of containerd's default.
    seccomp_profile: Option<PathBuf>,
    /// Namespaces to join (`ctr run --with-ns TYPE:PATH`).
    join: Vec<String>,
    env: Vec<String>,
    caps: BTreeSet<String>,
    read_only: bool,
    seccomp_default: bool,
    host_pid: bool,
    /// (host path, container path, read-only, host-to-container propagation)
    mounts: Vec<(PathBuf, String, bool, bool)>,
}

fn spec(scratch: &Path, without: &[&str]) -> Spec {
    let m = manifest();
    let pod = &m["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    let args = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_owned())
        .collect();
    let env = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            let name = e["name"].as_str().expect("env name");
            let value = match (
                &e["value"],
                e["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
            ) {
                (Value::String(v), _) => v.clone(),
                (_, Some("spec.nodeName")) => "lookout-test-node".to_owned(),
                (_, Some("metadata.namespace")) => m["metadata"]["namespace"]
                    .as_str()
                    .expect("namespace")
                    .to_owned(),
                (_, other) => panic!("env {name}: no value for the test: {other:?}"),
            };
            format!("{name}={value}")
        })
        .collect();
    let drops: Vec<&str> = sc["capabilities"]["drop"]
        .as_array()
        .expect("drop")
        .iter()
        .map(|v| v.as_str().expect("cap"))
        .collect();
    assert_eq!(drops, ["ALL"], "the manifest drops ALL, then adds");
    let bounding = bounding_set();
    let mut caps = BTreeSet::new();
    for cap in sc["capabilities"]["add"].as_array().expect("add") {
        let cap = cap.as_str().expect("cap");
        if without.contains(&cap) {
            continue;
        }
        if bounding & (1 << cap_bit(cap)) == 0 {
            eprintln!(
                "note: CAP_{cap} is not in this machine's bounding set; the agent runs without it"
            );
            continue;
        }
        caps.insert(cap.to_owned());
    }
    let mounts_by_name: std::collections::HashMap<String, &Value> = c["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .map(|v| (v["name"].as_str().expect("name").to_owned(), v))
        .collect();
    let mut mounts = Vec::new();
    for v in pod["volumes"].as_array().expect("volumes") {
        let name = v["name"].as_str().expect("volume name");
        let mount = mounts_by_name[name];
        let target = mount["mountPath"].as_str().expect("mountPath").to_owned();
        let ro = mount["readOnly"].as_bool().unwrap_or(false);
        let slave = mount["mountPropagation"].as_str() == Some("HostToContainer");
        let source = match v["hostPath"]["path"].as_str() {
            // The test's own directory, never the host's socket.
            Some("/run/lookout") => {
                let d = scratch.join("run-lookout");
                std::fs::create_dir_all(&d).expect("socket dir");
                d
            }
            Some(p) => PathBuf::from(p),
            None => {
                assert!(
                    v.get("emptyDir").is_some(),
                    "volume {name}: hostPath or emptyDir"
                );
                let d = scratch.join(format!("empty-{name}"));
                std::fs::create_dir_all(&d).expect("emptyDir");
                d
            }
        };
        mounts.push((source, target, ro, slave));
    }
    Spec {
        args,
        seccomp_profile: None,
        join: Vec::new(),
        env,
        caps,
        read_only: sc["readOnlyRootFilesystem"].as_bool() == Some(true),
        seccomp_default: sc["seccompProfile"]["type"].as_str() == Some("RuntimeDefault"),
        host_pid: pod["hostPID"].as_bool() == Some(true),
        mounts,
    }
}

/// The agent, running in the image under containerd.
struct Pod<'c> {
    containerd: &'c Containerd,
    id: String,
    child: std::process::Child,
    out: Output,
}

impl std::ops::Deref for Pod<'_> {
    type Target = Output;
    fn deref(&self) -> &Output {
        &self.out
    }
}

impl<'c> Pod<'c> {
    fn start(
        containerd: &'c Containerd,
        image: &str,
        spec: &Spec,
        scratch: &Path,
        id: &str,
    ) -> Pod<'c> {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&containerd.socket)
            .args(["run", "--rm"]);
        for e in &spec.env {
            cmd.arg("--env").arg(e);
        }
        for cap in &spec.caps {
            cmd.arg("--cap-add").arg(format!("CAP_{cap}"));
        }
        // `drop: ["ALL"]` then `add`: ctr applies its drops after its adds.
        for cap in ALL_CAPS.iter().filter(|c| !spec.caps.contains(**c)) {
            cmd.arg("--cap-drop").arg(format!("CAP_{cap}"));
        }
        if spec.read_only {
            cmd.arg("--read-only");
        }
        if spec.seccomp_default || spec.seccomp_profile.is_some() {
            cmd.arg("--seccomp");
        }
        if let Some(p) = &spec.seccomp_profile {
            cmd.arg("--seccomp-profile").arg(p);
        }
        if spec.host_pid {
            cmd.arg("--with-ns")
                .arg(format!("pid:/proc/{}/ns/pid", std::process::id()));
        }
        for ns in &spec.join {
            cmd.arg("--with-ns").arg(ns);
        }
        for (src, dst, ro, slave) in &spec.mounts {
            let mut opts = vec!["rbind", if *ro { "ro" } else { "rw" }];
            if *slave {
                opts.push("rslave");
            }
            cmd.arg("--mount").arg(format!(
                "type=bind,src={},dst={dst},options={}",
                src.display(),
                opts.join(":")
            ));
        }
        cmd.arg(image)
            .arg(id)
            .arg("/usr/local/bin/lookout")
            .args(&spec.args);
        let stderr = scratch.join(format!("{id}.stderr"));
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr"))
            .spawn()
            .expect("ctr run");
        let out = Output::collect(child.stdout.take().expect("stdout"), stderr);
        let pod = Pod {
            containerd,
            id: id.to_owned(),
            child,
            out,
        };
        pod.wait_log("lookout_agent::run: ready", Duration::from_secs(30));
        pod
    }

    /// The agent's host pid (the pod shares the host's pid namespace).
    fn pid(&self) -> u32 {
        let out = Command::new("ctr")
            .arg("--address")
            .arg(&self.containerd.socket)
            .args(["task", "ls"])
            .output()
            .expect("ctr task ls");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(self.id.as_str())).then(|| w.next()?.parse().ok())?
            })
            .expect("the agent's task")
    }

    /// `GET path` on the agent's port, from inside the pod's network
    /// namespace (as the kubelet's probes reach it).
    fn get(&self, path: &str) -> (u16, String) {
        let net = std::fs::File::open(format!("/proc/{}/ns/net", self.pid())).expect("net ns");
        let path = path.to_owned();
        std::thread::spawn(move || {
            nix::sched::setns(net, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns net");
            http_get("127.0.0.1:9477", &path)
        })
        .join()
        .expect("http thread")
    }

    /// SIGTERM, as the kubelet stops it; the exit status.
    fn terminate(mut self) -> std::process::ExitStatus {
        let ok = self
            .containerd
            .ctr(&["task", "kill", "--signal", "SIGTERM", &self.id]);
        assert!(ok.success(), "ctr task kill");
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait ctr") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not stop; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Pod<'_> {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self
                .containerd
                .ctr(&["task", "kill", "--signal", "SIGKILL", &self.id]);
            let _ = self.child.wait();
        }
    }
}

/// A cgroup namespace rooted at a cgroup of the test's own, as a pod has
/// on a cgroup v2 node (containerd on this machine's hybrid cgroups makes
/// none): from inside it, other processes' cgroups read as `/../...`.
struct CgroupNamespace {
    holder: std::process::Child,
    dir: PathBuf,
}

impl CgroupNamespace {
    fn new() -> CgroupNamespace {
        let unified = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .iter()
            .map(Path::new)
            .find(|p| p.join("cgroup.controllers").exists())
            .expect("a cgroup2 hierarchy");
        let dir = unified.join(format!("lookout-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a test cgroup");
        let holder = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec unshare --cgroup sleep 600",
                dir.display()
            ))
            .spawn()
            .expect("the namespace's holder");
        let ours = std::fs::read_link("/proc/self/ns/cgroup").expect("our cgroup ns");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let theirs = std::fs::read_link(format!("/proc/{}/ns/cgroup", holder.id()));
            if theirs.is_ok_and(|t| t != ours) {
                break;
            }
            assert!(Instant::now() < deadline, "unshare --cgroup did not happen");
            std::thread::sleep(Duration::from_millis(10));
        }
        CgroupNamespace { holder, dir }
    }

    fn path(&self) -> String {
        format!("/proc/{}/ns/cgroup", self.holder.id())
    }
}

impl Drop for CgroupNamespace {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

/// A runc container on the host, through the system's runc (the one the
/// agent in the image watches, at `/host/usr/sbin/runc`).
/// `root`: runc's `--root` (the scan mode looks only in the runtimes'
/// default roots).
fn host_container(scratch: &Path, id: &str, root: Option<&Path>) -> (u32, PathBuf, PathBuf) {
    let b = bundle::busybox(&scratch.join(id), &["sleep", "2"], |_| {});
    let root = root.map_or_else(|| scratch.join("runc-root"), Path::to_path_buf);
    let pid_file = scratch.join(format!("{id}.pid"));
    let runc = |args: &[&str]| {
        let st = Command::new("runc")
            .arg("--root")
            .arg(&root)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .status()
            .expect("runc");
        assert!(st.success(), "runc {args:?}");
    };
    runc(&[
        "create",
        "--bundle",
        b.to_str().expect("utf-8"),
        "--pid-file",
        pid_file.to_str().expect("utf-8"),
        id,
    ]);
    runc(&["start", id]);
    let pid = std::fs::read_to_string(&pid_file)
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    (pid, b, root)
}

fn cleanup(root: &Path, id: &str) {
    let _ = Command::new("runc")
        .arg("--root")
        .arg(root)
        .args(["delete", "--force", id])
        .stderr(Stdio::null())
        .status();
}

/// The image runs with the manifest's context: fanotify-ebpf, host pids,
/// host cgroup paths, probes, a clean stop. Then without SYS_ADMIN, and
/// without BPF and PERFMON: it keeps running a lower mode.
#[test]
fn the_image_runs_as_the_daemonset_runs_it() {
    if !ready("image_daemonset")
        || !require_program("image_daemonset", "containerd")
        || !require_program("image_daemonset", "ctr")
    {
        return;
    }
    let archive = archive();
    if !archive.exists() {
        skip(
            "image_daemonset",
            &format!(
                "{} is missing: run `cargo xtask image` (`cargo xtask test` does)",
                archive.display()
            ),
        );
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let scratch = dir.path();
    let containerd = Containerd::start(scratch);
    let out = Command::new("ctr")
        .arg("--address")
        .arg(&containerd.socket)
        .args(["image", "import"])
        .arg(&archive)
        .output()
        .expect("ctr image import");
    assert!(
        out.status.success(),
        "import: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = Command::new("ctr")
        .arg("--address")
        .arg(&containerd.socket)
        .args(["image", "ls", "-q"])
        .output()
        .expect("ctr image ls");
    let image = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .find(|l| l.contains("lookout"))
        .unwrap_or_else(|| {
            panic!(
                "the imported image; ctr said {:?}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
        .to_owned();

    // 1. As the manifest says, with a prestart hook that records where it
    // runs, in a cgroup namespace of its own.
    let cgroupns = CgroupNamespace::new();
    let mut s = spec(scratch, &[]);
    s.join.push(format!("cgroup:{}", cgroupns.path()));
    let hook_out = scratch.join("hook.out");
    s.args.push(format!(
        "--prestart=echo \"$(pwd) $(readlink /proc/self/ns/mnt)\" >> {}",
        hook_out.display()
    ));
    if std::fs::read_link("/proc/1/ns/mnt").is_err() {
        // This VM's init hides its namespaces: name a host process whose
        // namespaces are the host's (this test's) instead.
        eprintln!(
            "note: /proc/1/ns is unreadable here; hooks enter this test process's namespaces"
        );
        s.args
            .push(format!("--host-namespaces-pid={}", std::process::id()));
    }
    let started = Instant::now();
    let pod = Pod::start(&containerd, &image, &s, scratch, "lookout-full");
    // The figures of the in-container run (printed for the record; not
    // asserted: this machine is noisy).
    let status = std::fs::read_to_string(format!("/proc/{}/status", pod.pid())).unwrap_or_default();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap_or("VmRSS: ?");
    eprintln!(
        "image run: `ctr run` to ready {} ms; agent {rss}",
        started.elapsed().as_millis()
    );
    pod.wait_log("discovery mode fanotify-ebpf", Duration::from_secs(5));
    let (status, body) = pod.get("/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("mode fanotify-ebpf"), "{body}");
    assert_eq!(pod.get("/healthz").0, 200);
    let id = format!("lk-image-{}", std::process::id());
    let (pid, bundle, root) = host_container(scratch, &id, None);
    // As the host sees it (the container runs `sleep 2`).
    let host_cgroup = lookout_host::proc::cgroup(pid).expect("the container's cgroup");
    let added = pod.wait_event(&id, "added", Duration::from_secs(5));
    cleanup(&root, &id);
    pod.wait_event(&id, "removed", Duration::from_secs(10));
    let c = &added["container"];
    assert_eq!(c["pid"], pid, "the host pid: {added}");
    assert_eq!(c["bundle"], bundle.to_str().expect("utf-8"), "{added}");
    assert_eq!(added["source"], "runtime-hook", "{added}");
    // As the host sees it, not relative to the agent's cgroup namespace.
    assert!(!host_cgroup.starts_with("/.."), "{host_cgroup}");
    assert_eq!(
        c["cgroup"],
        host_cgroup.as_str(),
        "a host cgroup path: {added}"
    );
    // The hook ran in the host's mount namespace, in the bundle.
    let host_mnt = std::fs::read_link("/proc/self/ns/mnt").expect("our mnt ns");
    let recorded = std::fs::read_to_string(&hook_out).expect("the prestart hook ran");
    let want = format!("{} {}", bundle.display(), host_mnt.display());
    assert!(
        recorded.lines().any(|l| l == want),
        "the hook's cwd and mount namespace: want {want:?} in {recorded:?}"
    );
    let metrics = pod.get("/metrics").1;
    assert_eq!(
        metric(&metrics, "lookout_runtime_execs_without_argv_total"),
        Some(0.0),
        "every runtime exec (runc init through /host included) had its argv:\n{metrics}"
    );
    // Its own container, created before it ran, is found by its start-up
    // scan like any other.
    pod.wait_event("lookout-full", "added", Duration::from_secs(5));
    let status = pod.terminate();
    assert!(status.success(), "SIGTERM: exit 0, got {status}");

    // 2. The seed scenario: without SYS_ADMIN, RuntimeDefault's seccomp
    // profile refuses fanotify_init. The agent says why and runs the next
    // mode down (no cluster here: the state scan).
    let s = spec(scratch, &["SYS_ADMIN"]);
    let pod = Pod::start(&containerd, &image, &s, scratch, "lookout-no-sys-admin");
    pod.wait_log("discovery mode scan (refused:", Duration::from_secs(5));
    assert!(pod.log().contains("fanotify"), "{}", pod.log());
    assert_eq!(pod.get("/healthz").0, 200);
    let id = format!("lk-image-scan-{}", std::process::id());
    let (_, _, root) = host_container(scratch, &id, Some(Path::new("/run/runc")));
    let added = pod.wait_event(&id, "added", Duration::from_secs(30));
    cleanup(&root, &id);
    assert_ne!(added["source"], "runtime-hook", "{added}");
    assert!(pod.terminate().success());

    // 3. A node whose seccomp profile refuses bpf(): fanotify without argv
    // capture. (Removing CAP_BPF and CAP_PERFMON would not do it: the
    // kernel grants bpf() and perf_event_open() to CAP_SYS_ADMIN.)
    let mut s = spec(scratch, &[]);
    let profile = scratch.join("no-bpf.json");
    std::fs::write(
        &profile,
        r#"{"defaultAction":"SCMP_ACT_ALLOW","syscalls":[{"names":["bpf"],"action":"SCMP_ACT_ERRNO","errnoRet":1}]}"#,
    )
    .expect("profile");
    s.seccomp_profile = Some(profile);
    let pod = Pod::start(&containerd, &image, &s, scratch, "lookout-no-bpf");
    pod.wait_log("discovery mode fanotify (refused", Duration::from_secs(5));
    let id = format!("lk-image-fan-{}", std::process::id());
    let (pid, _, root) = host_container(scratch, &id, None);
    let added = pod.wait_event(&id, "added", Duration::from_secs(10));
    cleanup(&root, &id);
    assert_eq!(added["container"]["pid"], pid, "{added}");
    assert!(pod.terminate().success());
}
