//! hooks.d directories in the oci-hooks(5) formats used by CRI-O and
//! podman (1.0.0, and the legacy 0.1.0 in [`legacy`]), with the same
//! matching rules as containers/common.

mod fields;
mod legacy;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use lookout_model::Chain;
use oci_spec::runtime::Hook;
use regex::Regex;
use serde_json::{Map, Value};

use fields::Fields;

/// A lifecycle stage a hook asks for. Non-exhaustive: the runtime spec
/// has added stages before.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stage {
    /// `prestart` (deprecated in the runtime spec; CRI-O runs it as
    /// `createRuntime`).
    Prestart,
    /// `createRuntime`.
    CreateRuntime,
    /// `createContainer`.
    CreateContainer,
    /// `startContainer`.
    StartContainer,
    /// `poststart`.
    Poststart,
    /// `poststop`.
    Poststop,
}

impl Stage {
    fn parse(s: &str) -> Option<Stage> {
        Some(match s {
            "prestart" => Stage::Prestart,
            "createRuntime" => Stage::CreateRuntime,
            "createContainer" => Stage::CreateContainer,
            "startContainer" => Stage::StartContainer,
            "poststart" => Stage::Poststart,
            "poststop" => Stage::Poststop,
            _ => return None,
        })
    }

    /// Whether lookout runs hooks of this stage when a container is added
    /// (still `created`, before it may start). lookout runs every hook in
    /// the host namespaces; `createContainer` and `startContainer` hooks,
    /// which a runtime would run inside the container, run there too.
    pub fn runs_at_create(&self) -> bool {
        matches!(
            self,
            Stage::Prestart | Stage::CreateRuntime | Stage::CreateContainer | Stage::StartContainer
        )
    }
}

/// The `when` block, regexes compiled (of a 0.1.0 file: its conditions,
/// translated).
#[derive(Debug, Clone)]
pub struct When {
    always: Option<bool>,
    annotations: Vec<(Regex, Regex)>,
    commands: Vec<Regex>,
    has_bind_mounts: Option<bool>,
    /// Any one condition that holds is enough: a 0.1.0 file's rule
    /// (containers/common's `When.Or`); 1.0.0 files need all of them.
    any: bool,
}

/// What a `when` block is matched against.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// The container's annotations.
    pub annotations: &'a BTreeMap<String, String>,
    /// `process.args`, when the config has a `process`.
    pub args: Option<&'a [String]>,
    /// Whether the config has a bind mount.
    pub has_bind_mounts: bool,
}

impl When {
    /// The oci-hooks(5) rules, as containers/common implements them.
    ///
    /// 1.0.0: every condition that is set must match; regexes are
    /// unanchored (write `^...$` yourself); `always: false` or
    /// `hasBindMounts: false` never match; when `commands` is set and the
    /// config has a process, the command match decides (after the other
    /// conditions passed); a `when` with no condition never matches.
    ///
    /// 0.1.0: one condition that matches is enough (`hasbindmounts: false`
    /// and an annotation that matches nothing rule nothing out); failing
    /// those, `cmds` decide when set and the config has a process; a file
    /// with no condition never matches.
    pub fn matches(&self, t: &Target<'_>) -> bool {
        // Lazily, in containers/common's order: `always`, `hasBindMounts`,
        // each annotation pair; then the commands.
        let conditions = self
            .always
            .into_iter()
            .chain(self.has_bind_mounts.map(|want| want && t.has_bind_mounts))
            .chain(self.annotations.iter().map(|(key, value)| {
                t.annotations
                    .iter()
                    .any(|(k, v)| key.is_match(k) && value.is_match(v))
            }));
        let mut matched = 0;
        for hit in conditions {
            match (hit, self.any) {
                (true, true) => return true,
                (false, false) => return false,
                (true, false) => matched += 1,
                (false, true) => {}
            }
        }
        if let Some(args) = t.args
            && !self.commands.is_empty()
        {
            let Some(command) = args.first() else {
                return false;
            };
            return self.commands.iter().any(|c| c.is_match(command));
        }
        matched > 0
    }
}

