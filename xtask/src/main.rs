//! `cargo xtask`: lookout's build tasks. One module per subcommand.

mod bench;
mod build_ebpf;
mod fuzz;
mod image;
mod link_order;
mod outside;
mod public_api;
mod run;
mod symbol_order;
mod test;
mod util;
mod vm;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "lookout's build tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Build the BPF programs (nightly, build-std=core, BTF) into
    /// target/bpf/lookout-ebpf.o, and the example consumer's into
    /// target/bpf/lookout-example-execs.o, installing rust-src and bpf-linker
    /// if missing.
    BuildEbpf(build_ebpf::Options),
    /// Install what the tests need (as root), build the BPF programs, run all
    /// tests; with `--repeat N [FILTER]`, run them N times and report flakes.
    Test(test::Options),
    /// Build the BPF programs and the agent, then run `lookout ARGS`.
    Run(run::Options),
    /// Measure exec overhead, discovery latency, churn, memory and start-up
    /// (root); writes target/bench/report.json.
    Bench(bench::Options),
    /// Build the cargo-fuzz targets (nightly) and run each for `--time`
    /// seconds on its seeds, regressions and earlier finds; writes
    /// target/fuzz/report.json.
    Fuzz(fuzz::Options),
    /// Build the agent's OCI image archive (target/image/lookout.oci.tar)
    /// with no registry and no daemon; print its digest.
    Image(image::Options),
    /// Build crates outside the workspace against lookout's libraries with
    /// their own feature choices (another Kubernetes version; no tokio).
    Outside(outside::Options),
    /// Check each published library's public API (rustdoc JSON, nightly)
    /// against xtask/public-api/<crate>.txt; `--bless` rewrites them.
    PublicApi(public_api::Options),
    /// Run the agent with its binary out of the page cache and the disk's
    /// readahead off (root), and write the functions that start-up and a
    /// few containers touch to deploy/symbol-order.x86_64, which the
    /// image's link lays out together; `--check`: fail when that list no
    /// longer fits the code (CI).
    SymbolOrder(symbol_order::Options),
    /// Boot Debian's own kernels (5.10, 6.1, 6.12; amd64 and arm64) under
    /// QEMU and run the image's agent there against each release's runc
    /// and crun; writes target/vm-test/report.json.
    VmTest(vm::Options),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::BuildEbpf(o) => build_ebpf::build_ebpf(&o).map(|_| ()),
        Command::Test(o) => test::test(&o),
        Command::Run(o) => run::run(&o),
        Command::Bench(o) => bench::bench(&o),
        Command::Fuzz(o) => fuzz::fuzz(&o),
        Command::Image(o) => image::image(&o),
        Command::Outside(o) => outside::outside(&o),
        Command::PublicApi(o) => public_api::public_api(&o),
        Command::SymbolOrder(o) => symbol_order::generate(&o),
        Command::VmTest(o) => vm::vm_test(&o),
    };
    if let Err(e) = result {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}
