//! `cargo xtask bench`: builds what the benchmark needs and runs it (the
//! measurements are lookout-bench's). Needs root. With `--against REV`,
//! builds REV's agent too, in a git worktree, as this tree's image builds
//! an agent.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

use crate::util::{cargo, exec, is_root, output, say, workspace_root};

/// `cargo xtask bench`'s options: lookout-bench's.
pub type Options = lookout_bench::Options;

/// The target directory the bench builds its agent in: the image's, so
/// that `cargo xtask image` and the bench share their build.
const IMAGE_TARGET: &str = "target/image/build";

pub fn bench(opts: &Options) -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "the benchmark needs root (fanotify permission events, BPF, runc): sudo -E cargo xtask bench"
        );
    }
    let root = workspace_root();
    let paths =
        lookout_bench::Paths::new(&root, crate::image::agent_binary(&root.join(IMAGE_TARGET)));
    let needs = lookout_bench::needs(opts)?;
    let Some(rev) = &opts.against else {
        build(needs)?;
        return lookout_bench::run(opts, &paths);
    };
    let sha = resolve(rev)?;
    let here = describe_head();
    build(needs)?;
    let theirs = build_revision(&sha)?;
    lookout_bench::run_against(opts, &paths, &theirs, &here, rev, &sha)
}

/// Builds what `needs` asks for: the BPF object and the agent as the image
/// builds it, then the floors and tools (always this tree's).
fn build(needs: lookout_bench::Needs) -> anyhow::Result<()> {
    if needs.agent {
        crate::build_ebpf::build_ebpf(&crate::build_ebpf::Options {
            toolchain: "nightly".into(),
        })?;
        // Built as the image builds it (the list, packed relocations):
        // the figures are those of the agent that ships.
        let root = workspace_root();
        crate::image::build_agent(&root, &root.join(IMAGE_TARGET))?;
    }
    for args in lookout_bench::release_builds(needs) {
        exec(
            "build",
            cargo().args(["build", "-j2", "--release"]).args(args),
            "see the compiler error above",
        )?;
    }
    Ok(())
}

/// `rev`'s full commit id.
fn resolve(rev: &str) -> anyhow::Result<String> {
    let out = output(
        Command::new("git")
            .current_dir(workspace_root())
            .args(["rev-parse", "--verify", "--quiet"])
            .arg(format!("{rev}^{{commit}}")),
    );
    match out.map(|s| s.trim().to_owned()) {
        Some(sha) if sha.len() == 40 => Ok(sha),
        _ => bail!("--against {rev}: not a commit in this repository (git rev-parse)"),
    }
}

/// HEAD's short id, with `+changes` when the tree differs from it.
fn describe_head() -> String {
    let git = |args: &[&str]| {
        output(Command::new("git").current_dir(workspace_root()).args(args)).unwrap_or_default()
    };
    let head = git(&["rev-parse", "--short=10", "HEAD"]);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])
        .trim()
        .is_empty();
    format!("{}{}", head.trim(), if dirty { "+changes" } else { "" })
}

/// Builds revision `sha`'s agent as the image builds one (once) and
/// returns its path.
fn build_revision(sha: &str) -> anyhow::Result<PathBuf> {
    let base = workspace_root().join("target/bench/against");
    let kept = base.join(format!("lookout-{sha}-image"));
    if kept.is_file() {
        say("bench", &format!("using {} (built before)", kept.display()));
        return Ok(kept);
    }
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let tree = base.join(sha);
    if !tree.join("Cargo.toml").is_file() {
        // A half-made worktree from an interrupted run: start over.
        let _ = std::fs::remove_dir_all(&tree);
        let _ = Command::new("git")
            .current_dir(workspace_root())
            .args(["worktree", "prune"])
            .status();
        exec(
            "bench",
            Command::new("git")
                .current_dir(workspace_root())
                .args(["worktree", "add", "--detach"])
                .arg(&tree)
                .arg(sha),
            "see git's message above",
        )?;
    }
    let target = base.join("target");
    let in_tree = |args: &[&str]| {
        let mut cmd = cargo();
        cmd.current_dir(&tree)
            .args(args)
            .env("CARGO_TARGET_DIR", &target)
            // The revision's own toolchain file decides, not ours.
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("LOOKOUT_EBPF_OBJECT");
        cmd
    };
    // Its own BPF object: the programs are part of what is compared.
    exec(
        "bench",
        &mut in_tree(&["xtask", "build-ebpf"]),
        "the revision's BPF object did not build; see above",
    )?;
    let object = tree.join("target/bpf/lookout-ebpf.o");
    if !object.is_file() {
        bail!(
            "{sha:.12}'s build-ebpf left no {}: its agent would embed no BPF programs",
            object.display()
        );
    }
    let built = crate::image::build_agent(&tree, &base.join("image-target"))
        .context("the revision's agent did not build; see above")?;
    lookout_testsupport::install_executable(&built, &kept)
        .with_context(|| format!("copying {} to {}", built.display(), kept.display()))?;
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn an_unknown_revision_is_refused_by_name() {
        let err = resolve("no-such-rev-29").expect_err("not a commit");
        assert!(
            err.to_string().contains("--against no-such-rev-29"),
            "{err}"
        );
    }

    #[test]
    fn the_paths_are_under_target_bench_against() {
        // The worktree and its target directory must stay out of the
        // scratch directory the benchmark empties.
        let paths = lookout_bench::Paths::new(&workspace_root(), PathBuf::new());
        let base = workspace_root().join("target/bench/against");
        assert!(!base.starts_with(&paths.work));
        assert!(Path::new(&base).starts_with(&paths.out_dir));
    }
}
