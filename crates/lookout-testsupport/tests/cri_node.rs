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
