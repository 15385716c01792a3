//! What the informer tells consumers to act on at `added` (#55): the
//! workload at the top of each pod's owner chain, each container's kind
//! and its image digest, against the test API server (lookout-testsupport)
//! serving pods and their owners over real HTTP.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lookout_informer::{Config, Index, Informer, client_from_kubeconfig};
use lookout_model::{Container, ContainerEvent, ContainerKind, EventKind, Kubernetes, RuntimeKind};
use lookout_testsupport::apiserver::{ApiServer, ObjectJson, PodJson};
use tokio::sync::mpsc;

const NODE: &str = "node-a";
const DIGEST: &str = "4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d";

fn id(n: u32) -> String {
    format!("{n:064x}")
}

struct Running {
    rx: mpsc::UnboundedReceiver<ContainerEvent>,
    index: Index,
    added: HashMap<String, Arc<Container>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Running {
    /// The `added` of container `id` (deadline 15 s; in any order: a
    /// relist reports its pods' containers together).
    async fn added(&mut self, id: &str) -> Arc<Container> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(c) = self.added.remove(id) {
                return c;
            }
            let e = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("{id} added within 15 s"))
                .expect("informer still running");
            if e.event == EventKind::Added {
                self.added.insert(e.container.id.clone(), e.container);
            }
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

async fn start(server: &ApiServer) -> Running {
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client_from_kubeconfig(&server.kubeconfig(dir.path()))
        .await
        .expect("client from kubeconfig");
    let mut config = Config::new(NODE);
    config.proc_root = None;
    let informer = Informer::new(client, config);
    let index = informer.index();
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
        index,
        added: HashMap::new(),
        stop: Some(stop),
        task,
        _dir: dir,
    }
}

fn workload(c: &Container) -> (String, String, Option<String>) {
    let w = c
        .kubernetes
        .as_ref()
        .and_then(|k| k.workload.as_ref())
        .unwrap_or_else(|| panic!("a workload: {c:?}"));
    (w.key(), w.api_version.clone(), w.uid.clone())
}

fn reason(c: &Container) -> Option<&str> {
    c.unresolved.get("kubernetes.workload").map(String::as_str)
}

