//! What the agent's end-to-end tests share: a running `lookout run` with
//! its events collected, and runc helpers.
#![allow(dead_code)]

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lookout_testsupport::{require_program, require_root};
use serde_json::Value;

/// What an agent prints: its NDJSON events (collected by a reader thread)
/// and its log (a file). [`Agent`] and the image test's pod both have one.
pub struct Output {
    pub events: Arc<Mutex<Vec<Value>>>,
    pub stderr: PathBuf,
}

impl Output {
    /// Collects the events printed on `stdout`; the log is in `stderr`.
    pub fn collect(stdout: std::process::ChildStdout, stderr: PathBuf) -> Output {
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("bad JSON line {line:?}: {e}"));
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(v);
            }
        });
        Output { events, stderr }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    #[track_caller]
    pub fn wait_log(&self, needle: &str, timeout: Duration) {
        lookout_testsupport::wait_until(
            timeout,
            || self.log().contains(needle),
            || format!("agent never logged {needle:?}:\n{}", self.log()),
        );
    }

    /// Waits for a log line that contains every one of `needles`.
    #[track_caller]
    pub fn wait_log_line(&self, needles: &[&str], timeout: Duration) {
        lookout_testsupport::wait_until(
            timeout,
            || {
                self.log()
                    .lines()
                    .any(|l| needles.iter().all(|n| l.contains(n)))
            },
            || {
                format!(
                    "agent never logged a line with {needles:?}:\n{}",
                    self.log()
                )
            },
        );
    }

    /// Events about container `id`.
    pub fn events_for(&self, id: &str) -> Vec<Value> {
        let all = self.events.lock().unwrap_or_else(|e| e.into_inner());
        all.iter()
            .filter(|e| e["container"]["id"] == id)
            .cloned()
            .collect()
    }

    /// Waits for an `event` ("added"/"removed") about `id`.
    #[track_caller]
    pub fn wait_event(&self, id: &str, event: &str, timeout: Duration) -> Value {
        let find = || {
            self.events_for(id)
                .into_iter()
                .find(|e| e["event"] == event)
        };
        lookout_testsupport::wait_until(
            timeout,
            || find().is_some(),
            || {
                format!(
                    "no {event} event for {id}; events: {:?}\nlog:\n{}",
                    self.events_for(id),
                    self.log()
                )
            },
        );
        find().expect("found just now")
    }
}

/// A running `lookout run`, its events collected by a reader thread.
pub struct Agent {
    pub child: Child,
    out: Output,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for Agent {
    type Target = Output;
    fn deref(&self) -> &Output {
        &self.out
    }
}

impl Agent {
    /// An agent that watches only `rt` (see [`Runtime`]).
    pub fn start(rt: &Runtime, extra: &[&str]) -> Agent {
        Agent::start_with(Some(rt), extra, &[], None)
    }

    /// With environment variables `env` and, optionally, a seccomp filter
    /// or capability drop. `rt`: the one runtime binary the agent watches;
    /// `None` for agents that watch none (scan and informer modes).
    pub fn start_with(
        rt: Option<&Runtime>,
        extra: &[&str],
        env: &[(&str, &str)],
        restrict: Option<lookout_testsupport::Restrictions>,
    ) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        let stderr = dir.path().join("stderr");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lookout"));
        // Each agent its own consumer socket: parallel tests must not share
        // the node's default one.
        let socket = dir.path().join("api/lookout.sock");
        cmd.args(["run", "--output", "json", "--listen", "127.0.0.1:0"])
            .args(Runtime::agent_args(rt));
        if !extra
            .iter()
            .any(|a| a.starts_with("--socket") || *a == "--no-socket")
        {
            cmd.arg("--socket").arg(&socket);
        }
        // Nor the node's pinned maps: a test that wants them gives its
        // own --bpf-pin-dir on a private BPF file system (identity.rs).
        if !extra.iter().any(|a| a.starts_with("--bpf-pin-dir")) {
            cmd.arg("--no-pinned-maps");
        }
        cmd.args(extra)
            .env("LOOKOUT_LOG", "info,lookout_runtime_hook=debug")
            .env_remove("NODE_NAME")
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"));
        if let Some(r) = restrict {
            r.apply(&mut cmd).expect("restrict the agent");
        }
        let mut child = cmd.spawn().expect("spawn lookout run");
        let out = Output::collect(child.stdout.take().expect("stdout"), stderr);
        let agent = Agent {
            child,
            out,
            socket,
            _dir: dir,
        };
        agent.wait_log("lookout_agent::run: ready", Duration::from_secs(20));
        agent
    }

    /// The agent's consumer socket (unless the test chose another).
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// Where the agent serves /healthz, /readyz and /metrics.
    pub fn addr(&self) -> String {
        self.log()
            .split("on http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .expect("the agent logs where it serves")
            .to_owned()
    }

    /// The agent's /metrics page.
    pub fn metrics(&self) -> String {
        let (status, body) = http_get(&self.addr(), "/metrics");
        assert_eq!(status, 200, "{body}");
        body
    }

    /// SIGTERM, then the exit status and the log.
    pub fn stop(mut self) -> (std::process::ExitStatus, String) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return (status, self.log());
            }
            assert!(
                Instant::now() < deadline,
                "agent did not exit on SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 GET against the agent: (status, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    try_http_get(addr, path).expect("GET from the agent")
}

/// [`http_get`] that returns the I/O error (a connection the agent refused
/// at accept is reset).
pub fn try_http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// The value of the sample `name` (with its labels) in a metrics page.
pub fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Kills and reaps a child when dropped, also when the test panics, so
/// that a failed test leaves no agent or attacker process behind.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn ready(test: &str) -> bool {
    require_root(test) && require_program(test, "runc") && require_program(test, "busybox")
}

