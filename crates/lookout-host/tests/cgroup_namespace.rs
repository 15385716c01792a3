//! Cgroup paths read in another cgroup namespace than the process's own:
//! through the reader thread there, and from a thread that entered it.
//! Root only (a cgroup and a namespace are made); its own test binary, as
//! the namespace chosen is the process's for good.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use lookout_host::proc;

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

fn skip(test: &str, why: &str) {
    assert!(!in_ci(), "{test}: {why}, under CI");
    eprintln!("\n!!! SKIPPED {test}: {why}\n");
}

/// The cgroup2 mount (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a
/// hybrid host like this project's VMs).
fn cgroup2_mount() -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == "cgroup2")
        .map(|f| f[1].to_owned())
}

/// A process in cgroup `dir` and in a cgroup namespace rooted there: for
/// it, this test's cgroup reads `/..`.
struct Other {
    child: Child,
    dir: String,
}

impl Other {
    fn start(dir: String) -> Other {
        // One left by a run that was killed is reused.
        if let Err(e) = std::fs::create_dir(&dir)
            && e.kind() != std::io::ErrorKind::AlreadyExists
        {
            panic!("mkdir {dir}: {e}");
        }
        let child = Command::new("sh")
            .args([
                "-c",
                "echo $$ > \"$0/cgroup.procs\" && exec unshare --cgroup sleep 30",
                &dir,
            ])
            .spawn()
            .expect("sh");
        let mut other = Other { child, dir };
        let own = std::fs::read_link("/proc/self/ns/cgroup").expect("own cgroup ns");
        let pid = other.child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = other.child.try_wait() {
                panic!("sh could not join {} or unshare: {status}", other.dir);
            }
            match std::fs::read_link(format!("/proc/{pid}/ns/cgroup")) {
                Ok(ns) if ns != own => break,
                _ => {}
            }
            assert!(
                Instant::now() < deadline,
                "the child never left our cgroup namespace"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        other
    }
}

impl Drop for Other {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
fn a_thread_that_entered_the_host_namespace_reads_cgroups_as_the_reader_there_does() {
    let test = "a_thread_that_entered_the_host_namespace_reads_cgroups_as_the_reader_there_does";
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip(test, "needs root (a cgroup and a cgroup namespace)");
    }
    let Some(mount) = cgroup2_mount() else {
        return skip(test, "no cgroup2 hierarchy mounted");
    };
    let me = std::process::id();
    // Nothing to enter yet.
    assert!(!proc::enter_host_cgroup_namespace().expect("a no-op"));
    let here = proc::cgroup(me).expect("our cgroup");
    assert!(!here.starts_with("/.."), "{here}");

    // "The host" here is a process whose namespace is rooted below us.
    let other = Other::start(format!("{mount}/lookout-cgns-{me}"));
    assert!(proc::use_host_cgroup_namespace(other.child.id()).expect("setns as root"));
    let through_reader = proc::cgroup(me).expect("read by the reader thread");
    assert!(
        through_reader.starts_with("/.."),
        "read in the other namespace: {through_reader}"
    );
    let theirs = std::fs::read_link(format!("/proc/{}/ns/cgroup", other.child.id()))
        .expect("their namespace");
    let (entered, again, read, ns) = std::thread::spawn(move || {
        let entered = proc::enter_host_cgroup_namespace().expect("setns as root");
        let again = proc::enter_host_cgroup_namespace().expect("a no-op");
        let read = proc::cgroup(me);
        let ns = std::fs::read_link("/proc/thread-self/ns/cgroup").ok();
        (entered, again, read, ns)
    })
    .join()
    .expect("the thread");
    assert!(entered && !again);
    assert_eq!(ns.as_ref(), Some(&theirs), "the thread's own namespace");
    assert_eq!(read.as_deref(), Some(through_reader.as_str()));
    // This thread did not enter it: its reads still go to the reader.
    let own = std::fs::read_link("/proc/thread-self/ns/cgroup").expect("ours");
    assert_ne!(own, theirs);
    assert_eq!(proc::cgroup(me), Some(through_reader));
}
