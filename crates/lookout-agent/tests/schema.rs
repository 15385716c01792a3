//! The event's JSON form. `docs/event.schema.json` is generated from
//! lookout-model's types: this test fails when the committed file is stale
//! and rewrites it when `LOOKOUT_BLESS=1`. What `lookout run` really prints
//! is checked against it.

use std::path::PathBuf;
use std::time::Duration;

use lookout_testsupport::bundle;
use serde_json::Value;

mod common;
use common::*;

fn schema_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/event.schema.json")
}

fn generated() -> String {
    let schema = schemars::schema_for!(lookout_model::ContainerEvent);
    serde_json::to_string_pretty(&schema).expect("serialize the schema") + "\n"
}

#[test]
fn the_committed_schema_is_generated_from_the_types() {
    let want = generated();
    if std::env::var_os("LOOKOUT_BLESS").is_some() {
        std::fs::write(schema_path(), &want).expect("write docs/event.schema.json");
        return;
    }
    let have = std::fs::read_to_string(schema_path()).unwrap_or_default();
    assert!(
        have == want,
        "docs/event.schema.json is not what the types give: if the change is meant, \
         run `LOOKOUT_BLESS=1 cargo test -p lookout-agent --test schema` and review the \
         diff (docs/events.md says what may change without a new schema version)"
    );
}

#[test]
fn what_lookout_run_prints_matches_the_schema() {
    if !ready("schema_output") {
        return;
    }
    let schema: Value =
        serde_json::from_str(&std::fs::read_to_string(schema_path()).expect("the schema"))
            .expect("the schema is JSON");
    let validator = jsonschema::validator_for(&schema).expect("a valid JSON Schema");
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    // A container with everything an event can carry: annotations, a
    // Kubernetes identity, an exit code.
    let b = bundle::busybox(&dir.path().join("b"), &["sh", "-c", "exit 3"], |c| {
        c["annotations"] = serde_json::json!({
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-namespace": "default",
            "io.kubernetes.cri.sandbox-name": "web-0",
            "io.kubernetes.cri.sandbox-uid": "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
            "io.kubernetes.cri.container-name": "app",
            "io.kubernetes.cri.image-name": "registry.example/app:1",
        });
    });
    let agent = Agent::start(&rt, &[]);
    let id = id("schema");
    rt.ok(&["create", "--bundle", b.to_str().expect("utf-8"), &id]);
    rt.ok(&["start", &id]);
    agent.wait_event(&id, "added", Duration::from_secs(10));
    let removed = agent.wait_event(&id, "removed", Duration::from_secs(10));
    rt.cleanup(&id);
    assert_eq!(removed["exit_code"], 3, "{removed}");
    let events = agent.events_for(&id);
    assert_eq!(events.len(), 2, "{events:?}");
    for e in &events {
        assert_eq!(e["schema"], lookout_model::SCHEMA_VERSION, "{e}");
        let errors: Vec<String> = validator
            .iter_errors(e)
            .map(|err| err.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "{e}\ndoes not match the schema: {errors:?}"
        );
    }
    // The kernel's fields of #55 are in `added`: every namespace (time
    // since Linux 5.6), and the cgroup id where a cgroup v2 hierarchy is
    // mounted (on a hybrid node too).
    let added = events
        .iter()
        .find(|e| e["event"] == "added")
        .expect("added");
    let c = &added["container"];
    for ns in ["mnt", "net", "pid", "user", "ipc", "uts", "cgroup"] {
        assert!(
            c["namespaces"][ns].as_u64().is_some_and(|i| i > 0),
            "no {ns} namespace: {added}"
        );
    }
    let cgroup2 = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .any(|d| std::path::Path::new(d).join("cgroup.controllers").exists());
    if cgroup2 {
        assert!(
            c["cgroup_id"].as_u64().is_some_and(|i| i > 0),
            "no cgroup_id on a cgroup v2 node: {added}"
        );
        assert!(c.get("unresolved").is_none(), "{added}");
    } else {
        assert!(c["unresolved"]["cgroup_id"].is_string(), "{added}");
    }
    // A runc container in the host's user namespace has no id maps.
    assert!(c.get("id_maps").is_none(), "{added}");

    // And the schema is not vacuous: a wrong type is refused.
    let mut bad = events[0].clone();
    bad["container"]["pid"] = Value::String("one".into());
    assert!(!validator.is_valid(&bad), "a string pid passed the schema");
    for (field, wrong) in [
        ("cgroup_id", Value::String("7301".into())),
        ("kind", Value::String("daemon".into())),
        ("unresolved", serde_json::json!({"cgroup_id": 1})),
    ] {
        let mut bad = events[0].clone();
        bad["container"][field] = wrong;
        assert!(!validator.is_valid(&bad), "a wrong {field} passed: {bad}");
    }
}