pub fn id(test: &str) -> String {
    format!("lk-{test}-{}", std::process::id())
}

/// A private copy of a runtime binary (runc, crun) in a directory of the
/// test's own.
///
/// fanotify marks are per inode, and a runtime exec waits for the answer of
/// every group that marked it: if every test's agent marked the system's
/// runc, each test's runtime execs would wait on every other test's agent,
/// and a slow agent in one test would slow (or, stopped, freeze) all the
/// others. Each test therefore runs its containers through its own copy,
/// and its agent watches only that copy (`--no-default-runtimes
/// --runtime-path COPY`). No test in this suite execs the system's runtime
/// while an agent watches it.
pub struct Runtime {
    /// The copy, named like the original (the agent tells runtimes apart
    /// by file name).
    pub path: PathBuf,
    /// The ids of the containers `create`d or `run` through
    /// [`Runtime::run`]: deleted on drop, so that a test that fails midway
    /// leaves no container running.
    made: Mutex<Vec<String>>,
    _dir: tempfile::TempDir,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let made = std::mem::take(self.made.get_mut().unwrap_or_else(|e| e.into_inner()));
        let Some(name) = self.path.file_name() else {
            return;
        };
        // Only those still in the default root: a test deletes its own.
        let root = Path::new("/run").join(name);
        for id in made {
            // Nothing here may panic: this can run while a test unwinds.
            if root.join(&id).exists() {
                let _ = self
                    .command()
                    .args(["delete", "--force", &id])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

impl Runtime {
    /// A private copy of runc.
    pub fn runc() -> Runtime {
        Runtime::copy("runc")
    }

    /// A private copy of `name`, found in PATH.
    pub fn copy(name: &str) -> Runtime {
        let original = lookout_testsupport::find_program(name)
            .unwrap_or_else(|| panic!("{name} is not installed"));
        Runtime::copy_of(&original)
    }

    /// A private copy of the runtime binary `original`, with its name.
    pub fn copy_of(original: &Path) -> Runtime {
        let dir = tempfile::tempdir().expect("tempdir");
        let name = original.file_name().expect("a file name");
        let path = dir.path().join(name);
        lookout_testsupport::install_executable(original, &path)
            .unwrap_or_else(|e| panic!("copy {} to {}: {e}", original.display(), path.display()));
        Runtime {
            path,
            made: Mutex::new(Vec::new()),
            _dir: dir,
        }
    }

    /// The agent's arguments to watch only `rt` (nothing for `None`).
    pub fn agent_args(rt: Option<&Runtime>) -> Vec<String> {
        match rt {
            Some(rt) => vec![
                "--no-default-runtimes".into(),
                "--runtime-path".into(),
                rt.path.to_str().expect("utf-8 path").into(),
            ],
            None => vec!["--no-default-runtimes".into()],
        }
    }

    /// A command for the copy.
    pub fn command(&self) -> Command {
        Command::new(&self.path)
    }

    /// Runs the copy with stdout to /dev/null and stderr to a file. N.B. a
    /// pipe would be inherited by the container process and never reach
    /// EOF.
    pub fn run(&self, args: &[&str]) -> std::process::Output {
        if let (Some(&"create" | &"run"), Some(id)) = (args.first(), args.last()) {
            self.made
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((*id).to_owned());
        }
        let err = tempfile::NamedTempFile::new().expect("stderr file");
        let status = self
            .command()
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err.reopen().expect("reopen"))
            .status()
            .expect("run the runtime");
        std::process::Output {
            status,
            stdout: Vec::new(),
            stderr: std::fs::read(err.path()).unwrap_or_default(),
        }
    }

    /// Runs the copy and fails the test if it fails.
    pub fn ok(&self, args: &[&str]) {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "{} {args:?} failed: {}",
            self.path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `delete --force ID`, ignoring errors.
    pub fn cleanup(&self, id: &str) {
        let _ = self.run(&["delete", "--force", id]);
    }
}

pub fn read_stamp(path: &Path) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && let Ok(v) = s.trim().parse()
        {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "the container never wrote {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A private containerd (CRI plugin off, its own root, state and socket).
pub struct Containerd {
    child: std::process::Child,
    /// Its gRPC socket (`ctr --address`).
    pub socket: PathBuf,
}

impl Containerd {
    pub fn start(dir: &Path) -> Containerd {
        let socket = dir.join("containerd.sock");
        let config = dir.join("config.toml");
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{sock}\"\n[ttrpc]\n  address = \"{sock}.ttrpc\"\n",
                root = dir.join("root").display(),
                state = dir.join("state").display(),
                sock = socket.display()
            ),
        )
        .expect("write config");
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("containerd.log")).expect("log"))
            .spawn()
            .expect("start containerd");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "containerd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Containerd { child, socket }
    }

    pub fn ctr(&self, args: &[&str]) -> std::process::ExitStatus {
        Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run ctr")
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until every thread of `pid` is stopped (`T` in its stat).
pub fn wait_all_threads_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let states: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("the agent's tasks")
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
            .filter_map(|stat| {
                // The state follows the parenthesised command name.
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned))
            })
            .collect();
        if !states.is_empty() && states.iter().all(|s| s == "T") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the agent's threads did not all stop: {states:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `runc start ID`: whether it ran and succeeded. A start denied by a gate
/// never runs: the exec of the runtime binary itself fails with EPERM.
pub fn start_container(path: &Path, id: &str) -> bool {
    match std::process::Command::new(path)
        .args(["start", id])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
    {
        Ok(s) => s.success(),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => false,
        Err(e) => panic!("runc start: {e}"),
    }
}
