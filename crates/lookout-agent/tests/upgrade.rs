//! Upgrades on real runc: two agents at once, as a surge rollout runs them
//! (the old one serving the socket, the new one standing by), the old one
//! stopped or killed, and what consumers, hooks and gates see meanwhile.
//! Root only; each test its own runc copy, socket and directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lookout_client::{Client, Event, Filter, GateOptions, OnFailure};
use lookout_testsupport::bundle;

mod common;
use common::*;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Every event a `lookout_client` watcher passes on, from revision 0,
/// across reconnects (the client resumes by itself).
struct Seen {
    events: Arc<Mutex<Vec<Event>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Seen {
    fn start(rt: &tokio::runtime::Runtime, socket: &Path) -> Seen {
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        let socket = socket.to_owned();
        let task = rt.spawn(async move {
            let client = Client::connect(&socket).await.expect("connect");
            let mut w = client.watch(Filter::all()).await.expect("watch");
            while let Some(next) = w.next().await {
                match next {
                    Ok(e) => sink.lock().expect("lock").push(e),
                    Err(e) => panic!("the watcher gave up: {e}"),
                }
            }
            panic!("the watcher ended");
        });
        Seen { events, task }
    }

    fn all(&self) -> Vec<Event> {
        self.events.lock().expect("lock").clone()
    }

    /// (Added, Removed) counts for `id`.
    fn count(&self, id: &str) -> (usize, usize) {
        let mut n = (0, 0);
        for e in self.all() {
            match e {
                Event::Added { container, .. } if container.id == id => n.0 += 1,
                Event::Removed { container, .. } if container.id == id => n.1 += 1,
                _ => {}
            }
        }
        n
    }

    fn wait_removed(&self, id: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.count(id).1 == 0 {
            assert!(
                Instant::now() < deadline,
                "the watcher never saw {id} removed: {:?}",
                self.all()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Creates and starts `id` (a container that exits at once).
fn one_shot(rt: &Runtime, bundle: &Path, id: &str) {
    rt.ok(&["create", "--bundle", bundle.to_str().expect("utf-8"), id]);
    rt.ok(&["start", id]);
}

/// Lines of `log` that mention `id` and start with `stage`.
fn hook_runs(log: &Path, stage: &str, id: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with(stage) && l.contains(&format!("\"{id}\"")))
        .count()
}

/// The pid serving `socket`, once a `List` through it answers.
fn served_by(tokio: &tokio::runtime::Runtime, socket: &Path) -> Option<i32> {
    let conn = std::os::unix::net::UnixStream::connect(socket).ok()?;
    let cred =
        nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials).ok()?;
    drop(conn);
    let listed = tokio.block_on(async {
        let options = lookout_client::ConnectOptions::new().retry_for(Duration::ZERO);
        let c = Client::connect_with(socket, options).await.ok()?;
        tokio::time::timeout(Duration::from_secs(2), c.list(Filter::all()))
            .await
            .ok()?
            .ok()
    });
    listed.map(|_| cred.pid())
}

/// Waits until `socket` is served by `pid`; the time it took.
fn until_served_by(tokio: &tokio::runtime::Runtime, socket: &Path, pid: u32) -> Duration {
    let t = Instant::now();
    loop {
        if served_by(tokio, socket) == Some(pid as i32) {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the socket was not served by pid {pid} within 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Signals the agent (0: none) and waits for its exit (polling every
/// millisecond, so that the exit is timed to within one).
fn signal_and_reap(agent: &mut Agent, signal: i32) -> std::process::ExitStatus {
    if signal != 0 {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(agent.child.id() as i32, signal) };
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = agent.child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "agent did not exit on signal {signal}:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

struct Setup {
    rt: Runtime,
    dir: tempfile::TempDir,
    socket: PathBuf,
    hooks_log: PathBuf,
    bundle: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let rt = Runtime::runc();
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("api/lookout.sock");
        let hooks_log = dir.path().join("hooks.log");
        let bundle = dir.path().join("b");
        bundle::busybox(&bundle, &["true"], |_| {});
        Setup {
            rt,
            dir,
            socket,
            hooks_log,
            bundle,
        }
    }

    /// An agent on the shared socket, with a prestart and a poststop hook
    /// that append the OCI state to the hooks log.
    fn agent(&self) -> Agent {
        let log = self.hooks_log.to_str().expect("utf-8");
        let pre = format!("(printf 'pre '; cat; echo) >> {log}");
        let post = format!("(printf 'post '; cat; echo) >> {log}");
        Agent::start(
            &self.rt,
            &[
                "--socket",
                self.socket.to_str().expect("utf-8"),
                "--prestart",
                &pre,
                "--poststop",
                &post,
            ],
        )
    }
}

/// A surge rollout on one node: the new agent stands by while the old one
/// serves; a container started in the overlap gets each hook once (not
/// once per agent); at the old agent's SIGTERM the new one serves the
/// socket at once, and a `lookout_client` watcher sees every change
/// exactly once across the two processes, with no second snapshot.
#[test]
fn a_surge_rollout_hands_over_with_every_change_and_every_hook_once() {
    if !ready("upgrade_surge") {
        return;
    }
    let s = Setup::new();
    let tokio = runtime();
    let ids: Vec<String> = ["before", "overlap", "after"]
        .iter()
        .map(|w| format!("{}-{w}", id("surge")))
        .collect();

    let mut old = s.agent();
    let seen = Seen::start(&tokio, &s.socket);
    one_shot(&s.rt, &s.bundle, &ids[0]);
    seen.wait_removed(&ids[0]);

    let new = s.agent();
    new.wait_log("standing by", Duration::from_secs(5));
    assert_eq!(
        served_by(&tokio, &s.socket),
        Some(old.child.id() as i32),
        "the old agent keeps the socket while it runs"
    );
    // In the overlap both agents hold the start and report the container.
    one_shot(&s.rt, &s.bundle, &ids[1]);
    old.wait_event(&ids[1], "added", Duration::from_secs(5));
    new.wait_event(&ids[1], "added", Duration::from_secs(5));
    seen.wait_removed(&ids[1]);

    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(old.child.id() as i32, libc::SIGTERM) };
    let handover = until_served_by(&tokio, &s.socket, new.child.id());
    let status = signal_and_reap(&mut old, 0);
    println!("upgrade: SIGTERM to the old agent: the new one served the socket after {handover:?}");
    assert!(
        status.success(),
        "the old agent exits cleanly:\n{}",
        old.log()
    );
    // What this guards against is the old agent waiting out its 5 s limit
    // for a standby; the time itself is printed above, not asserted (1 s
    // failed once on this 2-core VM with three test binaries' agents busy).
    assert!(
        handover < Duration::from_secs(3),
        "the new agent served the socket {handover:?} after the old one's SIGTERM:\n{}",
        new.log()
    );
    assert!(
        old.log().contains("handed the consumer socket over"),
        "the old agent waited for the new one:\n{}",
        old.log()
    );
    new.wait_log("took the consumer socket over", Duration::from_secs(5));
    assert!(
        new.log().contains("clean=true"),
        "the old agent ended its watches after its last change:\n{}",
        new.log()
    );

    one_shot(&s.rt, &s.bundle, &ids[2]);
    seen.wait_removed(&ids[2]);
    for id in &ids {
        s.rt.cleanup(id);
    }

    let all = seen.all();
    seen.task.abort();
    for id in &ids {
        assert_eq!(
            seen.count(id),
            (1, 1),
            "{id} added and removed once each: {all:?}"
        );
    }
    let snapshots = all
        .iter()
        .filter(|e| matches!(e, Event::Snapshot { .. }))
        .count();
    assert_eq!(snapshots, 1, "the first only: {all:?}");
    let revisions: Vec<u64> = all.iter().map(Event::revision).collect();
    assert!(
        revisions.windows(2).all(|w| w[0] < w[1]),
        "revisions grow across the handover: {revisions:?}"
    );

    // Each hook once per container, whichever agent ran it.
    let (_, new_log) = new.stop();
    for id in &ids {
        for stage in ["pre", "post"] {
            assert_eq!(
                hook_runs(&s.hooks_log, stage, id),
                1,
                "{stage} hook of {id}:\n{}\nnew agent:\n{new_log}",
                std::fs::read_to_string(&s.hooks_log).unwrap_or_default()
            );
        }
    }
    assert!(!s.socket.exists(), "the last agent removes its socket");
    let stray: Vec<String> = std::fs::read_dir(s.dir.path().join("api"))
        .expect("the socket's directory")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            ![".lease", ".claims", ".gates"]
                .iter()
                .any(|x| n.ends_with(x))
        })
        .collect();
    assert!(
        stray.is_empty(),
        "no temporary socket left behind: {stray:?}"
    );
}

/// The old agent killed (`kill -9`) in the overlap: the standby takes over
/// the instant the kernel drops the dead agent's lease. Then the only
/// agent killed with none standing by: the socket and discovery are back
/// when a new agent has started (the kubelet's restart), and a container
/// created meanwhile is found by its start-up scan, late. Both windows are
/// measured and printed (docs/operations.md keeps the figures).
#[test]
fn a_killed_agent_is_replaced_by_its_standby_at_once_and_restarted_after_a_gap() {
    if !ready("upgrade_kill") {
        return;
    }
    let s = Setup::new();
    let tokio = runtime();
    let ids: Vec<String> = ["a", "b", "gap"]
        .iter()
        .map(|w| format!("{}-{w}", id("kill")))
        .collect();

    let mut old = s.agent();
    let seen = Seen::start(&tokio, &s.socket);
    one_shot(&s.rt, &s.bundle, &ids[0]);
    seen.wait_removed(&ids[0]);
    let mut new = s.agent();
    new.wait_log("standing by", Duration::from_secs(5));
    // Mirroring before the kill: the standby has the changes so far.
    new.wait_log("standby: mirroring", Duration::from_secs(5));
    signal_and_reap(&mut old, libc::SIGKILL);
    let to_standby = until_served_by(&tokio, &s.socket, new.child.id());
    println!("upgrade: kill -9 with a standby: socket served again after {to_standby:?}");
    // What this guards against is a standby that does not take over when
    // the dead agent's lease goes: then nothing serves the socket until a
    // new agent starts, which here never comes (`until_served_by` fails at
    // 10 s). The time itself is printed above; 3 s, not 1 s, as for the
    // SIGTERM handover in the surge test (1 s failed there once on this
    // 2-core VM with three test binaries' agents busy).
    assert!(
        to_standby < Duration::from_secs(3),
        "{to_standby:?}:\n{}",
        new.log()
    );
    one_shot(&s.rt, &s.bundle, &ids[1]);
    seen.wait_removed(&ids[1]);
    for id in &ids[..2] {
        assert_eq!(seen.count(id), (1, 1), "{id}: {:?}", seen.all());
    }

    // No standby: the gap lasts until a new agent has started.
    signal_and_reap(&mut new, libc::SIGKILL);
    let killed = Instant::now();
    let mut created = s.rt.command();
    created.args([
        "create",
        "--bundle",
        s.bundle.to_str().expect("utf-8"),
        &ids[2],
    ]);
    assert!(created.status().expect("runc create").success());
    let restarted = s.agent();
    until_served_by(&tokio, &s.socket, restarted.child.id());
    let window = killed.elapsed();
    println!(
        "upgrade: kill -9 without a standby: socket and discovery back after {window:?} \
         (the agent's start-up; the kubelet's restart delay comes on top)"
    );
    let found = restarted.wait_event(&ids[2], "added", Duration::from_secs(5));
    assert_eq!(
        found["source"], "state-scan",
        "a container created in the gap is found by the start-up scan: {found}"
    );
    s.rt.cleanup(&ids[2]);
    seen.task.abort();
}

/// Revisions, not wall time, order the two processes' changes: a map kept
/// by a consumer across the handover equals the new agent's `List`.
#[test]
fn a_consumers_map_kept_across_the_handover_equals_the_new_agents_list() {
    if !ready("upgrade_map") {
        return;
    }
    let s = Setup::new();
    let tokio = runtime();
    let mut old = s.agent();
    let seen = Seen::start(&tokio, &s.socket);
    // Long-running containers: some created before, some in the overlap.
    let sleeper = s.dir.path().join("sleeper");
    bundle::busybox(&sleeper, &["sleep", "600"], |_| {});
    let ids: Vec<String> = (0..4).map(|i| format!("{}-{i}", id("map"))).collect();
    for id in &ids[..2] {
        one_shot(&s.rt, &sleeper, id);
    }
    let new = s.agent();
    new.wait_log("standing by", Duration::from_secs(5));
    for id in &ids[2..] {
        one_shot(&s.rt, &sleeper, id);
    }
    s.rt.ok(&["kill", &ids[0], "KILL"]);
    seen.wait_removed(&ids[0]);
    signal_and_reap(&mut old, libc::SIGTERM);
    until_served_by(&tokio, &s.socket, new.child.id());
    s.rt.ok(&["kill", &ids[2], "KILL"]);
    seen.wait_removed(&ids[2]);

    let mut map: HashMap<String, ()> = HashMap::new();
    for e in seen.all() {
        match e {
            Event::Snapshot { containers, .. } => {
                map = containers.into_iter().map(|c| (c.id, ())).collect();
            }
            Event::Added { container, .. } => {
                map.insert(container.id, ());
            }
            Event::Removed { container, .. } => {
                map.remove(&container.id);
            }
            _ => {}
        }
    }
    seen.task.abort();
    let listed: Vec<String> = tokio.block_on(async {
        let c = Client::connect(&s.socket).await.expect("connect");
        let (_, l) = c.list(Filter::all()).await.expect("list");
        l.into_iter().map(|c| c.id).collect()
    });
    for id in &ids {
        s.rt.cleanup(id);
    }
    // Containers of this test only: the start-up scan also finds those
    // that tests running beside it create in runc's state directory.
    let ours = |id: &String| ids.contains(id);
    let mut kept: Vec<String> = map.into_keys().filter(ours).collect();
    kept.sort();
    let mut listed: Vec<String> = listed.into_iter().filter(ours).collect();
    listed.sort();
    assert_eq!(kept, listed);
    assert_eq!(kept, [ids[1].clone(), ids[3].clone()]);
}

/// Sets the flag when dropped (a test that fails stops its threads).
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A fail-closed gate through a surge rollout: a `lookout_client` gate
/// subscriber that allows even-numbered containers and denies odd ones.
/// Containers start from three threads at once before, during and after
/// the handover, and one (odd: to be denied) is held at the old agent when
/// it gets SIGTERM, its answer held back until the new agent serves. No
/// start escapes the gate: every container that started was held for the
/// subscriber and is one it allowed; the held-back one never started. The
/// client resubscribes by itself, and the new agent holds starts for it
/// until it is back.
#[test]
fn no_start_escapes_a_fail_closed_gate_through_the_handover() {
    if !ready("upgrade_gate") {
        return;
    }
    use std::sync::atomic::{AtomicBool, Ordering};
    let s = Setup::new();
    let tokio = runtime();
    let socket = s.socket.to_str().expect("utf-8");
    let debug = [(
        "LOOKOUT_LOG",
        "info,lookout_agent=debug,lookout_runtime_hook=debug",
    )];
    let mut old = Agent::start_with(Some(&s.rt), &["--socket", socket], &debug, None);
    let prefix = id("gate");
    let held_back = format!("{prefix}-heldback-1");
    let held: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let answer_held_back = Arc::new(tokio::sync::Notify::new());
    let subscriber = {
        let (held, path) = (Arc::clone(&held), s.socket.clone());
        let (held_back, go) = (held_back.clone(), Arc::clone(&answer_held_back));
        tokio.spawn(async move {
            let client = Client::connect(&path).await.expect("connect");
            let sub = GateOptions::new("upgrade-test")
                .filter(Filter::all().runtime("runc"))
                .deadline(Duration::from_secs(5))
                .on_failure(OnFailure::FailClosed);
            let mut gate = client.gate(sub).await.expect("gate");
            let mut first_held_back = true;
            while let Some(guard) = gate.next().await {
                let guard = guard.expect("the gate failed");
                if !guard.held() {
                    continue;
                }
                let id = guard.container().id.clone();
                held.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id.clone());
                if id == held_back && std::mem::take(&mut first_held_back) {
                    let go = Arc::clone(&go);
                    tokio::spawn(async move {
                        go.notified().await;
                        let _ = guard.deny("odd, and answered late");
                    });
                    continue;
                }
                let n: u32 = id
                    .rsplit('-')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(1);
                // An answer to a gone agent fails; the new one asks again.
                let _ = if n.is_multiple_of(2) {
                    guard.allow()
                } else {
                    guard.deny("odd")
                };
            }
        })
    };
    old.wait_log("gate subscriber connected", Duration::from_secs(5));
    let new = Agent::start_with(Some(&s.rt), &["--socket", socket], &debug, None);
    new.wait_log("standing by", Duration::from_secs(5));

    let stop = Arc::new(AtomicBool::new(false));
    // A failed assertion below stops the starters too.
    let _stop_on_drop = StopOnDrop(Arc::clone(&stop));
    let create = |path: &Path, bundle: &Path, id: &str| {
        // N.B. stderr to a file: a pipe would be inherited by the
        // container's init and never reach EOF.
        let err = tempfile::NamedTempFile::new().expect("stderr file");
        let created = std::process::Command::new(path)
            .args(["create", "--bundle", bundle.to_str().expect("utf-8"), id])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(err.reopen().expect("reopen"))
            .status()
            .expect("runc create");
        assert!(
            created.success(),
            "runc create {id}: {}",
            std::fs::read_to_string(err.path()).unwrap_or_default()
        );
    };
    let starters: Vec<_> = (0..3)
        .map(|t| {
            let (stop, path, bundle) = (Arc::clone(&stop), s.rt.path.clone(), s.bundle.clone());
            let prefix = format!("{prefix}-t{t}");
            std::thread::spawn(move || {
                let mut results = Vec::new();
                for n in 0u32..500 {
                    if stop.load(Ordering::Relaxed) && n >= 4 {
                        break;
                    }
                    let id = format!("{prefix}-{n}");
                    create(&path, &bundle, &id);
                    let started = start_container(&path, &id);
                    results.push((id, n, started));
                }
                results
            })
        })
        .collect();
    let wait_holds = |n: usize, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while held.lock().unwrap_or_else(|e| e.into_inner()).len() < n {
            assert!(
                Instant::now() < deadline,
                "fewer than {n} holds {what}\nnew agent:\n{}",
                new.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_holds(6, "in the overlap");
    // One start held at the old agent when it is told to stop.
    create(&s.rt.path, &s.bundle, &held_back);
    let late = {
        let path = s.rt.path.clone();
        let id = held_back.clone();
        std::thread::spawn(move || start_container(&path, &id))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !held
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&held_back)
    {
        assert!(Instant::now() < deadline, "no hold for {held_back}");
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(old.child.id() as i32, libc::SIGTERM) };
    until_served_by(&tokio, &s.socket, new.child.id());
    answer_held_back.notify_one();
    signal_and_reap(&mut old, 0);
    new.wait_log(
        "gate subscriber back after the takeover",
        Duration::from_secs(10),
    );
    let after = held.lock().unwrap_or_else(|e| e.into_inner()).len();
    wait_holds(after + 6, "after the handover");
    stop.store(true, Ordering::Relaxed);
    let mut results: Vec<(String, u32, bool)> = starters
        .into_iter()
        .flat_map(|t| t.join().expect("a starter"))
        .collect();
    results.push((held_back.clone(), 1, late.join().expect("the late start")));
    subscriber.abort();
    for (id, _, _) in &results {
        s.rt.cleanup(id);
    }
    let held = held.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let escaped: Vec<&String> = results
        .iter()
        .filter(|(id, n, started)| *started && (n % 2 == 1 || !held.contains(id)))
        .map(|(id, _, _)| id)
        .collect();
    let refused_allowed = results
        .iter()
        .filter(|(_, n, started)| !*started && n % 2 == 0)
        .count();
    println!(
        "upgrade: {} starts through the handover, {} escaped the gate, {refused_allowed} \
         allowed ones refused (fail-closed while the subscriber was away)",
        results.len(),
        escaped.len(),
    );
    assert!(
        escaped.is_empty(),
        "started without the gate's allow: {escaped:?}\nold agent:\n{}\nnew agent:\n{}",
        old.log(),
        new.log()
    );
}
