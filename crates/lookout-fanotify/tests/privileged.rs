//! fanotify against the real kernel: exec permission events on a marked
//! binary, answered, denied, dropped and abandoned. Needs root.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lookout_fanotify::{AsyncFanotify, Class, Fanotify, MIN_READ_BUFFER, MarkFlags, Mask, Report};
use lookout_testsupport::require_root;

/// A private copy of `true`, so marking it affects nobody else.
fn binary(dir: &Path) -> PathBuf {
    let path = dir.join("marked-true");
    lookout_testsupport::install_executable(Path::new("/bin/true"), &path).expect("copy /bin/true");
    path
}

/// Execs `bin` from a helper thread. N.B. `Command::spawn` itself waits
/// until the child's execve returns, which waits for our answer, so it must
/// not run on the thread that answers.
fn exec_in_thread(
    bin: &Path,
) -> std::thread::JoinHandle<std::io::Result<std::process::ExitStatus>> {
    let bin = bin.to_path_buf();
    std::thread::spawn(move || Command::new(&bin).stdout(Stdio::null()).status())
}

/// Waits until an exec blocks on the group, without reading the event.
fn next_event_peek(group: &Fanotify) {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: group.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, 5 s timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
    assert_eq!(n, 1, "no exec blocked on the group within 5 s");
}

fn parent_of(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("PPid:"))?;
    line.trim_start_matches("PPid:").trim().parse().ok()
}

fn group() -> Fanotify {
    Fanotify::builder()
        .class(Class::Content)
        .report(Report::TID)
        .init()
        .expect("fanotify_init as root")
}

