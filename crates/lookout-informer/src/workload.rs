//! A pod's workload: the controller at the top of its owner chain.
//!
//! The pod's controller `ownerReference` names its first owner. Only two
//! kinds are read to climb further, each with a metadata-only GET: a
//! `ReplicaSet` (apps/v1, whose controller is usually a Deployment) and a
//! `Job` (batch/v1, a CronJob's). Every other kind (StatefulSet,
//! DaemonSet, Deployment, an Argo Rollout, ...) is the top without a read:
//! reading arbitrary kinds would need discovery and RBAC on them.
//!
//! Owner references come from the API server, another party: their
//! fields are bounded and checked before use (a name goes into a URL
//! path), and a malformed one is reported, not followed.
//!
//! # Where it runs, and what it costs
//!
//! Inline in the informer's watch loop, before the pod's changes are
//! reported, so that an informer `added` carries its workload. That is
//! bounded: at most [`MAX_READS`] reads per pod, each cut at
//! [`READ_TIMEOUT`], and results are cached (successes for
//! [`FOUND_TTL`], failures for [`FAILED_TTL`], a 403 for
//! [`FORBIDDEN_TTL`]), so a pod's status updates, and every pod of a
//! ReplicaSet after the first, read nothing. A concurrent resolver would
//! report containers before their workload is known, or hold them anyway.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Api, Client};
use lookout_model::Workload;

/// Reads per pod at most: Pod → ReplicaSet → Deployment takes one, an
/// owner chain that goes on (or loops) stops here.
pub(crate) const MAX_READS: usize = 4;
/// How long one owner read may take.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a read owner's controller is trusted (an owner can be orphaned
/// or adopted, rarely).
pub(crate) const FOUND_TTL: Duration = Duration::from_secs(600);
/// How long a failed read (404, timeout, 5xx) is not retried: a later pod
/// event after that reads again.
pub(crate) const FAILED_TTL: Duration = Duration::from_secs(10);
/// How long a 403 is not retried: a ClusterRole fixed in place is
/// noticed within a minute, without a read per pod event meanwhile.
pub(crate) const FORBIDDEN_TTL: Duration = Duration::from_secs(60);
/// Cached owners at most. When full, expired entries go; if none had
/// expired, the whole cache is emptied (the next pods read their owners
/// again: a node with 4096 live ReplicaSets and Jobs is far past the pod
/// limit).
pub(crate) const MAX_CACHED: usize = 4096;

/// The key `unresolved` gives the reason under.
pub(crate) const FIELD: &str = "kubernetes.workload";

// N.B. bounds of Kubernetes' own validation: names are DNS subdomains
// (253), kinds are identifiers, an API group is a DNS subdomain.
const MAX_NAME: usize = 253;
const MAX_KIND: usize = 63;
const MAX_API_VERSION: usize = 253 + 1 + 63;
const MAX_UID: usize = 128;

/// What a pod's owner chain resolved to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Resolved {
    /// The top controller, or the deepest owner known when a read failed;
    /// `None` only when the pod's own controller reference is unusable.
    pub workload: Option<Workload>,
    /// Why `workload` is not the top, or absent.
    pub unresolved: Option<String>,
}

/// One owner: a checked controller reference.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Owner {
    api_version: String,
    kind: String,
    name: String,
    uid: String,
}

impl Owner {
    fn workload(&self, namespace: &str) -> Workload {
        let mut w = Workload::default();
        w.kind.clone_from(&self.kind);
        w.name.clone_from(&self.name);
        // A static pod's mirror is owned by its Node, which is in no
        // namespace: its key is `Node//name`.
        let cluster_scoped = self.kind == "Node" && self.api_version == "v1";
        w.namespace = if cluster_scoped {
            String::new()
        } else {
            namespace.to_owned()
        };
        w.api_version.clone_from(&self.api_version);
        w.uid = Some(self.uid.clone());
        w
    }
}

