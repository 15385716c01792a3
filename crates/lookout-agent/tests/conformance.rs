//! podman as the reference for OCI hooks (issue #57): one hooks.d
//! directory run by podman 4.3.1 (which implements oci-hooks(5) itself and
//! has runc run the hooks) and by `lookout run` beside a plain runc, and
//! compared: which hooks ran, per stage and in order; the mount namespace
//! each ran in; the State's `status` and `pid`; the outcome when a hook
//! fails. The directory covers every stage, a 0.1.0 file, every `when`
//! condition and a failing hook. Every known difference is listed in
//! [`DIFFERENCES`] with its reason, and asserted: a podman or lookout that
//! changes fails here.

mod common;
use common::*;

use std::path::Path;
use std::time::Duration;

use lookout_testsupport::bundle;
use lookout_testsupport::podman::{
    Action, COMMAND, Podman, Record, Recorder, RunOptions, STAGES, busybox_rootfs, require_podman,
    write_hook,
};
use serde_json::json;

/// What lookout does differently from podman 4.3.1 with runc 1.1.5, and
/// why. Each is asserted below.
const DIFFERENCES: &[(&str, &str)] = &[
    (
        "poststart",
        "runc before 1.2 runs poststart hooks during `create`, before startContainer and the \
         container's process, with status `created`; lookout runs them after the start, once \
         the process exec'd, with `running`, as the runtime spec says",
    ),
    (
        "poststop after a failure before the start",
        "podman runs poststop only for a container runc created; lookout runs it for a \
         container whose start it refused, as the runtime spec's lifecycle (step 12) says and \
         issue #57 asks",
    ),
    (
        "a failing poststart hook",
        "fatal under runc (it runs at create) and in runtime-spec 1.3; lookout logs and counts \
         it, and the container keeps running",
    ),
    (
        "an invalid hooks.d file",
        "podman refuses to run any container; lookout skips the file with its name and field, \
         and runs the others",
    ),
    (
        "environment",
        "runc's hooks without `env` inherit runc's environment (and the container's, inside it); \
         lookout gives a hook exactly its `env`, as containers/common does for the hooks it runs",
    ),
];

/// The hooks.d directory: every stage, a 0.1.0 file, each `when`
/// condition (a positive and a negative case), and a hook that fails for a
/// container annotated `fail: <stage>`. Every file also asks for the
/// annotation `lookout-test: <test>` (conditions are ANDed): an agent's
/// start-up scan finds the containers of tests running beside it.
fn hooks_dir(rec: &Recorder, dir: &Path, test: &str) {
    let mine = |mut when: serde_json::Value| {
        when["annotations"]["^lookout-test$"] = json!(format!("^{test}$"));
        when
    };
    let always = mine(json!({"always": true}));
    for (i, stage) in STAGES.iter().enumerate() {
        let mut hook = rec.hook(stage, &[stage], always.clone(), Action::Ok, None);
        if *stage == "createContainer" {
            static_hook(rec, &mut hook);
        }
        write_hook(dir, &format!("0{}-{stage}.json", i + 1), &hook).expect("hook");
    }
    let when = [
        (
            "20-ann.json",
            "when-annotations",
            json!({"annotations": {"^conf/key$": "^yes$"}}),
        ),
        (
            "21-ann-no.json",
            "never-annotations",
            json!({"annotations": {"^conf/key$": "^no$"}}),
        ),
        (
            "22-cmd.json",
            "when-commands",
            json!({"commands": ["recorder\\.sh$"]}),
        ),
        (
            "23-cmd-no.json",
            "never-commands",
            json!({"commands": ["^nginx$"]}),
        ),
        ("24-bind.json", "when-bind", json!({"hasBindMounts": true})),
        (
            "25-always-no.json",
            "never-always",
            json!({"always": false}),
        ),
    ];
    for (name, label, when) in when {
        let hook = rec.hook(label, &["createRuntime"], mine(when), Action::Ok, None);
        write_hook(dir, name, &hook).expect("hook");
    }
    // 0.1.0: `hook` a string, `arguments` after it; annotations matched by
    // value, any one condition enough.
    let legacy = json!({
        "hook": rec.script(),
        "arguments": ["legacy"],
        "annotations": [format!("^{test}$")],
        "stage": ["prestart"],
    });
    write_hook(dir, "30-legacy.json", &legacy).expect("hook");
    let mut fail = rec.hook(
        "fail",
        &["createContainer"],
        mine(json!({"annotations": {"^fail$": "^createContainer$"}})),
        Action::Fail,
        None,
    );
    static_hook(rec, &mut fail);
    write_hook(dir, "40-fail.json", &fail).expect("hook");
}

