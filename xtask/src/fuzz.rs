//! `cargo xtask fuzz`: builds the cargo-fuzz targets in fuzz/ and runs each
//! for a time budget on its seed corpus (fuzz/seeds/TARGET), its crash
//! regressions (fuzz/regressions/TARGET) and what earlier runs found
//! (target/fuzz/corpus/TARGET). Writes target/fuzz/report.json.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

use crate::build_ebpf::{cache_dir, ensure_toolchain};
use crate::util::{exec, say, workspace_root};

const STEP: &str = "fuzz";
/// The cargo-fuzz release installed into the cache.
const CARGO_FUZZ_VERSION: &str = "0.13.2";
/// Inputs are at most this long: an exec record is 4.6 KiB.
const MAX_LEN: usize = 8192;

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Targets to run (all of them by default; see `--list`).
    #[arg(value_name = "TARGET")]
    pub targets: Vec<String>,
    /// Seconds per target.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub time: u64,
    /// List the targets and exit.
    #[arg(long)]
    pub list: bool,
    /// The nightly toolchain cargo-fuzz builds with.
    #[arg(long, default_value = "nightly")]
    pub toolchain: String,
    /// Targets run at once (each is one libFuzzer process, one core).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub jobs: u32,
}

/// The targets, from fuzz/Cargo.toml's `[[bin]]` names.
fn targets(fuzz_dir: &Path) -> anyhow::Result<Vec<String>> {
    let manifest = fuzz_dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)
        .with_context(|| format!("reading {}", manifest.display()))?;
    let mut names = Vec::new();
    let mut in_bin = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_bin = line == "[[bin]]";
        } else if in_bin && let Some(v) = line.strip_prefix("name") {
            let v = v
                .trim_start()
                .trim_start_matches('=')
                .trim()
                .trim_matches('"');
            names.push(v.to_owned());
        }
    }
    if names.is_empty() {
        bail!("no [[bin]] targets in {}", manifest.display());
    }
    Ok(names)
}

fn ensure_cargo_fuzz() -> anyhow::Result<PathBuf> {
    let root = cache_dir().join(format!("cargo-fuzz-{CARGO_FUZZ_VERSION}"));
    let bin = root.join("bin/cargo-fuzz");
    if bin.is_file() {
        return Ok(bin);
    }
    say(
        STEP,
        &format!(
            "installing cargo-fuzz {CARGO_FUZZ_VERSION} into {} (once, about 90 s)",
            root.display()
        ),
    );
    exec(
        "install cargo-fuzz",
        Command::new("cargo")
            .args([
                "install",
                "cargo-fuzz",
                "--version",
                CARGO_FUZZ_VERSION,
                "--locked",
                "--root",
            ])
            .arg(&root)
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("CARGO_TARGET_DIR"),
        "check network access to crates.io",
    )?;
    if !bin.is_file() {
        bail!(
            "step 'install cargo-fuzz': cargo install succeeded but {} is missing",
            bin.display()
        );
    }
    Ok(bin)
}

/// What one run of a target did.
#[derive(Debug, Default)]
struct Run {
    target: String,
    seconds: f64,
    runs: u64,
    exec_per_sec: u64,
    coverage: u64,
    corpus: u64,
    crashed: Option<String>,
}

/// Reads libFuzzer's summary: the last status line ("#N\tDONE cov: C
/// ft: F corp: K/.. exec/s: E") and the final stats (`-print_final_stats`).
fn summarise(run: &mut Run, log: &str) {
    let field = |line: &str, key: &str| -> Option<u64> {
        let rest = line.split(key).nth(1)?.trim_start();
        let n: String = rest.chars().take_while(char::is_ascii_digit).collect();
        n.parse().ok()
    };
    if let Some(l) = log
        .lines()
        .rev()
        .find(|l| l.starts_with('#') && l.contains("cov:"))
    {
        run.coverage = field(l, "cov:").unwrap_or(0);
        run.corpus = field(l, "corp:").unwrap_or(0);
        run.exec_per_sec = field(l, "exec/s:").unwrap_or(0);
    }
    for l in log.lines() {
        if let Some(n) = field(l, "stat::number_of_executed_units:") {
            run.runs = n;
        }
        if let Some(n) = field(l, "stat::average_exec_per_sec:") {
            run.exec_per_sec = n;
        }
    }
}

