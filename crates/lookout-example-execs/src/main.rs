//! `lookout-example-execs`: counts the execs of each container on the node,
//! with a BPF program of its own that reads the map lookout pins.
//!
//! An example of a consumer that needs no API call per event: the agent
//! (`lookout run`) keeps `containers_by_cgroup`, pinned under
//! `--bpf-pin-dir` (`/sys/fs/bpf/lookout` by default), filled with one
//! entry per container before the container's first instruction, and
//! removes the entry when the container exits. This program:
//!
//! 1. refuses to run unless both of lookout's pins exist and look like
//!    lookout's ([`pins::check`]): aya's loader would otherwise create and
//!    pin a map of its own at lookout's path;
//! 2. loads its BPF object (`crates/lookout-example-execs-ebpf`, embedded
//!    at build time) with `EbpfLoader::map_pin_path`, so that the program's
//!    `containers_by_cgroup` *is* lookout's map, and attaches its
//!    tracepoint to `sched/sched_process_exec`;
//! 3. every `--interval`, prints each counted cgroup with its container's
//!    id, read from the same pinned map ([`report`]).
//!
//! It stops on SIGINT, SIGTERM or after `--exit-after`, printing the counts
//! once more. Run it as root beside an agent:
//!
//! ```text
//! cargo xtask build-ebpf
//! cargo build -p lookout-example-execs
//! sudo target/debug/lookout-example-execs --interval 2s
//! ```

mod pins;
mod report;
mod signals;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use aya::maps::{HashMap, IterableMap as _};
use aya::programs::TracePoint;
use aya::{Ebpf, EbpfLoader};
use clap::Parser;
use lookout_ebpf_common::{CONTAINER_MAPS_DIR, CONTAINERS_BY_CGROUP_MAP, ContainerEntry};

use crate::report::{Format, Report};

/// The BPF object `cargo xtask build-ebpf` built
/// (`target/bpf/lookout-example-execs.o`); empty when the build had none.
static BPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lookout-example-execs.o"));

/// The program in [`BPF_OBJECT`] and where it attaches.
const PROGRAM: &str = "count_execs";
const TRACEPOINT_CATEGORY: &str = "sched";
const TRACEPOINT: &str = "sched_process_exec";
/// The program's own map of counters, cgroup id → execs and the counted
/// container's entry.
const COUNTERS_MAP: &str = "EXECS_BY_CGROUP";

/// Counts execs per container through lookout's pinned BPF maps.
///
/// Needs root, and a lookout agent that pins its maps (`lookout run`, with
/// `--bpf-pin-dir` if not the default).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// The directory where lookout pins its maps: the agent's
    /// `--bpf-pin-dir`.
    #[arg(long, value_name = "DIR", default_value = CONTAINER_MAPS_DIR)]
    pin_dir: PathBuf,
    /// How often to print the counts.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Print one JSON object per container per tick:
    /// `{"container_id":…,"cgroup_id":…,"execs":…}`.
    #[arg(long)]
    json: bool,
    /// Stop after this long (for tests and scripts).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    exit_after: Option<Duration>,
}

fn main() {
    let cli = Cli::parse();
    if let Err(error) = run(&cli) {
        eprintln!("lookout-example-execs: error: {error:#}");
        std::process::exit(1);
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    if cli.interval.is_zero() {
        bail!("--interval must be longer than 0");
    }
    if BPF_OBJECT.is_empty() {
        bail!(
            "built without its BPF object: run `cargo xtask build-ebpf`, then build \
             lookout-example-execs again"
        );
    }
    // Before anything can spawn a thread: SIGINT and SIGTERM are taken by
    // `sigtimedwait` in the loop below, not by a handler.
    let stop = signals::Stop::block().context("blocking SIGINT and SIGTERM")?;

    // 1. lookout's pins, checked before the loader can create its own.
    let pinned = pins::check(&cli.pin_dir)?;
    let cgroup_pin = cli.pin_dir.join(CONTAINERS_BY_CGROUP_MAP);

    // 2. Load: aya opens the pin at `cgroup_pin` for the program's
    // `containers_by_cgroup` instead of creating a map.
    let mut ebpf = EbpfLoader::new()
        .map_pin_path(CONTAINERS_BY_CGROUP_MAP, cgroup_pin.as_path())
        .load(BPF_OBJECT)
        .context("loading the BPF object (root needed)")?;
    pins::same_map(&cgroup_pin, &pinned, containers_map(&ebpf)?.map())?;

    let program: &mut TracePoint = ebpf
        .program_mut(PROGRAM)
        .with_context(|| format!("the BPF object has no program {PROGRAM}"))?
        .try_into()
        .with_context(|| format!("{PROGRAM} is not a tracepoint program"))?;
    program
        .load()
        .with_context(|| format!("loading {PROGRAM} into the kernel"))?;
    program
        .attach(TRACEPOINT_CATEGORY, TRACEPOINT)
        .with_context(|| {
            format!(
                "attaching {PROGRAM} to {TRACEPOINT_CATEGORY}/{TRACEPOINT} (is tracefs mounted at \
                 /sys/kernel/tracing? lookout mounts it when it starts)"
            )
        })?;
    eprintln!(
        "lookout-example-execs: attached {PROGRAM} to {TRACEPOINT_CATEGORY}/{TRACEPOINT}; \
         counting the execs of the containers in {}",
        cgroup_pin.display()
    );

    // 3. Print every interval until stopped.
    let containers = containers_map(&ebpf)?;
    let counters = counters_map(&ebpf)?;
    let format = if cli.json { Format::Json } else { Format::Text };
    let mut report = Report::new(format);

    let start = Instant::now();
    let stop_at = cli.exit_after.map(|d| start + d);
    let mut next_tick = start + cli.interval;
    loop {
        let wake = stop_at.map_or(next_tick, |s| s.min(next_tick));
        if let Some(signal) = stop
            .wait(wake.saturating_duration_since(Instant::now()))
            .context("waiting for a signal")?
        {
            eprintln!("lookout-example-execs: stopping on signal {signal}");
            break;
        }
        let now = Instant::now();
        if stop_at.is_some_and(|s| now >= s) {
            break;
        }
        if now >= next_tick {
            pins::still_pinned(&cgroup_pin, &pinned)?;
            report.tick(&counters, &containers, start.elapsed())?;
            next_tick += cli.interval;
            if next_tick < now {
                // Late by more than an interval (a stopped process): skip.
                next_tick = now + cli.interval;
            }
        }
    }
    report.tick(&counters, &containers, start.elapsed())
}

/// The loaded `containers_by_cgroup`: lookout's map, through its pin.
fn containers_map(ebpf: &Ebpf) -> anyhow::Result<report::Containers<'_>> {
    let map = ebpf
        .map(CONTAINERS_BY_CGROUP_MAP)
        .with_context(|| format!("the BPF object has no map {CONTAINERS_BY_CGROUP_MAP}"))?;
    HashMap::try_from(map).with_context(|| {
        format!(
            "{CONTAINERS_BY_CGROUP_MAP} is not a hash map of u64 to {} bytes",
            ContainerEntry::SIZE
        )
    })
}

/// The program's own counters, cgroup id → execs.
fn counters_map(ebpf: &Ebpf) -> anyhow::Result<report::Counters<'_>> {
    let map = ebpf
        .map(COUNTERS_MAP)
        .with_context(|| format!("the BPF object has no map {COUNTERS_MAP}"))?;
    HashMap::try_from(map)
        .with_context(|| format!("{COUNTERS_MAP} is not a hash map of u64 to u64"))
}
