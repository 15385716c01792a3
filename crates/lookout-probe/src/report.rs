//! The probe's output: checks, the chosen mode, and why better modes were
//! refused.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::mode::{Mode, Refusal};

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The feature works here.
    Ok,
    /// The feature is absent or not allowed here; the detail says why.
    Unsupported,
    /// The check itself failed unexpectedly (for example an unreadable
    /// `/proc` file); the detail names the error.
    Error,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Ok => "ok",
            Status::Unsupported => "unsupported",
            Status::Error => "error",
        })
    }
}

/// One named check with its status and a human-readable detail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Check {
    /// A stable name such as `fanotify:init` or `bpf:tracepoint`.
    pub name: String,
    /// The outcome.
    pub status: Status,
    /// What was found, or the errno and its likely cause.
    pub detail: String,
}

impl Check {
    pub(crate) fn new(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Self {
        Check {
            name: name.into(),
            status,
            detail: detail.into(),
        }
    }

    pub(crate) fn from_result(name: &str, r: &Result<String, Fail>) -> Self {
        match r {
            Ok(detail) => Check::new(name, Status::Ok, detail.clone()),
            Err(f) => Check::new(name, f.status, f.reason.clone()),
        }
    }
}

/// Why a check did not pass: a status (unsupported or error) and a reason.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Fail {
    /// [`Status::Unsupported`] or [`Status::Error`].
    pub status: Status,
    /// The reason, naming the errno and its likely cause.
    pub reason: String,
}

impl Fail {
    /// An unsupported feature.
    pub fn unsupported(reason: impl Into<String>) -> Self {
        Fail {
            status: Status::Unsupported,
            reason: reason.into(),
        }
    }
    /// A check that failed unexpectedly.
    pub fn error(reason: impl Into<String>) -> Self {
        Fail {
            status: Status::Error,
            reason: reason.into(),
        }
    }
}

/// Everything the probe found.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ProbeReport {
    /// The host root the runtime binaries were looked up under.
    pub host_root: String,
    /// Every check, in a stable order.
    pub checks: Vec<Check>,
    /// The mode `--mode auto` picks.
    pub mode: Mode,
    /// Each better mode and why it was refused.
    pub refused: Vec<Refusal>,
    /// Runtime binaries found (host paths), first path of each inode.
    pub runtimes: Vec<crate::RuntimeBinary>,
    /// The facts the decision was made from (not serialized).
    #[serde(skip)]
    pub facts: Option<crate::decide::Facts>,
}

impl ProbeReport {
    /// The check called `name`, if it ran.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// Whether `mode` can run here: `Err` holds every reason it cannot.
    /// For a deserialized report (no facts), only the chosen mode and the
    /// refusals are known.
    pub fn requirements(&self, mode: Mode) -> Result<(), String> {
        if let Some(f) = &self.facts {
            return f.requirements(mode);
        }
        match self.refused.iter().find(|r| r.mode == mode) {
            Some(r) => Err(r.reason.clone()),
            None => Ok(()),
        }
    }

    /// One line for logs: the mode and each refusal.
    pub fn summary(&self) -> String {
        let mut s = format!("discovery mode {}", self.mode);
        if !self.refused.is_empty() {
            s.push_str(" (refused: ");
            let parts: Vec<String> = self
                .refused
                .iter()
                .map(|r| format!("{}: {}", r.mode, r.reason))
                .collect();
            s.push_str(&parts.join(" | "));
            s.push(')');
        }
        s
    }
}

impl fmt::Display for ProbeReport {
    /// A readable table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = self
            .checks
            .iter()
            .map(|c| c.name.len())
            .max()
            .unwrap_or(5)
            .max(5);
        writeln!(f, "{:<w$}  {:<11}  DETAIL", "CHECK", "STATUS")?;
        for c in &self.checks {
            writeln!(
                f,
                "{:<w$}  {:<11}  {}",
                c.name,
                c.status.to_string(),
                c.detail
            )?;
        }
        writeln!(f)?;
        writeln!(f, "mode: {}", self.mode)?;
        for r in &self.refused {
            writeln!(f, "refused {}: {}", r.mode, r.reason)?;
        }
        Ok(())
    }
}
