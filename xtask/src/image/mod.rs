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

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::util::{cargo, exec, output, say, workspace_root};

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

/// Builds the agent for `platform` in `target`, splits its debug info off
/// (`lookout[-ARCH].debug`, beside the archive for the main build) and
/// returns the stripped binary.
fn compile(
    platform: &Platform,
    root: &Path,
    out: &Path,
    target: &Path,
    main: bool,
) -> anyhow::Result<PathBuf> {
    if let Some(prefix) = platform.cross {
        cross_toolchain(platform.triple, prefix)?;
    }
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cargo")
        });
    // Paths that end up in the binary (panic locations, debug info) are
    // the same whichever directory it was built in. rustc applies the last
    // matching prefix: the target directory (inside the workspace) last.
    let rustflags = [
        format!("--remap-path-prefix={}=/build/src", root.display()),
        format!("--remap-path-prefix={}=/cargo", cargo_home.display()),
        format!("--remap-path-prefix={}=/build/target", target.display()),
        crate::symbol_order::MANGLING.to_owned(),
    ]
    .join("\x1f");
    let cargo_cmd = |subcommand: &str| {
        let mut cmd = if root == workspace_root() {
            cargo()
        } else {
            // Another tree (`bench --against`): its own BPF object decides.
            let mut cmd = in_tree("cargo", root);
            cmd.env_remove("LOOKOUT_EBPF_OBJECT");
            cmd
        };
        cmd.args([subcommand, "-j2", "--release", "--locked"])
            .args(["-p", "lookout-agent", "--bin", "lookout"])
            .args(["--target", platform.triple])
            .arg("--target-dir")
            .arg(target)
            .env_remove("RUSTFLAGS")
            .env("CARGO_ENCODED_RUSTFLAGS", &rustflags);
        if let Some(prefix) = platform.cross {
            let t = platform.triple.replace('-', "_");
            cmd.env(
                format!("CARGO_TARGET_{}_LINKER", t.to_uppercase()),
                format!("{prefix}-gcc"),
            )
            .env(format!("CC_{t}"), format!("{prefix}-gcc"))
            .env(format!("AR_{t}"), format!("{prefix}-ar"));
        }
        cmd
    };
    exec(
        "image",
        &mut cargo_cmd("build"),
        "read the compiler error above",
    )?;
    let binary = target.join(platform.triple).join("release/lookout");
    // A cross build links with the GNU cross toolchain's gcc; where the
    // toolchain ships its own lld (rustup's do), the final link uses it, as
    // the native build does: it packs relocations for every architecture,
    // and takes the symbol-order list.
    let cross_lld = platform.cross.and_then(|_| rust_lld_dir(root));
    let lld = cross_lld.is_some() || crate::symbol_order::linked_by_lld(&binary);
    let nm = platform.tool("nm");
    // The start-up code laid out together (see symbol_order.rs). The list is
    // made on amd64; most of its functions are the same on arm64.
    let laid_out = if !lld {
        say(
            "image",
            "warning: not linked by lld: the start-up code is not laid out together \
             (idle RSS about 3 MB higher)",
        );
        None
    } else {
        match crate::symbol_order::linker_order(&nm, &binary, target)? {
            Some(order) if order.symbols == 0 => {
                say(
                    "image",
                    &format!(
                        "warning: {} names no function of this build: not laid out \
                         (run `sudo -E cargo xtask symbol-order`)",
                        crate::symbol_order::ORDER_FILE
                    ),
                );
                None
            }
            found => found,
        }
    };
    // Link again, with the relative relocations packed (DT_RELR) when the
    // libc the image ships can load them, and with the start-up code laid
    // out together when lld links. Only the binary's own crate is compiled
    // again (about a second).
    let packed = packs_relocations(platform, lld)?;
    let mut link = Vec::new();
    if let Some(dir) = &cross_lld {
        link.extend([
            "-C".to_owned(),
            "link-arg=-fuse-ld=lld".to_owned(),
            "-C".to_owned(),
            format!("link-arg=-B{}", dir.display()),
        ]);
    }
    if packed {
        link.extend(["-C".to_owned(), format!("link-arg={PACK_RELATIVE_RELOCS}")]);
    } else {
        let linker = match platform.cross {
            None => "lld".to_owned(),
            Some(prefix) => format!(
                "the toolchain's rust-lld, or {prefix}-ld {} or later",
                gnu_ld_packs_from(platform).1
            ),
        };
        say(
            "image",
            &format!(
                "warning: {} relocations not packed: it needs {linker}, and a glibc of 2.36 \
                 or later (idle RSS about 1 MB higher)",
                platform.arch,
            ),
        );
    }
    if let Some(order) = &laid_out {
        say(
            "image",
            &format!(
                "{} functions laid out first ({} of the list's {} entries found)",
                order.symbols, order.keys_found, order.keys
            ),
        );
        // The list is made on amd64: arm64 builds find 87 % of it even
        // when it is fresh (functions of the other architecture's code).
        if platform.cross.is_none() && order.coverage() < crate::symbol_order::STALE_BELOW {
            say(
                "image",
                &format!(
                    "warning: {} is stale: {:.0} % of it names a function of this build \
                     (run `sudo -E cargo xtask symbol-order`; idle RSS grows as it ages)",
                    crate::symbol_order::ORDER_FILE,
                    100.0 * order.coverage()
                ),
            );
        }
        link.extend(crate::symbol_order::link_args(&order.file));
    }
    if !link.is_empty() {
        exec(
            "image",
            cargo_cmd("rustc").arg("--").args(&link),
            "read the linker error above",
        )?;
    }
    if cross_lld.is_some() && !crate::symbol_order::linked_by_lld(&binary) {
        bail!(
            "{} was not linked by lld after -fuse-ld=lld: remove {} and build again",
            binary.display(),
            target.display()
        );
    }
    if let Some(order) = &laid_out
        && !crate::symbol_order::is_laid_out(&nm, &binary, &order.file)?
    {
        bail!(
            "{} was not linked with {}: remove {} and build again",
            binary.display(),
            order.file.display(),
            target.display()
        );
    }
    if packed && !has_packed_relocations(platform, &binary)? {
        bail!(
            "{} has no DT_RELR after linking with {PACK_RELATIVE_RELOCS}: remove {} and build again",
            binary.display(),
            target.display()
        );
    }

    // The debug info stays beside the image, linked by name and CRC (the
    // same file name for every build: the link is part of the binary).
    let beside = if main { out } else { target };
    let name = match platform.cross {
        None => "lookout".to_owned(),
        Some(_) => format!("lookout-{}", platform.arch),
    };
    let debug = beside.join(format!("{name}.debug"));
    let stripped = beside.join(format!("{name}.stripped"));
    let objcopy = platform.tool("objcopy");
    exec(
        "image",
        Command::new(&objcopy)
            .arg("--only-keep-debug")
            .arg(&binary)
            .arg(&debug),
        "install binutils (and the cross toolchain: cargo xtask test installs it)",
    )?;
    exec(
        "image",
        Command::new(&objcopy)
            .arg("--strip-all")
            .arg(format!("--add-gnu-debuglink={}", debug.display()))
            .arg(&binary)
            .arg(&stripped),
        "install binutils",
    )?;
    Ok(stripped)
}

