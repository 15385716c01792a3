//! lookout: discovers every container on a Linux node the moment it is
//! created (before its first instruction runs) and when it exits.
//!
//! This crate is the `lookout` binary's engine. A Rust program can embed
//! it ([`Discovery`]) instead of running the binary: it then gets the
//! node's containers, their changes and gates on their start from the
//! [`Hub`] in-process, with the same modes, defences and limits as the
//! agent. See `examples/embed.rs`.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use lookout_agent::{Discovery, Filter};
//! let d = Discovery::builder().no_socket().start()?;
//! let (revision, containers) = d.hub().list(&Filter::default());
//! println!("{} containers at revision {revision}", containers.len());
//! d.stop()?;
//! # Ok(()) }
//! ```

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

mod cli;
mod docker;
mod embed;
mod endpoints;
mod grpc;
mod handover;
mod hooks;
mod hub;
mod k8s_events;
mod listen;
mod merge;
mod metrics;
mod nri;
mod pinned;
mod run;
mod watch_wire;
mod wire;

pub use embed::{Builder, Discovery};
pub use hub::{
    Change, FailurePolicy, Filter, GateSubscriber, HoldRequest, Hub, HubConfig, HubMetrics, Live,
    Refused, Responder, Subscription, Verdict, Watch, WatchEnd, WatchItem,
};

/// The BPF object built by `cargo xtask build-ebpf` (empty when the agent
/// was built without it).
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lookout-ebpf.o"));

/// The embedded BPF object, if this build has one.
fn ebpf_object() -> Option<&'static [u8]> {
    (!EBPF_OBJECT.is_empty()).then_some(EBPF_OBJECT)
}

/// lookout discovers the containers on this node the moment they are
/// created, and when they exit.
#[derive(Debug, Parser)]
#[command(name = "lookout", version, about, long_about = None)]
struct Cli {
    /// Log lines as text or as one JSON object each (on stderr).
    #[arg(long, global = true, value_enum, env = "LOOKOUT_LOG_FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Exit status of a command line that cannot be used (clap's, too).
const EXIT_USAGE: i32 = 2;

#[derive(Debug, Subcommand)]
enum Command {
    /// Check what this node supports and which discovery mode `auto` picks.
    ///
    /// Exits 0 whenever the probe ran, whatever it found.
    Probe(ProbeArgs),
    /// Discover containers and print one event per line (JSON by default
    /// when stdout is not a terminal). Stops on SIGTERM/SIGINT.
    Run(Box<run::RunArgs>),
    /// List this node's containers, from a running agent's API socket.
    Get(GetArgs),
    /// Print every container change as it happens, from a running agent's
    /// API socket (resumes across agent restarts).
    Watch(WatchArgs),
    /// Hold every container start through the agent's gate, print each
    /// hold, and allow it (after `--hold`) or deny it (`--deny`): what a
    /// gate consumer sees, for operators and tests.
    Gate(GateArgs),
}

#[derive(Debug, clap::Args)]
struct GateArgs {
    /// The subscription's name (in the agent's logs, metrics and denial
    /// reasons).
    #[arg(long, default_value = "lookout-cli")]
    name: String,
    /// How long the agent waits for each decision (at most its
    /// `--gate-max-deadline`).
    #[arg(long, default_value = "2s", value_parser = run::parse_duration)]
    deadline: std::time::Duration,
    /// Deny the start when no decision comes in time (default: allow it).
    #[arg(long)]
    fail_closed: bool,
    /// Keep each start held this long before answering.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    hold: std::time::Duration,
    /// Deny every start, with this reason.
    #[arg(long, value_name = "REASON")]
    deny: Option<String>,
    /// text or json (one object per hold).
    #[arg(short, long, value_enum, default_value_t = cli::WatchOutput::Text)]
    output: cli::WatchOutput,
    #[command(flatten)]
    filter: cli::FilterArgs,
    /// The agent's socket.
    #[arg(long, env = "LOOKOUT_SOCKET", default_value = lookout_client::DEFAULT_SOCKET)]
    socket: PathBuf,
}

#[derive(Debug, clap::Args)]
struct GetArgs {
    /// table, wide (more columns) or json.
    #[arg(short, long, value_enum, default_value_t = cli::GetOutput::Table)]
    output: cli::GetOutput,
    #[command(flatten)]
    filter: cli::FilterArgs,
    /// The agent's socket.
    #[arg(long, env = "LOOKOUT_SOCKET", default_value = lookout_client::DEFAULT_SOCKET)]
    socket: PathBuf,
}

#[derive(Debug, clap::Args)]
struct WatchArgs {
    /// text or json (one object per line).
    #[arg(short, long, value_enum, default_value_t = cli::WatchOutput::Text)]
    output: cli::WatchOutput,
    /// Start after this revision (0: the containers now, first).
    #[arg(long, default_value_t = 0)]
    since: u64,
    #[command(flatten)]
    filter: cli::FilterArgs,
    /// The agent's socket.
    #[arg(long, env = "LOOKOUT_SOCKET", default_value = lookout_client::DEFAULT_SOCKET)]
    socket: PathBuf,
}

fn client_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the client's runtime")
}

