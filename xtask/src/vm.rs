//! `cargo xtask vm-test`: the agent's image on Debian's own kernels and on
//! arm64, under QEMU (TCG: this machine's nested KVM cannot run stock
//! kernels).
//!
//! Each guest is one Debian release on one architecture: its cloud kernel,
//! its runc and crun, and its busybox, fetched from Debian's archive with
//! a private apt configuration (cached under `~/.cache/lookout/vm`, never
//! installed). The agent is the image's own binary and libraries
//! (`target/image/lookout.oci.tar`, the manifest for the guest's
//! platform), run chrooted with the guest's root at `/host`, as the
//! DaemonSet runs it. The guest (`xtask/vm/stage2.sh`) runs the probe,
//! the agent in modes `auto`, `fanotify` and `scan` with a consumer on the
//! API and a hooks.d prestart hook, and runc and crun containers that exit
//! with known codes; it prints everything between markers on its serial
//! console, and this module checks it. `--write-docs` writes
//! docs/kernels.md from the run.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::util::{exec, output, say, workspace_root};

const STEP: &str = "vm-test";

/// One guest of the matrix.
#[derive(Debug, Clone, Copy)]
pub struct Guest {
    /// `amd64-5.10`: what `--guest` takes.
    pub name: &'static str,
    /// Debian's release: its kernel, runc, crun and busybox.
    pub suite: &'static str,
    pub arch: Arch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    /// Debian's and OCI's name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }
}

/// The matrix: Debian 11, 12 and 13 on amd64, 12 and 13 on arm64.
pub const GUESTS: &[Guest] = &[
    Guest {
        name: "amd64-5.10",
        suite: "bullseye",
        arch: Arch::Amd64,
    },
    Guest {
        name: "amd64-6.1",
        suite: "bookworm",
        arch: Arch::Amd64,
    },
    Guest {
        name: "amd64-6.12",
        suite: "trixie",
        arch: Arch::Amd64,
    },
    Guest {
        name: "arm64-6.1",
        suite: "bookworm",
        arch: Arch::Arm64,
    },
    Guest {
        name: "arm64-6.12",
        suite: "trixie",
        arch: Arch::Arm64,
    },
];

/// The Debian packages a guest's root file system is made of (their
/// binaries and the libraries those load, nothing else).
const GUEST_PACKAGES: &[&str] = &["busybox-static", "runc", "crun"];

/// The binaries taken from those packages.
const GUEST_BINARIES: &[&str] = &[
    "bin/busybox",
    "usr/sbin/runc",
    "usr/bin/runc",
    "usr/bin/crun",
];

/// What this machine needs to run the guests.
pub const HOST_PACKAGES: &[&str] = &["qemu-system-x86", "qemu-system-arm"];

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Only these guests (repeatable): amd64-5.10, amd64-6.1, amd64-6.12,
    /// arm64-6.1, arm64-6.12.
    #[arg(long = "guest", value_name = "NAME")]
    pub guests: Vec<String>,
    /// Write docs/kernels.md from this run's results.
    #[arg(long)]
    pub write_docs: bool,
    /// Longest a guest may run, in seconds.
    #[arg(long, default_value = "150")]
    pub timeout: u64,
    /// Do not build the image: use target/image/lookout.oci.tar as it is.
    #[arg(long)]
    pub no_build: bool,
    /// More kernel command-line arguments (`lsm=...`, to find which part
    /// of a kernel a failure comes from).
    #[arg(long, value_name = "ARGS", default_value = "")]
    pub kernel_args: String,
}

pub fn vm_test(opts: &Options) -> anyhow::Result<()> {
    let chosen: Vec<Guest> = if opts.guests.is_empty() {
        GUESTS.to_vec()
    } else {
        opts.guests
            .iter()
            .map(|n| {
                GUESTS
                    .iter()
                    .copied()
                    .find(|g| g.name == n)
                    .with_context(|| {
                        let names: Vec<_> = GUESTS.iter().map(|g| g.name).collect();
                        format!("no guest {n:?} (the guests: {})", names.join(", "))
                    })
            })
            .collect::<anyhow::Result<_>>()?
    };
    if crate::util::is_root() {
        crate::test::install(HOST_PACKAGES)?;
    }
    let archive = workspace_root().join("target/image/lookout.oci.tar");
    if !opts.no_build {
        crate::image::build(&crate::image::Options::default(), "build")?;
    }
    let out = workspace_root().join("target/vm-test");
    std::fs::create_dir_all(&out)?;
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for guest in &chosen {
        let started = Instant::now();
        let result = run_guest(
            guest,
            &archive,
            &out,
            Duration::from_secs(opts.timeout),
            &opts.kernel_args,
        );
        let secs = started.elapsed().as_secs_f64();
        match result {
            Ok(mut report) => {
                report["seconds"] = json!((secs * 10.0).round() / 10.0);
                let problems = report["problems"].as_array().map_or(0, Vec::len);
                let rss = report["modes"]["auto"]["memory_kb"]["VmRSS"]
                    .as_f64()
                    .map_or("?".to_owned(), |kb| format!("{:.1} MB", kb / 1024.0));
                say(
                    STEP,
                    &format!(
                        "{}: {} in {secs:.1} s ({} problems; the agent's RSS {rss})",
                        guest.name,
                        if problems == 0 { "ok" } else { "FAILED" },
                        problems
                    ),
                );
                if problems > 0 {
                    failed.push(guest.name);
                    for p in report["problems"].as_array().into_iter().flatten() {
                        say(
                            STEP,
                            &format!("  {}: {}", guest.name, p.as_str().unwrap_or("?")),
                        );
                    }
                }
                reports.push(report);
            }
            Err(e) => {
                say(
                    STEP,
                    &format!("{}: FAILED in {secs:.1} s: {e:#}", guest.name),
                );
                failed.push(guest.name);
                reports.push(json!({"guest": guest.name, "error": format!("{e:#}")}));
            }
        }
    }
    let report = json!({ "guests": reports });
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
    say(
        STEP,
        &format!("wrote {}", out.join("report.json").display()),
    );
    if opts.write_docs {
        let path = workspace_root().join("docs/kernels.md");
        std::fs::write(&path, kernels_md(&report))?;
        say(STEP, &format!("wrote {}", path.display()));
    }
    if !failed.is_empty() {
        bail!(
            "guests failed: {} (serial logs in {})",
            failed.join(", "),
            out.display()
        );
    }
    Ok(())
}

