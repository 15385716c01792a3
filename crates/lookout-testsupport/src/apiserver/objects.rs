//! Pods' owners in the test API server: `GET` of ReplicaSets, Deployments
//! (`/apis/apps/v1/namespaces/{ns}/{resource}/{name}`), Jobs and CronJobs
//! (`/apis/batch/v1/...`), as the whole object or, when the `Accept`
//! header asks for `as=PartialObjectMetadata` (kube's `get_metadata`), as
//! a `meta.k8s.io/v1` `PartialObjectMetadata`. A missing object is a 404
//! `NotFound` Status, a [forbidden](ApiServer::forbid) resource a 403
//! `Forbidden` Status, both shaped as the real server sends them.

use std::collections::{BTreeMap, BTreeSet};

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use super::{ApiServer, PodJson, ServerState};

/// The owners the server holds, and the resources it refuses to read.
#[derive(Debug, Default)]
pub(super) struct Objects {
    /// (group, resource, namespace, name) -> object.
    by_key: BTreeMap<(String, String, String, String), Value>,
    /// `resource.group` names whose reads are 403.
    forbidden: BTreeSet<String>,
}

/// The routes for owners.
pub(super) fn router() -> Router<ServerState> {
    Router::new()
        .route("/apis/apps/v1/namespaces/{ns}/{resource}/{name}", get(read))
        .route(
            "/apis/batch/v1/namespaces/{ns}/{resource}/{name}",
            get(read),
        )
}

/// The API group and plural resource of an object's kind.
fn resource_of(api_version: &str, kind: &str) -> (String, String) {
    let group = api_version
        .split_once('/')
        .map_or("", |(g, _)| g)
        .to_owned();
    (group, format!("{}s", kind.to_ascii_lowercase()))
}

fn key_of(object: &Value) -> (String, String, String, String) {
    let (group, resource) = resource_of(
        object["apiVersion"].as_str().unwrap_or_default(),
        object["kind"].as_str().unwrap_or_default(),
    );
    let m = &object["metadata"];
    (
        group,
        resource,
        m["namespace"].as_str().unwrap_or("default").to_owned(),
        m["name"].as_str().unwrap_or_default().to_owned(),
    )
}

