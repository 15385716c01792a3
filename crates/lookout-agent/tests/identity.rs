//! What a consumer keys by, in `added` (#55): the cgroup id its BPF
//! programs see (`bpf_get_current_cgroup_id()`), every namespace of the
//! init, a user namespace's id maps; and, with the fallback Pod informer
//! against the test API server, the pod's workload and the container's
//! kind at `added`, its image digest as `updated`. Real runc containers,
//! as root; each test its own agent and runc copy (see `common`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lookout_testsupport::apiserver::{ApiServer, ObjectJson, PodJson};
use lookout_testsupport::bundle;
use serde_json::{Value, json};

mod common;
use common::*;

const NAMESPACES: [&str; 8] = ["mnt", "net", "pid", "user", "cgroup", "ipc", "uts", "time"];

/// The inode of `/proc/<pid>/ns/<name>`, as `stat` gives it.
fn ns_inode(pid: u64, name: &str) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/{name}"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/ns/{name}: {e}"))
        .ino()
}

/// The directory of `pid`'s cgroup v2 group, found independently of the
/// agent: the `0::` line of its cgroup file under the cgroup2 mount that
/// mountinfo names with root `/`.
fn cgroup_dir(pid: u64) -> PathBuf {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup file");
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("a cgroup v2 line");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let mount = mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            (f.get(sep + 1) == Some(&"cgroup2") && f[3] == "/").then(|| f[4].to_owned())
        })
        .expect("a cgroup2 mount of the whole hierarchy");
    Path::new(&mount).join(path.trim_start_matches('/'))
}

/// Creates container `id` from `bundle` through `rt`, and returns its
/// `added` event (the container is `created`: its start waits).
fn create(agent: &Agent, rt: &Runtime, bundle: &Path, id: &str) -> Value {
    rt.ok(&["create", "--bundle", bundle.to_str().expect("utf-8"), id]);
    agent.wait_event(id, "added", Duration::from_secs(10))
}

