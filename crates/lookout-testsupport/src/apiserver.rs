//! A Kubernetes API server for tests: real HTTP, real JSON, the list and
//! watch protocol for Pods, and a recorder for posted Events.
//!
//! No kube-apiserver can run on the test machines, so this server speaks
//! the parts of the protocol that a node agent uses, the way the real one
//! does:
//!
//! - `GET /api/v1/pods` lists (`PodList` with `metadata.resourceVersion`),
//!   honours `fieldSelector=spec.nodeName=X` (other selectors are a 400,
//!   as for a field the server does not index), `limit` and `continue`
//!   (pages come from one snapshot).
//! - `GET /api/v1/pods?watch=true&resourceVersion=N` streams newline-
//!   separated `{"type":"ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR",
//!   "object":...}` frames: first every change after `N`, then live ones.
//!   A version older than the last [`ApiServer::compact`] gets an `ERROR`
//!   frame with a 410 `Expired` Status, like an etcd compaction.
//!   `allowWatchBookmarks=true` gets a `BOOKMARK` after every
//!   [`ApiServer::bookmark`] call; `timeoutSeconds` ends the stream.
//! - [`ApiServer::drop_watches`] cuts every open watch mid-stream (the
//!   connection fails), as a restarting API server or load balancer does.
//! - `POST`/`PATCH` of `events.k8s.io/v1` and core `v1` Events are
//!   recorded ([`ApiServer::events`]) and echoed back.
//! - [`ApiServer::fail_next`] makes the next requests fail with a 500.
//! - Pods' owners: see [`objects`] ([`ApiServer::put_object`], [`ApiServer::forbid`]).
//!
//! The server runs on its own thread and tokio runtime, so sync and async
//! tests can use it alike. [`ApiServer::kubeconfig`] writes a kubeconfig
//! pointing at it.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::broadcast;

pub mod objects;
pub use objects::ObjectJson;

/// One change in the server's history.
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    kind: &'static str,
    pod: Value,
}

/// What goes to open watches.
#[derive(Debug, Clone)]
enum Live {
    Change(Change),
    Bookmark(u64),
    Drop,
}

#[derive(Debug, Default)]
struct Inner {
    rv: u64,
    /// (namespace, name) -> pod.
    pods: BTreeMap<(String, String), Value>,
    history: Vec<Change>,
    /// Versions at or below this one were compacted away.
    compacted: u64,
    /// List snapshots for `continue`, by token.
    pages: HashMap<String, Vec<Value>>,
    events: Vec<Value>,
    objects: objects::Objects,
    requests: Vec<String>,
    fail_next: u32,
    watches_opened: u32,
}

#[derive(Clone)]
struct ServerState {
    inner: Arc<Mutex<Inner>>,
    live: broadcast::Sender<Live>,
}

impl ServerState {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A test that panicked while holding the lock poisons it; the data
        // is still what the test wrote.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The running server. Dropping it stops it.
pub struct ApiServer {
    shared: ServerState,
    url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer").field("url", &self.url).finish()
    }
}

