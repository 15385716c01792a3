//! `lookout probe` as a user runs it: the real binary, as root, with
//! restrictions (seccomp, dropped capabilities) applied to it the way a
//! locked-down node would.

use std::process::Command;

use lookout_testsupport::{Restrictions, cap, in_ci, require_root, skip};
use serde_json::Value;

fn lookout() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lookout"));
    // A node without a cluster unless a test says otherwise.
    for var in [
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "KUBECONFIG",
        "NODE_NAME",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("HOME", "/nonexistent");
    cmd
}

/// Runs `lookout probe -o json` with `restrictions`; asserts exit 0 and
/// returns the parsed report.
fn probe_json(restrictions: Restrictions, env: &[(&str, &str)]) -> Value {
    let mut cmd = lookout();
    cmd.args(["probe", "-o", "json"]).envs(env.iter().copied());
    restrictions.apply(&mut cmd).expect("apply restrictions");
    let out = cmd.output().expect("run lookout probe");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "lookout probe failed: {:?}\n{stderr}",
        out.status
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "probe --json printed invalid JSON: {e}\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn check<'a>(report: &'a Value, name: &str) -> (&'a str, &'a str) {
    let c = report["checks"]
        .as_array()
        .expect("checks array")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {report}"));
    (
        c["status"].as_str().expect("status"),
        c["detail"].as_str().expect("detail"),
    )
}

fn refused(report: &Value, mode: &str) -> String {
    report["refused"]
        .as_array()
        .expect("refused array")
        .iter()
        .find(|r| r["mode"] == mode)
        .and_then(|r| r["reason"].as_str())
        .unwrap_or_else(|| panic!("{mode} not refused in {report}"))
        .to_owned()
}

#[test]
fn picks_fanotify_ebpf_on_this_machine() {
    if !require_root("picks_fanotify_ebpf_on_this_machine") {
        return;
    }
    let report = probe_json(Restrictions::new(), &[]);
    if check(&report, "bpf:object").0 != "ok" && !in_ci() {
        skip(
            "picks_fanotify_ebpf_on_this_machine",
            "agent built without `cargo xtask build-ebpf`",
        );
        return;
    }
    for name in [
        "fanotify:init",
        "fanotify:exec-permission-mark",
        "fanotify:report-tid",
        "fanotify:report-dfid-name",
        "bpf:object",
        "bpf:btf",
        "bpf:ringbuf",
        "bpf:tracepoint",
        "namespace:pid",
        "capability:CAP_SYS_ADMIN",
    ] {
        let (status, detail) = check(&report, name);
        assert_eq!(status, "ok", "{name}: {detail}");
    }
    assert_eq!(report["mode"], "fanotify-ebpf", "{report}");
    assert_eq!(report["refused"], serde_json::json!([]));
    let (status, detail) = check(&report, "kubernetes:config");
    assert_eq!(status, "unsupported", "{detail}");
}

fn fanotify_denied(errno: i32, name: &str) {
    if !require_root(&format!("fanotify_init_{name}")) {
        return;
    }
    let report = probe_json(
        Restrictions::new().deny_syscall(libc::SYS_fanotify_init, errno),
        &[],
    );
    let (status, detail) = check(&report, "fanotify:init");
    assert_eq!(status, "unsupported");
    assert!(
        detail.contains(name),
        "fanotify:init detail should name {name}: {detail}"
    );
    assert_eq!(
        check(&report, "fanotify:exec-permission-mark").0,
        "unsupported"
    );
    assert_eq!(report["mode"], "scan", "{report}");
    for mode in ["fanotify-ebpf", "fanotify"] {
        let reason = refused(&report, mode);
        assert!(
            reason.contains(&format!("fanotify_init: {name}")),
            "{mode}: {reason}"
        );
    }
    assert!(refused(&report, "podinformer").contains("no cluster"));
}

#[test]
fn fanotify_init_enosys_falls_back() {
    fanotify_denied(libc::ENOSYS, "ENOSYS");
}

#[test]
fn fanotify_init_eperm_falls_back() {
    fanotify_denied(libc::EPERM, "EPERM");
}

