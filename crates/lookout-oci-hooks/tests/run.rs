//! Running real hook programs (/bin/sh scripts): stdin, args, env, cwd,
//! exit codes, timeouts that kill the whole group, bounded output.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use lookout_model::{Container, RuntimeKind, Source};
use lookout_oci_hooks::oci_spec::runtime::{ContainerState, Hook, HookBuilder};
use lookout_oci_hooks::{Error, RunOptions, run_hook, state_of};

fn sh(script: &str) -> Hook {
    HookBuilder::default()
        .path("/bin/sh")
        .args(vec![
            "hook-sh".to_owned(),
            "-c".to_owned(),
            script.to_owned(),
        ])
        .env(vec![
            "FOO=bar baz".to_owned(),
            "PATH=/usr/bin:/bin".to_owned(),
        ])
        .build()
        .expect("hook")
}

fn state() -> lookout_oci_hooks::oci_spec::runtime::State {
    let mut c = Container::new("c-42", RuntimeKind::Runc);
    c.pid = Some(4242);
    c.bundle = Some("/run/bundle".into());
    c.annotations.insert("k".into(), "v".into());
    state_of(&c, ContainerState::Created, Source::RuntimeHook, false).expect("state")
}

#[tokio::test]
async fn the_state_arrives_on_stdin_with_args_env_and_cwd() {
    let d = tempfile::tempdir().expect("tempdir");
    let out = d.path().join("state.json");
    let hook = sh(&format!(
        "cat > {}; echo \"argv0=$0 foo=$FOO home=${{HOME:-unset}} cwd=$(pwd)\"; echo oops >&2; exit 3",
        out.display()
    ));
    let mut opts = RunOptions::default();
    opts.cwd = d.path().to_path_buf();
    let o = run_hook(&hook, &state(), &opts).await.expect("ran");
    assert_eq!(o.status.and_then(|s| s.code()), Some(3));
    assert!(!o.success());
    assert_eq!(o.describe(), "exit 3");
    let cwd = d.path().canonicalize().expect("canonical");
    assert_eq!(
        o.stdout.trim(),
        format!("argv0=hook-sh foo=bar baz home=unset cwd={}", cwd.display())
    );
    assert_eq!(o.stderr.trim(), "oops");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).expect("state file")).expect("JSON");
    assert_eq!(v["id"], "c-42");
    assert_eq!(v["status"], "created");
    assert_eq!(v["pid"], 4242);
    assert_eq!(v["bundle"], "/run/bundle");
    assert_eq!(v["annotations"]["k"], "v");
}

