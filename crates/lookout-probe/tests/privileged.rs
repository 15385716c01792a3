//! Probe tests against the real kernel. They need root; without it they
//! print SKIPPED (and fail under CI).

use std::process::Command;
use std::time::{Duration, Instant};

use lookout_probe::{Mode, ProbeOptions, Status, probe};
use lookout_testsupport::require_root;

/// The tests share one process; the fd-leak test counts the process's fds,
/// so the tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn no_cluster() -> ProbeOptions<'static> {
    ProbeOptions::new().env(|k| match k {
        "PATH" => std::env::var(k).ok(),
        _ => None,
    })
}

fn open_fds() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn missing_bpf_object_is_reported_and_fanotify_is_chosen() {
    if !require_root("missing_bpf_object_is_reported_and_fanotify_is_chosen") {
        return;
    }
    let _serial = serial();
    let report = probe(&no_cluster().bpf_object(None));
    let object = report.check("bpf:object").expect("bpf:object check");
    assert_eq!(object.status, Status::Unsupported);
    assert!(
        object.detail.contains("cargo xtask build-ebpf"),
        "{}",
        object.detail
    );
    assert_eq!(
        report.check("fanotify:init").map(|c| c.status),
        Some(Status::Ok)
    );
    assert_eq!(report.mode, Mode::Fanotify, "{report}");
    assert_eq!(report.refused.len(), 1);
    assert_eq!(report.refused[0].mode, Mode::FanotifyEbpf);
    assert!(report.refused[0].reason.contains("BPF object missing"));
}

#[test]
fn garbage_bpf_object_is_an_error_not_a_crash() {
    if !require_root("garbage_bpf_object_is_an_error_not_a_crash") {
        return;
    }
    let _serial = serial();
    let junk = vec![0x7fu8; 256];
    let report = probe(&no_cluster().bpf_object(Some(&junk)));
    assert_eq!(
        report.check("bpf:ringbuf").map(|c| c.status),
        Some(Status::Unsupported)
    );
    assert_eq!(report.mode, Mode::Fanotify);
}

#[test]
fn probing_leaves_no_fds_behind() {
    if !require_root("probing_leaves_no_fds_behind") {
        return;
    }
    let _serial = serial();
    // Warm up lazily opened fds (e.g. of the allocator or std) first.
    let _ = probe(&no_cluster());
    let before = open_fds();
    for _ in 0..3 {
        let _ = probe(&no_cluster());
    }
    let after = open_fds();
    assert_eq!(before, after, "fds leaked by probe()");
}

#[test]
fn probing_never_blocks_runtime_execs() {
    if !require_root("probing_never_blocks_runtime_execs") {
        return;
    }
    let _serial = serial();
    let report = probe(&no_cluster());
    let Some(runtime) = report.runtimes.first().map(|r| r.resolved.clone()) else {
        lookout_testsupport::skip(
            "probing_never_blocks_runtime_execs",
            "no runtime binary installed",
        );
        return;
    };
    // Exec the runtime in a loop from a separate process while probing
    // (and marking it) again and again. N.B. the loop is started before the
    // first probe, so it holds none of the probe's fanotify fds. A stuck
    // exec would keep the loop from seeing the stop file: it must finish.
    // The loop touches `started` after its first exec, and the probes wait
    // for it: every probe then runs while the loop is execing.
    let dir = tempfile::tempdir().expect("tempdir");
    let stop = dir.path().join("stop");
    let started = dir.path().join("started");
    let script = format!(
        "n=0; while [ ! -e {stop} ]; do {rt} --version >/dev/null || exit 1; n=$((n+1)); \
         [ $n -ne 1 ] || : > {started}; done; echo $n",
        stop = stop.display(),
        started = started.display(),
        rt = runtime.display()
    );
    let mut looper = Command::new("sh")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn exec loop");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !started.exists() {
        if let Some(status) = looper.try_wait().expect("try_wait") {
            panic!("the exec loop ended before probing: {status:?}");
        }
        if Instant::now() > deadline {
            let _ = looper.kill();
            let _ = looper.wait();
            panic!("the exec loop's first exec did not end within 10 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for _ in 0..10 {
        let _ = probe(&no_cluster());
    }
    std::fs::write(&stop, b"").expect("stop file");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = looper.try_wait().expect("try_wait") {
            assert!(status.success(), "a runtime exec failed while probing");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "runtime execs got stuck while probing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut count = String::new();
    std::io::Read::read_to_string(&mut looper.stdout.take().expect("stdout"), &mut count)
        .expect("read");
    let n: u32 = count.trim().parse().expect("exec count");
    assert!(n > 0, "no exec ran during the probes");
}