impl ApiServer {
    /// Starts a server on an ephemeral port of 127.0.0.1.
    pub fn start() -> ApiServer {
        let (live, _) = broadcast::channel(4096);
        let shared = ServerState {
            inner: Arc::new(Mutex::new(Inner {
                rv: 100,
                ..Inner::default()
            })),
            live,
        };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let url = format!(
            "http://{}",
            listener.local_addr().expect("listener address")
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = Router::new()
            .route("/api/v1/pods", get(pods))
            .route("/version", get(version))
            .route("/api/v1/namespaces/{ns}/events", post(event))
            .route("/apis/events.k8s.io/v1/namespaces/{ns}/events", post(event))
            .route(
                "/apis/events.k8s.io/v1/namespaces/{ns}/events/{name}",
                axum::routing::patch(event_patch),
            )
            .route(
                "/api/v1/namespaces/{ns}/events/{name}",
                axum::routing::patch(event_patch),
            )
            .merge(objects::router())
            .fallback(not_found)
            .with_state(shared.clone());
        let thread = std::thread::Builder::new()
            .name("test-apiserver".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("tokio runtime");
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("tokio listener");
                    let _ = axum::serve(listener, app)
                        .with_graceful_shutdown(async {
                            let _ = stopped.await;
                        })
                        .await;
                });
                rt.shutdown_timeout(std::time::Duration::from_millis(100));
            })
            .expect("server thread");
        ApiServer {
            shared,
            url,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Writes a kubeconfig for this server into `dir` and returns its path.
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: default\n\
             current-context: test\nusers:\n- name: test\n  user:\n    token: test-token\n",
            self.url
        );
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// Creates or replaces a pod (ADDED or MODIFIED), stamping a new
    /// `metadata.resourceVersion`. Returns that version.
    pub fn apply(&self, mut pod: Value) -> u64 {
        let mut s = self.shared.lock();
        s.rv += 1;
        let rv = s.rv;
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = key_of(&pod);
        let kind = if s.pods.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        s.pods.insert(key, pod.clone());
        let change = Change { rv, kind, pod };
        s.history.push(change.clone());
        let _ = self.shared.live.send(Live::Change(change));
        rv
    }

    /// Deletes a pod (DELETED, with its last state). Returns whether it
    /// existed.
    pub fn delete(&self, namespace: &str, name: &str) -> bool {
        let mut s = self.shared.lock();
        let Some(mut pod) = s.pods.remove(&(namespace.to_owned(), name.to_owned())) else {
            return false;
        };
        s.rv += 1;
        let rv = s.rv;
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        let change = Change {
            rv,
            kind: "DELETED",
            pod,
        };
        s.history.push(change.clone());
        let _ = self.shared.live.send(Live::Change(change));
        true
    }

    /// Forgets the history: a watch from any version before now gets
    /// 410 Gone and the client must list again.
    pub fn compact(&self) {
        let mut s = self.shared.lock();
        s.compacted = s.rv;
        s.history.clear();
    }

    /// Sends a BOOKMARK with the current version to every watch that asked
    /// for bookmarks.
    pub fn bookmark(&self) {
        let rv = self.shared.lock().rv;
        let _ = self.shared.live.send(Live::Bookmark(rv));
    }

    /// Cuts every open watch connection mid-stream.
    pub fn drop_watches(&self) {
        let _ = self.shared.live.send(Live::Drop);
    }

    /// Makes the next `n` pod requests fail with 500 Internal Server Error.
    pub fn fail_next(&self, n: u32) {
        self.shared.lock().fail_next = n;
    }

    /// The Events posted or patched so far (request bodies).
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }

    /// Every request so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().requests.clone()
    }

    /// How many watches were opened so far.
    pub fn watches_opened(&self) -> u32 {
        self.shared.lock().watches_opened
    }

    /// The current resource version.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.shared.live.send(Live::Drop);
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn key_of(pod: &Value) -> (String, String) {
    let m = &pod["metadata"];
    (
        m["namespace"].as_str().unwrap_or("default").to_owned(),
        m["name"].as_str().unwrap_or_default().to_owned(),
    )
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = status_object(code.as_u16(), reason, message);
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn query_map(raw: Option<&str>) -> HashMap<String, String> {
    let mut m = HashMap::new();
    for pair in raw.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        m.insert(percent_decode(k), percent_decode(v));
    }
    m
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The node a field selector asks for: `Ok(None)` for no selector.
fn node_selector(q: &HashMap<String, String>) -> Result<Option<String>, Box<Response>> {
    let Some(sel) = q.get("fieldSelector").filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    match sel.split_once('=') {
        Some(("spec.nodeName", node)) => Ok(Some(node.trim_start_matches('=').to_owned())),
        _ => Err(Box::new(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!("\"{sel}\" is not a known field selector: only \"spec.nodeName\" is indexed"),
        ))),
    }
}

fn on_node(pod: &Value, node: Option<&str>) -> bool {
    node.is_none_or(|n| pod["spec"]["nodeName"].as_str() == Some(n))
}

