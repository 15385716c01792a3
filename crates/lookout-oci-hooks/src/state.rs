//! The OCI State a hook receives on stdin, synthesized from what lookout
//! knows about a container.

use std::collections::HashMap;
use std::path::PathBuf;

use lookout_model::Container;
use oci_spec::runtime::{ContainerState, State, StateBuilder};

use crate::Error;

/// The runtime-spec version lookout's States claim.
pub const OCI_VERSION: &str = "1.2.0";

/// Set to `"true"` in the State's annotations when the hook runs for a
/// container found after it started (by the Pod informer or the start-up
/// state scan): the hook did not run before the container's first
/// instruction.
pub const LATE_ANNOTATION: &str = "io.lookout.hook.late";

/// Names the source that found the container (`runtime-hook`,
/// `state-scan`, `informer`).
pub const SOURCE_ANNOTATION: &str = "io.lookout.source";

/// The State of `c` with `status`: id, pid, bundle (the runtime's path;
/// `/` when unknown, since the field is required) and the config's
/// annotations, plus lookout's own.
pub fn state_of(
    c: &Container,
    status: ContainerState,
    source: lookout_model::Source,
    late: bool,
) -> Result<State, Error> {
    let mut annotations: HashMap<String, String> = c
        .annotations
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    annotations.insert(SOURCE_ANNOTATION.to_owned(), source.to_string());
    if late {
        annotations.insert(LATE_ANNOTATION.to_owned(), "true".to_owned());
    }
    let mut b = StateBuilder::default()
        .version(OCI_VERSION)
        .id(c.id.clone())
        .status(status)
        .bundle(c.bundle.clone().unwrap_or_else(|| PathBuf::from("/")))
        .annotations(annotations);
    if let Some(pid) = c.pid.and_then(|p| i32::try_from(p).ok()) {
        b = b.pid(pid);
    }
    b.build().map_err(Error::State)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lookout_model::{RuntimeKind, Source};

    #[test]
    fn a_state_is_valid_runtime_spec_json() {
        let mut c = Container::new("c1", RuntimeKind::Runc);
        c.pid = Some(42);
        c.bundle = Some(PathBuf::from("/run/b"));
        c.annotations.insert("a".into(), "b".into());
        let s = state_of(&c, ContainerState::Created, Source::RuntimeHook, false).expect("state");
        let v = serde_json::to_value(&s).expect("json");
        assert_eq!(v["ociVersion"], OCI_VERSION);
        assert_eq!(v["id"], "c1");
        assert_eq!(v["status"], "created");
        assert_eq!(v["pid"], 42);
        assert_eq!(v["bundle"], "/run/b");
        assert_eq!(v["annotations"]["a"], "b");
        assert_eq!(v["annotations"][SOURCE_ANNOTATION], "runtime-hook");
        assert!(v["annotations"].get(LATE_ANNOTATION).is_none());
        let late = state_of(&c, ContainerState::Running, Source::Informer, true).expect("state");
        let v = serde_json::to_value(&late).expect("json");
        assert_eq!(v["status"], "running");
        assert_eq!(v["annotations"][LATE_ANNOTATION], "true");
    }
}
