//! The runtime spec's hook stages as lookout runs them: which hooks run
//! at each, in whose namespaces, with which State, and what a failure
//! means.

use lookout_model::{Container, Source, Status};
use lookout_oci_hooks::oci_spec::runtime::{ContainerState, Hook};
use lookout_oci_hooks::{InContainer, PathIn, Stage};

/// A group of hooks run together, in the runtime spec's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Group {
    /// `prestart` (deprecated in the runtime spec), with `--prestart`: the
    /// host's namespaces. podman hands hooks.d `prestart` hooks to runc as
    /// such, and runc runs every one of them before `createRuntime`.
    Prestart,
    /// `createRuntime`: the host's namespaces.
    CreateRuntime,
    /// `createContainer`: in the container's namespaces, the program
    /// opened from the host.
    CreateContainer,
    /// `startContainer`: in the container's namespaces, the program looked
    /// up in the container.
    StartContainer,
    /// `poststart`: the host's namespaces, after the start.
    Poststart,
    /// `poststop`: the host's namespaces, after the exit.
    Poststop,
}

/// The groups that run before a container's start, in order.
pub(crate) const BEFORE_START: [Group; 4] = [
    Group::Prestart,
    Group::CreateRuntime,
    Group::CreateContainer,
    Group::StartContainer,
];