/// Boots one guest and checks what it printed.
fn run_guest(
    guest: &Guest,
    archive: &Path,
    out: &Path,
    timeout: Duration,
    kernel_args: &str,
) -> anyhow::Result<Value> {
    let debian = fetch(guest.suite, guest.arch)?;
    let tree = out.join(format!("{}.root", guest.name));
    let _ = std::fs::remove_dir_all(&tree);
    assemble(guest, &debian, archive, &tree)?;
    let initrd = out.join(format!("{}.cpio", guest.name));
    std::fs::write(&initrd, cpio(&tree)?)?;
    std::fs::remove_dir_all(&tree)?;
    let log = out.join(format!("{}.log", guest.name));
    say(
        STEP,
        &format!(
            "{}: booting {} (serial console in {})",
            guest.name,
            debian.kernel.display(),
            log.display()
        ),
    );
    boot(guest, &debian.kernel, &initrd, &log, timeout, kernel_args)?;
    let text = std::fs::read(&log)?;
    let text = String::from_utf8_lossy(&text);
    let mut report = check(guest, &text);
    report["kernel_package"] = json!(debian.kernel_package);
    // Each runtime release's own state file, kept as it wrote it.
    let kept = out.join(format!("{}.state", guest.name));
    std::fs::create_dir_all(&kept)?;
    for (id, runtime) in [("rc-auto", "runc"), ("cr-auto", "crun")] {
        if let Some((body, Some(0))) = sections(&text).get(&format!("state.{id}")) {
            std::fs::write(kept.join(format!("{runtime}.json")), body.trim())?;
        }
    }
    Ok(report)
}

/// A Debian release's files for one architecture.
struct Debian {
    /// `boot/vmlinuz-*`.
    kernel: PathBuf,
    kernel_package: String,
    /// [`GUEST_PACKAGES`] and their dependencies, extracted (usr-merged).
    tree: PathBuf,
}

