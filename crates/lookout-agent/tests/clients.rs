//! The consumer API with clients that no one here wrote, each with its
//! default options: Python's grpcio (grpc C-core, which sends the socket's
//! path, percent-encoded, as `:authority`) through the repository's own
//! example `clients/python/lookout_consumer.py`, and a raw-path
//! `:authority` as grpc-java sends it. The Python packages come from PyPI,
//! in a venv that `cargo xtask test` creates (`LOOKOUT_PYTHON` overrides).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use lookout_testsupport::{bundle, skip};
use serde_json::Value;

mod common;
use common::*;

/// The venv's python, with grpcio, grpcio-tools, grpcio-health-checking,
/// grpcio-reflection and h2; `None` (loudly skipped, a failure in CI)
/// when absent.
fn python(test: &str) -> Option<PathBuf> {
    let p = std::env::var_os("LOOKOUT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| lookout_testsupport::cache_dir().join("python-clients/bin/python3"));
    if p.is_file() {
        Some(p)
    } else {
        skip(
            test,
            &format!(
                "{} is missing: `sudo -E cargo xtask test` creates the venv of Python gRPC clients",
                p.display()
            ),
        );
        None
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `lookout_consumer.py --socket SOCKET ARGS`.
fn consumer(python: &Path, socket: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg(repo().join("clients/python/lookout_consumer.py"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// Runs a consumer command to its end and returns its JSON lines.
fn lines_of(mut cmd: Command) -> Vec<Value> {
    let out = cmd.output().expect("run lookout_consumer.py");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// A running consumer whose JSON lines arrive on a channel.
struct Running {
    child: KillOnDrop,
    lines: mpsc::Receiver<Value>,
}

impl Running {
    fn start(mut cmd: Command) -> Running {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the consumer");
        let stdout: ChildStdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        Running {
            child: KillOnDrop(child),
            lines,
        }
    }

    /// Waits for a line that `want` accepts.
    fn wait(&self, what: &str, want: impl Fn(&Value) -> bool) -> Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(v) if want(&v) => return v,
                Ok(_) => {}
                Err(_) => panic!("no {what} from the consumer within 30 s"),
            }
        }
    }

    /// Waits for the process to end successfully; returns the lines not
    /// waited for.
    fn finish(mut self) -> Vec<Value> {
        let child: &mut Child = &mut self.child.0;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                assert!(status.success(), "the consumer failed ({status}): {err}");
                // The reader ends at the pipe's end.
                return self.lines.iter().collect();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the consumer did not end within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn python_grpcio_with_default_options_lists_watches_gates_checks_health_and_reflects() {
    if !ready("python_grpcio") {
        return;
    }
    let Some(py) = python("python_grpcio") else {
        return;
    };
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let agent = Agent::start(&rt, &[]);
    let socket = agent.socket();

    // Health: SERVING once the agent is ready, both names (applied by the
    // API's thread as the agent logs `ready`: checked until it is).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let health = lines_of(consumer(&py, socket, &["health"]));
        let serving = |s: &str| {
            health
                .iter()
                .any(|l| l["service"] == s && l["status"] == "SERVING")
        };
        if serving("") && serving("lookout.v1.Lookout") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not SERVING 10 s after ready: {health:?}"
        );
    }

    // Reflection (v1alpha, what grpcio-reflection speaks): the services,
    // and a method resolved through it alone.
    let refl = lines_of(consumer(&py, socket, &["services"]));
    let services = refl[0]["services"].as_array().expect("services").clone();
    for s in [
        "lookout.v1.Lookout",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(services.iter().any(|v| v == s), "{s} not in {services:?}");
    }
    assert_eq!(
        refl[1]["methods"],
        serde_json::json!(["List", "Watch", "Gate"])
    );
    // The same listing through reflection v1.
    let out = Command::new(&py)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/reflection_v1.py"))
        .arg(socket)
        .output()
        .expect("run reflection_v1.py");
    let v1 = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{v1}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for s in [
        "lookout.v1.Lookout",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(
            v1.lines().any(|l| l == s),
            "{s} not listed by reflection v1: {v1}"
        );
    }

    // List: a created container is there.
    let b = d.join("b");
    bundle::busybox(&b, &["touch", "/ran"], |_| {});
    let listed = id("py-list");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &listed]);
    agent.wait_event(&listed, "added", Duration::from_secs(10));
    let list = lines_of(consumer(&py, socket, &["list"]));
    assert!(
        list.iter().any(|l| l["container"]["id"] == listed.as_str()),
        "{listed} not listed: {list:?}"
    );
    rt.cleanup(&listed);

    // Watch: a container created after the snapshot arrives.
    let watched = id("py-watch");
    let watch = Running::start(consumer(&py, socket, &["watch", "--until", &watched]));
    watch.wait("SNAPSHOT_END", |l| l["event"] == "SNAPSHOT_END");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &watched]);
    let added = watch.wait("ADDED", |l| {
        l["event"] == "ADDED" && l["container"]["id"] == watched.as_str()
    });
    assert!(
        added["container"]["pid"].as_u64().unwrap_or(0) > 1,
        "{added}"
    );
    watch.finish();
    rt.cleanup(&watched);

    // Gate: one allowed start, one denied that never runs.
    let (allowed, denied) = (id("py-allow"), id("py-deny"));
    let ba = d.join("allowed");
    let bd = d.join("denied");
    bundle::busybox(&ba, &["touch", "/ran"], |_| {});
    bundle::busybox(&bd, &["touch", "/ran"], |_| {});
    let gate = Running::start(consumer(
        &py,
        socket,
        &[
            "gate",
            "--runtime",
            "runc",
            "--deny",
            &denied,
            "--holds",
            "2",
            "--deadline-ms",
            "10000",
        ],
    ));
    gate.wait("subscribed", |l| l.get("subscribed").is_some());
    for (id, b) in [(&allowed, &ba), (&denied, &bd)] {
        rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), id]);
    }
    let allowed_ran = start_container(&rt.path, &allowed);
    let denied_ran = start_container(&rt.path, &denied);
    let holds = gate.finish();
    assert!(allowed_ran, "the allowed start is refused: {holds:?}");
    assert!(!denied_ran, "the denied start ran: {holds:?}");
    agent.wait_event(&allowed, "removed", Duration::from_secs(10));
    let removed = agent.wait_event(&denied, "removed", Duration::from_secs(10));
    assert_eq!(
        removed["reason"], "denied by gate python-example: denied by lookout_consumer.py",
        "{removed}"
    );
    assert!(ba.join("rootfs/ran").exists(), "the allowed container ran");
    assert!(
        !bd.join("rootfs/ran").exists(),
        "the denied container ran its first instruction"
    );
    rt.cleanup(&allowed);
    rt.cleanup(&denied);
}

