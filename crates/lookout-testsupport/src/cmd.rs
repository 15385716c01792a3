//! Commands run by the project's tooling (`cargo xtask`, the bench, the VM guests): each step
//! says what it runs, and a failure names the step and how to fix it.

use std::io;
use std::process::Command;

/// Prints a progress line for `step`, as `cargo xtask` prints its own.
pub fn say(step: &str, msg: &str) {
    eprintln!("[xtask {step}] {msg}");
}

/// Runs `cmd` after printing it, and fails with an error that names `step`, the command and
/// `fix` when it cannot start or exits unsuccessfully.
pub fn exec(step: &str, cmd: &mut Command, fix: &str) -> io::Result<()> {
    let shown = shell_line(cmd);
    say(step, &format!("$ {shown}"));
    let status = cmd.status().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "step '{step}': could not start {:?} ({fix}): {e}",
                cmd.get_program()
            ),
        )
    })?;
    if !status.success() {
        return Err(io::Error::other(format!(
            "step '{step}' failed ({status}): {shown}\n  fix: {fix}"
        )));
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

/// `cmd` as a shell line, for progress and error messages.
pub fn shell_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}
