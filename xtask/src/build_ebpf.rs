//! `cargo xtask build-ebpf`: the agent's BPF object and the example consumer's.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::util::{exec, output, say, workspace_root};

/// The bpf-linker release that works with the preinstalled nightly (see
/// docs/ebpf.md).
const BPF_LINKER_VERSION: &str = "0.13.0";
const STEP: &str = "build-ebpf";

#[derive(Debug, clap::Args)]
pub struct Options {
    /// The nightly toolchain to build with.
    #[arg(long, default_value = "nightly")]
    pub toolchain: String,
}

/// Where installed tools are cached: `$LOOKOUT_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/lookout`, else `~/.cache/lookout`.
pub(crate) fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LOOKOUT_CACHE_DIR") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("lookout");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/lookout")
}

/// The object path the agent embeds.
pub fn object_path() -> PathBuf {
    workspace_root().join("target/bpf/lookout-ebpf.o")
}

/// The object path `lookout-example-execs` embeds.
pub fn example_execs_object_path() -> PathBuf {
    workspace_root().join("target/bpf/lookout-example-execs.o")
}

/// One BPF crate of the repository: where it is, the binary it builds and
/// where the object goes.
struct BpfCrate {
    /// Directory under the workspace root.
    dir: &'static str,
    /// Its `[[bin]]` name: the file cargo writes.
    bin: &'static str,
    /// Where the object is copied to.
    dest: PathBuf,
}

/// Builds the BPF objects: the agent's (`target/bpf/lookout-ebpf.o`, whose
/// path it returns) and the example consumer's
/// (`target/bpf/lookout-example-execs.o`).
pub fn build_ebpf(opts: &Options) -> anyhow::Result<PathBuf> {
    let tc = &opts.toolchain;
    ensure_toolchain(tc)?;
    let linker_dir = ensure_bpf_linker(tc)?;
    let agent = BpfCrate {
        dir: "crates/lookout-ebpf",
        bin: "lookout-ebpf",
        dest: object_path(),
    };
    let example = BpfCrate {
        dir: "crates/lookout-example-execs-ebpf",
        bin: "lookout-example-execs-ebpf",
        dest: example_execs_object_path(),
    };
    build_crate(tc, &linker_dir, &agent)?;
    build_crate(tc, &linker_dir, &example)?;
    Ok(agent.dest)
}

/// Builds one BPF crate and copies its object to `krate.dest` if it changed.
///
/// Every crate builds into the same `target/ebpf` with the same flags and
/// profiles, so `-Z build-std=core` and aya-ebpf are compiled once for all
/// of them.
fn build_crate(tc: &str, linker_dir: &Path, krate: &BpfCrate) -> anyhow::Result<()> {
    let root = workspace_root();
    let crate_dir = root.join(krate.dir);
    let target_dir = root.join("target/ebpf");
    let path = std::env::join_paths(std::iter::once(linker_dir.to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .context("building PATH")?;
    say(STEP, &format!("building {}", krate.dir));
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&crate_dir)
        .arg(format!("+{tc}"))
        .args([
            "build",
            "-Z",
            "build-std=core",
            "--target",
            "bpfel-unknown-none",
            "--release",
        ])
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", &target_dir)
        // BTF lets the kernel verify and pretty-print our maps.
        .env("RUSTFLAGS", "-C debuginfo=2 -C link-arg=--btf")
        // Variables from the outer (stable) cargo would pin the wrong toolchain.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("CARGO_ENCODED_RUSTFLAGS");
    exec(
        STEP,
        &mut cmd,
        &format!(
            "read the compiler error above; {} must build with `cargo +nightly build -Z build-std=core --target bpfel-unknown-none`",
            krate.dir
        ),
    )?;

    let built = target_dir
        .join("bpfel-unknown-none/release")
        .join(krate.bin);
    let bytes = std::fs::read(&built)
        .with_context(|| format!("step '{STEP}': reading {}", built.display()))?;
    let dest = &krate.dest;
    std::fs::create_dir_all(dest.parent().unwrap_or(Path::new(".")))
        .context("creating target/bpf")?;
    // Only rewrite on change, so the binaries that embed it are not rebuilt
    // for nothing.
    if std::fs::read(dest).ok().as_deref() != Some(&bytes[..]) {
        std::fs::write(dest, &bytes).with_context(|| format!("writing {}", dest.display()))?;
    }
    say(
        STEP,
        &format!("BPF object: {} ({} bytes)", dest.display(), bytes.len()),
    );
    Ok(())
}

pub(crate) fn ensure_toolchain(tc: &str) -> anyhow::Result<()> {
    let list = output(Command::new("rustup").args(["toolchain", "list"]))
        .context("step 'find rustup': rustup is not on PATH (install rustup: the BPF build needs a nightly toolchain)")?;
    if !list
        .lines()
        .any(|l| l.starts_with(&format!("{tc}-")) || l.starts_with(tc))
    {
        say(STEP, &format!("installing toolchain {tc} (once)"));
        exec(
            "install nightly",
            Command::new("rustup").args([
                "toolchain",
                "install",
                tc,
                "--profile",
                "minimal",
                "--component",
                "rust-src",
            ]),
            "install a nightly toolchain with `rustup toolchain install nightly --component rust-src`",
        )?;
    }
    let comps = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        tc,
    ]))
    .unwrap_or_default();
    if !comps.lines().any(|l| l.starts_with("rust-src")) {
        say(
            STEP,
            &format!("adding rust-src to {tc} (needed by -Z build-std=core)"),
        );
        exec(
            "install rust-src",
            Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", tc]),
            &format!("run `rustup component add rust-src --toolchain {tc}`"),
        )?;
    }
    Ok(())
}

