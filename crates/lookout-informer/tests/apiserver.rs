//! The informer against the test API server (lookout-testsupport): real
//! HTTP and JSON, the list/watch protocol, 410 Gone, bookmarks and cut
//! connections. No kube-apiserver can run on the test machines; the server
//! is a faithful stand-in for the parts a node agent uses.

use std::time::Duration;

use lookout_informer::{Config, Informer, client_from_kubeconfig};
use lookout_model::{ContainerEvent, EventKind, Source};
use lookout_testsupport::apiserver::{ApiServer, PodJson};
use tokio::sync::mpsc;

const NODE: &str = "node-a";

fn id(n: u32) -> String {
    format!("{n:064x}")
}

struct Running {
    rx: mpsc::UnboundedReceiver<ContainerEvent>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn next(&mut self) -> ContainerEvent {
        tokio::time::timeout(Duration::from_secs(15), self.rx.recv())
            .await
            .expect("an event within 15 s")
            .expect("informer still running")
    }

    /// `n` events, sorted as "+id"/"-id[:code]".
    async fn take(&mut self, n: usize) -> Vec<String> {
        let mut v = Vec::new();
        for _ in 0..n {
            let e = self.next().await;
            assert_eq!(e.source, Source::Informer);
            v.push(match e.event {
                EventKind::Added => format!("+{}", &e.container.id[60..]),
                EventKind::Removed => format!(
                    "-{}{}",
                    &e.container.id[60..],
                    e.exit_code.map(|c| format!(":{c}")).unwrap_or_default()
                ),
                EventKind::Updated => panic!("the informer sends no updates: {e:?}"),
            });
        }
        v.sort();
        v
    }

    async fn quiet(&mut self, for_: Duration) {
        if let Ok(Some(e)) = tokio::time::timeout(for_, self.rx.recv()).await {
            panic!("unexpected event: {e:?}");
        }
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("informer stops on shutdown")
            .expect("informer task");
    }
}

async fn start(
    server: &ApiServer,
    dir: &std::path::Path,
    proc_root: Option<&std::path::Path>,
) -> Running {
    let client = client_from_kubeconfig(&server.kubeconfig(dir))
        .await
        .expect("client from kubeconfig");
    let mut config = Config::new(NODE);
    config.proc_root = proc_root.map(|p| p.to_path_buf());
    let informer = Informer::new(client, config);
    let (tx, rx) = mpsc::unbounded_channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut sink = move |e: ContainerEvent| {
            let _ = tx.send(e);
        };
        informer
            .run(&mut sink, async {
                let _ = stopped.await;
            })
            .await;
    });
    Running {
        rx,
        stop: Some(stop),
        task,
    }
}

