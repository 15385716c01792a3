//! Source files over their size limit.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use syn::spanned::Spanned;

use crate::modules::{is_test, item_attributes};
use crate::workspace::{Workspace, list};
use crate::{Config, Error, Rule, Violation, read, relative};

/// Every file over its limit, and every size exception that no longer applies.
///
/// A file of tests alone (under a crate's `tests/`, or brought in by `#[cfg(test)] mod …;`)
/// is measured whole against the test limit; any other file by its lines outside
/// `#[cfg(test)]` items against the code limit.
pub(crate) fn check(
    root: &Path,
    workspace: &Workspace,
    test_files: &[PathBuf],
    config: &Config,
) -> Result<Vec<Violation>, Error> {
    let test_files: BTreeSet<&Path> = test_files.iter().map(PathBuf::as_path).collect();
    let mut violations = Vec::new();
    let mut seen = BTreeSet::new();
    for krate in &workspace.crates {
        let mut files = Vec::new();
        rust_files(&krate.dir, &krate.dir, &mut files)?;
        for file in files {
            let name = relative(root, &file);
            let key = name.to_string_lossy().replace('\\', "/");
            let tests_only = test_files.contains(file.as_path())
                || file
                    .strip_prefix(&krate.dir)
                    .is_ok_and(|p| p.starts_with("tests"));
            let source = read(&file)?;
            let (lines, limit, what) = if tests_only {
                (source.lines().count(), config.test_lines, "lines of tests")
            } else {
                (
                    code_lines(&source, &file)?,
                    config.code_lines,
                    "lines of code",
                )
            };
            let exception = config.sizes.iter().find(|e| e.name == key);
            seen.insert(key.clone());
            let message = match exception {
                None if lines > limit => format!(
                    "{lines} {what}, over the limit of {limit}: split it by concern (or, for a \
                     reason, add it to the size exceptions in the tidy test)"
                ),
                Some(e) if lines > e.lines => format!(
                    "{lines} {what}: it grew past its exception ({} lines: {}); split it",
                    e.lines, e.reason
                ),
                Some(e) if lines <= limit => format!(
                    "{lines} {what} fits the limit of {limit} now: remove its size exception \
                     ({})",
                    e.reason
                ),
                _ => continue,
            };
            violations.push(Violation {
                rule: Rule::FileSize,
                file: name,
                line: None,
                message,
            });
        }
    }
    for exception in config.sizes.iter().filter(|e| !seen.contains(&e.name)) {
        violations.push(Violation {
            rule: Rule::FileSize,
            file: PathBuf::from(&exception.name),
            line: None,
            message: format!(
                "a size exception names a file that is gone ({}): remove it",
                exception.reason
            ),
        });
    }
    Ok(violations)
}

/// The lines of `source` outside its top-level `#[cfg(test)]` items.
fn code_lines(source: &str, file: &Path) -> Result<usize, Error> {
    let ast = syn::parse_file(source).map_err(|source| Error::Parse {
        path: file.to_path_buf(),
        source,
    })?;
    let tests: usize = ast
        .items
        .iter()
        .filter(|item| is_test(item_attributes(item)))
        .map(|item| {
            let span = item.span();
            span.end().line + 1 - span.start().line
        })
        .sum();
    Ok(source.lines().count().saturating_sub(tests))
}

/// The `.rs` files under `dir`, leaving out build output, hidden directories and crates nested
/// in it (they are crates of their own).
fn rust_files(crate_dir: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), Error> {
    for path in list(dir)? {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            let nested_crate = path != crate_dir && path.join("Cargo.toml").is_file();
            if name != "target" && !name.starts_with('.') && !nested_crate {
                rust_files(crate_dir, &path, out)?;
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
    Ok(())
}