/// Returns the directory holding a bpf-linker built against the toolchain's
/// own libLLVM, building it (once, ~75 s) into the cache if needed.
fn ensure_bpf_linker(tc: &str) -> anyhow::Result<PathBuf> {
    let sysroot = output(
        Command::new("rustc")
            .arg(format!("+{tc}"))
            .args(["--print", "sysroot"]),
    )
    .map(|s| PathBuf::from(s.trim()))
    .with_context(|| format!("step 'locate {tc}': `rustc +{tc} --print sysroot` failed"))?;
    let libllvm = std::fs::read_dir(sysroot.join("lib"))
        .with_context(|| format!("step 'find libLLVM': reading {}/lib", sysroot.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libLLVM.so.")))
        .with_context(|| {
            format!(
                "step 'find libLLVM': no libLLVM.so.* in {}/lib; fix: use a nightly that ships libLLVM (rustup's do)",
                sysroot.display()
            )
        })?;
    let file = libllvm
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_owned();
    // "libLLVM.so.22.1-rust-1.97.0-nightly" -> "22"
    let major = file
        .trim_start_matches("libLLVM.so.")
        .split(['.', '-'])
        .next()
        .filter(|m| m.chars().all(|c| c.is_ascii_digit()) && !m.is_empty())
        .with_context(|| format!("step 'find libLLVM': cannot read the LLVM version from {file}"))?
        .to_owned();

    let cache = cache_dir();
    // The linker is tied to this exact libLLVM: key the cache on its name.
    let key = file.trim_start_matches("libLLVM.so.");
    let root = cache.join(format!("bpf-linker-{BPF_LINKER_VERSION}-llvm-{key}"));
    let bin = root.join("bin");
    if bin.join("bpf-linker").is_file() {
        return Ok(bin);
    }
    say(
        STEP,
        &format!(
            "building bpf-linker {BPF_LINKER_VERSION} against {} into {} (once, about 75 s on 2 cores)",
            libllvm.display(),
            root.display()
        ),
    );
    let prefix = cache.join(format!("llvm-prefix-{key}"));
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    for name in ["libLLVM.so", file.as_str()] {
        let link = lib.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("step 'llvm prefix': symlinking {}", link.display()))?;
    }
    let status = exec(
        "install bpf-linker",
        Command::new("cargo")
            .arg(format!("+{tc}"))
            .args([
                "install",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
                "--locked",
                "--no-default-features",
            ])
            .args(["--features", &format!("llvm-{major}")])
            .arg("--root")
            .arg(&root)
            .env("LLVM_PREFIX", &prefix)
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("CARGO_TARGET_DIR"),
        &format!(
            "bpf-linker {BPF_LINKER_VERSION} must support feature llvm-{major}; check network access to crates.io \
             and that gcc is installed"
        ),
    );
    if let Err(e) = status {
        let _ = std::fs::remove_dir_all(&root);
        return Err(e);
    }
    if !bin.join("bpf-linker").is_file() {
        bail!(
            "step 'install bpf-linker': cargo install succeeded but {} is missing",
            bin.display()
        );
    }
    Ok(bin)
}
