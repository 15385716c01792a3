//! `cargo xtask image`: the agent's OCI image, built with no registry, no
//! daemon and no base image, for `linux/amd64` and `linux/arm64` (one
//! image index, a manifest per platform).
//!
//! Each platform's image holds the stripped `lookout` binary (the BPF
//! object, the same for both, embedded), the glibc libraries it links, as
//! this machine's Debian packages ship them (arm64: Debian's cross
//! toolchain, `libc6-arm64-cross`, the same files as `libc6:arm64`), and `/etc/passwd` + `/etc/group` with `root` and `nonroot`
//! (65532). No shell, no package manager. Its layout follows
//! `deploy/Containerfile`, which stays the reference for CI systems that can
//! pull base images (docs/deploy.md compares the two).
//!
//! Reproducible: the binary is built in its own target directory with its
//! paths remapped (`--remap-path-prefix`), every file in the layer has the
//! commit's time, owner 0:0 and a fixed mode, entries are sorted, gzip has
//! no time stamp, and the JSON documents are written from fixed structures.
//! `--check` builds the amd64 agent a second time from scratch in another
//! target directory and fails unless that platform's manifest digest is the
//! same; `--check --every-platform` rebuilds arm64 too and compares the
//! index's digest. CI runs the amd64 check only: the arm64 agent comes from
//! the same sources, flags and remapped paths with another linker, and a
//! second cross build would cost CI five minutes of its hour.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use serde_json::json;

mod archive;
mod compile;

use archive::{layer_files, rfc3339, source_date_epoch, write_archive};
use compile::compile;

use crate::util::{output, say, workspace_root};

/// Where the binary lives in the image.
pub const BINARY: &str = "usr/local/bin/lookout";

/// A platform the image is built for.
#[derive(Debug, Clone, Copy)]
pub struct Platform {
    /// OCI's (and Debian's) architecture name.
    pub arch: &'static str,
    /// Rust's target.
    pub triple: &'static str,
    /// OCI's variant, when the architecture has one.
    variant: Option<&'static str>,
    /// The GNU cross tools' prefix; `None` builds with this machine's own.
    cross: Option<&'static str>,
}

impl Platform {
    /// The binutils program `name` for this platform: this machine's own,
    /// or the cross toolchain's `{prefix}-name`.
    fn tool(&self, name: &str) -> String {
        self.cross
            .map_or(name.to_owned(), |prefix| format!("{prefix}-{name}"))
    }
}

/// The image's platforms, in the index's order.
pub const PLATFORMS: &[Platform] = &[
    Platform {
        arch: "amd64",
        triple: "x86_64-unknown-linux-gnu",
        variant: None,
        cross: None,
    },
    Platform {
        arch: "arm64",
        triple: "aarch64-unknown-linux-gnu",
        variant: Some("v8"),
        cross: Some("aarch64-linux-gnu"),
    },
];

/// Debian packages that cross-build the arm64 agent.
pub const CROSS_PACKAGES: &[&str] = &["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"];

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Also build the amd64 agent a second time from scratch (another
    /// target directory) and fail unless its manifest digest is the same.
    #[arg(long)]
    pub check: bool,
    /// With --check: rebuild every platform, and compare the index's digest.
    #[arg(long, requires = "check")]
    pub every_platform: bool,
    /// The image name recorded in the archive (`ctr image import` uses it).
    #[arg(long, default_value = DEFAULT_NAME)]
    pub name: String,
}

const DEFAULT_NAME: &str = "ghcr.io/lookout-dev/lookout";

impl Default for Options {
    fn default() -> Self {
        Options {
            check: false,
            every_platform: false,
            name: DEFAULT_NAME.to_owned(),
        }
    }
}