/// One loaded hook file.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HookConfig {
    /// The file name (hooks run in the lower-cased order of these).
    pub name: String,
    /// The file it came from.
    pub source: PathBuf,
    /// The program.
    pub hook: Hook,
    /// When it applies.
    pub when: When,
    /// Its stages.
    pub stages: Vec<Stage>,
}

/// A hook file (or hooks.d directory) that was skipped, and why.
///
/// Each message starts with the file; the underlying error, if any, is the
/// [`source`](std::error::Error::source): print with
/// [`lookout_model::Chain`] to see it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The file (or directory) could not be read.
    #[error("cannot read {}", path.display())]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not JSON, or not a JSON object (a field of the wrong type
    /// is a [`LoadError::Field`]).
    #[error("{}: invalid JSON", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// serde's complaint (with line and column).
        source: serde_json::Error,
    },
    /// A regex does not compile.
    #[error("{}: {field}: invalid regex {regex:?}", path.display())]
    Regex {
        /// The file.
        path: PathBuf,
        /// Where the regex is: `when.annotations` (a key),
        /// `when.annotations["key"]` (its value), `when.commands[2]`; in a
        /// 0.1.0 file `cmds[0]`, `annotations[1]`.
        field: String,
        /// The pattern.
        regex: String,
        /// The regex crate's complaint.
        source: regex::Error,
    },
    /// `hook.path` does not exist where the hook runs.
    #[error("{}: hook.path {}", path.display(), hook_path.display())]
    HookPath {
        /// The file.
        path: PathBuf,
        /// Where `hook.path` was looked for (under the hook root).
        hook_path: PathBuf,
        /// Why it is not there.
        source: std::io::Error,
    },
    /// A field breaks a rule of the format: a version lookout does not
    /// read, a missing field, a value of the wrong JSON type, a relative
    /// `hook.path`, no or an unknown stage, a `when` without a condition,
    /// two synonyms of a 0.1.0 file both set...
    #[error("{}: {field}: {reason}", path.display())]
    Field {
        /// The file.
        path: PathBuf,
        /// The field, as a path into the file: `version`, `hook.path`,
        /// `stages[1]`, `when`; in a 0.1.0 file `hook`, `arguments[0]`,
        /// `stage`.
        field: String,
        /// The rule it breaks (one line; strings from the file are quoted).
        reason: String,
    },
    /// The file as a whole breaks a rule: not a regular file, too big.
    #[error("{}: {reason}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The rule it breaks.
        reason: String,
    },
}

impl LoadError {
    /// The file (or directory) skipped.
    pub fn path(&self) -> &Path {
        match self {
            LoadError::Read { path, .. }
            | LoadError::Json { path, .. }
            | LoadError::Regex { path, .. }
            | LoadError::HookPath { path, .. }
            | LoadError::Field { path, .. }
            | LoadError::Invalid { path, .. } => path,
        }
    }
}

/// What a set of directories holds.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Loaded {
    /// Valid hooks, in the order they run.
    pub hooks: Vec<HookConfig>,
    /// Files that were skipped.
    pub errors: Vec<LoadError>,
}

/// Hook files are small; a bigger one is refused without being parsed.
pub const MAX_HOOK_FILE_BYTES: u64 = 1 << 20;

/// Loads one hook file: a regular file of at most [`MAX_HOOK_FILE_BYTES`],
/// [parsed](parse_file), whose `hook.path` exists.
pub fn load_file(path: &Path) -> Result<HookConfig, LoadError> {
    load_file_under(Path::new("/"), path)
}