/// The linker flag that packs relative relocations into `.relr.dyn`
/// (DT_RELR): 8 bytes per run of up to 63 pointers instead of 24 per
/// pointer. The dynamic loader reads the table once at start-up, and those
/// pages (0.95 MB of `.rela.dyn` for the amd64 agent) stayed resident.
const PACK_RELATIVE_RELOCS: &str = "-Wl,-z,pack-relative-relocs";

/// Whether `platform`'s binary can have packed relocations: the libc that
/// its image ships (this machine's, or the cross toolchain's) defines
/// `GLIBC_ABI_DT_RELR` (glibc 2.36 and later), and the linker that links
/// `binary` packs them: lld (`lld`), or the cross toolchain's GNU ld from
/// 2.41 for aarch64 (older ones take the flag and ignore it).
fn packs_relocations(platform: &Platform, lld: bool) -> anyhow::Result<bool> {
    let libc = match platform.cross {
        None => PathBuf::from(format!(
            "/lib/{}/libc.so.6",
            platform.triple.replace("-unknown", "")
        )),
        Some(prefix) => PathBuf::from(format!("/usr/{prefix}/lib/libc.so.6")),
    };
    let objdump = platform.tool("objdump");
    let text = output(Command::new(&objdump).arg("-p").arg(&libc))
        .with_context(|| format!("{objdump} -p {} failed", libc.display()))?;
    if !text.contains("GLIBC_ABI_DT_RELR") {
        return Ok(false);
    }
    // This machine's linker is whatever cargo's configuration picks (a
    // distribution's rustc may link with GNU ld, gold or mold): only lld is
    // taken to pack, so that a linker that rejects the flag costs memory,
    // not the build.
    if lld {
        return Ok(true);
    }
    let Some(prefix) = platform.cross else {
        return Ok(false);
    };
    // Without lld the cross build links with `{prefix}-gcc`, that is GNU ld.
    let version = output(Command::new(format!("{prefix}-ld")).arg("--version"))
        .and_then(|v| gnu_ld_version(&v))
        .unwrap_or((0, 0));
    Ok(version >= gnu_ld_packs_from(platform).0)
}

