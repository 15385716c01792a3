//! Podman 4.3.1 with runc 1.1.5 running a hooks.d directory, as measured
//! (`lookout_testsupport::podman`'s documentation): the reference that a
//! conformance test compares lookout with. Root, podman, runc, conmon, gcc
//! and busybox-static; SKIPPED otherwise (a failure under CI).

use std::path::{Path, PathBuf};
use std::time::Duration;

use lookout_testsupport::podman::{
    Action, COMMAND, PODMAN_ORDER, Podman, Record, Recorder, RunOptions, STAGES, busybox_rootfs,
    host_mnt_ns, require_podman, write_hook,
};
use serde_json::json;

/// How long a `poststop` record may take to appear after `podman run`
/// returns (it came before the return in every measured run).
const POSTSTOP: Duration = Duration::from_secs(10);

/// Fields drop in order: podman (its containers) before the directory.
struct Setup {
    podman: Podman,
    dir: PathBuf,
    rootfs: PathBuf,
    recorder: Recorder,
    _dir: tempfile::TempDir,
}

fn setup() -> Setup {
    let dir = tempfile::Builder::new()
        .prefix("lookout-podman-test-")
        .tempdir()
        .expect("tempdir");
    let path = dir.path().to_path_buf();
    let rootfs = busybox_rootfs(&path.join("bundle"));
    let recorder = Recorder::install(&path.join("rec")).expect("recorder");
    let podman = Podman::new().expect("podman");
    let version = ["version", "--format", "{{.Client.Version}}"];
    let v = podman.exec("version", &version).expect("podman version");
    eprintln!("podman {} (measured: podman 4.3.1, runc 1.1.5)", v.trim());
    Setup {
        _dir: dir,
        dir: path,
        rootfs,
        recorder,
        podman,
    }
}

impl Setup {
    fn opts(&self) -> RunOptions {
        RunOptions::new(&self.rootfs)
            .bind_same(self.recorder.dir())
            .command(self.recorder.container_command())
    }
}

fn stages(records: &[Record]) -> Vec<&str> {
    records.iter().map(|r| r.stage.as_str()).collect()
}

fn one<'r>(records: &'r [Record], stage: &str) -> &'r Record {
    let mut it = records.iter().filter(|r| r.stage == stage);
    let r = it
        .next()
        .unwrap_or_else(|| panic!("no {stage} record: {records:#?}"));
    assert!(it.next().is_none(), "{stage} ran twice: {records:#?}");
    r
}

fn canonical(p: &Path) -> String {
    std::fs::canonicalize(p)
        .expect("canonicalize")
        .display()
        .to_string()
}

#[test]
fn podman_runs_the_six_stages_in_order_each_in_its_namespace() {
    if !require_podman("podman_runs_the_six_stages_in_order_each_in_its_namespace") {
        return;
    }
    let s = setup();
    let hooks = s.dir.join("hooks.d");
    s.recorder.six_stage_dir(&hooks).expect("hooks.d");
    let run = s
        .podman
        .run(&s.opts().hooks_dir(&hooks))
        .expect("podman run");
    assert!(run.status.success(), "podman run: {run:?}");
    let records = s.recorder.wait_for("poststop", POSTSTOP);
    assert_eq!(stages(&records), PODMAN_ORDER, "{records:#?}");

    let host = host_mnt_ns().expect("host mnt ns");
    let command = one(&records, COMMAND);
    assert_ne!(
        command.mnt_ns, host,
        "the command ran in the host's mount ns"
    );
    assert_eq!(command.self_pid, 1, "the command is the container's pid 1");
    let id = run.id.clone().expect("container id");
    let bundle = run.bundle.clone().expect("bundle").display().to_string();
    let init = one(&records, "prestart").pid.expect("prestart's State pid");
    assert!(
        init > 1,
        "prestart's State pid is the init's host pid: {init}"
    );

    // stage, in the container's mount ns, status, pid, cwd
    let rootfs = canonical(&s.rootfs);
    let podman_cwd = canonical(s.podman.dir());
    let expected: [(&str, bool, &str, Option<u32>, &str); 6] = [
        ("prestart", false, "creating", Some(init), &bundle),
        ("createRuntime", false, "creating", Some(init), &bundle),
        ("createContainer", true, "creating", Some(1), &rootfs),
        ("poststart", false, "created", Some(init), &bundle),
        ("startContainer", true, "created", Some(1), "/"),
        ("poststop", false, "stopped", None, &podman_cwd),
    ];
    for (stage, in_container, status, pid, cwd) in expected {
        let r = one(&records, stage);
        let ns = if in_container { command.mnt_ns } else { host };
        assert_eq!(r.mnt_ns, ns, "{stage}'s mount ns: {r:#?}");
        assert_eq!(
            r.status.as_deref(),
            Some(status),
            "{stage}'s status: {r:#?}"
        );
        assert_eq!(r.pid, pid, "{stage}'s State pid: {r:#?}");
        assert_eq!(r.cwd, cwd, "{stage}'s cwd: {r:#?}");
        assert_eq!(r.id.as_deref(), Some(id.as_str()), "{stage}'s State id");
        assert_eq!(
            r.bundle.as_deref(),
            Some(bundle.as_str()),
            "{stage}'s bundle"
        );
        assert!(r.annotations > 0, "{stage}: no annotations: {r:#?}");
    }
    // Environments: runc's hooks inherit runc's (PATH included), the
    // in-container ones the container process's, podman's poststop none.
    for stage in ["prestart", "createRuntime", "poststart"] {
        let r = one(&records, stage);
        assert!(r.path.is_some() && r.env_count > 1, "{stage}'s env: {r:#?}");
    }
    for stage in ["createContainer", "startContainer"] {
        assert!(one(&records, stage).path.is_some(), "{stage} has no PATH");
    }
    assert_eq!(one(&records, "poststop").env_count, 0, "poststop's env");
    eprintln!("podman run took {:?}", run.elapsed);
}

