//! The runtime spec's hook stages as `lookout run` runs them for real runc
//! containers (issue #57): each stage at its point, in its namespaces, with
//! the State runc passes, and a failure before the start stopping the
//! container. Every hook runs one recorder script, which writes what it saw
//! to a directory bind-mounted into the container at the same path (so
//! that the hooks run in the container can write there too).

mod common;
use common::*;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lookout_testsupport::{bundle, require_program};
use serde_json::json;

/// A directory of records, its recorder script and stamp binary.
struct Recorder {
    dir: PathBuf,
}

impl Recorder {
    fn new(parent: &Path) -> Recorder {
        let dir = parent.join("rec");
        std::fs::create_dir_all(&dir).expect("mkdir rec");
        let stamp = bundle::monotonic_stamp(parent);
        lookout_testsupport::install_executable(&stamp, &dir.join("stamp")).expect("stamp");
        // busybox's applets by name: the script runs on the host and in the
        // container's root (a busybox-only file system) alike.
        let script = format!(
            r#"#!/bin/sh
x=$(cat)
b=busybox
field() {{ echo "$x" | $b grep -o "\"$1\":\"[^\"]*\"" | $b head -n1 | $b cut -d'"' -f4; }}
id=$(field id)
pid=$(echo "$x" | $b grep -o '"pid":[0-9]*' | $b head -n1 | $b cut -d: -f2)
out={dir}/$1.$id
{{
  echo "mnt=$($b readlink /proc/self/ns/mnt)"
  echo "status=$(field status)"
  echo "pid=$pid"
  [ -n "$pid" ] && echo "exe=$($b readlink /proc/$pid/exe)"
  echo "cap=$($b grep CapEff /proc/self/status | $b cut -f2)"
  echo "nnp=$($b grep NoNewPrivs /proc/self/status | $b cut -f2)"
  echo "uid=$($b id -u)"
}} > $out.tmp
{dir}/stamp $out.t
$b mv $out.tmp $out
[ "$2" = fail ] && exit 3
exit 0
"#,
            dir = dir.display()
        );
        let path = dir.join("rec.sh");
        std::fs::write(&path, script).expect("write rec.sh");
        lookout_testsupport::install_executable(&path, &dir.join("record")).expect("record");
        // createContainer runs a static program only: a shim that runs the
        // script with a busybox at the same path in the host and in the
        // container.
        let shim = bundle::static_shim(parent);
        lookout_testsupport::install_executable(&shim, &dir.join("shim")).expect("shim");
        let busybox = lookout_testsupport::find_program("busybox").expect("busybox");
        lookout_testsupport::install_executable(&busybox, &dir.join("busybox")).expect("busybox");
        Recorder { dir }
    }

    fn program(&self) -> String {
        self.dir.join("record").to_str().expect("utf-8").to_owned()
    }

    /// A hooks.d file `name` running the recorder for `stage` (recorded
    /// under `tag`), for containers annotated `lookout-test: <test>`.
    fn hook_file(&self, hooks: &Path, name: &str, stage: &str, tag: &str, test: &str) {
        let (path, mut args) = if stage == "createContainer" {
            let d = |f: &str| json!(self.dir.join(f));
            (
                self.dir.join("shim"),
                vec![json!("shim"), d("busybox"), d("rec.sh"), json!(tag)],
            )
        } else {
            (
                PathBuf::from(self.program()),
                vec![json!("record"), json!(tag)],
            )
        };
        if tag.ends_with("-fail") {
            args.push(json!("fail"));
        }
        std::fs::write(
            hooks.join(name),
            json!({
                "version": "1.0.0",
                "hook": {"path": path, "args": args},
                "when": {"annotations": {"^lookout-test$": format!("^{test}$")}},
                "stages": [stage],
            })
            .to_string(),
        )
        .expect("write hook file");
    }

    /// The record of `tag` for container `id`, waited for.
    fn record(&self, tag: &str, id: &str) -> BTreeMap<String, String> {
        let path = self.dir.join(format!("{tag}.{id}"));
        wait_until(
            Duration::from_secs(15),
            || path.exists(),
            || format!("no {tag} record for {id}"),
        );
        let text = std::fs::read_to_string(&path).expect("read record");
        let mut r: BTreeMap<String, String> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let stamp = PathBuf::from(format!("{}.t", path.display()));
        r.insert("t".into(), read_stamp(&stamp).to_string());
        r
    }

    fn has(&self, tag: &str, id: &str) -> bool {
        self.dir.join(format!("{tag}.{id}")).exists()
    }