/// A surge rollout under the Python gate: the old agent ends the gate at
/// its SIGTERM, the client subscribes again under the same name, and the
/// new agent, which held the gate's starts for it, asks it about the next
/// container.
#[test]
fn the_python_gate_subscribes_again_to_the_agent_that_takes_over() {
    if !ready("py_gate_rollout") {
        return;
    }
    let Some(py) = python("py_gate_rollout") else {
        return;
    };
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("api/lookout.sock");
    let s = socket.to_str().expect("utf-8");
    let old = Agent::start(&rt, &["--socket", s]);
    let gate = Running::start(consumer(
        &py,
        &socket,
        &["gate", "--runtime", "runc", "--deadline-ms", "10000"],
    ));
    gate.wait("subscribed", |l| l.get("subscribed").is_some());
    let new = Agent::start(&rt, &["--socket", s]);
    new.wait_log("standing by", Duration::from_secs(5));
    let (status, log) = old.stop();
    assert!(status.success(), "{log}");
    gate.wait("resubscribe", |l| l.get("resubscribe").is_some());
    new.wait_log(
        "gate subscriber back after the takeover",
        Duration::from_secs(10),
    );
    let id = id("py-rollout");
    let b = dir.path().join("b");
    bundle::busybox(&b, &["true"], |_| {});
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    let started = start_container(&rt.path, &id);
    // The resubscribed client was asked (other tests' containers found by
    // the new agent's scan may come first, as holds not held).
    gate.wait("the hold", |l| {
        l["hold"] == id.as_str() && l["held"] == true
    });
    rt.cleanup(&id);
    assert!(started, "the new agent's gate allowed it:\n{}", new.log());
}