/// Waits (deadline 15 s) until the server has opened `n` watches: a watch
/// the test means to cut must exist first.
async fn wait_for_watches(server: &ApiServer, n: u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while server.watches_opened() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} watch(es) within 15 s: {:?}",
            server.requests()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_add_update_restart_delete_and_other_nodes() {
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // A fake /proc where container 1's init is pid 4242.
    let proc_root = dir.path().join("proc");
    std::fs::create_dir_all(proc_root.join("4242")).expect("mkdir");
    std::fs::write(
        proc_root.join("4242/cgroup"),
        format!(
            "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{}.scope\n",
            id(1)
        ),
    )
    .expect("cgroup");
    server.apply(
        PodJson::new("default", "web-0", "uid-web", NODE)
            .running("nginx", "nginx:1.27", "containerd", &id(1))
            .json(),
    );
    server.apply(
        PodJson::new("default", "far-0", "uid-far", "node-b")
            .running("c", "img", "containerd", &id(9))
            .json(),
    );
    let mut run = start(&server, dir.path(), Some(&proc_root)).await;

    // Initial list: only this node's pod.
    let e = run.next().await;
    assert_eq!((e.event, &e.container.id), (EventKind::Added, &id(1)));
    assert_eq!(e.container.pid, Some(4242), "pid resolved from the cgroup");
    let k = e
        .container
        .kubernetes
        .as_ref()
        .expect("kubernetes metadata");
    assert_eq!(
        (
            k.namespace.as_deref(),
            k.pod.as_deref(),
            k.container.as_deref()
        ),
        (Some("default"), Some("web-0"), Some("nginx"))
    );
    assert_eq!(k.labels.get("app").map(String::as_str), Some("web"));
    assert_eq!(e.container.runtime.as_str(), "containerd");
    let list = server
        .requests()
        .into_iter()
        .find(|r| !r.contains("watch"))
        .expect("a list request");
    assert!(
        list.contains("fieldSelector=spec.nodeName%3Dnode-a"),
        "{list}"
    );

    // Add (with an init container that already finished), update that
    // changes nothing, restart, other node's change, delete.
    server.apply(
        PodJson::new("default", "db-0", "uid-db", NODE)
            .terminated("init", "busybox", "containerd", &id(3), 0, true)
            .running("pg", "postgres:17", "containerd", &id(2))
            .json(),
    );
    assert_eq!(run.take(1).await, ["+0002"]);
    server.apply(
        PodJson::new("default", "db-0", "uid-db", NODE)
            .terminated("init", "busybox", "containerd", &id(3), 0, true)
            .running("pg", "postgres:17", "containerd", &id(2))
            .json(),
    );
    server.apply(
        PodJson::new("default", "far-0", "uid-far", "node-b")
            .running("c", "img", "containerd", &id(10))
            .json(),
    );
    server.apply(
        PodJson::new("default", "web-0", "uid-web", NODE)
            .restarted("nginx", "nginx:1.27", "containerd", &id(1), 137, &id(4))
            .json(),
    );
    assert_eq!(run.take(2).await, ["+0004", "-0001:137"]);
    server.delete("default", "db-0");
    assert_eq!(run.take(1).await, ["-0002"]);
    // A CRI-O pod and an ephemeral container.
    server.apply(
        PodJson::new("kube-system", "dns-0", "uid-dns", NODE)
            .running("dns", "coredns", "cri-o", &id(5))
            .ephemeral("debugger", "busybox", "cri-o", &id(6))
            .json(),
    );
    assert_eq!(run.take(2).await, ["+0005", "+0006"]);
    run.quiet(Duration::from_millis(500)).await;
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_gone_relists_and_reports_only_what_changed() {
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    server.apply(
        PodJson::new("ns", "a-0", "ua", NODE)
            .running("c", "img", "containerd", &id(1))
            .json(),
    );
    server.apply(
        PodJson::new("ns", "b-0", "ub", NODE)
            .running("c", "img", "containerd", &id(2))
            .json(),
    );
    let mut run = start(&server, dir.path(), None).await;
    assert_eq!(run.take(2).await, ["+0001", "+0002"]);
    wait_for_watches(&server, 1).await;

    // The watch breaks and cannot come back for a while; meanwhile a pod
    // goes, another comes, and the history is compacted away.
    let before = server.requests().len();
    server.fail_next(u32::MAX);
    server.drop_watches();
    // Until the informer has tried again and been refused.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while server.requests().len() == before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a retry after the cut within 15 s: {:?}",
            server.requests()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.delete("ns", "a-0");
    server.apply(
        PodJson::new("ns", "c-0", "uc", NODE)
            .running("c", "img", "containerd", &id(3))
            .json(),
    );
    server.compact();
    server.fail_next(0);

    // The re-watch gets 410 Gone, the informer lists again, and reports
    // exactly the difference: no duplicate for b-0.
    assert_eq!(run.take(2).await, ["+0003", "-0001"]);
    run.quiet(Duration::from_millis(800)).await;
    let lists = server
        .requests()
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/pods") && !r.contains("watch=true"))
        .count();
    assert!(lists >= 2, "a relist after 410: {:?}", server.requests());
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_watch_resumes_from_the_last_bookmark_without_relisting() {
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    server.apply(
        PodJson::new("ns", "a-0", "ua", NODE)
            .running("c", "img", "containerd", &id(1))
            .json(),
    );
    let mut run = start(&server, dir.path(), None).await;
    assert_eq!(run.take(1).await, ["+0001"]);
    wait_for_watches(&server, 1).await;
    let watch = server
        .requests()
        .into_iter()
        .find(|r| r.contains("watch=true"));
    let watch = watch.expect("a watch request");
    assert!(watch.contains("allowWatchBookmarks=true"), "{watch}");

    // Changes on other nodes move the version on; a bookmark tells us.
    for n in 0..5 {
        server.apply(PodJson::new("ns", &format!("x-{n}"), &format!("ux{n}"), "node-b").json());
    }
    // The cut right after the bookmark, without a pause: the server's
    // watch gets the two in order (one broadcast channel), flushes the
    // BOOKMARK frame before it fails the connection, and the client passes
    // each line on as it reads it, so the informer has the bookmark's
    // version before it sees the cut.
    server.bookmark();
    let rv = server.resource_version();
    let watches_before = server.watches_opened();
    server.drop_watches();
    server.apply(
        PodJson::new("ns", "b-0", "ub", NODE)
            .running("c", "img", "containerd", &id(2))
            .json(),
    );
    assert_eq!(run.take(1).await, ["+0002"]);
    run.quiet(Duration::from_millis(500)).await;

    let reqs = server.requests();
    let rewatch = reqs
        .iter()
        .filter(|r| r.contains("watch=true"))
        .nth(watches_before as usize)
        .expect("a second watch");
    assert!(
        rewatch.contains(&format!("resourceVersion={rv}")),
        "resumed from the bookmark's version {rv}: {rewatch}"
    );
    let lists = reqs
        .iter()
        .filter(|r| !r.contains("watch=true") && r.contains("/api/v1/pods"))
        .count();
    assert_eq!(lists, 1, "no relist after a dropped connection: {reqs:?}");
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_are_retried_and_never_end_the_informer() {
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    server.fail_next(2);
    server.apply(
        PodJson::new("ns", "a-0", "ua", NODE)
            .running("c", "img", "containerd", &id(1))
            .json(),
    );
    let mut run = start(&server, dir.path(), None).await;
    assert_eq!(run.take(1).await, ["+0001"]);
    let failed = server.requests().len();
    assert!(
        failed >= 3,
        "two failures, then a list: {:?}",
        server.requests()
    );
    run.stop().await;
}

/// The pid of a container is found by its cgroup's name, and any user who
/// owns a delegated cgroup subtree (`user@UID.service`, rootless podman)
/// can name a cgroup of theirs after a container and move an older
/// process in. Such a cgroup is not root's: its processes are never taken
/// for the container's (their namespaces and cgroup would become the
/// container's keys in tracers' maps).
#[test]
fn a_users_cgroup_named_after_a_container_gives_no_pid() {
    use std::os::unix::process::CommandExt;
    let Some(user) = lookout_testsupport::unprivileged_user("informer_cgroup_squat") else {
        return;
    };
    let Ok(root) = lookout_host::kernel::find_cgroup2_root(std::path::Path::new("/")) else {
        lookout_testsupport::skip("informer_cgroup_squat", "no cgroup v2 tree");
        return;
    };
    let id = format!("{:064x}", 0xfeed_0000_u64 + u64::from(std::process::id()));
    let top = root.join(format!("lookout-test-squat-{}", std::process::id()));
    let cg = top.join(format!("cri-containerd-{id}.scope"));
    std::fs::create_dir_all(&cg).expect("make the cgroups");
    let procs = cg.join("cgroup.procs");
    let mut child = std::process::Command::new("sleep");
    child.arg("30");
    let procs_c = std::ffi::CString::new(procs.to_str().expect("utf-8")).expect("no NUL");
    // SAFETY: only async-signal-safe calls (open, write, close) between
    // fork and exec, on a path made before the fork.
    unsafe {
        child.pre_exec(move || {
            let fd = libc::open(procs_c.as_ptr(), libc::O_WRONLY);
            if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(fd);
            Ok(())
        });
    }
    let mut child = child.spawn().expect("start a process in the cgroup");
    let wanted: std::collections::HashSet<String> = [id.clone()].into();
    let proc_root = std::path::Path::new("/proc");
    // Root's cgroup: its process is the container's.
    let found = lookout_informer::find_pids(proc_root, &wanted);
    // The same cgroup, the user's: nothing.
    let chown = |uid: u32, gid: u32| {
        std::os::unix::fs::chown(&cg, Some(uid), Some(gid)).expect("chown the cgroup")
    };
    chown(user.uid, user.gid);
    let squatted = lookout_informer::find_pids(proc_root, &wanted);
    chown(0, 0);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir(&cg);
    let _ = std::fs::remove_dir(&top);
    assert_eq!(found.get(&id), Some(&child.id()), "root's cgroup");
    assert!(
        squatted.is_empty(),
        "a user's cgroup gave a pid: {squatted:?}"
    );
}
