//! `lookout get`, `lookout watch` and `lookout gate` against the agent's own consumer API: a
//! hub with containers, served by [`crate::grpc::spawn`] on a private socket, as `lookout run`
//! serves it. What a consumer of the CLI sees is tested end to end, with no fake server.

use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lookout_client::{Client, ConnectOptions, Filter};
use lookout_model::{Container, ContainerEvent, Kubernetes, RuntimeKind, Sink, Source, Status};
use prometheus_client::registry::Registry;

use super::*;
use crate::grpc::{Auth, Health};
use crate::hub::{Hub, HubConfig, HubMetrics, HubSink};

/// An agent's consumer API with nothing behind it but its hub.
struct Served {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    hub: Arc<Hub>,
    /// The hub's metrics.
    registry: Registry,
    _health: Health,
}

impl Served {
    fn start() -> Served {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("lookout.sock");
        let mut registry = Registry::default();
        let hub = Hub::new(HubConfig::default(), HubMetrics::register(&mut registry));
        let listener = crate::grpc::bind(&socket, None).expect("bind the socket");
        let health = crate::grpc::spawn(
            listener,
            socket.clone(),
            Arc::clone(&hub),
            Auth::default(),
            Duration::from_secs(2),
            (16, 16),
        )
        .expect("serve the API");
        health.set(true);
        Served {
            _dir: dir,
            socket,
            hub,
            registry,
            _health: health,
        }
    }

    /// Waits (ten seconds at most) until `n` gate subscribers are connected.
    async fn wait_for_subscribers(&self, n: u64) {
        let want = format!("gate_subscribers {n}\n");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("metrics");
            if text.contains(&want) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "not {n} gate subscribers within 10 s:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn emit(&self, event: ContainerEvent) {
        HubSink::new(Arc::clone(&self.hub), |_: ContainerEvent| {}).emit(event);
    }

    fn add(&self, id: &str, runtime: RuntimeKind, namespace: &str, pod: &str) {
        self.add_with(id, runtime, namespace, pod, |_| {});
    }

    /// [`Served::add`], with more set on the container by `more`.
    fn add_with(
        &self,
        id: &str,
        runtime: RuntimeKind,
        namespace: &str,
        pod: &str,
        more: impl FnOnce(&mut Container),
    ) {
        let mut container = Container::new(id, runtime);
        container.status = Status::Created;
        container.pid = Some(4242);
        let mut kubernetes = Kubernetes::default();
        kubernetes.namespace = Some(namespace.into());
        kubernetes.pod = Some(pod.into());
        kubernetes.container = Some("main".into());
        container.kubernetes = Some(kubernetes);
        more(&mut container);
        self.emit(ContainerEvent::added(Source::RuntimeHook, container));
    }

    fn remove(&self, id: &str, exit: i32) {
        let (_, live) = self.hub.list(&crate::hub::Filter::default());
        let live = live
            .into_iter()
            .find(|l| l.container.id == id)
            .expect("a live container");
        self.emit(ContainerEvent::removed(
            Source::RuntimeHook,
            live.container,
            Some(exit),
        ));
    }

    fn revision(&self) -> u64 {
        self.hub.list(&crate::hub::Filter::default()).0
    }
}

/// At most ten seconds for `what`: a hung call fails the test instead of hanging it.
async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), future)
        .await
        .unwrap_or_else(|_| panic!("{what} took more than 10 s"))
}

#[tokio::test]
async fn get_lists_the_agents_containers() {
    let agent = Served::start();
    agent.add("a", RuntimeKind::Runc, "default", "web");
    let get = |output| {
        let socket = agent.socket.clone();
        async move {
            let mut out = Vec::new();
            within(
                "lookout get",
                write_get(&socket, output, Filter::all(), &mut out),
            )
            .await
            .expect("lookout get");
            String::from_utf8(out).expect("UTF-8")
        }
    };
    let table = get(GetOutput::Table).await;
    let lines: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines[0][..3], ["ID", "RUNTIME", "NAMESPACE/POD"], "{table}");
    assert_eq!(
        lines[1][..5],
        ["a", "runc", "default/web", "main", "4242"],
        "{table}"
    );
    assert_eq!(lines.len(), 2, "{table}");
    let wide = get(GetOutput::Wide).await;
    assert!(
        wide.starts_with("ID ") && wide.contains(" BUNDLE\n"),
        "{wide}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&get(GetOutput::Json).await).expect("valid JSON");
    assert_eq!(json["revision"], agent.revision());
    assert_eq!(json["containers"][0]["id"], "a");
}

