//! The consumers part of lookout's benchmark, in a release build: gate
//! subscribers and watchers are tokio tasks in this process, and part of
//! what is measured. `cargo xtask bench` builds and runs it; it writes
//! its results (JSON) to `--out`.
//!
//! ```sh
//! cargo build --release -p lookout-bench --bins
//! sudo target/release/bench_consumers --agent AGENT --out consumers.json \
//!     --work target/bench/work/consumers --allow-all target/release/examples/allow_all \
//!     --work-floor target/release/work_floor --bpf-object target/bpf/lookout-ebpf.o
//! ```

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use lookout_bench::{Floors, run_consumers};

/// Measures gate subscribers and watchers against one agent.
#[derive(Debug, Parser)]
struct Args {
    /// The agent binary measured.
    #[arg(long)]
    agent: PathBuf,
    /// Where the results go (JSON).
    #[arg(long)]
    out: PathBuf,
    /// A scratch directory (emptied first).
    #[arg(long)]
    work: PathBuf,
    /// The allow-all responder (lookout-fanotify's `allow_all` example).
    #[arg(long)]
    allow_all: PathBuf,
    /// The work floor (this crate's `work_floor`).
    #[arg(long)]
    work_floor: PathBuf,
    /// The BPF object the work floor loads.
    #[arg(long)]
    bpf_object: PathBuf,
    /// Rounds of the gate measurement.
    #[arg(long, default_value_t = 200)]
    gate_rounds: usize,
    /// Containers churned through each agent for the watchers.
    #[arg(long, default_value_t = 300)]
    watch_churn: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let floors = Floors {
        allow_all: args.allow_all,
        work: args.work_floor,
        bpf_object: args.bpf_object,
    };
    let v = run_consumers(
        &args.agent,
        &floors,
        &args.work,
        args.gate_rounds,
        args.watch_churn,
    )?;
    std::fs::write(&args.out, serde_json::to_vec(&v)?)
        .with_context(|| format!("writing {}", args.out.display()))
}
