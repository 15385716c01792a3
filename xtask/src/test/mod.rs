//! `cargo xtask test`: everything the full suite needs, then the suite.

mod repeat;

use std::process::Command;

use crate::util::{cargo, exec, is_root, say};

/// Debian packages the tests use (real runtimes, a static busybox for root
/// file systems, iproute2/util-linux for namespaces).
pub const PACKAGES: &[&str] = &[
    "runc",
    "crun",
    "containerd",
    "conmon",
    // The reference for OCI hooks (tests/conformance.rs): podman runs a
    // hooks.d directory itself, through runc.
    "podman",
    "busybox-static",
    "util-linux",
    // useradd, for the tests that play an unprivileged attacker.
    "passwd",
    // mkfs.ext4 and a loop-mounted file system for the inode-map FUSE tests.
    "e2fsprogs",
    "mount",
    // objcopy, for the image's stripped binary and its separate debug info.
    "binutils",
    // gVisor (release 20221219); Debian 13's release is fetched beside it.
    "runsc",
    // Docker Engine 20.10 (tests/docker.rs, a private dockerd); Debian
    // 13's 26.1 is fetched beside it.
    "docker.io",
    // The venv of Python gRPC clients (tests/clients.rs).
    "python3-venv",
    // The Go consumer (clients/go), built offline with Debian's Go and
    // grpc-go, and its generated code checked against the proto.
    "golang-go",
    "golang-google-grpc-dev",
    // grpc-go 1.33 takes either; the generated code (APIv2) needs 1.5.
    "golang-github-golang-protobuf-1-5-dev",
    "golang-google-protobuf-dev",
    "protobuf-compiler",
    "protoc-gen-go",
    "protoc-gen-go-grpc",
    // The image's arm64 agent (cargo xtask image), and the guests that run
    // it (cargo xtask vm-test).
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "qemu-system-x86",
    "qemu-system-arm",
];

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Do not apt-get install missing packages.
    #[arg(long)]
    pub no_install: bool,
    /// Run the test binaries N times and report every test that failed at
    /// least once (logs under target/test-repeat/).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: Option<u32>,
    /// With --repeat: every round is a first run, as on a new machine: a
    /// fresh clone of HEAD with its own, empty target directory, the page
    /// cache dropped (as root), then this command without --repeat in it.
    /// Catches what only fails the first time (ETXTBSY, cold caches).
    #[arg(long, requires = "repeat")]
    pub fresh: bool,
    /// Only this package's tests (all of the workspace's without). Repeatable.
    #[arg(long = "package", short = 'p', value_name = "PKG")]
    pub packages: Vec<String>,
    /// Only tests whose name contains FILTER.
    #[arg(value_name = "FILTER")]
    pub filter: Option<String>,
    /// Extra arguments for `cargo test`, after `--`.
    #[arg(last = true)]
    pub cargo_args: Vec<String>,
}

pub fn test(opts: &Options) -> anyhow::Result<()> {
    if let Some(rounds) = opts.repeat.filter(|_| opts.fresh) {
        // Each round installs, builds and tests in its own clone.
        return repeat::fresh(rounds, opts);
    }
    let root = is_root();
    if root && !opts.no_install {
        crate::util::install(PACKAGES)?;
    } else if !root {
        say(
            "test",
            "not root: not installing packages; tests that need root or packages print SKIPPED \
             (run `sudo -E cargo xtask test` for the full suite)",
        );
    }
    crate::build_ebpf::build_ebpf(&crate::build_ebpf::Options {
        toolchain: "nightly".into(),
    })?;
    // The image that tests/image.rs runs as the DaemonSet does.
    crate::image::build(&crate::image::Options::default(), "build")?;
    if root && !opts.no_install {
        fetch_next_debian_runsc()?;
        fetch_containerd17()?;
        fetch_dockerd26()?;
    }
    python_clients()?;
    if let Some(rounds) = opts.repeat {
        return repeat::repeat(
            rounds,
            opts.filter.as_deref(),
            &opts.packages,
            &opts.cargo_args,
        );
    }
    let mut cmd = cargo();
    cmd.args(["test", "-j2"]);
    if opts.packages.is_empty() {
        cmd.arg("--workspace");
    }
    for p in &opts.packages {
        cmd.args(["-p", p]);
    }
    cmd.args(&opts.cargo_args);
    if let Some(f) = &opts.filter {
        cmd.arg(f);
    }
    exec("test", &mut cmd, "see the failing test above")
}

/// The Python gRPC clients the consumer tests use, from PyPI, pinned.
/// `h2` sends the raw-path `:authority` that grpc-java sends.
const PYTHON_CLIENTS: &[&str] = &[
    "grpcio==1.85.3",
    "grpcio-tools==1.85.1",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
    "h2==4.4.1",
];

/// Creates `<cache>/python-clients`, a venv with [`PYTHON_CLIENTS`]
/// (cached: nothing is done when it has them). `tests/clients.rs` runs
/// `clients/python/lookout_consumer.py` with its python.
fn python_clients() -> anyhow::Result<()> {
    let venv = crate::build_ebpf::cache_dir().join("python-clients");
    let marker = venv.join("lookout-packages.txt");
    let want = PYTHON_CLIENTS.join("\n");
    if std::fs::read_to_string(&marker).is_ok_and(|have| have == want) {
        return Ok(());
    }
    say(
        "test",
        "creating a venv of Python gRPC clients (grpcio, from PyPI)",
    );
    let _ = std::fs::remove_dir_all(&venv);
    exec(
        "python venv",
        Command::new("python3").arg("-m").arg("venv").arg(&venv),
        "install python3 and python3-venv",
    )?;
    exec(
        "pip install",
        Command::new(venv.join("bin/pip"))
            .args(["install", "-q", "--disable-pip-version-check"])
            .args(PYTHON_CLIENTS),
        "check the network access to PyPI",
    )?;
    std::fs::write(&marker, want)?;
    Ok(())
}

