//! OCI hooks for containers lookout discovers: run existing hook programs
//! (written for the `hooks` of a runtime's config.json) for every container
//! on a node, without touching the runtime's configuration.
//!
//! # Overview
//!
//! - [`state_of`] synthesizes the OCI [`State`](oci_spec::runtime::State)
//!   (ociVersion, id, status, pid, bundle, annotations) with the oci-spec
//!   crate's types.
//! - [`run_hook`] runs one [`Hook`](oci_spec::runtime::Hook): the State on
//!   stdin, `args`/`env` as given, a working directory, its own process
//!   group killed and reaped at the timeout, stdout/stderr captured up to a
//!   limit, exit status and duration in the [`Outcome`].
//! - [`HooksDirs`] loads hooks.d directories in the oci-hooks(5) JSON
//!   formats of CRI-O and podman (1.0.0, and the legacy 0.1.0), with the
//!   same matching rules ([`When::matches`]), and reloads them when they
//!   change. Invalid files are reported by name and field, and skipped.
//! - [`RunOptions::container`] runs a hook in a container's namespaces
//!   (the `createContainer` and `startContainer` stages).
//!
//! ```no_run
//! # async fn f() -> Result<(), lookout_oci_hooks::Error> {
//! use lookout_model::{Container, RuntimeKind, Source};
//! use lookout_oci_hooks::{RunOptions, run_hook, state_of};
//! use oci_spec::runtime::{ContainerState, HookBuilder};
//!
//! let mut c = Container::new("c1", RuntimeKind::Runc);
//! c.pid = Some(4242);
//! let state = state_of(&c, ContainerState::Created, Source::RuntimeHook, false)?;
//! let hook = HookBuilder::default()
//!     .path("/bin/sh")
//!     .args(vec!["sh".into(), "-c".into(), "cat > /tmp/state.json".into()])
//!     .build()
//!     .expect("a valid hook");
//! let outcome = run_hook(&hook, &state, &RunOptions::default()).await?;
//! println!("{} in {:?}", outcome.describe(), outcome.duration);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod container;
mod hooksd;
mod run;
mod state;

pub use container::{InContainer, PathIn};
pub use hooksd::{
    HookConfig, HooksDirs, LoadError, Loaded, MAX_HOOK_FILE_BYTES, Stage, Target, When, load_dirs,
    load_dirs_under, load_file, load_file_under, parse_file,
};
pub use oci_spec;
pub use run::{Outcome, RunOptions, run_hook};
pub use state::{LATE_ANNOTATION, OCI_VERSION, SOURCE_ANNOTATION, state_of};

use std::path::PathBuf;

/// Errors of running a hook.
///
/// The cause is the [`source`](std::error::Error::source), not part of the
/// message: print with [`lookout_model::Chain`] (or `{:#}` once in
/// `anyhow`) to see it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The hook could not be started (missing binary, no permission, a
    /// namespace that cannot be entered).
    #[error("cannot start hook {}", path.display())]
    Spawn {
        /// The program (or namespace file).
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The State could not be built (a field the runtime spec requires is
    /// missing).
    #[error("cannot build the OCI state")]
    State(#[source] oci_spec::OciSpecError),
    /// The State could not be encoded as JSON for the hook's stdin.
    #[error("cannot encode the OCI state")]
    Encode(#[source] serde_json::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use lookout_model::Chain;

    #[test]
    fn messages_leave_the_cause_to_the_chain() {
        let e = Error::Spawn {
            path: PathBuf::from("/opt/hook"),
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        };
        let cause = std::io::Error::from_raw_os_error(libc::ENOENT).to_string();
        assert_eq!(e.to_string(), "cannot start hook /opt/hook");
        let chain = Chain(&e).to_string();
        assert_eq!(chain, format!("cannot start hook /opt/hook: {cause}"));
        assert_eq!(chain.matches(&cause).count(), 1, "{chain}");
    }
}