/// Why `top`, reached without a read, is a claim rather than a fact:
/// a kind of Kubernetes' own in another API group, or a Deployment or
/// CronJob named by the pod itself (`direct`), which never own pods (their
/// ReplicaSets and Jobs do). Any pod creator can name any owner; these
/// two never come from a controller.
fn claimed(top: &Workload, direct: bool) -> Option<String> {
    if !top.is_what_its_key_says() {
        return Some(format!(
            "the pod names a {} of API version {}, which is not Kubernetes' own {}",
            top.kind, top.api_version, top.kind
        ));
    }
    (direct && matches!(top.kind.as_str(), "Deployment" | "CronJob")).then(|| {
        format!(
            "the pod names {} {} as its controller, which never owns pods itself: a claim, not verified",
            top.kind, top.name
        )
    })
}

/// The resources read to climb.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Readable {
    ReplicaSets,
    Jobs,
}

impl Readable {
    fn of(owner: &Owner) -> Option<Readable> {
        match (owner.api_version.as_str(), owner.kind.as_str()) {
            ("apps/v1", "ReplicaSet") => Some(Readable::ReplicaSets),
            ("batch/v1", "Job") => Some(Readable::Jobs),
            _ => None,
        }
    }

    /// The RBAC rule a 403 says is missing.
    fn rule(self) -> &'static str {
        match self {
            Readable::ReplicaSets => "get on replicasets in API group \"apps\"",
            Readable::Jobs => "get on jobs in API group \"batch\"",
        }
    }

    /// Warned about a 403 already (once per resource for the process).
    fn warned(self) -> &'static AtomicBool {
        static REPLICASETS: AtomicBool = AtomicBool::new(false);
        static JOBS: AtomicBool = AtomicBool::new(false);
        match self {
            Readable::ReplicaSets => &REPLICASETS,
            Readable::Jobs => &JOBS,
        }
    }
}

/// A cache key: a name reused by a new object (another uid) is another
/// key.
type Key = (Readable, String, String, String);

#[derive(Debug, Clone)]
struct Cached {
    at: Instant,
    ttl: Duration,
    /// The owner's own controller, or why it is unknown.
    controller: Result<Option<Owner>, String>,
}

/// Climbs owner chains, with a bounded cache.
pub(crate) struct Resolver {
    client: Client,
    cache: HashMap<Key, Cached>,
}

impl Resolver {
    pub fn new(client: Client) -> Resolver {
        Resolver {
            client,
            cache: HashMap::new(),
        }
    }

    /// The workload of `pod`. Never fails: what cannot be read is the
    /// reason in [`Resolved::unresolved`].
    pub async fn resolve(&mut self, pod: &Pod) -> Resolved {
        let m = &pod.metadata;
        let Some(namespace) = m.namespace.as_deref().filter(|n| name_ok(n)) else {
            return unresolved(None, "the pod has no valid namespace".into());
        };
        let mut owner = match controller_of(m.owner_references.as_deref()) {
            Ok(Some(o)) => o,
            Ok(None) => {
                // Its own workload.
                let Some(name) = m.name.as_deref().filter(|n| name_ok(n)) else {
                    return unresolved(None, "the pod has no valid name".into());
                };
                let mut w = Workload::default();
                w.kind = "Pod".into();
                w.name = name.to_owned();
                w.namespace = namespace.to_owned();
                w.api_version = "v1".into();
                w.uid = m.uid.clone().filter(|u| uid_ok(u));
                return Resolved {
                    workload: Some(w),
                    unresolved: None,
                };
            }
            Err(why) => return unresolved(None, format!("the pod's {why}")),
        };
        let mut seen = vec![owner.uid.clone()];
        for _ in 0..MAX_READS {
            let Some(resource) = Readable::of(&owner) else {
                let top = owner.workload(namespace);
                return Resolved {
                    unresolved: claimed(&top, seen.len() == 1),
                    workload: Some(top),
                };
            };
            let next = match self.controller(resource, namespace, &owner).await {
                Ok(Some(next)) => next,
                Ok(None) => {
                    return Resolved {
                        workload: Some(owner.workload(namespace)),
                        unresolved: None,
                    };
                }
                Err(why) => return unresolved(Some(owner.workload(namespace)), why),
            };
            if seen.contains(&next.uid) {
                let why = format!(
                    "owner loop: {} {} is its own owner's owner",
                    next.kind, next.name
                );
                return unresolved(Some(owner.workload(namespace)), why);
            }
            seen.push(next.uid.clone());
            owner = next;
        }
        let why = format!("owner chain longer than {MAX_READS} reads");
        unresolved(Some(owner.workload(namespace)), why)
    }

