//! Progress lines and commands.

use std::process::Command;

use anyhow::{Context, bail};

/// Prints a progress line for `step`, as the xtask prints its own.
pub(crate) fn say(step: &str, msg: &str) {
    eprintln!("[xtask {step}] {msg}");
}

/// Runs `cmd`, failing with a message that names `step` and suggests `fix`.
pub(crate) fn exec(step: &str, cmd: &mut Command, fix: &str) -> anyhow::Result<()> {
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
pub(crate) fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `cmd` as a shell line.
fn display(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}
