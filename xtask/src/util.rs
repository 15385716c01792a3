//! Helpers shared by the subcommands.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

/// The workspace root (the parent of xtask/).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// Prints a progress line for `step`.
pub fn say(step: &str, msg: &str) {
    eprintln!("[xtask {step}] {msg}");
}

/// Runs `cmd`, failing with a message that names `step` and suggests `fix`.
pub fn exec(step: &str, cmd: &mut Command, fix: &str) -> anyhow::Result<()> {
    say(step, &format!("$ {}", display(cmd)));
    let status = cmd.status().with_context(|| {
        format!(
            "step '{step}': could not start {:?} ({fix})",
            cmd.get_program()
        )
    })?;
    if !status.success() {
        bail!(
            "step '{step}' failed ({status}): {}\n  fix: {fix}",
            display(cmd)
        );
    }
    Ok(())
}

/// Runs `cmd` and returns its stdout, or `None` if it could not run or failed.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn display(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
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
