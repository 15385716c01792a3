//! The oci-hooks(5) 0.1.0 format, which podman and CRI-O still read
//! (containers/common `pkg/hooks/0.1.0/hook.go`), translated to what a
//! 1.0.0 file gives:
//!
//! - `hook` (a path) is `hook.path`; `arguments`, when set, make
//!   `hook.args` `[hook, arguments...]` (otherwise `args` stays unset);
//! - `stages` (or its synonym `stage`) are the stages;
//! - `cmds` (or `cmd`) are `when.commands`;
//! - `annotations` (or `annotation`), a list of value regexes, become the
//!   single `when.annotations` pair `".*"` → the list joined with `|`: any
//!   annotation whose value matches one of them;
//! - `hasbindmounts` is `when.hasBindMounts`;
//! - and the `when` is any-of: one condition that holds is enough (see
//!   [`When::matches`]).
//!
//! A file with none of `cmds`, `annotations`, `hasbindmounts` is valid, as
//! in containers/common, and never matches.

use oci_spec::runtime::Hook;
use serde_json::Value;

use super::fields::Fields;
use super::{LoadError, Parsed, When};

/// The version a 0.1.0 file may state (it may also state none, or `""`).
pub(super) const VERSION: &str = "0.1.0";

/// Reads a 0.1.0 file.
pub(super) fn parse(top: &Fields<'_>) -> Result<Parsed, LoadError> {
    let versionless = matches!(top.string("version"), Ok(None | Some("")));
    if versionless && matches!(top.value("hook"), Some(Value::Object(_))) {
        // The likeliest mistake: a 1.0.0 file that forgot its version.
        return Err(top.refuse(
            "hook",
            "an object, but a file without \"version\" is oci-hooks(5) 0.1.0, whose hook \
             is a path (a 1.0.0 file needs \"version\": \"1.0.0\")"
                .into(),
        ));
    }
    let Some(program) = top.string("hook")? else {
        return Err(top.refuse("hook", "missing (the program's absolute path)".into()));
    };
    let mut hook = Hook::default();
    hook.set_path(top.absolute_path("hook", program)?);
    if let Some(arguments) = top.strings("arguments")? {
        let args = std::iter::once(program)
            .chain(arguments)
            .map(str::to_owned)
            .collect();
        hook.set_args(Some(args));
    }

    let Some((stages_key, names)) = synonyms(top, "stages", "stage")? else {
        return Err(top.refuse("stages", "missing (or its synonym stage)".into()));
    };
    let stages = top.stages(stages_key, &names)?;

    let mut commands = Vec::new();
    if let Some((key, cmds)) = synonyms(top, "cmds", "cmd")? {
        for (i, c) in cmds.iter().enumerate() {
            commands.push(top.regex(format!("{key}[{i}]"), c)?);
        }
    }

    let mut annotations = Vec::new();
    if let Some((key, values)) = synonyms(top, "annotations", "annotation")? {
        // containers/common compiles the joined alternation, not each
        // entry: `["(", ")"]` is the valid `(|)`. When the whole does not
        // compile, name the first entry that does not compile alone.
        let joined = values.join("|");
        let value = match top.regex(top.name(key), &joined) {
            Ok(re) => re,
            Err(whole) => {
                for (i, v) in values.iter().enumerate() {
                    top.regex(format!("{key}[{i}]"), v)?;
                }
                return Err(whole);
            }
        };
        annotations.push((top.regex(top.name(key), ".*")?, value));
    }

    let when = When {
        always: None,
        annotations,
        commands,
        has_bind_mounts: top.bool("hasbindmounts")?,
        any: true,
    };
    Ok(Parsed { hook, when, stages })
}