impl Group {
    /// Its name in logs, claims and metrics.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Group::Prestart => "prestart",
            Group::CreateRuntime => "createRuntime",
            Group::CreateContainer => "createContainer",
            Group::StartContainer => "startContainer",
            Group::Poststart => "poststart",
            Group::Poststop => "poststop",
        }
    }

    /// Whether a hooks.d file's `stage` belongs to this group.
    pub(crate) fn has(self, stage: &Stage) -> bool {
        match self {
            Group::Prestart => *stage == Stage::Prestart,
            Group::CreateRuntime => *stage == Stage::CreateRuntime,
            Group::CreateContainer => *stage == Stage::CreateContainer,
            Group::StartContainer => *stage == Stage::StartContainer,
            Group::Poststart => *stage == Stage::Poststart,
            Group::Poststop => *stage == Stage::Poststop,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Whether its hooks run inside the container (and so only before
    /// its start, never in one found running).
    pub(crate) fn in_container_only(self) -> bool {
        matches!(self, Group::CreateContainer | Group::StartContainer)
    }

    /// Whether a failure here stops the container (the runtime spec: every
    /// stage before the start; `poststart` and `poststop` only warn).
    pub(crate) fn stops_the_container(self) -> bool {
        BEFORE_START.contains(&self)
    }

    /// Where its hooks run, for container `c` (`None`: the host's
    /// namespaces).
    pub(crate) fn in_container(self, c: &Container) -> Option<InContainer> {
        let path_in = match self {
            Group::CreateContainer => PathIn::Host,
            Group::StartContainer => PathIn::Container,
            _ => return None,
        };
        Some(InContainer::new(c.pid?, path_in))
    }

    /// The State's `status` and `pid` at this stage, as runc passes them:
    /// `creating` with the host's pid before the container exists for
    /// itself, `creating`/`created` with the pid in the container's own
    /// namespace for the hooks run in it, `running` after the start,
    /// `stopped` with no pid after the exit. A container found running
    /// (`late`) is `running` at every stage before its exit.
    pub(crate) fn state(self, c: &Container, late: bool) -> (ContainerState, Option<u32>) {
        let inner = || c.pid.and_then(lookout_host::proc::innermost_pid).or(c.pid);
        match (self, late) {
            (Group::Poststop, _) => (ContainerState::Stopped, None),
            (Group::CreateContainer | Group::StartContainer, true) => {
                (ContainerState::Running, inner())
            }
            (_, true) | (Group::Poststart, false) => (ContainerState::Running, c.pid),
            (Group::Prestart | Group::CreateRuntime, false) => (ContainerState::Creating, c.pid),
            (Group::CreateContainer, false) => (ContainerState::Creating, inner()),
            (Group::StartContainer, false) => (ContainerState::Created, inner()),
        }
    }
}

/// Whether lookout holds this container's start (it can still refuse it):
/// reported `created` by a backend that holds starts.
pub(crate) fn holds_start(source: Source, c: &Container) -> bool {
    matches!(source, Source::RuntimeHook | Source::Nri) && c.status == Status::Created
}

/// What a failing hook before the start does (`--hook-failure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnHookFailure {
    /// The container does not start (the runtime spec; what runc, crun,
    /// CRI-O and podman do).
    #[default]
    Stop,
    /// Logged and counted; the container starts.
    Warn,
}

/// One hook as configured: its name (the hooks.d file, or `sh -c ...`)
/// and the program.
pub(crate) type Named = (String, Hook);

/// How a group's run ended: `Err` with the first failure, after which the
/// group's later hooks did not run.
pub(crate) type GroupResult = Result<(), String>;

#[cfg(test)]
mod tests {
    use super::*;
    use lookout_model::RuntimeKind;

    #[test]
    fn each_stage_gets_runcs_status_and_pid() {
        let mut c = Container::new("c1", RuntimeKind::Runc);
        // Our own pid: its innermost pid is itself (no nested namespace).
        let me = std::process::id();
        c.pid = Some(me);
        let s = |g: Group, late| g.state(&c, late);
        assert_eq!(
            s(Group::Prestart, false),
            (ContainerState::Creating, Some(me))
        );
        assert_eq!(
            s(Group::CreateRuntime, false),
            (ContainerState::Creating, Some(me))
        );
        assert_eq!(
            s(Group::CreateContainer, false),
            (ContainerState::Creating, Some(me))
        );
        assert_eq!(
            s(Group::StartContainer, false),
            (ContainerState::Created, Some(me))
        );
        assert_eq!(
            s(Group::Poststart, false),
            (ContainerState::Running, Some(me))
        );
        assert_eq!(s(Group::Poststop, false), (ContainerState::Stopped, None));
        assert_eq!(
            s(Group::CreateRuntime, true),
            (ContainerState::Running, Some(me))
        );
        assert_eq!(s(Group::Poststop, true), (ContainerState::Stopped, None));
    }

    #[test]
    fn prestart_runs_before_create_runtime_and_only_stages_before_the_start_stop_it() {
        assert!(Group::Prestart.has(&Stage::Prestart));
        assert!(!Group::Prestart.has(&Stage::CreateRuntime));
        assert!(!Group::CreateRuntime.has(&Stage::Prestart));
        assert!(Group::CreateRuntime.has(&Stage::CreateRuntime));
        assert!(!Group::CreateRuntime.has(&Stage::CreateContainer));
        assert!(Group::StartContainer.has(&Stage::StartContainer));
        assert!(!Group::Poststart.has(&Stage::Poststop));
        for g in BEFORE_START {
            assert!(g.stops_the_container(), "{g:?}");
        }
        assert!(!Group::Poststart.stops_the_container());
        assert!(!Group::Poststop.stops_the_container());
    }

    #[test]
    fn only_the_container_stages_run_in_the_container() {
        let mut c = Container::new("c1", RuntimeKind::Runc);
        assert!(Group::CreateContainer.in_container(&c).is_none(), "no pid");
        c.pid = Some(7);
        let at = |g: Group| g.in_container(&c).map(|ic| (ic.pid, ic.path_in));
        assert_eq!(at(Group::CreateContainer), Some((7, PathIn::Host)));
        assert_eq!(at(Group::StartContainer), Some((7, PathIn::Container)));
        assert_eq!(at(Group::CreateRuntime), None);
        assert_eq!(at(Group::Poststart), None);
        assert!(Group::CreateContainer.in_container_only());
        assert!(!Group::Prestart.in_container_only());
    }
}
