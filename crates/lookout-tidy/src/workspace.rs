//! The workspace's crates, as their manifests describe them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{Error, read};

/// The kind of a dependency, as the manifest's table names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    /// `[dependencies]` and `[build-dependencies]`: the crate's code uses it.
    Code,
    /// `[dev-dependencies]`: only its tests, examples and benches do.
    Dev,
}

/// One crate of the workspace.
#[derive(Debug)]
pub(crate) struct Crate {
    pub name: String,
    /// Its directory.
    pub dir: PathBuf,
    pub manifest: PathBuf,
    /// `publish = false` is not set.
    pub published: bool,
    /// Its dependencies by package name, with the strongest kind each is used as.
    pub dependencies: BTreeMap<String, Kind>,
    /// The root file of each target: library, binaries, examples, tests, benches, build script.
    pub targets: Vec<PathBuf>,
}

/// The crates of a workspace: its members and the crates it excludes (built on their own, as
/// the BPF programs and the fuzzers are).
#[derive(Debug)]
pub(crate) struct Workspace {
    pub crates: Vec<Crate>,
}

#[derive(Deserialize)]
struct RootManifest {
    workspace: Option<WorkspaceTable>,
}

#[derive(Deserialize)]
struct WorkspaceTable {
    #[serde(default)]
    members: Vec<String>,
    #[serde(default)]
    exclude: Vec<String>,
}

#[derive(Deserialize)]
struct Manifest {
    package: Package,
    #[serde(flatten)]
    dependencies: Tables,
    /// `[target.'cfg(…)'.dependencies]` and the like.
    #[serde(default)]
    target: BTreeMap<String, Tables>,
    lib: Option<TargetTable>,
    #[serde(default)]
    bin: Vec<TargetTable>,
    #[serde(default)]
    example: Vec<TargetTable>,
    #[serde(default)]
    test: Vec<TargetTable>,
    #[serde(default)]
    bench: Vec<TargetTable>,
}

#[derive(Deserialize)]
struct Package {
    name: String,
    publish: Option<toml::Value>,
}

/// The three dependency tables, at the top of a manifest or under a platform.
#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Tables {
    #[serde(default)]
    dependencies: BTreeMap<String, toml::Value>,
    #[serde(default)]
    build_dependencies: BTreeMap<String, toml::Value>,
    #[serde(default)]
    dev_dependencies: BTreeMap<String, toml::Value>,
}

#[derive(Deserialize)]
struct TargetTable {
    path: Option<PathBuf>,
}

impl Workspace {
    /// Reads `root/Cargo.toml` and the manifest of every member and excluded crate.
    pub fn read(root: &Path) -> Result<Self, Error> {
        let path = root.join("Cargo.toml");
        let manifest: RootManifest = parse(&path)?;
        let table = manifest.workspace.ok_or_else(|| Error::Layout {
            path: path.clone(),
            message: "no [workspace] table".into(),
        })?;
        let mut crates = Vec::new();
        for dir in table.members.iter().chain(&table.exclude) {
            if dir.contains(['*', '?', '[']) {
                return Err(Error::Layout {
                    path: path.clone(),
                    message: format!("`{dir}`: glob members are not supported; list each crate"),
                });
            }
            let dir = root.join(dir);
            if dir.join("Cargo.toml").is_file() {
                crates.push(Crate::read(&dir)?);
            }
        }
        crates.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Workspace { crates })
    }

    /// The names of its crates.
    pub fn names(&self) -> BTreeSet<&str> {
        self.crates.iter().map(|c| c.name.as_str()).collect()
    }
}

impl Crate {
    fn read(dir: &Path) -> Result<Self, Error> {
        let manifest_path = dir.join("Cargo.toml");
        let manifest: Manifest = parse(&manifest_path)?;
        let mut dependencies = BTreeMap::new();
        let mut add = |table: &BTreeMap<String, toml::Value>, kind: Kind| {
            for (key, value) in table {
                // `name = { package = "other" }` depends on `other`.
                let name = value
                    .get("package")
                    .and_then(toml::Value::as_str)
                    .unwrap_or(key);
                let entry = dependencies.entry(name.to_owned()).or_insert(kind);
                *entry = (*entry).min(kind);
            }
        };
        for tables in std::iter::once(&manifest.dependencies).chain(manifest.target.values()) {
            add(&tables.dependencies, Kind::Code);
            add(&tables.build_dependencies, Kind::Code);
            add(&tables.dev_dependencies, Kind::Dev);
        }
        let published = !matches!(manifest.package.publish, Some(toml::Value::Boolean(false)));
        let explicit = manifest
            .lib
            .iter()
            .chain(&manifest.bin)
            .chain(&manifest.example)
            .chain(&manifest.test)
            .chain(&manifest.bench)
            .filter_map(|t| t.path.as_ref().map(|p| dir.join(p)));
        let mut targets: BTreeSet<PathBuf> = explicit.collect();
        targets.extend(discovered_targets(dir)?);
        Ok(Crate {
            name: manifest.package.name,
            dir: dir.to_path_buf(),
            manifest: manifest_path,
            published,
            dependencies,
            targets: targets.into_iter().collect(),
        })
    }
}

/// The targets cargo finds by itself: `src/lib.rs`, `src/main.rs`, `build.rs`, and the files
/// (or `<name>/main.rs` directories) in `src/bin`, `examples`, `tests` and `benches`.
fn discovered_targets(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let mut targets: Vec<PathBuf> = ["src/lib.rs", "src/main.rs", "build.rs"]
        .iter()
        .map(|f| dir.join(f))
        .filter(|p| p.is_file())
        .collect();
    for sub in ["src/bin", "examples", "tests", "benches"] {
        let sub = dir.join(sub);
        if !sub.is_dir() {
            continue;
        }
        for entry in list(&sub)? {
            if entry.extension().is_some_and(|e| e == "rs") && entry.is_file() {
                targets.push(entry);
            } else if entry.join("main.rs").is_file() {
                targets.push(entry.join("main.rs"));
            }
        }
    }
    Ok(targets)
}

/// The entries of a directory, sorted.
pub(crate) fn list(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let entries = std::fs::read_dir(dir).map_err(|source| Error::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| Error::Read {
            path: dir.to_path_buf(),
            source,
        })?;
        paths.push(entry.path());
    }
    paths.sort();
    Ok(paths)
}

fn parse<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, Error> {
    toml::from_str(&read(path)?).map_err(|source| Error::Manifest {
        path: path.to_path_buf(),
        source,
    })
}
