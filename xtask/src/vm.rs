//! `cargo xtask vm-test`: installs QEMU (as root), builds the image (unless
//! `--no-build`), and boots it on Debian's own kernels and on arm64
//! (lookout-vmtest); writes target/vm-test/report.json.

use crate::util::workspace_root;

/// `cargo xtask vm-test`'s options: lookout-vmtest's.
pub type Options = lookout_vmtest::Options;

pub fn vm_test(opts: &Options) -> anyhow::Result<()> {
    // An unknown `--guest` fails before anything is installed or built.
    lookout_vmtest::guests(opts)?;
    if crate::util::is_root() {
        crate::util::install(lookout_vmtest::HOST_PACKAGES)?;
    }
    let root = workspace_root();
    if !opts.no_build {
        crate::image::build(&crate::image::Options::default(), "build")?;
    }
    lookout_vmtest::run(
        opts,
        &lookout_vmtest::Paths {
            archive: root.join("target/image/lookout.oci.tar"),
            out: root.join("target/vm-test"),
            cache: crate::build_ebpf::cache_dir(),
            kernels_md: root.join("docs/kernels.md"),
        },
    )
}
