//! Helpers shared by the subcommands.

use std::path::PathBuf;
use std::process::Command;

/// The workspace root (the parent of xtask/).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

pub use lookout_testsupport::cmd::{output, say};

/// Runs `cmd` ([`lookout_testsupport::cmd::exec`]), for the subcommands' `anyhow` results.
pub fn exec(step: &str, cmd: &mut Command, fix: &str) -> anyhow::Result<()> {
    Ok(lookout_testsupport::cmd::exec(step, cmd, fix)?)
}

/// Whether we run as root.
pub fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|s| s.trim() == "0")
}

/// A `cargo` command for the stable workspace toolchain, without the
/// variables a parent cargo set for us.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Whether Debian package `pkg` is installed.
fn installed(pkg: &str) -> bool {
    output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .is_some_and(|s| s.contains("install ok installed"))
}

/// Installs those of `packages` that are missing, with apt-get (as root).
pub fn install(packages: &[&str]) -> anyhow::Result<()> {
    if output(Command::new("apt-get").arg("--version")).is_none() {
        say(
            "test",
            &format!("apt-get not found: install these packages yourself: {packages:?}"),
        );
        return Ok(());
    }
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        say("test", "all needed packages are installed");
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
