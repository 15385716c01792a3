//! Progress lines, commands, and paths as a runtime's arguments.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

/// Prints a progress line for `step`, as the xtask prints its own.
pub(crate) fn say(step: &str, msg: &str) {
    eprintln!("[xtask {step}] {msg}");
}

/// Runs `cmd`, failing with a message that names `step` and suggests `fix`.
pub(crate) fn exec(step: &str, cmd: &mut Command, fix: &str) -> anyhow::Result<()> {
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    say(step, &format!("$ {shown}"));
    let status = cmd.status().with_context(|| {
        format!(
            "step '{step}': could not start {:?} ({fix})",
            cmd.get_program()
        )
    })?;
    if !status.success() {
        bail!("step '{step}' failed ({status}): {shown}\n  fix: {fix}");
    }
    Ok(())
}

/// `path` as UTF-8, for a runtime's arguments.
pub(crate) fn utf8(path: &Path) -> anyhow::Result<&str> {
    path.to_str()
        .with_context(|| format!("not UTF-8: {}", path.display()))
}
