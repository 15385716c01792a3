//! The answering thread, against a real fanotify group (root).

use super::*;
use std::path::Path;
use std::process::{Command as Process, Stdio};

/// Runs `f` on another thread; panics if it takes more than 5 s.
fn within_5s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("{what}: still waiting after 5 s"))
}

fn exec(bin: &Path) -> bool {
    let bin = bin.to_owned();
    within_5s("an exec of the marked binary", move || {
        Process::new(bin)
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Whether the test can run (root); prints SKIPPED, or fails under CI,
/// if not.
fn root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    assert!(!ci, "{test}: needs root under CI");
    eprintln!("\n!!! SKIPPED {test}: needs root\n");
    false
}

/// A blocking group, as the hook makes one.
fn group() -> Fanotify {
    Fanotify::builder()
        .class(lookout_fanotify::Class::Content)
        .report(lookout_fanotify::Report::TID)
        .nonblock(false)
        .init()
        .expect("fanotify_init as root")
}

/// An answering thread on `group`, woken through `wake`, its counters,
/// and the task's end of its channel (keep it: closed, the thread's
/// hand-overs would fail at once).
fn answerer(
    group: &Fanotify,
    wake: std::io::Result<File>,
) -> (Answerer, Arc<Counters>, mpsc::Receiver<Exec>) {
    let (tx, rx) = mpsc::channel(16);
    let counters = Arc::new(Counters::new(None, Duration::from_secs(1)));
    let worker = Worker {
        group: group.share(),
        ring: None,
        counters: Arc::clone(&counters),
        marked: Arc::default(),
        shared: Arc::default(),
        tx,
        slice: None,
    };
    (Answerer::start(worker, wake).expect("spawn"), counters, rx)
}

/// Polls `done` every 20 ms for 10 s at most; panics with `what` then.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts an answerer on a private copy of `true`; execs it, stops the
/// answerer, execs it again with the group still open.
fn answers_and_stops(test: &str, wake: impl FnOnce(&Fanotify) -> std::io::Result<File>) {
    if !root(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("runc");
    // N.B. not std::fs::copy: a thread of this process forking while the
    // copy's fd is open would make the exec fail with ETXTBSY.
    let installed = Process::new("install")
        .args(["-m", "0755", "-T", "/bin/true"])
        .arg(&bin)
        .status()
        .expect("install(1)");
    assert!(installed.success(), "install /bin/true: {installed}");
    let group = group();
    let wake = wake(&group);
    let expect_read = wake.is_ok();
    let (mut answerer, counters, _rx) = answerer(&group, wake);
    assert_eq!(answerer.blocks_in_read(), expect_read);
    group
        .add_mark(&bin, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        .expect("mark");
    assert!(exec(&bin), "the answerer did not allow the exec");
    assert_eq!(counters.missing_argv.load(Ordering::Relaxed), 1);
    // Idle, the thread waits in read or poll, and that is no work:
    // counted as a batch, it would fail /healthz on a quiet node. One
    // exec's batch takes microseconds; watch for one of a second.
    // Nor is it stalled: the health probes sent meanwhile (one a
    // second) are read at once.
    let health = counters.health();
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_millis(2500) {
        let busy = health.permission_thread_busy();
        assert!(
            busy.is_none_or(|b| b < Duration::from_secs(1)),
            "an idle answering thread counted as busy for {busy:?}"
        );
        let stalled = health.reads_stalled();
        assert!(
            stalled.is_none_or(|b| b < Duration::from_secs(1)),
            "an idle answering thread left a probe unread for {stalled:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    within_5s("stopping the answerer", move || answerer.stop());
    // `group` is still open: had the marks stayed, this exec would
    // wait for an answer nobody gives.
    assert!(exec(&bin), "an exec after the stop was held");
    assert_eq!(counters.missing_argv.load(Ordering::Relaxed), 1);
}

#[test]
fn blocking_in_read_it_answers_and_stops_at_once() {
    answers_and_stops("blocking_in_read_it_answers_and_stops_at_once", |g| {
        let file = wake_file(g);
        assert!(file.is_ok(), "no wake-up event on this kernel: {file:?}");
        file
    });
}

#[test]
fn polling_without_a_wake_up_event_it_answers_and_stops_at_once() {
    answers_and_stops(
        "polling_without_a_wake_up_event_it_answers_and_stops_at_once",
        |_| Err(std::io::Error::other("told to poll")),
    );
}

/// A FUSE file system of one file, `bin`, whose daemon answers the
/// first open of it and holds every later one until the test lets them
/// go: a stalled FUSE daemon, as far as opening that file goes.
struct Stalling {
    opens: std::sync::atomic::AtomicU32,
    held: Arc<std::sync::Mutex<Held>>,
}

/// The opens [`Stalling`] holds; once released, it holds none.
#[derive(Default)]
struct Held {
    released: bool,
    replies: Vec<fuser::ReplyOpen>,
}

impl Stalling {
    const TTL: Duration = Duration::from_secs(60);

    fn attr(ino: fuser::INodeNo) -> fuser::FileAttr {
        let dir = u64::from(ino) == 1;
        fuser::FileAttr {
            ino,
            size: if dir { 0 } else { 4 },
            blocks: 0,
            atime: std::time::UNIX_EPOCH,
            mtime: std::time::UNIX_EPOCH,
            ctime: std::time::UNIX_EPOCH,
            crtime: std::time::UNIX_EPOCH,
            kind: if dir {
                fuser::FileType::Directory
            } else {
                fuser::FileType::RegularFile
            },
            perm: if dir { 0o755 } else { 0o644 },
            nlink: if dir { 2 } else { 1 },
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

impl fuser::Filesystem for Stalling {
    fn lookup(
        &self,
        _: &fuser::Request,
        parent: fuser::INodeNo,
        name: &std::ffi::OsStr,
        reply: fuser::ReplyEntry,
    ) {
        if u64::from(parent) == 1 && name == "bin" {
            reply.entry(
                &Self::TTL,
                &Self::attr(fuser::INodeNo(2)),
                fuser::Generation(0),
            );
        } else {
            reply.error(fuser::Errno::ENOENT);
        }
    }

    fn getattr(
        &self,
        _: &fuser::Request,
        ino: fuser::INodeNo,
        _: Option<fuser::FileHandle>,
        reply: fuser::ReplyAttr,
    ) {
        match u64::from(ino) {
            1 | 2 => reply.attr(&Self::TTL, &Self::attr(ino)),
            _ => reply.error(fuser::Errno::ENOENT),
        }
    }

    fn open(
        &self,
        _: &fuser::Request,
        _: fuser::INodeNo,
        _: fuser::OpenFlags,
        reply: fuser::ReplyOpen,
    ) {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.opens.fetch_add(1, Ordering::AcqRel) == 0 || held.released {
            reply.opened(fuser::FileHandle(1), fuser::FopenFlags::empty());
        } else {
            held.replies.push(reply);
        }
    }
}

/// Lets the opens [`Stalling`] holds go, and every later one, when
/// dropped at the latest: a test that fails while the answering thread
/// waits for one must not hang in stopping it.
struct Release(Arc<std::sync::Mutex<Held>>);

impl Release {
    /// How many opens it let go.
    fn now(&self) -> usize {
        let mut held = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        held.released = true;
        let n = held.replies.len();
        for reply in held.replies.drain(..) {
            reply.opened(fuser::FileHandle(2), fuser::FopenFlags::empty());
        }
        n
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        self.now();
    }
}

/// A read that hangs inside the kernel while it opens an event's file
/// (a runtime binary on a stalled FUSE or NFS mount) fails /healthz.
/// Here the file sits on [`Stalling`], marked `FAN_OPEN`: the test's
/// open raises the event, and the kernel's open of the file for it,
/// inside the thread's `read`, waits for a daemon that does not answer.
fn a_stuck_read_is_seen(test: &str, wake: impl FnOnce(&Fanotify) -> std::io::Result<File>) {
    if !root(test) {
        return;
    }
    let mnt = tempfile::tempdir().expect("tempdir");
    let held: Arc<std::sync::Mutex<Held>> = Arc::default();
    let fs = Stalling {
        opens: Default::default(),
        held: Arc::clone(&held),
    };
    let mut config = fuser::Config::default();
    config.mount_options = vec![fuser::MountOption::FSName("lookout-stalling".into())];
    let session = fuser::spawn_mount(fs, mnt.path(), &config).expect("mount FUSE as root");
    let bin = mnt.path().join("bin");
    let group = group();
    let wake = wake(&group);
    let blocking = wake.is_ok();
    let (mut answerer, counters, _rx) = answerer(&group, wake);
    // Dropped before the answerer, whatever happens.
    let release = Release(held);
    let health = counters.health();
    // The stuck-read indicator for this mode: the probe where the
    // thread blocks in `read`, the batch's age where it polls.
    let stuck = || {
        if blocking {
            health.reads_stalled()
        } else {
            health.permission_thread_busy()
        }
    };
    // (Blocking in read, this sends the first probe.)
    assert_eq!(stuck(), None, "nothing stuck before the test begins");
    group
        .add_mark(&bin, MarkFlags::empty(), Mask::OPEN)
        .expect("mark the FUSE file");
    let path = bin.clone();
    within_5s("the daemon's first open", move || {
        drop(File::open(path).expect("the daemon's first open"));
    });
    wait_for("the stuck read seen", || {
        stuck().is_some_and(|d| d >= Duration::from_secs(1))
    });
    // No event after this one (the thread would wait again), then the
    // daemon answers: the read returns.
    group
        .remove_mark(&bin, MarkFlags::empty(), Mask::OPEN)
        .expect("unmark the FUSE file");
    assert_ne!(
        release.now(),
        0,
        "the thread's open never reached the daemon"
    );
    wait_for("the read going on", || {
        stuck().is_none_or(|d| d < Duration::from_secs(1))
    });
    within_5s("stopping the answerer", move || answerer.stop());
    assert_eq!(
        health.reads_stalled(),
        None,
        "a stopped thread is not probed"
    );
    drop(session);
}

#[test]
fn blocking_in_read_a_read_stuck_opening_a_file_is_seen_by_the_probe() {
    a_stuck_read_is_seen(
        "blocking_in_read_a_read_stuck_opening_a_file_is_seen_by_the_probe",
        |g| {
            let file = wake_file(g);
            assert!(file.is_ok(), "no wake-up event on this kernel: {file:?}");
            file
        },
    );
}

#[test]
fn polling_a_read_stuck_opening_a_file_counts_as_busy() {
    a_stuck_read_is_seen("polling_a_read_stuck_opening_a_file_counts_as_busy", |_| {
        Err(std::io::Error::other("told to poll"))
    });
}
