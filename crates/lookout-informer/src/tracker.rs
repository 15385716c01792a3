//! From Pod objects to container added/removed changes: the informer's
//! state machine, free of I/O so that every transition is unit-tested.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use lookout_model::{Container, ContainerKind, Kubernetes, RuntimeKind, Status};

/// A change the tracker found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A container now runs.
    Added(Container),
    /// A container stopped (terminated, replaced by a restart, or its pod
    /// was deleted), with its exit code when the status says.
    Removed(Container, Option<i32>),
}

/// What the tracker keeps of a pod: only the fields it uses.
#[derive(Debug, Default)]
struct PodEntry {
    /// Running containers by runtime id.
    live: HashMap<String, Container>,
}

/// The pods of one node and their running containers.
#[derive(Debug, Default)]
pub struct Tracker {
    pods: HashMap<String, PodEntry>,
    /// Pods seen since a relist began (`Init` .. `InitDone`).
    relisting: Option<HashSet<String>>,
}

/// The runtime and id in a `containerID` (`containerd://<id>`,
/// `cri-o://<id>`, `docker://<id>`). `None` for an empty or malformed one.
pub fn parse_container_id(s: &str) -> Option<(RuntimeKind, &str)> {
    let (runtime, id) = s.split_once("://")?;
    // The API server is another party: an id that is not one (a path, a
    // NUL) is refused here, before it reaches hooks or events.
    if runtime.is_empty() || !lookout_model::valid_container_id(id) {
        return None;
    }
    Some((RuntimeKind::from_binary_name(runtime), id))
}

fn pod_key(pod: &Pod) -> String {
    let m = &pod.metadata;
    match &m.uid {
        Some(uid) => uid.clone(),
        None => format!(
            "{}/{}",
            m.namespace.as_deref().unwrap_or_default(),
            m.name.as_deref().unwrap_or_default()
        ),
    }
}

/// The image reference in a status's `imageID`: `(image_digest,
/// image_id)`.
///
/// `repo@sha256:<hex>` (containerd, CRI-O; cri-dockerd's with a
/// `docker-pullable://` prefix, which goes) is a digest; a bare
/// `sha256:<hex>` (cri-dockerd's `docker://sha256:...` for an image
/// without a repository digest) is an image id. Anything else, or
/// anything over 1024 bytes or with characters no reference has, is
/// neither: the API server is another party.
///
/// ```
/// use lookout_informer::parse_image_id;
/// let hex = "4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d";
/// let (digest, id) = parse_image_id(&format!("docker-pullable://nginx@sha256:{hex}"));
/// assert_eq!(digest, Some(format!("nginx@sha256:{hex}")));
/// assert_eq!(id, None);
/// assert_eq!(parse_image_id(&format!("sha256:{hex}")).1, Some(format!("sha256:{hex}")));
/// assert_eq!(parse_image_id(""), (None, None));
/// assert_eq!(parse_image_id(&format!("x://nginx@sha256:{hex}")), (None, None));
/// // Not a digest as the OCI image spec writes one.
/// let upper = hex.to_uppercase();
/// assert_eq!(parse_image_id(&format!("nginx@sha256:{upper}")), (None, None));
/// ```
pub fn parse_image_id(s: &str) -> (Option<String>, Option<String>) {
    let s = ["docker-pullable://", "docker://"]
        .iter()
        .find_map(|p| s.strip_prefix(p))
        .unwrap_or(s);
    // Lowercase only, as the OCI image spec writes a sha256 digest: filters
    // compare digests as strings, and `ABC...` would never match `abc...`.
    let sha = |h: &str| {
        h.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    };
    if s.len() > 1024 || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return (None, None);
    }
    // A repository: `[host[:port]/]path`, nothing a URL or a shell adds.
    let repo_ok = |r: &str| {
        !r.is_empty()
            && !r.contains("://")
            && r.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-/:".contains(&b))
    };
    match s.rsplit_once('@') {
        Some((repo, digest)) if repo_ok(repo) && sha(digest) => (Some(s.to_owned()), None),
        Some(_) => (None, None),
        None if sha(s) => (None, Some(s.to_owned())),
        None => (None, None),
    }
}

/// The statuses of every kind of container in a pod, with their kind.
fn statuses(pod: &Pod) -> impl Iterator<Item = (ContainerKind, &ContainerStatus)> {
    fn list(
        kind: ContainerKind,
        l: Option<&Vec<ContainerStatus>>,
    ) -> impl Iterator<Item = (ContainerKind, &ContainerStatus)> {
        l.into_iter().flatten().map(move |s| (kind, s))
    }
    let s = pod.status.as_ref();
    list(
        ContainerKind::Init,
        s.and_then(|s| s.init_container_statuses.as_ref()),
    )
    .chain(list(
        ContainerKind::Regular,
        s.and_then(|s| s.container_statuses.as_ref()),
    ))
    .chain(list(
        ContainerKind::Ephemeral,
        s.and_then(|s| s.ephemeral_container_statuses.as_ref()),
    ))
}