/// Reads until one event arrives (the group is non-blocking).
fn next_event(group: &Fanotify) -> lookout_fanotify::Event {
    let mut buf = vec![0; MIN_READ_BUFFER];
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while out.is_empty() {
        assert!(Instant::now() < deadline, "no fanotify event within 5 s");
        group.read_events(&mut buf, &mut out).expect("read events");
        if out.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!(out.len(), 1, "{out:?}");
    out.remove(0)
}

#[test]
fn exec_permission_allow_and_deny() {
    if !require_root("exec_permission_allow_and_deny") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = binary(dir.path());
    let group = group();
    group
        .add_mark(&bin, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        .expect("mark");

    // Allowed: the exec waits for our answer, then succeeds.
    let child = exec_in_thread(&bin);
    let mut event = next_event(&group);
    assert!(event.mask().contains(Mask::OPEN_EXEC_PERM));
    // The exec'ing process is our child, blocked in execve.
    assert_eq!(parent_of(event.pid()), Some(std::process::id()));
    assert_eq!(event.path().as_deref(), Some(bin.as_path()));
    event
        .take_permission()
        .expect("permission event")
        .allow()
        .expect("allow");
    assert!(child.join().expect("thread").expect("exec").success());

    // Denied: execve fails with EPERM.
    let waiter = exec_in_thread(&bin);
    let mut event = next_event(&group);
    event
        .take_permission()
        .expect("permission")
        .deny()
        .expect("deny");
    let err = waiter
        .join()
        .expect("thread")
        .expect_err("exec must be denied");
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
}

#[test]
fn dropping_an_event_allows_it() {
    if !require_root("dropping_an_event_allows_it") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = binary(dir.path());
    let group = group();
    group
        .add_mark(&bin, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        .expect("mark");
    let child = exec_in_thread(&bin);
    drop(next_event(&group)); // never answered explicitly
    assert!(child.join().expect("thread").expect("exec").success());
}

#[test]
fn closing_the_group_releases_blocked_execs() {
    if !require_root("closing_the_group_releases_blocked_execs") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = binary(dir.path());
    // N.B. the exec'ing process must not hold a copy of the group fd: a
    // child forked by us keeps the group alive (CLOEXEC acts only after the
    // permission check), so closing our copy would not release it. Start a
    // shell *before* creating the group, and let it exec once the mark is
    // in place: when the test creates the go file (the shell gives up
    // after about 10 s, and then the peek below fails).
    let go = dir.path().join("go");
    let script = format!(
        "i=0; while [ ! -e {go} ]; do i=$((i+1)); [ $i -lt 1000 ] || exit 9; sleep 0.01; done; exec {bin}",
        go = go.display(),
        bin = bin.display()
    );
    let mut child = Command::new("sh")
        .args(["-c", &script])
        .spawn()
        .expect("spawn sh");
    let group = group();
    group
        .add_mark(&bin, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        .expect("mark");
    std::fs::write(&go, b"").expect("go file");
    // Wait until the exec is blocked on us, then close without reading:
    // this is what happens when the agent crashes.
    next_event_peek(&group);
    let start = Instant::now();
    drop(group);
    // Released at the close (the exec of `true` then takes milliseconds);
    // a group that lived on would hold the exec for ever, so a bounded
    // wait fails instead of hanging.
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > Duration::from_secs(2) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the exec was still blocked 2 s after the group was closed");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success(), "{status:?}");
}

#[test]
fn async_reader_sees_events() {
    if !require_root("async_reader_sees_events") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = binary(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut group = AsyncFanotify::new(group()).expect("register");
        group
            .get_ref()
            .add_mark(&bin, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
            .expect("mark");
        let child = exec_in_thread(&bin);
        let mut out = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), group.read_events(&mut out))
            .await
            .expect("event within 5 s")
            .expect("read");
        assert_eq!(n, 1);
        assert!(out[0].mask().contains(Mask::OPEN_EXEC_PERM));
        out.clear(); // dropping answers "allow"
        let status = child.join().expect("thread").expect("exec");
        assert!(status.success());
    });
}

#[test]
fn dfid_name_records_name_the_created_file() {
    if !require_root("dfid_name_records_name_the_created_file") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let group = Fanotify::builder()
        .report(Report::DFID_NAME)
        .init()
        .expect("init");
    group
        .add_mark(
            dir.path(),
            MarkFlags::ONLYDIR,
            Mask::CREATE | Mask::MOVED_TO,
        )
        .expect("mark dir");
    std::fs::write(dir.path().join(".tmp-pid"), b"42").expect("write");
    std::fs::rename(dir.path().join(".tmp-pid"), dir.path().join("init.pid")).expect("rename");
    let mut buf = vec![0; MIN_READ_BUFFER];
    let mut out = Vec::new();
    group.read_events(&mut buf, &mut out).expect("read");
    let names: Vec<String> = out
        .iter()
        .flat_map(|e| e.info())
        .filter_map(|r| match r {
            lookout_fanotify::InfoRecord::Fid { name: Some(n), .. } => {
                Some(n.to_string_lossy().into_owned())
            }
            _ => None,
        })
        .collect();
    assert_eq!(names, [".tmp-pid", "init.pid"], "{out:?}");
    assert!(out[0].mask().contains(Mask::CREATE));
    assert!(out[1].mask().contains(Mask::MOVED_TO));
}

#[test]
fn mark_errors_name_the_path_and_errno() {
    if !require_root("mark_errors_name_the_path_and_errno") {
        return;
    }
    let group = group();
    let err = group
        .add_mark(
            Path::new("/definitely/not/here"),
            MarkFlags::empty(),
            Mask::OPEN_EXEC_PERM,
        )
        .expect_err("missing path");
    assert_eq!(err.errno(), Some(libc::ENOENT));
    assert!(err.to_string().contains("/definitely/not/here"), "{err}");
}

#[test]
fn drain_returns_on_a_blocking_group_once_the_queue_is_empty() {
    if !require_root("drain_returns_on_a_blocking_group_once_the_queue_is_empty") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = binary(dir.path());
    let group = Fanotify::builder()
        .class(Class::Content)
        .report(Report::TID)
        .nonblock(false)
        .init()
        .expect("fanotify_init as root");
    assert!(!group.is_nonblocking());
    group
        .add_mark(&bin, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        .expect("mark");
    // One exec held by the group: drain must answer it (allow) and then
    // return instead of waiting in read(2) for an event that never comes.
    let exec = exec_in_thread(&bin);
    next_event_peek(&group);
    // On another thread, so that a drain stuck in read(2) fails the test
    // instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = group.share();
    std::thread::spawn(move || {
        let first = reader.drain().expect("drain");
        let second = reader.drain().expect("drain an empty group");
        let _ = tx.send((first, second));
    });
    let drained = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("drain on a blocking group still waiting after 5 s");
    assert_eq!(drained, (1, 0));
    assert!(exec.join().expect("join").expect("exec").success());
    // The mode is the open file's, so every handle sees what drain set.
    assert!(group.is_nonblocking());
    group.set_nonblocking(false).expect("set blocking");
    assert!(!group.share().is_nonblocking());
}
