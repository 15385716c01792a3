//! OCI hooks run by `lookout run` for real runc containers (issue #5):
//! `--prestart`/`--poststop`, hooks.d directories, timeouts, Kubernetes
//! Events (recorded by the test API server).

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

use lookout_testsupport::apiserver::ApiServer;
use lookout_testsupport::{bundle, require_program};
use serde_json::Value;

fn wait_file(path: &Path, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && !s.is_empty()
        {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{} never written",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn json_file(path: &Path) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = wait_file(path, Duration::from_secs(10));
        match serde_json::from_str(&text) {
            Ok(v) => return v,
            // Still being written.
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("{}: {e}: {text}", path.display()),
        }
    }
}

#[test]
fn a_prestart_hook_gets_the_creating_state_and_finishes_before_the_first_instruction() {
    if !ready("prestart_hook") || !require_program("prestart_hook", "gcc") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let b = d.join("bundle");
    bundle::busybox(&b, &["/stamp", "/stamp.out"], |c| {
        c["annotations"] = serde_json::json!({"com.example/team": "blue"});
    });
    let stamp = bundle::monotonic_stamp(d);
    lookout_testsupport::install_executable(&stamp, &b.join("rootfs/stamp")).expect("copy stamp");
    // The hook is slow on purpose: `start` must wait for it.
    // Other tests' containers run meanwhile: name the files by the id in
    // the State.
    let script = d.join("prestart.sh");
    std::fs::write(
        &script,
        format!(
            "x=$(cat)\nid=$(echo \"$x\" | grep -o '\"id\":\"[^\"]*\"' | head -n1 | cut -d'\"' -f4)\n\
             echo \"$x\" > {d}/state.$id\nsleep 0.3\n{stamp} {d}/hook-done.$id\n",
            d = d.display(),
            stamp = stamp.display()
        ),
    )
    .expect("script");
    let prestart = format!("sh {}", script.display());
    let poststop = format!(
        "x=$(cat); id=$(echo \"$x\" | grep -o '\"id\":\"[^\"]*\"' | head -n1 | cut -d'\"' -f4); echo \"$x\" > {}/poststop.$id",
        d.display()
    );
    let agent = Agent::start(&rt, &["--prestart", &prestart, "--poststop", &poststop]);
    let id = id("prestart");
    let pid_file = d.join("init.pid");
    let bs = b.to_str().expect("utf-8");
    rt.ok(&[
        "create",
        "--bundle",
        bs,
        "--pid-file",
        pid_file.to_str().expect("utf-8"),
        &id,
    ]);
    rt.ok(&["start", &id]);
    let first_instruction = read_stamp(&b.join("rootfs/stamp.out"));
    agent.wait_event(&id, "removed", Duration::from_secs(10));
    rt.cleanup(&id);

    let hook_done = read_stamp(&d.join(format!("hook-done.{id}")));
    assert!(
        hook_done < first_instruction,
        "the prestart hook finished at {hook_done}, after the container's first instruction at {first_instruction}"
    );
    let pid: u64 = std::fs::read_to_string(&pid_file)
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    let state = json_file(&d.join(format!("state.{id}")));
    assert_eq!(state["ociVersion"], "1.2.0");
    assert_eq!(state["id"], id.as_str());
    assert_eq!(
        state["status"], "creating",
        "runc passes `creating` to prestart hooks"
    );
    assert_eq!(state["pid"], pid);
    assert_eq!(state["bundle"], bs);
    assert_eq!(state["annotations"]["com.example/team"], "blue");
    assert_eq!(state["annotations"]["io.lookout.source"], "runtime-hook");
    assert!(state["annotations"].get("io.lookout.hook.late").is_none());

    let stopped = json_file(&d.join(format!("poststop.{id}")));
    assert_eq!(stopped["id"], id.as_str());
    assert_eq!(stopped["status"], "stopped");
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("hook ran"), "{log}");
}

