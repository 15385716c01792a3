//! gVisor's runsc, from Debian's package (`--platform=ptrace`, no
//! network), as the runtime hook and the scan see it. Each test runs its
//! containers through its own copy of runsc, as the runc tests do (see
//! `common::Runtime`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use lookout_testsupport::{bundle, require_program};
use serde_json::Value;

mod common;
use common::*;

fn ready_runsc(test: &str) -> bool {
    ready(test) && require_program(test, "runsc")
}

/// A private copy of runsc with its flags: ptrace platform, no network,
/// and a state root.
struct Runsc {
    rt: Runtime,
    root: PathBuf,
}

impl Runsc {
    /// Debian 12's (the system's) runsc.
    fn new(root: &Path) -> Runsc {
        Runsc::of(
            &lookout_testsupport::find_program("runsc").expect("runsc"),
            root,
        )
    }

    fn of(binary: &Path, root: &Path) -> Runsc {
        Runsc {
            rt: Runtime::copy_of(binary),
            root: root.to_path_buf(),
        }
    }

    fn args<'a>(&'a self, cmd: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec![
            "--platform=ptrace",
            "--network=none",
            // No cgroup of its own per sandbox: runsc picks cgroup v1 or v2
            // by a `statfs` of /sys/fs/cgroup it takes as v1 when it fails,
            // and once in a CI run Debian 13's runsc made a v1 path on this
            // v2-only machine ("open /sys/fs/cgroup/cpuset/ID/cgroup.procs:
            // no such file or directory"). These tests are about what the
            // hook and the scan see, which no cgroup changes.
            "--ignore-cgroups",
            "--root",
            self.root.to_str().expect("utf-8"),
        ];
        v.extend_from_slice(cmd);
        v
    }

    fn ok(&self, cmd: &[&str]) {
        self.rt.ok(&self.args(cmd));
    }

    fn cleanup(&self, id: &str) {
        let _ = self.rt.run(&self.args(&["delete", "--force", id]));
    }

    /// The sandbox's host pid, from runsc's own state file.
    fn sandbox_pid(&self, id: &str) -> u64 {
        let state = self.root.join(format!("{id}_sandbox:{id}.state"));
        let v: Value =
            serde_json::from_slice(&std::fs::read(&state).expect("runsc state")).expect("json");
        v["sandbox"]["pid"].as_u64().expect("sandbox.pid")
    }
}

fn events_of(agent: &Agent, id: &str, kind: &str) -> usize {
    agent
        .events_for(id)
        .iter()
        .filter(|e| e["event"] == kind)
        .count()
}

#[test]
fn runsc_containers_are_reported_with_their_sandbox() {
    if !ready_runsc("runsc_containers") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    containers_are_reported(Runsc::new(&dir.path().join("root")), dir.path());
}

