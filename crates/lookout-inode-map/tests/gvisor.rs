//! The problem this crate exists for, reproduced with a real gVisor: a host
//! directory bind-mounted into a runsc container shows inode numbers that
//! gVisor makes up in the order files are first touched, so one host file
//! has one number in one run and another in the next. lookout does not
//! change gVisor; the second half of the test shows what a file server
//! that numbers files with this crate answers for the same two runs.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};

use lookout_inode_map::{
    ConflictPolicy, FileKey, InodeMap, Limits, Mode, Overflow, Stamp, probe_device,
};
use lookout_testsupport::{bundle, require_program, require_root};

const FILES: [&str; 8] = ["f1", "f2", "f3", "f4", "f5", "f6", "f7", "f8"];

/// Runs `script` in a runsc container with `data` bind-mounted read-only
/// at /data; its stdout.
fn in_gvisor(runsc: &Path, dir: &Path, data: &Path, name: &str, script: &str) -> String {
    let b = bundle::busybox(&dir.join(name), &["sh", "-c", script], |c| {
        let mounts = c["mounts"].as_array_mut().expect("mounts");
        mounts.push(serde_json::json!({
            "destination": "/data",
            "type": "bind",
            "source": data,
            "options": ["rbind", "ro"],
        }));
    });
    let id = format!("lk-inode-{name}-{}", std::process::id());
    let out = Command::new(runsc)
        .arg("--platform=ptrace")
        .arg("--network=none")
        // No cgroup per sandbox: runsc takes a failed `statfs` of
        // /sys/fs/cgroup for cgroup v1, and made a v1 path once in CI on
        // this v2-only machine (see lookout-agent's tests/runsc.rs).
        .arg("--ignore-cgroups")
        .arg("--root")
        .arg(dir.join("runsc-root"))
        .args(["run", "--bundle"])
        .arg(&b)
        .arg(&id)
        .stdin(Stdio::null())
        .output()
        .expect("runsc run");
    assert!(
        out.status.success(),
        "runsc run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `ls -i` output: name to inode number.
fn inodes(ls: &str) -> BTreeMap<String, u64> {
    ls.split_whitespace()
        .collect::<Vec<_>>()
        .chunks(2)
        .filter_map(|p| Some((p.get(1)?.to_string(), p[0].parse().ok()?)))
        .collect()
}

#[test]
fn gvisor_numbers_host_files_by_access_order_and_the_map_does_not() {
    if !require_root("gvisor_inodes")
        || !require_program("gvisor_inodes", "runsc")
        || !require_program("gvisor_inodes", "runc")
    {
        return;
    }
    let system = lookout_testsupport::find_program("runsc").expect("runsc");
    access_order_decides(&system);
}

#[test]
fn gvisor_of_debian_13_does_the_same() {
    if !require_root("gvisor_next_inodes") || !require_program("gvisor_next_inodes", "runc") {
        return;
    }
    let next = lookout_testsupport::runsc_next();
    if !next.is_file() {
        lookout_testsupport::skip(
            "gvisor_next_inodes",
            &format!(
                "{} is missing (`sudo -E cargo xtask test` fetches it)",
                next.display()
            ),
        );
        return;
    }
    access_order_decides(&next);
}

fn access_order_decides(runsc: &Path) {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    std::fs::create_dir(&data).expect("data");
    for f in FILES {
        std::fs::write(data.join(f), f).expect("write");
    }
    // Run 1 touches f5 first; run 2 only lists.
    let first = inodes(&in_gvisor(
        runsc,
        dir.path(),
        &data,
        "one",
        "cat /data/f5 >/dev/null; ls -i /data",
    ));
    let second = inodes(&in_gvisor(runsc, dir.path(), &data, "two", "ls -i /data"));
    assert_eq!(first.len(), FILES.len(), "{first:?}");
    assert_eq!(second.len(), FILES.len(), "{second:?}");
    let host: BTreeMap<String, u64> = FILES
        .iter()
        .map(|f| {
            let m = std::fs::metadata(data.join(f)).expect("stat");
            (f.to_string(), m.ino())
        })
        .collect();
    eprintln!("host: {host:?}\ngVisor, run 1: {first:?}\ngVisor, run 2: {second:?}");
    assert_ne!(
        first, second,
        "gVisor gave every host file the same number in both runs: the problem is gone \
         in this runsc release (update docs/inode-map.md)"
    );
    assert_ne!(first, host, "gVisor shows made-up numbers, not the host's");

    // The same two runs through a file server that numbers with this
    // crate: each run is a fresh map meeting the files in its order.
    let (dev, identity) = probe_device(&data).expect("device");
    let key = |f: &str| FileKey { dev, ino: host[f] };
    let run = |mode: Mode, order: &[&str], restore: Option<&lookout_inode_map::Snapshot>| {
        let mut map = InodeMap::new(mode, Limits::default());
        map.register_device(dev, identity.clone()).expect("device");
        if let Some(s) = restore {
            map.restore(s, ConflictPolicy::Fail).expect("restore");
        }
        let numbers: BTreeMap<String, u64> = order
            .iter()
            .map(|f| {
                let m = map.map(key(f), Stamp::UNKNOWN, None).expect("map");
                (f.to_string(), m.ino)
            })
            .collect();
        (numbers, map.snapshot())
    };
    let order_one: Vec<&str> = std::iter::once("f5")
        .chain(FILES.iter().copied().filter(|f| *f != "f5"))
        .collect();
    // Stable across restarts with no state at all: numbers from the host's.
    for mode in [
        Mode::Passthrough,
        Mode::Xino {
            bits: 8,
            overflow: Overflow::Fallback,
        },
    ] {
        let (one, _) = run(mode, &order_one, None);
        let (two, _) = run(mode, &FILES, None);
        assert_eq!(one, two, "{mode:?}: one number per host file in both runs");
    }
    // Allocated numbers like gVisor (first-access order) ...
    let (one, saved) = run(Mode::Allocated, &order_one, None);
    let (two, _) = run(Mode::Allocated, &FILES, None);
    assert_ne!(one, two, "Allocated without a snapshot depends on order");
    // ... and is stable only through a snapshot (a checkpoint/restore).
    let (restored, _) = run(Mode::Allocated, &FILES, Some(&saved));
    assert_eq!(one, restored, "Allocated through a snapshot");
}