#[tokio::test]
async fn get_watch_and_gate_say_when_the_agent_is_not_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let gate_options = GateOptions {
        name: "cli-test".into(),
        deadline: Duration::from_secs(2),
        fail_closed: false,
        hold: Duration::ZERO,
        deny: None,
        output: WatchOutput::Json,
    };
    let (get, watch, gate) = within("lookout get, watch and gate to give up", async {
        tokio::join!(
            super::get(&socket, GetOutput::Table, Filter::all()),
            super::watch(&socket, WatchOutput::Text, 0, Filter::all()),
            super::gate(&socket, gate_options, Filter::all()),
        )
    })
    .await;
    for error in [
        get.expect_err("no agent"),
        watch.expect_err("no agent"),
        gate.expect_err("no agent"),
    ] {
        assert!(format!("{error:#}").contains("does not exist"), "{error:#}");
    }
}

/// Takes `lines` lines, then fails as stdout does when `head` has exited.
struct Head {
    text: String,
    lines: usize,
}

impl Write for Head {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.text.matches('\n').count() >= self.lines {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        self.text.push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn watch_prints_events_until_stdout_closes() {
    let agent = Served::start();
    agent.add("a", RuntimeKind::Runc, "default", "web");
    let snapshot = agent.revision();
    let client = Client::connect_with(&agent.socket, ConnectOptions::new())
        .await
        .expect("connect");
    let watcher = client.watch(Filter::all()).await.expect("watch");
    agent.add("b", RuntimeKind::Crun, "payments", "api");
    agent.remove("a", 137);
    // The write of this one finds the pipe closed.
    agent.add("c", RuntimeKind::Runc, "default", "web");