#[test]
fn fanotify_init_eperm_with_a_cluster_picks_the_informer() {
    if !require_root("fanotify_init_eperm_with_a_cluster_picks_the_informer") {
        return;
    }
    let dir = tempfile_dir();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, "apiVersion: v1\nkind: Config\n").expect("write kubeconfig");
    let kc = kubeconfig.to_str().expect("utf-8 path");
    let report = probe_json(
        Restrictions::new().deny_syscall(libc::SYS_fanotify_init, libc::EPERM),
        &[("KUBECONFIG", kc), ("NODE_NAME", "node-a")],
    );
    assert_eq!(report["mode"], "podinformer", "{report}");
    assert_eq!(check(&report, "kubernetes:node-name"), ("ok", "node-a"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn without_cap_sys_admin_fanotify_is_refused() {
    if !require_root("without_cap_sys_admin_fanotify_is_refused") {
        return;
    }
    let report = probe_json(Restrictions::new().drop_capability(cap::SYS_ADMIN), &[]);
    let (status, detail) = check(&report, "capability:CAP_SYS_ADMIN");
    assert_eq!(status, "unsupported", "{detail}");
    let (status, detail) = check(&report, "fanotify:init");
    assert_eq!(status, "unsupported");
    assert!(
        detail.contains("EPERM") && detail.contains("CAP_SYS_ADMIN"),
        "{detail}"
    );
    assert_eq!(report["mode"], "scan", "{report}");
    assert!(refused(&report, "fanotify-ebpf").contains("EPERM"));
}

#[test]
fn text_output_is_a_table_and_exits_zero() {
    if !require_root("text_output_is_a_table_and_exits_zero") {
        return;
    }
    let mut cmd = lookout();
    cmd.arg("probe");
    Restrictions::new()
        .deny_syscall(libc::SYS_fanotify_init, libc::ENOSYS)
        .apply(&mut cmd)
        .expect("restrict");
    let out = cmd.output().expect("run");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("CHECK"), "{text}");
    assert!(text.contains("mode: scan"), "{text}");
    assert!(
        text.contains("refused fanotify-ebpf: fanotify_init: ENOSYS"),
        "{text}"
    );
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("discovery mode scan"), "{log}");
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lookout-probe-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

/// The command line's conventions: exit 2 for a log filter that does not
/// parse (with the variable named), `RUST_LOG` when `LOOKOUT_LOG` is unset,
/// JSON log lines on request, and `--json` kept as `-o json`. Needs no root.
#[test]
fn log_filters_formats_and_exit_codes() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = lookout();
        cmd.env_remove("LOOKOUT_LOG").env_remove("RUST_LOG");
        cmd.args(args).envs(env.iter().copied());
        cmd.output().expect("run lookout")
    };
    let bad = run(&["probe"], &[("LOOKOUT_LOG", "info,[")]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("LOOKOUT_LOG") && err.contains("not a log filter"),
        "{err}"
    );
    let bad = run(&["probe"], &[("RUST_LOG", "=[")]);
    assert_eq!(bad.status.code(), Some(2), "RUST_LOG is read too: {bad:?}");
    // LOOKOUT_LOG wins over RUST_LOG.
    let quiet = run(&["probe"], &[("LOOKOUT_LOG", "error"), ("RUST_LOG", "=[")]);
    assert_eq!(quiet.status.code(), Some(0), "{quiet:?}");
    // JSON log lines: the probe's summary line is one object.
    let json = run(&["--log-format", "json", "probe", "-o", "json"], &[]);
    assert!(json.status.success(), "{json:?}");
    let line = String::from_utf8_lossy(&json.stderr)
        .lines()
        .last()
        .map(str::to_owned)
        .expect("a log line");
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["level"], "INFO", "{v}");
    // `--json` and `-o json` print the same report (modulo what changes
    // between two probes, which the checks' names do not).
    let names = |out: &std::process::Output| -> Vec<String> {
        let v: Value = serde_json::from_slice(&out.stdout).expect("report");
        v["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    let old = run(&["probe", "--json"], &[]);
    assert!(old.status.success());
    assert_eq!(names(&old), names(&json));
    let both = run(&["probe", "--json", "-o", "text"], &[]);
    assert_eq!(
        both.status.code(),
        Some(2),
        "one spelling at a time: {both:?}"
    );
}

/// The argv the BPF program records, against the argv given: empty
/// arguments keep their place, an argument longer than a slot is cut to
/// 255 bytes, and the rest follow. The program's loop is shaped for the
/// verifier (no branch that stays in the loop), so its byte arithmetic is
/// checked here, on the real kernel. N.B. for an empty string the helper
/// returns 1 on recent kernels but 0 on older ones (`strncpy_from_user_nofault`
/// counted the NUL only after a non-empty string): the program's "at least
/// one byte" matters there, and this machine's kernel cannot tell.
#[test]
fn bpf_argv_capture_keeps_empty_and_long_arguments_in_place() {
    let test = "bpf_argv_capture_keeps_empty_and_long_arguments_in_place";
    if !require_root(test) {
        return;
    }
    let object: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lookout-ebpf.o"));
    if object.is_empty() {
        skip(
            test,
            "the agent was built without its BPF object (cargo xtask build-ebpf)",
        );
        return;
    }
    // A name of its own: every loaded capture records execs of its names,
    // whatever other test loaded it.
    let dir = tempfile::tempdir().expect("tempdir");
    let name = format!("lkargv{}", std::process::id());
    let exe = dir.path().join(&name);
    lookout_testsupport::install_executable(std::path::Path::new("/bin/true"), &exe)
        .expect("copy /bin/true");
    let mut capture = lookout_runtime_hook::ExecCapture::load(object, std::slice::from_ref(&name))
        .expect("load the argv capture");
    // The argv loop is shaped for the verifier (see the BPF crate's
    // README): a branch that stays in it multiplied the verified
    // instructions by 18 and start-up by 2.5, and loading still succeeded.
    // The kernel counts them per program (5.16 and later).
    let counts: Vec<u64> = std::fs::read_dir("/proc/self/fdinfo")
        .expect("fdinfo")
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("verified_insns:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .collect();
    if let Some(most) = counts.iter().max() {
        assert!(
            *most < 20_000,
            "a BPF program of this process took {most} verified instructions (9,713 per argv program at de6f826): {counts:?}"
        );
    }
    let mut ring = capture.take_ring().expect("the ring");
    let long = "x".repeat(300);
    let args = ["a", "", "bc", "", long.as_str(), "", "end"];
    let mut child = Command::new(&exe).args(args).spawn().expect("run");
    // The record is written at syscall entry, by the child's only thread:
    // its thread id is the child's pid.
    let pid = child.id();
    assert!(child.wait().expect("wait").success());
    let record = wait_record(&mut ring, pid, &name);
    let mut want = vec![exe.to_string_lossy().into_owned()];
    want.extend(args.iter().map(|a| {
        if a.len() > 255 {
            a[..255].to_owned()
        } else {
            (*a).to_owned()
        }
    }));
    assert_eq!(record.argv, want);
    assert!(!record.truncated, "{record:?}");
    assert_eq!(record.tgid, pid);

    // Records are as long as their argv: one that fills the argument area
    // (and is cut), then a short one, back to back in the ring, each read
    // whole and in its place.
    let wide: Vec<String> = (0..40)
        .map(|i| format!("{i:03}{}", "w".repeat(140)))
        .collect();
    let mut pids = Vec::new();
    for argv in [wide.clone(), vec!["after".to_owned()]] {
        let mut child = Command::new(&exe).args(&argv).spawn().expect("run");
        pids.push((child.id(), argv));
        assert!(child.wait().expect("wait").success());
    }
    for (i, (pid, argv)) in pids.into_iter().enumerate() {
        let record = wait_record(&mut ring, pid, &name);
        assert_eq!(record.argv[0], exe.to_string_lossy());
        if i == 0 {
            // 4096 bytes of arguments hold the path and 27 of these.
            assert!(record.truncated, "{record:?}");
            let kept = &record.argv[1..];
            assert!(kept.len() >= 20 && kept.len() < argv.len(), "{kept:?}");
            // The last one kept is cut at the area's end.
            let (last, whole) = kept.split_last().expect("arguments kept");
            assert_eq!(whole, &argv[..whole.len()]);
            assert!(argv[whole.len()].starts_with(last.as_str()), "{last}");
        } else {
            assert!(!record.truncated, "{record:?}");
            assert_eq!(record.argv[1..], argv[..]);
        }
    }

    // Short records take little room: 200 runtime execs that user space
    // has not read yet all fit (whole records, 4.6 KiB each, filled the
    // ring at 56).
    let mut unread = Vec::new();
    for i in 0..200 {
        let mut child = Command::new(&exe)
            .arg(format!("burst-{i}"))
            .spawn()
            .expect("run");
        unread.push(child.id());
        assert!(child.wait().expect("wait").success());
    }
    let lost: Vec<u32> = unread
        .into_iter()
        .filter(|pid| ring.take(*pid).is_none())
        .collect();
    assert!(lost.is_empty(), "records lost from the ring: {lost:?}");
    assert_eq!(ring.waiting(), 0, "every record was taken");

    // Run by name, through a PATH search: execvp tries each directory in
    // turn, and each try is an exec the programs record, by the same
    // thread. The last try is the exec that happened; the others must not
    // stay behind (one orphan per directory per exec, before 0d0fdcd).
    let mut path: Vec<std::path::PathBuf> = (0..8)
        .map(|i| dir.path().join(format!("empty{i}")))
        .collect();
    for d in &path {
        std::fs::create_dir(d).expect("mkdir");
    }
    path.push(dir.path().to_path_buf());
    let path = std::env::join_paths(&path).expect("PATH");
    for _ in 0..5 {
        let mut child = Command::new(&name)
            .env("PATH", &path)
            .arg("by-name")
            .spawn()
            .expect("run by name");
        let pid = child.id();
        assert!(child.wait().expect("wait").success());
        let record = wait_record(&mut ring, pid, &format!("{name}, by name"));
        assert_eq!(record.filename, exe.to_string_lossy(), "{record:?}");
        assert_eq!(
            ring.waiting(),
            0,
            "the PATH search's other tries stayed behind"
        );
    }

    // Root in a pid namespace of its own (a container's, without a user
    // namespace) is uid 0 too, and is not recorded: only the node's pid
    // namespace is. The shell learns its pid on the node from the node's
    // /proc (its own `/proc/self` there), then becomes the binary.
    if !lookout_testsupport::require_program(test, "unshare") {
        return;
    }
    let pid_file = dir.path().join("pid");
    let script = format!(
        "read -r s _ < /proc/self/stat; echo \"$s\" > {}; exec {} in-a-pid-namespace",
        pid_file.display(),
        exe.display()
    );
    let st = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "/bin/sh", "-c", &script])
        .status()
        .expect("unshare");
    assert!(st.success(), "{st}");
    let nested: u32 = std::fs::read_to_string(&pid_file)
        .expect("the pid file")
        .trim()
        .parse()
        .expect("a pid");
    // Then one in the node's namespace: once its record is read, any record
    // of the earlier exec would have been read too.
    let mut child = Command::new(&exe).arg("on-the-node").spawn().expect("run");
    let after = child.id();
    assert!(child.wait().expect("wait").success());
    lookout_testsupport::wait_until(
        std::time::Duration::from_secs(10),
        || ring.take(after).is_some(),
        || format!("no argv record of pid {after} ({name}) in 10 s"),
    );
    assert_eq!(
        ring.take(nested).map(|r| r.argv),
        None,
        "an exec in another pid namespace was recorded"
    );
}

/// The record of `pid` (an exec of `name`), waited for up to 10 s.
fn wait_record(
    ring: &mut lookout_runtime_hook::ArgvRing,
    pid: u32,
    name: &str,
) -> lookout_runtime_hook::ExecRecord {
    let mut record = None;
    lookout_testsupport::wait_until(
        std::time::Duration::from_secs(10),
        || {
            record = ring.take(pid);
            record.is_some()
        },
        || format!("no argv record of pid {pid} ({name}) in 10 s"),
    );
    record.expect("waited for")
}
