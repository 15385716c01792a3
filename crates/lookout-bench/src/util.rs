//! Progress lines, commands, and paths as a runtime's arguments.

use std::path::Path;
use std::process::Command;

use anyhow::Context;

pub(crate) use lookout_testsupport::cmd::say;

/// Runs `cmd` ([`lookout_testsupport::cmd::exec`]), for the bench's `anyhow` results.
pub(crate) fn exec(step: &str, cmd: &mut Command, fix: &str) -> anyhow::Result<()> {
    Ok(lookout_testsupport::cmd::exec(step, cmd, fix)?)
}

/// `path` as UTF-8, for a runtime's arguments.
pub(crate) fn utf8(path: &Path) -> anyhow::Result<&str> {
    path.to_str()
        .with_context(|| format!("not UTF-8: {}", path.display()))
}