#[derive(Debug, clap::Args)]
struct ProbeArgs {
    /// text (a table) or json (one object).
    #[arg(short, long, value_enum, default_value_t = ProbeOutput::Text)]
    output: ProbeOutput,
    /// The same as `--output json` (not shown in the help).
    #[arg(long, hide = true, conflicts_with = "output")]
    json: bool,
    /// Where the host's root file system is mounted.
    #[arg(long, env = "LOOKOUT_HOST_ROOT", default_value = "/")]
    host_root: PathBuf,
    /// An extra runtime binary to look for (an absolute host path). Repeatable.
    #[arg(long = "runtime-path", value_name = "PATH", value_parser = run::absolute_path)]
    runtime_paths: Vec<PathBuf>,
    /// Look only at the --runtime-path binaries: not the built-in list of
    /// install locations, not PATH.
    #[arg(long)]
    no_default_runtimes: bool,
    /// The runtime's NRI socket, a host path.
    #[arg(
        long,
        env = "LOOKOUT_NRI_SOCKET",
        default_value = lookout_probe::DEFAULT_NRI_SOCKET,
        value_parser = run::absolute_path
    )]
    nri_socket: PathBuf,
    /// dockerd's socket, a host path (the `docker:socket` check asks it
    /// for its version). Repeatable.
    #[arg(
        long = "docker-socket",
        value_name = "PATH",
        default_value = lookout_docker::DEFAULT_SOCKET,
        value_parser = run::absolute_path
    )]
    docker_sockets: Vec<PathBuf>,
    /// Where `lookout run` pins its container maps (the `bpf:pinned-maps`
    /// check).
    #[arg(
        long,
        env = "LOOKOUT_BPF_PIN_DIR",
        default_value = lookout_ebpf_common::CONTAINER_MAPS_DIR,
        value_name = "DIR",
        value_parser = run::absolute_path
    )]
    bpf_pin_dir: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ProbeOutput {
    Text,
    Json,
}

/// Log lines waiting for stderr at most (about 1 MB of them at the usual
/// length of a line): a stderr that is not read costs lines, not memory.
const LOG_QUEUE: usize = 4096;

/// How many log lines were dropped because stderr was not taking them.
static LOG_DROPS: std::sync::OnceLock<tracing_appender::non_blocking::ErrorCounter> =
    std::sync::OnceLock::new();

/// Log lines dropped so far (0 before logging starts).
pub(crate) fn log_lines_dropped() -> u64 {
    LOG_DROPS
        .get()
        .map_or(0, |c| u64::try_from(c.dropped_lines()).unwrap_or(u64::MAX))
}

/// The log filter: `$LOOKOUT_LOG`, else `$RUST_LOG`, else `info`. A filter
/// that does not parse is an error, not a silent `info`.
fn log_filter() -> Result<tracing_subscriber::EnvFilter, String> {
    for var in ["LOOKOUT_LOG", "RUST_LOG"] {
        match std::env::var(var) {
            Ok(v) if !v.trim().is_empty() => {
                return tracing_subscriber::EnvFilter::try_new(&v)
                    .map_err(|e| format!("{var}={v:?} is not a log filter: {e}"));
            }
            Ok(_) => {}
            Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(_)) => return Err(format!("{var} is not UTF-8")),
        }
    }
    Ok(tracing_subscriber::EnvFilter::new("info"))
}