    /// The controller of `owner`, from the cache or a metadata-only read.
    async fn controller(
        &mut self,
        resource: Readable,
        namespace: &str,
        owner: &Owner,
    ) -> Result<Option<Owner>, String> {
        let key = (
            resource,
            namespace.to_owned(),
            owner.name.clone(),
            owner.uid.clone(),
        );
        let now = Instant::now();
        if let Some(c) = self.cache.get(&key)
            && now.duration_since(c.at) < c.ttl
        {
            return c.controller.clone();
        }
        let (controller, ttl) = self.read(resource, namespace, owner).await;
        if self.cache.len() >= MAX_CACHED && !self.cache.contains_key(&key) {
            self.cache.retain(|_, c| now.duration_since(c.at) < c.ttl);
            if self.cache.len() >= MAX_CACHED {
                self.cache.clear();
            }
        }
        self.cache.insert(
            key,
            Cached {
                at: Instant::now(),
                ttl,
                controller: controller.clone(),
            },
        );
        controller
    }

    async fn read(
        &self,
        resource: Readable,
        namespace: &str,
        owner: &Owner,
    ) -> (Result<Option<Owner>, String>, Duration) {
        let what = format!("{} {namespace}/{}", owner.kind, owner.name);
        let client = self.client.clone();
        let got = match resource {
            Readable::ReplicaSets => {
                let api: Api<ReplicaSet> = Api::namespaced(client, namespace);
                tokio::time::timeout(READ_TIMEOUT, api.get_metadata(&owner.name))
                    .await
                    .map(|r| r.map(|m| m.metadata))
            }
            Readable::Jobs => {
                let api: Api<Job> = Api::namespaced(client, namespace);
                tokio::time::timeout(READ_TIMEOUT, api.get_metadata(&owner.name))
                    .await
                    .map(|r| r.map(|m| m.metadata))
            }
        };
        match got {
            Err(_) => (
                Err(format!("reading {what}: no answer within {READ_TIMEOUT:?}")),
                FAILED_TTL,
            ),
            Ok(Ok(meta)) => {
                if meta.uid.as_deref() != Some(owner.uid.as_str()) {
                    let why = format!(
                        "{what} was replaced: its uid is not the {} the owner reference names",
                        owner.uid
                    );
                    return (Err(why), FAILED_TTL);
                }
                let controller = controller_of(meta.owner_references.as_deref())
                    .map_err(|why| format!("{what}'s {why}"));
                (controller, FOUND_TTL)
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 403 => {
                if !resource.warned().swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        object = what,
                        "the API server refused reading {what} (403 Forbidden): \
                         the agent's ClusterRole lacks {}; workloads stop at it",
                        resource.rule()
                    );
                }
                let why = format!(
                    "reading {what} is forbidden (403): the ClusterRole lacks {}",
                    resource.rule()
                );
                (Err(why), FORBIDDEN_TTL)
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => {
                (Err(format!("{what} not found (404)")), FAILED_TTL)
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %lookout_model::Chain(&e), "reading {what}");
                let why = format!("reading {what}: {}", lookout_model::Chain(&e));
                (Err(why), FAILED_TTL)
            }
        }
    }
}

fn unresolved(workload: Option<Workload>, why: String) -> Resolved {
    Resolved {
        workload,
        unresolved: Some(why),
    }
}