    // `lookout watch | head -n 4`: the snapshot's line, its end, two changes.
    let mut out = Head {
        text: String::new(),
        lines: 4,
    };
    within(
        "lookout watch to stop",
        print_events(watcher, WatchOutput::Text, &mut out),
    )
    .await
    .expect("a closed pipe is not an error");
    let (added, removed) = (snapshot + 1, snapshot + 2);
    assert_eq!(
        out.text,
        format!(
            "{snapshot} SNAPSHOT a runc default/web 4242\n\
             {snapshot} SNAPSHOT_END 1\n\
             {added} ADDED b crun payments/api 4242\n\
             {removed} REMOVED a runc default/web 4242 exit=137\n"
        )
    );
}

/// The filter flags, as `lookout get`, `watch` and `gate` take them.
#[derive(clap::Parser)]
struct Flags {
    #[command(flatten)]
    filter: FilterArgs,
}

/// A pod's container as the agent knows it once the pod watch resolved
/// it: a Deployment's, in its cgroup, with its image's digest.
fn deployed(c: &mut Container, deployment: &str, cgroup_id: u64, digest: &str) {
    let mut workload = lookout_model::Workload::default();
    workload.kind = "Deployment".into();
    workload.namespace = "shop".into();
    workload.name = deployment.into();
    workload.api_version = "apps/v1".into();
    if let Some(k) = c.kubernetes.as_mut() {
        k.workload = Some(workload);
    }
    c.cgroup_id = Some(cgroup_id);
    c.kind = Some(lookout_model::ContainerKind::Regular);
    c.image_digest = Some(digest.into());
}

#[tokio::test]
async fn get_and_watch_select_by_workload_cgroup_id_and_image_digest() {
    let agent = Served::start();
    let (api, web) = (
        "registry.example/api@sha256:aaaa",
        "registry.example/web@sha256:bbbb",
    );
    agent.add_with("api", RuntimeKind::Runc, "shop", "api-1", |c| {
        deployed(c, "api", 7001, api)
    });
    agent.add_with("web", RuntimeKind::Runc, "shop", "web-1", |c| {
        deployed(c, "web", 7002, web)
    });
    // Knows none of the three: matches none of them.
    agent.add("bare", RuntimeKind::Crun, "shop", "bare");
    let flags = |args: &[&str]| {
        let mut argv = vec!["lookout"];
        argv.extend_from_slice(args);
        <Flags as clap::Parser>::try_parse_from(argv)
            .expect("valid flags")
            .filter
    };
    let get = |filter: FilterArgs| {
        let socket = agent.socket.clone();
        async move {
            let mut out = Vec::new();
            within(
                "lookout get",
                write_get(&socket, GetOutput::Json, filter.to_filter(), &mut out),
            )
            .await
            .expect("lookout get");
            let json: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
            json["containers"]
                .as_array()
                .expect("containers")
                .iter()
                .map(|c| c["id"].as_str().expect("id").to_owned())
                .collect::<Vec<_>>()
        }
    };
    for (args, ids) in [
        (&["--workload", "Deployment/shop/api"][..], &["api"][..]),
        (
            &[
                "--workload",
                "Deployment/shop/api",
                "--workload",
                "Deployment/shop/web",
            ],
            &["api", "web"],
        ),
        (&["--workload", "ReplicaSet/shop/api"], &[]),
        (&["--cgroup-id", "7002"], &["web"]),
        (&["--cgroup-id", "7003"], &[]),
        (&["--image-digest", api], &["api"]),
        // The sha256: part alone.
        (&["--image-digest", "sha256:bbbb"], &["web"]),
        // Every flag given must match.
        (&["--cgroup-id", "7001", "--image-digest", web], &[]),
        (&["--namespace", "shop", "--runtime", "crun"], &["bare"]),
        (&[], &["api", "bare", "web"]),
    ] {
        let mut got = get(flags(args)).await;
        got.sort();
        assert_eq!(got, ids, "lookout get {args:?}");
    }
    // The JSON carries the new fields, the table's wide form too.
    let mut out = Vec::new();
    within(
        "lookout get",
        write_get(
            &agent.socket,
            GetOutput::Json,
            flags(&["--cgroup-id", "7001"]).to_filter(),
            &mut out,
        ),
    )
    .await
    .expect("lookout get");
    let json: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
    let c = &json["containers"][0];
    assert_eq!(c["cgroup_id"], 7001, "{c}");
    assert_eq!(c["kind"], "regular", "{c}");
    assert_eq!(c["image_digest"], api, "{c}");
    assert_eq!(c["kubernetes"]["workload"]["kind"], "Deployment", "{c}");
    assert_eq!(c["kubernetes"]["workload"]["api_version"], "apps/v1", "{c}");

    // A watch by cgroup id: the snapshot and the changes of that container only.
    let client = Client::connect_with(&agent.socket, ConnectOptions::new())
        .await
        .expect("connect");
    let filter = flags(&["--cgroup-id", "7002", "--cgroup-id", "7004"]).to_filter();
    let watcher = client.watch(filter).await.expect("watch");
    let snapshot = agent.revision();
    agent.add_with("other", RuntimeKind::Runc, "shop", "other-1", |c| {
        deployed(c, "other", 7005, api)
    });
    agent.add_with("web2", RuntimeKind::Runc, "shop", "web-2", |c| {
        deployed(c, "web", 7004, web)
    });
    agent.remove("other", 0);
    // Its write finds the pipe closed.
    agent.remove("web2", 0);
    let mut out = Head {
        text: String::new(),
        lines: 3,
    };
    within(
        "lookout watch to stop",
        print_events(watcher, WatchOutput::Text, &mut out),
    )
    .await
    .expect("a closed pipe is not an error");
    assert_eq!(
        out.text,
        format!(
            "{snapshot} SNAPSHOT web runc shop/web-1 4242 kind=regular workload=Deployment/shop/web cgroup_id=7002 digest={web}\n\
             {snapshot} SNAPSHOT_END 1\n\
             {} ADDED web2 runc shop/web-2 4242 kind=regular workload=Deployment/shop/web cgroup_id=7004 digest={web}\n",
            snapshot + 2
        )
    );
}

/// Each `write` of the CLI (one line) sent on a channel.
struct Lines(tokio::sync::mpsc::UnboundedSender<String>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .send(String::from_utf8_lossy(buf).into_owned())
            .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn gate_holds_only_the_starts_its_cgroup_id_filter_selects() {
    use lookout_model::{StartBarrier, StartDecision};

    let agent = Served::start();
    let client = Client::connect_with(&agent.socket, ConnectOptions::new())
        .await
        .expect("connect");
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    let opts = GateOptions {
        name: "cli-filter".into(),
        deadline: Duration::from_secs(10),
        fail_closed: false,
        hold: Duration::ZERO,
        deny: Some("not this one".into()),
        output: WatchOutput::Json,
    };
    let filter = Filter::all().cgroup_id(7002);
    let gate = tokio::spawn(async move {
        let mut out = Lines(tx);
        answer_holds(&client, opts, filter, &mut out).await
    });
    agent.wait_for_subscribers(1).await;
    let barrier = crate::hub::GateBarrier(Arc::clone(&agent.hub));
    agent.add_with("api", RuntimeKind::Runc, "shop", "api-1", |c| {
        deployed(c, "api", 7001, "registry.example/api@sha256:aaaa")
    });
    agent.add_with("web", RuntimeKind::Runc, "shop", "web-1", |c| {
        deployed(c, "web", 7002, "registry.example/web@sha256:bbbb")
    });
    assert!(
        barrier.wait("api").is_none(),
        "another cgroup's start is not held"
    );
    let wait = barrier.wait("web").expect("its cgroup's start is held");
    assert_eq!(
        within("the gate's answer", wait).await,
        StartDecision::Deny("denied by gate cli-filter: not this one".into())
    );
    let line = within("the hold's line", lines.recv())
        .await
        .expect("a line");
    let hold: serde_json::Value = serde_json::from_str(&line).expect("valid JSON");
    assert_eq!(hold["id"], "web", "{hold}");
    assert_eq!(hold["held"], true, "{hold}");
    assert_eq!(hold["cgroup_id"], 7002, "{hold}");
    assert_eq!(hold["workload"], "Deployment/shop/web", "{hold}");
    assert_eq!(hold["kind"], "regular", "{hold}");
    assert!(lines.try_recv().is_err(), "one hold only");
    gate.abort();
}
