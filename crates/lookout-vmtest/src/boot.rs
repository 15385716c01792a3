//! Booting a guest under QEMU (TCG), its serial console in a file.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::{Arch, Guest, HOST_PACKAGES};

/// Runs the guest to its power-off (or `timeout`), its console in `log`.
pub(crate) fn boot(
    guest: &Guest,
    kernel: &Path,
    initrd: &Path,
    log: &Path,
    timeout: Duration,
    kernel_args: &str,
) -> anyhow::Result<()> {
    let (mut cmd, console) = match guest.arch {
        Arch::Amd64 => {
            let mut c = Command::new("qemu-system-x86_64");
            c.args(["-accel", "tcg", "-cpu", "max"]);
            (c, "ttyS0")
        }
        Arch::Arm64 => {
            let mut c = Command::new("qemu-system-aarch64");
            c.args(["-M", "virt", "-cpu", "max,pauth-impdef=on"]);
            (c, "ttyAMA0")
        }
    };
    cmd.arg("-append")
        .arg(format!("console={console} quiet loglevel=1 panic=-1 {kernel_args}").trim_end());
    // One vCPU: with two, TCG guests of 6.1 hung in a soft lockup (both
    // vCPUs stuck in runc's first exec, before lookout ran), and one leaves
    // the second host core to the host.
    cmd.args(["-m", "1536", "-smp", "1", "-no-reboot", "-display", "none"])
        .args(["-monitor", "none", "-nic", "none"])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .stdin(Stdio::null());
    let mut child = cmd.spawn().with_context(|| {
        format!(
            "starting {:?} (install {HOST_PACKAGES:?})",
            cmd.get_program()
        )
    })?;
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("qemu exited with {status}");
            }
            return Ok(());
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the guest did not power off within {} s (see {})",
                timeout.as_secs(),
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
