//! The agent's build for one platform, as the image ships it: remapped
//! paths, v0 symbols, a second link with packed relocations and the
//! symbol-order list, its debug info split off.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use super::*;
use crate::util::{cargo, exec, output, say, workspace_root};

/// Builds the agent for `platform` in `target`, splits its debug info off
/// (`lookout[-ARCH].debug`, beside the archive for the main build) and
/// returns the stripped binary.
pub(super) fn compile(
    platform: &Platform,
    root: &Path,
    out: &Path,
    target: &Path,
    main: bool,
) -> anyhow::Result<PathBuf> {
    if let Some(prefix) = platform.cross {
        cross_toolchain(platform.triple, prefix)?;
    }
    let cargo_cmd = |subcommand: &str| agent_cargo(platform, root, target, subcommand);
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
    let lld = cross_lld.is_some() || crate::link_order::linked_by_lld(&binary);
    let nm = platform.tool("nm");
    // The start-up code laid out together (see link_order.rs). The list is
    // made on amd64; most of its functions are the same on arm64.
    let laid_out = laid_out(lld, &nm, &binary, target)?;
    // Link again, with the relative relocations packed (DT_RELR) when the
    // libc the image ships can load them, and with the start-up code laid
    // out together when lld links. Only the binary's own crate is compiled
    // again (about a second).
    let packed = packs_relocations(platform, lld)?;
    let link = link_args(platform, packed, cross_lld.as_deref(), laid_out.as_ref());
    if !link.is_empty() {
        exec(
            "image",
            cargo_cmd("rustc").arg("--").args(&link),
            "read the linker error above",
        )?;
    }
    if cross_lld.is_some() && !crate::link_order::linked_by_lld(&binary) {
        bail!(
            "{} was not linked by lld after -fuse-ld=lld: remove {} and build again",
            binary.display(),
            target.display()
        );
    }
    if let Some(order) = &laid_out
        && !crate::link_order::is_laid_out(&nm, &binary, &order.file)?
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

    split_debug(platform, &binary, if main { out } else { target })
}

/// The `cargo SUBCOMMAND` (build, or rustc to link again) of the agent for
/// `platform` in the tree `root`, with `target` as its target directory:
/// paths remapped, v0 symbols, the cross linker.
pub(super) fn agent_cargo(
    platform: &Platform,
    root: &Path,
    target: &Path,
    subcommand: &str,
) -> Command {
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
        crate::link_order::MANGLING.to_owned(),
    ]
    .join("\x1f");
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
}

/// The symbol-order list for the link of `binary` (see link_order.rs), if
/// lld links it and the list names functions of this build.
pub(super) fn laid_out(
    lld: bool,
    nm: &str,
    binary: &Path,
    target: &Path,
) -> anyhow::Result<Option<crate::link_order::LinkerOrder>> {
    Ok(if !lld {
        say(
            "image",
            "warning: not linked by lld: the start-up code is not laid out together \
         (idle RSS about 3 MB higher)",
        );
        None
    } else {
        match crate::link_order::linker_order(nm, binary, target)? {
            Some(order) if order.symbols == 0 => {
                say(
                    "image",
                    &format!(
                        "warning: {} names no function of this build: not laid out \
                     (run `sudo -E cargo xtask symbol-order`)",
                        crate::link_order::ORDER_FILE
                    ),
                );
                None
            }
            found => found,
        }
    })
}