/// [`load_file`] for hooks that run on a host whose `/` is at `hook_root`
/// here (a DaemonSet with the host at `/host`): `hook.path` is a host path,
/// checked under `hook_root`.
pub fn load_file_under(hook_root: &Path, path: &Path) -> Result<HookConfig, LoadError> {
    let read = |source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    };
    let invalid = |reason: String| LoadError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(read)?;
    if !meta.is_file() {
        return Err(invalid("not a regular file".into()));
    }
    if meta.len() > MAX_HOOK_FILE_BYTES {
        return Err(invalid(format!("larger than {MAX_HOOK_FILE_BYTES} bytes")));
    }
    let text = std::fs::read(path).map_err(read)?;
    let c = parse_file(&text, path)?;
    let p = c.hook.path();
    // The hook runs in the host's mount namespace: its symlinks (an
    // absolute `/usr/bin/sh -> /bin/dash`) are the host's, read under
    // `hook_root`, not this process's root.
    let checked = lookout_host::resolve_in_root(hook_root, p)
        .and_then(|here| std::fs::metadata(&here).map(|_| ()));
    if let Err(source) = checked {
        return Err(LoadError::HookPath {
            path: path.to_path_buf(),
            hook_path: lookout_host::host_path(hook_root, p),
            source,
        });
    }
    Ok(c)
}

/// Parses the bytes of hook file `path`: everything [`load_file`] checks
/// but the file system.
///
/// The version is told as containers/common tells it: `"version": "1.0.0"`
/// is the 1.0.0 format; `"0.1.0"`, `""`, `null` or no `version` at all is
/// the legacy 0.1.0 format (translated to the same [`HookConfig`], with its
/// any-of [`When`]); any other version is refused. Every refusal names the
/// file and the field.
pub fn parse_file(text: &[u8], path: &Path) -> Result<HookConfig, LoadError> {
    let object: Map<String, Value> =
        serde_json::from_slice(text).map_err(|source| LoadError::Json {
            path: path.to_path_buf(),
            source,
        })?;
    let top = Fields::top(path, &object);
    let Parsed { hook, when, stages } = match top.string("version")? {
        Some(CURRENT_VERSION) => parse_current(&top)?,
        None | Some("" | legacy::VERSION) => legacy::parse(&top)?,
        Some(other) => {
            return Err(top.refuse(
                "version",
                format!(
                    "{other:?} is not an oci-hooks(5) version lookout reads \
                     ({CURRENT_VERSION}, or {} or none for the legacy format)",
                    legacy::VERSION
                ),
            ));
        }
    };
    Ok(HookConfig {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        source: path.to_path_buf(),
        hook,
        when,
        stages,
    })
}

/// The version of the current format.
const CURRENT_VERSION: &str = "1.0.0";

/// What a file of either version gives.
struct Parsed {
    hook: Hook,
    when: When,
    stages: Vec<Stage>,
}

/// Reads a 1.0.0 file.
fn parse_current(top: &Fields<'_>) -> Result<Parsed, LoadError> {
    let Some(h) = top.object("hook", "hook.")? else {
        return Err(top.refuse("hook", "missing".into()));
    };
    let Some(program) = h.string("path")? else {
        return Err(h.refuse("path", "missing".into()));
    };
    let mut hook = Hook::default();
    hook.set_path(h.absolute_path("path", program)?);
    let owned = |v: Vec<&str>| v.into_iter().map(str::to_owned).collect();
    hook.set_args(h.strings("args")?.map(owned));
    hook.set_env(h.strings("env")?.map(owned));
    if let Some(t) = h.int("timeout")? {
        if t <= 0 {
            return Err(h.refuse("timeout", format!("{t} is not greater than zero")));
        }
        hook.set_timeout(Some(t));
    }

    let Some(names) = top.strings("stages")? else {
        return Err(top.refuse("stages", "missing".into()));
    };
    let stages = top.stages("stages", &names)?;

    let mut when = When {
        always: None,
        annotations: Vec::new(),
        commands: Vec::new(),
        has_bind_mounts: None,
        any: false,
    };
    if let Some(w) = top.object("when", "when.")? {
        when.always = w.bool("always")?;
        for (k, v) in w.string_map("annotations")?.into_iter().flatten() {
            when.annotations.push((
                w.regex(w.name("annotations"), k)?,
                w.regex(format!("{}[{k:?}]", w.name("annotations")), v)?,
            ));
        }
        for (i, c) in w.strings("commands")?.into_iter().flatten().enumerate() {
            when.commands
                .push(w.regex(format!("{}[{i}]", w.name("commands")), c)?);
        }
        when.has_bind_mounts = w.bool("hasBindMounts")?;
    }
    if when.always.is_none()
        && when.has_bind_mounts.is_none()
        && when.annotations.is_empty()
        && when.commands.is_empty()
    {
        return Err(top.refuse(
            "when",
            "no condition (set at least one of always, annotations, commands, hasBindMounts)"
                .into(),
        ));
    }
    Ok(Parsed { hook, when, stages })
}

