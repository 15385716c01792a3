//! `cargo xtask bench --only nri`: lookout in NRI mode on a real CRI node
//! (containerd 1.7 with NRI, `lookout_testsupport::cri::CriNode`), driven
//! like a kubelet.
//!
//! - How long after the kubelet's StartContainer call the agent's `added`
//!   event is stamped (CLOCK_MONOTONIC on both sides: the event's
//!   `monotonic_ns` against the clock read just before the call).
//! - How long StartContainer takes with no agent and with `lookout run
//!   --mode nri` attached. Blocks of pods alternate without and with the
//!   agent, so that a noisy machine drifts both sides alike.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lookout_testsupport::cri::{BUSYBOX_IMAGE, CriNode, Kubelet, PodSpec};
use serde_json::{Value, json};

/// Pods per block; blocks alternate without and with the agent.
const BLOCK: usize = 10;
const BLOCKS: usize = 4;

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The release agent in `--mode nri` on `node`, its `added` stamps by
/// container id.
struct Agent {
    child: std::process::Child,
    added: Arc<Mutex<HashMap<String, u64>>>,
}

impl Agent {
    fn start(lookout: &Path, node: &CriNode, work: &Path) -> anyhow::Result<Agent> {
        let log = work.join("agent.log");
        let mut child = std::process::Command::new(lookout)
            .args(["run", "--mode", "nri", "--output", "json", "--no-socket"])
            .args(["--listen", "127.0.0.1:0", "--no-default-runtimes"])
            .arg("--nri-socket")
            .arg(node.nri_socket())
            .env("LOOKOUT_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting lookout run --mode nri")?;
        let stdout = child.stdout.take().context("the agent's stdout")?;
        let added: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
        let seen = Arc::clone(&added);
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                let Ok(e) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if e["event"] == "added"
                    && let (Some(id), Some(ns)) =
                        (e["container"]["id"].as_str(), e["monotonic_ns"].as_u64())
                    && let Ok(mut m) = seen.lock()
                {
                    m.insert(id.to_owned(), ns);
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while !std::fs::read_to_string(&log)?.contains("lookout_agent::run: ready") {
            if Instant::now() > deadline {
                bail!(
                    "the agent was not ready in 20 s:\n{}",
                    std::fs::read_to_string(&log)?
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Agent { child, added })
    }

    /// `id`'s `added` stamp, waiting up to 5 s for it.
    fn added(&self, id: &str) -> anyhow::Result<u64> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(ns) = self.added.lock().ok().and_then(|m| m.get(id).copied()) {
                return Ok(ns);
            }
            if Instant::now() > deadline {
                bail!("no added event for {id}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// One pod: StartContainer's duration, and with an agent the time from the
/// call to the `added` stamp.
fn one_pod(
    kubelet: &mut Kubelet,
    agent: Option<&Agent>,
    n: usize,
) -> anyhow::Result<(u64, Option<u64>)> {
    let spec = PodSpec::new("bench", &format!("nri-{n}")).container(
        "app",
        BUSYBOX_IMAGE,
        &["sleep", "300"],
    );
    let mut pod = kubelet
        .create_pod(&spec)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let t0 = monotonic_ns();
    kubelet
        .start_pod(&mut pod)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let start_us = pod.start_took.first().map_or(0, |d| d.as_micros() as u64);
    let to_added = match agent {
        Some(a) => Some(a.added(&pod.container_ids[0])?.saturating_sub(t0) / 1000),
        None => None,
    };
    kubelet
        .remove_pod(&pod)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((start_us, to_added))
}

fn percentiles(mut v: Vec<u64>) -> Value {
    v.sort_unstable();
    let at = |q: f64| {
        v.get(((v.len() as f64 - 1.0) * q).round() as usize)
            .copied()
    };
    json!({ "n": v.len(), "p50": at(0.5), "p99": at(0.99), "max": v.last() })
}

/// Runs the NRI bench in `work` with the release agent `lookout`.
pub fn bench_nri(lookout: &Path, work: &Path) -> anyhow::Result<Value> {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    let node = CriNode::start().context("starting containerd 1.7 (cargo xtask test fetches it)")?;
    let mut kubelet = node.kubelet().context("CRI client")?;
    // One pod first: images unpacked, caches warm.
    one_pod(&mut kubelet, None, 0)?;
    let (mut without, mut with, mut to_added) = (Vec::new(), Vec::new(), Vec::new());
    let mut n = 1;
    for block in 0..BLOCKS {
        let agent = if block % 2 == 1 {
            Some(Agent::start(lookout, &node, work)?)
        } else {
            None
        };
        for _ in 0..BLOCK {
            let (start, added) = one_pod(&mut kubelet, agent.as_ref(), n)?;
            n += 1;
            match added {
                Some(a) => {
                    with.push(start);
                    to_added.push(a);
                }
                None => without.push(start),
            }
        }
    }
    let p50 = |v: &[u64]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    Ok(json!({
        "start_container_us": {
            "without_agent": percentiles(without.clone()),
            "with_agent_nri": percentiles(with.clone()),
            "added_p50_us": p50(&with) as i64 - p50(&without) as i64,
        },
        "start_call_to_added_us": percentiles(to_added),
    }))
}

pub fn print(v: &Value) {
    let s = &v["start_container_us"];
    println!("NRI (containerd 1.7.24, CRI StartContainer of a one-container pod)");
    println!("| | n | p50 | p99 | max |");
    println!("|---|---|---|---|---|");
    for (label, row) in [
        ("StartContainer, no agent (us)", &s["without_agent"]),
        (
            "StartContainer, lookout --mode nri (us)",
            &s["with_agent_nri"],
        ),
        (
            "StartContainer call -> added (us)",
            &v["start_call_to_added_us"],
        ),
    ] {
        println!(
            "| {label} | {} | {} | {} | {} |",
            row["n"], row["p50"], row["p99"], row["max"]
        );
    }
    println!("added to StartContainer at p50: {} us", s["added_p50_us"]);
}