/// The first GNU ld release that packs relative relocations for
/// `platform`, and how to print it.
fn gnu_ld_packs_from(platform: &Platform) -> ((u32, u32), &'static str) {
    if platform.triple.starts_with("x86_64") {
        ((2, 38), "2.38")
    } else {
        ((2, 41), "2.41")
    }
}

/// The version of `ld --version`'s first line: "GNU ld (GNU Binutils for
/// Debian) 2.40".
fn gnu_ld_version(text: &str) -> Option<(u32, u32)> {
    let last = text.lines().next()?.split_whitespace().last()?;
    let mut parts = last.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The directory of the toolchain's `ld.lld` (rustup's toolchains ship
/// rust-lld behind it, in `lib/rustlib/<host>/bin/gcc-ld`), for a gcc that
/// links with `-fuse-ld=lld -B<dir>`; `None` when the toolchain that builds
/// `root` has none (a distribution's rustc).
fn rust_lld_dir(root: &Path) -> Option<PathBuf> {
    let rustc = |args: &[&str]| output(in_tree("rustc", root).args(args));
    let sysroot = rustc(&["--print", "sysroot"])?;
    let host = rustc(&["-vV"])?
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))?;
    let dir = Path::new(sysroot.trim())
        .join("lib/rustlib")
        .join(host)
        .join("bin/gcc-ld");
    dir.join("ld.lld").is_file().then_some(dir)
}

/// `program` (cargo, rustc) run in tree `root` with the toolchain that
/// builds it: this one's own, or, for another tree (`bench --against`),
/// the one its `rust-toolchain.toml` names.
fn in_tree(program: &str, root: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(root);
    if root != workspace_root() {
        cmd.env_remove("RUSTUP_TOOLCHAIN");
    }
    cmd
}

/// Whether `binary` has a packed relocation table (a DT_RELR entry).
fn has_packed_relocations(platform: &Platform, binary: &Path) -> anyhow::Result<bool> {
    let readelf = platform.tool("readelf");
    let text = output(Command::new(&readelf).args(["-d", "-W"]).arg(binary))
        .with_context(|| format!("{readelf} -d {} failed", binary.display()))?;
    Ok(text.lines().any(|l| l.contains("(RELR)")))
}

/// Makes sure rustup has `triple` and that the GNU cross tools `prefix-*`
/// are installed (with apt-get, as root).
fn cross_toolchain(triple: &str, prefix: &str) -> anyhow::Result<()> {
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"]))
        .is_some_and(|t| t.lines().any(|l| l.trim() == triple));
    if !installed {
        exec(
            "image",
            Command::new("rustup").args(["target", "add", triple]),
            "check the network access to static.rust-lang.org",
        )?;
    }
    if output(Command::new(format!("{prefix}-gcc")).arg("--version")).is_none() {
        if crate::util::is_root() {
            crate::test::install(CROSS_PACKAGES)?;
        } else {
            bail!(
                "{prefix}-gcc not found: install {CROSS_PACKAGES:?} (as root, cargo xtask image does)"
            );
        }
    }
    Ok(())
}

