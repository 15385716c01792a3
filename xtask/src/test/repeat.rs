//! `cargo xtask test --repeat N [FILTER]`: runs the test binaries N times
//! and reports every test that failed at least once.
//!
//! A test that fails one run in ten loses a day's landing, so flakes are
//! hunted on purpose: the binaries are built once (`cargo test --no-run`),
//! then each one runs N times exactly as `cargo test` runs it (its package
//! directory as the working directory, tests in parallel), and the outcome
//! of every test in every round is tallied from libtest's `test NAME ...
//! ok|FAILED` lines. The whole output of a binary that failed is kept under
//! `target/test-repeat/` for the post-mortem, and the tally is written to
//! `target/test-repeat/summary.json`.
//!
//! Rounds on a warm tree miss what fails only on a first run: a test
//! binary run for the first time, a cold page cache, a target directory
//! being filled (issue #23: a runtime copy refused with `ETXTBSY` on a
//! fresh clone, never in five warm rounds). `--fresh` makes every round a
//! first run: a new clone of HEAD, its own empty target directory, the
//! page cache dropped, then the whole test command inside it.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;

use crate::util::{cargo, output, say, workspace_root};

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
#[derive(Debug, Default, Clone)]
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
    write_summary(&logs.join("summary.json"), &tally, rounds)?;
    report(&tally, rounds, started.elapsed())
}

/// Writes the tally as JSON, for `--fresh`'s outer run (and for scripts).
fn write_summary(path: &Path, tally: &BTreeMap<String, Tally>, rounds: u32) -> anyhow::Result<()> {
    let tests: serde_json::Map<String, serde_json::Value> = tally
        .iter()
        .map(|(name, t)| {
            let failures: Vec<_> = t
                .failures
                .iter()
                .map(|(round, log)| json!({"round": round, "log": log}))
                .collect();
            let v = json!({"passed": t.passed, "failed": t.failed, "ignored": t.ignored,
                           "failures": failures});
            (name.clone(), v)
        })
        .collect();
    let text = serde_json::to_vec_pretty(&json!({"rounds": rounds, "tests": tests}))?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Reads a summary that [`write_summary`] wrote.
fn read_summary(path: &Path) -> anyhow::Result<BTreeMap<String, Tally>> {
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("parsing {}", path.display()))?;
    let tests = v["tests"].as_object().context("no \"tests\" object")?;
    let number = |v: &serde_json::Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    let mut tally = BTreeMap::new();
    for (name, t) in tests {
        let failures = t["failures"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|x| {
                let log = PathBuf::from(x["log"].as_str().unwrap_or_default());
                (number(&x["round"]).unwrap_or(0), log)
            })
            .collect();
        let tally_of = Tally {
            passed: number(&t["passed"]).unwrap_or(0),
            failed: number(&t["failed"]).unwrap_or(0),
            ignored: number(&t["ignored"]).unwrap_or(0),
            failures,
        };
        tally.insert(name.clone(), tally_of);
    }
    Ok(tally)
}

