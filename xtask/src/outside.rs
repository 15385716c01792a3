//! `cargo xtask outside`: builds crates outside this workspace that depend
//! on lookout's libraries the way another project would, with their own
//! feature choices:
//!
//! - lookout-informer with another Kubernetes version (k8s-openapi's
//!   `v1_33`, where the agent picks `latest`): a library that chose the
//!   version itself would make this fail in k8s-openapi's build script;
//! - lookout-probe, which is synchronous: no tokio in its dependency tree.
//!
//! The crates are written to `target/outside/` and built offline against
//! the packages this workspace already fetched.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

use crate::util::{cargo, exec, say, workspace_root};

#[derive(Debug, clap::Args)]
pub struct Options {}

fn write_crate(dir: &Path, name: &str, deps: &str, main: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            "[package]\nname = \"{name}\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
             # Not a member of lookout's workspace.\n[workspace]\n\n[dependencies]\n{deps}"
        ),
    )?;
    std::fs::write(dir.join("src/main.rs"), main)?;
    Ok(())
}

pub fn outside(_: &Options) -> anyhow::Result<()> {
    let root = workspace_root();
    let base = root.join("target/outside");
    let crates = root.join("crates");
    let target = base.join("target");

    // 1. The informer with another Kubernetes version.
    let informer = base.join("informer-v1-33");
    write_crate(
        &informer,
        "outside-informer",
        &format!(
            "lookout-informer = {{ path = \"{}\" }}\n\
             k8s-openapi = {{ version = \"0.29\", default-features = false, features = [\"v1_33\"] }}\n",
            crates.join("lookout-informer").display()
        ),
        "fn main() {\n    // The informer's types, built against Kubernetes 1.33's API.\n    \
         let _ = std::any::type_name::<lookout_informer::Config>();\n    \
         k8s_openapi::k8s_if_1_33! { println!(\"1.33\"); }\n}\n",
    )?;
    // The same resolution as the workspace (offline: no new downloads).
    std::fs::write(
        informer.join("Cargo.lock"),
        std::fs::read(root.join("Cargo.lock"))?,
    )?;
    exec(
        "outside",
        cargo()
            .current_dir(&informer)
            .args(["build", "-j2", "--offline", "--target-dir"])
            .arg(&target),
        "lookout-informer must not choose k8s-openapi's version feature (only the binary may)",
    )?;
    let out = Command::new(target.join("debug/outside-informer"))
        .output()
        .context("run outside-informer")?;
    if String::from_utf8_lossy(&out.stdout).trim() != "1.33" {
        bail!(
            "the outside crate did not build against Kubernetes 1.33: {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    say(
        "outside",
        "lookout-informer builds with k8s-openapi's v1_33, chosen by its user",
    );

    // 2. The probe, synchronous: no tokio.
    let probe = base.join("probe");
    write_crate(
        &probe,
        "outside-probe",
        &format!(
            "lookout-probe = {{ path = \"{}\" }}\n",
            crates.join("lookout-probe").display()
        ),
        "fn main() {\n    let _ = lookout_probe::ProbeOptions::default();\n}\n",
    )?;
    std::fs::write(
        probe.join("Cargo.lock"),
        std::fs::read(root.join("Cargo.lock"))?,
    )?;
    let tree = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .current_dir(&probe)
        .args(["tree", "--offline", "-e", "normal", "--prefix", "none"])
        .output()
        .context("cargo tree")?;
    if !tree.status.success() {
        bail!("cargo tree: {}", String::from_utf8_lossy(&tree.stderr));
    }
    let tree = String::from_utf8_lossy(&tree.stdout);
    let crates_in_tree = tree.lines().count();
    if let Some(l) = tree.lines().find(|l| l.starts_with("tokio ")) {
        bail!("lookout-probe pulls tokio into its users' trees: {l}");
    }
    exec(
        "outside",
        cargo()
            .current_dir(&probe)
            .args(["build", "-j2", "--offline", "--target-dir"])
            .arg(&target),
        "see the compiler error above",
    )?;
    say(
        "outside",
        &format!("lookout-probe builds without tokio ({crates_in_tree} lines in its normal tree)"),
    );
    Ok(())
}