/// The files of `platform`'s layer: the binary, its libraries, the users
/// and the mount points.
fn layer_files(platform: &Platform, stripped: &Path) -> anyhow::Result<Files> {
    let mut files = Files::default();
    files.file(BINARY, 0o755, std::fs::read(stripped)?);
    let libs = shared_libraries(platform, stripped)?;
    // N.B. The agent does without libm: loading it costs about 0.45 MiB of
    // resident pages (docs/benchmarks.md, twelfth pass). Something that
    // calls a libm function (`f64::powf`, tokio's multi-thread scheduler)
    // brings it back; say so where the image is made.
    if let Some((lib, _)) = libs.iter().find(|(lib, _)| {
        lib.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libm.so"))
    }) {
        say(
            "image",
            &format!(
                "warning: the {} agent loads {} (about 0.45 MiB more resident memory); \
                 `nm -D --undefined-only` on it names what it takes from there",
                platform.arch,
                lib.display()
            ),
        );
    }
    for (lib, at) in libs {
        let bytes = std::fs::read(&lib).with_context(|| format!("reading {}", lib.display()))?;
        let path = at.to_str().context("library path is not UTF-8")?;
        files.file(path.trim_start_matches('/'), 0o755, bytes);
    }
    files.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
            .to_vec(),
    );
    files.file(
        "etc/group",
        0o644,
        b"root:x:0:\nnonroot:x:65532:\n".to_vec(),
    );
    // Mount points the DaemonSet uses, so that a read-only root needs no
    // new directory.
    for dir in [
        "host",
        "tmp",
        "run/lookout",
        "sys/kernel/tracing",
        "proc",
        "dev",
    ] {
        files.dir(dir, if dir == "tmp" { 0o1777 } else { 0o755 });
    }
    files.dir("home/nonroot", 0o755);
    Ok(files)
}

/// The commit's time, or `$SOURCE_DATE_EPOCH`.
fn source_date_epoch() -> u64 {
    if let Some(e) = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return e;
    }
    output(
        Command::new("git")
            .current_dir(workspace_root())
            .args(["log", "-1", "--format=%ct"]),
    )
    .and_then(|s| s.trim().parse().ok())
    .unwrap_or(0)
}

fn rfc3339(epoch: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(epoch))
        .to_string()
}

/// The shared libraries `binary` loads: where to read each, and where it
/// goes in the image. This machine's own from `ldd`; a cross-built
/// binary's from `readelf` (its `NEEDED` entries and interpreter) in the
/// cross toolchain's sysroot, placed where Debian's `libc6` of that
/// architecture has them.
fn shared_libraries(platform: &Platform, binary: &Path) -> anyhow::Result<Vec<(PathBuf, PathBuf)>> {
    let Some(prefix) = platform.cross else {
        let text = output(Command::new("ldd").arg(binary))
            .with_context(|| format!("ldd {} failed", binary.display()))?;
        let mut libs = Vec::new();
        for line in text.lines() {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)" or "linux-vdso.so.1 (0x...)".
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line.split_whitespace().next(),
            };
            if let Some(p) = path.filter(|p| p.starts_with('/')) {
                libs.push((PathBuf::from(p), PathBuf::from(p)));
            }
        }
        if libs.is_empty() {
            bail!("ldd found no library in {}:\n{text}", binary.display());
        }
        libs.sort();
        libs.dedup();
        return Ok(libs);
    };
    let sysroot = PathBuf::from(format!("/usr/{prefix}/lib"));
    let mut libs = Vec::new();
    let mut todo = vec![binary.to_path_buf()];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(file) = todo.pop() {
        let text = output(Command::new("readelf").args(["-d", "-l", "-W"]).arg(&file))
            .with_context(|| format!("readelf {} failed (install binutils)", file.display()))?;
        for line in text.lines() {
            if let Some(rest) = line.split("[Requesting program interpreter: ").nth(1) {
                let at = PathBuf::from(rest.trim_end_matches(']'));
                let name = at.file_name().context("interpreter path")?;
                if seen.insert(at.clone()) {
                    libs.push((sysroot.join(name), at));
                }
            }
            if line.contains("(NEEDED)")
                && let Some(name) = line.split('[').nth(1).map(|s| s.trim_end_matches(']'))
            {
                let from = sysroot.join(name);
                if !from.is_file() {
                    bail!(
                        "{} needs {name}, not in {}",
                        file.display(),
                        sysroot.display()
                    );
                }
                let at = PathBuf::from(format!("/lib/{prefix}/{name}"));
                if seen.insert(at.clone()) {
                    todo.push(from.clone());
                    libs.push((from, at));
                }
            }
        }
    }
    libs.sort();
    Ok(libs)
}

/// The layer's contents: path (no leading `/`) to entry, sorted.
#[derive(Default)]
pub struct Files(BTreeMap<String, Entry>);

enum Entry {
    Dir(u32),
    File(u32, Vec<u8>),
}

impl Files {
    /// A file (its parent directories are added, 0755).
    pub fn file(&mut self, path: &str, mode: u32, bytes: Vec<u8>) {
        self.parents(path);
        self.0.insert(path.to_owned(), Entry::File(mode, bytes));
    }