    /// `config` gets the records' directory at the same path.
    fn mount_into(&self, config: &mut serde_json::Value) {
        let d = self.dir.to_str().expect("utf-8");
        config["mounts"].as_array_mut().expect("mounts").push(
            json!({"destination": d, "source": d, "type": "bind", "options": ["rbind", "rw"]}),
        );
    }
}

fn wait_until(timeout: Duration, cond: impl Fn() -> bool, what: impl Fn() -> String) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "{}", what());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn mnt_of(pid: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/mnt"))
        .expect("read a mount namespace")
        .to_string_lossy()
        .into_owned()
}

#[test]
fn every_stage_runs_at_its_point_in_its_namespaces_with_runcs_state() {
    const TEST: &str = "hook_stages";
    if !ready(TEST) || !require_program(TEST, "gcc") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let rec = Recorder::new(d);
    let hooks = d.join("hooks.d");
    std::fs::create_dir_all(&hooks).expect("mkdir");
    for (name, stage) in [
        ("10-prestart.json", "prestart"),
        ("20-createRuntime.json", "createRuntime"),
        ("30-createContainer.json", "createContainer"),
        ("40-startContainer.json", "startContainer"),
        ("50-poststart.json", "poststart"),
        ("60-poststop.json", "poststop"),
    ] {
        rec.hook_file(&hooks, name, stage, stage, TEST);
    }
    // A legacy oci-hooks(5) 0.1.0 file: `hook` a string, `arguments`
    // after it, annotations matched by value.
    std::fs::write(
        hooks.join("70-legacy.json"),
        json!({
            "hook": rec.program(),
            "arguments": ["legacy"],
            "annotations": [format!("^{TEST}$")],
            "stage": ["prestart"],
        })
        .to_string(),
    )
    .expect("write the 0.1.0 file");
    let agent = Agent::start(&rt, &["--hooks-dir", hooks.to_str().expect("utf-8")]);
    let id = id("stages");
    let b = bundle::busybox(&d.join("b"), &["sleep", "30"], |c| {
        c["annotations"] = json!({"lookout-test": TEST});
        rec.mount_into(c);
    });
    let pid_file = d.join("init.pid");
    rt.ok(&[
        "create",
        "--bundle",
        b.to_str().expect("utf-8"),
        "--pid-file",
        pid_file.to_str().expect("utf-8"),
        &id,
    ]);
    let init = std::fs::read_to_string(&pid_file)
        .expect("pid file")
        .trim()
        .to_owned();
    let container_mnt = mnt_of(&init);
    let host_mnt = mnt_of("self");
    assert_ne!(container_mnt, host_mnt);
    rt.ok(&["start", &id]);
    let poststart = rec.record("poststart", &id);
    rt.cleanup(&id);
    let poststop = rec.record("poststop", &id);

    let r = |tag: &str| rec.record(tag, &id);
    let (pre, crt, cc, sc) = (
        r("prestart"),
        r("createRuntime"),
        r("createContainer"),
        r("startContainer"),
    );
    let show = format!(
        "{pre:?}\n{crt:?}\n{cc:?}\n{sc:?}\n{poststart:?}\n{poststop:?}\n{}",
        agent.log()
    );
    // Where each ran: the host's mount namespace, or the container's.
    assert_eq!(pre["mnt"], host_mnt, "{show}");
    assert_eq!(crt["mnt"], host_mnt, "{show}");
    assert_eq!(cc["mnt"], container_mnt, "{show}");
    assert_eq!(sc["mnt"], container_mnt, "{show}");
    assert_eq!(poststart["mnt"], host_mnt, "{show}");
    assert_eq!(poststop["mnt"], host_mnt, "{show}");
    // The State runc passes at each stage: the host's pid outside, the
    // container's own (1) inside, none once stopped.
    assert_eq!(
        (pre["status"].as_str(), pre["pid"].as_str()),
        ("creating", init.as_str()),
        "{show}"
    );
    assert_eq!(
        (crt["status"].as_str(), crt["pid"].as_str()),
        ("creating", init.as_str()),
        "{show}"
    );
    assert_eq!(
        (cc["status"].as_str(), cc["pid"].as_str()),
        ("creating", "1"),
        "{show}"
    );
    assert_eq!(
        (sc["status"].as_str(), sc["pid"].as_str()),
        ("created", "1"),
        "{show}"
    );
    assert_eq!(
        (poststart["status"].as_str(), poststart["pid"].as_str()),
        ("running", init.as_str()),
        "{show}"
    );
    assert_eq!(
        (poststop["status"].as_str(), poststop["pid"].as_str()),
        ("stopped", ""),
        "{show}"
    );
    // startContainer runs as the container's process: its uid and
    // capabilities (runc's defaults, far from root's full set), and
    // no_new_privs.
    let status = std::fs::read_to_string(format!("/proc/{init}/status")).expect("init status");
    let init_cap = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(str::trim)
        .expect("CapEff");
    assert_eq!(sc["cap"], init_cap, "{show}");
    assert_eq!(sc["nnp"], "1", "{show}");
    assert_eq!(sc["uid"], "0", "{show}");
    assert_ne!(sc["cap"], cc["cap"], "createContainer runs as root: {show}");
    // poststart: the container's process had exec'd its program (runc's
    // init is a copy of runc; the program is the rootfs's busybox).
    let exe = poststart.get("exe").map(String::as_str).unwrap_or_default();
    assert!(
        exe.ends_with("/bin/busybox") && !exe.contains("runc"),
        "{show}"
    );
    let t = |m: &BTreeMap<String, String>| m["t"].parse::<u64>().expect("stamp");
    // The 0.1.0 file ran with the prestart hooks: after 10-prestart, before
    // every createRuntime hook (runc runs all of one stage, then the next).
    let legacy = r("legacy");
    assert_eq!(legacy["mnt"], host_mnt, "{show}");
    assert_eq!(legacy["status"], "creating", "{show}");
    assert!(
        t(&pre) < t(&legacy) && t(&legacy) < t(&crt),
        "{legacy:?}\n{show}"
    );
    // In the runtime spec's order.
    let order = [&pre, &crt, &cc, &sc, &poststart, &poststop].map(t);
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}\n{show}");
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn a_failing_create_container_hook_stops_the_container_and_poststop_still_runs() {
    const TEST: &str = "hook_fails";
    if !ready(TEST) || !require_program(TEST, "gcc") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let rec = Recorder::new(d);
    let hooks = d.join("hooks.d");
    std::fs::create_dir_all(&hooks).expect("mkdir");
    rec.hook_file(
        &hooks,
        "30-cc.json",
        "createContainer",
        "createContainer-fail",
        TEST,
    );
    rec.hook_file(
        &hooks,
        "40-sc.json",
        "startContainer",
        "startContainer",
        TEST,
    );
    rec.hook_file(&hooks, "60-poststop.json", "poststop", "poststop", TEST);
    let ran = |id: &str| rec.dir.join(format!("ran.{id}"));
    let container = |name: &str, id: &str| {
        let ran = ran(id);
        let ran = ran.to_str().expect("utf-8").to_owned();
        bundle::busybox(&d.join(name), &["touch", &ran], |c| {
            c["annotations"] = json!({"lookout-test": TEST});
            rec.mount_into(c);
        })
    };

    // The default: the start is refused, nothing of the container runs.
    let agent = Agent::start(&rt, &["--hooks-dir", hooks.to_str().expect("utf-8")]);
    let id = id("hookfail");
    let b = container("b", &id);
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    // The exec of `runc start` itself is refused (EPERM).
    match rt.command().args(["start", &id]).output() {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}"),
        Ok(out) => assert!(
            !out.status.success(),
            "runc start went on:\n{}",
            agent.log()
        ),
    }
    let removed = agent.wait_event(&id, "removed", Duration::from_secs(10));
    let reason = removed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("denied by hooks: createContainer hook 30-cc.json: exit 3"),
        "{removed}"
    );
    assert!(rec.has("createContainer-fail", &id));
    assert!(
        !rec.has("startContainer", &id),
        "a hook after the failing one ran"
    );
    let poststop = rec.record("poststop", &id);
    assert_eq!(poststop["status"], "stopped");
    assert!(!ran(&id).exists(), "the container's command ran");
    rt.cleanup(&id);
    let m = agent.metrics();
    assert_eq!(
        metric(
            &m,
            "lookout_hooks_total{stage=\"createContainer\",outcome=\"failed\"}"
        ),
        Some(1.0),
        "{m}"
    );
    let _ = agent.stop();

    // --hook-failure warn: logged and counted, and the container runs.
    let agent = Agent::start(
        &rt,
        &[
            "--hooks-dir",
            hooks.to_str().expect("utf-8"),
            "--hook-failure",
            "warn",
        ],
    );
    let id = format!("{id}-warn");
    let b = container("w", &id);
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    rt.ok(&["start", &id]);
    wait_until(
        Duration::from_secs(10),
        || ran(&id).exists(),
        || format!("the container never ran:\n{}", agent.log()),
    );
    assert!(rec.has("createContainer-fail", &id));
    agent.wait_event(&id, "removed", Duration::from_secs(10));
    rt.cleanup(&id);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("--hook-failure warn"), "{log}");
}