/// One hook per stage that fails (exit 1, or past its 1 s timeout) when
/// the annotation `fail` (or `hang`) names its stage.
fn failing_dir(s: &Setup) -> PathBuf {
    let hooks = s.dir.join("hooks.d");
    s.recorder.six_stage_dir(&hooks).expect("hooks.d");
    for (i, stage) in STAGES.iter().enumerate() {
        let fail = s.recorder.hook(
            stage,
            &[stage],
            json!({"annotations": {"^fail$": format!("^{stage}$")}}),
            Action::Fail,
            None,
        );
        write_hook(&hooks, &format!("5{}-fail-{stage}.json", i + 1), &fail).expect("hook");
        let hang = s.recorder.hook(
            stage,
            &[stage],
            json!({"annotations": {"^hang$": format!("^{stage}$")}}),
            Action::Sleep(30),
            Some(1),
        );
        write_hook(&hooks, &format!("6{}-hang-{stage}.json", i + 1), &hang).expect("hook");
    }
    hooks
}

#[test]
fn a_failing_hook_fails_podman_run_up_to_poststart_and_is_ignored_at_poststop() {
    if !require_podman("a_failing_hook_fails_podman_run_up_to_poststart_and_is_ignored_at_poststop")
    {
        return;
    }
    let s = setup();
    let hooks = failing_dir(&s);
    // stage, podman run's exit code, its message, did the command run
    // (then poststop runs too)
    let cases = [
        ("prestart", 126, "runc create failed", false),
        ("createRuntime", 126, "runc create failed", false),
        ("createContainer", 126, "runc create failed", false),
        ("poststart", 126, "runc create failed", false),
        ("startContainer", 1, "error running hook #1", false),
        ("poststop", 0, "", true),
    ];
    for (stage, code, message, command_ran) in cases {
        s.recorder.clear().expect("clear");
        let run = s
            .podman
            .run(&s.opts().hooks_dir(&hooks).annotation("fail", stage))
            .expect("podman run");
        assert_eq!(run.status.code(), Some(code), "fail={stage}: {run:?}");
        assert!(run.stderr.contains(message), "fail={stage}: {run:?}");
        if stage != "poststop" {
            assert!(
                run.stderr.contains(&format!("{stage} fails on purpose")),
                "{run:?}"
            );
        }
        let poststop = stage == "startContainer" || stage == "poststop";
        let records = if poststop {
            s.recorder.wait_for("poststop", POSTSTOP)
        } else {
            s.recorder.records()
        };
        let failed: Vec<&Record> = records.iter().filter(|r| r.action == "fail").collect();
        assert_eq!(failed.len(), 1, "fail={stage}: {records:#?}");
        assert_eq!(failed[0].stage, stage);
        assert_eq!(
            records.iter().any(|r| r.stage == COMMAND),
            command_ran,
            "fail={stage}: did the command run? {records:#?}"
        );
        // Everything before the failing hook ran, in order; after it,
        // only poststop (when the container had started) and, at poststop,
        // the stage's other hooks.
        let upto = PODMAN_ORDER
            .iter()
            .position(|&p| p == stage)
            .expect("a stage");
        let mut want: Vec<&str> = PODMAN_ORDER[..=upto].to_vec();
        want.push(stage);
        if stage == "startContainer" {
            want.push("poststop");
        }
        assert_eq!(stages(&records), want, "fail={stage}: {records:#?}");
    }
    // A hook past its timeout: killed after it (the `exec`'d sleep goes
    // with it), and podman run fails as with exit 1.
    s.recorder.clear().expect("clear");
    let run = s
        .podman
        .run(&s.opts().hooks_dir(&hooks).annotation("hang", "prestart"))
        .expect("podman run");
    assert_eq!(run.status.code(), Some(126), "{run:?}");
    assert!(
        run.stderr
            .contains("hook ran past specified timeout of 1.0s"),
        "{run:?}"
    );
    assert!(run.elapsed < Duration::from_secs(20), "{run:?}");
    assert_eq!(stages(&s.recorder.records()), ["prestart", "prestart"]);
}