    /// A directory (and its parents).
    pub fn dir(&mut self, path: &str, mode: u32) {
        self.parents(path);
        self.0.insert(path.to_owned(), Entry::Dir(mode));
    }

    fn parents(&mut self, path: &str) {
        let mut p = Path::new(path).parent();
        while let Some(dir) = p.filter(|d| !d.as_os_str().is_empty()) {
            let key = dir.to_string_lossy().into_owned();
            self.0.entry(key).or_insert(Entry::Dir(0o755));
            p = dir.parent();
        }
    }
}

/// The layer as an uncompressed tar: sorted, owner 0:0, time `epoch`.
fn layer_tar(files: &Files, epoch: u64) -> anyhow::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    tar.mode(tar::HeaderMode::Deterministic);
    for (path, entry) in &files.0 {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(epoch);
        h.set_uid(0);
        h.set_gid(0);
        match entry {
            Entry::Dir(mode) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(*mode);
                h.set_size(0);
                tar.append_data(&mut h, format!("{path}/"), std::io::empty())?;
            }
            Entry::File(mode, bytes) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(bytes.len() as u64);
                tar.append_data(&mut h, path, bytes.as_slice())?;
            }
        }
    }
    Ok(tar.into_inner()?)
}

fn sha256(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    let mut s = String::with_capacity(7 + 64);
    s.push_str("sha256:");
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Writes the OCI image layout as a tar archive, one manifest per
/// platform under one index; returns the index's digest (the image's
/// identity, what a registry would record for the tag) and each platform's
/// manifest digest, in `images`' order.
pub fn write_archive(
    archive: &Path,
    images: &[(Platform, Files)],
    epoch: u64,
    reference: &str,
    labels: serde_json::Value,
) -> anyhow::Result<(String, Vec<String>)> {
    let created = rfc3339(epoch);
    let mut blobs = Files::default();
    let mut entries = Vec::new();
    let mut manifests = Vec::new();
    for (platform, files) in images {
        let layer = layer_tar(files, epoch)?;
        let diff_id = sha256(&layer);
        let mut gz = flate2::GzBuilder::new()
            .mtime(0)
            .write(Vec::new(), flate2::Compression::best());
        gz.write_all(&layer)?;
        let layer_gz = gz.finish()?;
        let mut config = json!({
            "architecture": platform.arch,
            "os": "linux",
            "created": created,
            "config": {
                "Entrypoint": [format!("/{BINARY}")],
                "Cmd": ["run"],
                "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
                "WorkingDir": "/",
                "Labels": labels,
            },
            "rootfs": { "type": "layers", "diff_ids": [diff_id] },
            "history": [{ "created": created, "created_by": "cargo xtask image" }],
        });
        let mut os_platform = json!({"architecture": platform.arch, "os": "linux"});
        if let Some(v) = platform.variant {
            config["variant"] = json!(v);
            os_platform["variant"] = json!(v);
        }
        let config = serde_json::to_vec(&config)?;
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": sha256(&config),
                "size": config.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": sha256(&layer_gz),
                "size": layer_gz.len(),
            }],
            "annotations": { "org.opencontainers.image.created": created },
        }))?;
        manifests.push(sha256(&manifest));
        entries.push(json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha256(&manifest),
            "size": manifest.len(),
            "platform": os_platform,
        }));
        for blob in [config, manifest, layer_gz] {
            let name = format!("blobs/sha256/{}", &sha256(&blob)["sha256:".len()..]);
            blobs.file(&name, 0o644, blob);
        }
    }
    // The image: an index of the platforms' manifests, as a registry
    // serves a multi-platform tag.
    let image_index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": entries,
    }))?;
    let digest = sha256(&image_index);
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": digest,
            "size": image_index.len(),
            "annotations": {
                "io.containerd.image.name": reference,
                "org.opencontainers.image.ref.name": reference.rsplit_once(':').map_or("latest", |(_, t)| t),
            },
        }],
    }))?;
    blobs.file(
        &format!("blobs/sha256/{}", &digest["sha256:".len()..]),
        0o644,
        image_index,
    );
    blobs.file(
        "oci-layout",
        0o644,
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    );
    blobs.file("index.json", 0o644, index);
    let tmp = archive.with_extension("tar.tmp");
    std::fs::write(&tmp, layer_tar(&blobs, epoch)?)?;
    std::fs::rename(&tmp, archive)?;
    Ok((digest, manifests))
}

#[cfg(test)]
mod tests {
    use super::*;

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
