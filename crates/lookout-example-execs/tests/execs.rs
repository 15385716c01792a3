//! The example against real pinned maps, without an agent: each test mounts
//! a private bpffs instance, pins the two container maps there as lookout
//! does, and runs the example binary with `--pin-dir` pointing at it.
//!
//! Root only (BPF, mounts, cgroups), and the binary must have been built
//! with its BPF object (`cargo xtask build-ebpf` first). Otherwise each test
//! prints a loud SKIPPED line, or fails under CI.

use std::ffi::CString;
use std::io::{BufRead as _, BufReader, Read as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aya::maps::{HashMap, Map, MapData};
use aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_HASH;
use lookout_ebpf_common::{
    CONTAINER_MAPS_FLAGS, CONTAINER_MAPS_MAX_ENTRIES, CONTAINERS_BY_CGROUP_KERNEL_NAME,
    CONTAINERS_BY_CGROUP_MAP, CONTAINERS_BY_MNTNS_KERNEL_NAME, CONTAINERS_BY_MNTNS_MAP,
    ContainerEntry,
};
use lookout_testsupport::perf::TracepointSampler;
use lookout_testsupport::{require_root, skip, wait_until};

/// The example binary.
const EXAMPLE: &str = env!("CARGO_BIN_EXE_lookout-example-execs");
/// Size of the BPF object embedded in [`EXAMPLE`] (`0`: built without).
const OBJECT_BYTES: &str = env!("LOOKOUT_EXAMPLE_EXECS_OBJECT_BYTES");
/// How long anything the example does may take on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(30);

/// A test that needs root and the example's BPF object: `$name` is both the
/// test function and the name its skip line gives.
macro_rules! privileged_test {
    ($(#[$doc:meta])* fn $name:ident($env:ident) $body:block) => {
        $(#[$doc])*
        #[test]
        fn $name() {
            let Some($env) = prerequisites(stringify!($name)) else {
                return;
            };
            $body
        }
    };
}

/// What every test here needs from the machine.
struct Machine {
    /// The cgroup v2 hierarchy's root: `bpf_get_current_cgroup_id()` is the
    /// id of a task's directory in it.
    cgroup2: PathBuf,
}

/// The machine, or `None` (and a skip, or a failure under CI) when it
/// lacks something.
fn prerequisites(test: &str) -> Option<Machine> {
    if !require_root(test) {
        return None;
    }
    if OBJECT_BYTES == "0" {
        skip(
            test,
            "lookout-example-execs was built without its BPF object: run `cargo xtask build-ebpf`, \
             then the tests again",
        );
        return None;
    }
    let Some(cgroup2) = cgroup2_root() else {
        skip(
            test,
            "no cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified",
        );
        return None;
    };
    ensure_tracefs();
    Some(Machine { cgroup2 })
}

/// `/sys/fs/cgroup` on a cgroup v2 host, `/sys/fs/cgroup/unified` on a
/// hybrid one (v1 controllers, v2 for process tracking: this VM), if
/// either is a cgroup2 file system.
fn cgroup2_root() -> Option<PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| is_cgroup2(p))
}

/// Whether `path` is on a cgroup v2 file system (`statfs(2)`'s `f_type`).
fn is_cgroup2(path: &Path) -> bool {
    let c_path = c_path(path);
    // SAFETY: statfs is plain data, written by the call before it is read.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid, exclusive out-pointer.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut buf) };
    rc == 0 && buf.f_type == libc::CGROUP2_SUPER_MAGIC
}

/// Attaching a tracepoint needs tracefs. The agent mounts it when it is
/// missing (these VMs boot without it); with no agent here, the test does
/// the same, with the same flags.
fn ensure_tracefs() {
    let tracing = Path::new("/sys/kernel/tracing");
    if tracing.join("events").is_dir() || Path::new("/sys/kernel/debug/tracing/events").is_dir() {
        return;
    }
    // SAFETY: NUL-terminated literals; a null data pointer is allowed.
    let rc = unsafe {
        libc::mount(
            c"tracefs".as_ptr(),
            c"/sys/kernel/tracing".as_ptr(),
            c"tracefs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    };
    assert_eq!(
        rc,
        0,
        "mounting tracefs at {}: {}",
        tracing.display(),
        std::io::Error::last_os_error()
    );
}

/// A private instance of the BPF file system on a fresh temporary
/// directory (each `mount -t bpf` is a new instance), unmounted on drop,
/// failed test or not. Its pins go with it.
struct BpfFs {
    dir: tempfile::TempDir,
    /// What the kernel puts in every new instance (`maps.debug` and
    /// `progs.debug` with CONFIG_BPF_PRELOAD), left out of [`BpfFs::names`].
    preloaded: Vec<String>,
}

impl BpfFs {
    fn mount() -> BpfFs {
        let dir = tempfile::Builder::new()
            .prefix("lookout-example-execs-bpffs-")
            .tempdir()
            .expect("a temporary directory");
        let target = c_path(dir.path());
        // SAFETY: NUL-terminated strings; a null data pointer is allowed.
        let rc = unsafe {
            libc::mount(
                c"bpf".as_ptr(),
                target.as_ptr(),
                c"bpf".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        assert_eq!(
            rc,
            0,
            "mount -t bpf bpf {}: {}",
            dir.path().display(),
            std::io::Error::last_os_error()
        );
        let mut bpffs = BpfFs {
            dir,
            preloaded: Vec::new(),
        };
        bpffs.preloaded = bpffs.names();
        bpffs
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The names in the directory but the kernel's own, sorted.
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.path())
            .expect("read the bpffs directory")
            .map(|e| {
                e.expect("a directory entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|name| !self.preloaded.contains(name))
            .collect();
        names.sort();
        names
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        let target = c_path(self.dir.path());
        // SAFETY: a NUL-terminated path.
        if unsafe { libc::umount2(target.as_ptr(), 0) } != 0 {
            let error = std::io::Error::last_os_error();
            eprintln!("umount {}: {error}; detaching", self.dir.path().display());
            // SAFETY: as above.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("a path without NUL")
}

/// Creates a container map as the agent does (hash, u64 keys,
/// `BPF_F_NO_PREALLOC`, the agent's kernel name) with `value_size`-byte
/// values, and pins it at `path`. The pin keeps it alive.
fn pin_map(path: &Path, kernel_name: &str, value_size: u32) -> MapData {
    let definition = aya_obj::Map::new_from_params(
        BPF_MAP_TYPE_HASH as u32,
        8,
        value_size,
        CONTAINER_MAPS_MAX_ENTRIES,
        CONTAINER_MAPS_FLAGS,
    );
    let map = MapData::create(definition, kernel_name, None)
        .unwrap_or_else(|e| panic!("creating the map {kernel_name}: {e}"));
    map.pin(path)
        .unwrap_or_else(|e| panic!("pinning {}: {e}", path.display()));
    map
}

/// Both of lookout's maps pinned in `bpffs`, as a running agent leaves
/// them; returns `containers_by_cgroup` for the test to fill.
fn pin_lookouts_maps(bpffs: &BpfFs) -> HashMap<MapData, u64, [u8; ContainerEntry::SIZE]> {
    let size = ContainerEntry::SIZE as u32;
    let by_cgroup = pin_map(
        &bpffs.path().join(CONTAINERS_BY_CGROUP_MAP),
        CONTAINERS_BY_CGROUP_KERNEL_NAME,
        size,
    );
    pin_map(
        &bpffs.path().join(CONTAINERS_BY_MNTNS_MAP),
        CONTAINERS_BY_MNTNS_KERNEL_NAME,
        size,
    );
    HashMap::try_from(Map::HashMap(by_cgroup)).expect("a hash map of u64 to 128 bytes")
}

/// A cgroup v2 directory of the test's own, removed on drop.
struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    fn create(machine: &Machine, name: &str) -> Cgroup {
        let path = machine.cgroup2.join(format!(
            "lookout-example-execs-{}-{name}",
            std::process::id()
        ));
        std::fs::create_dir(&path)
            .unwrap_or_else(|e| panic!("creating the cgroup {}: {e}", path.display()));
        Cgroup { path }
    }

    /// The cgroup's id: the inode number of its directory, what
    /// `bpf_get_current_cgroup_id()` returns for a task in it.
    fn id(&self) -> u64 {
        std::fs::metadata(&self.path)
            .unwrap_or_else(|e| panic!("stat {}: {e}", self.path.display()))
            .ino()
    }

    /// Runs `/bin/true` in this cgroup: a child that moves itself in
    /// (writes "0" to `cgroup.procs`) and then execs once. Returns its pid.
    fn exec_true(&self) -> u32 {
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(self.path.join("cgroup.procs"))
            .unwrap_or_else(|e| panic!("opening {}/cgroup.procs: {e}", self.path.display()));
        let fd = procs.as_raw_fd();
        let mut command = Command::new("/bin/true");
        // SAFETY: the closure runs in the forked child before exec and only
        // calls write(2), which is async-signal-safe; it allocates nothing.
        // `procs` outlives the spawn below, so `fd` is open in the child.
        unsafe {
            command.pre_exec(move || {
                if libc::write(fd, b"0".as_ptr().cast(), 1) == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("running /bin/true in {}: {e}", self.path.display()));
        let status = child.wait().expect("waiting for /bin/true");
        assert!(status.success(), "/bin/true in a cgroup: {status}");
        drop(procs);
        child.id()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // The child has been waited for, so the cgroup is empty; the kernel
        // may still be tearing its last task down for a moment.
        let start = std::time::Instant::now();
        while let Err(error) = std::fs::remove_dir(&self.path) {
            if start.elapsed() > Duration::from_secs(5) {
                eprintln!("removing the cgroup {}: {error}", self.path.display());
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The example binary, running, its output collected line by line. Killed
/// on drop if still running.
struct Example {
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
}

impl Example {
    fn start(pin_dir: &Path) -> Example {
        let mut child = Command::new(EXAMPLE)
            .arg("--pin-dir")
            .arg(pin_dir)
            .args(["--json", "--interval", "100ms"])
            // A safety net: it stops by itself even if this test is killed.
            .args(["--exit-after", "120s"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {EXAMPLE}: {e}"));
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let out = child.stdout.take().expect("piped stdout");
        let lines = Arc::clone(&stdout);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                lines.lock().expect("the stdout lock").push(line);
            }
        });
        let mut err = child.stderr.take().expect("piped stderr");
        let text = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = err.read(&mut buf) {
                text.lock()
                    .expect("the stderr lock")
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Example {
            child,
            stdout,
            stderr,
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().expect("the stderr lock").clone()
    }

    /// The JSON lines printed so far.
    fn rows(&self) -> Vec<serde_json::Value> {
        self.stdout
            .lock()
            .expect("the stdout lock")
            .iter()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON: {line:?}: {e}"))
            })
            .collect()
    }

    /// Waits until the example says its program is attached; fails at once
    /// if it exits instead.
    fn wait_attached(&mut self) {
        let stderr = Arc::clone(&self.stderr);
        let text = move || stderr.lock().expect("the stderr lock").clone();
        wait_until(
            DEADLINE,
            || {
                if let Ok(Some(status)) = self.child.try_wait() {
                    panic!(
                        "the example exited ({status}) before attaching:\n{}",
                        text()
                    );
                }
                text().contains("attached")
            },
            || format!("the example never said it attached:\n{}", text()),
        );
    }

    /// Stops the example with SIGTERM and returns how it exited.
    fn terminate(&mut self) -> ExitStatus {
        let pid = i32::try_from(self.child.id()).expect("a pid fits i32");
        // SAFETY: kill(2) on our own child, which has not been waited for
        // (so the pid is still its own).
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0, "kill -TERM");
        let mut status = None;
        wait_until(
            DEADLINE,
            || {
                status = self.child.try_wait().expect("waitpid");
                status.is_some()
            },
            || "the example did not stop on SIGTERM".into(),
        );
        status.expect("an exit status")
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The rows of one cgroup.
fn rows_of(rows: &[serde_json::Value], cgroup_id: u64) -> Vec<&serde_json::Value> {
    rows.iter()
        .filter(|row| row["cgroup_id"].as_u64() == Some(cgroup_id))
        .collect()
}

privileged_test! {
    /// One exec in a container's cgroup is counted once, under the id read
    /// from the pinned map; an exec in a cgroup that lookout does not know
    /// is not counted at all.
    fn counts_one_exec_of_a_container_and_none_elsewhere(machine) {
        // Dropped in reverse: the example first, then the cgroups, then the
        // bpffs instance.
        let bpffs = BpfFs::mount();
        let mut by_cgroup = pin_lookouts_maps(&bpffs);
        let container = Cgroup::create(&machine, "container");
        let elsewhere = Cgroup::create(&machine, "elsewhere");
        let container_id = format!("example-execs-{}", std::process::id());
        let mut entry = ContainerEntry::new(container_id.as_bytes());
        entry.cgroup_id = container.id();
        by_cgroup
            .insert(container.id(), entry.to_bytes(), 0)
            .expect("inserting the container's entry");

        let mut example = Example::start(bpffs.path());
        example.wait_attached();
        let mut perf = TracepointSampler::open("sched", "sched_process_exec", 16 * 4096)
            .unwrap_or_else(|e| panic!("a perf reader of sched:sched_process_exec: {e}"));
        // The exec that must not count first: when the container's line
        // shows, the counters were read after both execs.
        let execs = [elsewhere.exec_true(), container.exec_true()];

        // The program returns 1, not 0: a perf reader of the tracepoint
        // still gets both samples (0 would drop them for every reader).
        let seen: Vec<u32> = perf.drain().iter().map(|hit| hit.pid).collect();
        for pid in execs {
            assert!(
                seen.contains(&pid),
                "a perf reader of sched:sched_process_exec missed pid {pid}'s exec while the \
                 example ran (lost {}): does the program return 0?",
                perf.lost()
            );
        }

        wait_until(
            DEADLINE,
            || rows_of(&example.rows(), container.id()).len() >= 2,
            || format!("no two ticks with the container's count; stdout: {:?}", example.rows()),
        );
        let rows = example.rows();
        for row in rows_of(&rows, container.id()) {
            assert_eq!(row["container_id"], container_id.as_str(), "{row}");
            assert_eq!(row["execs"], 1, "one exec counted once: {row}");
        }
        assert_eq!(
            rows_of(&rows, elsewhere.id()),
            Vec::<&serde_json::Value>::new(),
            "a cgroup outside lookout's map is not counted"
        );
        assert_eq!(rows.len(), rows_of(&rows, container.id()).len(), "{rows:?}");

        let status = example.terminate();
        assert!(status.success(), "exit on SIGTERM: {status}\n{}", example.stderr());
        assert!(example.stderr().contains("stopping on signal 15"), "{}", example.stderr());
        assert_eq!(
            bpffs.names(),
            [CONTAINERS_BY_CGROUP_MAP, CONTAINERS_BY_MNTNS_MAP],
            "the example pins nothing of its own"
        );
    }
}

/// Runs the example against `pin_dir` and returns its failure's stderr;
/// panics if it does not fail.
fn refusal(pin_dir: &Path) -> String {
    let output = Command::new(EXAMPLE)
        .arg("--pin-dir")
        .arg(pin_dir)
        // Should it not refuse, it stops by itself.
        .args(["--exit-after", "5s"])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {EXAMPLE}: {e}"));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !output.status.success(),
        "the example ran without lookout's pins: {stderr}"
    );
    stderr
}

privileged_test! {
    /// Without both pins the example refuses, names what is missing, and
    /// creates nothing in the directory: aya's loader would have created
    /// and pinned a map of its own at lookout's path.
    fn refuses_without_both_pins_and_creates_nothing(_machine) {
        let bpffs = BpfFs::mount();
        let dir = bpffs.path();

        let stderr = refusal(dir);
        let expected = format!(
            "no pinned map at {}: is lookout running with --bpf-pin-dir {}?",
            dir.join(CONTAINERS_BY_CGROUP_MAP).display(),
            dir.display()
        );
        assert!(stderr.contains(&expected), "{stderr}");
        assert_eq!(bpffs.names(), Vec::<String>::new());

        // One of the two is not enough.
        pin_map(
            &dir.join(CONTAINERS_BY_CGROUP_MAP),
            CONTAINERS_BY_CGROUP_KERNEL_NAME,
            ContainerEntry::SIZE as u32,
        );
        let stderr = refusal(dir);
        let missing = format!("no pinned map at {}", dir.join(CONTAINERS_BY_MNTNS_MAP).display());
        assert!(stderr.contains(&missing), "{stderr}");
        assert_eq!(bpffs.names(), [CONTAINERS_BY_CGROUP_MAP]);

        // A map of another layout is not lookout's.
        pin_map(&dir.join(CONTAINERS_BY_MNTNS_MAP), CONTAINERS_BY_MNTNS_KERNEL_NAME, 64);
        let stderr = refusal(dir);
        assert!(stderr.contains("8-byte keys and 64-byte values"), "{stderr}");
        assert_eq!(bpffs.names(), [CONTAINERS_BY_CGROUP_MAP, CONTAINERS_BY_MNTNS_MAP]);
    }
}