/// The list under `plural` or under its synonym `singular`, with the key it
/// was under; both set is refused. An empty list counts as set, as in
/// containers/common (`"stages": []` and `"stage": [...]` are both set).
fn synonyms<'a>(
    top: &Fields<'a>,
    plural: &'static str,
    singular: &'static str,
) -> Result<Option<(&'static str, Vec<&'a str>)>, LoadError> {
    match (top.strings(plural)?, top.strings(singular)?) {
        (Some(_), Some(_)) => Err(top.refuse(
            singular,
            format!("set together with its synonym {plural} (keep one)"),
        )),
        (Some(v), None) => Ok(Some((plural, v))),
        (None, Some(v)) => Ok(Some((singular, v))),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    use super::super::{HookConfig, LoadError, Stage, Target, load_dirs, parse_file};

    const FILE: &str = "/usr/share/containers/oci/hooks.d/legacy.json";

    fn parse(json: &str) -> HookConfig {
        parse_file(json.as_bytes(), Path::new(FILE)).unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    /// The refusal of `json`, without the file's name (checked), one line.
    fn refusal(json: &str) -> String {
        let e = parse_file(json.as_bytes(), Path::new(FILE)).expect_err(json);
        assert_eq!(e.path(), Path::new(FILE));
        let message = e.to_string();
        assert!(!message.contains('\n'), "one line: {message:?}");
        message
            .strip_prefix(&format!("{FILE}: "))
            .unwrap_or_else(|| panic!("names the file: {message:?}"))
            .to_owned()
    }

    /// A container: its annotations, `process.args` and bind mounts.
    struct Container {
        annotations: BTreeMap<String, String>,
        args: Option<Vec<String>>,
        bind: bool,
    }

    impl Container {
        fn new() -> Container {
            Container {
                annotations: BTreeMap::new(),
                args: Some(vec!["/bin/sh".into()]),
                bind: false,
            }
        }
        fn annotated(mut self, k: &str, v: &str) -> Container {
            self.annotations.insert(k.into(), v.into());
            self
        }
        fn args(mut self, args: Option<&[&str]>) -> Container {
            self.args = args.map(|a| a.iter().map(|s| (*s).to_owned()).collect());
            self
        }
        fn bind(mut self) -> Container {
            self.bind = true;
            self
        }
        fn target(&self) -> Target<'_> {
            Target {
                annotations: &self.annotations,
                args: self.args.as_deref(),
                has_bind_mounts: self.bind,
            }
        }
    }

    fn matches(h: &HookConfig, c: &Container) -> bool {
        h.when.matches(&c.target())
    }

    #[test]
    fn a_0_1_0_file_becomes_the_hook_a_1_0_0_file_would() {
        let h = parse(
            r#"{
                "hook": "/usr/libexec/oci/hooks.d/oci-umount",
                "arguments": ["--debug", "-v"],
                "stages": ["prestart", "poststop"],
                "cmds": ["nginx$"],
                "annotations": ["^on$"],
                "hasbindmounts": true,
                "unknown": "ignored, as Go ignores it"
            }"#,
        );
        assert_eq!(h.name, "legacy.json");
        assert_eq!(h.source, Path::new(FILE));
        assert_eq!(
            h.hook.path(),
            Path::new("/usr/libexec/oci/hooks.d/oci-umount")
        );
        assert_eq!(
            h.hook.args().as_deref(),
            Some(
                &[
                    "/usr/libexec/oci/hooks.d/oci-umount".to_owned(),
                    "--debug".to_owned(),
                    "-v".to_owned()
                ][..]
            ),
            "args are the path, then the arguments"
        );
        assert_eq!(h.hook.env(), &None);
        assert_eq!(h.hook.timeout(), None);
        assert_eq!(h.stages, [Stage::Prestart, Stage::Poststop]);

        // No `arguments`: no `args` (the runtime's default argv); an empty
        // list: the path alone.
        let bare = parse(r#"{"hook":"/bin/true","stages":["prestart"],"cmds":["x"]}"#);
        assert_eq!(bare.hook.args(), &None);
        let empty = parse(r#"{"hook":"/bin/true","arguments":[],"stages":["prestart"]}"#);
        assert_eq!(
            empty.hook.args().as_deref(),
            Some(&["/bin/true".to_owned()][..])
        );

        // The version: none, null, "" and "0.1.0" are all this format.
        for version in [
            "",
            r#""version":null,"#,
            r#""version":"","#,
            r#""version":"0.1.0","#,
        ] {
            let h = parse(&format!(
                r#"{{{version}"hook":"/bin/true","stage":["poststop"]}}"#
            ));
            assert_eq!(h.stages, [Stage::Poststop], "{version}");
        }
    }

    #[test]
    fn one_condition_is_enough_where_1_0_0_needs_all() {
        let legacy = parse(
            r#"{"hook":"/bin/true","stage":["prestart"],
                "cmds":["nginx$"],"annotations":["^on$"],"hasbindmounts":true}"#,
        );
        let current = parse(
            r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"stages":["prestart"],
                "when":{"commands":["nginx$"],"annotations":{".*":"^on$"},"hasBindMounts":true}}"#,
        );
        let nginx = Some(&["/usr/sbin/nginx"][..]);
        let all = Container::new().annotated("trace", "on").args(nginx).bind();
        assert!(matches(&legacy, &all) && matches(&current, &all));

        let only_bind = Container::new().bind();
        let only_annotation = Container::new().annotated("trace", "on");
        let only_command = Container::new().args(nginx);
        for (what, c) in [
            ("bind mounts", &only_bind),
            ("an annotation", &only_annotation),
            ("the command", &only_command),
        ] {
            assert!(matches(&legacy, c), "0.1.0: {what} alone is enough");
            assert!(!matches(&current, c), "1.0.0: {what} alone is not");
        }
        // A condition that holds decides before the commands are looked at.
        let annotated_sh = Container::new().annotated("trace", "on");
        assert!(matches(&legacy, &annotated_sh));
        // Failing everything else, the commands decide.
        let neither = Container::new().annotated("trace", "off");
        assert!(!matches(&legacy, &neither));
        assert!(!matches(&legacy, &Container::new().args(None)));

        // `hasbindmounts: false` rules nothing out (1.0.0: it never matches).
        let no_bind = parse(
            r#"{"hook":"/bin/true","stage":["prestart"],"hasbindmounts":false,"cmds":["nginx$"]}"#,
        );
        assert!(matches(&no_bind, &Container::new().args(nginx)));
        assert!(!matches(&no_bind, &Container::new().bind()));
    }

    #[test]
    fn a_file_without_a_condition_loads_and_never_matches() {
        // containers/common accepts it (its own test `TestStage`) and its
        // `When.Match` answers false: nothing matched.
        let h = parse(r#"{"hook":"/bin/true","stage":["prestart"]}"#);
        let everything = Container::new()
            .annotated("a", "b")
            .args(Some(&["/bin/sh"]))
            .bind();
        assert!(!matches(&h, &everything));
        assert!(!matches(&h, &Container::new().args(None)));
    }

    #[test]
    fn stage_is_a_synonym_of_stages() {
        let both = r#"{"hook":"/bin/true","stages":["prestart"],"stage":["poststop"]}"#;
        assert_eq!(
            refusal(both),
            "stage: set together with its synonym stages (keep one)"
        );
        // An empty list counts as set.
        assert_eq!(
            refusal(r#"{"hook":"/bin/true","stages":[],"stage":["poststop"]}"#),
            "stage: set together with its synonym stages (keep one)"
        );
        assert_eq!(
            parse(r#"{"hook":"/bin/true","stages":null,"stage":["createRuntime"]}"#).stages,
            [Stage::CreateRuntime],
            "null is unset"
        );
        assert_eq!(
            refusal(r#"{"hook":"/bin/true","cmds":["x"]}"#),
            "stages: missing (or its synonym stage)"
        );
        assert_eq!(
            refusal(r#"{"hook":"/bin/true","stage":[]}"#),
            "stage: empty (the hook would never run)"
        );
        assert_eq!(
            refusal(r#"{"hook":"/bin/true","stage":["prestart","postmortem"]}"#),
            r#"stage[1]: unknown stage "postmortem""#
        );
        assert_eq!(
            refusal(r#"{"hook":"/bin/true","stages":["startup"]}"#),
            r#"stages[0]: unknown stage "startup""#
        );
    }

    #[test]
    fn cmds_match_process_args_0() {
        for key in ["cmds", "cmd"] {
            let h = parse(&format!(
                r#"{{"hook":"/bin/true","stages":["prestart"],"{key}":["^/usr/bin/nginx$","^redis"]}}"#
            ));
            let c = |args: &[&str]| Container::new().args(Some(args));
            assert!(matches(&h, &c(&["/usr/bin/nginx", "-g"])), "{key}");
            assert!(matches(&h, &c(&["redis-server"])), "{key}: either entry");
            assert!(
                !matches(&h, &c(&["/bin/sh", "/usr/bin/nginx"])),
                "{key}: args[0] only"
            );
            assert!(!matches(&h, &c(&[])), "{key}: no args[0]");
        }
        assert_eq!(
            refusal(r#"{"hook":"/bin/true","stages":["prestart"],"cmds":["a"],"cmd":["b"]}"#),
            "cmd: set together with its synonym cmds (keep one)"
        );
    }

    #[test]
    fn annotations_match_any_annotation_value() {
        for key in ["annotations", "annotation"] {
            let h = parse(&format!(
                r#"{{"hook":"/bin/true","stages":["prestart"],"{key}":["^true$","^on$"]}}"#
            ));
            assert!(matches(
                &h,
                &Container::new().annotated("x.example/trace", "on")
            ));
            assert!(matches(&h, &Container::new().annotated("anything", "true")));
            assert!(
                !matches(&h, &Container::new().annotated("on", "off")),
                "values only"
            );
            assert!(!matches(&h, &Container::new().annotated("a", "true-ish")));
            assert!(!matches(&h, &Container::new()));
        }
        // containers/common joins the list into one value regex: an empty
        // list is the empty regex, which any annotated container matches.
        let empty = parse(r#"{"hook":"/bin/true","stages":["prestart"],"annotations":[]}"#);
        assert!(matches(&empty, &Container::new().annotated("a", "")));
        assert!(!matches(&empty, &Container::new()));
        // ...and the joined alternation is what must compile: `(|)`.
        let halves = parse(r#"{"hook":"/bin/true","stages":["prestart"],"annotations":["(",")"]}"#);
        assert!(matches(&halves, &Container::new().annotated("a", "b")));
        assert_eq!(
            refusal(
                r#"{"hook":"/bin/true","stages":["prestart"],"annotations":["a"],"annotation":["b"]}"#
            ),
            "annotation: set together with its synonym annotations (keep one)"
        );
    }

    #[test]
    fn hasbindmounts_needs_a_bind_mount() {
        let h = parse(r#"{"hook":"/bin/true","stages":["prestart"],"hasbindmounts":true}"#);
        assert!(matches(&h, &Container::new().bind()));
        assert!(!matches(&h, &Container::new()));
        let off = parse(r#"{"hook":"/bin/true","stages":["prestart"],"hasbindmounts":false}"#);
        assert!(!matches(&off, &Container::new().bind()));
        assert!(!matches(&off, &Container::new()));
    }

    #[test]
    fn refusals_of_a_0_1_0_file_name_the_field() {
        let cases = [
            (
                r#"{"hook":{"path":"/bin/true"},"when":{"always":true},"stages":["prestart"]}"#,
                r#"hook: an object, but a file without "version" is oci-hooks(5) 0.1.0, whose hook is a path (a 1.0.0 file needs "version": "1.0.0")"#,
            ),
            (
                r#"{"version":"0.1.0","hook":{"path":"/bin/true"},"stages":["prestart"]}"#,
                "hook: expected a string, found an object",
            ),
            (
                r#"{"stages":["prestart"]}"#,
                "hook: missing (the program's absolute path)",
            ),
            (
                r#"{"hook":"bin/true","stages":["prestart"]}"#,
                r#"hook: "bin/true" is not absolute"#,
            ),
            (
                r#"{"hook":"","stages":["prestart"]}"#,
                r#"hook: "" is not absolute"#,
            ),
            (
                r#"{"hook":"/bin/true","arguments":["-v",2],"stages":["prestart"]}"#,
                "arguments[1]: expected a string, found a number",
            ),
            (
                r#"{"hook":"/bin/true","arguments":"-v","stages":["prestart"]}"#,
                "arguments: expected an array of strings, found a string",
            ),
            (
                r#"{"hook":"/bin/true","stages":["prestart"],"cmds":["sh","("]}"#,
                r#"cmds[1]: invalid regex "(""#,
            ),
            (
                r#"{"hook":"/bin/true","stages":["prestart"],"cmd":["["]}"#,
                r#"cmd[0]: invalid regex "[""#,
            ),
            (
                r#"{"hook":"/bin/true","stages":["prestart"],"annotations":["ok","[a"]}"#,
                r#"annotations[1]: invalid regex "[a""#,
            ),
            (
                r#"{"hook":"/bin/true","stages":["prestart"],"hasbindmounts":"yes"}"#,
                "hasbindmounts: expected true or false, found a string",
            ),
            (
                r#"{"version":"2.0.0","hook":"/bin/true","stages":["prestart"]}"#,
                r#"version: "2.0.0" is not an oci-hooks(5) version lookout reads (1.0.0, or 0.1.0 or none for the legacy format)"#,
            ),
            (
                r#"{"version":0.1,"hook":"/bin/true","stages":["prestart"]}"#,
                "version: expected a string, found a number",
            ),
        ];
        for (json, want) in cases {
            assert_eq!(refusal(json), want, "{json}");
        }
        // The regex crate's complaint is the cause, not the message.
        let e = parse_file(
            br#"{"hook":"/bin/true","stages":["prestart"],"cmds":["("]}"#,
            Path::new(FILE),
        )
        .expect_err("bad regex");
        assert!(matches!(&e, LoadError::Regex { field, .. } if field == "cmds[0]"));
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn a_later_directory_overrides_by_file_name_across_versions() {
        let legacy = r#"{"hook":"/bin/true","stage":["createRuntime"],"hasbindmounts":false,"cmds":["nginx$"]}"#;
        let current = r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"when":{"hasBindMounts":false,"commands":["nginx$"]},"stages":["poststop"]}"#;
        let nginx = Container::new().args(Some(&["/usr/sbin/nginx"]));
        for (first, second, stage, matched) in [
            (legacy, current, Stage::Poststop, false),
            (current, legacy, Stage::CreateRuntime, true),
        ] {
            let a = tempfile::tempdir().expect("tempdir");
            let b = tempfile::tempdir().expect("tempdir");
            std::fs::write(a.path().join("10-hook.json"), first).expect("write");
            std::fs::write(b.path().join("10-hook.json"), second).expect("write");
            let l = load_dirs(&[a.path().to_path_buf(), b.path().to_path_buf()]);
            assert!(l.errors.is_empty(), "{:?}", l.errors);
            assert_eq!(l.hooks.len(), 1);
            let h = &l.hooks[0];
            assert_eq!(h.source, b.path().join("10-hook.json"), "the later one");
            // The same conditions: `hasBindMounts: false` vetoes in 1.0.0
            // only.
            assert_eq!(matches(h, &nginx), matched, "{stage:?}");
            assert_eq!(h.stages, [stage]);
        }
        // A 0.1.0 hook's path is checked on the file system like a 1.0.0 one.
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            d.path().join("gone.json"),
            r#"{"hook":"/nonexistent/lk-hook","stage":["prestart"]}"#,
        )
        .expect("write");
        let l = load_dirs(&[PathBuf::from(d.path())]);
        assert!(matches!(
            &l.errors[..],
            [LoadError::HookPath { hook_path, .. }] if hook_path == Path::new("/nonexistent/lk-hook")
        ));
    }
}
