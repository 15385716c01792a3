//! Progress lines and commands, as the rest of the project's tooling prints and runs them.

use std::process::Command;

pub(crate) use lookout_testsupport::cmd::{output, say};

/// Runs `cmd` ([`lookout_testsupport::cmd::exec`]), for the guests' `anyhow` results.
pub(crate) fn exec(step: &str, cmd: &mut Command, fix: &str) -> anyhow::Result<()> {
    Ok(lookout_testsupport::cmd::exec(step, cmd, fix)?)
}
