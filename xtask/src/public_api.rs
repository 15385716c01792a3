//! `cargo xtask public-api [--bless] [-p CRATE]...`: the public API of every
//! published library crate, checked against a snapshot in
//! `xtask/public-api/<crate>.txt`, so that a change to a reused crate's API
//! shows up in review as a diff of that file, not by surprise in a user's
//! build.
//!
//! Each crate's rustdoc JSON is built with the nightly toolchain (the JSON
//! output is unstable) in `target/public-api`, apart from the stable build,
//! and rendered one item per line by the `public-api` crate: every public
//! path with its kind and signature, impls included (auto traits too, as
//! losing `Send` breaks users; blanket impls from std are left out as noise).
//!
//! The `public-api` release must read the JSON format the installed nightly
//! writes: [`rustdoc_types::FORMAT_VERSION`] is checked before parsing, so a
//! nightly update that changes the format fails with that message rather
//! than a parse error.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::util::{cargo, exec, output, say, workspace_root};

const STEP: &str = "public-api";

/// Libraries choose no Kubernetes version (k8s-openapi's rule); their docs
/// build with the one the agent picks, as .ci/run's per-crate checks do.
const K8S_OPENAPI_VERSION: &str = "1.37";

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Rewrite the snapshots from the code instead of comparing: for an API
    /// change that is meant.
    #[arg(long)]
    bless: bool,
    /// Only this crate (repeatable); by default every published library.
    #[arg(short = 'p', long = "package", value_name = "CRATE")]
    packages: Vec<String>,
    /// The nightly toolchain that writes rustdoc JSON.
    #[arg(long, default_value = "nightly")]
    toolchain: String,
}

/// A library crate of the workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Library {
    /// The package name (`lookout-model`): names the snapshot file.
    package: String,
    /// The lib target's name (`lookout_model`): names the JSON file.
    lib: String,
}

fn snapshot_dir() -> PathBuf {
    workspace_root().join("xtask/public-api")
}

