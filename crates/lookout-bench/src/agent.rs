//! The agent under measurement: a `lookout run` child, optionally in a
//! cgroup namespace of its own.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::events::{Events, events_in};
use crate::util::say;

/// A `lookout run --output json` child, stopped (SIGTERM, then reaped) when
/// dropped, so that a failed benchmark leaves no agent behind.
pub(crate) struct Agent {
    child: Child,
    pub(crate) out: PathBuf,
    err: PathBuf,
}

/// The cgroup agents run in with `--agent-cgroup-namespace`.
pub(crate) static AGENT_CGROUP: std::sync::OnceLock<AgentCgroup> = std::sync::OnceLock::new();

/// A cgroup (v2) that agents are started in, each in a cgroup namespace
/// rooted there: as a DaemonSet's pod sees the node's cgroups.
pub(crate) struct AgentCgroup {
    dir: PathBuf,
}

impl AgentCgroup {
    /// Makes `lookout-bench-agents` under the cgroup2 mount, once.
    pub(crate) fn make() -> anyhow::Result<()> {
        let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
        let mount = mounts
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() > 2 && f[2] == "cgroup2")
            .map(|f| PathBuf::from(f[1]))
            .context("--agent-cgroup-namespace: no cgroup2 hierarchy is mounted")?;
        let dir = mount.join("lookout-bench-agents");
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
        say(
            "bench",
            &format!(
                "agents run in {} and a cgroup namespace of their own",
                dir.display()
            ),
        );
        let _ = AGENT_CGROUP.set(AgentCgroup { dir });
        Ok(())
    }

    /// `command` (a `lookout run`), started in this cgroup and a new cgroup
    /// namespace, with this process as the host's: the shell and
    /// `unshare` exec, so the agent keeps the pid spawned.
    pub(crate) fn wrap(&self, command: &Command) -> Command {
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg("echo $$ > \"$0/cgroup.procs\" && exec unshare --cgroup \"$@\"")
            .arg(&self.dir)
            .arg(command.get_program())
            .args(command.get_args())
            .arg(format!("--host-namespaces-pid={}", std::process::id()));
        sh
    }
}

/// A BPF file system of the benchmark's own (mounted at the first agent's
/// start), where each agent pins its container maps in a directory of its
/// own: what a node's agent writes, without the node's /sys/fs/bpf. An
/// agent of a revision before the maps ignores the variable.
static PIN_FS: std::sync::Mutex<Option<(PathBuf, u32)>> = std::sync::Mutex::new(None);

/// Unmounts the benchmark's BPF file system when dropped.
pub(crate) struct PinFsGuard;

impl Drop for PinFsGuard {
    fn drop(&mut self) {
        let taken = PIN_FS.lock().ok().and_then(|mut fs| fs.take());
        if let Some((dir, _)) = taken {
            let _ = Command::new("umount").arg("-l").arg(&dir).status();
            let _ = std::fs::remove_dir(&dir);
        }
    }
}

/// A new pin directory for an agent (`None`, said once, if no BPF file
/// system can be mounted: the agents then run without maps).
fn next_pin_dir() -> Option<PathBuf> {
    let mut fs = PIN_FS.lock().ok()?;
    if fs.is_none() {
        let dir = std::env::temp_dir().join(format!("lookout-bench-bpffs-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let mounted = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            say(
                "bench",
                "cannot mount a BPF file system: agents run without pinned maps",
            );
            return None;
        }
        *fs = Some((dir, 0));
    }
    let (dir, n) = fs.as_mut()?;
    *n += 1;
    Some(dir.join(format!("agent-{n}")))
}

impl Agent {
    /// Starts the agent with stdout and stderr in `work` and waits for its
    /// `ready` line; returns it and the time to ready.
    pub(crate) fn start(
        bin: &Path,
        work: &Path,
        args: &[&str],
    ) -> anyhow::Result<(Agent, Duration)> {
        let out = work.join("agent.out");
        let err = work.join("agent.err");
        let t = Instant::now();
        let mut command = Command::new(bin);
        command.args(["run", "--output", "json"]).args(args);
        if let Some(pins) = next_pin_dir() {
            command.env("LOOKOUT_BPF_PIN_DIR", pins);
        }
        if let Some(cg) = AGENT_CGROUP.get() {
            command = cg.wrap(&command);
        }
        let child = command
            // The start-up phases are a debug line (see `startup`).
            .env_remove("LOOKOUT_LOG")
            .env("RUST_LOG", "info,lookout_agent::run::startup=debug")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out)?)
            .stderr(std::fs::File::create(&err)?)
            .spawn()
            .context("starting lookout")?;
        let agent = Agent { child, out, err };
        let deadline = Instant::now() + Duration::from_secs(30);
        // `lookout::run: ready` from the binary's own module, or
        // `lookout_agent::run: ready` since the agent is a library.
        while !std::fs::read_to_string(&agent.err)
            .unwrap_or_default()
            .contains("::run: ready")
        {
            if Instant::now() > deadline {
                bail!(
                    "lookout never became ready:\n{}",
                    std::fs::read_to_string(&agent.err).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok((agent, t.elapsed()))
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the agent printed on stdout (its events) so far.
    pub(crate) fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Everything the agent logged so far.
    pub(crate) fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Events by container id: (added ns, removed ns).
    pub(crate) fn events(&self) -> Events {
        events_in(&self.out)
    }

    /// Stops the agent (SIGTERM) and reaps it.
    pub(crate) fn stop(self) {
        drop(self);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // N.B. SIGTERM, not SIGKILL: the agent removes its fanotify marks
        // and its socket on the way out.
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}
