//! A Debian release's kernel, runc, crun and busybox for one
//! architecture, fetched from Debian's archive with a private apt
//! configuration (cached, never installed).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use serde_json::{Value, json};

use crate::util::{exec, output, say};
use crate::{Arch, STEP};

/// The Debian packages a guest's root file system is made of (their
/// binaries and the libraries those load, nothing else).
pub(crate) const GUEST_PACKAGES: &[&str] = &["busybox-static", "runc", "crun"];

/// A Debian release's files for one architecture.
pub(crate) struct Debian {
    /// `boot/vmlinuz-*`.
    pub(crate) kernel: PathBuf,
    pub(crate) kernel_package: String,
    /// [`GUEST_PACKAGES`] and their dependencies, extracted (usr-merged).
    pub(crate) tree: PathBuf,
}

/// Fetches (cached) the kernel and [`GUEST_PACKAGES`] of `suite` for
/// `arch` with a private apt configuration: nothing is installed and this
/// machine's sources are not changed. Cached in `cache`'s `vm/`.
pub(crate) fn fetch(cache: &Path, suite: &str, arch: Arch) -> anyhow::Result<Debian> {
    let w = cache.join("vm").join(format!("{suite}-{}", arch.name()));
    let done = w.join("fetched.json");
    if let Ok(text) = std::fs::read_to_string(&done)
        && let Ok(v) = serde_json::from_str::<Value>(&text)
        && let (Some(k), Some(p)) = (v["kernel"].as_str(), v["kernel_package"].as_str())
    {
        return Ok(Debian {
            kernel: w.join(k),
            kernel_package: p.to_owned(),
            tree: w.join("tree"),
        });
    }
    say(
        STEP,
        &format!(
            "fetching Debian {suite} {} (kernel, runc, crun, busybox)",
            arch.name()
        ),
    );
    let _ = std::fs::remove_dir_all(&w);
    for d in [
        "lists/partial",
        "archives/partial",
        "state",
        "cache",
        "kernel",
    ] {
        std::fs::create_dir_all(w.join(d))?;
    }
    std::fs::write(w.join("status"), "")?;
    std::fs::write(
        w.join("sources.list"),
        format!("deb [arch={}] {} {suite} main\n", arch.name(), mirror()),
    )?;
    let apt = |tool: &str| {
        let mut c = Command::new(tool);
        c.current_dir(&w);
        for (k, v) in [
            ("Dir::Etc::sourcelist", w.join("sources.list")),
            ("Dir::Etc::sourceparts", "-".into()),
            ("Dir::State", w.join("state")),
            ("Dir::State::lists", w.join("lists")),
            ("Dir::State::status", w.join("status")),
            ("Dir::Cache", w.join("cache")),
            ("Dir::Cache::archives", w.join("archives")),
            ("APT::Architecture", arch.name().into()),
            ("APT::Architectures", arch.name().into()),
            ("APT::Get::List-Cleanup", "0".into()),
            ("APT::Sandbox::User", "root".into()),
            ("Debug::NoLocking", "1".into()),
        ] {
            c.arg("-o").arg(format!("{k}={}", Path::new(&v).display()));
        }
        c
    };
    let net = "check the network access to Debian's mirrors";
    exec(STEP, apt("apt-get").args(["update", "-q"]), net)?;
    // The cloud kernel's metapackage names the real one.
    let meta = format!("linux-image-cloud-{}", arch.name());
    let depends = output(apt("apt-cache").args(["depends", &meta]))
        .with_context(|| format!("apt-cache depends {meta} failed"))?;
    let kernel_package = depends
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .filter(|p| p.starts_with("linux-image-"))
        .with_context(|| format!("{meta} depends on no kernel:\n{depends}"))?
        .trim()
        .to_owned();
    exec(
        STEP,
        apt("apt-get")
            .current_dir(w.join("kernel"))
            .args(["download", "-q", &kernel_package]),
        net,
    )?;
    exec(
        STEP,
        apt("apt-get")
            .args([
                "install",
                "-y",
                "-q",
                "--download-only",
                "--no-install-recommends",
            ])
            .args(GUEST_PACKAGES)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        net,
    )?;
    let kdeb = debs(&w.join("kernel"))?
        .into_iter()
        .next()
        .context("apt-get download left no kernel package")?;
    exec(
        STEP,
        Command::new("dpkg-deb")
            .arg("-x")
            .arg(&kdeb)
            .arg(w.join("kernel/x")),
        "install dpkg",
    )?;
    let kernel = std::fs::read_dir(w.join("kernel/x/boot"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .context("the kernel package has no boot/vmlinuz-*")?;
    let tree = w.join("tree");
    for deb in debs(&w.join("archives"))? {
        exec(
            STEP,
            Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree),
            "install dpkg",
        )?;
    }
    usr_merge(&tree)?;
    let kernel_rel = kernel.strip_prefix(&w)?.to_string_lossy().into_owned();
    std::fs::write(
        &done,
        serde_json::to_vec(&json!({"kernel": kernel_rel, "kernel_package": kernel_package}))?,
    )?;
    Ok(Debian {
        kernel,
        kernel_package,
        tree,
    })
}

/// The mirror this machine's apt uses.
pub(crate) fn mirror() -> String {
    std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("URIs:"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "http://deb.debian.org/debian".into())
}

pub(crate) fn debs(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    v.sort();
    Ok(v)
}

/// Debian 11 and 12 packages put files in /bin and /lib, Debian 13's in
/// /usr: one tree where /bin, /sbin, /lib and /lib64 are links into /usr,
/// as on an installed system.
pub(crate) fn usr_merge(tree: &Path) -> anyhow::Result<()> {
    for d in ["bin", "sbin", "lib", "lib64"] {
        let top = tree.join(d);
        let under = tree.join("usr").join(d);
        std::fs::create_dir_all(&under)?;
        if top.is_symlink() {
            continue;
        }
        if top.is_dir() {
            exec(
                STEP,
                Command::new("cp").arg("-a").arg(top.join(".")).arg(&under),
                "install coreutils",
            )?;
            std::fs::remove_dir_all(&top)?;
        }
        std::os::unix::fs::symlink(format!("usr/{d}"), &top)?;
    }
    Ok(())
}