/// `hook` (the recorder script) through a static shim: lookout runs a
/// `createContainer` hook only if it is a static program (it runs as root
/// in the container, where a script's shell would be the container's).
/// The shim runs the script with the recorder's busybox, at the same path
/// in the host and the container, under podman too.
fn static_hook(rec: &Recorder, hook: &mut serde_json::Value) {
    let shim = rec.dir().join("shim");
    if !shim.exists() {
        let built = bundle::static_shim(rec.dir().parent().expect("a parent"));
        lookout_testsupport::install_executable(&built, &shim).expect("install the shim");
    }
    let mut args = vec![
        json!("shim"),
        json!(rec.dir().join("busybox")),
        json!(rec.script()),
    ];
    if let Some(rest) = hook["hook"]["args"].as_array() {
        args.extend(rest.iter().skip(1).cloned());
    }
    hook["hook"]["path"] = json!(shim);
    hook["hook"]["args"] = json!(args);
}

/// Where a record ran, as `host` or `container`, and its State's status
/// and pid as `host`, `1` or `-`: what the two runs can share.
fn shape(r: &Record, host_mnt: u64, container_mnt: u64, host_pid: Option<u32>) -> String {
    let ns = match r.mnt_ns {
        n if n == host_mnt => "host",
        n if n == container_mnt => "container",
        _ => "other",
    };
    let pid = match r.pid {
        None => "-".to_owned(),
        Some(1) => "1".to_owned(),
        Some(p) if Some(p) == host_pid => "host".to_owned(),
        Some(p) => format!("other({p})"),
    };
    format!(
        "{} {ns} {} {pid}",
        r.stage,
        r.status.as_deref().unwrap_or("-")
    )
}

/// The shapes of a run's hook records (the command's own left out), in
/// order; and the command's record, if it ran.
fn shapes(
    records: &[Record],
    host_mnt: u64,
    host_pid: Option<u32>,
) -> (Vec<String>, Option<Record>) {
    let command = records.iter().find(|r| r.stage == COMMAND).cloned();
    let container_mnt = command.as_ref().map_or(0, |c| c.mnt_ns);
    let container_mnt = records
        .iter()
        .find(|r| r.stage == "createContainer")
        .map_or(container_mnt, |r| r.mnt_ns);
    let hooks = records
        .iter()
        .filter(|r| r.stage != COMMAND)
        .map(|r| shape(r, host_mnt, container_mnt, host_pid))
        .collect();
    (hooks, command)
}

/// A runc bundle like podman's container: busybox, the recorder's
/// command, `annotations`, the recorder's directory at the same path.
fn runc_bundle(rec: &Recorder, dir: &Path, annotations: &[(&str, &str)]) -> std::path::PathBuf {
    let command = rec.container_command();
    let args: Vec<&str> = command.iter().map(String::as_str).collect();
    bundle::busybox(dir, &args, |c| {
        c["annotations"] = annotations
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect::<serde_json::Map<_, _>>()
            .into();
        let r = rec.dir().to_str().expect("utf-8");
        c["mounts"].as_array_mut().expect("mounts").push(
            json!({"destination": r, "source": r, "type": "bind", "options": ["rbind", "rw"]}),
        );
    })
}

