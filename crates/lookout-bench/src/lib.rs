//! lookout's benchmark: the measurements behind `cargo xtask bench`, and
//! the floor programs measured beside the agent.
//!
//! # Overview
//!
//! The xtask parses `cargo xtask bench`'s flags into [`Options`], builds
//! what [`needs`] asks for (the agent as the image builds it, the BPF
//! object, the floors: [`release_builds`]), and calls [`run`] with the
//! [`Paths`] of those builds; or, with `--against REV`, builds REV's agent
//! too and calls [`run_against`]. Everything here needs root: fanotify
//! permission events, BPF, runc.
//!
//! The measurements run the real agent (`lookout run`) against real
//! runtimes. Ratios are measured side by side in one run; absolute times
//! on shared VMs are noisy. Each part `--only` names ([`part_names`])
//! adds its keys to one report, target/bench/report.json, and prints its
//! share of it.
//!
//! Beside the agent run the floors: lookout-fanotify's `allow_all`
//! example (the least any exec-permission listener does), and this
//! crate's `work_floor` binary (the agent's work per container on one
//! thread, with none of its safety boundaries). The consumers part runs in
//! this crate's `bench_consumers` binary, built with optimisation: its
//! clients are part of what it measures.

mod against;
mod agent;
mod churn;
mod consumers;
mod containers;
mod discovery;
mod events;
mod exec;
mod floor;
mod hooks;
mod host;
mod inode;
mod nri;
mod parts;
mod pinned;
mod print;
mod startup;
mod stats;
mod util;

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::Value;

pub use against::run_against;
pub use consumers::run_consumers;
pub use containers::busybox_bundle;
pub use floor::Floors;
pub use parts::part_names;

/// `cargo xtask bench`'s options (its flags).
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Execs per configuration and round for the exec-overhead measurement.
    #[arg(long, default_value_t = 200)]
    pub execs: usize,
    /// Rounds (configurations are interleaved round by round).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Sequential containers for the discovery-latency measurement.
    /// With 200, the p99 is the third largest lag, not the maximum.
    #[arg(long, default_value_t = 200)]
    pub latency: usize,
    /// Containers for the churn measurement.
    #[arg(long, default_value_t = 500)]
    pub churn: usize,
    /// Containers, each with 64 KiB of annotations, for the memory
    /// measurement (all tracked at once).
    #[arg(long, default_value_t = 200)]
    pub heavy: usize,
    /// Entries per mode for the inode-map measurement.
    #[arg(long, default_value_t = 1_000_000)]
    pub inode_entries: u64,
    /// Rounds of the gate measurement: each round times one `runc start`
    /// per agent (0, 1 and 10 gate subscribers), in a random order.
    #[arg(long, default_value_t = 200)]
    pub gate_rounds: usize,
    /// Containers churned through each of the two agents (100 watchers,
    /// none) for the watcher CPU and memory measurement.
    #[arg(long, default_value_t = 300)]
    pub watch_churn: usize,
    /// Run only one part (`agent` includes `consumers`). Without it: `agent`,
    /// then `inode-map`.
    #[arg(long, value_name = "PART", value_parser = parts::part_names())]
    pub only: Option<String>,
    /// Also build the agent of revision REV (a commit, tag or branch) and
    /// measure it side by side with this tree's, interleaved scenario by
    /// scenario on the same machine: each figure is printed for both, with
    /// their ratio. Runs the `agent` part (consumers included). REV is
    /// built once, in a git worktree under target/bench/against.
    #[arg(long, value_name = "REV")]
    pub against: Option<String>,
    /// Start each agent as in a pod on a cgroup v2 node: in a cgroup and a
    /// cgroup namespace of its own (`unshare --cgroup`), told the host's
    /// namespace by `--host-namespaces-pid` (this process). The agent then
    /// reads every container's cgroup in the host's namespace, as in the
    /// DaemonSet. Applies to the agents this process starts (discovery,
    /// churn, memory, start-up); not to the consumers part.
    #[arg(long)]
    pub agent_cgroup_namespace: bool,
}

/// What must be built before a run: the agent, the floors, the inode
/// map's tools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// The BPF object and the agent, built as the image builds it.
    pub agent: bool,
    /// The floor programs and the consumers' binary ([`release_builds`]).
    pub floors: bool,
    /// lookout-inode-map's `bench_map` and `stablefs` examples.
    pub inode_tools: bool,
}

