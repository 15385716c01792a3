//! `cargo xtask run -- ARGS`.

use std::process::Command;

use crate::util::{cargo, exec, workspace_root};

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Build the agent in release mode.
    #[arg(long)]
    pub release: bool,
    /// Arguments for `lookout`, after `--`.
    #[arg(last = true)]
    pub args: Vec<String>,
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    crate::build_ebpf::build_ebpf(&crate::build_ebpf::Options {
        toolchain: "nightly".into(),
    })?;
    let mut build = cargo();
    build.args([
        "build",
        "-j2",
        "--package",
        "lookout-agent",
        "--bin",
        "lookout",
    ]);
    if opts.release {
        build.arg("--release");
    }
    exec("build", &mut build, "read the compiler error above")?;
    let profile = if opts.release { "release" } else { "debug" };
    let bin = workspace_root()
        .join("target")
        .join(profile)
        .join("lookout");
    let status = Command::new(&bin).args(&opts.args).status()?;
    std::process::exit(status.code().unwrap_or(1));
}