#[tokio::test]
async fn a_hanging_hook_and_its_children_are_killed_at_the_timeout() {
    let d = tempfile::tempdir().expect("tempdir");
    let pidfile = d.path().join("child.pid");
    let hook = sh(&format!("sleep 30 & echo $! > {}; wait", pidfile.display()));
    let mut opts = RunOptions::default();
    // 2 s: long enough for the hook to have written its child's pid on a
    // loaded 2-core VM before it is killed (300 ms was not, surely).
    opts.default_timeout = Duration::from_secs(2);
    let t = Instant::now();
    let o = run_hook(&hook, &state(), &opts).await.expect("ran");
    assert!(o.timed_out, "{o:?}");
    // Killed at 2 s; a hook never killed would run until its `sleep 30`
    // ends. 10 s tells the two apart with room for load.
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(o.describe().starts_with("timed out"), "{}", o.describe());
    let child: i32 = std::fs::read_to_string(&pidfile)
        .expect("pid file (written by the hook before its timeout)")
        .trim()
        .parse()
        .expect("pid");
    // The grandchild was in the hook's process group: it is gone too (it
    // may linger as a zombie of init for a moment).
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
        let gone = stat.is_empty() || stat.contains(") Z");
        if gone {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the hook's child survived: {stat}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Its own timeout wins over the default.
    let mut quick = sh("sleep 5");
    quick.set_timeout(Some(1));
    let o = run_hook(&quick, &state(), &RunOptions::default())
        .await
        .expect("ran");
    assert!(o.timed_out && o.duration < Duration::from_secs(3), "{o:?}");
}

#[tokio::test]
async fn output_is_bounded_and_hooks_that_ignore_stdin_do_not_block() {
    let hook =
        sh("head -c 300000 /dev/zero | tr '\\0' x; head -c 300000 /dev/zero | tr '\\0' y >&2");
    let mut opts = RunOptions::default();
    opts.output_limit = 1000;
    let o = run_hook(&hook, &state(), &opts).await.expect("ran");
    assert!(o.success(), "{o:?}");
    assert!(o.truncated);
    assert_eq!(o.stdout.len(), 1000);
    assert_eq!(o.stderr.len(), 1000);
    assert!(o.stdout.bytes().all(|b| b == b'x'));
}

#[tokio::test]
async fn a_missing_program_is_an_error_naming_it() {
    let hook = HookBuilder::default()
        .path("/nonexistent/hook")
        .build()
        .expect("hook");
    let e = run_hook(&hook, &state(), &RunOptions::default())
        .await
        .expect_err("missing");
    assert!(matches!(e, Error::Spawn { .. }));
    assert_eq!(e.to_string(), "cannot start hook /nonexistent/hook");
    // The cause follows once, from the chain.
    let chain = lookout_model::Chain(&e).to_string();
    assert!(
        chain.starts_with("cannot start hook /nonexistent/hook: No such file"),
        "{chain}"
    );
    assert_eq!(chain.matches("No such file").count(), 1, "{chain}");
}

#[tokio::test]
async fn chosen_fds_are_closed_in_the_hook() {
    let f = std::fs::File::open("/dev/null").expect("open");
    // Clear CLOEXEC so that, unless closed on purpose, the hook would
    // inherit it.
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on an fd we own.
    unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    let check = sh(&format!(
        "test -e /proc/self/fd/{fd} && echo open || echo closed"
    ));
    let o = run_hook(&check, &state(), &RunOptions::default())
        .await
        .expect("ran");
    assert_eq!(
        o.stdout.trim(),
        "open",
        "the control: inherited without close_fds"
    );
    let mut opts = RunOptions::default();
    opts.close_fds = vec![fd];
    let o = run_hook(&check, &state(), &opts).await.expect("ran");
    assert_eq!(o.stdout.trim(), "closed");
    drop(f);
}

/// Root, or a loud skip (a failure under CI, where root is given).
fn root_or_skip(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{test} needs root, and CI runs as root"
    );
    eprintln!("!!! SKIPPED {test}: needs root (chroot)");
    false
}