#[test]
fn runsc_of_debian_13_containers_are_reported_with_their_sandbox() {
    if !ready("runsc_next") {
        return;
    }
    let binary = lookout_testsupport::runsc_next();
    if !binary.is_file() {
        lookout_testsupport::skip(
            "runsc_next",
            &format!(
                "{} is missing (`sudo -E cargo xtask test` fetches it)",
                binary.display()
            ),
        );
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    containers_are_reported(Runsc::of(&binary, &dir.path().join("root")), dir.path());
}

/// create + start, `run -detach` and a container that exits at once, each
/// reported once with its sandbox, and removed.
fn containers_are_reported(runsc: Runsc, d: &Path) {
    let agent = Agent::start(&runsc.rt, &[]);
    let sleeper = bundle::busybox(&d.join("sleep"), &["sleep", "1"], |_| {});
    let quick = bundle::busybox(&d.join("true"), &["true"], |_| {});

    // create + start, as containerd's runsc shim drives it.
    let a = id("runsc-create");
    runsc.ok(&["create", "--bundle", sleeper.to_str().expect("utf-8"), &a]);
    let sandbox = runsc.sandbox_pid(&a);
    runsc.ok(&["start", &a]);
    let added = agent.wait_event(&a, "added", Duration::from_secs(10));
    let c = &added["container"];
    assert_eq!(c["runtime"], "runsc", "{added}");
    assert_eq!(c["sandbox"], "gvisor", "{added}");
    assert_eq!(c["status"], "created", "reported before its start: {added}");
    assert_eq!(c["pid"], sandbox, "the sandbox's host pid: {added}");
    assert_eq!(c["bundle"], sleeper.to_str().expect("utf-8"), "{added}");
    assert_eq!(added["source"], "runtime-hook");
    agent.wait_event(&a, "removed", Duration::from_secs(15));

    // run -detach: created and started in one step.
    let b = id("runsc-run");
    runsc.ok(&[
        "run",
        "-detach",
        "--bundle",
        sleeper.to_str().expect("utf-8"),
        &b,
    ]);
    let added = agent.wait_event(&b, "added", Duration::from_secs(10));
    assert_eq!(added["container"]["sandbox"], "gvisor", "{added}");
    agent.wait_event(&b, "removed", Duration::from_secs(15));

    // A container that exits at once.
    let q = id("runsc-true");
    runsc.ok(&["create", "--bundle", quick.to_str().expect("utf-8"), &q]);
    runsc.ok(&["start", &q]);
    agent.wait_event(&q, "added", Duration::from_secs(10));
    agent.wait_event(&q, "removed", Duration::from_secs(15));

    for id in [&a, &b, &q] {
        runsc.cleanup(id);
        assert_eq!(events_of(&agent, id, "added"), 1, "{id} added once");
        assert_eq!(events_of(&agent, id, "removed"), 1, "{id} removed once");
    }
    let m = agent.metrics();
    assert_eq!(
        metric(&m, "lookout_missed_containers_total"),
        None,
        "nothing missed:\n{m}"
    );
}

#[test]
fn a_runsc_container_running_before_the_agent_is_found_by_its_scan() {
    if !ready_runsc("runsc_scan") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // runsc's default root: where the scan looks.
    let runsc = Runsc::new(Path::new("/run/runsc"));
    let b = bundle::busybox(&d.join("b"), &["sleep", "30"], |_| {});
    let early = id("runsc-early");
    runsc.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &early]);
    runsc.ok(&["start", &early]);
    let sandbox = runsc.sandbox_pid(&early);
    let agent = Agent::start(&runsc.rt, &[]);
    let added = agent.wait_event(&early, "added", Duration::from_secs(10));
    runsc.cleanup(&early);
    assert_eq!(added["source"], "state-scan", "{added}");
    assert_eq!(added["container"]["pid"], sandbox, "{added}");
    assert_eq!(added["container"]["sandbox"], "gvisor", "{added}");
    assert_eq!(added["container"]["runtime"], "runsc", "{added}");
    agent.wait_event(&early, "removed", Duration::from_secs(15));
}

/// A fake `runsc` that leaves a state file no runsc release writes: what
/// a future layout change looks like to this version.
fn fake_runsc(dir: &Path) -> PathBuf {
    let src = dir.join("fake.c");
    std::fs::write(
        &src,
        r#"#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    const char *root = "/run/runsc", *id = 0;
    int create = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--root") && i + 1 < argc) root = argv[++i];
        else if (!strcmp(argv[i], "create")) create = 1;
        else if (argv[i][0] != '-') id = argv[i];
        else if (!strcmp(argv[i], "--bundle")) i++;
    }
    if (!create || !id) return 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s_sandbox:%s.state", root, id, id);
    FILE *f = fopen(path, "w");
    if (!f) return 1;
    fputs("{\"version\": 99, \"sandboxes\": []}", f);
    return fclose(f) ? 1 : 0;
}
"#,
    )
    .expect("write fake.c");
    let bin_dir = dir.join("fake");
    std::fs::create_dir_all(&bin_dir).expect("dir");
    let bin = bin_dir.join("runsc");
    let status = Command::new("gcc")
        .args(["-O2", "-static", "-o"])
        .arg(&bin)
        .arg(&src)
        .stdout(Stdio::null())
        .status()
        .expect("gcc");
    assert!(status.success(), "gcc -static");
    bin
}