/// Where Debian 13's runsc is extracted (tests/runsc.rs runs both
/// releases); `$LOOKOUT_RUNSC_NEXT` in the tests.
pub fn next_runsc_dir() -> std::path::PathBuf {
    crate::build_ebpf::cache_dir().join("runsc-trixie")
}

/// Where Debian 13's containerd (1.7, with the CRI plugin and NRI) is
/// extracted; `$LOOKOUT_CONTAINERD17` in the tests
/// (`lookout_testsupport::containerd17()`).
pub fn containerd17_dir() -> std::path::PathBuf {
    crate::build_ebpf::cache_dir().join("containerd17")
}

/// Fetches Debian 13's runsc package (cached):
/// `<cache>/runsc-trixie/root/usr/bin/runsc`.
fn fetch_next_debian_runsc() -> anyhow::Result<()> {
    fetch_trixie_package(
        &next_runsc_dir(),
        "runsc",
        "usr/bin/runsc",
        "runsc (Debian 13)",
        "for the gVisor tests",
    )
}

/// Fetches Debian 13's containerd 1.7 package (cached):
/// `<cache>/containerd17/root/usr/bin/{containerd,ctr,containerd-shim-runc-v2}`.
/// Debian 12's containerd is 1.6, which has no NRI; the CRI tests
/// (`lookout_testsupport::cri`) run this one beside it.
fn fetch_containerd17() -> anyhow::Result<()> {
    fetch_trixie_package(
        &containerd17_dir(),
        "containerd",
        "usr/bin/containerd-shim-runc-v2",
        "containerd (Debian 13)",
        "for the CRI and NRI tests",
    )
}

/// Where Debian 13's docker.io (26.1) is extracted; `$LOOKOUT_DOCKERD26`
/// in the tests (`lookout_testsupport::dockerd26()`).
pub fn dockerd26_dir() -> std::path::PathBuf {
    crate::build_ebpf::cache_dir().join("docker26")
}

/// Fetches Debian 13's docker.io package (cached):
/// `<cache>/docker26/root/usr/sbin/dockerd`. It runs on Debian 12 with
/// Debian 12's containerd, runc and docker-init (its dockerd needs glibc
/// 2.34; Debian 13's runc would need 2.38); tests/docker.rs runs it beside
/// Debian 12's 20.10.
fn fetch_dockerd26() -> anyhow::Result<()> {
    fetch_trixie_package(
        &dockerd26_dir(),
        "docker.io",
        "usr/sbin/dockerd",
        "docker.io (Debian 13)",
        "for the Docker tests",
    )
}

/// Fetches Debian 13's `package` from the mirror this machine already
/// uses, without adding the release to its sources, and extracts it into
/// `<w>/root` (cached: nothing is done when `<w>/root/<marker>` exists).
fn fetch_trixie_package(
    w: &std::path::Path,
    package: &str,
    marker: &str,
    step: &str,
    why: &str,
) -> anyhow::Result<()> {
    if w.join("root").join(marker).is_file() {
        return Ok(());
    }
    say("test", &format!("fetching Debian 13's {package} ({why})"));
    let lists = w.join("apt/lists/partial");
    std::fs::create_dir_all(&lists)?;
    let sources =
        std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    let mirror = sources
        .lines()
        .find_map(|l| l.strip_prefix("URIs:"))
        .map(str::trim)
        .unwrap_or("http://deb.debian.org/debian")
        .to_owned();
    std::fs::write(
        w.join("apt/sources.list"),
        format!("deb {mirror} trixie main\n"),
    )?;
    let opts = |c: &mut Command| {
        c.arg(format!(
            "-o=Dir::Etc::sourcelist={}",
            w.join("apt/sources.list").display()
        ))
        .arg("-o=Dir::Etc::sourceparts=-")
        .arg(format!(
            "-o=Dir::State::lists={}",
            w.join("apt/lists").display()
        ))
        .arg("-o=APT::Get::List-Cleanup=0")
        .arg("-o=APT::Sandbox::User=root");
    };
    let mut update = Command::new("apt-get");
    opts(&mut update);
    update.args(["update", "-q"]);
    exec(
        step,
        &mut update,
        "check the network access to Debian's mirrors",
    )?;
    let mut download = Command::new("apt-get");
    opts(&mut download);
    download
        .current_dir(w.join("apt"))
        .args(["download", "-q", package]);
    exec(
        step,
        &mut download,
        "check the network access to Debian's mirrors",
    )?;
    let prefix = format!("{package}_");
    let deb = std::fs::read_dir(w.join("apt"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|x| x == "deb")
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix))
        })
        .ok_or_else(|| anyhow::anyhow!("apt-get download {package} left no .deb"))?;
    exec(
        step,
        Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(w.join("root")),
        "install dpkg",
    )
}
