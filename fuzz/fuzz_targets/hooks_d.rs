//! hooks.d files (oci-hooks(5)) and the matching of their `when` against
//! a container's annotations and command.
//!
//! Input: a first byte, then (even) the file's bytes, matched against a
//! few fixed containers; or (odd) a structured input: a well-formed file
//! from chosen fields, in the 1.0.0 or the legacy 0.1.0 shape, and the
//! container to match. (Raw bytes reach both formats too: a file without
//! `version` is 0.1.0.)
#![no_main]

use std::collections::BTreeMap;
use std::path::Path;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lookout_oci_hooks::{HookConfig, Target, parse_file};

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
    /// oci-hooks(5) 0.1.0: `version` left out when `None`, each list under
    /// either (or both) of its two names.
    Legacy {
        version: Option<String>,
        hook: String,
        arguments: Option<Vec<String>>,
        stages: Option<Vec<String>>,
        stage: Option<Vec<String>>,
        cmds: Option<Vec<String>>,
        cmd: Option<Vec<String>>,
        annotations: Option<Vec<String>>,
        annotation: Option<Vec<String>>,
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

fn check(bytes: &[u8], targets: &[Target<'_>]) -> Option<HookConfig> {
    let path = Path::new("/etc/containers/oci/hooks.d/f.json");
    match parse_file(bytes, path) {
        Ok(hook) => {
            assert!(hook.hook.path().is_absolute());
            assert!(!hook.stages.is_empty());
            for t in targets {
                let _ = hook.when.matches(t);
            }
            let _ = hook.stages.iter().map(|s| s.runs_at_create()).count();
            Some(hook)
        }
        Err(e) => {
            // Every refusal names the file and stays on one line, whatever
            // the file holds (its strings are quoted).
            assert_eq!(e.path(), path);
            let message = e.to_string();
            assert!(message.starts_with("/etc/containers/oci/hooks.d/f.json: "));
            assert!(!message.contains('\n'), "{message:?}");
            None
        }
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
        let _ = check(
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
    let mut legacy_path = None;
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
        File::Legacy {
            version,
            hook,
            arguments,
            stages,
            stage,
            cmds,
            cmd,
            annotations,
            annotation,
            has_bind_mounts,
        } => {
            legacy_path = Some((hook.clone(), arguments.is_some()));
            let mut file = serde_json::json!({
                "hook": hook,
                "arguments": arguments,
                "stages": stages,
                "stage": stage,
                "cmds": cmds,
                "cmd": cmd,
                "annotations": annotations,
                "annotation": annotation,
                "hasbindmounts": has_bind_mounts,
            });
            if let (Some(v), Some(o)) = (version, file.as_object_mut()) {
                o.insert("version".into(), v.into());
            }
            serde_json::to_vec(&file).expect("serialise")
        }
    };
    let target = Target {
        annotations: &input.annotations,
        args: input.args.as_deref(),
        has_bind_mounts: input.has_bind_mounts,
    };
    let parsed = check(&bytes, &[target]);
    if let (Some(h), Some((hook, has_arguments))) = (parsed, legacy_path) {
        // Read as 0.1.0 (a 1.0.0 version would need `hook` to be an object).
        assert_eq!(h.hook.path(), Path::new(&hook));
        let args = h.hook.args().as_deref().unwrap_or_default();
        assert_eq!(has_arguments, !args.is_empty());
        if has_arguments {
            assert_eq!(args[0], hook, "args[0] is the hook's path");
        }
    }
});