/// What `cargo xtask image` made.
#[derive(Debug)]
pub struct Built {
    /// `target/image/lookout.oci.tar`.
    pub archive: PathBuf,
    /// The index's digest (`sha256:...`): the image's identity.
    pub digest: String,
    /// Each platform's manifest digest, in the index's order.
    pub manifests: Vec<(&'static str, String)>,
    /// Name and tag recorded in the archive.
    pub reference: String,
}

pub fn image(opts: &Options) -> anyhow::Result<()> {
    let built = build(opts, "build")?;
    println!("{}", built.archive.display());
    println!("{} {}", built.reference, built.digest);
    if opts.check {
        // From scratch: nothing of an earlier check may be reused.
        let check_dir = workspace_root().join("target/image/build-check");
        if check_dir.exists() {
            std::fs::remove_dir_all(&check_dir)
                .with_context(|| format!("removing {}", check_dir.display()))?;
        }
        let platforms = if opts.every_platform {
            PLATFORMS
        } else {
            &PLATFORMS[..1]
        };
        let again = build_platforms(opts, "build-check", platforms)?;
        anyhow::ensure!(!again.manifests.is_empty(), "the check built no platform");
        for (arch, digest) in &again.manifests {
            let first = built
                .manifests
                .iter()
                .find(|(a, _)| a == arch)
                .map(|(_, d)| d.as_str());
            if first != Some(digest.as_str()) {
                let name = if *arch == PLATFORMS[0].arch {
                    "lookout".to_owned()
                } else {
                    format!("lookout-{arch}")
                };
                bail!(
                    "the image is not reproducible: linux/{arch}'s manifest was {} then {digest} \
                     (compare target/image/{name}.stripped with \
                     target/image/build-check/{name}.stripped, e.g. with diffoscope)",
                    first.unwrap_or("missing"),
                );
            }
            say(
                "image",
                &format!(
                    "reproducible: a second linux/{arch} build from scratch gave its manifest {digest}"
                ),
            );
        }
        // Every platform rebuilt: the index (the image's identity) too.
        if opts.every_platform && again.digest != built.digest {
            bail!(
                "the image is not reproducible: the index was {} then {} (compare {} and {})",
                built.digest,
                again.digest,
                built.archive.display(),
                again.archive.display()
            );
        }
    }
    Ok(())
}

/// Builds the agent for every platform in `target/image/<target_dir>` and
/// the archive from them.
pub fn build(opts: &Options, target_dir: &str) -> anyhow::Result<Built> {
    build_platforms(opts, target_dir, PLATFORMS)
}

/// [`build`] for some of the platforms only.
fn build_platforms(
    opts: &Options,
    target_dir: &str,
    platforms: &[Platform],
) -> anyhow::Result<Built> {
    crate::build_ebpf::build_ebpf(&crate::build_ebpf::Options {
        toolchain: "nightly".into(),
    })?;
    let root = workspace_root();
    let out = root.join("target/image");
    let target = out.join(target_dir);
    std::fs::create_dir_all(&target)?;
    let epoch = source_date_epoch();
    let revision = output(
        Command::new("git")
            .current_dir(&root)
            .args(["rev-parse", "HEAD"]),
    )
    .map(|s| s.trim().to_owned())
    .unwrap_or_else(|| "unknown".into());
    let version = env!("CARGO_PKG_VERSION");
    let reference = format!("{}:{version}", opts.name);
    let labels = json!({
        "org.opencontainers.image.title": "lookout",
        "org.opencontainers.image.description":
            "Discovers every container on a Kubernetes node before its first instruction",
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.created": rfc3339(epoch),
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.source": "https://github.com/lookout-dev/lookout",
        "org.opencontainers.image.ref.name": reference,
    });
    let mut images = Vec::new();
    for platform in platforms {
        let stripped = compile(platform, &root, &out, &target, target_dir == "build")?;
        images.push((*platform, layer_files(platform, &stripped)?));
    }
    let archive_name = if target_dir == "build" {
        "lookout.oci.tar".to_owned()
    } else {
        format!("lookout-{target_dir}.oci.tar")
    };
    let archive = out.join(archive_name);
    let (digest, manifests) = write_archive(&archive, &images, epoch, &reference, labels)?;
    let size = std::fs::metadata(&archive)?.len();
    let manifests = platforms.iter().map(|p| p.arch).zip(manifests).collect();
    let platforms: Vec<String> = platforms
        .iter()
        .map(|p| format!("linux/{}", p.arch))
        .collect();
    say(
        "image",
        &format!(
            "{} ({:.1} MB, {}; debug info beside it): {reference} {digest}",
            archive.display(),
            size as f64 / 1e6,
            platforms.join(" and "),
        ),
    );
    Ok(Built {
        archive,
        digest,
        manifests,
        reference,
    })
}

/// Builds this machine's own platform's agent from the workspace at `root`
/// (this one, or another revision's worktree whose BPF object is built) as
/// the image builds it: v0 symbols, the start-up code laid out with this
/// tree's list, packed relocations. `target` is the target directory.
/// Returns the binary with its symbols (what the image strips), so that
/// the bench measures what ships and `perf` still names functions.
pub fn build_agent(root: &Path, target: &Path) -> anyhow::Result<PathBuf> {
    let platform = PLATFORMS
        .iter()
        .find(|p| p.cross.is_none())
        .context("no platform is built natively")?;
    if std::env::consts::ARCH != "x86_64" {
        bail!(
            "the image is built on an x86_64 machine (arm64 is cross-built); this is {}",
            std::env::consts::ARCH
        );
    }
    std::fs::create_dir_all(target).with_context(|| format!("creating {}", target.display()))?;
    compile(platform, root, target, target, false)?;
    Ok(agent_binary(target))
}

/// Where [`build_agent`] leaves the agent in target directory `target`.
pub fn agent_binary(target: &Path) -> PathBuf {
    target.join(PLATFORMS[0].triple).join("release/lookout")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use super::archive::*;
    use super::compile::*;

    #[test]
    fn gnu_ld_versions_are_read_from_the_first_line() {
        let debian = "GNU ld (GNU Binutils for Debian) 2.40\nCopyright (C) 2023\n";
        assert_eq!(gnu_ld_version(debian), Some((2, 40)));
        assert_eq!(
            gnu_ld_version("GNU ld version 2.41.50.20231016\n"),
            Some((2, 41))
        );
        assert_eq!(
            gnu_ld_version("LLD 19.1.7 (compatible with GNU linkers)"),
            None
        );
        assert_eq!(gnu_ld_version(""), None);
        assert!(gnu_ld_version(debian).unwrap() < gnu_ld_packs_from(&PLATFORMS[1]).0);
        assert!(gnu_ld_version(debian).unwrap() >= gnu_ld_packs_from(&PLATFORMS[0]).0);
    }

    fn image(order: &[(&str, &[u8])]) -> Vec<(Platform, Files)> {
        PLATFORMS
            .iter()
            .map(|p| {
                let mut f = Files::default();
                for (path, b) in order {
                    f.file(path, 0o644, b.to_vec());
                }
                (*p, f)
            })
            .collect()
    }

    #[test]
    fn one_index_names_a_manifest_per_platform() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("i.tar");
        let (top, manifests) =
            write_archive(&path, &image(&[("usr/bin/x", b"x")]), 7, "n:1", json!({}))
                .expect("archive");
        let mut blobs = BTreeMap::new();
        let mut tar = tar::Archive::new(std::fs::File::open(&path).expect("open"));
        for e in tar.entries().expect("entries") {
            let mut e = e.expect("entry");
            let name = e.path().expect("path").to_string_lossy().into_owned();
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut bytes).expect("read");
            blobs.insert(name, bytes);
        }
        let blob = |d: &str| -> serde_json::Value {
            serde_json::from_slice(&blobs[&format!("blobs/sha256/{}", &d["sha256:".len()..])])
                .expect("json blob")
        };
        let index: serde_json::Value =
            serde_json::from_slice(&blobs["index.json"]).expect("index.json");
        assert_eq!(
            index["manifests"][0]["digest"],
            top.as_str(),
            "the image is the index"
        );
        let listed = blob(&top)["manifests"]
            .as_array()
            .expect("manifests")
            .clone();
        let digests: Vec<&str> = listed
            .iter()
            .map(|m| m["digest"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(digests, manifests, "the manifests returned are the index's");
        let platforms = listed
            .iter()
            .map(|m| {
                let manifest = blob(m["digest"].as_str().expect("digest"));
                let config = blob(manifest["config"]["digest"].as_str().expect("config"));
                // The index's platform is the config's.
                assert_eq!(config["architecture"], m["platform"]["architecture"]);
                m["platform"]["architecture"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned()
            })
            .collect::<Vec<_>>();
        assert_eq!(platforms, ["amd64", "arm64"]);
    }

    #[test]
    fn the_archive_depends_on_contents_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = (dir.path().join("a.tar"), dir.path().join("b.tar"));
        let labels = || json!({"org.opencontainers.image.version": "1"});
        let one = write_archive(
            &a,
            &image(&[("usr/bin/x", b"x"), ("etc/y", b"y")]),
            7,
            "n:1",
            labels(),
        )
        .expect("a");
        // Another order of insertion: the same bytes.
        let two = write_archive(
            &b,
            &image(&[("etc/y", b"y"), ("usr/bin/x", b"x")]),
            7,
            "n:1",
            labels(),
        )
        .expect("b");
        assert_eq!(one, two);
        assert_eq!(std::fs::read(&a).expect("a"), std::fs::read(&b).expect("b"));
        // And a change of contents is a change of digest.
        let three = write_archive(
            &b,
            &image(&[("etc/y", b"z"), ("usr/bin/x", b"x")]),
            7,
            "n:1",
            labels(),
        )
        .expect("c");
        assert_ne!(one, three);
    }
}