/// Fetches (cached) the kernel and [`GUEST_PACKAGES`] of `suite` for
/// `arch` with a private apt configuration: nothing is installed and this
/// machine's sources are not changed.
fn fetch(suite: &str, arch: Arch) -> anyhow::Result<Debian> {
    let w = crate::build_ebpf::cache_dir()
        .join("vm")
        .join(format!("{suite}-{}", arch.name()));
    let done = w.join("fetched.json");
    if let Ok(text) = std::fs::read_to_string(&done)
        && let Ok(v) = serde_json::from_str::<Value>(&text)
        && let (Some(k), Some(p)) = (v["kernel"].as_str(), v["kernel_package"].as_str())
    {
        return Ok(Debian {
            kernel: w.join(k),
            kernel_package: p.to_owned(),
            tree: w.join("tree"),
        });
    }
    say(
        STEP,
        &format!(
            "fetching Debian {suite} {} (kernel, runc, crun, busybox)",
            arch.name()
        ),
    );
    let _ = std::fs::remove_dir_all(&w);
    for d in [
        "lists/partial",
        "archives/partial",
        "state",
        "cache",
        "kernel",
    ] {
        std::fs::create_dir_all(w.join(d))?;
    }
    std::fs::write(w.join("status"), "")?;
    std::fs::write(
        w.join("sources.list"),
        format!("deb [arch={}] {} {suite} main\n", arch.name(), mirror()),
    )?;
    let apt = |tool: &str| {
        let mut c = Command::new(tool);
        c.current_dir(&w);
        for (k, v) in [
            ("Dir::Etc::sourcelist", w.join("sources.list")),
            ("Dir::Etc::sourceparts", "-".into()),
            ("Dir::State", w.join("state")),
            ("Dir::State::lists", w.join("lists")),
            ("Dir::State::status", w.join("status")),
            ("Dir::Cache", w.join("cache")),
            ("Dir::Cache::archives", w.join("archives")),
            ("APT::Architecture", arch.name().into()),
            ("APT::Architectures", arch.name().into()),
            ("APT::Get::List-Cleanup", "0".into()),
            ("APT::Sandbox::User", "root".into()),
            ("Debug::NoLocking", "1".into()),
        ] {
            c.arg("-o").arg(format!("{k}={}", Path::new(&v).display()));
        }
        c
    };
    let net = "check the network access to Debian's mirrors";
    exec(STEP, apt("apt-get").args(["update", "-q"]), net)?;
    // The cloud kernel's metapackage names the real one.
    let meta = format!("linux-image-cloud-{}", arch.name());
    let depends = output(apt("apt-cache").args(["depends", &meta]))
        .with_context(|| format!("apt-cache depends {meta} failed"))?;
    let kernel_package = depends
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .filter(|p| p.starts_with("linux-image-"))
        .with_context(|| format!("{meta} depends on no kernel:\n{depends}"))?
        .trim()
        .to_owned();
    exec(
        STEP,
        apt("apt-get")
            .current_dir(w.join("kernel"))
            .args(["download", "-q", &kernel_package]),
        net,
    )?;
    exec(
        STEP,
        apt("apt-get")
            .args([
                "install",
                "-y",
                "-q",
                "--download-only",
                "--no-install-recommends",
            ])
            .args(GUEST_PACKAGES)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        net,
    )?;
    let kdeb = debs(&w.join("kernel"))?
        .into_iter()
        .next()
        .context("apt-get download left no kernel package")?;
    exec(
        STEP,
        Command::new("dpkg-deb")
            .arg("-x")
            .arg(&kdeb)
            .arg(w.join("kernel/x")),
        "install dpkg",
    )?;
    let kernel = std::fs::read_dir(w.join("kernel/x/boot"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .context("the kernel package has no boot/vmlinuz-*")?;
    let tree = w.join("tree");
    for deb in debs(&w.join("archives"))? {
        exec(
            STEP,
            Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree),
            "install dpkg",
        )?;
    }
    usr_merge(&tree)?;
    let kernel_rel = kernel.strip_prefix(&w)?.to_string_lossy().into_owned();
    std::fs::write(
        &done,
        serde_json::to_vec(&json!({"kernel": kernel_rel, "kernel_package": kernel_package}))?,
    )?;
    Ok(Debian {
        kernel,
        kernel_package,
        tree,
    })
}

/// The mirror this machine's apt uses.
fn mirror() -> String {
    std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("URIs:"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "http://deb.debian.org/debian".into())
}

fn debs(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    v.sort();
    Ok(v)
}

/// Debian 11 and 12 packages put files in /bin and /lib, Debian 13's in
/// /usr: one tree where /bin, /sbin, /lib and /lib64 are links into /usr,
/// as on an installed system.
fn usr_merge(tree: &Path) -> anyhow::Result<()> {
    for d in ["bin", "sbin", "lib", "lib64"] {
        let top = tree.join(d);
        let under = tree.join("usr").join(d);
        std::fs::create_dir_all(&under)?;
        if top.is_symlink() {
            continue;
        }
        if top.is_dir() {
            exec(
                STEP,
                Command::new("cp").arg("-a").arg(top.join(".")).arg(&under),
                "install coreutils",
            )?;
            std::fs::remove_dir_all(&top)?;
        }
        std::os::unix::fs::symlink(format!("usr/{d}"), &top)?;
    }
    Ok(())
}

/// The guest's root file system in `root`. (Its executables are copied
/// with `std::fs::copy`: they run in the guest, never here, so the ETXTBSY
/// race the lint is about cannot happen.)
#[allow(clippy::disallowed_methods)]
fn assemble(guest: &Guest, debian: &Debian, archive: &Path, root: &Path) -> anyhow::Result<()> {
    for d in ["usr/bin", "usr/sbin", "usr/lib", "usr/lib64"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    for d in ["bin", "sbin", "lib", "lib64"] {
        std::os::unix::fs::symlink(format!("usr/{d}"), root.join(d))?;
    }
    for d in [
        "dev",
        "proc",
        "sys",
        "run",
        "tmp",
        "etc/lookout/hooks.d",
        "opt/lookout",
        "rootfs/bin",
        "rootfs/proc",
        "rootfs/dev",
    ] {
        std::fs::create_dir_all(root.join(d))?;
    }
    // The runtimes and busybox, with the libraries they load.
    let mut wanted: Vec<String> = GUEST_BINARIES
        .iter()
        .filter(|b| debian.tree.join(b).is_file())
        .map(|b| (*b).to_owned())
        .collect();
    let mut copied = std::collections::BTreeSet::new();
    while let Some(rel) = wanted.pop() {
        if !copied.insert(rel.clone()) {
            continue;
        }
        let from = debian.tree.join(&rel);
        // The packages' links are absolute (`/lib64/ld-linux-x86-64.so.2 ->
        // /lib/x86_64-linux-gnu/ld-2.31.so`): followed inside the tree.
        let real = lookout_host::resolve_in_root(&debian.tree, Path::new(&rel))
            .with_context(|| format!("{} is missing", from.display()))?;
        let to = root.join(&rel);
        if let Some(p) = to.parent() {
            std::fs::create_dir_all(p)?;
        }
        std::fs::copy(&real, &to).with_context(|| format!("copying {}", real.display()))?;
        wanted.extend(needs(&debian.tree, &real)?);
    }
    // The containers' root: busybox alone.
    std::fs::copy(
        debian.tree.join("bin/busybox"),
        root.join("rootfs/bin/busybox"),
    )?;
    std::os::unix::fs::symlink("busybox", root.join("rootfs/bin/sh"))?;
    std::os::unix::fs::symlink("busybox", root.join("rootfs/bin/sleep"))?;
    for (name, script) in [
        ("exit3", "exit 3"),
        ("exit5", "exit 5"),
        ("sleep-exit3", "sleep 3; exit 3"),
        ("sleep-exit5", "sleep 3; exit 5"),
    ] {
        let b = root.join("bundles").join(name);
        std::fs::create_dir_all(&b)?;
        std::fs::write(b.join("config.json"), bundle_config(script))?;
    }
    std::fs::write(
        root.join("etc/lookout/hooks.d/vm.json"),
        serde_json::to_vec_pretty(&json!({
            "version": "1.0.0",
            "hook": {"path": "/bin/sh", "args": ["sh", "-c", "cat >> /tmp/hook.out; echo >> /tmp/hook.out"]},
            "when": {"always": true},
            "stages": ["prestart"],
        }))?,
    )?;
    // The agent: the image's files for this platform.
    unpack_image(archive, guest.arch, &root.join("opt/lookout"))?;
    for (name, text) in [
        ("init", include_str!("../vm/init.sh")),
        ("stage2", include_str!("../vm/stage2.sh")),
    ] {
        std::fs::write(root.join(name), text)?;
        set_mode(&root.join(name), 0o755)?;
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// The config.json of a container that runs `sh -c SCRIPT` in /rootfs
/// (read-only, shared): what every runtime release in the matrix accepts.
fn bundle_config(script: &str) -> Vec<u8> {
    let config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "-c", script],
            "env": ["PATH=/bin"],
            "cwd": "/",
            "noNewPrivileges": true,
        },
        "root": {"path": "/rootfs", "readonly": true},
        "hostname": "vm",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"}],
        },
    });
    serde_json::to_vec_pretty(&config).unwrap_or_default()
}