async fn version(State(shared): State<ServerState>) -> Response {
    shared.lock().requests.push("GET /version".to_owned());
    let body = json!({
        "major": "1", "minor": "34", "emulationMajor": "1", "emulationMinor": "34",
        "minCompatibilityMajor": "1", "minCompatibilityMinor": "33",
        "gitVersion": "v1.34.2", "gitCommit": "8cc511e399b929453cd98ae65b419c3cc227ec79",
        "gitTreeState": "clean", "buildDate": "2026-11-11T19:05:24Z", "goVersion": "go1.24.9",
        "compiler": "gc", "platform": "linux/amd64"
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn not_found(method: Method, uri: Uri, State(shared): State<ServerState>) -> Response {
    shared.lock().requests.push(format!("{method} {uri}"));
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("the server could not find the requested resource ({uri})"),
    )
}

async fn pods(State(shared): State<ServerState>, uri: Uri, RawQuery(raw): RawQuery) -> Response {
    let q = query_map(raw.as_deref());
    // One lock from recording the request to answering it (or, for a
    // watch, to subscribing it): a test's `fail_next`, `drop_watches` or
    // change then falls wholly before or wholly after each request, as with
    // a real API server. With two locks a watch recorded before a
    // `drop_watches` could subscribe after it and never be cut.
    let mut s = shared.lock();
    s.requests.push(format!("GET {uri}"));
    if s.fail_next > 0 {
        s.fail_next -= 1;
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "injected failure",
        );
    }
    let node = match node_selector(&q) {
        Ok(n) => n,
        Err(r) => return *r,
    };
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        watch(&mut s, &shared.live, q, node)
    } else {
        list(&mut s, q, node)
    }
}

