//! lookout run on a hostile node (issue #10): an unprivileged user, created
//! by the tests, tries to spoof, freeze and blind container discovery while
//! root runs real containers. Each test states the attack and what must
//! still hold. See docs/security.md.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lookout_testsupport::{User, bundle, require_program, unprivileged_user};
use serde_json::Value;

mod common;
use common::*;

/// Root, runc, busybox and the unprivileged user, or a loud skip.
fn attacker(test: &str) -> Option<User> {
    if !ready(test) {
        return None;
    }
    unprivileged_user(test)
}

/// Lets every user read and run what is in `dir` (tempdirs are 0700).
fn open_to_all(dir: &Path) {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// A directory owned by the attacker, for what they plant.
fn attacker_dir(user: User) -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix("lk-attacker-")
        .tempdir()
        .expect("tempdir");
    std::os::unix::fs::chown(d.path(), Some(user.uid), Some(user.gid)).expect("chown");
    open_to_all(d.path());
    d
}

/// Runs `sh -c shell args...` (so `args[0]` is `$0`) as the attacker and
/// waits for it (its exit status is the attacker's business).
fn as_attacker(user: User, shell: &str, args: &[&str]) {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c").arg(shell).args(args);
    let _ = user
        .apply(&mut cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run as the attacker");
}

/// Waits until the metric samples `names` add up to at least `min`.
fn wait_metric(agent: &Agent, names: &[&str], min: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let page = agent.metrics();
        let sum: f64 = names.iter().filter_map(|n| metric(&page, n)).sum();
        if sum >= min {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{names:?} never reached {min} together:\n{page}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Each of `ids` was added once, by the runtime hook at its `create`
/// (`created`), and removed once; each is cleaned up.
fn each_seen_once_at_create(agent: &Agent, rt: &Runtime, ids: &[String]) {
    for id in ids {
        rt.cleanup(id);
        let ev = agent.events_for(id);
        let n = |k: &str| ev.iter().filter(|e| e["event"] == k).count();
        assert_eq!((n("added"), n("removed")), (1, 1), "{id}: {ev:?}");
        let added = ev.iter().find(|e| e["event"] == "added").expect("added");
        assert_eq!(added["source"], "runtime-hook", "{added}");
        assert_eq!(added["container"]["status"], "created", "{added}");
    }
}

#[test]
fn a_spoofed_runtime_root_gets_no_container_no_root_hook_and_no_identity() {
    let Some(user) = attacker("spoof") else {
        return;
    };
    let rt = Runtime::runc();
    open_to_all(rt.path.parent().expect("runtime dir"));
    let dir = tempfile::tempdir().expect("tempdir");
    let hook_log = dir.path().join("prestart.log");
    let prestart = format!("cat >> {0}; echo >> {0}", hook_log.display());
    let agent = Agent::start(&rt, &["--prestart", &prestart]);

    // Root's real container: tracked, its prestart hook run.
    let real = id("spoof-real");
    let b = bundle::busybox(&dir.path().join("real"), &["sleep", "30"], |_| {});
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &real]);
    rt.ok(&["start", &real]);
    let real_added = agent.wait_event(&real, "added", Duration::from_secs(5));

    // The attacker's runtime root holds a state that names pid 1, and
    // their bundle claims a kube-system pod.
    let play = attacker_dir(user);
    let fake = id("spoof-fake");
    let root = play.path().join("root");
    let bundle_dir = play.path().join("bundle");
    std::fs::create_dir_all(root.join(&fake)).expect("mkdir");
    std::fs::create_dir_all(&bundle_dir).expect("mkdir");
    std::fs::write(
        root.join(&fake).join("state.json"),
        serde_json::json!({
            "id": fake,
            "init_process_pid": 1,
            "config": {"labels": [format!("bundle={}", bundle_dir.display())]},
        })
        .to_string(),
    )
    .expect("write state");
    std::fs::write(
        bundle_dir.join("config.json"),
        serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["/bin/sh"]},
            "annotations": {
                "io.kubernetes.pod.namespace": "kube-system",
                "io.kubernetes.pod.name": "kube-proxy-x",
                "io.kubernetes.pod.uid": "11111111-2222-3333-4444-555555555555",
                "io.kubernetes.container.name": "kube-proxy",
            },
        })
        .to_string(),
    )
    .expect("write config");
    for p in [
        root.as_path(),
        &root.join(&fake),
        &root.join(&fake).join("state.json"),
        &bundle_dir,
        &bundle_dir.join("config.json"),
    ] {
        std::os::unix::fs::chown(p, Some(user.uid), Some(user.gid)).expect("chown");
    }

    // Through the watched runtime, as the attacker: create and start the
    // fake, and reuse the real container's id to fake its removal.
    let (runc, root_s, bundle_s) = (
        rt.path.to_str().expect("utf-8"),
        root.to_str().expect("utf-8"),
        bundle_dir.to_str().expect("utf-8"),
    );
    let script = "\"$0\" --root \"$1\" create --bundle \"$2\" \"$3\"; \
                  \"$0\" --root \"$1\" start \"$3\"; \
                  \"$0\" --root \"$1\" create --bundle \"$2\" \"$4\"; \
                  \"$0\" --root \"$1\" kill \"$4\" KILL; \
                  \"$0\" --root \"$1\" delete --force \"$4\"";
    as_attacker(user, script, &[runc, root_s, bundle_s, &fake, &real]);
    // Five runtime execs, each answered at once and not followed: ignored
    // as a user's, or, when one ended before its follower looked, counted
    // as unread (and reconciled, which finds nothing of theirs).
    wait_metric(
        &agent,
        &[
            "lookout_runtime_execs_ignored_total{reason=\"non-root\"}",
            "lookout_errors_total{kind=\"argv-unread\"}",
        ],
        5.0,
    );

    // Discovery goes on for root.
    let after = id("spoof-after");
    let b2 = bundle::busybox(&dir.path().join("after"), &["true"], |_| {});
    rt.ok(&["run", "-d", "--bundle", b2.to_str().expect("utf-8"), &after]);
    agent.wait_event(&after, "added", Duration::from_secs(5));

    assert!(
        agent.events_for(&fake).is_empty(),
        "{:?}",
        agent.events_for(&fake)
    );
    let all: Vec<Value> = agent
        .events
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    for e in &all {
        assert_ne!(e["container"]["pid"], 1, "an event with pid 1: {e}");
        assert_ne!(
            e["container"]["kubernetes"]["namespace"], "kube-system",
            "a spoofed Kubernetes identity: {e}"
        );
    }
    // The real container is untouched: one added, with its own pid, and
    // no removal while it runs.
    let real_events = agent.events_for(&real);
    assert_eq!(real_events.len(), 1, "{real_events:?}");
    assert_eq!(
        real_events[0]["container"]["pid"],
        real_added["container"]["pid"]
    );
    let hooks = std::fs::read_to_string(&hook_log).unwrap_or_default();
    assert!(
        hooks.contains(&real),
        "the real prestart hook ran:\n{hooks}"
    );
    assert!(
        !hooks.contains(&fake) && !hooks.contains("kube-system"),
        "a root hook ran for the attacker:\n{hooks}"
    );
    rt.cleanup(&real);
    rt.cleanup(&after);
}