pub fn fuzz(opts: &Options) -> anyhow::Result<()> {
    let root = workspace_root();
    let fuzz_dir = root.join("fuzz");
    let all = targets(&fuzz_dir)?;
    if opts.list {
        for t in &all {
            println!("{t}");
        }
        return Ok(());
    }
    let chosen: Vec<String> = if opts.targets.is_empty() {
        all.clone()
    } else {
        for t in &opts.targets {
            if !all.contains(t) {
                bail!("no fuzz target {t:?}; the targets are: {}", all.join(", "));
            }
        }
        opts.targets.clone()
    };
    ensure_toolchain(&opts.toolchain)?;
    let cargo_fuzz = ensure_cargo_fuzz()?;
    let out = root.join("target/fuzz");
    let build_dir = out.join("build");
    let base = |cmd: &mut Command| {
        cmd.current_dir(&root)
            .env("RUSTUP_TOOLCHAIN", &opts.toolchain)
            .env("CARGO_BUILD_JOBS", "2")
            .env_remove("CARGO_TARGET_DIR");
    };
    // Built once for all targets (release, debug assertions on, ASan).
    let mut build = Command::new(&cargo_fuzz);
    base(&mut build);
    build
        .args(["fuzz", "build", "--debug-assertions", "--target-dir"])
        .arg(&build_dir);
    exec(
        "build fuzz targets",
        &mut build,
        "the targets build with the nightly toolchain; see docs/fuzzing.md",
    )?;

    // `--jobs` targets at a time, each logging to its own file.
    let mut runs = Vec::new();
    let mut waiting: std::collections::VecDeque<&String> = chosen.iter().collect();
    let mut running: Vec<(String, std::process::Child, Instant, std::path::PathBuf)> = Vec::new();
    while !waiting.is_empty() || !running.is_empty() {
        while running.len() < opts.jobs as usize
            && let Some(t) = waiting.pop_front()
        {
            let corpus = out.join("corpus").join(t);
            let artifacts = out.join("artifacts").join(t);
            let logs = out.join("logs");
            for d in [&corpus, &artifacts, &logs] {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            }
            let mut cmd = Command::new(&cargo_fuzz);
            base(&mut cmd);
            cmd.args(["fuzz", "run", "--debug-assertions", "--target-dir"])
                .arg(&build_dir)
                .arg(t)
                .arg(&corpus);
            for extra in ["seeds", "regressions"] {
                let d = fuzz_dir.join(extra).join(t);
                if d.is_dir() {
                    cmd.arg(d);
                }
            }
            cmd.arg("--")
                .arg(format!("-max_total_time={}", opts.time))
                .arg(format!("-max_len={MAX_LEN}"))
                .arg(format!("-artifact_prefix={}/", artifacts.display()))
                .arg("-print_final_stats=1");
            let log_path = logs.join(format!("{t}.log"));
            let log = std::fs::File::create(&log_path)
                .with_context(|| format!("creating {}", log_path.display()))?;
            cmd.stdin(std::process::Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log);
            say(STEP, &format!("{t}: {} s", opts.time));
            let child = cmd
                .spawn()
                .with_context(|| format!("running {}", cargo_fuzz.display()))?;
            running.push((t.clone(), child, Instant::now(), log_path));
        }
        let mut i = 0;
        while i < running.len() {
            let Some(status) = running[i].1.try_wait()? else {
                i += 1;
                continue;
            };
            let (t, _, started, log_path) = running.swap_remove(i);
            let log = std::fs::read_to_string(&log_path)
                .with_context(|| format!("reading {}", log_path.display()))?;
            let mut run = Run {
                target: t,
                seconds: started.elapsed().as_secs_f64(),
                ..Run::default()
            };
            summarise(&mut run, &log);
            if !status.success() {
                let artifact = log
                    .lines()
                    .find_map(|l| l.split("Test unit written to ").nth(1))
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("see {}", log_path.display()));
                run.crashed = Some(artifact);
            }
            runs.push(run);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    runs.sort_by(|a, b| a.target.cmp(&b.target));

    write_report(opts.time, &runs, &out)?;
    let crashed: Vec<&Run> = runs.iter().filter(|r| r.crashed.is_some()).collect();
    if !crashed.is_empty() {
        bail!(
            "{} target(s) crashed: {}. Reproduce with `RUSTUP_TOOLCHAIN={} {} fuzz run --debug-assertions TARGET ARTIFACT`; \
             fix it, then keep the input in fuzz/regressions/TARGET/ and add a unit test (docs/fuzzing.md)",
            crashed.len(),
            crashed
                .iter()
                .map(|r| r.target.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            opts.toolchain,
            cargo_fuzz.display()
        );
    }
    Ok(())
}

/// Prints the runs' table and writes them to `out/report.json`.
fn write_report(time: u64, runs: &[Run], out: &Path) -> anyhow::Result<()> {
    println!(
        "{:<18} {:>8} {:>12} {:>10} {:>6} {:>7}  result",
        "target", "seconds", "runs", "exec/s", "cov", "corpus"
    );
    for r in runs {
        println!(
            "{:<18} {:>8.1} {:>12} {:>10} {:>6} {:>7}  {}",
            r.target,
            r.seconds,
            r.runs,
            r.exec_per_sec,
            r.coverage,
            r.corpus,
            r.crashed
                .as_deref()
                .map_or("ok".to_owned(), |a| format!("CRASH: {a}"))
        );
    }
    let report = serde_json::json!({
        "time_per_target_s": time,
        "targets": runs.iter().map(|r| serde_json::json!({
            "target": r.target,
            "seconds": r.seconds,
            "runs": r.runs,
            "exec_per_sec": r.exec_per_sec,
            "coverage": r.coverage,
            "corpus": r.corpus,
            "crash": r.crashed,
        })).collect::<Vec<_>>(),
    });
    let report_path = out.join("report.json");
    std::fs::write(&report_path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", report_path.display()))?;
    say(STEP, &format!("report: {}", report_path.display()));
    Ok(())
}
