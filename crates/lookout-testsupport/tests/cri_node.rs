//! The real CRI node: containerd 1.7 starts on private sockets with NRI on,
//! two nodes run side by side, and a dropped node leaves nothing behind.

use std::time::Duration;

use lookout_testsupport::cri::{CriNode, require_cri};

fn mounts_under(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(dir.to_str().expect("utf-8 path")))
        .map(str::to_owned)
        .collect()
}

#[test]
fn two_nodes_start_side_by_side_and_clean_up() {
    if !require_cri("two_nodes_start_side_by_side_and_clean_up") {
        return;
    }
    let a = CriNode::start().expect("first node");
    let b = CriNode::start().expect("second node");
    eprintln!(
        "containerd 1.7 ready in {:?} and {:?}",
        a.started_in(),
        b.started_in()
    );
    assert_ne!(a.socket(), b.socket());
    assert_ne!(a.nri_socket(), b.nri_socket());
    assert_ne!(a.runc(), b.runc());
    for n in [&a, &b] {
        assert!(n.started_in() < Duration::from_secs(30));
        std::os::unix::net::UnixStream::connect(n.nri_socket()).expect("NRI socket accepts");
        assert!(n.root().starts_with(n.dir()));
        assert!(
            n.log().contains("serving..."),
            "containerd's log says it serves:\n{}",
            n.log()
        );
        // The CRI plugin loaded (it fails to load on a broken config).
        let plugins = n.ctr(&["plugins", "ls"]).expect("ctr plugins ls");
        let cri = plugins
            .lines()
            .find(|l| l.contains("io.containerd.grpc.v1") && l.contains(" cri "))
            .unwrap_or_else(|| panic!("no CRI plugin:\n{plugins}"));
        assert!(cri.trim_end().ends_with("ok"), "CRI plugin: {cri}");
        let nri = plugins
            .lines()
            .find(|l| l.contains("io.containerd.nri.v1"))
            .unwrap_or_else(|| panic!("no NRI plugin:\n{plugins}"));
        assert!(nri.trim_end().ends_with("ok"), "NRI plugin: {nri}");
    }
    let dir = a.dir().to_path_buf();
    let pid = a.pid();
    drop(a);
    assert!(!dir.exists(), "{} left behind", dir.display());
    assert!(mounts_under(&dir).is_empty(), "{:?}", mounts_under(&dir));
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z ")),
        "containerd {pid} still runs"
    );
    // The other node is unaffected.
    b.ctr(&["version"]).expect("the second node still answers");
}

#[test]
fn a_pod_runs_through_cri_like_a_kubelet() {
    use lookout_testsupport::cri::{BUSYBOX_IMAGE, PodSpec, api::ContainerState};
    if !require_cri("a_pod_runs_through_cri_like_a_kubelet") {
        return;
    }
    let node = CriNode::start().expect("node");
    let mut kubelet = node.kubelet().expect("CRI client");
    let v = kubelet.version().expect("Version");
    assert_eq!(v.runtime_name, "containerd");
    assert!(v.runtime_version.starts_with("1.7"), "{v:?}");
    assert_eq!(v.runtime_api_version, "v1");

    let spec = PodSpec::new("default", "hello")
        .label("app", "hello")
        .container(
            "say",
            BUSYBOX_IMAGE,
            &["sh", "-c", "echo hello from cri; exit 3"],
        )
        .container("wait", BUSYBOX_IMAGE, &["sleep", "300"]);
    let pod = kubelet.run_pod(&spec).expect("run the pod");
    eprintln!(
        "RunPodSandbox {:?}; CreateContainer {:?}; StartContainer {:?}",
        pod.sandbox_took, pod.create_took, pod.start_took
    );
    let say = pod.container("say").expect("say");
    let exited = kubelet
        .wait_exited(say, Duration::from_secs(10))
        .expect("say exits");
    assert_eq!(exited.exit_code, 3, "{exited:?}");
    let log = std::fs::read_to_string(pod.log_path("say").expect("log path")).expect("log");
    assert!(log.contains("stdout F hello from cri"), "{log}");
    let wait = kubelet
        .container_status(pod.container("wait").expect("wait"))
        .expect("status");
    assert_eq!(wait.state(), ContainerState::ContainerRunning);
    assert_eq!(wait.labels["io.kubernetes.pod.uid"], spec.uid);

    let sandboxes = kubelet.list_pod_sandboxes().expect("ListPodSandbox");
    assert_eq!(sandboxes.len(), 1);
    let meta = sandboxes[0].metadata.as_ref().expect("metadata");
    assert_eq!(
        (
            meta.namespace.as_str(),
            meta.name.as_str(),
            meta.uid.as_str()
        ),
        ("default", "hello", spec.uid.as_str())
    );
    assert_eq!(sandboxes[0].labels["app"], "hello");
    let listed = kubelet
        .list_containers(Some(&pod.sandbox_id))
        .expect("ListContainers");
    assert_eq!(listed.len(), 2, "{listed:?}");

    kubelet.remove_pod(&pod).expect("remove the pod");
    assert!(kubelet.list_containers(None).expect("list").is_empty());
    assert!(kubelet.list_pod_sandboxes().expect("list").is_empty());
}

#[test]
fn a_node_dropped_with_a_running_pod_leaves_no_process_or_mount() {
    use lookout_testsupport::cri::{BUSYBOX_IMAGE, PodSpec};
    if !require_cri("a_node_dropped_with_a_running_pod") {
        return;
    }
    let node = CriNode::start().expect("node");
    let mut kubelet = node.kubelet().expect("CRI client");
    let spec = PodSpec::new("default", "left-running").container(
        "app",
        BUSYBOX_IMAGE,
        &["sleep", "299.5"],
    );
    kubelet.run_pod(&spec).expect("run the pod");
    let dir = node.dir().to_path_buf();
    assert!(
        !mounts_under(&dir).is_empty(),
        "a running pod has its root file system mounted under the node"
    );
    let address = node.socket().to_str().expect("utf-8").to_owned();
    let ours = |needle: &str| -> Vec<String> {
        std::fs::read_dir("/proc")
            .expect("/proc")
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains(needle))
            .collect()
    };
    // StartContainer returns when `runc start` reads EOF on the exec FIFO,
    // that is when the init's execve closes its close-on-exec end. The ELF
    // loader sets the new command line only after that, so for a moment
    // the init's cmdline is empty: wait for `sleep` with a deadline.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while ours("sleep 299.5").is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!ours("sleep 299.5").is_empty(), "the container runs");
    assert!(!ours(&address).is_empty(), "the shim runs");
    let tasks = dir.join("state/io.containerd.runtime.v2.task/k8s.io");
    let shim_sockets: Vec<String> = std::fs::read_dir(&tasks)
        .expect("task bundles")
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("address")).ok())
        .filter_map(|a| a.trim().strip_prefix("unix://").map(str::to_owned))
        .collect();
    assert!(
        !shim_sockets.is_empty(),
        "the tasks name their shim's socket"
    );
    drop(kubelet);
    drop(node);
    for s in &shim_sockets {
        assert!(!std::path::Path::new(s).exists(), "shim socket {s} left");
    }
    assert!(mounts_under(&dir).is_empty(), "{:?}", mounts_under(&dir));
    assert!(!dir.exists(), "{} left behind", dir.display());
    // A process killed a moment ago may linger as a zombie of init.
    let alive = |c: &Vec<String>| c.iter().filter(|c| !c.is_empty()).count();
    assert_eq!(alive(&ours("sleep 299.5")), 0, "container left running");
    assert_eq!(alive(&ours(&address)), 0, "shim left running");
}