/// The libraries (and the ELF interpreter) `binary` loads, as paths
/// relative to `tree`, from `readelf` (which reads any architecture).
fn needs(tree: &Path, binary: &Path) -> anyhow::Result<Vec<String>> {
    let text = output(Command::new("readelf").args(["-d", "-l", "-W"]).arg(binary))
        .with_context(|| format!("readelf {} failed (install binutils)", binary.display()))?;
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split("[Requesting program interpreter: ").nth(1) {
            out.push(
                rest.trim_end_matches(']')
                    .trim_start_matches('/')
                    .to_owned(),
            );
        }
        if line.contains("(NEEDED)")
            && let Some(name) = line.split('[').nth(1).map(|s| s.trim_end_matches(']'))
        {
            let found = ["usr/lib", "usr/lib64"]
                .iter()
                .flat_map(|d| {
                    let mut v = vec![format!("{d}/{name}")];
                    for multiarch in ["x86_64-linux-gnu", "aarch64-linux-gnu"] {
                        v.push(format!("{d}/{multiarch}/{name}"));
                    }
                    v
                })
                .find(|rel| tree.join(rel).exists())
                .with_context(|| {
                    format!("{} needs {name}, not in its packages", binary.display())
                })?;
            out.push(found);
        }
    }
    Ok(out)
}

/// Unpacks the image's layer for `arch` from the OCI archive into `dest`.
fn unpack_image(archive: &Path, arch: Arch, dest: &Path) -> anyhow::Result<()> {
    let blobs = read_tar(archive)
        .with_context(|| format!("reading {} (run `cargo xtask image`)", archive.display()))?;
    let blob = |digest: &str| -> anyhow::Result<&Vec<u8>> {
        let name = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
        blobs
            .get(&name)
            .with_context(|| format!("the archive has no {name}"))
    };
    let index: Value = serde_json::from_slice(
        blobs
            .get("index.json")
            .context("the archive has no index.json")?,
    )?;
    // index.json names the image; a multi-platform image is itself an
    // index of one manifest per platform.
    let mut manifests = index["manifests"].as_array().cloned().unwrap_or_default();
    if let [only] = manifests.as_slice()
        && only["mediaType"] == "application/vnd.oci.image.index.v1+json"
    {
        let inner: Value =
            serde_json::from_slice(blob(only["digest"].as_str().context("index digest")?)?)?;
        manifests = inner["manifests"].as_array().cloned().unwrap_or_default();
    }
    let entry = manifests
        .iter()
        .find(|m| m["platform"]["architecture"].as_str() == Some(arch.name()))
        .with_context(|| format!("the image has no linux/{} manifest", arch.name()))?;
    let manifest: Value =
        serde_json::from_slice(blob(entry["digest"].as_str().context("manifest digest")?)?)?;
    for layer in manifest["layers"].as_array().into_iter().flatten() {
        let gz = blob(layer["digest"].as_str().context("layer digest")?)?;
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(gz.as_slice()));
        tar.set_preserve_permissions(true);
        tar.unpack(dest)
            .with_context(|| format!("unpacking the image's layer into {}", dest.display()))?;
    }
    Ok(())
}

/// Every regular file of a tar archive, by path.
fn read_tar(path: &Path) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let mut tar = tar::Archive::new(std::fs::File::open(path)?);
    let mut files = BTreeMap::new();
    for entry in tar.entries()? {
        let mut entry = entry?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = entry
            .path()?
            .to_string_lossy()
            .trim_start_matches("./")
            .to_owned();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes)?;
        files.insert(name, bytes);
    }
    Ok(files)
}