#[test]
fn fifos_planted_by_an_unprivileged_user_do_not_freeze_discovery() {
    let Some(user) = attacker("fifos") else {
        return;
    };
    let rt = Runtime::runc();
    open_to_all(rt.path.parent().expect("runtime dir"));
    let dir = tempfile::tempdir().expect("tempdir");
    // crun, when installed, through a copy of its own too.
    let crun = lookout_testsupport::find_program("crun").map(|_| Runtime::copy("crun"));
    let crun_path = crun
        .as_ref()
        .map(|c| c.path.to_str().expect("utf-8").to_owned());
    // 5 s: a read that blocked on one of the FIFOs would hold the next
    // container's exec this long, well past the 3 s bound below.
    let mut extra = vec!["--answer-deadline", "5s"];
    if let Some(c) = crun_path.as_deref() {
        extra.extend(["--runtime-path", c]);
    }
    let agent = Agent::start(&rt, &extra);
    let play = attacker_dir(user);
    let p = play.path().to_str().expect("utf-8");
    let runc = rt.path.to_str().expect("utf-8");

    // The issue's recipe: a FIFO where the state file would be, then the
    // watched runc on that root, as the attacker. (runc itself may hang
    // on it: that is the attacker's own process.)
    let mut attacker_runc = {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg("mkdir -p \"$1/r/x\" \"$1/b\" && mkfifo \"$1/r/x/state.json\" && exec \"$0\" --root \"$1/r\" create --bundle \"$1/b\" x")
            .args([runc, p]);
        KillOnDrop(
            user.apply(&mut cmd)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("attacker"),
        )
    };
    // A FIFO in place of a config.json, in a bundle directory of theirs
    // that root's runtime is pointed at: lookout must not block on it
    // (runc will, on its own open, and is killed at the end).
    as_attacker(
        user,
        "mkdir -p \"$0/fifo-bundle\" && mkfifo \"$0/fifo-bundle/config.json\"",
        &[p],
    );
    let hung_id = id("fifo-config");
    let mut root_runc_on_fifo = KillOnDrop(
        rt.command()
            .args(["create", "--bundle", &format!("{p}/fifo-bundle"), &hung_id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("runc create on a FIFO config"),
    );

    // A config.json that is a symlink to /etc/shadow, in a bundle of
    // theirs: runc (root) follows it and fails; lookout never reads it.
    as_attacker(
        user,
        "mkdir -p \"$0/link-bundle\" && ln -s /etc/shadow \"$0/link-bundle/config.json\"",
        &[p],
    );
    let link_id = id("link-config");
    let _ = rt.run(&["create", "--bundle", &format!("{p}/link-bundle"), &link_id]);
    // crun's --config naming a FIFO of theirs (crun blocks on it itself).
    as_attacker(user, "mkfifo \"$0/config-fifo.json\"", &[p]);
    let crun_id = id("crun-fifo-config");
    let mut crun_on_fifo = crun.as_ref().map(|c| {
        KillOnDrop(
            c.command()
                .args(["create", "--config", &format!("{p}/config-fifo.json")])
                .args(["--bundle", &format!("{p}/b"), &crun_id])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("crun create --config FIFO"),
        )
    });
    // A FIFO where root's runc will write its pid file.
    as_attacker(user, "mkfifo \"$0/pid-fifo\"", &[p]);

    // The next root container is created, started and reported in under
    // 3 s. A read blocked on a FIFO would hold its exec until the 5 s
    // answer deadline (and a frozen discovery would never report it), so
    // 3 s separates the two with room for a loaded 2-core VM, where the
    // exec-flood test may run beside this one (it takes about 50 ms idle).
    let good = id("after-fifos");
    let b = bundle::busybox(&dir.path().join("good"), &["sleep", "1"], |_| {});
    let t = Instant::now();
    rt.ok(&[
        "create",
        "--pid-file",
        &format!("{p}/pid-fifo"),
        "--bundle",
        b.to_str().expect("utf-8"),
        &good,
    ]);
    rt.ok(&["start", &good]);
    agent.wait_event(&good, "added", Duration::from_secs(10));
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "create+start+added took {took:?}"
    );
    let (status, body) = http_get(&agent.addr(), "/healthz");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    agent.wait_event(&good, "removed", Duration::from_secs(10));
    rt.cleanup(&good);

    eprintln!("create + start + added after the planted FIFOs: {took:?}");
    let _ = root_runc_on_fifo.0.kill();
    if let Some(c) = crun_on_fifo.as_mut() {
        let _ = c.0.kill();
    }
    let _ = attacker_runc.0.kill();
    let t = Instant::now();
    let (status, log) = agent.stop();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "SIGTERM took {:?}",
        t.elapsed()
    );
    assert!(
        log.contains(&hung_id) && log.contains("not a regular file"),
        "the FIFO config.json was refused with a reason:\n{log}"
    );
    assert!(
        log.contains(&link_id) && log.contains("a symlink (not followed)"),
        "the symlinked config.json was refused with a reason:\n{log}"
    );
    if crun.is_some() {
        assert!(
            log.lines()
                .any(|l| l.contains(&crun_id) && l.contains("not a regular file")),
            "crun's FIFO --config was refused with a reason:\n{log}"
        );
    }
    rt.cleanup(&hung_id);
    rt.cleanup(&link_id);
}

