//! The workspace's structure, checked like a test.
//!
//! lookout keeps its structure the way rust-analyzer keeps its own with `tidy.rs`: a test
//! (`tests/tidy.rs`) runs [`check`] on the repository, so `cargo test`, `cargo xtask test` and
//! CI fail on any [`Violation`], with the file and line to fix. The rules:
//!
//! | rule | fails on |
//! |---|---|
//! | [`Rule::ImportCircle`] | sibling modules of one crate that import each other, directly or round a loop |
//! | [`Rule::CrateArrow`] | a dependency between the workspace's crates that `docs/architecture.md` does not list, or a listed one that is gone |
//! | [`Rule::PublishedOnApi`] | a published crate that depends on `lookout-api` or `lookout-agent` (for its tests and examples too) |
//! | [`Rule::FileSize`] | a source file over its limit that [`Config::allow_size`] does not name, or a named one that grew or now fits |
//! | [`Rule::PathAttribute`] | a `#[path]` module |
//!
//! # Import circles
//!
//! For every module `m` of a crate (the crate root too), the check draws a graph over `m`'s
//! direct children: child `a` points at child `b` when code anywhere under `a` names a path
//! that leads under `b`, as `crate::b::…`, `super::b::…`, a `use` of either, a name that a
//! `use` or `pub use` brought in (`crate::Thing` where the root has `pub use b::Thing`), or a
//! sibling reached through `use super::*`. The graph must have no cycle. So every reference
//! between two modules counts once, at the level where their paths part: `run/api.rs` naming
//! `crate::hub::Hub` is an arrow `run -> hub` among the root's children.
//!
//! What does not count: a module naming its own ancestors or descendants (a child using its
//! parent's items, a parent using its children's), code under `#[cfg(test)]`, and paths inside
//! macro invocations other than `crate::…`, `super::…` and `self::…` ones. Every target is
//! its own tree: the library, binaries, examples, integration tests and build scripts.
//!
//! # Crate arrows
//!
//! `docs/architecture.md` holds, after a `<!-- tidy:arrows -->` line, a fenced block with one
//! line per crate of the workspace:
//!
//! ```text
//! lookout-host -> lookout-model
//! lookout-probe -> lookout-fanotify, lookout-host | lookout-testsupport
//! ```
//!
//! Left of `|` are the crates its code may use (`[dependencies]`, `[build-dependencies]`),
//! right of it those only its tests and examples may (`[dev-dependencies]`). The list is the
//! graph, not a ceiling: an arrow that is listed but no longer in a manifest fails too, so the
//! document stays a true picture.
//!
//! # Example
//!
//! ```no_run
//! let config = lookout_tidy::Config::new().allow_api("lookout-client", "the API's own client");
//! let violations = lookout_tidy::check(std::path::Path::new("."), &config)?;
//! for violation in &violations {
//!     eprintln!("{violation}");
//! }
//! # Ok::<(), lookout_tidy::Error>(())
//! ```

#![deny(missing_docs)]

use std::fmt;
use std::path::{Path, PathBuf};

mod arrows;
mod graph;
mod modules;
mod size;
mod workspace;

/// What a [`Violation`] breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Rule {
    /// Sibling modules of one crate import each other.
    ImportCircle,
    /// A dependency between the workspace's crates that `docs/architecture.md` does not list,
    /// or a listed arrow that no manifest has.
    CrateArrow,
    /// A published crate depends on one of the crates that [`Config::new`] keeps away from
    /// published crates (`lookout-api`, `lookout-agent`).
    PublishedOnApi,
    /// A source file over its size limit.
    FileSize,
    /// A `#[path]` module.
    PathAttribute,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rule::ImportCircle => "import-circle",
            Rule::CrateArrow => "crate-arrow",
            Rule::PublishedOnApi => "published-on-api",
            Rule::FileSize => "file-size",
            Rule::PathAttribute => "path-attribute",
        })
    }
}

/// One thing to fix: where, which rule, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The rule broken.
    pub rule: Rule,
    /// The file to fix, relative to the checked root.
    pub file: PathBuf,
    /// The line in `file`, when there is one.
    pub line: Option<usize>,
    /// What is wrong, with the evidence.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        write!(f, ": [{}] {}", self.rule, self.message)
    }
}