/// `tree` as an uncompressed initramfs (cpio "newc"): the kernel unpacks
/// it as the guest's first root.
fn cpio(tree: &Path) -> anyhow::Result<Vec<u8>> {
    use std::os::unix::fs::MetadataExt;
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
        let mut entries: Vec<_> = std::fs::read_dir(dir)?
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for p in entries {
            out.push(p.clone());
            if p.is_dir() && !p.is_symlink() {
                walk(&p, out)?;
            }
        }
        Ok(())
    }
    let mut paths = Vec::new();
    walk(tree, &mut paths)?;
    let mut out = Vec::new();
    let mut push = |name: &str, mode: u32, ino: u32, data: &[u8]| {
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out.extend_from_slice(data);
        while out.len() % 4 != 0 {
            out.push(0);
        }
    };
    for (i, p) in paths.iter().enumerate() {
        let name = p.strip_prefix(tree)?.to_string_lossy().into_owned();
        let meta = std::fs::symlink_metadata(p)?;
        let ino = i as u32 + 1;
        if meta.is_symlink() {
            let target = std::fs::read_link(p)?;
            push(&name, 0o120777, ino, target.to_string_lossy().as_bytes());
        } else if meta.is_dir() {
            push(&name, 0o040000 | (meta.mode() & 0o7777), ino, &[]);
        } else {
            push(
                &name,
                0o100000 | (meta.mode() & 0o7777),
                ino,
                &std::fs::read(p)?,
            );
        }
    }
    push("TRAILER!!!", 0, 0, &[]);
    Ok(out)
}

/// Runs the guest to its power-off (or `timeout`), its console in `log`.
fn boot(
    guest: &Guest,
    kernel: &Path,
    initrd: &Path,
    log: &Path,
    timeout: Duration,
    kernel_args: &str,
) -> anyhow::Result<()> {
    let (mut cmd, console) = match guest.arch {
        Arch::Amd64 => {
            let mut c = Command::new("qemu-system-x86_64");
            c.args(["-accel", "tcg", "-cpu", "max"]);
            (c, "ttyS0")
        }
        Arch::Arm64 => {
            let mut c = Command::new("qemu-system-aarch64");
            c.args(["-M", "virt", "-cpu", "max,pauth-impdef=on"]);
            (c, "ttyAMA0")
        }
    };
    cmd.arg("-append")
        .arg(format!("console={console} quiet loglevel=1 panic=-1 {kernel_args}").trim_end());
    // One vCPU: with two, TCG guests of 6.1 hung in a soft lockup (both
    // vCPUs stuck in runc's first exec, before lookout ran), and one leaves
    // the second host core to the host.
    cmd.args(["-m", "1536", "-smp", "1", "-no-reboot", "-display", "none"])
        .args(["-monitor", "none", "-nic", "none"])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .stdin(Stdio::null());
    let mut child = cmd.spawn().with_context(|| {
        format!(
            "starting {:?} (install {HOST_PACKAGES:?})",
            cmd.get_program()
        )
    })?;
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("qemu exited with {status}");
            }
            return Ok(());
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the guest did not power off within {} s (see {})",
                timeout.as_secs(),
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The console's sections: name to (text, rc).
fn sections(text: &str) -> BTreeMap<String, (String, Option<i32>)> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if let Some(name) = line.strip_prefix("@@lk begin ") {
            current = Some((name.trim().to_owned(), String::new()));
        } else if let Some(rest) = line.strip_prefix("@@lk end ") {
            let rc = rest
                .rsplit_once("rc=")
                .and_then(|(_, n)| n.trim().parse().ok());
            if let Some((name, body)) = current.take() {
                out.insert(name, (body, rc));
            }
        } else if let Some((_, body)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .collect()
}

