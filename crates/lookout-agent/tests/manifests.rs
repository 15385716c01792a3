//! Every manifest in deploy/kubernetes parses into its k8s-openapi type,
//! with no field the type does not know (a typo fails CI), and the
//! DaemonSet says what docs/deploy.md promises.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::de::DeserializeOwned;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes")
}

/// Paths of `original` that are missing or different in `parsed`: fields
/// the typed struct dropped (unknown names) or changed.
fn lost(original: &Value, parsed: &Value, at: &str, out: &mut Vec<String>) {
    match (original, parsed) {
        (Value::Object(o), Value::Object(p)) => {
            for (k, v) in o {
                match p.get(k) {
                    Some(pv) => lost(v, pv, &format!("{at}.{k}"), out),
                    None if v.is_null() => {}
                    None => out.push(format!("{at}.{k}")),
                }
            }
        }
        (Value::Array(o), Value::Array(p)) if o.len() == p.len() => {
            for (i, (a, b)) in o.iter().zip(p).enumerate() {
                lost(a, b, &format!("{at}[{i}]"), out);
            }
        }
        (a, b) if a == b => {}
        // YAML `10%` stays a string, `10` a number: IntOrString keeps both.
        (Value::Number(a), Value::String(b)) | (Value::String(b), Value::Number(a))
            if a.to_string() == *b => {}
        (a, b) => out.push(format!("{at}: {a} became {b}")),
    }
}

fn typed<T: DeserializeOwned + serde::Serialize>(file: &str, doc: &Value) -> T {
    let t: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{file}: not a valid {}: {e}", std::any::type_name::<T>()));
    let back = serde_json::to_value(&t).expect("serialize");
    let mut missing = Vec::new();
    lost(doc, &back, "", &mut missing);
    assert!(
        missing.is_empty(),
        "{file}: fields unknown to {} (typos?): {missing:?}",
        std::any::type_name::<T>()
    );
    t
}

fn load(file: &str) -> Value {
    let text =
        std::fs::read_to_string(deploy_dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{file}: invalid YAML: {e}"))
}

#[test]
fn every_manifest_parses_into_its_kubernetes_type() {
    let kustomization = load("kustomization.yaml");
    let resources: Vec<String> = kustomization["resources"]
        .as_array()
        .expect("kustomization resources")
        .iter()
        .filter_map(|r| r.as_str().map(str::to_owned))
        .collect();
    // Every YAML file in the directory is listed, and every listed file exists.
    let mut on_disk: Vec<String> = std::fs::read_dir(deploy_dir())
        .expect("deploy/kubernetes")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    on_disk.sort();
    let mut listed = resources.clone();
    listed.sort();
    assert_eq!(
        listed, on_disk,
        "kustomization.yaml lists exactly the manifests"
    );

    let mut kinds = Vec::new();
    for file in &resources {
        let doc = load(file);
        let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "Namespace" => drop(typed::<Namespace>(file, &doc)),
            "ServiceAccount" => drop(typed::<ServiceAccount>(file, &doc)),
            "ClusterRole" => drop(typed::<ClusterRole>(file, &doc)),
            "ClusterRoleBinding" => drop(typed::<ClusterRoleBinding>(file, &doc)),
            "DaemonSet" => drop(typed::<DaemonSet>(file, &doc)),
            other => panic!("{file}: unexpected kind {other:?}"),
        }
        kinds.push(kind);
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "DaemonSet",
            "Namespace",
            "ServiceAccount"
        ]
    );
}