/// `--repeat N --fresh`: N first runs, one after another. Each round clones
/// HEAD into a new directory (so its target directory starts empty), drops
/// the page cache (as root), and runs `cargo xtask test --repeat 1` there
/// with the same packages, filter and cargo arguments: the README's
/// command (packages, BPF, image, every test binary once), with a tally.
/// Machine-wide caches stay: Debian's packages, cargo's registry,
/// bpf-linker and the fetched Debian 13 packages (`~/.cache/lookout`).
pub fn fresh(rounds: u32, opts: &super::Options) -> anyhow::Result<()> {
    let root = workspace_root();
    let git = |args: &[&str]| output(Command::new("git").current_dir(&root).args(args));
    let head = git(&["rev-parse", "HEAD"])
        .context("git rev-parse HEAD: --fresh clones the repository, it needs git")?
        .trim()
        .to_owned();
    if git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.trim().is_empty())
    {
        say(
            "test --fresh",
            "the work tree has uncommitted changes: the clones test HEAD only (commit first)",
        );
    }
    let logs = root.join("target/test-repeat");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let mut tally: BTreeMap<String, Tally> = BTreeMap::new();
    let started = Instant::now();
    for round in 1..=rounds {
        let t = Instant::now();
        let clone =
            std::env::temp_dir().join(format!("lookout-fresh-{}-{round}", std::process::id()));
        let _ = std::fs::remove_dir_all(&clone);
        crate::util::exec(
            "test --fresh",
            Command::new("git")
                .args(["clone", "--quiet", "--no-checkout"])
                .arg(&root)
                .arg(&clone),
            "check that the repository can be cloned",
        )?;
        crate::util::exec(
            "test --fresh",
            Command::new("git")
                .current_dir(&clone)
                .args(["checkout", "--quiet", "--detach", &head]),
            "check the clone",
        )?;
        drop_page_cache();
        let log = logs.join(format!("fresh-round-{round}.log"));
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        cmd.current_dir(&clone)
            .env_remove("CARGO_TARGET_DIR")
            .args(["xtask", "test", "--repeat", "1"]);
        if opts.no_install {
            cmd.arg("--no-install");
        }
        for p in &opts.packages {
            cmd.args(["-p", p]);
        }
        if let Some(f) = &opts.filter {
            cmd.arg(f);
        }
        if !opts.cargo_args.is_empty() {
            cmd.arg("--").args(&opts.cargo_args);
        }
        say(
            "test --fresh",
            &format!(
                "round {round}/{rounds}: {} at {head:.12}, a first run (log: {})",
                clone.display(),
                log.display()
            ),
        );
        let status = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().context("log file")?)
            .stderr(file)
            .status()
            .context("starting cargo xtask test in the clone")?;
        let (passed, failed) = merge_round(&mut tally, round, &clone, &logs, &log, status);
        // A round's target directory is several GB: never keep it.
        if let Err(e) = std::fs::remove_dir_all(&clone) {
            say(
                "test --fresh",
                &format!("could not remove {}: {e}", clone.display()),
            );
        }
        say(
            "test --fresh",
            &format!(
                "round {round}/{rounds}: {passed} passed, {failed} failed ({})",
                secs(t.elapsed())
            ),
        );
    }
    write_summary(&logs.join("summary.json"), &tally, rounds)?;
    report(&tally, rounds, started.elapsed())
}

/// Adds one fresh round's tally (the clone's summary.json) to `tally`,
/// keeping the failing binaries' logs outside the clone. A round that
/// ended without a tally (an install, the BPF or image build, a compile
/// error) or failed otherwise counts as one failure under its own name.
/// Returns the round's (passed, failed).
fn merge_round(
    tally: &mut BTreeMap<String, Tally>,
    round: u32,
    clone: &Path,
    logs: &Path,
    log: &Path,
    status: std::process::ExitStatus,
) -> (u32, u32) {
    let (mut passed, mut failed) = (0u32, 0u32);
    match read_summary(&clone.join("target/test-repeat/summary.json")) {
        Ok(round_tally) => {
            for (name, t) in round_tally {
                let entry = tally.entry(name).or_default();
                entry.passed += t.passed;
                entry.ignored += t.ignored;
                entry.failed += t.failed;
                passed += t.passed;
                failed += t.failed;
                for (_, inner) in t.failures {
                    let file = inner
                        .file_name()
                        .map_or_else(|| "binary.log".into(), |n| n.to_string_lossy().into_owned());
                    let kept = logs.join(format!("fresh-round-{round}-{file}"));
                    let _ = std::fs::write(&kept, std::fs::read(&inner).unwrap_or_default());
                    entry.failures.push((round, kept));
                }
            }
        }
        Err(e) => {
            let entry = tally
                .entry(format!("(round without a tally: {e:#})"))
                .or_default();
            entry.failed += 1;
            entry.failures.push((round, log.to_path_buf()));
            failed += 1;
        }
    }
    if !status.success() && failed == 0 {
        let entry = tally
            .entry(format!("(round: cargo xtask test {status})"))
            .or_default();
        entry.failed += 1;
        entry.failures.push((round, log.to_path_buf()));
        failed += 1;
    }
    (passed, failed)
}

/// Drops the page cache, as on a machine that just booted (root only).
fn drop_page_cache() {
    // SAFETY: sync() has no preconditions; it only flushes dirty pages.
    unsafe { libc::sync() };
    match std::fs::write("/proc/sys/vm/drop_caches", "3") {
        Ok(()) => say("test --fresh", "dropped the page cache"),
        Err(e) => say(
            "test --fresh",
            &format!("page cache kept (drop_caches: {e}); run as root for a cold cache"),
        ),
    }
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