#[test]
fn a_runc_containers_added_carries_its_cgroup_id_and_every_namespace() {
    if !ready("identity_cgroup_id") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = bundle::busybox(&dir.path().join("b"), &["/bin/sleep", "30"], |_| {});
    let agent = Agent::start(&rt, &[]);
    let id = id("identity-cgroup");
    let added = create(&agent, &rt, &b, &id);
    let c = &added["container"];
    assert_eq!(c["status"], "created", "{added}");
    let pid = c["pid"].as_u64().expect("pid");

    let dir_inode = std::fs::metadata(cgroup_dir(pid))
        .expect("the container's cgroup directory")
        .ino();
    assert_eq!(c["cgroup_id"].as_u64(), Some(dir_inode), "{added}");
    for name in NAMESPACES {
        assert_eq!(
            c["namespaces"][name].as_u64(),
            Some(ns_inode(pid, name)),
            "namespace {name}: {added}"
        );
    }
    // runc unshares these (and the cgroup namespace on cgroup v2 only):
    // the container's are not this process's.
    let me = u64::from(std::process::id());
    for name in ["mnt", "net", "pid", "ipc", "uts"] {
        assert_ne!(
            c["namespaces"][name].as_u64(),
            Some(ns_inode(me, name)),
            "{name}"
        );
    }
    // In the host's user namespace: no maps, and nothing unresolved.
    assert_eq!(c["namespaces"]["user"].as_u64(), Some(ns_inode(me, "user")));
    assert!(c.get("id_maps").is_none(), "{added}");
    assert!(c.get("unresolved").is_none(), "{added}");

    rt.ok(&["start", &id]);
    rt.ok(&["kill", &id, "KILL"]);
    let removed = agent.wait_event(&id, "removed", Duration::from_secs(10));
    assert_eq!(removed["container"]["cgroup_id"], c["cgroup_id"]);
    rt.cleanup(&id);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn a_container_in_its_own_user_namespace_is_reported_with_it_and_its_maps() {
    if !ready("identity_user_namespace") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let maps = json!([{"containerID": 0, "hostID": 100000, "size": 65536}]);
    let b = bundle::busybox(&dir.path().join("b"), &["/bin/sleep", "30"], |c| {
        let namespaces = c["linux"]["namespaces"]
            .as_array_mut()
            .expect("runc spec's namespaces");
        namespaces.push(json!({"type": "user"}));
        c["linux"]["uidMappings"] = maps.clone();
        c["linux"]["gidMappings"] = maps.clone();
    });
    let agent = Agent::start(&rt, &[]);
    let id = id("identity-userns");
    let added = create(&agent, &rt, &b, &id);
    let c = &added["container"];
    let pid = c["pid"].as_u64().expect("pid");

    let theirs = ns_inode(pid, "user");
    assert_ne!(
        theirs,
        ns_inode(u64::from(std::process::id()), "user"),
        "runc made no user namespace"
    );
    assert_eq!(c["namespaces"]["user"].as_u64(), Some(theirs), "{added}");
    let want = json!([{"container_id": 0, "host_id": 100000, "size": 65536}]);
    assert_eq!(c["id_maps"]["uid"], want, "{added}");
    assert_eq!(c["id_maps"]["gid"], want, "{added}");
    assert!(c.get("unresolved").is_none(), "{added}");

    rt.ok(&["delete", "--force", &id]);
    agent.wait_event(&id, "removed", Duration::from_secs(10));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

const DIGEST: &str = "4c1e997385b8fb4ad4d1d3c7e5a8f5d8b2a1c0e9f8d7c6b5a4938271605f4e3d";

#[test]
fn a_hooked_cri_container_has_its_workload_and_kind_at_added_and_its_digest_as_updated() {
    if !ready("workload_at_added") {
        return;
    }
    let rt = Runtime::runc();
    let server = ApiServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = server.kubeconfig(dir.path());
    let runc_id = id("workload");
    server.put_object(ObjectJson::new("apps/v1", "Deployment", "shop", "web", "uid-d").json());
    server.put_object(
        ObjectJson::new("apps/v1", "ReplicaSet", "shop", "web-7d9", "uid-rs")
            .controlled_by("apps/v1", "Deployment", "web", "uid-d")
            .json(),
    );
    // The pod as the kubelet reports it while its container is created:
    // in the spec, not in any status yet.
    let pod = |running: bool| {
        let p = PodJson::new("shop", "web-7d9-x", "uid-web", "node-a").controlled_by(
            "apps/v1",
            "ReplicaSet",
            "web-7d9",
            "uid-rs",
        );
        let p = if running {
            p.running("nginx", "nginx:1.27", "containerd", &runc_id)
        } else {
            p
        };
        let mut v = p.json();
        v["spec"]["containers"] = json!([{ "name": "nginx", "image": "nginx:1.27" }]);
        v
    };
    server.apply(pod(false));
    let agent = Agent::start_with(
        Some(&rt),
        &[],
        &[
            ("NODE_NAME", "node-a"),
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
        ],
        None,
    );
    agent.wait_log("pod informer synced", Duration::from_secs(15));
    let b = bundle::busybox(&dir.path().join("b"), &["sleep", "30"], |c| {
        c["annotations"] = json!({
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-namespace": "shop",
            "io.kubernetes.cri.sandbox-name": "web-7d9-x",
            "io.kubernetes.cri.sandbox-uid": "uid-web",
            "io.kubernetes.cri.container-name": "nginx",
        });
    });
    rt.ok(&[
        "run",
        "-d",
        "--bundle",
        b.to_str().expect("utf-8"),
        &runc_id,
    ]);
    let added = agent.wait_event(&runc_id, "added", Duration::from_secs(10));
    assert_eq!(added["source"], "runtime-hook");
    let c = &added["container"];
    assert_eq!(
        c["kubernetes"]["workload"],
        json!({
            "kind": "Deployment", "name": "web", "namespace": "shop",
            "api_version": "apps/v1", "uid": "uid-d",
        }),
        "{added}"
    );
    assert_eq!(c["kind"], "regular", "{added}");
    assert!(
        c["image_digest"].is_null(),
        "no status names it yet: {added}"
    );
    assert!(
        c.get("unresolved")
            .is_none_or(|u| u.get("kubernetes.workload").is_none())
    );

    // The kubelet reports it running: the informer's digest arrives as an
    // `updated` of the hook's record.
    server.apply(pod(true));
    let updated = agent.wait_event(&runc_id, "updated", Duration::from_secs(10));
    assert_eq!(updated["source"], "informer");
    let u = &updated["container"];
    assert_eq!(
        u["image_digest"],
        format!("nginx:1.27@sha256:{DIGEST}"),
        "{updated}"
    );
    assert_eq!(u["pid"], c["pid"], "the hook's record, filled: {updated}");
    assert_eq!(u["kubernetes"]["workload"]["kind"], "Deployment");
    rt.cleanup(&runc_id);
    agent.wait_event(&runc_id, "removed", Duration::from_secs(10));
    let ev = agent.events_for(&runc_id);
    let n = |k: &str| ev.iter().filter(|e| e["event"] == k).count();
    assert_eq!(
        (n("added"), n("updated"), n("removed")),
        (1, 1, 1),
        "{ev:?}"
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{status:?}\n{log}");
}