#[test]
fn an_unreadable_runsc_state_is_a_warning_and_a_metric_and_the_next_container_is_reported() {
    if !ready_runsc("runsc_unreadable") || !require_program("runsc_unreadable", "gcc") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let root = d.join("root");
    std::fs::create_dir_all(&root).expect("root");
    let runsc = Runsc::new(&root);
    let fake = fake_runsc(d);
    let agent = Agent::start(
        &runsc.rt,
        &["--runtime-path", fake.to_str().expect("utf-8")],
    );
    let bad = id("runsc-bad");
    let b = bundle::busybox(&d.join("b"), &["sleep", "1"], |_| {});
    let st = Command::new(&fake)
        .args([
            "--root",
            root.to_str().expect("utf-8"),
            "create",
            "--bundle",
        ])
        .arg(&b)
        .arg(&bad)
        .status()
        .expect("fake runsc");
    assert!(st.success());
    agent.wait_log("whose state cannot be read", Duration::from_secs(10));
    let good = id("runsc-good");
    runsc.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &good]);
    runsc.ok(&["start", &good]);
    agent.wait_event(&good, "added", Duration::from_secs(10));
    agent.wait_event(&good, "removed", Duration::from_secs(15));
    runsc.cleanup(&good);

    let log = agent.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("whose state cannot be read"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning: {warnings:?}");
    assert!(
        warnings[0].contains("WARN") && warnings[0].contains(&bad) && warnings[0].contains("runsc"),
        "runtime, id and reason: {}",
        warnings[0]
    );
    assert_eq!(events_of(&agent, &bad, "added"), 0);
    let m = agent.metrics();
    assert_eq!(
        metric(
            &m,
            "lookout_missed_containers_total{runtime=\"runsc\",reason=\"unreadable-state\"}"
        ),
        Some(1.0),
        "{m}"
    );
}

#[test]
fn containers_of_one_runsc_sandbox_are_each_reported_and_removed() {
    if !ready_runsc("runsc_pod") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let runsc = Runsc::new(&d.join("root"));
    let agent = Agent::start(&runsc.rt, &[]);
    let pod = id("runsc-pod");
    let cri = |kind: &str, pod: &str| {
        let (kind, pod) = (kind.to_owned(), pod.to_owned());
        move |c: &mut Value| {
            c["annotations"] = serde_json::json!({
                "io.kubernetes.cri.container-type": kind,
                "io.kubernetes.cri.sandbox-id": pod,
            });
        }
    };
    // As containerd's runsc shim starts a pod: the sandbox (pause), then
    // a container that joins it.
    let pb = bundle::busybox(&d.join("pod"), &["sleep", "30"], cri("sandbox", &pod));
    let cb = bundle::busybox(&d.join("ctr"), &["sleep", "30"], cri("container", &pod));
    runsc.ok(&["create", "--bundle", pb.to_str().expect("utf-8"), &pod]);
    runsc.ok(&["start", &pod]);
    let c = id("runsc-in-pod");
    runsc.ok(&["create", "--bundle", cb.to_str().expect("utf-8"), &c]);
    runsc.ok(&["start", &c]);
    let pod_added = agent.wait_event(&pod, "added", Duration::from_secs(10));
    let c_added = agent.wait_event(&c, "added", Duration::from_secs(10));
    assert_eq!(
        pod_added["container"]["pid"], c_added["container"]["pid"],
        "one sandbox process for both"
    );
    assert_eq!(c_added["container"]["sandbox"], "gvisor");
    // The container goes; its sandbox stays: its deletion reports it.
    runsc.ok(&["delete", "--force", &c]);
    agent.wait_event(&c, "removed", Duration::from_secs(10));
    assert_eq!(
        events_of(&agent, &pod, "removed"),
        0,
        "the pod's sandbox runs on"
    );
    runsc.ok(&["delete", "--force", &pod]);
    agent.wait_event(&pod, "removed", Duration::from_secs(10));
    for id in [&pod, &c] {
        assert_eq!(events_of(&agent, id, "added"), 1, "{id} added once");
        assert_eq!(events_of(&agent, id, "removed"), 1, "{id} removed once");
    }
}