impl Needs {
    /// What either needs.
    fn or(self, other: Needs) -> Needs {
        Needs {
            agent: self.agent || other.agent,
            floors: self.floors || other.floors,
            inode_tools: self.inode_tools || other.inode_tools,
        }
    }
}

/// What the run `opts` asks for needs built (an unknown `--only` is an
/// error). With `--against`: the agent and the floors.
pub fn needs(opts: &Options) -> anyhow::Result<Needs> {
    if opts.against.is_some() {
        against::discovery_only(opts)?;
        return Ok(parts::AGENT_AND_FLOORS);
    }
    Ok(parts::selected(opts.only.as_deref())?
        .iter()
        .fold(Needs::default(), |n, p| n.or(p.needs)))
}

/// The arguments of each `cargo build -j2 --release` (in the workspace)
/// that builds the programs `needs` asks for, besides the agent: where
/// [`Paths::new`] expects them.
pub fn release_builds(needs: Needs) -> Vec<&'static [&'static str]> {
    let mut builds: Vec<&'static [&'static str]> = Vec::new();
    if needs.floors {
        builds.push(&["-p", "lookout-fanotify", "--example", "allow_all"]);
        builds.push(&["-p", "lookout-bench", "--bins"]);
    }
    if needs.inode_tools {
        builds.push(&[
            "-p",
            "lookout-inode-map",
            "--example",
            "bench_map",
            "--example",
            "stablefs",
        ]);
    }
    builds
}

/// Where the benchmark finds its binaries and writes its files.
#[derive(Debug, Clone)]
pub struct Paths {
    /// The agent, built as the image builds it (with its symbols).
    pub lookout: PathBuf,
    /// The floor responders.
    pub floors: Floors,
    /// This crate's `bench_consumers` binary (release).
    pub consumers: PathBuf,
    /// lookout-inode-map's `bench_map` example (release).
    pub bench_map: PathBuf,
    /// lookout-inode-map's `stablefs` example (release).
    pub stablefs: PathBuf,
    /// target/bench, where report.json goes.
    pub out_dir: PathBuf,
    /// target/bench/work, the scratch directory.
    pub work: PathBuf,
}

impl Paths {
    /// The paths in the workspace at `root`, where [`release_builds`]
    /// leaves its programs, for the agent binary `lookout`.
    pub fn new(root: &Path, lookout: PathBuf) -> Paths {
        let release = root.join("target/release");
        let out_dir = root.join("target/bench");
        Paths {
            lookout,
            floors: Floors {
                allow_all: release.join("examples/allow_all"),
                work: release.join("work_floor"),
                bpf_object: root.join("target/bpf/lookout-ebpf.o"),
            },
            consumers: release.join("bench_consumers"),
            bench_map: release.join("examples/bench_map"),
            stablefs: release.join("examples/stablefs"),
            work: out_dir.join("work"),
            out_dir,
        }
    }
}

/// Runs the parts `opts` selects (`--only`, or a full run) with the
/// programs at `paths` (built: [`needs`]); writes report.json and prints
/// each part's table.
pub fn run(opts: &Options, paths: &Paths) -> anyhow::Result<()> {
    prepare(opts)?;
    let _pins = agent::PinFsGuard;
    if opts.against.is_some() {
        bail!("--against: see run_against");
    }
    let parts = parts::selected(opts.only.as_deref())?;
    let mut report = parts::Report::new();
    for part in &parts {
        report.extend((part.run)(opts, paths)?);
    }
    let report = Value::Object(report);
    std::fs::create_dir_all(&paths.out_dir)?;
    let path = paths.out_dir.join("report.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", path.display()))?;
    for part in &parts {
        (part.print)(&report);
    }
    println!("report: {}", path.display());
    Ok(())
}

/// Fails unless this process is root; with `--agent-cgroup-namespace`,
/// makes the agents' cgroup.
fn prepare(opts: &Options) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the benchmark needs root (fanotify permission events, BPF, runc): sudo -E cargo xtask bench"
        );
    }
    if opts.agent_cgroup_namespace {
        agent::AgentCgroup::make()?;
    }
    Ok(())
}