/// Loads `dirs` in order: a file in a later directory replaces the file of
/// the same name in an earlier one; only `*.json` files count; hooks are
/// ordered by lower-cased file name. A missing directory is no error.
pub fn load_dirs(dirs: &[PathBuf]) -> Loaded {
    load_dirs_under(Path::new("/"), dirs)
}

/// [`load_dirs`], with each `hook.path` checked under `hook_root` (see
/// [`load_file_under`]).
pub fn load_dirs_under(hook_root: &Path, dirs: &[PathBuf]) -> Loaded {
    let mut by_name: HashMap<String, PathBuf> = HashMap::new();
    let mut errors = Vec::new();
    for dir in dirs {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                errors.push(LoadError::Read {
                    path: dir.clone(),
                    source,
                });
                continue;
            }
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".json") {
                by_name.insert(name, entry.path());
            }
        }
    }
    let mut files: Vec<(String, PathBuf)> = by_name.into_iter().collect();
    files.sort_by(|a, b| {
        a.0.to_lowercase()
            .cmp(&b.0.to_lowercase())
            .then(a.0.cmp(&b.0))
    });
    let mut hooks = Vec::new();
    for (_, path) in files {
        match load_file_under(hook_root, &path) {
            Ok(h) => hooks.push(h),
            Err(e) => errors.push(e),
        }
    }
    Loaded { hooks, errors }
}

/// hooks.d directories that reload when they change: each [`HooksDirs::current`]
/// compares the directories' files (names, sizes, modification times) with
/// the last load, a `readdir` and a `stat` per file.
#[derive(Debug, Default)]
pub struct HooksDirs {
    dirs: Vec<PathBuf>,
    /// Where `hook.path`s resolve (see [`load_file_under`]); empty: `/`.
    hook_root: PathBuf,
    fingerprint: Vec<(PathBuf, u64, Option<SystemTime>)>,
    loaded: Loaded,
}

impl HooksDirs {
    /// Watches `dirs` (later ones override earlier ones by file name).
    pub fn new(dirs: Vec<PathBuf>) -> HooksDirs {
        HooksDirs::with_hook_root(dirs, PathBuf::from("/"))
    }

    /// Watches `dirs`, whose hooks run on a host whose `/` is at
    /// `hook_root` here (see [`load_file_under`]).
    pub fn with_hook_root(dirs: Vec<PathBuf>, hook_root: PathBuf) -> HooksDirs {
        let mut h = HooksDirs {
            dirs,
            hook_root,
            ..HooksDirs::default()
        };
        h.reload();
        h
    }

    fn fingerprint(&self) -> Vec<(PathBuf, u64, Option<SystemTime>)> {
        let mut v = Vec::new();
        for d in &self.dirs {
            let Ok(entries) = std::fs::read_dir(d) else {
                continue;
            };
            for e in entries.flatten() {
                let meta = e.metadata().ok();
                v.push((
                    e.path(),
                    meta.as_ref().map_or(0, |m| m.len()),
                    meta.and_then(|m| m.modified().ok()),
                ));
            }
        }
        v.sort();
        v
    }