impl ApiServer {
    /// Creates or replaces an owner object (a ReplicaSet, Deployment, Job
    /// or CronJob; see [`ObjectJson`]), stamping a new
    /// `metadata.resourceVersion`.
    pub fn put_object(&self, mut object: Value) {
        let mut s = self.shared.lock();
        s.rv += 1;
        object["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        s.objects.by_key.insert(key_of(&object), object);
    }

    /// Deletes an owner object (`apps/v1`, `ReplicaSet`, ...). Returns
    /// whether it existed.
    pub fn delete_object(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> bool {
        let (group, resource) = resource_of(api_version, kind);
        let key = (group, resource, namespace.to_owned(), name.to_owned());
        self.shared.lock().objects.by_key.remove(&key).is_some()
    }

    /// Makes reads of `resource` in `group` (`"replicasets"`, `"apps"`)
    /// answer 403 Forbidden, as with a ClusterRole that lacks them (or
    /// allows them again).
    pub fn forbid(&self, group: &str, resource: &str, forbidden: bool) {
        let name = format!("{resource}.{group}");
        let objects = &mut self.shared.lock().objects;
        if forbidden {
            objects.forbidden.insert(name);
        } else {
            objects.forbidden.remove(&name);
        }
    }
}

async fn read(
    State(shared): State<ServerState>,
    UrlPath((ns, resource, name)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let mut s = shared.lock();
    s.requests.push(format!("GET {uri}"));
    let group = if uri.path().starts_with("/apis/apps/") {
        "apps"
    } else {
        "batch"
    };
    let known = match group {
        "apps" => ["replicasets", "deployments"].contains(&resource.as_str()),
        _ => ["jobs", "cronjobs"].contains(&resource.as_str()),
    };
    let details = json!({ "name": name, "group": group, "kind": resource });
    let refuse = |code: StatusCode, reason: &str, message: String| {
        let mut body = super::status_object(code.as_u16(), reason, &message);
        body["details"] = details.clone();
        (
            code,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    };
    if !known {
        let message = format!("the server could not find the requested resource ({uri})");
        return refuse(StatusCode::NOT_FOUND, "NotFound", message);
    }
    if s.objects.forbidden.contains(&format!("{resource}.{group}")) {
        let message = format!(
            "{resource}.{group} \"{name}\" is forbidden: User \
             \"system:serviceaccount:lookout:lookout\" cannot get resource \"{resource}\" \
             in API group \"{group}\" in the namespace \"{ns}\""
        );
        return refuse(StatusCode::FORBIDDEN, "Forbidden", message);
    }
    let key = (group.to_owned(), resource.clone(), ns, name.clone());
    let Some(object) = s.objects.by_key.get(&key) else {
        let message = format!("{resource}.{group} \"{name}\" not found");
        return refuse(StatusCode::NOT_FOUND, "NotFound", message);
    };
    let partial = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("as=PartialObjectMetadata"));
    let body = if partial {
        json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": object["metadata"],
        })
    } else {
        object.clone()
    };
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// An owner object (ReplicaSet, Deployment, Job, CronJob) shaped like a
/// real cluster's, for [`ApiServer::put_object`].
#[derive(Debug, Clone)]
pub struct ObjectJson(pub Value);

impl ObjectJson {
    /// An object of `kind` (`apps/v1` `ReplicaSet`, ...) `namespace/name`
    /// with `uid`, no owner.
    pub fn new(
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> ObjectJson {
        ObjectJson(json!({
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "generation": 1,
                "creationTimestamp": "2026-11-29T09:59:00Z",
                "labels": { "app": name },
                "annotations": { "deployment.kubernetes.io/revision": "1" },
            },
            "spec": {},
            "status": {},
        }))
    }

    /// Sets the controller owner reference.
    pub fn controlled_by(
        mut self,
        api_version: &str,
        kind: &str,
        name: &str,
        uid: &str,
    ) -> ObjectJson {
        self.0["metadata"]["ownerReferences"] = controller(api_version, kind, name, uid);
        self
    }

    /// The JSON.
    pub fn json(self) -> Value {
        self.0
    }
}

fn controller(api_version: &str, kind: &str, name: &str, uid: &str) -> Value {
    json!([{
        "apiVersion": api_version, "kind": kind, "name": name, "uid": uid,
        "controller": true, "blockOwnerDeletion": true
    }])
}

impl PodJson {
    /// Replaces the pod's owner (a ReplicaSet `{name}-rs` by default) with
    /// the controller `kind` `name`.
    pub fn controlled_by(
        mut self,
        api_version: &str,
        kind: &str,
        name: &str,
        uid: &str,
    ) -> PodJson {
        self.0["metadata"]["ownerReferences"] = controller(api_version, kind, name, uid);
        self
    }

    /// Removes the pod's owner: a bare pod.
    pub fn without_owner(mut self) -> PodJson {
        if let Some(m) = self.0["metadata"].as_object_mut() {
            m.remove("ownerReferences");
        }
        self
    }

    /// Adds a running init container (a sidecar: `restartPolicy: Always`).
    pub fn running_init(mut self, name: &str, image: &str, runtime: &str, id: &str) -> PodJson {
        let status = json!({
            "name": name,
            "state": { "running": { "startedAt": "2026-11-29T10:00:02Z" } },
            "lastState": {},
            "ready": true,
            "restartCount": 0,
            "image": image,
            "imageID": format!("{image}@sha256:{}", "1".repeat(64)),
            "containerID": format!("{runtime}://{id}"),
            "started": true
        });
        self.push("initContainerStatuses", name, image, status);
        self
    }

    /// Adds a running ephemeral (debug) container.
    pub fn ephemeral(mut self, name: &str, image: &str, runtime: &str, id: &str) -> PodJson {
        let status = json!({
            "name": name,
            "state": { "running": { "startedAt": "2026-11-29T10:06:00Z" } },
            "lastState": {},
            "ready": false,
            "restartCount": 0,
            "image": image,
            "imageID": "",
            "containerID": format!("{runtime}://{id}"),
        });
        self.push("ephemeralContainerStatuses", name, image, status);
        self
    }

    /// Sets `status.phase` (`Succeeded`, `Failed`, ...).
    pub fn phase(mut self, phase: &str) -> PodJson {
        self.0["status"]["phase"] = json!(phase);
        self
    }

    /// Sets the `imageID` of container `name`'s status, whatever its list.
    pub fn image_id(mut self, name: &str, image_id: &str) -> PodJson {
        for list in [
            "initContainerStatuses",
            "containerStatuses",
            "ephemeralContainerStatuses",
        ] {
            for st in self.0["status"][list].as_array_mut().into_iter().flatten() {
                if st["name"] == name {
                    st["imageID"] = json!(image_id);
                }
            }
        }
        self
    }
}