#[test]
fn an_exec_flood_by_an_unprivileged_user_hides_no_container() {
    let Some(user) = attacker("flood") else {
        return;
    };
    const N: usize = 20;
    let rt = Runtime::runc();
    open_to_all(rt.path.parent().expect("runtime dir"));
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = Agent::start(&rt, &[]);
    // The waits asserted at the end count only with BPF argv capture.
    assert!(
        agent.log().contains("discovery mode fanotify-ebpf"),
        "{}",
        agent.log()
    );
    // Four attacker processes exec runtime names as fast as they can: paths
    // that do not exist (the BPF programs see the name before the path is
    // looked up) and the watched runtime itself.
    let flood = "while :; do /nonexistent/runc; /nonexistent/crun; /nonexistent/runsc; \
                 \"$0\" --version; done";
    let attackers: Vec<KillOnDrop> = (0..4)
        .map(|_| {
            let mut cmd = Command::new("/bin/sh");
            cmd.arg("-c").arg(flood).arg(&rt.path);
            KillOnDrop(
                user.apply(&mut cmd)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("attacker"),
            )
        })
        .collect();
    // Let the flood run before and while root works.
    wait_metric(
        &agent,
        &["lookout_runtime_execs_ignored_total{reason=\"non-root\"}"],
        20.0,
    );
    let b = bundle::busybox(&dir.path().join("b"), &["true"], |_| {});
    let bs = b.to_str().expect("utf-8").to_owned();
    let ids: Vec<String> = (0..N).map(|i| format!("{}-{i}", id("flood"))).collect();
    let rt_ref = &rt;
    std::thread::scope(|s| {
        for chunk in ids.chunks(N / 4) {
            let bs = &bs;
            s.spawn(move || {
                for id in chunk {
                    rt_ref.ok(&["create", "--bundle", bs, id]);
                    rt_ref.ok(&["start", id]);
                }
            });
        }
    });
    for id in &ids {
        agent.wait_event(id, "removed", Duration::from_secs(30));
    }
    drop(attackers);
    each_seen_once_at_create(&agent, &rt, &ids);
    // The attackers' execs of the watched runtime have no BPF record (only
    // host root's are recorded): the permission thread must not wait for
    // one (2 ms an exec, which root's next exec would wait behind).
    // Root's own execs may wait now and then for a record another CPU had
    // not committed yet.
    let page = agent.metrics();
    let ignored = metric(
        &page,
        "lookout_runtime_execs_ignored_total{reason=\"non-root\"}",
    )
    .unwrap_or_default();
    let waits = metric(&page, "lookout_argv_record_waits_total").expect("the waits metric");
    assert!(
        ignored >= 20.0 && waits < 10.0,
        "{ignored} attacker execs, {waits} waits for a record:\n{page}"
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn idle_connections_and_running_hooks_under_a_low_fd_limit_never_deny_an_exec() {
    let Some(user) = attacker("fd_limit") else {
        return;
    };
    // When fanotify cannot install an event's fd in the agent, the kernel
    // *denies* the exec: runtime execs fail with EPERM across the node.
    // Hard limit 256 (nothing to raise to); 500 idle connections from an
    // unprivileged user; 20 prestart hooks running at once.
    const N: usize = 20;
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = Agent::start_with(
        Some(&rt),
        &["--prestart", "sleep 1", "--hook-timeout", "5s"],
        &[],
        Some(lookout_testsupport::Restrictions::new().nofile(256, 256)),
    );
    let addr = agent.addr();
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    // The attacker opens 500 connections and holds them idle.
    let holder_bin = connection_holder(dir.path());
    open_to_all(dir.path());
    let mut cmd = Command::new(&holder_bin);
    cmd.args([host, port, "500"]);
    let mut holder = KillOnDrop(
        user.apply(&mut cmd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("connection holder"),
    );
    // It prints how many connections it opened, then waits to be killed.
    let mut opened = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(holder.0.stdout.take().expect("stdout")),
        &mut opened,
    )
    .expect("read");
    assert_eq!(opened.trim(), "500", "the attacker's connections");
    let b = bundle::busybox(&dir.path().join("b"), &["true"], |_| {});
    let bs = b.to_str().expect("utf-8").to_owned();
    let ids: Vec<String> = (0..N).map(|i| format!("{}-{i}", id("fd-limit"))).collect();
    let rt_ref = &rt;
    std::thread::scope(|s| {
        for id in &ids {
            let bs = &bs;
            s.spawn(move || {
                // ok(): a denied exec (EPERM) fails the test here.
                rt_ref.ok(&["create", "--bundle", bs, id]);
                rt_ref.ok(&["start", id]);
            });
        }
    });
    for id in &ids {
        agent.wait_event(id, "removed", Duration::from_secs(30));
        rt.cleanup(id);
    }
    drop(holder);
    // The agent frees the attacker's connection slots as it reads their
    // ends; until then a new connection is refused at accept (reset).
    let deadline = Instant::now() + Duration::from_secs(10);
    let page = loop {
        match try_http_get(&addr, "/metrics") {
            Ok((200, page)) => break page,
            other => assert!(
                Instant::now() < deadline,
                "/metrics still refused 10 s after the attacker left: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        metric(&page, "lookout_http_connections_refused_total").unwrap_or(0.0) >= 400.0,
        "{page}"
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    for id in &ids {
        assert!(
            log.lines()
                .any(|l| l.contains("hook ran") && l.contains(&format!("id=\"{id}\""))),
            "no prestart hook ran for {id}:\n{log}"
        );
    }
}

/// `holder HOST PORT N`: opens N TCP connections, prints N, holds them.
fn connection_holder(dir: &Path) -> std::path::PathBuf {
    let src = dir.join("holder.c");
    let bin = dir.join("holder");
    std::fs::write(
        &src,
        r#"#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(atoi(argv[2]));
    if (inet_pton(AF_INET, argv[1], &a.sin_addr) != 1) return 3;
    int n = atoi(argv[3]), ok = 0;
    for (int i = 0; i < n; i++) {
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0) break;
        ok++;
    }
    printf("%d\n", ok);
    fflush(stdout);
    pause();
    return 0;
}
"#,
    )
    .expect("write holder.c");
    let status = Command::new("gcc")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .expect("run gcc");
    assert!(status.success(), "gcc failed");
    bin
}

/// Root in a container without a user namespace (the Kubernetes default)
/// is uid 0 to the kernel, like host root. It fills the argv ring with
/// records named like the runtime, so that the real runtime's records
/// find no room: without a defence, root's
/// containers are followed late, after the fact, and their starts are not
/// held. The BPF programs record only callers in the agent's own pid
/// namespace, and the late path refuses the rest (docs/security.md).
#[test]
fn a_root_exec_flood_from_a_container_pid_namespace_hides_no_container() {
    let test = "pidns-flood";
    if !ready(test) || !require_program(test, "unshare") {
        return;
    }
    const N: usize = 6;
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = Agent::start(&rt, &[]);
    let count = dir.path().join("count");
    // In a pid namespace of its own, like a pod's processes: root execs a
    // file called runc (that need not exist) as fast as it can, and notes
    // every 64th try. Records as short as they come (304 bytes with the
    // ring's header) fill the ring to its last 304 bytes, less than any
    // `runc create` needs.
    let flood = "i=0; while :; do /nonexistent/runc; i=$((i+1)); \
                 [ $((i % 64)) -eq 0 ] && echo $i > \"$0.new\" && mv \"$0.new\" \"$0\"; done";
    let flooder = KillOnDrop(
        Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "/bin/sh", "-c"])
            .arg(flood)
            .arg(&count)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("flooder"),
    );
    let tries = || {
        std::fs::read_to_string(&count)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    // Before each of root's runtime execs, 1024 more tries: 862 records
    // would fill the 256 KiB ring that root's last exec drained.
    let fill = || {
        let want = tries() + 1024;
        let deadline = Instant::now() + Duration::from_secs(20);
        while tries() < want {
            assert!(
                Instant::now() < deadline,
                "the flood stalled at {}",
                tries()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let b = bundle::busybox(&dir.path().join("b"), &["true"], |_| {});
    let bs = b.to_str().expect("utf-8");
    let ids: Vec<String> = (0..N).map(|i| format!("{}-{i}", id(test))).collect();
    for id in &ids {
        fill();
        rt.ok(&["create", "--bundle", bs, id]);
        fill();
        rt.ok(&["start", id]);
    }
    for id in &ids {
        agent.wait_event(id, "removed", Duration::from_secs(30));
    }
    drop(flooder);
    let page = agent.metrics();
    each_seen_once_at_create(&agent, &rt, &ids);
    // Every one of root's runtime execs found its record: none was
    // allowed blindly and followed late.
    assert_eq!(
        metric(&page, "lookout_runtime_execs_without_argv_total"),
        Some(0.0),
        "{page}"
    );
    // Nor did the flood's records wait in the table (the gauge counts
    // other tests' root runc execs too, which this agent never sees the
    // permission event of: far fewer than the flood's thousands).
    let waiting = metric(&page, "lookout_argv_records_waiting").expect("the gauge");
    assert!(waiting < 1000.0, "{waiting} argv records waiting");

    // Root of that namespace runs the watched runtime itself: no record
    // (the programs skip it), and the late path takes it for what it is.
    let st = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child"])
        .arg(&rt.path)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .expect("runc --version in a pid namespace");
    assert!(st.success());
    wait_metric(
        &agent,
        &["lookout_runtime_execs_ignored_total{reason=\"pid-namespace\"}"],
        1.0,
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}