fn reads(server: &ApiServer, resource: &str) -> usize {
    server
        .requests()
        .iter()
        .filter(|r| r.starts_with("GET /apis/") && r.contains(&format!("/{resource}/")))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployments_pod_names_the_deployment_with_one_replicaset_read() {
    let server = ApiServer::start();
    server.put_object(ObjectJson::new("apps/v1", "Deployment", "shop", "api", "uid-deploy").json());
    server.put_object(
        ObjectJson::new("apps/v1", "ReplicaSet", "shop", "api-7d9c8b5f4", "uid-rs")
            .controlled_by("apps/v1", "Deployment", "api", "uid-deploy")
            .json(),
    );
    for (n, pod) in [(1, "api-7d9c8b5f4-a"), (2, "api-7d9c8b5f4-b")] {
        server.apply(
            PodJson::new("shop", pod, &format!("uid-{pod}"), NODE)
                .controlled_by("apps/v1", "ReplicaSet", "api-7d9c8b5f4", "uid-rs")
                .running("api", "registry.example/api:2", "containerd", &id(n))
                .json(),
        );
    }
    let mut run = start(&server).await;
    for n in [1, 2] {
        let c = run.added(&id(n)).await;
        assert_eq!(
            workload(&c),
            (
                "Deployment/shop/api".into(),
                "apps/v1".into(),
                Some("uid-deploy".into())
            )
        );
        assert_eq!(reason(&c), None, "{c:?}");
        assert_eq!(c.kind, Some(ContainerKind::Regular));
        assert_eq!(
            c.image_digest.as_deref(),
            Some(format!("registry.example/api:2@sha256:{DIGEST}").as_str())
        );
    }
    // Both pods' owner from one (metadata-only) read; the Deployment is
    // the top without a read.
    assert_eq!(reads(&server, "replicasets"), 1, "{:?}", server.requests());
    assert_eq!(reads(&server, "deployments"), 0, "{:?}", server.requests());
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cronjobs_pod_names_the_cronjob() {
    let server = ApiServer::start();
    server.put_object(
        ObjectJson::new("batch/v1", "Job", "ops", "backup-29410", "uid-job")
            .controlled_by("batch/v1", "CronJob", "backup", "uid-cron")
            .json(),
    );
    server.apply(
        PodJson::new("ops", "backup-29410-x", "uid-p", NODE)
            .controlled_by("batch/v1", "Job", "backup-29410", "uid-job")
            .running("backup", "backup:1", "containerd", &id(1))
            .json(),
    );
    let mut run = start(&server).await;
    let c = run.added(&id(1)).await;
    assert_eq!(
        workload(&c),
        (
            "CronJob/ops/backup".into(),
            "batch/v1".into(),
            Some("uid-cron".into())
        )
    );
    assert_eq!(reason(&c), None);
    assert_eq!(reads(&server, "cronjobs"), 0);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_or_replaced_replicaset_leaves_the_deepest_owner_known_and_why() {
    let server = ApiServer::start();
    // The pod's ReplicaSet is gone; another pod's was deleted and made
    // again under its name (a new uid): not the pod's owner.
    server.put_object(
        ObjectJson::new("apps/v1", "ReplicaSet", "default", "again-rs", "uid-new")
            .controlled_by("apps/v1", "Deployment", "again", "uid-d")
            .json(),
    );
    server.apply(
        PodJson::new("default", "gone-0", "uid-p1", NODE)
            .controlled_by("apps/v1", "ReplicaSet", "gone-rs", "uid-gone")
            .running("c", "img:1", "containerd", &id(1))
            .json(),
    );
    server.apply(
        PodJson::new("default", "again-0", "uid-p2", NODE)
            .controlled_by("apps/v1", "ReplicaSet", "again-rs", "uid-old")
            .running("c", "img:1", "containerd", &id(2))
            .json(),
    );
    let mut run = start(&server).await;
    let c = run.added(&id(1)).await;
    assert_eq!(
        workload(&c),
        (
            "ReplicaSet/default/gone-rs".into(),
            "apps/v1".into(),
            Some("uid-gone".into())
        )
    );
    let why = reason(&c).expect("a reason");
    assert!(why.contains("not found (404)"), "{why}");
    let c = run.added(&id(2)).await;
    assert_eq!(workload(&c).0, "ReplicaSet/default/again-rs");
    let why = reason(&c).expect("a reason");
    assert!(why.contains("was replaced"), "{why}");
    run.stop().await;
}

/// Log lines, for the one warning.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// A current-thread runtime: the informer's task logs on this thread, where
// the test's subscriber is the default.
#[tokio::test(flavor = "current_thread")]
async fn forbidden_replicaset_reads_warn_once_and_stop_at_the_replicaset() {
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let server = ApiServer::start();
    server.forbid("apps", "replicasets", true);
    for n in 1..=3 {
        server.apply(
            PodJson::new("default", &format!("web{n}-0"), &format!("uid-{n}"), NODE)
                .controlled_by(
                    "apps/v1",
                    "ReplicaSet",
                    &format!("web{n}-rs"),
                    &format!("rs-{n}"),
                )
                .running("c", "img:1", "containerd", &id(n))
                .json(),
        );
    }
    let mut run = start(&server).await;
    for n in 1..=3 {
        let c = run.added(&id(n)).await;
        assert_eq!(workload(&c).0, format!("ReplicaSet/default/web{n}-rs"));
        let why = reason(&c).expect("a reason");
        assert!(
            why.contains("forbidden (403)") && why.contains("replicasets"),
            "{why}"
        );
    }
    run.stop().await;
    let text =
        String::from_utf8_lossy(&log.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned();
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("403 Forbidden"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning:\n{text}");
    assert!(
        warnings[0].contains("WARN")
            && warnings[0].contains("get on replicasets in API group \"apps\""),
        "names the missing rule: {}",
        warnings[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_loop_ends_and_a_bare_pod_is_its_own_workload() {
    let server = ApiServer::start();
    server.put_object(
        ObjectJson::new("apps/v1", "ReplicaSet", "default", "a", "uid-a")
            .controlled_by("apps/v1", "ReplicaSet", "b", "uid-b")
            .json(),
    );
    server.put_object(
        ObjectJson::new("apps/v1", "ReplicaSet", "default", "b", "uid-b")
            .controlled_by("apps/v1", "ReplicaSet", "a", "uid-a")
            .json(),
    );
    server.apply(
        PodJson::new("default", "loop-0", "uid-loop", NODE)
            .controlled_by("apps/v1", "ReplicaSet", "a", "uid-a")
            .running("c", "img:1", "containerd", &id(1))
            .json(),
    );
    server.apply(
        PodJson::new("default", "bare", "uid-bare", NODE)
            .without_owner()
            .running("c", "img:1", "containerd", &id(2))
            .json(),
    );
    // A controller of a kind that is not read (an Argo Rollout's).
    server.apply(
        PodJson::new("default", "ro-0", "uid-ro", NODE)
            .controlled_by("argoproj.io/v1alpha1", "Rollout", "ro", "uid-rollout")
            .running("c", "img:1", "containerd", &id(3))
            .json(),
    );
    let mut run = start(&server).await;
    let c = run.added(&id(1)).await;
    assert_eq!(workload(&c).0, "ReplicaSet/default/b");
    let why = reason(&c).expect("a reason");
    assert!(why.contains("owner loop"), "{why}");
    let c = run.added(&id(2)).await;
    assert_eq!(
        workload(&c),
        (
            "Pod/default/bare".into(),
            "v1".into(),
            Some("uid-bare".into())
        )
    );
    assert_eq!(reason(&c), None);
    let c = run.added(&id(3)).await;
    assert_eq!(
        workload(&c),
        (
            "Rollout/default/ro".into(),
            "argoproj.io/v1alpha1".into(),
            Some("uid-rollout".into())
        )
    );
    assert!(
        server.requests().iter().all(|r| !r.contains("rollouts")),
        "{:?}",
        server.requests()
    );
    assert_eq!(
        reason(&c),
        None,
        "a kind not of Kubernetes' own is what it says"
    );
    run.stop().await;
}

/// Any pod creator can name any owner. Two claims never come from a
/// controller, and are reported as claims: a kind of Kubernetes' own in
/// another API group, and a Deployment named by the pod itself (a
/// Deployment's pods are its ReplicaSets').
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_no_controller_would_set_are_reported_as_claims() {
    let server = ApiServer::start();
    server.apply(
        PodJson::new("shop", "fake-0", "uid-fake", NODE)
            .controlled_by("x.example/v1", "Deployment", "api", "uid-x")
            .running("c", "img:1", "containerd", &id(1))
            .json(),
    );
    server.apply(
        PodJson::new("shop", "direct-0", "uid-direct", NODE)
            .controlled_by("apps/v1", "Deployment", "api", "uid-d")
            .running("c", "img:1", "containerd", &id(2))
            .json(),
    );
    server.apply(
        PodJson::new("shop", "sts-0", "uid-sts", NODE)
            .controlled_by("apps/v1", "StatefulSet", "db", "uid-sts-owner")
            .running("c", "img:1", "containerd", &id(3))
            .json(),
    );
    let mut run = start(&server).await;
    let c = run.added(&id(1)).await;
    assert_eq!(workload(&c).0, "Deployment/shop/api");
    let why = reason(&c).expect("a reason");
    assert!(why.contains("not Kubernetes' own"), "{why}");
    let c = run.added(&id(2)).await;
    assert_eq!(workload(&c).0, "Deployment/shop/api");
    let why = reason(&c).expect("a reason");
    assert!(why.contains("never owns pods itself"), "{why}");
    let c = run.added(&id(3)).await;
    assert_eq!(workload(&c).0, "StatefulSet/shop/db");
    assert_eq!(reason(&c), None);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinds_and_image_references_from_the_pod_and_enrichment_by_uid_and_name() {
    let server = ApiServer::start();
    server.apply(
        PodJson::new("default", "dbg-0", "uid-dbg", NODE)
            .without_owner()
            .running_init("proxy", "envoy:1", "containerd", &id(1))
            .running("app", "app:1", "containerd", &id(2))
            .ephemeral("debugger", "busybox", "containerd", &id(3))
            .running("legacy", "legacy:1", "docker", &id(4))
            .image_id(
                "legacy",
                &format!("docker-pullable://legacy@sha256:{DIGEST}"),
            )
            .running("local", "local:dev", "docker", &id(5))
            .image_id("local", &format!("docker://sha256:{DIGEST}"))
            .json(),
    );
    let mut run = start(&server).await;
    let c = run.added(&id(1)).await;
    assert_eq!(c.kind, Some(ContainerKind::Init));
    let c = run.added(&id(2)).await;
    assert_eq!(c.kind, Some(ContainerKind::Regular));
    assert_eq!(
        c.image_digest.as_deref(),
        Some(format!("app:1@sha256:{DIGEST}").as_str())
    );
    let c = run.added(&id(3)).await;
    assert_eq!(c.kind, Some(ContainerKind::Ephemeral));
    assert_eq!(
        (c.image_digest.as_deref(), c.image_id.as_deref()),
        (None, None)
    );
    let c = run.added(&id(4)).await;
    assert_eq!(
        c.image_digest.as_deref(),
        Some(format!("legacy@sha256:{DIGEST}").as_str()),
        "the docker-pullable:// prefix goes"
    );
    let c = run.added(&id(5)).await;
    assert_eq!(
        (c.image_digest.as_deref(), c.image_id.as_deref()),
        (None, Some(format!("sha256:{DIGEST}").as_str()))
    );

    // A container another backend reports at create, before any status
    // names it: by its CRI annotations' pod uid and container name it gets
    // the workload and kind, not an image digest.
    let annotated = |name: Option<&str>| {
        let mut c = Container::new(id(9), RuntimeKind::Runc);
        let mut k = Kubernetes::default();
        k.pod_uid = Some("uid-dbg".into());
        k.container = name.map(str::to_owned);
        c.kubernetes = Some(k);
        c
    };
    let mut c = annotated(Some("app"));
    run.index.enrich(&mut c);
    assert_eq!(c.kind, Some(ContainerKind::Regular));
    assert_eq!(workload(&c).0, "Pod/default/dbg-0");
    assert_eq!(c.image_digest, None);
    let mut c = annotated(Some("proxy"));
    run.index.enrich(&mut c);
    assert_eq!(c.kind, Some(ContainerKind::Init));
    // The pod's sandbox stays a sandbox.
    let mut sandbox = annotated(None);
    sandbox.pod_sandbox = true;
    sandbox.kind = Some(ContainerKind::Sandbox);
    run.index.enrich(&mut sandbox);
    assert_eq!(sandbox.kind, Some(ContainerKind::Sandbox));
    assert_eq!(workload(&sandbox).0, "Pod/default/dbg-0");
    // Nothing more to add: no copy of a shared record.
    assert!(run.index.enrichment(&sandbox).is_none());
    // By id: what the informer saw running.
    let mut c = Container::new(id(2), RuntimeKind::Runc);
    run.index.enrich(&mut c);
    assert_eq!(c.kind, Some(ContainerKind::Regular));
    assert!(c.image_digest.is_some());
    assert_eq!(workload(&c).0, "Pod/default/dbg-0");
    run.stop().await;
}
