//! hooks.d files (oci-hooks(5)) and the matching of their `when` against
//! a container's annotations and command.
//!
//! Input: a first byte, then (even) the file's bytes, matched against a
//! few fixed containers; or (odd) a structured input: a well-formed file
//! from chosen fields, and the container to match.
#![no_main]

use std::collections::BTreeMap;
use std::path::Path;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lookout_oci_hooks::{Target, parse_file};

#[derive(Arbitrary, Debug)]
enum File {
    Shaped {
        version: Option<String>,
        path: String,
        args: Option<Vec<String>>,
        timeout: Option<i64>,
        stages: Vec<String>,
        always: Option<bool>,
        annotations: Option<BTreeMap<String, String>>,
        commands: Option<Vec<String>>,
        has_bind_mounts: Option<bool>,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    file: File,
    annotations: BTreeMap<String, String>,
    args: Option<Vec<String>>,
    has_bind_mounts: bool,
}

fn check(bytes: &[u8], targets: &[Target<'_>]) {
    if let Ok(hook) = parse_file(bytes, Path::new("/etc/containers/oci/hooks.d/f.json")) {
        assert!(hook.hook.path().is_absolute());
        assert!(!hook.stages.is_empty());
        for t in targets {
            let _ = hook.when.matches(t);
        }
        let _ = hook.stages.iter().map(|s| s.runs_at_create()).count();
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        let a: BTreeMap<String, String> = [
            (
                "io.kubernetes.cri.container-type".to_owned(),
                "container".to_owned(),
            ),
            ("org.example/trace".to_owned(), "true".to_owned()),
        ]
        .into();
        let args = ["/bin/sh".to_owned(), "-c".to_owned(), "sleep 1".to_owned()];
        let none = BTreeMap::new();
        check(
            rest,
            &[
                Target {
                    annotations: &a,
                    args: Some(&args),
                    has_bind_mounts: true,
                },
                Target {
                    annotations: &none,
                    args: None,
                    has_bind_mounts: false,
                },
            ],
        );
        return;
    }
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(rest)) else {
        return;
    };
    let bytes = match input.file {
        File::Shaped {
            version,
            path,
            args,
            timeout,
            stages,
            always,
            annotations,
            commands,
            has_bind_mounts,
        } => serde_json::to_vec(&serde_json::json!({
            "version": version.unwrap_or_else(|| "1.0.0".into()),
            "hook": {"path": path, "args": args, "timeout": timeout},
            "when": {
                "always": always,
                "annotations": annotations,
                "commands": commands,
                "hasBindMounts": has_bind_mounts,
            },
            "stages": stages,
        }))
        .expect("serialise"),
    };
    let target = Target {
        annotations: &input.annotations,
        args: input.args.as_deref(),
        has_bind_mounts: input.has_bind_mounts,
    };
    check(&bytes, &[target]);
});
