//! `cargo xtask test`: everything the full suite needs, then the suite.

use std::process::Command;

use crate::util::{cargo, exec, is_root, output, say};

/// Debian packages the tests use (real runtimes, a static busybox for root
/// file systems, iproute2/util-linux for namespaces).
pub const PACKAGES: &[&str] = &[
    "runc",
    "crun",
    "containerd",
    "conmon",
    "busybox-static",
    "util-linux",
    // useradd, for the tests that play an unprivileged attacker.
    "passwd",
    // mkfs.ext4 and a loop-mounted file system for the inode-map FUSE tests.
    "e2fsprogs",
    "mount",
    // objcopy, for the image's stripped binary and its separate debug info.
    "binutils",
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
    /// With --repeat: only this package's tests. Repeatable.
    #[arg(long = "package", short = 'p', value_name = "PKG", requires = "repeat")]
    pub packages: Vec<String>,
    /// With --repeat: only tests whose name contains FILTER.
    #[arg(value_name = "FILTER", requires = "repeat")]
    pub filter: Option<String>,
    /// Extra arguments for `cargo test`, after `--`.
    #[arg(last = true)]
    pub cargo_args: Vec<String>,
}

pub fn test(opts: &Options) -> anyhow::Result<()> {
    let root = is_root();
    if root && !opts.no_install {
        install_packages()?;
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
    if let Some(rounds) = opts.repeat {
        return crate::repeat::repeat(
            rounds,
            opts.filter.as_deref(),
            &opts.packages,
            &opts.cargo_args,
        );
    }
    let mut cmd = cargo();
    cmd.args(["test", "-j2", "--workspace"])
        .args(&opts.cargo_args);
    exec("test", &mut cmd, "see the failing test above")
}

fn installed(pkg: &str) -> bool {
    output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .is_some_and(|s| s.contains("install ok installed"))
}

fn install_packages() -> anyhow::Result<()> {
    if output(Command::new("apt-get").arg("--version")).is_none() {
        say(
            "test",
            "apt-get not found: install these packages yourself: {PACKAGES:?}",
        );
        return Ok(());
    }
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        say("test", "all test packages are installed");
        return Ok(());
    }
    say("test", &format!("installing {}", missing.join(" ")));
    exec(
        "apt-get update",
        Command::new("apt-get").args(["update", "-q"]),
        "check the network access to Debian's mirrors",
    )?;
    exec(
        "apt-get install",
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        "install the packages above by hand and rerun",
    )
}