/// An agent chrooted in the host's mount namespace (a chroot, systemd's
/// `RootDirectory=`, the `cargo xtask vm-test` guests): a hook for the
/// host runs in the host process's root, not the agent's. Here the roles
/// are turned around: the test is the agent, and a chrooted busybox is
/// "the host's" process.
#[tokio::test]
async fn a_hook_runs_in_the_root_of_the_process_it_runs_for() {
    if !root_or_skip("a_hook_runs_in_the_root_of_the_process_it_runs_for") {
        return;
    }
    let d = tempfile::tempdir().expect("tempdir");
    let r = d.path();
    std::fs::create_dir_all(r.join("bin")).expect("bin");
    // Copied by cp(1): a copy written from this process could still be open
    // for writing in a child another test forks, and then fail to exec
    // with ETXTBSY (docs/testing.md, flakes).
    let copied = std::process::Command::new("cp")
        .arg("/bin/busybox")
        .arg(r.join("bin/busybox"))
        .status()
        .expect("cp");
    assert!(copied.success(), "busybox-static is installed");
    std::os::unix::fs::symlink("/bin/busybox", r.join("bin/sh")).expect("sh");
    let mut other = std::process::Command::new("chroot")
        .arg(r)
        .args(["/bin/busybox", "sleep", "30"])
        .spawn()
        .expect("chroot");
    let pid = other.id();
    // Wait (with a deadline) until the child has entered its root.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_link(format!("/proc/{pid}/root"))
        .ok()
        .as_deref()
        != Some(r)
    {
        assert!(
            Instant::now() < deadline,
            "the child never entered {}",
            r.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let marker = format!("/lk-hook-root-{}", std::process::id());
    let mut opts = RunOptions::default();
    opts.namespaces_of = Some(pid);
    // busybox picks its applet by argv[0].
    let hook = HookBuilder::default()
        .path("/bin/sh")
        .args(vec![
            "sh".to_owned(),
            "-c".to_owned(),
            format!("echo there > {marker}"),
        ])
        .build()
        .expect("hook");
    let o = run_hook(&hook, &state(), &opts).await.expect("ran");
    let _ = other.kill();
    let _ = other.wait();
    assert!(o.success(), "{}: {}", o.describe(), o.stderr);
    assert_eq!(
        std::fs::read_to_string(r.join(marker.trim_start_matches('/')))
            .ok()
            .as_deref(),
        Some("there\n"),
        "the hook ran in the other process's root"
    );
    assert!(!std::path::Path::new(&marker).exists(), "not in ours");
}

/// A program run in a container is a sealed copy in memory: the
/// container's processes, which see the hook's `/proc/<pid>/exe`, find
/// nothing of the host's to write to (runc's CVE-2019-5736). In our own
/// namespaces (nothing to enter, so no root needed), with busybox, a
/// static program.
#[tokio::test]
async fn a_program_run_in_a_container_is_a_sealed_copy_not_the_hosts_file() {
    let Some(busybox) = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
    else {
        // (Not lookout-testsupport's `skip`: this file is packaged.)
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "busybox-static is not installed"
        );
        eprintln!("SKIPPED sealed_hook_program: busybox-static is not installed");
        return;
    };
    let hook = HookBuilder::default()
        .path(busybox)
        .args(vec![
            "sh".to_owned(),
            "-c".to_owned(),
            // The exe, then a write through it (refused: sealed, or busy).
            "readlink /proc/self/exe; echo x >> /proc/self/exe && echo WROTE".to_owned(),
        ])
        .build()
        .expect("hook");
    let opts = in_our_own_namespaces();
    let o = run_hook(&hook, &state(), &opts).await.expect("ran");
    assert!(
        o.stdout.starts_with("/memfd:lookout-hook"),
        "{} / {}",
        o.stdout,
        o.stderr
    );
    assert!(!o.stdout.contains("WROTE"), "{}", o.stdout);
}

/// A createContainer program that is a script or dynamically linked is
/// refused before anything runs: its interpreter would come from the
/// container's file system and run as root.
#[tokio::test]
async fn a_script_never_runs_as_root_in_a_container() {
    let d = tempfile::tempdir().expect("tempdir");
    let script = d.path().join("hook.sh");
    let marker = d.path().join("ran");
    std::fs::write(&script, format!("#!/bin/sh\ntouch {}\n", marker.display())).expect("write");
    let hook = HookBuilder::default()
        .path(&script)
        .args(vec!["hook.sh".to_owned()])
        .build()
        .expect("hook");
    let opts = in_our_own_namespaces();
    let e = run_hook(&hook, &state(), &opts).await.expect_err("refused");
    let chain = lookout_model::Chain(&e).to_string();
    assert!(chain.contains("a script"), "{chain}");
    assert!(!marker.exists());
}

/// A container whose init is gone is never entered, even when its pid
/// names a process again: the pidfd opened while it was the container's
/// says it is gone.
#[tokio::test]
async fn a_hook_never_enters_a_process_that_took_a_dead_inits_pid() {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("sleep");
    let pid = child.id();
    // SAFETY: pidfd_open(2) on our own child's pid, which it still holds.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
    // SAFETY: a new fd the kernel just returned, owned by nobody else.
    let pidfd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    child.kill().expect("kill");
    child.wait().expect("reap");
    let hook = sh("true");
    let mut opts = RunOptions::default();
    // Our own pid stands in for the process that reused the init's.
    opts.container = Some(
        lookout_oci_hooks::InContainer::new(std::process::id(), lookout_oci_hooks::PathIn::Host)
            .with_pidfd(std::sync::Arc::new(pidfd)),
    );
    let e = run_hook(&hook, &state(), &opts).await.expect_err("refused");
    let chain = lookout_model::Chain(&e).to_string();
    assert!(chain.contains("the container's process is gone"), "{chain}");
}

/// Options that run a hook "in a container" whose namespaces are ours:
/// nothing to enter, so no root needed, and everything else of a
/// `createContainer` run (the program's copy, its checks, the identity).
fn in_our_own_namespaces() -> RunOptions {
    let mut opts = RunOptions::default();
    opts.container = Some(lookout_oci_hooks::InContainer::new(
        std::process::id(),
        lookout_oci_hooks::PathIn::Host,
    ));
    opts
}