/// glibc's malloc arenas the agent's threads share, at most (unless the
/// operator set `MALLOC_ARENA_MAX` or `GLIBC_TUNABLES`).
const MALLOC_ARENAS: i32 = 2;

/// Caps glibc's malloc arenas at [`MALLOC_ARENAS`], before any thread
/// starts. By default a thread that allocates while another holds an arena
/// gets an arena of its own (up to 8 per CPU), and memory freed in one
/// stays there: the readers, the hook's task, the API and the stdout writer
/// kept about 1.1-1.3 MB more with 200 tracked containers whose config
/// carries 64 KiB of annotations (docs/benchmarks.md, seventeenth pass).
/// Its threads seldom allocate at the same moment, so two arenas cost no
/// measurable waiting.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_ARENA_MAX").is_some()
            || std::env::var_os("GLIBC_TUNABLES").is_some()
        {
            return;
        }
        // SAFETY: mallopt takes two integers and changes only malloc's
        // parameters; called before any other thread exists.
        let _ = unsafe { libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS) };
    }
}

/// The `lookout` command line: parses `std::env::args` and runs the
/// subcommand (what `main` of the binary does). Exit status: 0 done, 1 an
/// error (printed), 2 a command line or environment that cannot be used.
pub fn cli_main() -> anyhow::Result<()> {
    limit_malloc_arenas();
    let cli = Cli::parse();
    let filter = match log_filter() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("lookout: {e}");
            std::process::exit(EXIT_USAGE);
        }
    };
    // Log lines are written to stderr by a thread of their own, never by
    // the thread that logs: the hook's task logs while a runtime exec
    // waits on it, and a stderr nobody reads (or whose reader splices into
    // a destination that stalls, holding the pipe's lock) must not hold
    // it. At most LOG_QUEUE lines wait; more are dropped and counted
    // (`lookout_log_lines_dropped_total`). The guard flushes what waits
    // when `cli_main` returns (for at most a second).
    let (writer, _flush) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_QUEUE)
        .thread_name("lookout-log")
        .finish(std::io::stderr());
    let _ = LOG_DROPS.set(writer.error_counter());
    let logs = tracing_subscriber::fmt()
        .with_writer(writer)
        .with_env_filter(filter);
    match cli.log_format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().init(),
    }
    match cli.command {
        Command::Probe(args) => probe(args),
        Command::Run(args) => run::run(*args, ebpf_object()),
        Command::Get(a) => {
            client_runtime()?.block_on(cli::get(&a.socket, a.output, a.filter.to_filter()))
        }
        Command::Watch(a) => client_runtime()?.block_on(cli::watch(
            &a.socket,
            a.output,
            a.since,
            a.filter.to_filter(),
        )),
        Command::Gate(a) => client_runtime()?.block_on(cli::gate(
            &a.socket,
            cli::GateOptions {
                name: a.name,
                deadline: a.deadline,
                fail_closed: a.fail_closed,
                hold: a.hold,
                deny: a.deny,
                output: a.output,
            },
            a.filter.to_filter(),
        )),
    }
}

fn probe(args: ProbeArgs) -> anyhow::Result<()> {
    let opts = lookout_probe::ProbeOptions::new()
        .host_root(args.host_root)
        .runtime_paths(args.runtime_paths)
        .default_runtimes(!args.no_default_runtimes)
        .nri_socket(args.nri_socket)
        .docker_sockets(args.docker_sockets)
        .bpf_pin_dir(Some(args.bpf_pin_dir))
        .bpf_object(ebpf_object());
    let report = lookout_probe::probe(&opts);
    if args.json || args.output == ProbeOutput::Json {
        let json = serde_json::to_string_pretty(&report).context("serializing the probe report")?;
        println!("{json}");
    } else {
        print!("{report}");
    }
    tracing::info!("{}", report.summary());
    Ok(())
}

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
