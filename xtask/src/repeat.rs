//! `cargo xtask test --repeat N [FILTER]`: runs the test binaries N times
//! and reports every test that failed at least once.
//!
//! A test that fails one run in ten loses a day's landing, so flakes are
//! hunted on purpose: the binaries are built once (`cargo test --no-run`),
//! then each one runs N times exactly as `cargo test` runs it (its package
//! directory as the working directory, tests in parallel), and the outcome
//! of every test in every round is tallied from libtest's `test NAME ...
//! ok|FAILED` lines. The whole output of a binary that failed is kept under
//! `target/test-repeat/` for the post-mortem.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::util::{cargo, say, workspace_root};

/// One test executable that `cargo test` would run.
#[derive(Debug, Clone)]
struct TestBinary {
    /// `package/target`, e.g. `lookout-agent/run`.
    name: String,
    exe: PathBuf,
    /// The package directory: cargo runs tests from there.
    dir: PathBuf,
}

/// What happened to one test over all rounds.
#[derive(Debug, Default)]
struct Tally {
    passed: u32,
    failed: u32,
    ignored: u32,
    /// Rounds in which it failed, and where the output went.
    failures: Vec<(u32, PathBuf)>,
}

/// How a libtest line ends.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Failed,
    Ignored,
}

/// `test a::b ... ok` → (`a::b`, Ok). Other lines → `None`.
fn parse_line(line: &str) -> Option<(&str, Outcome)> {
    let rest = line.strip_prefix("test ")?;
    let (name, result) = rest.rsplit_once(" ... ")?;
    let outcome = match result.trim_end() {
        "ok" => Outcome::Ok,
        "FAILED" => Outcome::Failed,
        r if r.starts_with("ignored") => Outcome::Ignored,
        _ => return None,
    };
    Some((name, outcome))
}

/// Builds the test binaries of `packages` (all of the workspace when
/// empty) and lists them.
fn build(packages: &[String], cargo_args: &[String]) -> anyhow::Result<Vec<TestBinary>> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "-j2",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    if packages.is_empty() {
        cmd.arg("--workspace");
    }
    for p in packages {
        cmd.args(["-p", p]);
    }
    cmd.args(cargo_args).stdout(Stdio::piped());
    say("test --repeat", "building the test binaries once");
    let mut child = cmd.spawn().context("starting cargo test --no-run")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut bins = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's messages")?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let manifest = msg["manifest_path"].as_str().unwrap_or_default();
        let dir = Path::new(manifest)
            .parent()
            .map_or_else(workspace_root, Path::to_path_buf);
        let package = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = msg["target"]["name"].as_str().unwrap_or("?");
        bins.push(TestBinary {
            name: format!("{package}/{target}"),
            exe: PathBuf::from(exe),
            dir,
        });
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!("cargo test --no-run failed ({status}); fix the build first");
    }
    bins.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(bins)
}

/// Runs every binary `rounds` times with `filter`, prints a report, and
/// fails if any test failed in any round.
pub fn repeat(
    rounds: u32,
    filter: Option<&str>,
    packages: &[String],
    cargo_args: &[String],
) -> anyhow::Result<()> {
    let bins = build(packages, cargo_args)?;
    let logs = workspace_root().join("target/test-repeat");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let mut tally: BTreeMap<String, Tally> = BTreeMap::new();
    let started = Instant::now();
    for round in 1..=rounds {
        let t = Instant::now();
        let (mut passed, mut failed) = (0u32, 0u32);
        for bin in &bins {
            let mut cmd = Command::new(&bin.exe);
            cmd.current_dir(&bin.dir)
                .env("CARGO_MANIFEST_DIR", &bin.dir)
                .stdin(Stdio::null());
            if let Some(f) = filter {
                cmd.arg(f);
            }
            let out = cmd
                .output()
                .with_context(|| format!("running {}", bin.exe.display()))?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            let mut saw_failure = false;
            let log = logs.join(format!("round-{round}-{}.log", bin.name.replace('/', "-")));
            for (name, outcome) in stdout.lines().filter_map(parse_line) {
                let entry = tally.entry(format!("{} {name}", bin.name)).or_default();
                match outcome {
                    Outcome::Ok => {
                        entry.passed += 1;
                        passed += 1;
                    }
                    Outcome::Ignored => entry.ignored += 1,
                    Outcome::Failed => {
                        entry.failed += 1;
                        entry.failures.push((round, log.clone()));
                        failed += 1;
                        saw_failure = true;
                    }
                }
            }
            // A binary that died (a signal, an abort) or failed without a
            // FAILED line still counts, under its own name.
            if !out.status.success() && !saw_failure {
                let entry = tally
                    .entry(format!("{} (the binary: {})", bin.name, out.status))
                    .or_default();
                entry.failed += 1;
                entry.failures.push((round, log.clone()));
                failed += 1;
                saw_failure = true;
            }
            if saw_failure {
                let mut text = stdout.into_owned();
                text.push_str("\n---- stderr ----\n");
                text.push_str(&String::from_utf8_lossy(&out.stderr));
                std::fs::write(&log, text).with_context(|| format!("writing {}", log.display()))?;
            }
        }
        say(
            "test --repeat",
            &format!(
                "round {round}/{rounds}: {passed} passed, {failed} failed ({})",
                secs(t.elapsed())
            ),
        );
    }
    report(&tally, rounds, started.elapsed())
}

fn secs(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
}

fn report(tally: &BTreeMap<String, Tally>, rounds: u32, took: Duration) -> anyhow::Result<()> {
    let tests = tally.len();
    let flaky: Vec<(&String, &Tally)> = tally.iter().filter(|(_, t)| t.failed > 0).collect();
    println!(
        "\n{tests} tests, {rounds} rounds, {}: {} failed at least once",
        secs(took),
        flaky.len()
    );
    if tests == 0 {
        bail!("no test ran: check the filter");
    }
    for (name, t) in &flaky {
        println!(
            "  FAILED {}/{} {name} (passed {})",
            t.failed,
            t.failed + t.passed,
            t.passed
        );
        for (round, log) in &t.failures {
            println!("         round {round}: {}", log.display());
        }
    }
    if flaky.is_empty() {
        Ok(())
    } else {
        bail!(
            "{} tests failed at least once in {rounds} rounds",
            flaky.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtest_lines() {
        assert_eq!(parse_line("test a::b ... ok"), Some(("a::b", Outcome::Ok)));
        assert_eq!(
            parse_line("test x ... FAILED"),
            Some(("x", Outcome::Failed))
        );
        assert_eq!(
            parse_line("test y ... ignored, needs a kernel"),
            Some(("y", Outcome::Ignored))
        );
        assert_eq!(parse_line("test result: ok. 3 passed"), None);
        assert_eq!(parse_line("running 3 tests"), None);
        assert_eq!(
            parse_line("test z has been running for over 60 seconds"),
            None
        );
    }
}