#[test]
fn hooks_d_files_match_on_annotations_commands_and_always_and_bad_ones_are_skipped() {
    if !ready("hooks_d") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let hooks = d.join("hooks.d");
    let out = d.join("out");
    std::fs::create_dir_all(&hooks).expect("mkdir");
    std::fs::create_dir_all(&out).expect("mkdir");
    // Each hook touches out/<name>.<container id> (the id from its State).
    let hook = |name: &str, when: &str, stages: &str| {
        let script = format!(
            "id=$(grep -o '\"id\":\"[^\"]*\"' | head -n1 | cut -d'\"' -f4); touch {}/{name}.$id",
            out.display()
        );
        let v = serde_json::json!({
            "version": "1.0.0",
            "hook": {"path": "/bin/sh", "args": ["sh", "-c", script], "env": ["PATH=/usr/bin:/bin"]},
            "when": serde_json::from_str::<Value>(when).expect("when"),
            "stages": serde_json::from_str::<Value>(stages).expect("stages"),
        });
        std::fs::write(hooks.join(format!("{name}.json")), v.to_string()).expect("write hook");
    };
    hook("10-always", r#"{"always": true}"#, r#"["prestart"]"#);
    hook(
        "20-annot",
        r#"{"annotations": {"com\\.example/trace": "^yes$"}}"#,
        r#"["createRuntime"]"#,
    );
    hook("30-cmd", r#"{"commands": ["sleep$"]}"#, r#"["prestart"]"#);
    hook(
        "40-nomatch",
        r#"{"annotations": {"com\\.example/trace": "^no$"}}"#,
        r#"["prestart"]"#,
    );
    hook("50-stop", r#"{"always": true}"#, r#"["poststop"]"#);
    std::fs::write(hooks.join("60-broken.json"), "{ not json").expect("write");
    std::fs::write(
        hooks.join("70-missing.json"),
        r#"{"version":"1.0.0","hook":{"path":"/nonexistent/hook"},"when":{"always":true},"stages":["prestart"]}"#,
    )
    .expect("write");
    std::fs::write(
        hooks.join("80-regex.json"),
        r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"when":{"commands":["(unclosed"]},"stages":["prestart"]}"#,
    )
    .expect("write");

    let agent = Agent::start(&rt, &["--hooks-dir", hooks.to_str().expect("utf-8")]);
    let traced = id("hooksd-a");
    let plain = id("hooksd-b");
    let a = bundle::busybox(&d.join("a"), &["/bin/sleep", "1"], |c| {
        c["annotations"] = serde_json::json!({"com.example/trace": "yes"});
    });
    let b = bundle::busybox(&d.join("b"), &["/bin/true"], |_| {});
    rt.ok(&["run", "-d", "--bundle", a.to_str().expect("utf-8"), &traced]);
    rt.ok(&["run", "-d", "--bundle", b.to_str().expect("utf-8"), &plain]);
    agent.wait_event(&traced, "removed", Duration::from_secs(10));
    agent.wait_event(&plain, "removed", Duration::from_secs(10));
    rt.cleanup(&traced);
    rt.cleanup(&plain);
    let expect = |id: &str, names: &[&str]| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut got: Vec<String> = std::fs::read_dir(&out)
                .expect("out")
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter_map(|n| n.strip_suffix(&format!(".{id}")).map(str::to_owned))
                .collect();
            got.sort();
            if got == names || Instant::now() > deadline {
                assert_eq!(got, names, "hooks run for {id}");
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    expect(&traced, &["10-always", "20-annot", "30-cmd", "50-stop"]);
    expect(&plain, &["10-always", "50-stop"]);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    for bad in ["60-broken.json", "70-missing.json", "80-regex.json"] {
        assert!(
            log.lines()
                .any(|l| l.contains("hook file skipped") && l.contains(bad)),
            "{bad} reported: {log}"
        );
    }
    assert!(log.contains("invalid regex"), "{log}");
}

#[test]
fn a_hanging_hook_is_killed_at_the_timeout_and_blocks_nothing_else() {
    if !ready("hanging_hook") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // Hangs for containers annotated "hang", finishes at once for others.
    let hooks = d.join("hooks.d");
    std::fs::create_dir_all(&hooks).expect("mkdir");
    std::fs::write(
        hooks.join("hang.json"),
        serde_json::json!({
            "version": "1.0.0",
            // A duration no other test uses: pgrep below must not find
            // another test's container running `sleep 30`.
            "hook": {"path": "/bin/sleep", "args": ["sleep", "29.73"]},
            "when": {"annotations": {"^hang$": ""}},
            "stages": ["prestart"]
        })
        .to_string(),
    )
    .expect("write");
    let agent = Agent::start(
        &rt,
        &[
            "--hooks-dir",
            hooks.to_str().expect("utf-8"),
            // 5 s, so that the bounds below tell "held by the hanging
            // hook" (5 s) from "a slow machine" (well under 3 s).
            "--hook-timeout",
            "5s",
        ],
    );
    let slow = id("hang-slow");
    let other = id("hang-other");
    let a = bundle::busybox(&d.join("a"), &["sleep", "5"], |c| {
        c["annotations"] = serde_json::json!({"hang": "yes"});
    });
    let b = bundle::busybox(&d.join("b"), &["sleep", "5"], |_| {});
    rt.ok(&["create", "--bundle", a.to_str().expect("utf-8"), &slow]);
    agent.wait_event(&slow, "added", Duration::from_secs(5));
    // While its hook hangs, another container is created, discovered and
    // started at once. Held behind the hook, it would wait until the hook's
    // 5 s timeout (which began before `t`, at the create); 3 s leaves a
    // loaded 2-core VM room and still fails that.
    let t = Instant::now();
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &other]);
    agent.wait_event(&other, "added", Duration::from_secs(10));
    rt.ok(&["start", &other]);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "others wait: {:?}",
        t.elapsed()
    );
    // The hanging one's start is refused once its hook timed out (the
    // runtime spec: a hook that times out fails): at most 5 s after its
    // create. Were it not decided at the hook's timeout, the start would
    // wait for the agent's cap on a start's wait, 11 s (max(hook timeout,
    // gate max deadline 10 s, ...) + 1 s), or for the hook's 29.73 s; 8 s
    // tells those apart with 3 s to spare for load.
    let t = Instant::now();
    let refused = match rt.command().args(["start", &slow]).output() {
        Err(e) => e.kind() == std::io::ErrorKind::PermissionDenied,
        Ok(out) => !out.status.success(),
    };
    let waited = t.elapsed();
    assert!(refused, "the start went on:\n{}", agent.log());
    assert!(waited < Duration::from_secs(8), "start waited {waited:?}");
    let removed = agent.wait_event(&slow, "removed", Duration::from_secs(10));
    let reason = removed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("denied by hooks: prestart hook hang.json: timed out"),
        "{removed}"
    );
    rt.cleanup(&slow);
    rt.cleanup(&other);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !agent.log().contains("timed out") {
        assert!(
            Instant::now() < deadline,
            "no timeout logged:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The hook's `sleep` was killed, not left behind.
    let left = std::process::Command::new("pgrep")
        .args(["-f", "^sleep 29\\.73$"])
        .output()
        .expect("pgrep");
    assert!(
        left.stdout.is_empty(),
        "hook left running: {}",
        String::from_utf8_lossy(&left.stdout)
    );
    let (status, _) = agent.stop();
    assert!(status.success());
}

#[test]
fn hooks_for_containers_found_late_say_so_in_the_state() {
    if !ready("late_hooks") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let early = id("late");
    let b = bundle::busybox(&d.join("b"), &["sleep", "3"], |_| {});
    rt.ok(&["run", "-d", "--bundle", b.to_str().expect("utf-8"), &early]);
    let prestart = format!(
        "x=$(cat); id=$(echo \"$x\" | grep -o '\"id\":\"[^\"]*\"' | head -n1 | cut -d'\"' -f4); echo \"$x\" > {}/state.$id",
        d.display()
    );
    let agent = Agent::start(&rt, &["--prestart", &prestart]);
    let added = agent.wait_event(&early, "added", Duration::from_secs(5));
    assert_eq!(added["source"], "state-scan");
    let state = json_file(&d.join(format!("state.{early}")));
    rt.cleanup(&early);
    assert_eq!(state["id"], early.as_str());
    assert_eq!(state["status"], "running");
    assert_eq!(state["annotations"]["io.lookout.hook.late"], "true");
    assert_eq!(state["annotations"]["io.lookout.source"], "state-scan");
    let _ = agent.stop();
}

/// The Event the agent posted to `server` about container `id`.
fn wait_k8s_event(server: &ApiServer, agent: &Agent, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = server
            .events()
            .into_iter()
            .find(|e| e["note"].as_str().is_some_and(|n| n.contains(id)));
        if let Some(e) = found {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "no Event posted: {:?}\n{}",
            server.requests(),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An agent that posts Events to `server`, with `extra` flags.
fn events_agent(rt: &Runtime, server: &ApiServer, dir: &Path, extra: &[&str]) -> Agent {
    let kubeconfig = server.kubeconfig(dir);
    let mut args = vec!["--k8s-events", "--fallback-informer=false"];
    args.extend_from_slice(extra);
    Agent::start_with(
        Some(rt),
        &args,
        &[
            ("NODE_NAME", "node-a"),
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
            // Each dropped Event is logged at debug, with its container.
            (
                "LOOKOUT_LOG",
                "info,lookout_runtime_hook=debug,lookout_agent::hooks=debug,lookout_agent::k8s_events=debug",
            ),
        ],
        None,
    )
}

#[test]
fn new_containers_are_posted_as_kubernetes_events() {
    if !ready("k8s_events") {
        return;
    }
    let rt = Runtime::runc();
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = server.kubeconfig(dir.path());
    let agent = Agent::start_with(
        Some(&rt),
        &["--k8s-events", "--fallback-informer=false"],
        &[
            ("NODE_NAME", "node-a"),
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
        ],
        None,
    );
    let id = id("k8s-event");
    let b = bundle::busybox(&dir.path().join("b"), &["true"], |c| {
        c["hostname"] = serde_json::json!("event-host");
        // Secrets as containers really carry them: injected env vars and
        // annotations. None may reach the Event (readable by anyone who
        // may list Events).
        c["process"]["env"] = serde_json::json!(["PATH=/bin", "PASSWORD=hunter2-env"]);
        c["annotations"] = serde_json::json!({"example.com/api-token": "tok-s3cr3t-annotation"});
    });
    rt.ok(&["run", "-d", "--bundle", b.to_str().expect("utf-8"), &id]);
    agent.wait_event(&id, "added", Duration::from_secs(5));
    rt.cleanup(&id);
    let event = wait_k8s_event(&server, &agent, &id);
    assert_eq!(event["apiVersion"], "events.k8s.io/v1");
    assert_eq!(event["reason"], "NewContainerConfig");
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["regarding"]["kind"], "Node");
    assert_eq!(event["regarding"]["name"], "node-a");
    assert_eq!(event["reportingController"], "lookout");
    let note = event["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("event-host")
            && note.contains("PASSWORD")
            && note.contains("example.com/api-token"),
        "the summary is in the note: {note}"
    );
    assert!(
        !note.contains("hunter2-env") && !note.contains("tok-s3cr3t-annotation"),
        "a secret reached the Event: {note}"
    );
    assert!(
        note.len() <= 1024,
        "k8s limits notes to 1 kB: {}",
        note.len()
    );
    let (status, _) = agent.stop();
    assert!(status.success());
}

/// The two agents of a rollout, one serving the socket and one standing
/// by, post one Event for a container both see: the Event is claimed
/// beside the shared socket.
#[test]
fn two_agents_of_a_rollout_post_one_event_per_container() {
    if !ready("k8s_events_once") {
        return;
    }
    let rt = Runtime::runc();
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("api/lookout.sock");
    let s = socket.to_str().expect("utf-8");
    let old = events_agent(&rt, &server, dir.path(), &["--socket", s]);
    let new = events_agent(&rt, &server, dir.path(), &["--socket", s]);
    new.wait_log("standing by", Duration::from_secs(5));
    let id = id("k8s-event-once");
    let b = bundle::busybox(&dir.path().join("b"), &["true"], |_| {});
    rt.ok(&["run", "-d", "--bundle", b.to_str().expect("utf-8"), &id]);
    old.wait_event(&id, "added", Duration::from_secs(5));
    new.wait_event(&id, "added", Duration::from_secs(5));
    rt.cleanup(&id);
    wait_k8s_event(&server, &old, &id);
    // One of them posted it, the other found it claimed and done.
    let deadline = Instant::now() + Duration::from_secs(20);
    let skipped = "Kubernetes Event already posted by the other agent";
    while !(old.log().contains(skipped) || new.log().contains(skipped)) {
        assert!(
            Instant::now() < deadline,
            "neither agent skipped the Event:\nold:\n{}\nnew:\n{}",
            old.log(),
            new.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let posted = server
        .events()
        .into_iter()
        .filter(|e| e["note"].as_str().is_some_and(|n| n.contains(&id)))
        .count();
    assert_eq!(posted, 1, "one Event for {id}: {:?}", server.requests());
}

#[test]
fn kubernetes_events_over_the_rate_limit_are_dropped_and_counted() {
    if !ready("k8s_events_limit") {
        return;
    }
    let rt = Runtime::runc();
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = events_agent(
        &rt,
        &server,
        dir.path(),
        &["--k8s-events-burst", "2", "--k8s-events-per-minute", "0"],
    );
    let ids: Vec<String> = (0..5).map(|i| id(&format!("k8s-limit-{i}"))).collect();
    for (i, id) in ids.iter().enumerate() {
        let b = bundle::busybox(&dir.path().join(format!("b{i}")), &["true"], |_| {});
        rt.ok(&["run", "-d", "--bundle", b.to_str().expect("utf-8"), id]);
    }
    for id in &ids {
        agent.wait_event(id, "added", Duration::from_secs(10));
        rt.cleanup(id);
    }
    // Every container the agent reports goes through the limit once:
    // posted or dropped. N.B. that includes other tests' containers its
    // start-up state scan found; with none, `added` is our 5.
    let dropped_lines = |log: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains("Kubernetes Event dropped: over the rate limit"))
            .map(str::to_owned)
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let (added, posted, dropped) = loop {
        let added = {
            let all = agent.events.lock().unwrap_or_else(|e| e.into_inner());
            all.iter().filter(|e| e["event"] == "added").count()
        };
        let posted = server.events();
        let dropped = dropped_lines(&agent.log());
        if posted.len() + dropped.len() == added {
            break (added, posted, dropped);
        }
        assert!(
            Instant::now() < deadline,
            "{added} added, {} posted, {} dropped:\n{}",
            posted.len(),
            dropped.len(),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(posted.len(), 2, "the burst, then nothing: {posted:?}");
    assert_eq!(dropped.len(), added - 2, "{}", agent.log());
    assert_eq!(
        metric(&agent.metrics(), "lookout_k8s_events_dropped_total"),
        Some((added - 2) as f64),
        "3 with no other test's container"
    );
    // Each of ours was either posted or dropped, never both.
    for id in &ids {
        let was_posted = posted
            .iter()
            .any(|e| e["note"].as_str().is_some_and(|n| n.contains(id.as_str())));
        let was_dropped = dropped.iter().any(|l| l.contains(id.as_str()));
        assert!(
            was_posted != was_dropped,
            "{id}: posted {was_posted}, dropped {was_dropped}"
        );
    }
    // Warned once (the first drop), not once per Event.
    let log = agent.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("Kubernetes Events dropped"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(warnings[0].contains("dropped=1"), "{}", warnings[0]);
    let (status, _) = agent.stop();
    assert!(status.success());
}

#[test]
fn with_unsafe_values_the_event_note_carries_env_and_annotation_values() {
    if !ready("k8s_events_unsafe") {
        return;
    }
    let rt = Runtime::runc();
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = events_agent(&rt, &server, dir.path(), &["--k8s-events-unsafe-values"]);
    let id = id("k8s-unsafe");
    let b = bundle::busybox(&dir.path().join("b"), &["true"], |c| {
        c["process"]["env"] = serde_json::json!(["PATH=/bin", "PASSWORD=hunter2"]);
        c["annotations"] = serde_json::json!({"example.com/api-token": "tok-s3cr3t-annotation"});
    });
    rt.ok(&["run", "-d", "--bundle", b.to_str().expect("utf-8"), &id]);
    agent.wait_event(&id, "added", Duration::from_secs(5));
    rt.cleanup(&id);
    let event = wait_k8s_event(&server, &agent, &id);
    let note = event["note"].as_str().unwrap_or_default();
    // The opt-in works (new_containers_are_posted_as_kubernetes_events
    // shows the default hides both).
    assert!(
        note.contains("PASSWORD=hunter2") && note.contains("tok-s3cr3t-annotation"),
        "values missing: {note}"
    );
    assert!(note.len() <= 1024, "{}", note.len());
    let log = agent.log();
    let warned = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("--k8s-events-unsafe-values"))
        .count();
    assert_eq!(warned, 1, "one warning at start-up: {log}");
    let (status, _) = agent.stop();
    assert!(status.success());
}

#[test]
fn bad_event_rate_limits_are_refused_with_exit_code_2() {
    // Checked before anything runs: no root needed.
    for (with, flag, value) in [
        (&["--k8s-events"][..], "--k8s-events-burst", "0"),
        (&[], "--k8s-events-burst", "-1"),
        (&["--k8s-events"], "--k8s-events-per-minute", "many"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lookout"))
            .args(["run", "--no-socket"])
            .args(with)
            .arg(format!("{flag}={value}"))
            .args(["--listen", "127.0.0.1:0"])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run lookout");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(
            err.contains(flag) && err.contains(value) && !err.contains("panicked"),
            "{flag} {value}: {err}"
        );
    }
}

#[test]
fn a_start_held_for_prestart_hooks_shows_as_the_oldest_unanswered_exec() {
    if !ready("oldest_unanswered") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = Agent::start(&rt, &["--prestart", "sleep 2"]);
    let id = id("held-start");
    let b = bundle::busybox(&dir.path().join("b"), &["true"], |_| {});
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    let oldest = || {
        metric(
            &agent.metrics(),
            "lookout_permission_oldest_unanswered_seconds",
        )
        .expect("the metric")
    };
    std::thread::scope(|s| {
        let start = s.spawn(|| rt.ok(&["start", &id]));
        let deadline = Instant::now() + Duration::from_secs(5);
        while oldest() < 0.5 {
            assert!(Instant::now() < deadline, "the held start never showed");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Held on purpose, within the bound: still healthy.
        assert_eq!(http_get(&agent.addr(), "/healthz").0, 200);
        start.join().expect("start");
    });
    // The answer reaches runc before the answerer lets go of its slot
    // (the woken exec may run first): wait for the slot, 5 s at most.
    let deadline = Instant::now() + Duration::from_secs(5);
    while oldest() != 0.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(oldest(), 0.0, "answered: nothing waits");
    agent.wait_event(&id, "removed", Duration::from_secs(10));
    rt.cleanup(&id);
}