#[test]
fn a_raw_path_authority_as_grpc_java_sends_it_is_served() {
    if !ready("raw_authority") {
        return;
    }
    let Some(py) = python("raw_authority") else {
        return;
    };
    let rt = Runtime::runc();
    let agent = Agent::start(&rt, &[]);
    let out = Command::new(&py)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/raw_authority.py"))
        .arg(agent.socket())
        .output()
        .expect("run raw_authority.py");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.trim() == "reset=None grpc-status=0 health=1",
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `clients/go`'s example, built with Debian's Go and grpc-go (no module
/// proxy here: GOPATH mode over `/usr/share/gocode`), into `dir`.
fn build_go_consumer(dir: &Path) -> PathBuf {
    let clients = repo().join("clients");
    let gopath = dir.join("gopath");
    let parent = gopath.join("src/github.com/lookout-dev/lookout");
    std::fs::create_dir_all(&parent).expect("mkdir");
    std::os::unix::fs::symlink(&clients, parent.join("clients")).expect("symlink");
    let bin = dir.join("lookout-consumer");
    let out = Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg("./cmd/lookout-consumer")
        .current_dir(parent.join("clients/go"))
        .env("GO111MODULE", "off")
        .env("GOPATH", format!("{}:/usr/share/gocode", gopath.display()))
        .env("GOFLAGS", "")
        .output()
        .expect("run go build");
    assert!(
        out.status.success(),
        "go build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

#[test]
fn go_grpc_lists_and_watches() {
    if !ready("go_grpc") {
        return;
    }
    for program in ["go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"] {
        if !lookout_testsupport::require_program("go_grpc", program) {
            return;
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let go = build_go_consumer(d);
    let rt = Runtime::runc();
    let agent = Agent::start(&rt, &[]);
    let socket = agent.socket().to_str().expect("utf-8").to_owned();
    let run = |args: &[&str]| go_command(&go, &socket, args);

    let b = d.join("b");
    bundle::busybox(&b, &["true"], |_| {});
    let listed = id("go-list");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &listed]);
    agent.wait_event(&listed, "added", Duration::from_secs(10));
    let list = lines_of(run(&["list"]));
    assert!(
        list.iter().any(|l| l["container"]["id"] == listed.as_str()),
        "{listed} not listed: {list:?}"
    );
    rt.cleanup(&listed);

    let watched = id("go-watch");
    let watch = Running::start(run(&["watch", "-until", &watched]));
    watch.wait("SNAPSHOT_END", |l| l["event"] == "SNAPSHOT_END");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &watched]);
    watch.wait("ADDED", |l| {
        l["event"] == "ADDED" && l["container"]["id"] == watched.as_str()
    });
    watch.finish();
    rt.cleanup(&watched);
}

/// The Go code in `clients/go/lookoutv1` is what the proto generates now
/// (Debian 12's protoc 3.21, protoc-gen-go 1.28, protoc-gen-go-grpc 1.0).
#[test]
fn the_generated_go_code_is_current() {
    for program in ["protoc", "protoc-gen-go", "protoc-gen-go-grpc"] {
        if !lookout_testsupport::require_program("generated_go", program) {
            return;
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let module = "module=github.com/lookout-dev/lookout/clients/go";
    let out = Command::new("protoc")
        .arg("-I")
        .arg(repo().join("crates/lookout-api/proto"))
        .arg(format!("--go_out={}", dir.path().display()))
        .arg(format!("--go_opt={module}"))
        .arg(format!("--go-grpc_out={}", dir.path().display()))
        .arg(format!("--go-grpc_opt={module}"))
        .arg("lookout/v1/lookout.proto")
        .output()
        .expect("run protoc");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for file in ["lookout.pb.go", "lookout_grpc.pb.go"] {
        let fresh = std::fs::read(dir.path().join("lookoutv1").join(file)).expect("generated");
        let kept = std::fs::read(repo().join("clients/go/lookoutv1").join(file)).expect("kept");
        assert!(
            fresh == kept,
            "clients/go/lookoutv1/{file} is stale: regenerate it (clients/go/README.md)"
        );
    }
}

/// The inode of the cgroup v2 directory `pid` is in (what
/// `bpf_get_current_cgroup_id()` returns in it): `/sys/fs/cgroup`, or
/// `/sys/fs/cgroup/unified` on a hybrid node; `None` on a cgroup v1 node.
fn cgroup_inode(pid: u64) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let root = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .map(Path::new)
        .find(|r| r.join("cgroup.controllers").exists())?;
    let dir = root.join(path.trim_start_matches('/'));
    Some(std::fs::metadata(dir).ok()?.ino())
}

/// The `cgroup_id` of `id` in a consumer's JSON lines (`{"container": ...}`
/// or an event's), which must be there.
fn cgroup_id_in(lines: &[Value], id: &str) -> u64 {
    let line = lines
        .iter()
        .find(|l| l["container"]["id"] == id)
        .unwrap_or_else(|| panic!("{id} not in {lines:?}"));
    line["container"]["cgroup_id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cgroup_id: {line}"))
}

/// A runc container's cgroup id (the inode of its cgroup v2 directory)
/// reaches the Python and the Go consumer alike, by List and by Watch, and
/// a filter by it selects that container and one by another id does not.
#[test]
fn the_cgroup_id_reaches_python_and_go_and_selects_its_container() {
    if !ready("cgroup_id_consumers") {
        return;
    }
    let Some(py) = python("cgroup_id_consumers") else {
        return;
    };
    for program in ["go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"] {
        if !lookout_testsupport::require_program("cgroup_id_consumers", program) {
            return;
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let go = build_go_consumer(d);
    let rt = Runtime::runc();
    let agent = Agent::start(&rt, &[]);
    let socket = agent.socket();
    let s = socket.to_str().expect("utf-8").to_owned();
    let go_run = |args: &[&str]| go_command(&go, &s, args);
    let b = d.join("b");
    bundle::busybox(&b, &["true"], |_| {});

    // The agent's own event says the cgroup id; it is the directory's inode.
    let listed = id("cg-list");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &listed]);
    let added = agent.wait_event(&listed, "added", Duration::from_secs(10));
    let cgroup_id = added["container"]["cgroup_id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cgroup_id in the agent's event: {added}"));
    assert_ne!(cgroup_id, 0, "{added}");
    let pid = added["container"]["pid"].as_u64().expect("pid");
    if let Some(inode) = cgroup_inode(pid) {
        assert_eq!(cgroup_id, inode, "the inode of its cgroup v2 directory");
    }
    let want = cgroup_id.to_string();
    let other = (cgroup_id ^ 1).to_string();

    // Python: listed with it; selected by it; not by another.
    let all = lines_of(consumer(&py, socket, &["list"]));
    assert_eq!(cgroup_id_in(&all, &listed), cgroup_id);
    let by_id = lines_of(consumer(&py, socket, &["list", "--cgroup-id", &want]));
    assert_eq!(by_id[0]["count"], 1, "{by_id:?}");
    assert_eq!(cgroup_id_in(&by_id, &listed), cgroup_id);
    let by_other = lines_of(consumer(&py, socket, &["list", "--cgroup-id", &other]));
    assert!(
        by_other
            .iter()
            .all(|l| l["container"]["id"] != listed.as_str()),
        "a filter by {other} selected {listed} ({cgroup_id}): {by_other:?}"
    );
    // Go: the same.
    let by_id = lines_of(go_run(&["list", "-cgroup-id", &want]));
    assert_eq!(by_id[0]["count"], 1, "{by_id:?}");
    assert_eq!(cgroup_id_in(&by_id, &listed), cgroup_id);
    let by_other = lines_of(go_run(&["list", "-cgroup-id", &other]));
    assert!(
        by_other
            .iter()
            .all(|l| l["container"]["id"] != listed.as_str()),
        "a filter by {other} selected {listed} ({cgroup_id}): {by_other:?}"
    );
    rt.cleanup(&listed);

    // Watch: a container's ADDED says the cgroup id its List then says,
    // to both consumers.
    let watched = id("cg-watch");
    let py_watch = Running::start(consumer(&py, socket, &["watch", "--until", &watched]));
    let go_watch = Running::start(go_run(&["watch", "-until", &watched]));
    for w in [&py_watch, &go_watch] {
        w.wait("SNAPSHOT_END", |l| l["event"] == "SNAPSHOT_END");
    }
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &watched]);
    let mut seen = Vec::new();
    for w in [&py_watch, &go_watch] {
        let added = w.wait("ADDED", |l| {
            l["event"] == "ADDED" && l["container"]["id"] == watched.as_str()
        });
        seen.push(cgroup_id_in(std::slice::from_ref(&added), &watched));
    }
    py_watch.finish();
    go_watch.finish();
    let agents = agent.wait_event(&watched, "added", Duration::from_secs(10));
    let watched_id = agents["container"]["cgroup_id"].as_u64().unwrap_or(0);
    assert_ne!(watched_id, 0, "{agents}");
    assert_eq!(seen, [watched_id, watched_id], "Python's and Go's ADDED");
    if let Some(inode) = agents["container"]["pid"].as_u64().and_then(cgroup_inode) {
        assert_eq!(watched_id, inode, "the inode of its cgroup v2 directory");
    }
    let listed = lines_of(consumer(&py, socket, &["list"]));
    assert_eq!(
        cgroup_id_in(&listed, &watched),
        watched_id,
        "List after Watch"
    );
    let listed = lines_of(go_run(&["list"]));
    assert_eq!(
        cgroup_id_in(&listed, &watched),
        watched_id,
        "List after Watch"
    );
    rt.cleanup(&watched);
}

/// The Go consumer `go`, on the agent's `socket`, with `args`.
fn go_command(go: &Path, socket: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(go);
    cmd.args(["-socket", socket])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}
