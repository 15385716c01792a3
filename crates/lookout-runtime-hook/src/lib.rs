//! Container lifecycle detection from OCI runtime execs.
//!
//! # Overview
//!
//! [`RuntimeHook`] puts a `FAN_OPEN_EXEC_PERM` mark on every runtime binary
//! (runc, crun, ...) in one fanotify group. Each exec of a runtime blocks in
//! the kernel until lookout answers; meanwhile lookout pairs the event (by
//! thread id, `FAN_REPORT_TID`) with the argv that the BPF programs in
//! `lookout-ebpf` captured at `sys_enter_execve[at]`, and parses it
//! ([`argv::parse`]):
//!
//! - `create`/`run`: read the bundle's `config.json` (bounded, no symlinks
//!   out of the bundle), remember the container, allow the exec. When the
//!   `create` process exits (pidfd) — or, for `run`, when the state file
//!   appears — read the runtime's state for the pid and report `Added`.
//! - `start <id>`: report `Added` first if it is still pending, *then* allow
//!   the exec. A created container cannot run its first instruction before
//!   it is reported.
//! - The container's init process is watched with a pidfd; its exit is
//!   reported as `Removed` at once (no polling).
//!
//! [`RuntimeHook::scan`] reports containers that already run, from the
//! runtimes' state directories, checking pid start times against reuse.
//!
//! Every permission event is answered (the guard allows on drop, also on
//! panic), and closing the group lets the kernel allow anything pending.
#![deny(missing_docs)]

mod answer;
pub mod argv;
mod bounded;
pub mod bpf_log;
pub mod btf;
mod capture;
mod container;
mod hook;
mod lifecycle;
pub mod oci;
mod pidfd;
mod run_watch;
mod scan;
pub mod state;
mod stats;
pub mod untrusted;

pub use capture::{ArgvRing, ExecCapture, ExecRecord};
/// Fills a [`lookout_model::Container`] from its init process's /proc
/// files (pid, namespaces, cgroup) and its bundle's config.json
/// (annotations and the Kubernetes identity in them, hostname, args), as
/// the hook does before it reports one. Reads /proc, so it may block on a
/// process whose /proc files are held: not for a thread that must not.
pub use container::fill as fill_container;
/// [`fill_container`] for an init process that
/// [`lookout_host::proc::container_init`] checked: one `/proc` read fewer.
pub use container::fill_init as fill_container_init;
pub use hook::{Builder, DEFAULT_SCHEDULER_SLICE, RuntimeHook, StartupTimes};
pub use pidfd::{ProcessHandle, kill as kill_process, pidfd_open};
pub use scan::{Scanner, scan_state, scan_state_in};
pub use stats::{Health, Observer, Stats};
pub use untrusted::Refused;

use std::path::PathBuf;

/// Errors of the runtime hook. Setup errors (`Fanotify`, `Bpf`) mean the
/// mode cannot run; per-container errors (`Config`, `State`, `PidFile`) are
/// logged and skipped by the hook.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// fanotify setup failed.
    #[error(transparent)]
    Fanotify(lookout_fanotify::Error),
    /// BPF setup failed: `what` was being done.
    #[error("BPF argv capture: {what}")]
    Bpf {
        /// What failed (loading the object, attaching a program, a map).
        what: String,
        /// The loader's error, if the failure came from one (a program or
        /// map missing from the object has none).
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The permission thread could not be started.
    #[error("starting the permission thread")]
    Thread(#[source] std::io::Error),
    /// A config.json could not be used.
    #[error("config {}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Problem,
    },
    /// A runtime state file could not be used.
    #[error("state {}", path.display())]
    State {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Problem,
    },
    /// A pid file could not be used.
    #[error("pid file {}", path.display())]
    PidFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Problem,
    },
}

/// Why a file a runtime points at (config.json, state, pid file) could not
/// be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// It was refused or could not be read (see [`untrusted`]).
    #[error(transparent)]
    Refused(#[from] untrusted::Refused),
    /// It is not the JSON expected.
    #[error("invalid JSON")]
    Json(#[from] serde_json::Error),
    /// Its content is not acceptable, for this reason.
    #[error("{0}")]
    Invalid(String),
    /// It was not read within the deadline (a hung file system), or too
    /// many reads are stuck already.
    #[error("{0}")]
    NotInTime(&'static str),
}

/// Asks the kernel for a `slice` on the calling thread (see
/// [`Builder::scheduler_slice`]); `which` names the thread in the debug
/// line when the kernel cannot.
pub(crate) fn ask_for_slice(which: &str, slice: std::time::Duration) {
    match lookout_host::sched::request_slice(slice) {
        Ok(lookout_host::sched::Slice::Set(_)) => {}
        Ok(other) => tracing::debug!(thread = which, ?other, "scheduler slice left as it was"),
        Err(e) => tracing::debug!(thread = which, %e, "cannot ask for a scheduler slice"),
    }
}
