//! The floor responders measured beside the agent: the allow-all responder
//! and the work floor.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::host::{cpu_clock_s, give_agent_slice};

/// The responders measured beside the agent, as floors of its figures.
#[derive(Debug, Clone)]
pub struct Floors {
    /// The allow-all responder (lookout-fanotify's `allow_all` example):
    /// what any exec-permission listener pays.
    pub allow_all: PathBuf,
    /// The work floor (this crate's `work_floor` binary): the agent's work
    /// per container on one thread, with none of its safety boundaries.
    pub work: PathBuf,
    /// The BPF object the work floor loads (the agent's argv capture).
    pub bpf_object: PathBuf,
}

/// The allow-all floor responder (lookout-fanotify's `allow_all` example)
/// marking some files: the least any exec-permission listener can do, and
/// so the floor of the agent's CPU per exec. Killed when dropped.
pub(crate) struct Floor {
    pub(crate) child: Child,
}

impl Floor {
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts the allow-all responder on `marked` and waits for its `ready`
    /// line (its log in `dir/floor.err`).
    pub(crate) fn start(bin: &Path, marked: &[&Path], dir: &Path) -> anyhow::Result<Floor> {
        Self::start_with(bin, marked, dir, None)
    }

    /// Starts the work floor on `marked` (the BPF object first), its events
    /// in `dir/floor.out`, and waits for its `ready` line.
    pub(crate) fn start_work(floors: &Floors, marked: &Path, dir: &Path) -> anyhow::Result<Floor> {
        let out = dir.join("floor.out");
        Self::start_with(&floors.work, &[&floors.bpf_object, marked], dir, Some(&out))
    }

    /// Starts `bin` with `args`, its stdout in `out` (or nowhere), and waits
    /// for its `ready` line (its log in `dir/floor.err`).
    pub(crate) fn start_with(
        bin: &Path,
        args: &[&Path],
        dir: &Path,
        out: Option<&Path>,
    ) -> anyhow::Result<Floor> {
        std::fs::create_dir_all(dir)?;
        let err = dir.join("floor.err");
        let stdout = match out {
            Some(o) => Stdio::from(std::fs::File::create(o)?),
            None => Stdio::null(),
        };
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(std::fs::File::create(&err)?)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let floor = Floor { child };
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut floor = floor;
        loop {
            let log = std::fs::read_to_string(&err).unwrap_or_default();
            if log.contains("ready: allowing") {
                give_agent_slice(floor.child.id());
                return Ok(floor);
            }
            if let Ok(Some(status)) = floor.child.try_wait() {
                bail!("the floor responder exited ({status}):\n{log}");
            }
            if Instant::now() > deadline {
                bail!("the floor responder never became ready:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Its CPU time so far, in seconds.
    pub(crate) fn cpu_s(&self) -> f64 {
        cpu_clock_s(self.child.id())
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How many `kind` lines (`added`, `removed`) the work floor started in
/// `dir` printed for containers whose id holds `prefix`.
pub(crate) fn work_floor_lines(dir: &Path, kind: &str, prefix: &str) -> usize {
    let kind = format!("\"event\":\"{kind}\"");
    std::fs::read_to_string(dir.join("floor.out"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&kind) && l.contains(prefix))
        .count()
}
