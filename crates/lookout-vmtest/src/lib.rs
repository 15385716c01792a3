//! lookout's image on Debian's own kernels and on arm64, under QEMU (TCG:
//! nested KVM here cannot run stock kernels): what `cargo xtask vm-test`
//! runs, once the xtask has built the image and installed QEMU.
//!
//! Each guest ([`GUESTS`]) is one Debian release on one architecture: its
//! cloud kernel, its runc and crun, and its busybox, fetched from Debian's
//! archive with a private apt configuration (cached under
//! [`Paths::cache`], never installed). The agent is the image's own binary
//! and libraries (the archive's manifest for the guest's platform), run
//! chrooted with the guest's root at `/host`, as the DaemonSet runs it. The
//! guest (`vm/stage2.sh`) runs the probe, the agent in modes `auto`,
//! `fanotify` and `scan` with a consumer on the API and a hooks.d prestart
//! hook, and runc and crun containers that exit with known codes; it
//! prints everything between markers on its serial console, which [`run`]
//! checks. `--write-docs` writes docs/kernels.md from the run.

mod boot;
mod check;
mod debian;
mod kernels_md;
mod rootfs;
mod util;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::util::say;

/// Where a run finds the image and its cache, and writes its files.
#[derive(Debug, Clone)]
pub struct Paths {
    /// The image archive (`target/image/lookout.oci.tar`).
    pub archive: PathBuf,
    /// Where the report, serial logs and initramfs go (`target/vm-test`).
    pub out: PathBuf,
    /// The download cache; Debian's packages go in its `vm/`.
    pub cache: PathBuf,
    /// docs/kernels.md, written with `--write-docs`.
    pub kernels_md: PathBuf,
}

/// One guest of the matrix.
#[derive(Debug, Clone, Copy)]
pub struct Guest {
    /// `amd64-5.10`: what `--guest` takes.
    pub name: &'static str,
    /// Debian's release: its kernel, runc, crun and busybox.
    pub suite: &'static str,
    /// The guest's architecture.
    pub arch: Arch,
}

/// A guest's architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// x86-64.
    Amd64,
    /// AArch64.
    Arm64,
}

impl Arch {
    /// Debian's and OCI's name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }
}

/// The matrix: Debian 11, 12 and 13 on amd64, 12 and 13 on arm64.
pub const GUESTS: &[Guest] = &[
    Guest {
        name: "amd64-5.10",
        suite: "bullseye",
        arch: Arch::Amd64,
    },
    Guest {
        name: "amd64-6.1",
        suite: "bookworm",
        arch: Arch::Amd64,
    },
    Guest {
        name: "amd64-6.12",
        suite: "trixie",
        arch: Arch::Amd64,
    },
    Guest {
        name: "arm64-6.1",
        suite: "bookworm",
        arch: Arch::Arm64,
    },
    Guest {
        name: "arm64-6.12",
        suite: "trixie",
        arch: Arch::Arm64,
    },
];

/// What this machine needs to run the guests.
pub const HOST_PACKAGES: &[&str] = &["qemu-system-x86", "qemu-system-arm"];

pub(crate) const STEP: &str = "vm-test";

/// `cargo xtask vm-test`'s options (its flags).
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Only these guests (repeatable): amd64-5.10, amd64-6.1, amd64-6.12,
    /// arm64-6.1, arm64-6.12.
    #[arg(long = "guest", value_name = "NAME")]
    pub guests: Vec<String>,
    /// Write docs/kernels.md from this run's results.
    #[arg(long)]
    pub write_docs: bool,
    /// Longest a guest may run, in seconds.
    #[arg(long, default_value = "150")]
    pub timeout: u64,
    /// Do not build the image: use target/image/lookout.oci.tar as it is.
    #[arg(long)]
    pub no_build: bool,
    /// More kernel command-line arguments (`lsm=...`, to find which part
    /// of a kernel a failure comes from).
    #[arg(long, value_name = "ARGS", default_value = "")]
    pub kernel_args: String,
}

/// The guests `opts` chooses (`--guest`, or all of them); an unknown name
/// is an error that lists them.
pub fn guests(opts: &Options) -> anyhow::Result<Vec<Guest>> {
    Ok(if opts.guests.is_empty() {
        GUESTS.to_vec()
    } else {
        opts.guests
            .iter()
            .map(|n| {
                GUESTS
                    .iter()
                    .copied()
                    .find(|g| g.name == n)
                    .with_context(|| {
                        let names: Vec<_> = GUESTS.iter().map(|g| g.name).collect();
                        format!("no guest {n:?} (the guests: {})", names.join(", "))
                    })
            })
            .collect::<anyhow::Result<_>>()?
    })
}

