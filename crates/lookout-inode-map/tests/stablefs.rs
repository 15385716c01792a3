//! The proof: a tree spanning two host file systems (the test machine's
//! ext4 and a loop-mounted ext4), served through the `stablefs` example
//! (FUSE), unmounted and mounted again by a fresh process. Root, /dev/fuse,
//! mkfs.ext4 and a loop device are needed (and present in CI).

use std::collections::BTreeMap;
use std::os::unix::fs::{DirEntryExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lookout_testsupport::{require_program, require_root};

fn stablefs_bin() -> PathBuf {
    // target/<profile>/deps/<this test> -> target/<profile>/examples/stablefs
    let exe = std::env::current_exe().expect("current exe");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|p| p.join("examples/stablefs"))
        .expect("target dir");
    // `cargo test` builds the examples with the tests; `--test stablefs`
    // alone does not.
    assert!(
        bin.exists(),
        "{} is missing: run `cargo test -p lookout-inode-map` (or `cargo build --examples`)",
        bin.display()
    );
    bin
}

fn ready(test: &str) -> bool {
    require_root(test)
        && require_program(test, "mkfs.ext4")
        && require_program(test, "mount")
        && (Path::new("/dev/fuse").exists() || {
            lookout_testsupport::skip(test, "/dev/fuse is missing");
            false
        })
}

/// A tree on the test's file system with a loop-mounted ext4 inside.
struct Tree {
    dir: tempfile::TempDir,
}