/// Why the check could not run (a tree it cannot read), as opposed to a [`Violation`] it found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or directory could not be read.
    #[error("reading {path}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A Rust source file does not parse.
    #[error("parsing {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's error (its span has the line).
        #[source]
        source: syn::Error,
    },
    /// A `Cargo.toml` does not parse, or lacks what the check needs.
    #[error("reading the manifest {path}")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// The cause.
        #[source]
        source: toml::de::Error,
    },
    /// The workspace's layout is not one the check understands.
    #[error("{path}: {message}")]
    Layout {
        /// The file that says so.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// An exception to a rule, with its reason.
#[derive(Debug, Clone)]
struct Exception {
    name: String,
    lines: usize,
    reason: String,
}

/// The limits and exceptions a check applies. [`Config::new`] has the defaults; the exceptions
/// are added one by one, each with its reason, so the list reads as a commented allowlist.
#[derive(Debug, Clone)]
pub struct Config {
    code_lines: usize,
    test_lines: usize,
    sizes: Vec<Exception>,
    api_crates: Vec<String>,
    api_users: Vec<Exception>,
    arrows_doc: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Self::new()
    }
}

impl Config {
    /// The defaults: 800 lines of code per file (its `#[cfg(test)]` items not counted), 1,200
    /// for a file of tests alone, `lookout-api` and `lookout-agent` kept away from published
    /// crates, and the arrows in `docs/architecture.md`.
    pub fn new() -> Self {
        Config {
            code_lines: 800,
            test_lines: 1200,
            sizes: Vec::new(),
            api_crates: vec!["lookout-api".into(), "lookout-agent".into()],
            api_users: Vec::new(),
            arrows_doc: PathBuf::from("docs/architecture.md"),
        }
    }

    /// The most lines of code a source file may have, its `#[cfg(test)]` items not counted.
    pub fn code_lines(mut self, lines: usize) -> Self {
        self.code_lines = lines;
        self
    }

    /// The most lines a file of tests alone may have (under `tests/`, or a module that only
    /// `#[cfg(test)]` brings in).
    pub fn test_lines(mut self, lines: usize) -> Self {
        self.test_lines = lines;
        self
    }

    /// Lets `file` (relative to the root) be over its limit, up to `lines`: it may shrink but not
    /// grow, and once it fits the limit the exception fails as stale.
    pub fn allow_size(mut self, file: &str, lines: usize, reason: &str) -> Self {
        self.sizes.push(Exception {
            name: file.into(),
            lines,
            reason: reason.into(),
        });
        self
    }

    /// Lets the published crate `krate` depend on the crates kept away from published ones.
    pub fn allow_api(mut self, krate: &str, reason: &str) -> Self {
        self.api_users.push(Exception {
            name: krate.into(),
            lines: 0,
            reason: reason.into(),
        });
        self
    }

    /// Where the arrow list is, relative to the root (`docs/architecture.md` by default).
    pub fn arrows_doc(mut self, path: impl Into<PathBuf>) -> Self {
        self.arrows_doc = path.into();
        self
    }
}

/// Checks the workspace at `root` (the directory of its top `Cargo.toml`) and returns every
/// violation, sorted by file and line. An empty list means the tree is tidy.
///
/// # Errors
///
/// [`Error`] when a manifest, source file or the arrow list cannot be read or parsed: the check
/// does not pass a tree it could not read.
pub fn check(root: &Path, config: &Config) -> Result<Vec<Violation>, Error> {
    let workspace = workspace::Workspace::read(root)?;
    let mut violations = Vec::new();
    let mut test_files = Vec::new();
    for krate in &workspace.crates {
        for target in &krate.targets {
            let tree = modules::Tree::read(root, target)?;
            violations.extend(tree.path_attributes());
            violations.extend(graph::circles(&krate.name, &tree.edges()));
            test_files.extend(tree.test_files);
        }
    }
    violations.extend(arrows::check(root, &workspace, config)?);
    violations.extend(size::check(root, &workspace, &test_files, config)?);
    violations.sort_by(|a, b| (&a.file, a.line, a.rule).cmp(&(&b.file, b.line, b.rule)));
    violations.dedup();
    Ok(violations)
}

/// The path of `path` relative to `root`, for messages.
fn relative(root: &Path, path: &Path) -> PathBuf {
    path.strip_prefix(root).unwrap_or(path).to_path_buf()
}

/// Reads a file to a string, with the path in the error.
fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: path.to_path_buf(),
        source,
    })
}
