//! The proof: a tree spanning two host file systems (the test machine's
//! ext4 and a loop-mounted ext4), served through the `stablefs` example
//! (FUSE), unmounted and mounted again by a fresh process. Root, /dev/fuse,
//! mkfs.ext4 and a loop device are needed (and present in CI).

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
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
    // alone does not, and would run whatever binary an older build left.
    let build = "run `cargo test -p lookout-inode-map` or `cargo build -p lookout-inode-map --example stablefs` first";
    let built = bin
        .metadata()
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("{}: {e}: {build}", bin.display()));
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sources = std::fs::read_dir(crate_dir.join("src"))
        .expect("src")
        .flatten()
        .map(|e| e.path())
        .chain([crate_dir.join("examples/stablefs.rs")]);
    for source in sources {
        let changed = source.metadata().and_then(|m| m.modified()).expect("mtime");
        assert!(
            changed <= built,
            "{} is older than {}: {build}",
            bin.display(),
            source.display()
        );
    }
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

/// Root and /dev/fuse, no loop device.
fn fuse_ready(test: &str) -> bool {
    require_root(test)
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
    xattr_number(path, c"trusted.stablefs.dev")
}

/// An attribute stablefs serves, as a number.
fn xattr_number(path: &Path, name: &std::ffi::CStr) -> u64 {
    let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))
        .expect("path");
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
        "getxattr {} {name:?}: {}",
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

// A served tree someone hostile writes to (issue #11, item 5): names
// swapped for symlinks after the kernel looked them up, symlinks planted in
// the tree, a symlink at the snapshot path.

const SECRET: &str = "s3cr3t: outside the served root\n";

/// Whether `read` holds any of [`SECRET`]: a read through a node the kernel
/// has the size of may return only the first bytes.
fn leaks(read: &str) -> bool {
    read.contains(&SECRET[..6])
}

/// A served tree, its mount point, and a directory outside both whose
/// `secret` file holds [`SECRET`].
struct Hostile {
    dir: tempfile::TempDir,
    outside: tempfile::TempDir,
}

impl Hostile {
    fn new() -> Hostile {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("src")).expect("mkdir");
        std::fs::write(outside.path().join("secret"), SECRET).expect("write");
        Hostile { dir, outside }
    }

    fn src(&self) -> PathBuf {
        self.dir.path().join("src")
    }

    fn at(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }

    fn secret(&self) -> PathBuf {
        self.outside.path().join("secret")
    }
}

/// Replaces `path` with a symlink to `target`, atomically (rename).
fn swap_for_symlink(target: &Path, path: &Path) {
    let tmp = path.with_extension("swap");
    std::os::unix::fs::symlink(target, &tmp).expect("symlink");
    std::fs::rename(&tmp, path).expect("rename");
}