/// Checks one guest's console; returns its report (problems listed in it).
fn check(guest: &Guest, text: &str) -> Value {
    let s = sections(text);
    let mut problems: Vec<String> = Vec::new();
    if !text.contains("@@lk done") {
        problems.push("the guest did not reach the end of its checks".into());
    }
    let body = |name: &str| s.get(name).map(|(b, _)| b.as_str()).unwrap_or("");
    let uname = body("uname").trim().to_owned();
    let versions = body("versions").trim().to_owned();
    let probe: Value = serde_json::Deserializer::from_str(body("probe"))
        .into_iter::<Value>()
        .next()
        .and_then(Result::ok)
        .unwrap_or(Value::Null);
    let devfd = body("devfd-missing");
    let without_devfd = json!({
        "ran": devfd.contains("stopped"),
        "error": devfd
            .lines()
            .find(|l| l.contains("cloned binary") || l.contains("re-execute"))
            .map(|l| strip_ansi(l).trim().to_owned()),
    });
    if probe.is_null() {
        problems.push(format!("no probe output: {:?}", body("probe")));
    }
    let mut modes = serde_json::Map::new();
    for (mode, containers) in [
        ("auto", &[("rc-auto", 3), ("cr-auto", 5)][..]),
        ("fanotify", &[("rc-fan", 3), ("cr-fan", 5)][..]),
        ("scan", &[("rc-scan", 3), ("cr-scan", 5)][..]),
    ] {
        let events = json_lines(body(&format!("events.{mode}")));
        let watch = json_lines(body(&format!("watch.{mode}")));
        let hook = body(&format!("hook.{mode}"));
        let gates = json_lines(body(&format!("gate.{mode}")));
        let mut results = serde_json::Map::new();
        for (id, code) in containers {
            let run = body(&format!("run.{mode}.{id}"));
            let ran = run.contains("stopped")
                && s.get(&format!("run.{mode}.{id}"))
                    .is_some_and(|(_, rc)| *rc == Some(0));
            let of = |kind: &str| {
                events
                    .iter()
                    .find(|e| e["event"] == kind && e["container"]["id"] == *id)
                    .cloned()
            };
            let added = of("added");
            let removed = of("removed");
            let mut r = json!({
                "ran": ran,
                "added": added.is_some(),
                "removed": removed.is_some(),
            });
            if !ran {
                problems.push(format!(
                    "{mode}: container {id} did not run: {}",
                    run.trim()
                ));
            }
            match &added {
                Some(a) => {
                    r["pid"] = a["container"]["pid"].clone();
                    r["status"] = a["container"]["status"].clone();
                    r["source"] = a["source"].clone();
                    r["args"] = a["container"]["args"].clone();
                    if a["container"]["pid"].as_u64().unwrap_or(0) == 0 {
                        problems.push(format!("{mode}: {id} added without a pid"));
                    }
                    if mode != "scan" && a["container"]["status"] != "created" {
                        problems.push(format!(
                            "{mode}: {id} added as {}, not while created",
                            a["container"]["status"]
                        ));
                    }
                }
                None if ran => problems.push(format!("{mode}: no added event for {id}")),
                None => {}
            }
            match &removed {
                Some(e) => {
                    r["exit_code"] = e["exit_code"].clone();
                    // Exit codes come from the BPF exit program: the other
                    // modes report one only when they learn it.
                    let wrong = match e["exit_code"].as_i64() {
                        Some(c) => c != *code,
                        None => mode == "auto",
                    };
                    if wrong {
                        problems.push(format!(
                            "{mode}: {id} removed with exit code {}, not {code}",
                            e["exit_code"]
                        ));
                    }
                }
                None if ran => problems.push(format!("{mode}: no removed event for {id}")),
                None => {}
            }
            // The consumer API saw it too.
            let seen = watch
                .iter()
                .any(|e| e.to_string().contains(&format!("\"{id}\"")));
            r["watched"] = json!(seen);
            if ran && !seen {
                problems.push(format!("{mode}: the API's watcher never saw {id}"));
            }
            // A gate consumer held its start, through the API, where the
            // mode can hold one (BPF reads the runtime's argv before its
            // exec goes on). Without BPF (`fanotify`) the exec is allowed
            // before its argv is read: the gate hears of the container,
            // not held.
            let gate = gates.iter().find(|g| g["id"] == *id);
            match mode {
                "auto" => {
                    let held = gate.is_some_and(|g| g["held"] == true);
                    r["gate_held"] = json!(held);
                    if ran && !held {
                        problems.push(format!("{mode}: the API's gate never held {id}"));
                    }
                }
                "fanotify" => {
                    let heard = gate.is_some_and(|g| g["held"] == false);
                    r["gate_heard_not_held"] = json!(heard);
                    if ran && !heard {
                        problems.push(format!(
                            "{mode}: the API's gate did not hear of {id} as not held: {gate:?}"
                        ));
                    }
                }
                _ => {}
            }
            // The prestart hook ran with the container's state.
            if mode != "scan" {
                let hooked = hook.contains(&format!("\"id\":\"{id}\""));
                r["prestart_hook"] = json!(hooked);
                if ran && !hooked {
                    problems.push(format!("{mode}: the prestart hook did not run for {id}"));
                }
            }
            results.insert((*id).to_owned(), r);
        }
        let log = json_lines(body(&format!("log.{mode}")));
        let chosen = log
            .iter()
            .find_map(|l| l["fields"]["mode"].as_str().map(str::to_owned));
        let warnings: Vec<String> = log
            .iter()
            .filter(|l| l["level"] == "WARN" || l["level"] == "ERROR")
            .map(|l| format!("{}: {}", l["level"].as_str().unwrap_or(""), l["fields"]))
            .collect();
        // The answering thread blocks in read(2), woken to stop by an event
        // on a marked memfd; every kernel here must give that event.
        if let Some(l) = log.iter().find(|l| {
            l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("the answering thread polls its group"))
        }) {
            problems.push(format!("{mode}: {}", l["fields"]));
        }
        let metrics = body(&format!("metrics.{mode}"));
        modes.insert(
            mode.to_owned(),
            json!({
                "mode": chosen,
                "containers": results,
                "warnings": warnings,
                "unread_argv": metric(metrics, "unread_argv"),
                "memory_kb": memory_kb(body(&format!("memory.{mode}"))),
            }),
        );
    }
    let mut states = serde_json::Map::new();
    for (id, runtime) in [("rc-auto", "runc"), ("cr-auto", "crun")] {
        let state: Value =
            serde_json::from_str(body(&format!("state.{id}")).trim()).unwrap_or(Value::Null);
        let keys: Vec<&str> = state
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k.as_str())
            .collect();
        // The fields lookout reads (lookout-runtime-hook's state.rs).
        let reads: &[&str] = if runtime == "runc" {
            &["init_process_pid", "init_process_start", "config"]
        } else {
            &["pid", "process-start-time", "bundle"]
        };
        let missing: Vec<&str> = reads
            .iter()
            .copied()
            .filter(|k| state.get(k).is_none())
            .collect();
        if state.is_null() {
            problems.push(format!("no {runtime} state file from the guest"));
        } else if !missing.is_empty() {
            problems.push(format!("{runtime}'s state file lacks {missing:?}"));
        }
        states.insert(
            runtime.to_owned(),
            json!({"keys": keys, "lookout_reads": reads, "missing": missing}),
        );
    }
    json!({
        "guest": guest.name,
        "suite": guest.suite,
        "state_files": states,
        "arch": guest.arch.name(),
        "uname": uname,
        "runtimes": versions,
        "probe": probe,
        "without_dev_fd": without_devfd,
        "modes": modes,
        "problems": problems,
    })
}

