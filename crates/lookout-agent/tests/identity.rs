//! What a consumer keys by, in `added` (#55): the cgroup id its BPF
//! programs see (`bpf_get_current_cgroup_id()`), every namespace of the
//! init, a user namespace's id maps; and, with the fallback Pod informer
//! against the test API server, the pod's workload and the container's
//! kind at `added`, its image digest as `updated`. The same keys as the
//! pinned BPF maps a tracer looks tasks up in (#56), and the agent's BPF
//! programs' own diagnostics. Real runc containers, as root; each test its
//! own agent and runc copy (see `common`).

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

// ---------------------------------------------------------------------------
// The pinned container maps (#56): what a tracer's BPF program looks a task
// up in. Each test mounts a BPF file system of its own (a bpffs mount is an
// instance of its own), so tests running side by side share no map.

use aya::maps::{HashMap as BpfHash, MapData};
use lookout_ebpf_common::{ContainerEntry, RUNTIME_RUNC};

/// A private BPF file system on a temporary directory, unmounted on drop.
struct BpfFs {
    dir: tempfile::TempDir,
}

impl BpfFs {
    fn mount() -> BpfFs {
        let dir = tempfile::tempdir().expect("tempdir");
        nix::mount::mount(
            Some("bpf"),
            dir.path(),
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .expect("mount -t bpf (root)");
        BpfFs { dir }
    }

    /// The agent's pin directory in it.
    fn pins(&self) -> PathBuf {
        self.dir.path().join("lookout")
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A pinned-maps test's node: a BPF file system of its own, a runc copy,
/// a bundle that runs `cmd`.
struct PinNode {
    fs: BpfFs,
    rt: Runtime,
    bundle: PathBuf,
    _dir: tempfile::TempDir,
}

impl PinNode {
    fn new(cmd: &[&str]) -> PinNode {
        let dir = tempfile::tempdir().expect("tempdir");
        let bundle = bundle::busybox(&dir.path().join("b"), cmd, |_| {});
        PinNode {
            fs: BpfFs::mount(),
            rt: Runtime::runc(),
            bundle,
            _dir: dir,
        }
    }

    /// The agent's pin directory.
    fn pins(&self) -> PathBuf {
        self.fs.pins()
    }

    /// An agent that pins there, with `restrict`.
    fn agent_with(&self, restrict: Option<lookout_testsupport::Restrictions>) -> Agent {
        let pins = self.pins();
        let arg = ["--bpf-pin-dir", pins.to_str().expect("utf-8")];
        Agent::start_with(Some(&self.rt), &arg, &[], restrict)
    }

    fn agent(&self) -> Agent {
        self.agent_with(None)
    }

    /// Creates container `id` through `agent`; its `added`.
    fn create(&self, agent: &Agent, id: &str) -> Value {
        create(agent, &self.rt, &self.bundle, id)
    }
}

type Entries = BpfHash<MapData, u64, [u8; ContainerEntry::SIZE]>;

/// The pinned map `name` under `pins`, opened as a tracer would.
fn pinned(pins: &Path, name: &str) -> Entries {
    let data = MapData::from_pin(pins.join(name)).unwrap_or_else(|e| panic!("pin {name}: {e}"));
    Entries::try_from(aya::maps::Map::HashMap(data)).expect("a hash map of entries")
}

fn entry(map: &Entries, key: u64) -> Option<ContainerEntry> {
    map.get(&key, 0)
        .ok()
        .and_then(|b| ContainerEntry::from_bytes(&b))
}

const BY_CGROUP: &str = lookout_ebpf_common::CONTAINERS_BY_CGROUP_MAP;
const BY_MNTNS: &str = lookout_ebpf_common::CONTAINERS_BY_MNTNS_MAP;

#[test]
fn a_created_container_is_in_the_pinned_maps_until_it_exits() {
    if !ready("pinned_maps_lifecycle") {
        return;
    }
    let node = PinNode::new(&["/bin/sleep", "30"]);
    let (pins, rt) = (node.pins(), &node.rt);
    let agent = node.agent();
    let mode = std::fs::metadata(&pins).expect("pin directory").mode();
    assert_eq!(mode & 0o7777, 0o700, "pin directory mode {mode:o}");

    let id = id("pinned-lifecycle");
    let added = node.create(&agent, &id);
    let c = &added["container"];
    let pid = c["pid"].as_u64().expect("pid");
    let cgroup = c["cgroup_id"].as_u64().expect("cgroup id");
    let mnt = ns_inode(pid, "mnt");
    // Created, its start not yet asked for: both keys are there.
    let by_cgroup = pinned(&pins, BY_CGROUP);
    let by_mntns = pinned(&pins, BY_MNTNS);
    let e = entry(&by_cgroup, cgroup).expect("the container's cgroup id is a key");
    assert_eq!(e.id(), id.as_bytes());
    assert_eq!(e.runtime, RUNTIME_RUNC);
    assert_eq!(e.pid_ns, ns_inode(pid, "pid"));
    assert_eq!((e.cgroup_id, e.mnt_ns), (cgroup, mnt));
    assert_eq!(
        entry(&by_mntns, mnt),
        Some(e),
        "the same entry by mount namespace"
    );
    // At least this one (the state scan may find other tests' containers).
    let metrics = agent.metrics();
    let written = metrics
        .lines()
        .find_map(|l| l.strip_prefix("lookout_pinned_map_entries{map=\"containers_by_cgroup\"} "))
        .and_then(|n| n.parse::<u64>().ok());
    assert!(written.is_some_and(|n| n >= 1), "{metrics}");

    rt.ok(&["start", &id]);
    rt.ok(&["kill", &id, "KILL"]);
    // Removed from the maps before the hub, and so stdout, has `removed`.
    agent.wait_event(&id, "removed", Duration::from_secs(10));
    assert_eq!(entry(&by_cgroup, cgroup), None, "cgroup key left behind");
    assert_eq!(
        entry(&by_mntns, mnt),
        None,
        "mount namespace key left behind"
    );
    rt.cleanup(&id);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn a_new_agent_reconciles_the_pins_it_finds_without_emptying_them() {
    if !ready("pinned_maps_restart") {
        return;
    }
    let node = PinNode::new(&["/bin/sleep", "60"]);
    let (pins, rt) = (node.pins(), &node.rt);
    let first = node.agent();
    let (stays, goes) = (id("pinned-stays"), id("pinned-goes"));
    let stays_cgroup = node.create(&first, &stays)["container"]["cgroup_id"]
        .as_u64()
        .expect("cgroup id");
    let goes_cgroup = node.create(&first, &goes)["container"]["cgroup_id"]
        .as_u64()
        .expect("cgroup id");
    let (status, log) = first.stop();
    assert!(status.success(), "{log}");

    let mut by_cgroup = pinned(&pins, BY_CGROUP);
    // An agent that stops leaves its entries: tracers go on reading them.
    assert!(entry(&by_cgroup, stays_cgroup).is_some(), "emptied on exit");
    // While no agent runs: one container ends, and an entry appears for a
    // cgroup that lives but that no agent will report (a tracer's own
    // test entry, or a container the new agent has not found yet).
    rt.cleanup(&goes);
    let unknown = tempfile::Builder::new()
        .prefix("lookout-pinned-")
        .tempdir_in(cgroup_dir(u64::from(std::process::id())))
        .expect("a cgroup of the test's own");
    let unknown_cgroup = std::fs::metadata(unknown.path()).expect("cgroup").ino();
    let fake = ContainerEntry::new(b"not-a-container-lookout-knows");
    by_cgroup
        .insert(unknown_cgroup, fake.to_bytes(), 0)
        .expect("insert an unknown live entry");

    let second = node.agent();
    // The state scan reports the container that still runs (with its
    // entry), and the sweep at `ready` removes the gone one's.
    second.wait_event(&stays, "added", Duration::from_secs(10));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while entry(&by_cgroup, goes_cgroup).is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "the gone container's entry stayed:\n{}",
            second.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let e = entry(&by_cgroup, stays_cgroup).expect("the running container's entry");
    assert_eq!(e.id(), stays.as_bytes());
    assert_eq!(
        entry(&by_cgroup, unknown_cgroup),
        Some(fake),
        "a live cgroup's entry was removed"
    );
    second.wait_log("stale pinned map entry removed", Duration::from_secs(5));
    let metrics = second.metrics();
    assert!(
        metrics.contains("lookout_pinned_map_stale_removed_total{map=\"containers_by_cgroup\"} 1"),
        "{metrics}"
    );

    rt.cleanup(&stays);
    by_cgroup
        .remove(&unknown_cgroup)
        .expect("remove the test's entry");
    drop(unknown);
    let (status, log) = second.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn without_a_bpf_file_system_the_agent_runs_and_says_why() {
    if !ready("pinned_maps_no_bpffs") {
        return;
    }
    let rt = Runtime::runc();
    let dir = tempfile::tempdir().expect("tempdir");
    let pins = dir.path().join("lookout");
    let b = bundle::busybox(&dir.path().join("b"), &["/bin/sleep", "30"], |_| {});
    let agent = Agent::start(&rt, &["--bpf-pin-dir", pins.to_str().expect("utf-8")]);
    agent.wait_log("is not on a BPF file system", Duration::from_secs(5));
    assert!(!pins.exists(), "nothing made outside a BPF file system");
    // Discovery goes on without the maps.
    let id = id("pinned-no-bpffs");
    create(&agent, &rt, &b, &id);
    rt.cleanup(&id);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

#[test]
fn a_pin_directory_an_unprivileged_user_made_first_is_moved_aside() {
    let Some(user) = lookout_testsupport::unprivileged_user("pinned_maps_squatter") else {
        return;
    };
    if !ready("pinned_maps_squatter") {
        return;
    }
    // A bpffs root is mode 1777 unless mounted otherwise (Cilium's is), and
    // empty at every boot: anyone can make the agent's directory first, to
    // swap the maps tracers read, or to switch them off.
    let node = PinNode::new(&["/bin/sleep", "30"]);
    let pins = node.pins();
    let made = user
        .apply(&mut std::process::Command::new("mkdir"))
        .args(["-m", "0777"])
        .arg(&pins)
        .status()
        .expect("mkdir as the attacker");
    assert!(made.success());
    let agent = node.agent();
    agent.wait_log("moved aside, and the agent", Duration::from_secs(5));
    // The attacker's directory is beside it, untouched; the agent's is
    // root's, 0700, with its maps.
    let aside: Vec<PathBuf> = std::fs::read_dir(node.fs.dir.path())
        .expect("the bpffs root")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.to_string_lossy()
                .contains(&format!("lookout-refused-uid{}-", user.uid))
        })
        .collect();
    assert_eq!(
        aside.len(),
        1,
        "{aside:?} in {:?}\n{}",
        std::fs::read_dir(node.fs.dir.path())
            .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>()),
        agent.log()
    );
    assert_eq!(
        std::fs::metadata(&aside[0]).expect("moved aside").uid(),
        user.uid
    );
    let meta = std::fs::symlink_metadata(&pins).expect("the agent's directory");
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o700));
    let id = id("pinned-squatter");
    let added = node.create(&agent, &id);
    let cgroup = added["container"]["cgroup_id"].as_u64().expect("cgroup id");
    assert!(entry(&pinned(&pins, BY_CGROUP), cgroup).is_some());
    node.rt.cleanup(&id);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

/// `crates/lookout-example-execs`, built beside the agent by the same
/// `cargo test` (a workspace member); `None` when it was not built.
fn example_execs() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_BIN_EXE_lookout")).parent()?;
    let bin = dir.join("lookout-example-execs");
    bin.is_file().then_some(bin)
}

/// The proof that an entry is written before the container's first
/// instruction: a tracer's own program (the aya example consumer), which
/// counts execs by the cgroup ids in the pinned map, counts the container's
/// entrypoint exec, the first thing it runs, under the container's id.
#[test]
fn a_tracer_counts_a_containers_first_exec_under_its_id() {
    if !ready("pinned_maps_example_consumer") {
        return;
    }
    let Some(example) = example_execs() else {
        lookout_testsupport::skip(
            "pinned_maps_example_consumer",
            "lookout-example-execs is not built (cargo test --workspace builds it)",
        );
        return;
    };
    // One exec in the container: its entrypoint (busybox's true).
    let node = PinNode::new(&["/bin/true"]);
    let (pins, rt) = (node.pins(), &node.rt);
    let agent = node.agent();
    let dir = tempfile::tempdir().expect("tempdir");
    let err = dir.path().join("example.err");
    let out = dir.path().join("example.out");
    let mut consumer = KillOnDrop(
        std::process::Command::new(&example)
            .args([
                "--pin-dir",
                pins.to_str().expect("utf-8"),
                "--json",
                "--interval",
                "100ms",
            ])
            .stdout(std::fs::File::create(&out).expect("stdout file"))
            .stderr(std::fs::File::create(&err).expect("stderr file"))
            .spawn()
            .expect("start the example consumer"),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&err)
        .unwrap_or_default()
        .contains("attached")
    {
        let exited = consumer.0.try_wait().expect("try_wait");
        assert!(
            exited.is_none() && std::time::Instant::now() < deadline,
            "the example consumer never attached:\n{}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let id = id("pinned-first-exec");
    let cgroup = node.create(&agent, &id)["container"]["cgroup_id"].clone();
    rt.ok(&["start", &id]);
    agent.wait_event(&id, "removed", Duration::from_secs(10));
    // The entry went with the container; the program copied it when it
    // counted the first exec.
    let line = format!("\"container_id\":\"{id}\"");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let counted = loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(l) = text.lines().rev().find(|l| l.contains(&line)) {
            break serde_json::from_str::<Value>(l).expect("a JSON line");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the example consumer never counted {id}:\n{text}\n{}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(counted["execs"], 1, "{counted}");
    assert_eq!(counted["cgroup_id"], cgroup, "{counted}");
    drop(consumer);
    rt.cleanup(&id);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

// ---------------------------------------------------------------------------
// The BPF programs' own diagnostics (aya-log), beside the maps they serve.

/// The BPF programs' aya-log records reach the agent's log, as target
/// `lookout_ebpf`, when its filter shows them (they are not written at all
/// otherwise: `bpf_log::level` sets the programs' level at load).
#[test]
fn the_bpf_programs_diagnostics_reach_the_agents_log() {
    if !ready("bpf_log") {
        return;
    }
    let rt = Runtime::runc();
    let agent = Agent::start_with(
        Some(&rt),
        &[],
        &[("LOOKOUT_LOG", "info,lookout_ebpf=trace")],
        None,
    );
    assert!(agent.log().contains("bpf=true"), "{}", agent.log());
    let version = rt.run(&["--version"]);
    assert!(version.status.success());
    agent.wait_log_line(
        &["lookout_ebpf", "runtime exec recorded: tgid"],
        Duration::from_secs(10),
    );
    drop(agent);
}

#[test]
fn without_bpf_the_agent_pins_nothing_and_says_why() {
    if !ready("pinned_maps_no_bpf") {
        return;
    }
    let node = PinNode::new(&["/bin/sleep", "30"]);
    let (pins, rt) = (node.pins(), &node.rt);
    // bpf(2) refused, as without CAP_BPF (or under a seccomp profile that
    // denies it): no programs, no maps.
    let agent = node.agent_with(Some(
        lookout_testsupport::Restrictions::new().deny_syscall(libc::SYS_bpf, libc::EPERM),
    ));
    agent.wait_log_line(
        &["no pinned container maps", "not permitted", "CAP_BPF"],
        Duration::from_secs(5),
    );
    let pinned: Vec<_> = std::fs::read_dir(&pins)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(pinned.is_empty(), "pinned without bpf(2): {pinned:?}");
    let id = id("pinned-no-bpf");
    node.create(&agent, &id);
    rt.cleanup(&id);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

/// A surge: two agents on one node, one map. Both write a container's
/// entry; the first one's exit leaves it; the second removes it when the
/// container exits.
#[test]
fn two_agents_keep_one_map() {
    if !ready("pinned_maps_surge") {
        return;
    }
    let node = PinNode::new(&["/bin/sleep", "60"]);
    let (pins, rt) = (node.pins(), &node.rt);
    let (old, new) = (node.agent(), node.agent());
    let id = id("pinned-surge");
    let added = node.create(&old, &id);
    new.wait_event(&id, "added", Duration::from_secs(10));
    let cgroup = added["container"]["cgroup_id"].as_u64().expect("cgroup id");
    let by_cgroup = pinned(&pins, BY_CGROUP);
    let written = entry(&by_cgroup, cgroup).expect("written by both");
    assert_eq!(written.id(), id.as_bytes());
    let (status, log) = old.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        entry(&by_cgroup, cgroup),
        Some(written),
        "the old agent's exit took the entry"
    );
    rt.ok(&["start", &id]);
    rt.ok(&["kill", &id, "KILL"]);
    new.wait_event(&id, "removed", Duration::from_secs(10));
    assert_eq!(
        entry(&by_cgroup, cgroup),
        None,
        "the entry outlived its container"
    );
    assert!(
        !new.log().contains("cannot remove pinned map entry"),
        "{}",
        new.log()
    );
    rt.cleanup(&id);
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
}

/// Whether a perf reader of tracepoint `category/name`, sampling every CPU
/// (as `perf record -a -e category:name` does), sees the process `f`
/// starts hit it.
fn perf_sees(category: &str, name: &str, f: impl FnOnce() -> u32) -> bool {
    let mut sampler = lookout_testsupport::perf::TracepointSampler::open(category, name, 16 * 4096)
        .unwrap_or_else(|e| panic!("a perf reader of {category}:{name}: {e}"));
    let pid = f();
    sampler.drain().iter().any(|hit| hit.pid == pid)
}

/// A tracepoint's BPF programs also filter its perf events: one that
/// returns 0 drops the sample for every perf reader on the node. aya's
/// `#[tracepoint]` returned 0, and `perf record -a -e
/// sched:sched_process_exit` saw no exit while an agent ran.
#[test]
fn perf_readers_of_the_agents_tracepoints_still_see_their_events() {
    if !ready("perf_tracepoints") {
        return;
    }
    let rt = Runtime::runc();
    let agent = Agent::start(&rt, &[]);
    assert!(
        agent.log().contains("bpf=true"),
        "the agent runs without its BPF programs, so this proves nothing:\n{}",
        agent.log()
    );
    let run_true = || {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawning true");
        let pid = child.id();
        child.wait().expect("waiting for true");
        pid
    };
    for (category, name) in [
        ("sched", "sched_process_exit"),
        ("syscalls", "sys_enter_execve"),
    ] {
        assert!(
            perf_sees(category, name, run_true),
            "a perf reader of {category}:{name} missed an event while the agent ran"
        );
    }
    drop(agent);
}