    fn reload(&mut self) {
        self.fingerprint = self.fingerprint();
        let root = if self.hook_root.as_os_str().is_empty() {
            Path::new("/")
        } else {
            &self.hook_root
        };
        self.loaded = load_dirs_under(root, &self.dirs);
        for e in &self.loaded.errors {
            // `file` and `reason`, as docs/hooks.md shows; the reason is the
            // whole chain (it names the file too).
            tracing::warn!(
                file = %e.path().display(),
                reason = %Chain(e),
                "hook file skipped"
            );
        }
        if !self.dirs.is_empty() {
            tracing::info!(
                hooks = self.loaded.hooks.len(),
                skipped = self.loaded.errors.len(),
                "hooks.d loaded"
            );
        }
    }

    /// The hooks now, reloaded first if a directory changed.
    pub fn current(&mut self) -> &Loaded {
        if !self.dirs.is_empty() && self.fingerprint() != self.fingerprint {
            self.reload();
        }
        &self.loaded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn when(json: &str) -> When {
        let d = tempfile::tempdir().expect("tempdir");
        let f = d.path().join("h.json");
        std::fs::write(
            &f,
            format!(r#"{{"version":"1.0.0","hook":{{"path":"/bin/sh"}},"when":{json},"stages":["prestart"]}}"#),
        )
        .expect("write");
        load_file(&f).expect("valid").when
    }

    fn target<'a>(
        a: &'a BTreeMap<String, String>,
        args: Option<&'a [String]>,
        bind: bool,
    ) -> Target<'a> {
        Target {
            annotations: a,
            args,
            has_bind_mounts: bind,
        }
    }

