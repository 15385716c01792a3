//! The discovery-mode decision: a pure function of what was found, so
//! every branch is unit-tested without a kernel.

use crate::mode::{Mode, Refusal};

/// What each mode depends on; `Err` holds the reason a requirement fails.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Facts {
    /// Permission events and an exec-permission mark work.
    pub fanotify: Result<(), String>,
    /// `FAN_REPORT_TID` works (pairs fanotify events with BPF records).
    pub report_tid: Result<(), String>,
    /// The BPF object loads and its tracepoint delivers events.
    pub bpf: Result<(), String>,
    /// We run in the host pid namespace.
    pub host_pid_ns: Result<(), String>,
    /// No sandbox hides the host from us.
    pub sandbox: Result<(), String>,
    /// At least one runtime binary was found.
    pub runtimes: Result<(), String>,
    /// A cluster is reachable by configuration and `NODE_NAME` is set.
    pub kube: Result<(), String>,
}

impl Facts {
    /// Every reason `mode` cannot run, or `Ok` if it can.
    pub fn requirements(&self, mode: Mode) -> Result<(), String> {
        let needed: Vec<&Result<(), String>> = match mode {
            Mode::FanotifyEbpf => vec![
                &self.sandbox,
                &self.fanotify,
                &self.report_tid,
                &self.bpf,
                &self.host_pid_ns,
                &self.runtimes,
            ],
            Mode::Fanotify => vec![
                &self.sandbox,
                &self.fanotify,
                &self.host_pid_ns,
                &self.runtimes,
            ],
            Mode::PodInformer => vec![&self.kube],
            Mode::Scan => vec![],
        };
        let mut reasons: Vec<&str> = Vec::new();
        for r in needed {
            if let Err(reason) = r
                && !reasons.contains(&reason.as_str())
            {
                reasons.push(reason);
            }
        }
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(reasons.join("; "))
        }
    }

    /// The best mode whose requirements hold, and the refusals of every
    /// better one. `scan` has no requirements, so a mode is always chosen.
    pub fn decide(&self) -> (Mode, Vec<Refusal>) {
        let mut refused = Vec::new();
        for mode in Mode::LADDER {
            match self.requirements(mode) {
                Ok(()) => return (mode, refused),
                Err(reason) => refused.push(Refusal { mode, reason }),
            }
        }
        // Unreachable in practice: Scan has no requirements.
        (Mode::Scan, refused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_ok() -> Facts {
        Facts {
            fanotify: Ok(()),
            report_tid: Ok(()),
            bpf: Ok(()),
            host_pid_ns: Ok(()),
            sandbox: Ok(()),
            runtimes: Ok(()),
            kube: Ok(()),
        }
    }

    #[test]
    fn everything_available_picks_fanotify_ebpf() {
        assert_eq!(all_ok().decide(), (Mode::FanotifyEbpf, vec![]));
    }

    #[test]
    fn no_bpf_picks_fanotify_and_says_why() {
        let f = Facts {
            bpf: Err("BPF object missing".into()),
            ..all_ok()
        };
        let (mode, refused) = f.decide();
        assert_eq!(mode, Mode::Fanotify);
        assert_eq!(
            refused,
            vec![Refusal {
                mode: Mode::FanotifyEbpf,
                reason: "BPF object missing".into()
            }]
        );
    }

    #[test]
    fn no_fanotify_with_cluster_picks_informer() {
        let f = Facts {
            fanotify: Err("fanotify_init: EPERM".into()),
            ..all_ok()
        };
        let (mode, refused) = f.decide();
        assert_eq!(mode, Mode::PodInformer);
        assert_eq!(refused.len(), 2);
        assert!(refused.iter().all(|r| r.reason == "fanotify_init: EPERM"));
    }

    #[test]
    fn nothing_but_scan() {
        let f = Facts {
            fanotify: Err("fanotify_init: ENOSYS".into()),
            kube: Err("no cluster".into()),
            ..all_ok()
        };
        let (mode, refused) = f.decide();
        assert_eq!(mode, Mode::Scan);
        assert_eq!(
            refused.last().map(|r| r.reason.as_str()),
            Some("no cluster")
        );
    }

    #[test]
    fn reasons_are_joined_without_repeats() {
        let f = Facts {
            fanotify: Err("a".into()),
            host_pid_ns: Err("b".into()),
            runtimes: Err("a".into()),
            ..all_ok()
        };
        assert_eq!(f.requirements(Mode::Fanotify), Err("a; b".into()));
        assert_eq!(f.requirements(Mode::Scan), Ok(()));
    }
}
