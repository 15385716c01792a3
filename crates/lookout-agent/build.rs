//! Embeds the BPF object that `cargo xtask build-ebpf` produced.
//!
//! The object is looked for at `$LOOKOUT_EBPF_OBJECT`, else at
//! `<workspace>/target/bpf/lookout-ebpf.o`. When it is missing the agent
//! still builds: it embeds an empty object, and `lookout probe` reports
//! `bpf:object unsupported`.

use std::path::PathBuf;

fn main() {
    println!("cargo::rerun-if-env-changed=LOOKOUT_EBPF_OBJECT");
    let manifest = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let default = manifest.join("../../target/bpf/lookout-ebpf.o");
    let source = std::env::var_os("LOOKOUT_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or(default);
    // Watch the directory too, so an object that appears later triggers a
    // rebuild even when the file did not exist at the last build.
    println!("cargo::rerun-if-changed={}", source.display());
    if let Some(dir) = source.parent().filter(|d| d.is_dir()) {
        println!("cargo::rerun-if-changed={}", dir.display());
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("lookout-ebpf.o");
    match std::fs::read(&source) {
        Ok(bytes) => {
            std::fs::write(&out, bytes).expect("write OUT_DIR/lookout-ebpf.o");
        }
        Err(_) => {
            println!(
                "cargo::warning=BPF object {} not found; building lookout without it (run `cargo xtask build-ebpf`)",
                source.display()
            );
            std::fs::write(&out, []).expect("write OUT_DIR/lookout-ebpf.o");
        }
    }
}