/// The recorder's command under `podman` with `hooks` and `annotations`.
fn podman_run(
    podman: &Podman,
    rec: &Recorder,
    hooks: &Path,
    d: &Path,
    annotations: &[(&str, &str)],
) -> lookout_testsupport::podman::RunResult {
    let rootfs = busybox_rootfs(&d.join("podman-bundle"));
    let mut opts = RunOptions::new(&rootfs)
        .hooks_dir(hooks)
        .bind_same(rec.dir())
        .command(rec.container_command());
    for (k, v) in annotations {
        opts = opts.annotation(k, v);
    }
    podman.run(&opts).expect("podman run")
}

fn host_mnt() -> u64 {
    lookout_testsupport::podman::host_mnt_ns().expect("the host's mount namespace")
}

#[test]
fn lookout_runs_a_hooks_d_directory_as_podman_does() {
    const TEST: &str = "hooks_conformance";
    if !ready(TEST) || !require_podman(TEST) {
        return;
    }
    eprintln!("known differences from podman 4.3.1 + runc 1.1.5:");
    for (what, why) in DIFFERENCES {
        eprintln!("  - {what}: {why}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let rec = Recorder::install(&d.join("rec")).expect("recorder");
    let hooks = d.join("hooks.d");
    hooks_dir(&rec, &hooks, TEST);
    let host = host_mnt();
    let annotations = [("conf/key", "yes"), ("lookout-test", TEST)];

    // podman.
    let podman = Podman::new().expect("podman");
    let ran = podman_run(&podman, &rec, &hooks, d, &annotations);
    assert!(
        ran.status.success(),
        "podman run: {}\n{}",
        ran.stderr,
        rec.text()
    );
    let theirs = rec.wait_for("poststop", Duration::from_secs(10));
    // podman's State pid is the init's; the command, pid 1 in its
    // namespace, does not say it: the host pid is the one prestart got.
    let their_pid = theirs
        .iter()
        .find(|r| r.stage == "prestart")
        .and_then(|r| r.pid);
    let (podman_hooks, podman_cmd) = shapes(&theirs, host, their_pid);
    assert!(
        podman_cmd.is_some(),
        "podman's container never ran: {theirs:#?}"
    );
    rec.clear().expect("clear");

    // lookout, beside a plain runc, for a bundle like podman's.
    let rt = Runtime::runc();
    let agent = Agent::start(&rt, &["--hooks-dir", hooks.to_str().expect("utf-8")]);
    let id = id("conformance");
    let b = runc_bundle(&rec, &d.join("b"), &annotations);
    let pid_file = d.join("init.pid");
    rt.ok(&[
        "create",
        "--bundle",
        b.to_str().expect("utf-8"),
        "--pid-file",
        pid_file.to_str().expect("utf-8"),
        &id,
    ]);
    let our_pid: Option<u32> = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|p| p.trim().parse().ok());
    rt.ok(&["start", &id]);
    let ours = rec.wait_for("poststop", Duration::from_secs(15));
    rt.cleanup(&id);
    let (lookout_hooks, lookout_cmd) = shapes(&ours, host, our_pid);
    assert!(
        lookout_cmd.is_some(),
        "lookout's container never ran: {ours:#?}"
    );
    let show = format!(
        "podman:\n  {}\nlookout:\n  {}\n{}",
        podman_hooks.join("\n  "),
        lookout_hooks.join("\n  "),
        agent.log()
    );

    // The same hooks in the same order, each where podman ran it and with
    // its State; but for poststart (DIFFERENCES[0]): runc 1.1.5 runs it
    // at create, `created`, before startContainer.
    let podman_poststart = "poststart host created host";
    let lookout_poststart = "poststart host running host";
    let mut expected: Vec<String> = podman_hooks
        .iter()
        .filter(|s| s.as_str() != podman_poststart)
        .cloned()
        .collect();
    assert_eq!(
        podman_hooks.len(),
        expected.len() + 1,
        "podman's poststart changed: {show}"
    );
    let at = expected
        .iter()
        .position(|s| s.starts_with("startContainer "))
        .expect("a startContainer record")
        + 1;
    expected.insert(at, lookout_poststart.to_owned());
    assert_eq!(lookout_hooks, expected, "{show}");
    // What the list holds, spelled out: every stage, each where the spec
    // says, the 0.1.0 file with the prestart hooks, each `when` positive
    // case and none of the negative ones.
    for want in [
        "prestart host creating host",
        "legacy host creating host",
        "createRuntime host creating host",
        "when-annotations host creating host",
        "when-commands host creating host",
        "when-bind host creating host",
        "createContainer container creating 1",
        "startContainer container created 1",
        "poststop host stopped -",
    ] {
        assert!(
            lookout_hooks.iter().any(|s| s == want),
            "no `{want}`: {show}"
        );
    }
    assert!(
        !lookout_hooks.iter().any(|s| s.starts_with("never-")),
        "{show}"
    );
    // DIFFERENCES[4]: exactly the hook's `env` (none here).
    assert!(
        ours.iter()
            .filter(|r| r.stage != COMMAND)
            .all(|r| r.env_count == 0),
        "{ours:#?}"
    );
    assert!(
        theirs
            .iter()
            .any(|r| r.stage == "prestart" && r.env_count > 0),
        "{theirs:#?}"
    );
    let _ = agent.stop();
}

#[test]
fn a_failing_create_container_hook_stops_the_container_under_podman_and_lookout() {
    const TEST: &str = "hooks_conformance_fail";
    if !ready(TEST) || !require_podman(TEST) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let rec = Recorder::install(&d.join("rec")).expect("recorder");
    let hooks = d.join("hooks.d");
    hooks_dir(&rec, &hooks, TEST);
    let fail = [("fail", "createContainer"), ("lookout-test", TEST)];

    let podman = Podman::new().expect("podman");
    let ran = podman_run(&podman, &rec, &hooks, d, &fail);
    assert!(
        !ran.status.success(),
        "podman ran the container: {}",
        rec.text()
    );
    let theirs = rec.records();
    let stages = |r: &[Record]| r.iter().map(|r| r.stage.clone()).collect::<Vec<_>>();
    assert!(stages(&theirs).contains(&"fail".to_owned()), "{theirs:#?}");
    assert!(
        !stages(&theirs).contains(&COMMAND.to_owned()),
        "{theirs:#?}"
    );
    assert!(
        !stages(&theirs).contains(&"startContainer".to_owned()),
        "{theirs:#?}"
    );
    // DIFFERENCES[1]: podman runs no poststop for a container runc did not
    // create.
    assert!(
        !stages(&theirs).contains(&"poststop".to_owned()),
        "{theirs:#?}"
    );
    rec.clear().expect("clear");

    let rt = Runtime::runc();
    let agent = Agent::start(&rt, &["--hooks-dir", hooks.to_str().expect("utf-8")]);
    let id = id("conformance-fail");
    let b = runc_bundle(&rec, &d.join("b"), &fail);
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    let refused = match rt.command().args(["start", &id]).output() {
        Err(e) => e.kind() == std::io::ErrorKind::PermissionDenied,
        Ok(out) => !out.status.success(),
    };
    assert!(refused, "the start went on:\n{}", agent.log());
    let ours = rec.wait_for("poststop", Duration::from_secs(15));
    rt.cleanup(&id);
    assert!(stages(&ours).contains(&"fail".to_owned()), "{ours:#?}");
    assert!(!stages(&ours).contains(&COMMAND.to_owned()), "{ours:#?}");
    assert!(
        !stages(&ours).contains(&"startContainer".to_owned()),
        "{ours:#?}"
    );
    // The hooks before the failing one ran in both, in the same order.
    let before = |r: &[Record]| {
        r.iter()
            .map(|r| r.stage.clone())
            .take_while(|s| s != "fail")
            .collect::<Vec<_>>()
    };
    assert_eq!(before(&ours), before(&theirs), "{ours:#?}\n{theirs:#?}");
    let _ = agent.stop();
}