/// `text` without terminal colour sequences (runc colours its errors).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // ESC [ ... final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The agent's `/proc/<pid>/status` memory lines (`VmRSS:   9876 kB`) as
/// `{"VmRSS": 9876, ...}`, in KiB; null when the guest printed none.
fn memory_kb(text: &str) -> Value {
    let fields: serde_json::Map<String, Value> = text
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
            Some((name.trim().to_owned(), json!(kb)))
        })
        .collect();
    if fields.is_empty() {
        Value::Null
    } else {
        Value::Object(fields)
    }
}

/// The sum of the samples of every metric whose name contains `name`.
fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(name))
    {
        if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// docs/kernels.md from a run's report.
fn kernels_md(report: &Value) -> String {
    let guests: Vec<&Value> = report["guests"].as_array().into_iter().flatten().collect();
    let mut s = String::from(
        "# Kernels and architectures: what a real run found\n\n\
         Generated by `cargo xtask vm-test --write-docs` from one run of every guest: Debian's \
         own cloud kernels under QEMU (TCG), each release's own runc and crun, and the image's \
         own binary for the guest's platform, chrooted with the guest's root at `/host` as the \
         DaemonSet runs it. Do not edit by hand: rerun it. How the guests are made: \
         [testing.md](testing.md#kernels-and-arm64-cargo-xtask-vm-test).\n\n\
         ## Discovery, exit codes, hooks and the API\n\n\
         Each cell: the containers reported `added` while `created` and \
         `removed`, with their exit codes; `-` where the mode reports none.\n\n",
    );
    s.push_str("| guest | kernel | runc | crun | `auto` picks | auto | fanotify | scan | prestart hook | API watch | API gate held (auto) | gate told, not held (fanotify) | runtimes without `/dev/fd` | seconds |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for g in &guests {
        let versions = g["runtimes"].as_str().unwrap_or("");
        let version = |name: &str| {
            versions
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} version ")))
                .unwrap_or("?")
                .to_owned()
        };
        let cell = |mode: &str| {
            let cs = &g["modes"][mode]["containers"];
            let parts: Vec<String> = cs
                .as_object()
                .into_iter()
                .flatten()
                .map(|(id, c)| {
                    let ok = c["added"] == true && c["removed"] == true;
                    let runtime = if id.starts_with("cr-") {
                        "crun"
                    } else {
                        "runc"
                    };
                    let code = c["exit_code"]
                        .as_i64()
                        .map_or("-".to_owned(), |c| c.to_string());
                    format!("{runtime} {} {code}", if ok { "ok" } else { "MISSED" })
                })
                .collect();
            parts.join(", ")
        };
        let all_in = |field: &str, modes: &[&str]| {
            let mut any = false;
            let mut every = true;
            for mode in modes {
                for (_, c) in g["modes"][mode]["containers"]
                    .as_object()
                    .into_iter()
                    .flatten()
                {
                    any = true;
                    every &= c[field] == true;
                }
            }
            if any && every { "yes" } else { "NO" }
        };
        let devfd = if g["without_dev_fd"]["ran"] == true {
            "run".to_owned()
        } else {
            format!(
                "fail: {}",
                g["without_dev_fd"]["error"]
                    .as_str()
                    .unwrap_or("?")
                    .replace('|', "/")
            )
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            g["guest"].as_str().unwrap_or("?"),
            g["uname"].as_str().unwrap_or("?"),
            version("runc"),
            version("crun"),
            g["probe"]["mode"].as_str().unwrap_or("?"),
            cell("auto"),
            cell("fanotify"),
            cell("scan"),
            all_in("prestart_hook", &["auto", "fanotify"]),
            all_in("watched", &["auto", "fanotify"]),
            all_in("gate_held", &["auto"]),
            all_in("gate_heard_not_held", &["fanotify"]),
            devfd,
            g["seconds"],
        ));
    }
    s.push_str(
        "\n**Runtimes without `/dev/fd` on 5.10.** runc (1.0 and 1.1) and crun re-execute \
         themselves from a sealed memfd with glibc's `fexecve`, `execveat(fd, \"\", \
         AT_EMPTY_PATH)`. The kernel names such an exec `/dev/fd/N`, and Debian's 5.10 stacks \
         TOMOYO (`CONFIG_LSM=...,tomoyo`), whose exec check resolves that name and fails with \
         ENOENT when `/dev/fd` does not exist. Later kernels fall back to the file itself. Every \
         real node has `/dev/fd` (udev and systemd make it), so this is a property of minimal \
         guests, not of nodes, and nothing lookout does depends on it; the guests record it \
         once, then make `/dev/fd`. Booting the 5.10 guest with `--kernel-args \
         \"lsm=lockdown,yama,apparmor\"` (TOMOYO left out) runs the same containers without \
         `/dev/fd`. The same error was reported against Debian's 5.7 when a sysvinit update \
         stopped making `/dev/fd` (opencontainers/runc#2552).\n",
    );
    s.push_str(
        "\n## Runtime state files by release\n\n\
         What each release writes for a container just created (`<root>/<id>/state.json` for \
         runc, `<root>/<id>/status` for crun), read from the guests. lookout reads runc's \
         `init_process_pid`, `init_process_start` and `config.labels` (`bundle=`), and crun's \
         `pid`, `process-start-time` and `bundle`; the files themselves are test fixtures \
         (`crates/lookout-runtime-hook/tests/fixtures/`).\n\n\
         | release | runtime | fields lookout reads | top-level keys |\n|---|---|---|---|\n",
    );
    for g in &guests {
        if g["arch"] != "amd64" {
            continue;
        }
        let versions = g["runtimes"].as_str().unwrap_or("");
        for runtime in ["runc", "crun"] {
            let st = &g["state_files"][runtime];
            let version = versions
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{runtime} version ")))
                .unwrap_or("?");
            let missing = st["missing"].as_array().map_or(0, Vec::len);
            let keys: Vec<&str> = st["keys"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            s.push_str(&format!(
                "| Debian {} | {runtime} {version} | {} | `{}` |\n",
                g["suite"].as_str().unwrap_or("?"),
                if missing == 0 {
                    "all present".to_owned()
                } else {
                    format!("MISSING {}", st["missing"])
                },
                keys.join("`, `"),
            ));
        }
    }
    s.push_str(
        "\n## The agent's memory\n\n\
         `/proc/<agent>/status` after each mode's containers ran and were removed (before \
         SIGTERM), in MB: the image's binary for the guest's architecture. Mapped files are \
         the binary's pages and the libraries'; a guest's root is its initramfs, a tmpfs, so \
         they count as shared memory there (`RssShmem`), as file pages (`RssFile`) on a node. \
         Anonymous: heap, stacks and the BPF rings. Compare guests with each other, and the \
         bench's idle row with the bench's.\n\n\
         | guest | auto: RSS | mapped files | anonymous | fanotify: RSS | scan: RSS |\n\
         |---|---|---|---|---|---|\n",
    );
    for g in &guests {
        let kb = |mode: &str, field: &str| g["modes"][mode]["memory_kb"][field].as_f64();
        let mb = |v: Option<f64>| v.map_or("?".to_owned(), |kb| format!("{:.1}", kb / 1024.0));
        let mapped = kb("auto", "RssFile")
            .zip(kb("auto", "RssShmem"))
            .map(|(f, s)| f + s);
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            g["guest"].as_str().unwrap_or("?"),
            mb(kb("auto", "VmRSS")),
            mb(mapped),
            mb(kb("auto", "RssAnon")),
            mb(kb("fanotify", "VmRSS")),
            mb(kb("scan", "VmRSS")),
        ));
    }
    // The probe's checks that depend on the kernel, one row each.
    s.push_str(
        "\n## What the probe found\n\n\
         `lookout probe` in each guest: `ok`, or the status and the probe's own words (with the \
         errno).\n\n| check |",
    );
    for g in &guests {
        s.push_str(&format!(" {} |", g["guest"].as_str().unwrap_or("?")));
    }
    s.push_str("\n|---|");
    for _ in &guests {
        s.push_str("---|");
    }
    s.push('\n');
    let mut names: Vec<String> = Vec::new();
    for g in &guests {
        for c in g["probe"]["checks"].as_array().into_iter().flatten() {
            let name = c["name"].as_str().unwrap_or("").to_owned();
            let kernel_side = ["fanotify:", "bpf:", "cgroup", "kernel"]
                .iter()
                .any(|p| name.starts_with(p));
            if kernel_side && !names.contains(&name) {
                names.push(name);
            }
        }
    }
    for name in &names {
        s.push_str(&format!("| `{name}` |"));
        for g in &guests {
            let check = g["probe"]["checks"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["name"] == name.as_str());
            let text = match check {
                None => "—".to_owned(),
                Some(c) if c["status"] == "ok" && name != "kernel" => "ok".to_owned(),
                Some(c) => format!(
                    "{}: {}",
                    c["status"].as_str().unwrap_or("?"),
                    c["detail"].as_str().unwrap_or("")
                ),
            };
            s.push_str(&format!(" {} |", text.replace('|', "/")));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_memory_is_read_from_its_status_lines() {
        let status = "VmRSS:\t    9876 kB\nRssAnon:\t    2048 kB\nRssFile:\t    7828 kB\nRssShmem:\t       0 kB\n";
        let m = memory_kb(status);
        assert_eq!(m["VmRSS"], 9876);
        assert_eq!(m["RssAnon"], 2048);
        assert_eq!(m["RssFile"], 7828);
        assert_eq!(memory_kb(""), Value::Null);
        assert_eq!(memory_kb("grep: /proc/1/status: No such file"), Value::Null);
    }
}