#[test]
fn the_daemonset_is_what_the_deploy_guide_promises() {
    let ds: DaemonSet = typed("daemonset.yaml", &load("daemonset.yaml"));
    // A surge rollout: the new agent runs before the old one stops
    // (docs/operations.md, "Upgrades").
    let rolling = ds
        .spec
        .update_strategy
        .as_ref()
        .and_then(|u| u.rolling_update.as_ref())
        .expect("a rolling update");
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)), "surge");
    assert_eq!(
        rolling.max_unavailable,
        Some(IntOrString::Int(0)),
        "never no agent on a node"
    );
    let pod = ds.spec.template.spec.expect("pod spec");
    assert_eq!(pod.host_pid, Some(true), "host pids");
    assert!(
        pod.termination_grace_period_seconds.unwrap_or(30) >= 20,
        "room for the handover and the starts the old agent decides"
    );
    // The metrics port is the pod's own: two agents on a node do not clash.
    assert_ne!(pod.host_network, Some(true), "no host network");
    for c in &pod.containers {
        for p in c.ports.iter().flatten() {
            assert_eq!(p.host_port, None, "no host port: a surge would clash");
        }
    }
    assert_eq!(pod.service_account_name.as_deref(), Some("lookout"));
    let c = &pod.containers[0];
    let env = c.env.as_ref().expect("env");
    let node = env
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME");
    let field = node
        .value_from
        .as_ref()
        .and_then(|v| v.field_ref.as_ref())
        .expect("NODE_NAME from the downward API");
    assert_eq!(field.field_path, "spec.nodeName");
    let host = c
        .volume_mounts
        .as_ref()
        .and_then(|m| m.iter().find(|m| m.mount_path == "/host"))
        .expect("host root mount");
    assert_eq!(host.read_only, Some(true), "the host root is read-only");
    // The consumer API's socket lives in the host's /run/lookout, where
    // consumers' pods mount it from (docs/consumers.md).
    let api = c
        .volume_mounts
        .as_ref()
        .and_then(|m| m.iter().find(|m| m.mount_path == "/run/lookout"))
        .expect("/run/lookout mount");
    assert_ne!(
        api.read_only,
        Some(true),
        "the agent creates its socket there"
    );
    let api_host = pod
        .volumes
        .as_ref()
        .and_then(|v| v.iter().find(|v| v.name == api.name))
        .and_then(|v| v.host_path.as_ref())
        .expect("/run/lookout is a hostPath volume");
    assert_eq!(api_host.path, "/run/lookout", "the host's /run/lookout");
    assert_eq!(
        api_host.type_.as_deref(),
        Some("DirectoryOrCreate"),
        "the agent's pod may be the first to need it"
    );
    let sc = c.security_context.as_ref().expect("securityContext");
    assert_ne!(sc.privileged, Some(true), "capabilities, not privileged");
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let added = caps.add.clone().unwrap_or_default();
    // The minimum the code needs (docs/deploy.md gives each one's use);
    // tests/image.rs runs the image with exactly these.
    assert_eq!(
        added,
        [
            "SYS_ADMIN",
            "SYS_PTRACE",
            "DAC_READ_SEARCH",
            "SYS_RESOURCE",
            "SYS_CHROOT",
            "KILL"
        ],
        "capabilities: change docs/deploy.md with them"
    );
    let path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|h| h.path.clone())
    };
    assert_eq!(path(&c.liveness_probe).as_deref(), Some("/healthz"));
    assert_eq!(path(&c.readiness_probe).as_deref(), Some("/readyz"));
    assert!(
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_some(),
        "limits"
    );

    // The arguments are ones `lookout` accepts.
    let args = c.args.clone().unwrap_or_default();
    assert_eq!(args.first().map(String::as_str), Some("run"));
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_lookout"))
        .args(["run", "--help"])
        .output()
        .expect("lookout run --help");
    let help = String::from_utf8_lossy(&help.stdout);
    for a in args.iter().skip(1) {
        let flag = a.split('=').next().unwrap_or(a);
        assert!(
            help.contains(flag),
            "{flag} is not a `lookout run` flag:\n{help}"
        );
    }
    for e in env {
        if e.name.starts_with("LOOKOUT_") && e.name != "LOOKOUT_LOG" {
            assert!(
                help.contains(&e.name),
                "{} is not read by `lookout run`",
                e.name
            );
        }
    }
}

#[test]
fn the_cluster_role_allows_exactly_what_the_agent_does() {
    let role: ClusterRole = typed("clusterrole.yaml", &load("clusterrole.yaml"));
    let rules = role.rules.unwrap_or_default();
    let allows = |group: &str, resource: &str, verb: &str| {
        rules.iter().any(|r| {
            r.api_groups
                .as_ref()
                .is_some_and(|g| g.iter().any(|g| g == group))
                && r.resources
                    .as_ref()
                    .is_some_and(|rs| rs.iter().any(|x| x == resource))
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    for verb in ["get", "list", "watch"] {
        assert!(allows("", "pods", verb), "pods {verb}");
    }
    for verb in ["create", "patch"] {
        assert!(allows("events.k8s.io", "events", verb), "events {verb}");
    }
    // Workloads: one owner read each, nothing listed or watched.
    assert!(allows("apps", "replicasets", "get"), "replicasets get");
    assert!(allows("batch", "jobs", "get"), "jobs get");
    for (group, resource) in [("apps", "replicasets"), ("batch", "jobs")] {
        for verb in ["list", "watch"] {
            assert!(!allows(group, resource, verb), "{resource} {verb}");
        }
    }
    assert!(
        !allows("apps", "deployments", "get"),
        "no other owners read"
    );
    assert!(
        !allows("", "events", "create"),
        "events only through events.k8s.io"
    );
    assert!(
        !allows("events.k8s.io", "events", "delete"),
        "no deleting Events"
    );
    assert!(!allows("", "pods", "delete"), "read-only on pods");
    assert!(!allows("", "secrets", "get"), "no secrets");
}

/// The consumer DaemonSet that docs/consumers.md shows is a DaemonSet with
/// no unknown field, and mounts what the text says (not applied to a
/// cluster here: there is none).
#[test]
fn the_consumer_daemonset_in_the_docs_is_valid_and_mounts_the_socket_directory() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/consumers.md");
    let text = std::fs::read_to_string(&path).expect("docs/consumers.md");
    let yaml = text
        .split("```yaml\n")
        .nth(1)
        .and_then(|s| s.split("\n```").next())
        .expect("a yaml block in docs/consumers.md");
    let doc: Value = serde_saphyr::from_str(yaml).expect("the docs' DaemonSet is YAML");
    let ds: DaemonSet = typed("docs/consumers.md", &doc);
    let pod = ds.spec.template.spec.expect("pod spec");
    assert_eq!(pod.host_pid, Some(true), "host pids, as lookout reports");
    let volume = pod
        .volumes
        .as_ref()
        .and_then(|v| v.iter().find(|v| v.name == "lookout"))
        .and_then(|v| v.host_path.as_ref())
        .expect("a hostPath volume");
    assert_eq!(volume.path, "/run/lookout", "the directory, not the socket");
    assert_eq!(volume.type_.as_deref(), Some("Directory"));
    let mount = pod.containers[0]
        .volume_mounts
        .as_ref()
        .and_then(|m| m.iter().find(|m| m.name == "lookout"))
        .expect("the socket directory mounted");
    assert_eq!(mount.mount_path, "/run/lookout");
    assert_eq!(mount.read_only, Some(true));
}
