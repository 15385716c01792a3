//! The arrows between crates: the manifests against the list in `docs/architecture.md`, and
//! published crates kept off the agent's wire API.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::workspace::{Kind, Workspace};
use crate::{Config, Error, Rule, Violation, read, relative};

/// The line before the list's fenced block.
const MARKER: &str = "<!-- tidy:arrows -->";

/// One crate's line of the list.
#[derive(Debug, Default)]
struct Allowed {
    line: usize,
    code: BTreeSet<String>,
    dev: BTreeSet<String>,
}

/// Every arrow violation of the workspace.
pub(crate) fn check(
    root: &Path,
    workspace: &Workspace,
    config: &Config,
) -> Result<Vec<Violation>, Error> {
    let doc_path = root.join(&config.arrows_doc);
    let doc = relative(root, &doc_path);
    let list = parse(&read(&doc_path)?, &doc_path)?;
    let names = workspace.names();
    let mut violations = Vec::new();
    let mut violation = |file: &Path, line: Option<usize>, rule: Rule, message: String| {
        violations.push(Violation {
            rule,
            file: file.to_path_buf(),
            line,
            message,
        });
    };

    for (name, allowed) in &list {
        if !names.contains(name.as_str()) {
            violation(
                &doc,
                Some(allowed.line),
                Rule::CrateArrow,
                format!("`{name}` is not a crate of the workspace: remove its line"),
            );
        }
    }
    for krate in &workspace.crates {
        let manifest = relative(root, &krate.manifest);
        let Some(allowed) = list.get(&krate.name) else {
            violation(
                &doc,
                None,
                Rule::CrateArrow,
                format!(
                    "`{}` has no line in the arrow list: add `{} -> …` with the crates it uses",
                    krate.name, krate.name
                ),
            );
            continue;
        };
        let ours = krate
            .dependencies
            .iter()
            .filter(|(name, _)| names.contains(name.as_str()));
        for (dependency, kind) in ours {
            let listed = match kind {
                Kind::Code => allowed.code.contains(dependency),
                Kind::Dev => allowed.code.contains(dependency) || allowed.dev.contains(dependency),
            };
            if !listed {
                let table = match kind {
                    Kind::Code => "[dependencies]",
                    Kind::Dev => "[dev-dependencies]",
                };
                violation(
                    &manifest,
                    None,
                    Rule::CrateArrow,
                    format!(
                        "{} depends on {dependency} ({table}), an arrow that {} does not \
                         allow: remove the dependency, or argue for the arrow there",
                        krate.name,
                        doc.display()
                    ),
                );
            }
        }
        for (listed, wanted) in [(&allowed.code, Kind::Code), (&allowed.dev, Kind::Dev)] {
            for dependency in listed {
                let why = match (krate.dependencies.get(dependency), wanted) {
                    // Listed as it is used; or its code uses what is listed for its tests
                    // only, reported above as an arrow the list does not allow.
                    (Some(Kind::Code), _) | (Some(Kind::Dev), Kind::Dev) => continue,
                    (Some(Kind::Dev), Kind::Code) => "only its tests use it: list it right of `|`",
                    (None, _) => "no manifest has it: remove it from the list",
                };
                violation(
                    &doc,
                    Some(allowed.line),
                    Rule::CrateArrow,
                    format!(
                        "the arrow {} -> {dependency} is listed, but {why}",
                        krate.name
                    ),
                );
            }
        }
    }

    for krate in workspace.crates.iter().filter(|c| c.published) {
        let exempt = config.api_users.iter().any(|e| e.name == krate.name);
        for dependency in &config.api_crates {
            if !exempt && krate.dependencies.contains_key(dependency) {
                violation(
                    &relative(root, &krate.manifest),
                    None,
                    Rule::PublishedOnApi,
                    format!(
                        "{} is published and depends on {dependency}: a crate that other \
                         projects reuse must not pull in the agent or its wire API (move what \
                         needs it into an unpublished crate)",
                        krate.name
                    ),
                );
            }
        }
    }
    for exception in &config.api_users {
        let needed = workspace.crates.iter().any(|c| {
            c.name == exception.name
                && c.published
                && config
                    .api_crates
                    .iter()
                    .any(|d| c.dependencies.contains_key(d))
        });
        if !needed {
            violation(
                &doc,
                None,
                Rule::PublishedOnApi,
                format!(
                    "the exception for {} ({}) is no longer needed: remove it",
                    exception.name, exception.reason
                ),
            );
        }
    }
    Ok(violations)
}

/// The list: one line per crate, `name -> code, crates | dev, crates`.
fn parse(text: &str, path: &Path) -> Result<BTreeMap<String, Allowed>, Error> {
    let layout = |line: usize, message: String| Error::Layout {
        path: path.to_path_buf(),
        message: format!("line {line}: {message}"),
    };
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim()));
    if !lines.any(|(_, l)| l == MARKER) {
        return Err(Error::Layout {
            path: path.to_path_buf(),
            message: format!("no `{MARKER}` line before the list of arrows between crates"),
        });
    }
    match lines.next() {
        Some((_, fence)) if fence.starts_with("```") => {}
        Some((n, _)) => return Err(layout(n, format!("a fenced block must follow `{MARKER}`"))),
        None => return Err(layout(0, format!("nothing follows `{MARKER}`"))),
    }
    let mut list = BTreeMap::new();
    for (n, line) in lines {
        if line.starts_with("```") {
            return Ok(list);
        }
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = line.split_once("->").ok_or_else(|| {
            layout(
                n,
                format!("`{line}`: expected `crate -> crate, … | crate, …`"),
            )
        })?;
        let (code, dev) = rest.split_once('|').unwrap_or((rest, ""));
        let names = |part: &str| -> BTreeSet<String> {
            part.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        };
        let allowed = Allowed {
            line: n,
            code: names(code),
            dev: names(dev),
        };
        if list.insert(name.trim().to_owned(), allowed).is_some() {
            return Err(layout(n, format!("`{}` has a second line", name.trim())));
        }
    }
    Err(Error::Layout {
        path: path.to_path_buf(),
        message: format!("the fenced block after `{MARKER}` is not closed"),
    })
}
