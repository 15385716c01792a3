//! The discovery modes, best first, and why a better one was refused: what
//! the decision ([`crate::Facts::decide`]) gives and the report carries.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A discovery mode, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Mode {
    /// `FAN_OPEN_EXEC_PERM` on the runtime binaries plus BPF argv capture:
    /// containers are reported before they start.
    #[serde(rename = "fanotify-ebpf")]
    FanotifyEbpf,
    /// Fanotify alone; argv is read from `/proc` after the exec is allowed.
    #[serde(rename = "fanotify")]
    Fanotify,
    /// A Kubernetes Pod informer for this node; no blocking.
    #[serde(rename = "podinformer")]
    PodInformer,
    /// Scanning the runtimes' state directories.
    #[serde(rename = "scan")]
    Scan,
}

impl Mode {
    /// All modes, best first (the order `auto` walks).
    pub const LADDER: [Mode; 4] = [
        Mode::FanotifyEbpf,
        Mode::Fanotify,
        Mode::PodInformer,
        Mode::Scan,
    ];

    /// The name used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::FanotifyEbpf => "fanotify-ebpf",
            Mode::Fanotify => "fanotify",
            Mode::PodInformer => "podinformer",
            Mode::Scan => "scan",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error for a string that names no mode.
#[derive(Debug, Clone, thiserror::Error)]
#[error("unknown discovery mode {0:?} (expected fanotify-ebpf, fanotify, podinformer or scan)")]
pub struct UnknownMode(pub String);

impl FromStr for Mode {
    type Err = UnknownMode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mode::LADDER
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| UnknownMode(s.to_owned()))
    }
}

/// A better mode that was not chosen, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Refusal {
    /// The mode.
    pub mode: Mode,
    /// Every reason it cannot run here, joined with `; `.
    pub reason: String,
}