/// Boots the guests `opts` chooses, each with the image archive at
/// `paths.archive`, and checks them; writes `report.json` (and the serial
/// logs) to `paths.out`, and with `--write-docs` `paths.kernels_md`. Fails
/// when a guest failed. The image must be built, and QEMU
/// ([`HOST_PACKAGES`]) installed.
pub fn run(opts: &Options, paths: &Paths) -> anyhow::Result<()> {
    let chosen = guests(opts)?;
    let (archive, out) = (&paths.archive, &paths.out);
    std::fs::create_dir_all(out)?;
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for guest in &chosen {
        let started = Instant::now();
        let result = run_guest(
            guest,
            paths,
            archive,
            out,
            Duration::from_secs(opts.timeout),
            &opts.kernel_args,
        );
        let secs = started.elapsed().as_secs_f64();
        match result {
            Ok(mut report) => {
                report["seconds"] = json!((secs * 10.0).round() / 10.0);
                let problems = report["problems"].as_array().map_or(0, Vec::len);
                let rss = report["modes"]["auto"]["memory_kb"]["VmRSS"]
                    .as_f64()
                    .map_or("?".to_owned(), |kb| format!("{:.1} MB", kb / 1024.0));
                say(
                    STEP,
                    &format!(
                        "{}: {} in {secs:.1} s ({} problems; the agent's RSS {rss})",
                        guest.name,
                        if problems == 0 { "ok" } else { "FAILED" },
                        problems
                    ),
                );
                if problems > 0 {
                    failed.push(guest.name);
                    for p in report["problems"].as_array().into_iter().flatten() {
                        say(
                            STEP,
                            &format!("  {}: {}", guest.name, p.as_str().unwrap_or("?")),
                        );
                    }
                }
                reports.push(report);
            }
            Err(e) => {
                say(
                    STEP,
                    &format!("{}: FAILED in {secs:.1} s: {e:#}", guest.name),
                );
                failed.push(guest.name);
                reports.push(json!({"guest": guest.name, "error": format!("{e:#}")}));
            }
        }
    }
    let report = json!({ "guests": reports });
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
    say(
        STEP,
        &format!("wrote {}", out.join("report.json").display()),
    );
    if opts.write_docs {
        let path = &paths.kernels_md;
        std::fs::write(path, kernels_md::kernels_md(&report))?;
        say(STEP, &format!("wrote {}", path.display()));
    }
    if !failed.is_empty() {
        bail!(
            "guests failed: {} (serial logs in {})",
            failed.join(", "),
            out.display()
        );
    }
    Ok(())
}

/// Boots one guest and checks what it printed.
fn run_guest(
    guest: &Guest,
    paths: &Paths,
    archive: &Path,
    out: &Path,
    timeout: Duration,
    kernel_args: &str,
) -> anyhow::Result<Value> {
    let debian = debian::fetch(&paths.cache, guest.suite, guest.arch)?;
    let tree = out.join(format!("{}.root", guest.name));
    let _ = std::fs::remove_dir_all(&tree);
    rootfs::assemble(guest, &debian, archive, &tree)?;
    let initrd = out.join(format!("{}.cpio", guest.name));
    std::fs::write(&initrd, rootfs::cpio(&tree)?)?;
    std::fs::remove_dir_all(&tree)?;
    let log = out.join(format!("{}.log", guest.name));
    say(
        STEP,
        &format!(
            "{}: booting {} (serial console in {})",
            guest.name,
            debian.kernel.display(),
            log.display()
        ),
    );
    boot::boot(guest, &debian.kernel, &initrd, &log, timeout, kernel_args)?;
    let text = std::fs::read(&log)?;
    let text = String::from_utf8_lossy(&text);
    let mut report = check::check(guest, &text);
    report["kernel_package"] = json!(debian.kernel_package);
    // Each runtime release's own state file, kept as it wrote it.
    let kept = out.join(format!("{}.state", guest.name));
    std::fs::create_dir_all(&kept)?;
    for (id, runtime) in [("rc-auto", "runc"), ("cr-auto", "crun")] {
        if let Some((body, Some(0))) = check::sections(&text).get(&format!("state.{id}")) {
            std::fs::write(kept.join(format!("{runtime}.json")), body.trim())?;
        }
    }
    Ok(report)
}
