//! The informer's pure part, `Tracker::apply`: a Pod in, container changes
//! out. No API server and no root. Lives outside `src/` because its Pod
//! fixtures come from the unpublished test-support crate (this file is not
//! in the published package).

use k8s_openapi::api::core::v1::Pod;
use lookout_informer::{Change, Tracker};
use lookout_testsupport::apiserver::PodJson;

fn pod(j: PodJson) -> Pod {
    serde_json::from_value(j.json()).expect("a valid Pod")
}

fn ids(out: &[Change]) -> Vec<String> {
    let mut v: Vec<String> = out
        .iter()
        .map(|c| match c {
            Change::Added(c) => format!("+{}", c.id),
            Change::Removed(c, code) => format!(
                "-{}{}",
                c.id,
                code.map(|c| format!(":{c}")).unwrap_or_default()
            ),
        })
        .collect();
    v.sort();
    v
}

#[test]
fn running_containers_of_every_kind_are_added_once() {
    let mut t = Tracker::new();
    let p = pod(PodJson::new("default", "web-1", "u1", "n1")
        .terminated("init", "busybox", "containerd", "i1", 0, true)
        .running("nginx", "nginx:1.27", "containerd", "c1")
        .ephemeral("debug", "busybox", "containerd", "e1"));
    let mut out = Vec::new();
    t.apply(&p, &mut out);
    assert_eq!(ids(&out), ["+c1", "+e1"]);
    let Change::Added(c) = &out[0] else { panic!() };
    let k = c.kubernetes.as_ref().expect("metadata");
    assert_eq!(k.namespace.as_deref(), Some("default"));
    assert_eq!(k.pod_uid.as_deref(), Some("u1"));
    assert_eq!(k.labels.get("app").map(String::as_str), Some("web"));
    assert_eq!(c.runtime.as_str(), "containerd");
    out.clear();
    t.apply(&p, &mut out);
    assert!(out.is_empty(), "an unchanged pod changes nothing: {out:?}");
}

#[test]
fn a_restart_removes_the_old_id_with_its_exit_code_and_adds_the_new() {
    let mut t = Tracker::new();
    let mut out = Vec::new();
    t.apply(
        &pod(PodJson::new("ns", "a-1", "u", "n").running("app", "img", "cri-o", "old")),
        &mut out,
    );
    out.clear();
    t.apply(
        &pod(
            PodJson::new("ns", "a-1", "u", "n").restarted("app", "img", "cri-o", "old", 137, "new")
        ),
        &mut out,
    );
    assert_eq!(ids(&out), ["+new", "-old:137"]);
}

#[test]
fn completed_pods_and_deleted_pods_remove_their_containers() {
    let mut t = Tracker::new();
    let mut out = Vec::new();
    t.apply(
        &pod(PodJson::new("ns", "job-1", "j", "n").running("work", "img", "containerd", "w1")),
        &mut out,
    );
    t.apply(
        &pod(PodJson::new("ns", "web-1", "w", "n").running("web", "img", "docker", "d1")),
        &mut out,
    );
    out.clear();
    t.apply(
        &pod(PodJson::new("ns", "job-1", "j", "n")
            .terminated("work", "img", "containerd", "w1", 0, false)
            .phase("Succeeded")),
        &mut out,
    );
    assert_eq!(ids(&out), ["-w1:0"]);
    out.clear();
    t.delete(
        &pod(PodJson::new("ns", "web-1", "w", "n").running("web", "img", "docker", "d1")),
        &mut out,
    );
    assert_eq!(ids(&out), ["-d1"]);
    assert_eq!(t.live().count(), 0);
}

#[test]
fn a_relist_removes_pods_deleted_while_we_were_away() {
    let mut t = Tracker::new();
    let mut out = Vec::new();
    let keep = pod(PodJson::new("ns", "keep-1", "k", "n").running("c", "img", "containerd", "k1"));
    t.apply(&keep, &mut out);
    t.apply(
        &pod(PodJson::new("ns", "gone-1", "g", "n").running("c", "img", "containerd", "g1")),
        &mut out,
    );
    out.clear();
    t.init();
    t.apply(&keep, &mut out);
    t.init_done(&mut out);
    assert_eq!(ids(&out), ["-g1"]);
}