    #[test]
    fn matching_follows_containers_common() {
        let ann = BTreeMap::from([("io.example/trace".to_owned(), "yes-please".to_owned())]);
        let none = BTreeMap::new();
        let args = vec!["/usr/bin/nginx".to_owned(), "-g".to_owned()];
        assert!(when(r#"{"always":true}"#).matches(&target(&none, None, false)));
        assert!(!when(r#"{"always":false}"#).matches(&target(&ann, Some(&args), true)));
        // Unanchored regexes, keys and values.
        assert!(when(r#"{"annotations":{"trace":"yes"}}"#).matches(&target(&ann, None, false)));
        assert!(!when(r#"{"annotations":{"^trace$":"yes"}}"#).matches(&target(&ann, None, false)));
        assert!(!when(r#"{"annotations":{"trace":"^no"}}"#).matches(&target(&ann, None, false)));
        // All conditions must hold.
        assert!(
            !when(r#"{"always":true,"annotations":{"missing":".*"}}"#)
                .matches(&target(&ann, None, false))
        );
        assert!(when(r#"{"hasBindMounts":true}"#).matches(&target(&none, None, true)));
        assert!(!when(r#"{"hasBindMounts":true}"#).matches(&target(&none, None, false)));
        assert!(!when(r#"{"hasBindMounts":false}"#).matches(&target(&none, None, false)));
        // Commands decide once the rest passed; they match args[0].
        assert!(when(r#"{"commands":["nginx$"]}"#).matches(&target(&none, Some(&args), false)));
        assert!(!when(r#"{"commands":["^-g$"]}"#).matches(&target(&none, Some(&args), false)));
        assert!(
            when(r#"{"annotations":{"trace":""},"commands":["nginx"]}"#).matches(&target(
                &ann,
                Some(&args),
                false
            ))
        );
        assert!(
            !when(r#"{"annotations":{"nope":""},"commands":["nginx"]}"#).matches(&target(
                &ann,
                Some(&args),
                false
            ))
        );
        // Without a process, commands alone cannot match.
        assert!(!when(r#"{"commands":["nginx"]}"#).matches(&target(&none, None, false)));
    }

    #[test]
    fn bad_files_are_reported_by_name_and_the_rest_load_in_order() {
        let a = tempfile::tempdir().expect("tempdir");
        let b = tempfile::tempdir().expect("tempdir");
        let good = |stage: &str| {
            format!(
                r#"{{"version":"1.0.0","hook":{{"path":"/bin/true"}},"when":{{"always":true}},"stages":["{stage}"]}}"#
            )
        };
        let w = |d: &Path, n: &str, s: &str| std::fs::write(d.join(n), s).expect("write");
        w(a.path(), "20-b.json", &good("prestart"));
        w(a.path(), "10-A.json", &good("poststop"));
        w(
            a.path(),
            "30-over.json",
            r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"when":{"always":false},"stages":["prestart"]}"#,
        );
        w(b.path(), "30-over.json", &good("createRuntime"));
        w(a.path(), "notes.txt", "ignored");
        w(a.path(), "40-json.json", "{ not json");
        w(
            a.path(),
            "50-missing.json",
            r#"{"version":"1.0.0","hook":{"path":"/nonexistent/hook"},"when":{"always":true},"stages":["prestart"]}"#,
        );
        w(
            a.path(),
            "60-regex.json",
            r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"when":{"commands":["("]},"stages":["prestart"]}"#,
        );
        w(
            a.path(),
            "70-stage.json",
            r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"when":{"always":true},"stages":["postmortem"]}"#,
        );
        w(
            a.path(),
            "80-version.json",
            r#"{"version":"2.0.0","hook":{"path":"/bin/true"},"when":{"always":true},"stages":["prestart"]}"#,
        );
        w(
            a.path(),
            "90-nowhen.json",
            r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"stages":["prestart"]}"#,
        );
        let l = load_dirs(&[
            a.path().to_path_buf(),
            b.path().to_path_buf(),
            PathBuf::from("/nonexistent"),
        ]);
        let names: Vec<&str> = l.hooks.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["10-A.json", "20-b.json", "30-over.json"]);
        assert_eq!(
            l.hooks[2].stages,
            [Stage::CreateRuntime],
            "the later directory wins"
        );
        assert!(l.errors.iter().all(|e| e.path().parent() == Some(a.path())));
        let mut bad: Vec<String> = l
            .errors
            .iter()
            .map(|e| {
                let chain = Chain(e).to_string();
                chain[a.path().as_os_str().len() + 1..].to_owned()
            })
            .collect();
        bad.sort();
        assert_eq!(bad.len(), 6, "{bad:?}");
        assert!(
            bad[0].starts_with("40-json.json: invalid JSON: key must be a string"),
            "{bad:?}"
        );
        assert!(
            bad[1].starts_with("50-missing.json: hook.path /nonexistent/hook: No such file"),
            "{bad:?}"
        );
        assert!(
            bad[2].starts_with(
                "60-regex.json: when.commands[0]: invalid regex \"(\": regex parse error"
            ),
            "{bad:?}"
        );
        assert_eq!(
            bad[3],
            "70-stage.json: stages[0]: unknown stage \"postmortem\""
        );
        assert!(
            bad[4].starts_with("80-version.json: version: \"2.0.0\" is not"),
            "{bad:?}"
        );
        assert!(
            bad[5].starts_with("90-nowhen.json: when: no condition"),
            "{bad:?}"
        );
    }

    /// `parse_file`'s refusal of `json`, without the file's name (checked).
    fn refusal(json: &str) -> String {
        let path = Path::new("/etc/containers/oci/hooks.d/x.json");
        let e = parse_file(json.as_bytes(), path).expect_err(json);
        assert_eq!(e.path(), path);
        let message = e.to_string();
        assert!(!message.contains('\n'), "one line: {message:?}");
        message
            .strip_prefix("/etc/containers/oci/hooks.d/x.json: ")
            .unwrap_or_else(|| panic!("names the file: {message:?}"))
            .to_owned()
    }

    #[test]
    fn refusals_of_a_1_0_0_file_name_the_field() {
        let file = |hook: &str, when: &str, stages: &str| {
            format!(r#"{{"version":"1.0.0","hook":{hook},"when":{when},"stages":{stages}}}"#)
        };
        let ok_hook = r#"{"path":"/bin/true"}"#;
        let ok_when = r#"{"always":true}"#;
        let ok_stages = r#"["prestart"]"#;
        let cases = [
            (
                r#"{"version":1}"#.to_owned(),
                "version: expected a string, found a number",
            ),
            (
                r#"{"version":"1.0.0","when":{"always":true},"stages":["prestart"]}"#.to_owned(),
                "hook: missing",
            ),
            (
                file(r#""/bin/true""#, ok_when, ok_stages),
                "hook: expected an object, found a string",
            ),
            (file("{}", ok_when, ok_stages), "hook.path: missing"),
            (
                file(r#"{"path":"bin/true"}"#, ok_when, ok_stages),
                r#"hook.path: "bin/true" is not absolute"#,
            ),
            (
                file(
                    r#"{"path":"/bin/true","args":["true",1]}"#,
                    ok_when,
                    ok_stages,
                ),
                "hook.args[1]: expected a string, found a number",
            ),
            (
                file(r#"{"path":"/bin/true","env":"A=1"}"#, ok_when, ok_stages),
                "hook.env: expected an array of strings, found a string",
            ),
            (
                file(r#"{"path":"/bin/true","timeout":0}"#, ok_when, ok_stages),
                "hook.timeout: 0 is not greater than zero",
            ),
            (
                file(r#"{"path":"/bin/true","timeout":1.5}"#, ok_when, ok_stages),
                "hook.timeout: 1.5 is not a 64-bit integer",
            ),
            (
                file(ok_hook, r#"{"always":"yes"}"#, ok_stages),
                "when.always: expected true or false, found a string",
            ),
            (
                file(ok_hook, r#"{"annotations":{"a":1}}"#, ok_stages),
                r#"when.annotations["a"]: expected a string, found a number"#,
            ),
            (
                file(ok_hook, r#"{"annotations":{"a":"("}}"#, ok_stages),
                r#"when.annotations["a"]: invalid regex "(""#,
            ),
            (
                file(ok_hook, r#"{"annotations":{"(":"a"}}"#, ok_stages),
                r#"when.annotations: invalid regex "(""#,
            ),
            (
                file(ok_hook, r#"{"commands":["a","b","("]}"#, ok_stages),
                r#"when.commands[2]: invalid regex "(""#,
            ),
            (
                file(ok_hook, r#"{"commands":[]}"#, ok_stages),
                "when: no condition (set at least one of always, annotations, commands, hasBindMounts)",
            ),
            (
                r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"when":{"always":true}}"#
                    .to_owned(),
                "stages: missing",
            ),
            (
                file(ok_hook, ok_when, "[]"),
                "stages: empty (the hook would never run)",
            ),
            (
                file(ok_hook, ok_when, r#"["prestart",7]"#),
                "stages[1]: expected a string, found a number",
            ),
            (
                file(ok_hook, ok_when, r#"["prestart","postmortem"]"#),
                r#"stages[1]: unknown stage "postmortem""#,
            ),
        ];
        for (json, want) in cases {
            assert_eq!(refusal(&json), want, "{json}");
        }
        // A well-formed file: args, env and timeout kept.
        let h = parse_file(
            file(
                r#"{"path":"/bin/true","args":["true","-x"],"env":["A=1"],"timeout":3}"#,
                ok_when,
                r#"["poststop","prestart"]"#,
            )
            .as_bytes(),
            Path::new("/x.json"),
        )
        .expect("valid");
        assert_eq!(
            h.hook.args().as_deref(),
            Some(&["true".to_owned(), "-x".to_owned()][..])
        );
        assert_eq!(h.hook.env().as_deref(), Some(&["A=1".to_owned()][..]));
        assert_eq!(h.hook.timeout(), Some(3));
        assert_eq!(h.stages, [Stage::Poststop, Stage::Prestart]);
    }

    #[test]
    fn messages_name_the_file_and_leave_the_cause_to_the_chain() {
        let path = Path::new("/etc/containers/oci/hooks.d/x.json");
        let e = parse_file(b"{ not json", path).expect_err("invalid");
        let cause = std::error::Error::source(&e)
            .expect("serde's error")
            .to_string();
        assert_eq!(e.to_string(), format!("{}: invalid JSON", path.display()));
        let chain = Chain(&e).to_string();
        assert_eq!(chain, format!("{}: invalid JSON: {cause}", path.display()));
        assert_eq!(chain.matches(&cause).count(), 1, "{chain}");
        assert_eq!(e.path(), path);
    }

    #[test]
    fn hook_paths_are_checked_where_the_hook_runs() {
        // A DaemonSet: the host at `root`, the hook at a host path.
        let root = tempfile::tempdir().expect("root");
        std::fs::create_dir_all(root.path().join("opt/lk-test-hooks")).expect("dirs");
        std::fs::write(root.path().join("opt/lk-test-hooks/trace"), "").expect("hook");
        let dir = tempfile::tempdir().expect("hooks.d");
        let file = dir.path().join("10-trace.json");
        std::fs::write(
            &file,
            r#"{"version":"1.0.0","hook":{"path":"/opt/lk-test-hooks/trace"},"when":{"always":true},"stages":["prestart"]}"#,
        )
        .expect("write");
        assert!(
            matches!(load_file(&file), Err(LoadError::HookPath { hook_path, .. })
                if hook_path == Path::new("/opt/lk-test-hooks/trace")),
            "not here"
        );
        let h = load_file_under(root.path(), &file).expect("under the host root");
        assert_eq!(
            h.hook.path(),
            Path::new("/opt/lk-test-hooks/trace"),
            "kept a host path"
        );
        let dirs = HooksDirs::with_hook_root(vec![dir.path().to_path_buf()], root.path().into());
        assert_eq!(dirs.loaded.hooks.len(), 1);
    }

    #[test]
    fn hook_paths_follow_the_hosts_absolute_symlinks() {
        // Found on a Debian guest (cargo xtask vm-test): the host's
        // `/bin/sh` is a link to `/bin/busybox`, which the agent's own root
        // does not have. The link is the host's: read under the host root.
        let root = tempfile::tempdir().expect("root");
        std::fs::create_dir_all(root.path().join("usr/bin")).expect("dirs");
        // A directory this machine does not have, so that a check against
        // this process's root cannot pass by chance.
        std::fs::create_dir_all(root.path().join("lk-host-only")).expect("dirs");
        std::fs::write(root.path().join("lk-host-only/busybox"), "").expect("busybox");
        std::os::unix::fs::symlink("usr/bin", root.path().join("bin")).expect("merged /bin");
        std::os::unix::fs::symlink("/lk-nowhere/busybox", root.path().join("usr/bin/gone"))
            .expect("dangling");
        std::os::unix::fs::symlink("/lk-host-only/busybox", root.path().join("usr/bin/sh"))
            .expect("sh");
        let dir = tempfile::tempdir().expect("hooks.d");
        let file = |name: &str, path: &str| {
            let f = dir.path().join(name);
            std::fs::write(
                &f,
                format!(
                    r#"{{"version":"1.0.0","hook":{{"path":"{path}"}},"when":{{"always":true}},"stages":["prestart"]}}"#
                ),
            )
            .expect("write");
            f
        };
        let h = load_file_under(root.path(), &file("sh.json", "/bin/sh")).expect("resolved");
        assert_eq!(h.hook.path(), Path::new("/bin/sh"), "kept the host path");
        // A link to nothing on the host is still refused.
        assert!(matches!(
            load_file_under(root.path(), &file("gone.json", "/usr/bin/gone")),
            Err(LoadError::HookPath { .. })
        ));
    }

    #[test]
    fn directories_reload_when_a_file_changes() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut dirs = HooksDirs::new(vec![d.path().to_path_buf()]);
        assert!(dirs.current().hooks.is_empty());
        std::fs::write(
            d.path().join("a.json"),
            r#"{"version":"1.0.0","hook":{"path":"/bin/true"},"when":{"always":true},"stages":["poststop"]}"#,
        )
        .expect("write");
        assert_eq!(dirs.current().hooks.len(), 1);
        std::fs::remove_file(d.path().join("a.json")).expect("rm");
        assert!(dirs.current().hooks.is_empty());
    }
}
