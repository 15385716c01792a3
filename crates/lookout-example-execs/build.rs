//! Embeds the BPF object that `cargo xtask build-ebpf` produced.
//!
//! The object is looked for at `$LOOKOUT_EXAMPLE_EXECS_OBJECT`, else at
//! `<workspace>/target/bpf/lookout-example-execs.o`. When it is missing the
//! example still builds: it embeds an empty object and says at run time
//! that it was built without one.
//!
//! `LOOKOUT_EXAMPLE_EXECS_OBJECT_BYTES` (the embedded object's size, `0`
//! when none) is set for every target of the package, so the tests know
//! whether the binary they run has its program.

use std::path::PathBuf;

fn main() {
    println!("cargo::rerun-if-env-changed=LOOKOUT_EXAMPLE_EXECS_OBJECT");
    let manifest = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let default = manifest.join("../../target/bpf/lookout-example-execs.o");
    let source = std::env::var_os("LOOKOUT_EXAMPLE_EXECS_OBJECT")
        .map(PathBuf::from)
        .unwrap_or(default);
    // Watch the directory too, so an object that appears later triggers a
    // rebuild even when the file did not exist at the last build.
    println!("cargo::rerun-if-changed={}", source.display());
    if let Some(dir) = source.parent().filter(|d| d.is_dir()) {
        println!("cargo::rerun-if-changed={}", dir.display());
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("lookout-example-execs.o");
    let bytes = match std::fs::read(&source) {
        Ok(bytes) => bytes,
        Err(_) => {
            println!(
                "cargo::warning=BPF object {} not found; building lookout-example-execs without it (run `cargo xtask build-ebpf`)",
                source.display()
            );
            Vec::new()
        }
    };
    std::fs::write(&out, &bytes).expect("write OUT_DIR/lookout-example-execs.o");
    println!(
        "cargo::rustc-env=LOOKOUT_EXAMPLE_EXECS_OBJECT_BYTES={}",
        bytes.len()
    );
}
