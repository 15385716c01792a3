//! Docker Engine's containers with their identity, on a real, private
//! dockerd (its own data and exec roots, no iptables, no bridge): Debian
//! 12's 20.10 and Debian 13's 26.1 (fetched by `cargo xtask test`). Each
//! dockerd runs its containers through the test's own runc copy (its
//! default runtime), which the test's agent watches.
//!
//! Docker copies none of a container's name, image or labels into the OCI
//! config: the agent reports the container from runc's exec at once, and
//! what dockerd knows follows in an `updated` event.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lookout_testsupport::{require_program, skip};
use serde_json::Value;

mod common;
use common::*;

/// A private dockerd, stopped (and its containers removed) on drop.
struct Dockerd {
    child: std::process::Child,
    dir: tempfile::TempDir,
    socket: PathBuf,
    cli: PathBuf,
}

impl Dockerd {
    /// Starts `dockerd` with `runc` as its default runtime, and imports a
    /// busybox image as `localhost/bb:1`.
    fn start(dockerd: &Path, runc: &Runtime) -> Dockerd {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let socket = d.join("docker.sock");
        let child = Command::new(dockerd)
            .arg("--data-root")
            .arg(d.join("data"))
            .arg("--exec-root")
            .arg(d.join("exec"))
            .arg("--pidfile")
            .arg(d.join("dockerd.pid"))
            .args(["--iptables=false", "--bridge=none"])
            .arg("-H")
            .arg(format!("unix://{}", socket.display()))
            .arg("--add-runtime")
            .arg(format!("lkrunc={}", runc.path.display()))
            .arg("--default-runtime=lkrunc")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("dockerd.log")).expect("log"))
            .spawn()
            .expect("start dockerd");
        // /usr/bin/docker is Debian 12's 20.10 client (API 1.41), which both
        // daemons serve; another client earlier in PATH may be newer.
        let cli = ["/usr/bin/docker"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .or_else(|| lookout_testsupport::find_program("docker"))
            .expect("docker.io's client");
        let docker = Dockerd {
            child,
            dir,
            socket,
            cli,
        };
        let client = lookout_docker::Client::new(&docker.socket).timeout(Duration::from_secs(2));
        let deadline = Instant::now() + Duration::from_secs(60);
        while client.version().is_err() {
            assert!(
                Instant::now() < deadline,
                "dockerd did not answer within 60 s:\n{}",
                docker.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // An image without a registry: busybox's root file system.
        let bundle = docker.dir.path().join("image");
        lookout_testsupport::bundle::busybox(&bundle, &["true"], |_| {});
        let mut tar = Command::new("tar")
            .arg("-C")
            .arg(bundle.join("rootfs"))
            .args(["-c", "."])
            .stdout(Stdio::piped())
            .spawn()
            .expect("tar");
        let status = docker
            .command(&["import", "-", "localhost/bb:1"])
            .stdin(tar.stdout.take().expect("tar's stdout"))
            .stdout(Stdio::null())
            .status()
            .expect("docker import");
        assert!(tar.wait().is_ok_and(|s| s.success()), "tar failed");
        assert!(status.success(), "docker import failed:\n{}", docker.log());
        docker
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("dockerd.log")).unwrap_or_default()
    }

    /// `<exec-root>/runtime-runc/moby`: its runc state root.
    fn state_root(&self) -> PathBuf {
        self.dir.path().join("exec/runtime-runc/moby")
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.cli);
        c.arg("-H")
            .arg(format!("unix://{}", self.socket.display()))
            .args(args)
            .env_remove("DOCKER_HOST")
            .stdin(Stdio::null());
        c
    }

    /// Runs the client; its stdout, trimmed, or the test fails.
    fn docker(&self, args: &[&str]) -> String {
        let out = self.command(args).output().expect("run docker");
        assert!(
            out.status.success(),
            "docker {args:?} failed: {}\ndockerd:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The daemon's version, as `/version` says.
    fn version(&self) -> String {
        lookout_docker::Client::new(&self.socket)
            .version()
            .expect("version")
            .version
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        // Containers first (dockerd's own stop waits 10 s for each one
        // whose init ignores SIGTERM), then the daemon and its containerd.
        if let Ok(out) = self.command(&["ps", "-aq"]).output() {
            let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            if !ids.is_empty() {
                let mut args = vec!["rm", "-f"];
                args.extend(ids.iter().map(String::as_str));
                let _ = self.command(&args).stdout(Stdio::null()).status();
            }
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // dockerd leaves its data root bind-mounted on itself.
        let _ = nix::mount::umount2(
            &self.dir.path().join("data"),
            nix::mount::MntFlags::MNT_DETACH,
        );
    }
}

/// A Docker-style id (64 hex digits) unique to this test process and
/// call: the test pid, then a count. Both dockerd tests run side by side
/// in one process, and runc's default cgroup is named after the id, so a
/// fixed id would collide between them (or with a crashed run's leftover).
fn docker_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{:08x}{n:056x}", std::process::id())
}

/// Waits for an `updated` event of `id` (the agent's lookup in dockerd).
fn updated(agent: &Agent, id: &str) -> Value {
    agent.wait_event(id, "updated", Duration::from_secs(20))
}

fn ready(test: &str, dockerd: &Path) -> bool {
    if !common::ready(test) || !require_program(test, "containerd") || !require_program(test, "tar")
    {
        return false;
    }
    if !dockerd.is_file() {
        skip(
            test,
            &format!(
                "{} is missing: `sudo -E cargo xtask test` installs docker.io and fetches Debian \
                 13's (or set LOOKOUT_DOCKERD26)",
                dockerd.display()
            ),
        );
        return false;
    }
    true
}

/// The whole story on one dockerd: a container found by the start-up scan
/// and one created while the agent runs, both with their name, image and
/// labels; cri-dockerd's pod identity; and, with dockerd gone, containers
/// still reported, with one warning.
fn docker_containers_with_their_identity(test: &str, dockerd: &Path, release: &str) {
    if !ready(test, dockerd) {
        return;
    }
    let runc = Runtime::runc();
    let docker = Dockerd::start(dockerd, &runc);
    let version = docker.version();
    assert!(version.starts_with(release), "{version}");
    eprintln!("dockerd {version}");

    // Before the agent: the start-up scan finds it in dockerd's exec root.
    let before = docker.docker(&[
        "run",
        "-d",
        "--name",
        "pre1",
        "--label",
        "app=pre",
        "localhost/bb:1",
        "sleep",
        "300",
    ]);
    let socket = docker.socket.to_str().expect("utf-8").to_owned();
    let root = docker.state_root().to_str().expect("utf-8").to_owned();
    let agent = Agent::start(&runc, &["--docker-socket", &socket, "--state-root", &root]);
    let added = agent.wait_event(&before, "added", Duration::from_secs(10));
    assert_eq!(added["source"], "state-scan", "{added}");
    let u = updated(&agent, &before);
    assert_eq!(u["source"], "docker", "{u}");
    assert_eq!(u["container"]["name"], "pre1", "{u}");
    assert_eq!(u["container"]["image"], "localhost/bb:1", "{u}");
    assert_eq!(u["container"]["labels"]["app"], "pre", "{u}");
    assert!(
        u["container"]["image_id"]
            .as_str()
            .is_some_and(|i| i.starts_with("sha256:")),
        "{u}"
    );

    // While the agent runs: reported while created, by runc's exec, then
    // its identity; removed with its exit code, and its name.
    let web = docker.docker(&[
        "run",
        "-d",
        "--name",
        "web1",
        "--label",
        "app=shop",
        "localhost/bb:1",
        "sh",
        "-c",
        "trap 'exit 3' TERM; sleep 300 & wait",
    ]);
    let added = agent.wait_event(&web, "added", Duration::from_secs(10));
    assert_eq!(added["source"], "runtime-hook", "{added}");
    assert_eq!(added["container"]["status"], "created", "{added}");
    assert_eq!(added["container"]["runtime_root"], root.as_str(), "{added}");
    let u = updated(&agent, &web);
    let after = |e: &Value| e["monotonic_ns"].as_u64().unwrap_or(0);
    println!(
        "docker {release}: updated {:.1} ms after added",
        after(&u).saturating_sub(after(&added)) as f64 / 1e6
    );
    assert_eq!(u["container"]["name"], "web1", "{u}");
    assert_eq!(u["container"]["image"], "localhost/bb:1", "{u}");
    assert_eq!(u["container"]["labels"]["app"], "shop", "{u}");
    assert_eq!(u["container"]["pid"], added["container"]["pid"], "{u}");
    // The consumer API's table shows it by name.
    let table = Command::new(env!("CARGO_BIN_EXE_lookout"))
        .args(["get", "-o", "wide", "--socket"])
        .arg(agent.socket())
        .output()
        .expect("lookout get");
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.contains(&web[..13]) && l.contains("web1") && l.contains("localhost/bb:1")),
        "{table}"
    );
    // `docker run -d` returns when `runc start` does, which may be before
    // `sh` has run its `trap`; a SIGTERM before it would be dropped (an
    // init without a handler) and the exit would be docker's SIGKILL.
    let pid = added["container"]["pid"].as_u64().expect("pid");
    wait_for_sigterm_handler(pid);
    docker.docker(&["stop", "-t", "10", "web1"]);
    let removed = agent.wait_event(&web, "removed", Duration::from_secs(20));
    assert_eq!(removed["exit_code"], 3, "{removed}");
    assert_eq!(removed["container"]["name"], "web1", "{removed}");

    // cri-dockerd's labels: the pod's identity, as CRI annotations give it
    // under containerd.
    let pod = [
        "--label",
        "io.kubernetes.pod.name=web-0",
        "--label",
        "io.kubernetes.pod.namespace=shop",
        "--label",
        "io.kubernetes.pod.uid=5f1d",
    ];
    let mut args = vec!["run", "-d", "--name", "k8s_POD_web-0_shop_5f1d_0"];
    args.extend(pod);
    args.extend([
        "--label",
        "io.kubernetes.container.name=POD",
        "--label",
        "io.kubernetes.docker.type=podsandbox",
        "localhost/bb:1",
        "sleep",
        "300",
    ]);
    let sandbox = docker.docker(&args);
    let mut args = vec!["run", "-d", "--name", "k8s_nginx_web-0_shop_5f1d_0"];
    args.extend(pod);
    args.extend([
        "--label",
        "io.kubernetes.container.name=nginx",
        "--label",
        "io.kubernetes.docker.type=container",
        "localhost/bb:1",
        "sleep",
        "300",
    ]);
    let nginx = docker.docker(&args);
    let u = updated(&agent, &nginx);
    let k = &u["container"]["kubernetes"];
    assert_eq!(
        (&k["namespace"], &k["pod"], &k["pod_uid"], &k["container"]),
        (
            &Value::from("shop"),
            &Value::from("web-0"),
            &Value::from("5f1d"),
            &Value::from("nginx")
        ),
        "{u}"
    );
    assert_eq!(k["image"], "localhost/bb:1", "{u}");
    assert_eq!(u["container"].get("pod_sandbox"), None, "{u}");
    let u = updated(&agent, &sandbox);
    assert_eq!(u["container"]["pod_sandbox"], true, "{u}");
    assert_eq!(u["container"]["kubernetes"]["pod"], "web-0", "{u}");
    assert!(u["container"]["kubernetes"]["container"].is_null(), "{u}");

    // dockerd gone (killed: its socket file stays, nobody listens): Docker's
    // containers are still reported, without their identity, and one
    // warning says why.
    docker.docker(&["rm", "-f", &before, &sandbox, &nginx]);
    for id in [&before, &sandbox, &nginx] {
        agent.wait_event(id, "removed", Duration::from_secs(20));
    }
    let mut dockerd = docker;
    let _ = dockerd.child.kill();
    let _ = dockerd.child.wait();
    let bundle = tempfile::tempdir().expect("tempdir");
    for _ in 0..2 {
        // A Docker-style id, in dockerd's root, run by the same runc.
        let id = docker_id();
        let b = bundle.path().join(&id);
        lookout_testsupport::bundle::busybox(&b, &["sh", "-c", "exit 4"], |_| {});
        let b = b.to_str().expect("utf-8");
        runc.ok(&["--root", &root, "create", "--bundle", b, &id]);
        let added = agent.wait_event(&id, "added", Duration::from_secs(10));
        runc.ok(&["--root", &root, "start", &id]);
        assert_eq!(added["container"]["runtime_root"], root.as_str(), "{added}");
        let removed = agent.wait_event(&id, "removed", Duration::from_secs(10));
        assert_eq!(removed["exit_code"], 4, "{removed}");
        let _ = runc.run(&["--root", &root, "delete", "--force", &id]);
        assert_eq!(
            agent
                .events_for(&id)
                .iter()
                .filter(|e| e["event"] == "updated")
                .count(),
            0
        );
    }
    // Lookups run on blocking threads, not ordered with the events: wait
    // for the counts (10 s at most).
    let counts = |metrics: &str| {
        (
            metric(metrics, "lookout_docker_lookups_total{outcome=\"found\"}").unwrap_or(0.0),
            metric(
                metrics,
                "lookout_docker_lookups_total{outcome=\"unavailable\"}",
            )
            .unwrap_or(0.0),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut metrics = agent.metrics();
    while !matches!(counts(&metrics), (f, u) if f >= 4.0 && u >= 2.0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        metrics = agent.metrics();
    }
    let (found, unavailable) = counts(&metrics);
    assert!(found >= 4.0, "{metrics}");
    assert!(unavailable >= 2.0, "{metrics}");
    // The log after the agent stopped: every line written (the writer
    // thread is flushed at exit).
    let (status, log) = agent.stop();
    assert!(status.success());
    assert_eq!(
        log.matches("Docker enrichment unavailable").count(),
        1,
        "one warning for the outage:\n{log}"
    );
}

#[test]
fn docker_20_10_containers_have_their_name_image_and_labels() {
    docker_containers_with_their_identity("docker_20_10", Path::new("/usr/sbin/dockerd"), "20.10");
}

#[test]
fn docker_26_1_containers_have_their_name_image_and_labels() {
    docker_containers_with_their_identity("docker_26_1", &lookout_testsupport::dockerd26(), "26.1");
}

/// The probe says whether dockerd answers, with its version.
#[test]
fn the_probe_reports_dockers_socket() {
    const TEST: &str = "docker_probe";
    let dockerd = Path::new("/usr/sbin/dockerd");
    if !ready(TEST, dockerd) {
        return;
    }
    let runc = Runtime::runc();
    let docker = Dockerd::start(dockerd, &runc);
    let check = |socket: &Path| {
        let report = lookout_probe::probe(
            &lookout_probe::ProbeOptions::new()
                .default_runtimes(false)
                .docker_sockets(vec![socket.to_path_buf()]),
        );
        report.check("docker:socket").expect("the check").clone()
    };
    let c = check(&docker.socket);
    assert_eq!(c.status, lookout_probe::Status::Ok, "{c:?}");
    assert!(c.detail.contains("Docker 20.10"), "{c:?}");
    drop(docker);
    let c = check(Path::new("/nonexistent/docker.sock"));
    assert_eq!(c.status, lookout_probe::Status::Unsupported, "{c:?}");
    assert!(c.detail.contains("no /nonexistent/docker.sock"), "{c:?}");
}

/// A socket that an unprivileged user owns (a `--docker-socket` in a
/// directory others may write to) is never asked: its owner could answer
/// with any pod's identity, and the agent would report it, post Events on
/// that pod and decide gates by it.
#[test]
fn a_docker_socket_an_unprivileged_user_owns_is_never_asked() {
    const TEST: &str = "docker_forged_socket";
    if !common::ready(TEST) || !require_program(TEST, "python3") {
        return;
    }
    let Some(user) = lookout_testsupport::unprivileged_user(TEST) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod");
    let socket = open.join("docker.sock");
    let asked = open.join("asked");
    let id = docker_id();
    // The attacker's dockerd: every answer names the container as the
    // victim's pod; each connection is noted.
    const FAKE: &str = r#"
import socket, sys
path, asked, cid = sys.argv[1:4]
body = ('[{"Id":"%s","Names":["/forged"],"Labels":{"io.kubernetes.pod.name":"victim",'
        '"io.kubernetes.pod.namespace":"payments","io.kubernetes.container.name":"app"}}]' % cid)
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(16)
while True:
    c, _ = s.accept()
    open(asked, "a").write("x")
    c.recv(65536)
    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body.encode())
    c.close()
"#;
    let mut cmd = Command::new("python3");
    cmd.args(["-c", FAKE])
        .arg(&socket)
        .arg(&asked)
        .arg(&id)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    user.apply(&mut cmd);
    let _fake = KillOnDrop(cmd.spawn().expect("the attacker's server"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "the attacker's socket never appeared"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let runc = Runtime::runc();
    let agent = Agent::start(&runc, &["--docker-socket", socket.to_str().expect("utf-8")]);
    let root = dir.path().join("exec/runtime-runc/moby");
    let root = root.to_str().expect("utf-8");
    let b = dir.path().join("bundle");
    lookout_testsupport::bundle::busybox(&b, &["sh", "-c", "exit 0"], |_| {});
    runc.ok(&[
        "--root",
        root,
        "create",
        "--bundle",
        b.to_str().expect("utf-8"),
        &id,
    ]);
    agent.wait_event(&id, "added", Duration::from_secs(10));
    runc.ok(&["--root", root, "start", &id]);
    agent.wait_event(&id, "removed", Duration::from_secs(10));
    let _ = runc.run(&["--root", root, "delete", "--force", &id]);
    // The lookup's outcome is counted once it is over: then nothing more
    // can come.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !agent
        .metrics()
        .lines()
        .any(|l| l.starts_with("lookout_docker_lookups_total{"))
    {
        assert!(
            Instant::now() < deadline,
            "the lookup never ended:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let events = agent.events_for(&id);
    assert!(
        events.iter().all(|e| e["event"] != "updated"
            && e["container"]["kubernetes"].is_null()
            && e["container"].get("name").is_none()),
        "{events:?}"
    );
    assert!(
        !asked.exists(),
        "the agent connected to the attacker's socket"
    );
    let log = agent.log();
    assert!(log.contains(&format!("owned by uid {}", user.uid)), "{log}");
}

/// Waits (10 s at most) until process `pid` catches SIGTERM (its
/// `SigCgt` mask in /proc has bit 14).
fn wait_for_sigterm_handler(pid: u64) {
    let catches = || {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                let mask = s.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
                u64::from_str_radix(mask.trim(), 16).ok()
            })
            .is_some_and(|m| m & (1 << (libc::SIGTERM - 1)) != 0)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !catches() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(catches(), "process {pid} never trapped SIGTERM");
}