/// The arguments of the second link: lld for a cross build that has it,
/// packed relocations where they load, the symbol-order list; warns of
/// what is left out.
pub(super) fn link_args(
    platform: &Platform,
    packed: bool,
    cross_lld: Option<&Path>,
    laid_out: Option<&crate::link_order::LinkerOrder>,
) -> Vec<String> {
    let mut link = Vec::new();
    if let Some(dir) = cross_lld {
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
    if let Some(order) = laid_out {
        say(
            "image",
            &format!(
                "{} functions laid out first ({} of the list's {} entries found)",
                order.symbols, order.keys_found, order.keys
            ),
        );
        // The list is made on amd64: arm64 builds find 87 % of it even
        // when it is fresh (functions of the other architecture's code).
        if platform.cross.is_none() && order.coverage() < crate::link_order::STALE_BELOW {
            say(
                "image",
                &format!(
                    "warning: {} is stale: {:.0} % of it names a function of this build \
                     (run `sudo -E cargo xtask symbol-order`; idle RSS grows as it ages)",
                    crate::link_order::ORDER_FILE,
                    100.0 * order.coverage()
                ),
            );
        }
        link.extend(crate::link_order::link_args(&order.file));
    }
    link
}

/// Splits `binary`'s debug info off into `beside` (`lookout[-ARCH].debug`,
/// linked by name and CRC) and returns the stripped binary.
pub(super) fn split_debug(
    platform: &Platform,
    binary: &Path,
    beside: &Path,
) -> anyhow::Result<PathBuf> {
    // The debug info stays beside the image, linked by name and CRC (the
    // same file name for every build: the link is part of the binary).
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
            .arg(binary)
            .arg(&debug),
        "install binutils (and the cross toolchain: cargo xtask test installs it)",
    )?;
    exec(
        "image",
        Command::new(&objcopy)
            .arg("--strip-all")
            .arg(format!("--add-gnu-debuglink={}", debug.display()))
            .arg(binary)
            .arg(&stripped),
        "install binutils",
    )?;
    Ok(stripped)
}

/// The linker flag that packs relative relocations into `.relr.dyn`
/// (DT_RELR): 8 bytes per run of up to 63 pointers instead of 24 per
/// pointer. The dynamic loader reads the table once at start-up, and those
/// pages (0.95 MB of `.rela.dyn` for the amd64 agent) stayed resident.
pub(super) const PACK_RELATIVE_RELOCS: &str = "-Wl,-z,pack-relative-relocs";

/// Whether `platform`'s binary can have packed relocations: the libc that
/// its image ships (this machine's, or the cross toolchain's) defines
/// `GLIBC_ABI_DT_RELR` (glibc 2.36 and later), and the linker that links
/// `binary` packs them: lld (`lld`), or the cross toolchain's GNU ld from
/// 2.41 for aarch64 (older ones take the flag and ignore it).
pub(super) fn packs_relocations(platform: &Platform, lld: bool) -> anyhow::Result<bool> {
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
pub(super) fn gnu_ld_packs_from(platform: &Platform) -> ((u32, u32), &'static str) {
    if platform.triple.starts_with("x86_64") {
        ((2, 38), "2.38")
    } else {
        ((2, 41), "2.41")
    }
}

/// The version of `ld --version`'s first line: "GNU ld (GNU Binutils for
/// Debian) 2.40".
pub(super) fn gnu_ld_version(text: &str) -> Option<(u32, u32)> {
    let last = text.lines().next()?.split_whitespace().last()?;
    let mut parts = last.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The directory of the toolchain's `ld.lld` (rustup's toolchains ship
/// rust-lld behind it, in `lib/rustlib/<host>/bin/gcc-ld`), for a gcc that
/// links with `-fuse-ld=lld -B<dir>`; `None` when the toolchain that builds
/// `root` has none (a distribution's rustc).
pub(super) fn rust_lld_dir(root: &Path) -> Option<PathBuf> {
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
pub(super) fn in_tree(program: &str, root: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(root);
    if root != workspace_root() {
        cmd.env_remove("RUSTUP_TOOLCHAIN");
    }
    cmd
}

/// Whether `binary` has a packed relocation table (a DT_RELR entry).
pub(super) fn has_packed_relocations(platform: &Platform, binary: &Path) -> anyhow::Result<bool> {
    let readelf = platform.tool("readelf");
    let text = output(Command::new(&readelf).args(["-d", "-W"]).arg(binary))
        .with_context(|| format!("{readelf} -d {} failed", binary.display()))?;
    Ok(text.lines().any(|l| l.contains("(RELR)")))
}

/// Makes sure rustup has `triple` and that the GNU cross tools `prefix-*`
/// are installed (with apt-get, as root).
pub(super) fn cross_toolchain(triple: &str, prefix: &str) -> anyhow::Result<()> {
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
            crate::util::install(CROSS_PACKAGES)?;
        } else {
            bail!(
                "{prefix}-gcc not found: install {CROSS_PACKAGES:?} (as root, cargo xtask image does)"
            );
        }
    }
    Ok(())
}