#[test]
fn hooks_d_files_run_by_lower_cased_name_a_later_dir_overrides_and_when_matches() {
    if !require_podman(
        "hooks_d_files_run_by_lower_cased_name_a_later_dir_overrides_and_when_matches",
    ) {
        return;
    }
    let s = setup();
    let (d1, d2) = (s.dir.join("d1"), s.dir.join("d2"));
    let always = || json!({"always": true});
    let prestart = |label: &str, when| {
        s.recorder
            .hook(label, &["prestart"], when, Action::Ok, None)
    };
    for (name, label) in [
        ("B.json", "B"),
        ("a.json", "a"),
        ("10-x.json", "10-x"),
        ("9-y.json", "9-y"),
        ("_u.json", "_u"),
        ("x.json", "d1-x"),
    ] {
        write_hook(&d1, name, &prestart(label, always())).expect("hook");
    }
    write_hook(&d2, "x.json", &prestart("d2-x", always())).expect("hook");
    let script = s.recorder.script().display().to_string();
    let conditions = [
        ("c1-always-false", json!({"always": false})),
        ("c2-annotation", json!({"annotations": {"^k$": "^v$"}})),
        ("c3-annotation-miss", json!({"annotations": {"^k$": "^w$"}})),
        ("c4-command", json!({"commands": ["recorder\\.sh$"]})),
        ("c5-command-miss", json!({"commands": ["^/bin/true$"]})),
        ("c6-bind", json!({"hasBindMounts": true})),
        ("c7-bind-false", json!({"hasBindMounts": false})),
        (
            "c8-and-miss",
            json!({"always": true, "annotations": {"^k$": "^w$"}}),
        ),
        ("c9-empty", json!({})),
    ];
    for (label, when) in conditions {
        write_hook(&d2, &format!("{label}.json"), &prestart(label, when)).expect("hook");
    }
    // The 0.1.0 format: no `when`; its conditions are OR-ed, annotations
    // are regexps of any annotation's value, and no condition never runs.
    let legacy = [
        ("o1-cmds", json!({"cmds": ["recorder"]})),
        (
            "o2-or",
            json!({"cmds": ["^/nothing$"], "annotations": ["^v$"]}),
        ),
        ("o3-none", json!({})),
        ("o4-key-is-no-value", json!({"annotations": ["^k$"]})),
    ];
    for (label, cond) in legacy {
        let mut hook = json!({"hook": script, "arguments": [label], "stages": ["prestart"]});
        for (k, v) in cond.as_object().expect("object") {
            hook[k] = v.clone();
        }
        write_hook(&d2, &format!("{label}.json"), &hook).expect("hook");
    }
    let run = s
        .podman
        .run(&s.opts().hooks_dir(&d1).hooks_dir(&d2).annotation("k", "v"))
        .expect("podman run");
    assert!(run.status.success(), "{run:?}");
    let records = s.recorder.records();
    let ran: Vec<&str> = stages(&records)
        .into_iter()
        .filter(|&s| s != COMMAND)
        .collect();
    assert_eq!(
        ran,
        [
            "10-x",
            "9-y",
            "_u",
            "a",
            "B",
            "c2-annotation",
            "c4-command",
            "c6-bind",
            "o1-cmds",
            "o2-or",
            "d2-x",
        ],
        "{records:#?}"
    );
}