impl Tree {
    fn new() -> Tree {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = dir.path().join("src");
        for d in ["a/b/c", "logs", "vol"] {
            std::fs::create_dir_all(src.join(d)).expect("mkdir");
        }
        for i in 0..20 {
            std::fs::write(src.join(format!("logs/app-{i}.log")), format!("line {i}\n"))
                .expect("write");
        }
        std::fs::write(src.join("a/b/c/deep"), "deep").expect("write");
        std::os::unix::fs::symlink("../logs/app-1.log", src.join("a/link")).expect("symlink");
        let img = dir.path().join("vol.img");
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(16 << 20))
            .expect("image");
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img));
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(src.join("vol")));
        for i in 0..10 {
            std::fs::write(src.join(format!("vol/data-{i}")), "v").expect("write");
        }
        std::fs::create_dir_all(src.join("vol/sub")).expect("mkdir");
        std::fs::write(src.join("vol/sub/x"), "x").expect("write");
        Tree { dir }
    }

    fn src(&self) -> PathBuf {
        self.dir.path().join("src")
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg(self.src().join("vol"))
            .stderr(Stdio::null())
            .status();
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

struct Mount {
    child: Child,
    at: PathBuf,
    log: PathBuf,
}

impl Mount {
    fn new(mode: &str, src: &Path, at: &Path, snapshot: Option<&Path>) -> Mount {
        std::fs::create_dir_all(at).expect("mountpoint");
        let log = at.with_extension("log");
        let mut cmd = Command::new(stablefs_bin());
        cmd.args(["--mode", mode]);
        if let Some(s) = snapshot {
            cmd.arg("--snapshot").arg(s);
        }
        let child = cmd
            .arg(src)
            .arg(at)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn stablefs");
        let m = Mount {
            child,
            at: at.to_path_buf(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split(' ').nth(4) == at.to_str() && l.contains("stablefs"))
        {
            assert!(
                Instant::now() < deadline,
                "stablefs never mounted: {}",
                std::fs::read_to_string(&m.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        m
    }

    /// Unmounts and waits for the process (which saves its snapshot).
    fn unmount(mut self) -> String {
        run(Command::new("umount").arg(&self.at));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                assert!(status.success(), "stablefs failed: {log}");
                return log;
            }
            assert!(
                Instant::now() < deadline,
                "stablefs did not exit after umount"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.at)
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every path under `root` (relative), sorted.
fn paths(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for e in std::fs::read_dir(root.join(&rel))
            .expect("read_dir")
            .flatten()
        {
            let r = rel.join(e.file_name());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(r.clone());
            }
            out.push(r);
        }
    }
    out.sort();
    out
}

/// The device the map gave a file (`trusted.stablefs.dev`): FUSE itself
/// shows one `st_dev` per mount, the kernel's anonymous device, which
/// another mount may not get again.
fn mapped_dev(path: &Path) -> u64 {
    let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))
        .expect("path");
    let name = c"trusted.stablefs.dev";
    let mut buf = [0u8; 32];
    // SAFETY: NUL-terminated strings and a buffer of the given length.
    let n = unsafe {
        libc::lgetxattr(
            c.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    assert!(
        n > 0,
        "getxattr {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    std::str::from_utf8(&buf[..n as usize])
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("a number")
}

/// (st_ino, mapped st_dev) of each path through the mount, stat'ed in
/// `order`. Also checks that FUSE shows the mount's one `st_dev` for all.
fn record(at: &Path, order: &[PathBuf]) -> BTreeMap<PathBuf, (u64, u64)> {
    let mount_dev = std::fs::metadata(at).expect("mount").dev();
    order
        .iter()
        .map(|p| {
            let m = std::fs::symlink_metadata(at.join(p))
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert_eq!(m.dev(), mount_dev);
            (p.clone(), (m.ino(), mapped_dev(&at.join(p))))
        })
        .collect()
}

/// getdents (`d_ino`) agrees with `stat` for every entry.
fn listing_agrees_with_stat(at: &Path) {
    let mut stack = vec![at.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            let m = std::fs::symlink_metadata(e.path()).expect("stat");
            assert_eq!(
                e.ino(),
                m.ino(),
                "d_ino of {} differs from st_ino",
                e.path().display()
            );
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
}

#[test]
fn numbers_survive_a_remount_by_a_fresh_process_in_every_stable_mode() {
    if !ready("stablefs_remount") {
        return;
    }
    let tree = Tree::new();
    let src = tree.src();
    let order = paths(&src);
    let reversed: Vec<PathBuf> = order.iter().rev().cloned().collect();
    assert!(order.len() > 30, "{order:?}");
    for mode in ["passthrough", "xino", "allocated", "hashed"] {
        let at = tree.dir.path().join(format!("mnt-{mode}"));
        let snap = tree.dir.path().join(format!("{mode}.snap"));
        let m = Mount::new(mode, &src, &at, Some(&snap));
        let first = record(&at, &order);
        listing_agrees_with_stat(&at);
        // `ls -i` shows the same numbers.
        let ls = Command::new("ls")
            .arg("-i")
            .arg(at.join("logs"))
            .output()
            .expect("ls");
        for line in String::from_utf8_lossy(&ls.stdout).lines() {
            let mut parts = line.split_whitespace();
            let (Some(ino), Some(name)) = (parts.next(), parts.next()) else {
                continue;
            };
            assert_eq!(
                ino.parse::<u64>().ok(),
                first.get(&PathBuf::from("logs").join(name)).map(|x| x.0),
                "ls -i {name} in {mode}"
            );
        }
        m.unmount();
        // A fresh process, the other access order.
        let m = Mount::new(mode, &src, &at, Some(&snap));
        let second = record(&at, &reversed);
        let log = m.unmount();
        assert_eq!(
            first, second,
            "{mode}: numbers changed across the remount\n{log}"
        );
        let distinct: std::collections::HashSet<(u64, u64)> = first.values().copied().collect();
        assert_eq!(
            distinct.len(),
            first.len(),
            "{mode}: two files share a number"
        );
        if mode == "passthrough" {
            // Host numbers, and one virtual device per host file system.
            let devs: std::collections::HashSet<u64> = first.values().map(|x| x.1).collect();
            assert_eq!(devs.len(), 2, "two host file systems, two devices");
            let host = std::fs::metadata(src.join("logs/app-1.log"))
                .expect("stat")
                .ino();
            assert_eq!(first[&PathBuf::from("logs/app-1.log")].0, host);
        }
    }
}

#[test]
fn allocated_numbers_without_a_snapshot_follow_the_access_order() {
    if !ready("stablefs_allocated") {
        return;
    }
    let tree = Tree::new();
    let src = tree.src();
    let order = paths(&src);
    let reversed: Vec<PathBuf> = order.iter().rev().cloned().collect();
    let at = tree.dir.path().join("mnt");
    let m = Mount::new("allocated", &src, &at, None);
    let first = record(&at, &order);
    m.unmount();
    let m = Mount::new("allocated", &src, &at, None);
    let second = record(&at, &reversed);
    m.unmount();
    let changed = first
        .iter()
        .filter(|(p, v)| second.get(*p).map(|x| x.0) != Some(v.0))
        .count();
    assert!(
        changed > first.len() / 2,
        "the legacy counter should renumber files when the access order changes; {changed} of {} changed",
        first.len()
    );
}

#[test]
fn a_reused_host_inode_gets_a_new_number() {
    if !ready("stablefs_reuse") {
        return;
    }
    let tree = Tree::new();
    let src = tree.src();
    for mode in ["allocated", "hashed"] {
        let at = tree.dir.path().join(format!("mnt-{mode}"));
        let snap = tree.dir.path().join(format!("{mode}.snap"));
        let victim = src.join("vol/data-3");
        let old_host = std::fs::metadata(&victim).expect("stat").ino();
        let m = Mount::new(mode, &src, &at, Some(&snap));
        let old = std::fs::metadata(at.join("vol/data-3"))
            .expect("stat")
            .ino();
        m.unmount();
        // On the host: unlink, then create until ext4 hands out the freed
        // inode again (it usually does at once).
        std::fs::remove_file(&victim).expect("rm");
        let mut reborn = None;
        for i in 0..200 {
            let p = src.join(format!("vol/new-{mode}-{i}"));
            std::fs::write(&p, "new life").expect("create");
            if std::fs::metadata(&p).expect("stat").ino() == old_host {
                reborn = Some(p);
                break;
            }
        }
        let reborn = reborn.expect("ext4 reused the inode");
        let rel = reborn.strip_prefix(&src).expect("under src").to_path_buf();
        let m = Mount::new(mode, &src, &at, Some(&snap));
        let new = std::fs::metadata(at.join(&rel)).expect("stat").ino();
        m.unmount();
        assert_ne!(
            new, old,
            "{mode}: the new file inherited the old file's number"
        );
        // Put the victim back for the next mode.
        std::fs::write(&victim, "v").expect("write");
    }
}