pub fn public_api(opts: &Options) -> anyhow::Result<()> {
    let root = workspace_root();
    let all = libraries()?;
    let chosen: Vec<&Library> = if opts.packages.is_empty() {
        all.iter().collect()
    } else {
        opts.packages
            .iter()
            .map(|p| {
                all.iter().find(|l| &l.package == p).with_context(|| {
                    format!(
                        "{p} is not a published library of this workspace (those are: {})",
                        names(&all)
                    )
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    check_toolchain(&opts.toolchain)?;
    let dir = snapshot_dir();
    let target_dir = root.join("target/public-api");

    let mut failed = Vec::new();
    for lib in &chosen {
        let api = render(&rustdoc_json(lib, &opts.toolchain, &target_dir)?)?;
        let path = dir.join(format!("{}.txt", lib.package));
        if opts.bless {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            if std::fs::read_to_string(&path).ok().as_deref() != Some(api.as_str()) {
                std::fs::write(&path, &api)
                    .with_context(|| format!("writing {}", path.display()))?;
                say(STEP, &format!("{}: blessed {}", lib.package, rel(&path)));
            } else {
                say(STEP, &format!("{}: unchanged", lib.package));
            }
            continue;
        }
        let Ok(old) = std::fs::read_to_string(&path) else {
            say(
                STEP,
                &format!("{}: no snapshot {}", lib.package, rel(&path)),
            );
            failed.push(lib.package.clone());
            continue;
        };
        let changes = diff(&old, &api);
        if changes.is_empty() {
            say(
                STEP,
                &format!("{}: {} lines, as in the snapshot", lib.package, lines(&api)),
            );
        } else {
            eprintln!(
                "--- {} (snapshot)\n+++ {} (the code now)\n{}",
                rel(&path),
                lib.package,
                format_diff(&changes)
            );
            failed.push(lib.package.clone());
        }
    }

    // Snapshots of crates that are gone (or no longer published).
    if opts.packages.is_empty() {
        for stale in stale_snapshots(&dir, &all)? {
            if opts.bless {
                std::fs::remove_file(&stale)
                    .with_context(|| format!("removing {}", stale.display()))?;
                say(STEP, &format!("removed {}: no such library", rel(&stale)));
            } else {
                say(
                    STEP,
                    &format!("{} belongs to no published library", rel(&stale)),
                );
                failed.push(rel(&stale));
            }
        }
    }

    if !failed.is_empty() {
        bail!(
            "the public API differs from its snapshot for: {}.\n  \
             If the change is intended, rerun with --bless \
             (`cargo xtask public-api --bless`) and commit xtask/public-api/ with it: \
             the diff is what reviewers read. If not, the diff above shows what changed.",
            failed.join(", ")
        );
    }
    Ok(())
}

fn names(libs: &[Library]) -> String {
    libs.iter()
        .map(|l| l.package.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn rel(path: &Path) -> String {
    path.strip_prefix(workspace_root())
        .unwrap_or(path)
        .display()
        .to_string()
}

fn lines(s: &str) -> usize {
    s.lines().count()
}

/// The workspace's published library crates, from `cargo metadata`.
fn libraries() -> anyhow::Result<Vec<Library>> {
    let out = output(cargo().args(["metadata", "--no-deps", "--format-version", "1"]))
        .context("`cargo metadata` failed")?;
    let meta: serde_json::Value = serde_json::from_str(&out).context("parsing cargo metadata")?;
    libraries_in(&meta)
}

/// The members of `meta` (cargo metadata's JSON) that have a lib target and
/// may be published (`publish = false` reads as `"publish": []`), by name.
fn libraries_in(meta: &serde_json::Value) -> anyhow::Result<Vec<Library>> {
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .context("cargo metadata: no workspace_members")?
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    let mut libs = Vec::new();
    for p in meta["packages"]
        .as_array()
        .context("cargo metadata: no packages")?
    {
        let (Some(id), Some(name)) = (p["id"].as_str(), p["name"].as_str()) else {
            continue;
        };
        if !members.contains(id) || p["publish"].as_array().is_some_and(|a| a.is_empty()) {
            continue;
        }
        let lib = p["targets"].as_array().into_iter().flatten().find(|t| {
            t["kind"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| matches!(k.as_str(), Some("lib" | "rlib")))
        });
        if let Some(lib) = lib.and_then(|t| t["name"].as_str()) {
            libs.push(Library {
                package: name.to_owned(),
                lib: lib.to_owned(),
            });
        }
    }
    libs.sort_by(|a, b| a.package.cmp(&b.package));
    Ok(libs)
}

fn stale_snapshots(dir: &Path, libs: &[Library]) -> anyhow::Result<Vec<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut stale = Vec::new();
    for e in entries {
        let path = e?.path();
        let known = path
            .file_stem()
            .and_then(|s| s.to_str())
            .is_some_and(|s| libs.iter().any(|l| l.package == s));
        if path.extension().is_some_and(|x| x == "txt") && !known {
            stale.push(path);
        }
    }
    stale.sort();
    Ok(stale)
}

fn check_toolchain(tc: &str) -> anyhow::Result<()> {
    let version = output(Command::new("rustup").args(["run", tc, "rustdoc", "--version"]))
        .with_context(|| {
            format!(
                "step '{STEP}': no rustdoc in toolchain {tc} (rustdoc JSON needs a nightly; \
                 install it with `rustup toolchain install {tc} --profile minimal`)"
            )
        })?;
    say(STEP, &format!("rustdoc JSON from {}", version.trim()));
    Ok(())
}

/// Builds `lib`'s rustdoc JSON (all features: a feature-gated item is API
/// too) and returns its path.
fn rustdoc_json(lib: &Library, tc: &str, target_dir: &Path) -> anyhow::Result<PathBuf> {
    let mut cmd = Command::new("rustup");
    cmd.current_dir(workspace_root())
        .args([
            "run",
            tc,
            "cargo",
            "rustdoc",
            "-j2",
            "-q",
            "--lib",
            "--all-features",
        ])
        .args(["-p", &lib.package, "--target-dir"])
        .arg(target_dir)
        .args(["--", "-Z", "unstable-options", "--output-format", "json"])
        .args(["--cap-lints", "warn"])
        .env(
            "K8S_OPENAPI_ENABLED_VERSION",
            std::env::var_os("K8S_OPENAPI_ENABLED_VERSION")
                .unwrap_or_else(|| K8S_OPENAPI_VERSION.into()),
        )
        // Variables from the outer (stable) cargo would pin the wrong
        // toolchain or wrap its compiler.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTDOC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("CARGO_ENCODED_RUSTFLAGS");
    exec(
        STEP,
        &mut cmd,
        &format!(
            "read rustdoc's error above; `{tc}` must document {}",
            lib.package
        ),
    )?;
    Ok(target_dir.join("doc").join(format!("{}.json", lib.lib)))
}

/// The rustdoc JSON format version `json` says it is in, if it says.
fn format_version(json: &str) -> Option<u32> {
    // rustdoc writes it last; look from the end rather than parse it all.
    let key = "\"format_version\":";
    let at = json.rfind(key)? + key.len();
    let digits: String = json[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// The public API in `json` (a rustdoc JSON file), one item per line, in
/// the `public-api` crate's order (each item beside its parent), with a
/// final newline.
fn render(json: &Path) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let found = format_version(&text);
    if found != Some(rustdoc_types::FORMAT_VERSION) {
        bail!(
            "{} is in rustdoc JSON format {found:?}, and the public-api crate xtask uses reads \
             format {}: pin in xtask/Cargo.toml the public-api release whose rustdoc-types \
             reads this nightly's format (or use the nightly that matches), then rerun with \
             --bless (the rendering may change)",
            json.display(),
            rustdoc_types::FORMAT_VERSION
        );
    }
    let api = public_api::Builder::from_rustdoc_json(json)
        .omit_blanket_impls(true)
        .build()
        .with_context(|| format!("reading the public API in {}", json.display()))?;
    let mut out = String::new();
    for item in api.items() {
        out.push_str(&item.to_string());
        out.push('\n');
    }
    Ok(out)
}

/// The lines the code lost and gained against the snapshot, each sorted.
#[derive(Debug, Default, PartialEq, Eq)]
struct Diff<'a> {
    removed: Vec<&'a str>,
    added: Vec<&'a str>,
}

impl Diff<'_> {
    fn is_empty(&self) -> bool {
        self.removed.is_empty() && self.added.is_empty()
    }
}

/// The lines only in `old` and only in `new`, as multisets (a line twice in
/// one and once in the other is one change), so neither the files' order nor
/// blank lines matter.
fn diff<'a>(old: &'a str, new: &'a str) -> Diff<'a> {
    let sorted = |s: &'a str| {
        let mut v: Vec<&str> = s.lines().filter(|l| !l.is_empty()).collect();
        v.sort_unstable();
        v
    };
    let (old, new) = (sorted(old), sorted(new));
    let (mut i, mut j) = (0, 0);
    let mut d = Diff::default();
    loop {
        match (old.get(i), new.get(j)) {
            (None, None) => return d,
            (Some(a), Some(b)) if a == b => {
                i += 1;
                j += 1;
            }
            (Some(a), Some(b)) if a < b => {
                d.removed.push(a);
                i += 1;
            }
            (Some(a), None) => {
                d.removed.push(a);
                i += 1;
            }
            (_, Some(b)) => {
                d.added.push(b);
                j += 1;
            }
        }
    }
}

/// The removed lines as `-line`, then the added ones as `+line`, then a
/// count.
fn format_diff(d: &Diff<'_>) -> String {
    let mut s = String::new();
    for (sign, lines) in [('-', &d.removed), ('+', &d.added)] {
        for l in lines.iter() {
            s.push(sign);
            s.push_str(l);
            s.push('\n');
        }
    }
    s.push_str(&format!(
        "({} removed, {} added)",
        d.removed.len(),
        d.added.len()
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_lines_in_another_order_are_no_change() {
        assert!(diff("b\na\n", "a\nb").is_empty());
        assert!(diff("", "\n").is_empty());
    }

    fn d<'a>(removed: &[&'a str], added: &[&'a str]) -> Diff<'a> {
        Diff {
            removed: removed.to_vec(),
            added: added.to_vec(),
        }
    }

    #[test]
    fn removed_then_added_each_sorted() {
        let old = "pub fn m::f(u32)\npub struct m::S\npub mod m\npub fn m::z()\n";
        let new = "pub mod m\npub fn m::f(u64)\npub struct m::S\npub const m::C: u8\n";
        let changes = diff(old, new);
        assert_eq!(
            changes,
            d(
                &["pub fn m::f(u32)", "pub fn m::z()"],
                &["pub const m::C: u8", "pub fn m::f(u64)"]
            )
        );
        assert_eq!(
            format_diff(&changes),
            "-pub fn m::f(u32)\n-pub fn m::z()\n+pub const m::C: u8\n+pub fn m::f(u64)\n\
             (2 removed, 2 added)"
        );
    }

    #[test]
    fn duplicate_lines_count() {
        assert_eq!(diff("x\nx\n", "x\n"), d(&["x"], &[]));
        assert_eq!(diff("x\n", "x\nx\ny\n"), d(&[], &["x", "y"]));
    }

    #[test]
    fn format_version_is_read_from_the_end() {
        assert_eq!(
            format_version(r#"{"root":1,"format_version":57}"#),
            Some(57)
        );
        assert_eq!(format_version(r#"{"format_version": 60 }"#), Some(60));
        assert_eq!(format_version(r#"{"root":1}"#), None);
    }

    #[test]
    fn published_libraries_only() {
        let meta = serde_json::json!({
            "workspace_members": ["a 0.1", "b 0.1", "c 0.1", "d 0.1"],
            "packages": [
                {"id": "a 0.1", "name": "lookout-a", "publish": null,
                 "targets": [{"name": "lookout_a", "kind": ["lib"]}, {"name": "a", "kind": ["bin"]}]},
                {"id": "b 0.1", "name": "xtask", "publish": [],
                 "targets": [{"name": "xtask", "kind": ["lib"]}]},
                {"id": "c 0.1", "name": "tool", "publish": null,
                 "targets": [{"name": "tool", "kind": ["bin"]}]},
                {"id": "d 0.1", "name": "lookout-d", "publish": ["crates-io"],
                 "targets": [{"name": "d_lib", "kind": ["rlib"]}]},
                {"id": "e 0.1", "name": "dep", "publish": null,
                 "targets": [{"name": "dep", "kind": ["lib"]}]},
            ]
        });
        assert_eq!(
            libraries_in(&meta).expect("libraries"),
            vec![
                Library {
                    package: "lookout-a".into(),
                    lib: "lookout_a".into()
                },
                Library {
                    package: "lookout-d".into(),
                    lib: "d_lib".into()
                },
            ]
        );
    }
}