/// The one controller reference in `refs`, checked; `Ok(None)` for none.
/// The `Err` is a reason, `"controller reference ..."`.
fn controller_of(refs: Option<&[OwnerReference]>) -> Result<Option<Owner>, String> {
    let mut controllers = refs
        .into_iter()
        .flatten()
        .filter(|r| r.controller == Some(true));
    let Some(r) = controllers.next() else {
        return Ok(None);
    };
    if controllers.next().is_some() {
        return Err("controller reference is not the only one (malformed)".into());
    }
    let bad = |field: &str| Err(format!("controller reference has a malformed {field}"));
    if !kind_ok(&r.kind) {
        return bad("kind");
    }
    if !name_ok(&r.name) {
        return bad("name");
    }
    if !api_version_ok(&r.api_version) {
        return bad("apiVersion");
    }
    if !uid_ok(&r.uid) {
        return bad("uid");
    }
    Ok(Some(Owner {
        api_version: r.api_version.clone(),
        kind: r.kind.clone(),
        name: r.name.clone(),
        uid: r.uid.clone(),
    }))
}

#[cfg(fuzzing)]
pub(crate) fn controller_for_fuzzing(pod: &Pod) -> Result<Option<[String; 4]>, String> {
    let o = controller_of(pod.metadata.owner_references.as_deref())?;
    Ok(o.map(|o| [o.api_version, o.kind, o.name, o.uid]))
}

/// A DNS subdomain (what ReplicaSet, Job and namespace names are): it
/// becomes a URL path segment.
fn name_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

fn kind_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_KIND
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphabetic())
        && s.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// `v1` or `group/version`.
fn api_version_ok(s: &str) -> bool {
    let (group, version) = s.split_once('/').unwrap_or(("", s));
    s.len() <= MAX_API_VERSION
        && (group.is_empty() || name_ok(group))
        && !version.is_empty()
        && version.len() <= 63
        && version
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

fn uid_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_UID && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(kind: &str, name: &str, controller: Option<bool>) -> OwnerReference {
        OwnerReference {
            api_version: "apps/v1".into(),
            kind: kind.into(),
            name: name.into(),
            uid: "u-1".into(),
            controller,
            block_owner_deletion: None,
        }
    }

    #[test]
    fn only_one_checked_controller_reference_is_followed() {
        assert_eq!(controller_of(None), Ok(None));
        assert_eq!(controller_of(Some(&[r("ReplicaSet", "a", None)])), Ok(None));
        let one = controller_of(Some(&[
            r("ReplicaSet", "gc-only", Some(false)),
            r("ReplicaSet", "web-7d9", Some(true)),
        ]));
        assert_eq!(one.ok().flatten().map(|o| o.name), Some("web-7d9".into()));
        assert!(controller_of(Some(&[r("A", "a", Some(true)), r("B", "b", Some(true))])).is_err());
        // From a hostile API server: names that would walk the URL path.
        for name in [
            "",
            "../../api/v1/secrets",
            "a/b",
            "A",
            "-a",
            &"a".repeat(254),
        ] {
            assert!(
                controller_of(Some(&[r("ReplicaSet", name, Some(true))])).is_err(),
                "{name:?}"
            );
        }
        for kind in ["", "Replica Set", "1Job", &"K".repeat(64)] {
            assert!(
                controller_of(Some(&[r(kind, "a", Some(true))])).is_err(),
                "{kind:?}"
            );
        }
        let mut bad = r("ReplicaSet", "a", Some(true));
        bad.api_version = "apps/v1/../x".into();
        assert!(controller_of(Some(&[bad])).is_err());
        let mut bad = r("ReplicaSet", "a", Some(true));
        bad.uid = "u\n1".into();
        assert!(controller_of(Some(&[bad])).is_err());
        assert!(api_version_ok("v1") && api_version_ok("argoproj.io/v1alpha1"));
    }
}