/// Running containers of `pod`, and the exit codes of terminated ones by id.
fn observe(pod: &Pod) -> (HashMap<String, Container>, HashMap<String, i32>) {
    let m = &pod.metadata;
    let labels: BTreeMap<String, String> = m.labels.clone().unwrap_or_default();
    let mut running = HashMap::new();
    let mut codes = HashMap::new();
    for (kind, st) in statuses(pod) {
        let state = st.state.as_ref();
        for t in [
            state.and_then(|s| s.terminated.as_ref()),
            st.last_state.as_ref().and_then(|s| s.terminated.as_ref()),
        ]
        .into_iter()
        .flatten()
        {
            let id = t.container_id.as_deref().or(st.container_id.as_deref());
            if let Some((_, id)) = id.and_then(parse_container_id) {
                codes.entry(id.to_owned()).or_insert(t.exit_code);
            }
        }
        if state.and_then(|s| s.running.as_ref()).is_none() {
            continue;
        }
        let Some((runtime, id)) = st.container_id.as_deref().and_then(parse_container_id) else {
            continue;
        };
        let mut c = Container::new(id, runtime);
        c.status = Status::Running;
        c.kind = Some(kind);
        (c.image_digest, c.image_id) = parse_image_id(&st.image_id);
        c.kubernetes = Some({
            let mut k = Kubernetes::default();
            k.namespace = m.namespace.clone();
            k.pod = m.name.clone();
            k.pod_uid = m.uid.clone();
            k.container = Some(st.name.clone());
            k.image = Some(st.image.clone()).filter(|i| !i.is_empty());
            k.labels = labels.clone();
            k
        });
        running.insert(id.to_owned(), c);
    }
    (running, codes)
}

impl Tracker {
    /// An empty tracker.
    pub fn new() -> Tracker {
        Tracker::default()
    }

    /// Running containers known now.
    pub fn live(&self) -> impl Iterator<Item = &Container> {
        self.pods.values().flat_map(|p| p.live.values())
    }

    /// A pod was added or modified.
    pub fn apply(&mut self, pod: &Pod, out: &mut Vec<Change>) {
        let key = pod_key(pod);
        if let Some(seen) = self.relisting.as_mut() {
            seen.insert(key.clone());
        }
        let (running, codes) = observe(pod);
        let entry = self.pods.entry(key).or_default();
        let gone: Vec<String> = entry
            .live
            .keys()
            .filter(|id| !running.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Some(c) = entry.live.remove(&id) {
                let code = codes.get(&id).copied();
                out.push(Change::Removed(c, code));
            }
        }
        for (id, c) in running {
            match entry.live.get_mut(&id) {
                // Labels may change on a running pod: keep them current.
                // (The image of a running container does not change.)
                Some(known) => known.kubernetes = c.kubernetes,
                None => {
                    entry.live.insert(id, c.clone());
                    out.push(Change::Added(c));
                }
            }
        }
    }

    /// A pod was deleted: everything it ran is gone.
    pub fn delete(&mut self, pod: &Pod, out: &mut Vec<Change>) {
        let (_, codes) = observe(pod);
        if let Some(entry) = self.pods.remove(&pod_key(pod)) {
            for (id, c) in entry.live {
                let code = codes.get(&id).copied();
                out.push(Change::Removed(c, code));
            }
        }
    }

    /// A relist begins (start-up, or after 410 Gone).
    pub fn init(&mut self) {
        self.relisting = Some(HashSet::new());
    }

    /// A relist ended: pods it did not return were deleted meanwhile.
    pub fn init_done(&mut self, out: &mut Vec<Change>) {
        let Some(seen) = self.relisting.take() else {
            return;
        };
        let stale: Vec<String> = self
            .pods
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for k in stale {
            if let Some(entry) = self.pods.remove(&k) {
                for (_, c) in entry.live {
                    out.push(Change::Removed(c, None));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_parse_strictly() {
        assert_eq!(
            parse_container_id("containerd://abc").map(|(r, i)| (r.to_string(), i)),
            Some(("containerd".into(), "abc"))
        );
        assert_eq!(parse_container_id("cri-o://x").map(|(_, i)| i), Some("x"));
        assert!(parse_container_id("").is_none());
        assert!(parse_container_id("containerd://").is_none());
        assert!(parse_container_id("abc").is_none());
        // From a hostile API server: ids that would be paths.
        assert!(parse_container_id("containerd://../../etc").is_none());
        assert!(parse_container_id("containerd://a/b").is_none());
        assert!(parse_container_id("containerd://..").is_none());
        assert!(parse_container_id("containerd://a\0b").is_none());
    }
}