/// Opens `path` as an `O_PATH` fd: no FUSE `OPEN`, only a reference to
/// the node the kernel looked up.
fn node_ref(path: &Path, flags: nix::fcntl::OFlag) -> std::os::fd::OwnedFd {
    use nix::fcntl::OFlag;
    nix::fcntl::open(
        path,
        OFlag::O_PATH | OFlag::O_CLOEXEC | flags,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `args` in a private mount namespace where `hide` is covered by an
/// empty tmpfs: what the process reads from under `hide` can only have
/// come through a file server in the first namespace (stablefs), never
/// from its own kernel's symlink resolution.
fn run_hiding(hide: &Path, args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(r#"mount -t tmpfs stablefs-test "$1" && shift && exec "$@""#)
        .arg("sh")
        .arg(hide)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("unshare")
}

#[test]
fn a_file_swapped_for_a_symlink_after_lookup_is_not_followed() {
    let test = "stablefs_swapped_file";
    if !fuse_ready(test) || !require_program(test, "unshare") {
        return;
    }
    let h = Hostile::new();
    std::fs::write(h.src().join("f"), "public\n").expect("write");
    std::fs::write(h.src().join("g"), "public\n").expect("write");
    let m = Mount::new("xino", &h.src(), &h.at(), None);
    // The kernel looks both up (and keeps a reference to f's node).
    for name in ["f", "g"] {
        assert!(
            std::fs::metadata(h.at().join(name))
                .expect("stat")
                .is_file()
        );
    }
    let f = node_ref(&h.at().join("f"), nix::fcntl::OFlag::empty());
    swap_for_symlink(&h.secret(), &h.src().join("f"));
    swap_for_symlink(&h.secret(), &h.src().join("g"));
    // Opening f's node again (the magic link skips the name lookup, so the
    // kernel sends OPEN for the node it looked up before the swap, however
    // long ago that was): a server that opens by path follows the symlink.
    let reopened = std::fs::read_to_string(format!("/proc/self/fd/{}", f.as_raw_fd()));
    assert!(
        !leaks(reopened.as_deref().unwrap_or_default()),
        "the server followed a symlink swapped in after lookup: {reopened:?}"
    );
    let err = reopened.expect_err("the node's name holds a symlink now");
    assert_eq!(err.raw_os_error(), Some(libc::ESTALE), "{err}");
    drop(f);
    // By name, with the outside hidden: within the entry's TTL the kernel
    // opens the node it looked up (the server refuses), after it the new
    // symlink (which the kernel resolves itself, to the empty tmpfs).
    let out = run_hiding(
        h.outside.path(),
        &["cat".as_ref(), h.at().join("g").as_os_str()],
    );
    assert!(
        !leaks(&String::from_utf8_lossy(&out.stdout)),
        "the server served the outside file: {out:?}"
    );
    assert!(!out.status.success(), "{out:?}");
    m.unmount();
}

#[test]
fn a_directory_swapped_for_a_symlink_after_lookup_is_not_followed() {
    let test = "stablefs_swapped_dir";
    if !fuse_ready(test) {
        return;
    }
    let h = Hostile::new();
    std::fs::create_dir(h.src().join("d")).expect("mkdir");
    std::fs::write(h.src().join("d/inside"), "inside\n").expect("write");
    std::fs::write(h.outside.path().join("only-outside"), SECRET).expect("write");
    let m = Mount::new("xino", &h.src(), &h.at(), None);
    assert!(h.at().join("d/inside").exists());
    let d = node_ref(&h.at().join("d"), nix::fcntl::OFlag::O_DIRECTORY);
    std::fs::rename(h.src().join("d"), h.src().join("d.old")).expect("rename");
    std::os::unix::fs::symlink(h.outside.path(), h.src().join("d")).expect("symlink");
    // Looked up in d's node: a server that joins paths resolves
    // <root>/d/only-outside through the symlink.
    let opened = nix::fcntl::openat(
        &d,
        "only-outside",
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    );
    let read = opened.map(|fd| {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut std::fs::File::from(fd), &mut s);
        s
    });
    assert!(
        !leaks(read.as_deref().unwrap_or_default()),
        "the server followed a directory symlink swapped in after lookup"
    );
    assert_eq!(read, Err(nix::errno::Errno::ENOENT));
    // The node is still the directory it was (renamed on the host).
    let inside = nix::fcntl::openat(
        &d,
        "inside",
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .expect("d's own file");
    let mut s = String::new();
    std::io::Read::read_to_string(&mut std::fs::File::from(inside), &mut s).expect("read");
    assert_eq!(s, "inside\n");
    drop(d);
    m.unmount();
}

#[test]
fn a_planted_symlink_is_served_as_a_symlink_and_never_followed() {
    let test = "stablefs_planted_symlink";
    if !fuse_ready(test) || !require_program(test, "unshare") {
        return;
    }
    let h = Hostile::new();
    std::os::unix::fs::symlink(h.secret(), h.src().join("escape")).expect("symlink");
    std::fs::write(h.src().join("plain"), "plain\n").expect("write");
    let m = Mount::new("xino", &h.src(), &h.at(), None);
    let listed = std::fs::read_dir(h.at())
        .expect("read_dir")
        .flatten()
        .find(|e| e.file_name() == "escape")
        .expect("escape is listed");
    assert!(listed.file_type().expect("d_type").is_symlink());
    // (A DirEntry keeps its directory open, which would keep the mount busy.)
    drop(listed);
    let escape = h.at().join("escape");
    assert!(
        std::fs::symlink_metadata(&escape)
            .expect("lstat")
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read_link(&escape).expect("readlink"), h.secret());
    let nofollow = nix::fcntl::open(
        &escape,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_NOFOLLOW,
        nix::sys::stat::Mode::empty(),
    );
    assert_eq!(nofollow.err(), Some(nix::errno::Errno::ELOOP));
    // The kernel resolves a symlink itself, on the client's side: with the
    // outside hidden from the client, reading through the link finds the
    // empty tmpfs. A server that followed it (serving `escape` as a
    // regular file) would hand over the secret it can still see.
    let out = run_hiding(h.outside.path(), &["cat".as_ref(), escape.as_os_str()]);
    assert!(
        !leaks(&String::from_utf8_lossy(&out.stdout)),
        "the server served the symlink's target: {out:?}"
    );
    assert!(!out.status.success(), "{out:?}");
    // The hiding namespace still reaches the mount.
    let plain = run_hiding(
        h.outside.path(),
        &["cat".as_ref(), h.at().join("plain").as_os_str()],
    );
    assert_eq!(
        String::from_utf8_lossy(&plain.stdout),
        "plain\n",
        "{plain:?}"
    );
    m.unmount();
}

/// The server's open fds.
fn fds(child: &Child) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", child.id()))
        .expect("/proc/<pid>/fd")
        .count()
}

#[test]
fn forgotten_nodes_close_their_fds() {
    let test = "stablefs_forget";
    if !fuse_ready(test) {
        return;
    }
    const FILES: usize = 300;
    let h = Hostile::new();
    std::fs::create_dir(h.src().join("many")).expect("mkdir");
    for i in 0..FILES {
        std::fs::write(h.src().join(format!("many/f-{i}")), "x").expect("write");
    }
    let m = Mount::new("allocated", &h.src(), &h.at(), None);
    let nodes = || xattr_number(&h.at(), c"trusted.stablefs.nodes");
    let inos: Vec<u64> = (0..FILES)
        .map(|i| {
            std::fs::metadata(h.at().join(format!("many/f-{i}")))
                .expect("stat")
                .ino()
        })
        .collect();
    let before = nodes();
    assert!(
        before > FILES as u64,
        "{before} nodes after {FILES} lookups"
    );
    let fds_before = fds(&m.child);
    // Dropping the dentry and inode caches makes the kernel send FORGET
    // for every node it no longer holds; it does so asynchronously.
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        std::fs::write("/proc/sys/vm/drop_caches", "2").expect("drop_caches");
        let n = nodes();
        if n < before / 10 {
            break n;
        }
        assert!(
            Instant::now() < deadline,
            "still {n} of {before} nodes live after dropping the caches"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let fds_after = fds(&m.child);
    assert!(
        fds_before - fds_after >= (before - after) as usize,
        "{} nodes forgotten but only {fds_before} -> {fds_after} fds",
        before - after
    );
    // Forgotten is not renumbered: the released entries keep their numbers
    // while the map has room.
    for (i, ino) in inos.iter().enumerate().step_by(37) {
        let again = std::fs::metadata(h.at().join(format!("many/f-{i}")))
            .expect("stat")
            .ino();
        assert_eq!(again, *ino, "many/f-{i} after its node was forgotten");
    }
    let log = m.unmount();
    assert!(log.contains("forgotten"), "{log}");
}

#[test]
fn a_symlink_at_the_snapshot_path_is_replaced_not_followed() {
    let test = "stablefs_snapshot_symlink";
    if !fuse_ready(test) {
        return;
    }
    let h = Hostile::new();
    for i in 0..5 {
        std::fs::write(h.src().join(format!("f-{i}")), "x").expect("write");
    }
    let precious = h.outside.path().join("precious");
    std::fs::write(&precious, "not a snapshot").expect("write");
    let state = h.dir.path().join("state");
    std::fs::create_dir(&state).expect("mkdir");
    let snap = state.join("s.snap");
    let m = Mount::new("allocated", &h.src(), &h.at(), Some(&snap));
    for i in 0..5 {
        std::fs::metadata(h.at().join(format!("f-{i}"))).expect("stat");
    }
    // Planted while the server runs; it writes the snapshot at unmount.
    // Also at the temporary name stablefs once wrote through first.
    std::os::unix::fs::symlink(&precious, &snap).expect("symlink");
    std::os::unix::fs::symlink(&precious, snap.with_extension("tmp")).expect("symlink");
    m.unmount();
    assert_eq!(
        std::fs::read(&precious).expect("read"),
        b"not a snapshot",
        "the snapshot was written through a symlink"
    );
    assert!(
        std::fs::symlink_metadata(&snap)
            .expect("lstat")
            .file_type()
            .is_file(),
        "the symlink was not replaced"
    );
    let mut left: Vec<_> = std::fs::read_dir(&state)
        .expect("read_dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["s.snap", "s.tmp"],
        "a temporary file was left behind"
    );
    // And it is the snapshot: the next server restores from it.
    let m = Mount::new("allocated", &h.src(), &h.at(), Some(&snap));
    let log = m.unmount();
    assert!(
        log.lines()
            .any(|l| l.starts_with("stablefs: restored ") && !l.contains("restored 0 ")),
        "{log}"
    );

    // A symlink there at start, even to a valid snapshot, is not read
    // through: the server refuses to start.
    let elsewhere = h.outside.path().join("valid.snap");
    std::fs::rename(&snap, &elsewhere).expect("mv");
    let valid = std::fs::read(&elsewhere).expect("read");
    std::os::unix::fs::symlink(&elsewhere, &snap).expect("symlink");
    let log = h.dir.path().join("refused.log");
    let mut child = Command::new(stablefs_bin())
        .args(["--mode", "allocated", "--snapshot"])
        .arg(&snap)
        .arg(h.src())
        .arg(h.at())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn stablefs");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = Command::new("umount").arg("-l").arg(h.at()).status();
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "stablefs started from a symlinked snapshot: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains(&*snap.to_string_lossy()), "{log}");
    assert!(
        std::fs::symlink_metadata(&snap)
            .expect("lstat")
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read(&elsewhere).expect("read"), valid);
}