fn list(s: &mut Inner, q: HashMap<String, String>, node: Option<String>) -> Response {
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|&l| l > 0)
        .unwrap_or(usize::MAX);
    let (rv, items, offset) = match q.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let Some((rv, offset)) = token
                .split_once(':')
                .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<usize>().ok()?)))
            else {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "invalid continue token",
                );
            };
            let Some(items) = s.pages.get(token).cloned() else {
                return status(
                    StatusCode::GONE,
                    "Expired",
                    "the provided continue parameter is too old",
                );
            };
            (rv, items, offset)
        }
        None => {
            let items: Vec<Value> = s
                .pods
                .values()
                .filter(|p| on_node(p, node.as_deref()))
                .cloned()
                .collect();
            (s.rv, items, 0)
        }
    };
    let end = offset.saturating_add(limit).min(items.len());
    let page: Vec<Value> = items[offset.min(items.len())..end].to_vec();
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if end < items.len() {
        let token = format!("{rv}:{end}");
        s.pages.insert(token.clone(), items);
        metadata["continue"] = json!(token);
        metadata["remainingItemCount"] = json!(0);
    }
    let body = json!({
        "kind": "PodList",
        "apiVersion": "v1",
        "metadata": metadata,
        "items": page,
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn frame(kind: &str, object: &Value) -> Result<Bytes, std::io::Error> {
    let mut line = json!({ "type": kind, "object": object }).to_string();
    line.push('\n');
    Ok(Bytes::from(line))
}

fn watch(
    s: &mut Inner,
    live: &broadcast::Sender<Live>,
    q: HashMap<String, String>,
    node: Option<String>,
) -> Response {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1800);
    // Replay and subscribe under the request's lock: nothing falls in
    // between.
    let (backlog, mut rx, gone) = {
        s.watches_opened += 1;
        let gone = from != 0 && from < s.compacted;
        let backlog: Vec<Change> = if gone {
            Vec::new()
        } else if from == 0 {
            // resourceVersion unset or 0: the current state as ADDED.
            s.pods
                .values()
                .map(|p| Change {
                    rv: s.rv,
                    kind: "ADDED",
                    pod: p.clone(),
                })
                .collect()
        } else {
            s.history.iter().filter(|c| c.rv > from).cloned().collect()
        };
        (backlog, live.subscribe(), gone)
    };
    let stream = async_stream::stream! {
        if gone {
            yield frame(
                "ERROR",
                &status_object(410, "Expired", &format!("too old resource version: {from}")),
            );
            return;
        }
        for c in backlog {
            if on_node(&c.pod, node.as_deref()) {
                yield frame(c.kind, &c.pod);
            }
        }
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(timeout);
        loop {
            let next = tokio::time::timeout_at(deadline, rx.recv()).await;
            match next {
                Err(_) => return, // timeoutSeconds: a clean end
                Ok(Ok(Live::Change(c))) => {
                    if c.rv > from && on_node(&c.pod, node.as_deref()) {
                        yield frame(c.kind, &c.pod);
                    }
                }
                Ok(Ok(Live::Bookmark(rv))) => {
                    if bookmarks {
                        yield frame(
                            "BOOKMARK",
                            &json!({
                                "kind": "Pod",
                                "apiVersion": "v1",
                                "metadata": { "resourceVersion": rv.to_string() },
                            }),
                        );
                    }
                }
                Ok(Ok(Live::Drop)) | Ok(Err(broadcast::error::RecvError::Closed)) => {
                    // A frame yielded just before (a BOOKMARK sent right
                    // before `drop_watches`) is still in hyper's write
                    // buffer: hyper polls the body again before flushing,
                    // and an error then closes the connection unflushed.
                    // Pending once lets hyper flush it first (its
                    // dispatcher flushes after every poll of the body), so
                    // the client sees every frame sent before the cut.
                    tokio::task::yield_now().await;
                    yield Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        "watch dropped by the test server",
                    ));
                    return;
                }
                Ok(Err(broadcast::error::RecvError::Lagged(_))) => {
                    // Like a watch cache that fell behind: end the stream;
                    // the client resumes from its last version.
                    return;
                }
            }
        }
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn event(
    State(shared): State<ServerState>,
    UrlPath(ns): UrlPath<String>,
    uri: Uri,
    body: Bytes,
) -> Result<Response, Infallible> {
    record_event(
        &shared,
        format!("POST {uri}"),
        &ns,
        &body,
        StatusCode::CREATED,
    )
}

async fn event_patch(
    State(shared): State<ServerState>,
    UrlPath((ns, _name)): UrlPath<(String, String)>,
    uri: Uri,
    body: Bytes,
) -> Result<Response, Infallible> {
    record_event(&shared, format!("PATCH {uri}"), &ns, &body, StatusCode::OK)
}

fn record_event(
    shared: &ServerState,
    request: String,
    ns: &str,
    body: &[u8],
    ok: StatusCode,
) -> Result<Response, Infallible> {
    let mut s = shared.lock();
    s.requests.push(request);
    let Ok(mut v) = serde_json::from_slice::<Value>(body) else {
        return Ok(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "the body is not JSON",
        ));
    };
    s.events.push(v.clone());
    s.rv += 1;
    let rv = s.rv;
    if v.get("metadata").is_none() {
        v["metadata"] = json!({});
    }
    v["metadata"]["namespace"] = json!(ns);
    v["metadata"]["resourceVersion"] = json!(rv.to_string());
    if v["metadata"]["name"].is_null() {
        v["metadata"]["name"] = json!(format!("event-{rv}"));
    }
    Ok((
        ok,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response())
}

/// A pod shaped like the ones a real cluster returns (containerd runtime,
/// a ReplicaSet owner, managed fields, conditions). Add containers with
/// [`PodJson::running`] and friends.
#[derive(Debug, Clone)]
pub struct PodJson(pub Value);

impl PodJson {
    /// A `Running` pod `namespace/name` with `uid` on `node`, no containers yet.
    pub fn new(namespace: &str, name: &str, uid: &str, node: &str) -> PodJson {
        PodJson(json!({
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "generateName": format!("{}-", name.rsplit_once('-').map_or(name, |(a, _)| a)),
                "namespace": namespace,
                "uid": uid,
                "creationTimestamp": "2026-11-29T10:00:00Z",
                "labels": { "app": name.rsplit_once('-').map_or(name, |(a, _)| a), "pod-template-hash": "7d9c8b5f4" },
                "annotations": { "kubectl.kubernetes.io/restartedAt": "2026-11-29T09:59:00Z" },
                "ownerReferences": [{
                    "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("{name}-rs"),
                    "uid": "0b5c8a5e-6f7e-4f6b-9a55-6a1c6d1e2f00", "controller": true, "blockOwnerDeletion": true
                }],
                "managedFields": [{
                    "manager": "kubelet", "operation": "Update", "apiVersion": "v1",
                    "time": "2026-11-29T10:00:05Z", "fieldsType": "FieldsV1", "subresource": "status",
                    "fieldsV1": { "f:status": { "f:conditions": {}, "f:containerStatuses": {} } }
                }]
            },
            "spec": {
                "nodeName": node,
                "containers": [],
                "restartPolicy": "Always",
                "terminationGracePeriodSeconds": 30,
                "dnsPolicy": "ClusterFirst",
                "serviceAccountName": "default",
                "schedulerName": "default-scheduler",
                "tolerations": [
                    { "key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300 }
                ],
                "priority": 0,
                "enableServiceLinks": true,
                "preemptionPolicy": "PreemptLowerPriority"
            },
            "status": {
                "phase": "Running",
                "conditions": [
                    { "type": "Initialized", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-29T10:00:01Z" },
                    { "type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-29T10:00:05Z" },
                    { "type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-29T10:00:00Z" }
                ],
                "hostIP": "10.0.0.11",
                "hostIPs": [{ "ip": "10.0.0.11" }],
                "podIP": "10.244.1.23",
                "podIPs": [{ "ip": "10.244.1.23" }],
                "startTime": "2026-11-29T10:00:00Z",
                "qosClass": "BestEffort",
                "containerStatuses": []
            }
        }))
    }

    fn push(&mut self, list: &str, name: &str, image: &str, status: Value) {
        let spec_list = if list == "initContainerStatuses" {
            "initContainers"
        } else if list == "ephemeralContainerStatuses" {
            "ephemeralContainers"
        } else {
            "containers"
        };
        let spec = &mut self.0["spec"][spec_list];
        if spec.is_null() {
            *spec = json!([]);
        }
        if let Some(a) = spec.as_array_mut() {
            a.push(json!({ "name": name, "image": image, "imagePullPolicy": "IfNotPresent",
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File" }));
        }
        let st = &mut self.0["status"][list];
        if st.is_null() {
            *st = json!([]);
        }
        if let Some(a) = st.as_array_mut() {
            a.push(status);
        }
    }

    /// Adds a running container `name` with CRI id `runtime://id`.
    pub fn running(mut self, name: &str, image: &str, runtime: &str, id: &str) -> PodJson {
        let status = json!({
            "name": name,
            "state": { "running": { "startedAt": "2026-11-29T10:00:04Z" } },
            "lastState": {},
            "ready": true,
            "restartCount": 0,
            "image": image,
            "imageID": format!("{image}@sha256:4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d"),
            "containerID": format!("{runtime}://{id}"),
            "started": true
        });
        self.push("containerStatuses", name, image, status);
        self
    }

    /// Adds a container `name` that restarted: `old` terminated with
    /// `code`, `new` runs.
    pub fn restarted(
        mut self,
        name: &str,
        image: &str,
        runtime: &str,
        old: &str,
        code: i32,
        new: &str,
    ) -> PodJson {
        let status = json!({
            "name": name,
            "state": { "running": { "startedAt": "2026-11-29T10:05:00Z" } },
            "lastState": { "terminated": {
                "exitCode": code, "reason": "Error", "startedAt": "2026-11-29T10:00:04Z",
                "finishedAt": "2026-11-29T10:04:59Z", "containerID": format!("{runtime}://{old}")
            } },
            "ready": true,
            "restartCount": 1,
            "image": image,
            "imageID": format!("{image}@sha256:4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d"),
            "containerID": format!("{runtime}://{new}"),
            "started": true
        });
        self.push("containerStatuses", name, image, status);
        self
    }

    /// Adds a container `name` that terminated with `code` (a completed
    /// Job's container, or a finished init container when `init`).
    pub fn terminated(
        mut self,
        name: &str,
        image: &str,
        runtime: &str,
        id: &str,
        code: i32,
        init: bool,
    ) -> PodJson {
        let status = json!({
            "name": name,
            "state": { "terminated": {
                "exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" },
                "startedAt": "2026-11-29T10:00:02Z", "finishedAt": "2026-11-29T10:00:03Z",
                "containerID": format!("{runtime}://{id}")
            } },
            "lastState": {},
            "ready": false,
            "restartCount": 0,
            "image": image,
            "imageID": format!("{image}@sha256:4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d"),
            "containerID": format!("{runtime}://{id}"),
            "started": false
        });
        let list = if init {
            "initContainerStatuses"
        } else {
            "containerStatuses"
        };
        self.push(list, name, image, status);
        self
    }

    /// The JSON.
    pub fn json(self) -> Value {
        self.0
    }
}
