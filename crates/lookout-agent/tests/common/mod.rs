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

/// A running `lookout run`, its events collected by a reader thread.
pub struct Agent {
    pub child: Child,
    pub events: Arc<Mutex<Vec<Value>>>,
    pub stderr: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    pub fn start(extra: &[&str]) -> Agent {
        Agent::start_with(extra, &[], None)
    }

    /// With environment variables `env` and, optionally, a seccomp filter
    /// or capability drop.
    pub fn start_with(
        extra: &[&str],
        env: &[(&str, &str)],
        restrict: Option<lookout_testsupport::Restrictions>,
    ) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        let stderr = dir.path().join("stderr");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lookout"));
        cmd.args(["run", "--output", "json", "--listen", "127.0.0.1:0"])
            .args(extra)
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
        let events = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().expect("stdout");
        let sink = Arc::clone(&events);
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("bad JSON line {line:?}: {e}"));
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(v);
            }
        });
        let agent = Agent {
            child,
            events,
            stderr,
            _dir: dir,
        };
        agent.wait_log("lookout::run: ready", Duration::from_secs(20));
        agent
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn wait_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "agent never logged {needle:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
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
    pub fn wait_event(&self, id: &str, event: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self
                .events_for(id)
                .into_iter()
                .find(|e| e["event"] == event)
            {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "no {event} event for {id} within {timeout:?}; events: {:?}\nlog:\n{}",
                self.events_for(id),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
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

pub fn ready(test: &str) -> bool {
    require_root(test) && require_program(test, "runc") && require_program(test, "busybox")
}

pub fn id(test: &str) -> String {
    format!("lk-{test}-{}", std::process::id())
}

/// Runs runc with stdout to /dev/null and stderr to a file. N.B. a pipe
/// would be inherited by the container process and never reach EOF.
pub fn runc(args: &[&str]) -> std::process::Output {
    let err = tempfile::NamedTempFile::new().expect("stderr file");
    let status = Command::new("runc")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err.reopen().expect("reopen"))
        .status()
        .expect("run runc");
    std::process::Output {
        status,
        stdout: Vec::new(),
        stderr: std::fs::read(err.path()).unwrap_or_default(),
    }
}

pub fn runc_ok(args: &[&str]) {
    let out = runc(args);
    assert!(
        out.status.success(),
        "runc {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn cleanup(id: &str) {
    let _ = runc(&["delete", "--force", id]);
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
