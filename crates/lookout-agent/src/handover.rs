//! Two agents on one node, as a surge rollout runs them: who serves the
//! consumer socket, and how they share what must happen once.
//!
//! - **The lease** ([`Lease`]): an exclusive `flock(2)` on a file beside
//!   the socket. The agent that holds it serves the socket; a new agent
//!   that finds it held waits in *standby*. The kernel drops the lock when
//!   its holder closes it or dies (even by SIGKILL), and the waiting agent
//!   takes it at that instant.
//! - **The mirror** ([`mirror`]): a standby agent follows the serving
//!   agent's `Watch` from revision 0 and applies every change to its own
//!   hub with the same revision, so that when it takes over, a consumer
//!   resumes from its last revision with no change lost or repeated.
//! - **Claims** ([`Claims`]): an action both agents would take for one
//!   container (a hook, a Kubernetes Event) is claimed with a lock on a
//!   file named after it. The first agent runs it and marks it done; the
//!   other waits while it runs and skips it once done. A claim whose
//!   holder died unfinished is taken over and run: an action may run twice
//!   only when its first runner was killed while running it, never zero
//!   times.
//!
//! - **The book** ([`Book`]): the serving agent's gate subscriptions, for
//!   its successor. While it stands by, a new agent lets every start go on
//!   at once: the serving agent holds it too, and its gates decide (the
//!   kernel asks one fanotify group after the other, so neither may wait
//!   for the other's answer). At the handover the old agent goes on
//!   deciding until the new one serves, with the old one's gates parked:
//!   their subscribers (disconnected by the old agent's exit) find their
//!   holds waiting, and each gate's failure policy decides the holds of a
//!   subscriber that does not come back. No start escapes a fail-closed
//!   gate during an upgrade.
//!
//! The files live in the socket's directory (`/run/lookout` on a node),
//! which both agents mount. They are created by root, 0600, never through
//! a symbolic link.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use lookout_api::v1 as pb;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::hub::{FailurePolicy, Filter, Hub, Live, Subscription, SubscriptionStore};
use crate::wire;

fn open_private(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc_o_nofollow())
        .open(path)
}

/// `O_NOFOLLOW`: a symbolic link planted at a lease or claim path is
/// refused, not followed.
fn libc_o_nofollow() -> i32 {
    nix::fcntl::OFlag::O_NOFOLLOW.bits()
}

/// The lease: held while this agent serves the consumer socket.
#[derive(Debug)]
pub struct Lease {
    _lock: Flock<File>,
}

/// The lease file for the socket at `socket`: `.<name>.lease` beside it.
pub fn lease_path(socket: &Path) -> PathBuf {
    beside(socket, "lease")
}

fn beside(socket: &Path, what: &str) -> PathBuf {
    let dir = socket.parent().unwrap_or(Path::new("/"));
    let name = socket
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "lookout.sock".into());
    dir.join(format!(".{name}.{what}"))
}

impl Lease {
    /// Takes the lease if nobody holds it; `None` if another agent does.
    pub fn try_take(path: &Path) -> anyhow::Result<Option<Lease>> {
        let f = open_private(path).with_context(|| format!("opening {}", path.display()))?;
        match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(Lease::mark(lock))),
            Err((_, Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(e).with_context(|| format!("flock {}", path.display())),
        }
    }

    /// Waits until the holder lets go (it exits, or dies), then takes the
    /// lease. The wait is a blocking `flock(2)` on a thread of its own.
    pub async fn wait(path: PathBuf) -> anyhow::Result<Lease> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("lookout-lease".into())
            .spawn(move || {
                let r = open_private(&path)
                    .with_context(|| format!("opening {}", path.display()))
                    .and_then(|f| {
                        Flock::lock(f, FlockArg::LockExclusive)
                            .map_err(|(_, e)| e)
                            .with_context(|| format!("flock {}", path.display()))
                    })
                    .map(Lease::mark);
                let _ = tx.send(r);
            })
            .context("spawning the lease thread")?;
        rx.await.context("the lease thread ended")?
    }

    /// The holder's pid, as it wrote it (for logs).
    pub fn holder(path: &Path) -> Option<u32> {
        read_pid(path)
    }

    fn mark(mut lock: Flock<File>) -> Lease {
        // The holder's pid, for the logs of the agent that waits.
        let _ = lock.set_len(0);
        let _ = lock.rewind();
        let _ = writeln!(lock, "{}", std::process::id());
        Lease { _lock: lock }
    }
}

/// The standby marker beside `socket`: `.<name>.standby`, holding the
/// pid of the agent that waits for the lease. The serving agent, when it
/// stops, waits for that agent to serve before it stops deciding starts.
fn standby_path(socket: &Path) -> PathBuf {
    beside(socket, "standby")
}

/// The pid written in the file at `path` (a lease or standby mark).
fn read_pid(path: &Path) -> Option<u32> {
    let b = read_limited(path, 32)?;
    String::from_utf8(b).ok()?.trim().parse().ok()
}

/// Marks this process as the one waiting for the lease.
pub fn mark_standby(socket: &Path) {
    let pid = format!("{}\n", std::process::id());
    if let Err(e) = write_whole(&standby_path(socket), pid.as_bytes()) {
        tracing::warn!(%e, "cannot mark this agent as standing by; the serving agent will not wait for it");
    }
}

/// Removes this process's standby mark (it serves now, or stops).
pub fn unmark_standby(socket: &Path) {
    let path = standby_path(socket);
    let ours = read_pid(&path) == Some(std::process::id());
    if ours {
        let _ = std::fs::remove_file(path);
    }
}

/// The pid of another live agent standing by for the socket, if any.
pub fn successor(socket: &Path) -> Option<u32> {
    let pid = read_pid(&standby_path(socket))?;
    let alive = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .is_some_and(|p| nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), None).is_ok());
    (alive && pid != std::process::id()).then_some(pid)
}

/// What [`Claims::once`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Once {
    /// This agent ran it.
    Ran,
    /// Another agent had run it.
    Done,
    /// Another agent was still running it when the wait ended.
    Busy,
}

/// Actions claimed once between the agents on a node (see the module
/// docs).
#[derive(Debug, Clone)]
pub struct Claims {
    dir: Arc<PathBuf>,
}

/// How long a claim file is kept after its last change: both agents reach
/// a container's claims within seconds of each other (they see the same
/// `create` and the same exit), so this is ample; each file costs the
/// node's tmpfs a page.
pub const CLAIM_TTL: Duration = Duration::from_secs(600);

/// How often [`Claims::sweep`] runs.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);

const DONE: &[u8] = b"done\n";

impl Claims {
    /// The claims beside the socket at `socket` (`.<name>.claims/`),
    /// created 0700 if missing. Refused if it is not a directory of ours.
    pub fn open(socket: &Path) -> anyhow::Result<Claims> {
        let dir = beside(socket, "claims");
        match std::fs::symlink_metadata(&dir) {
            Ok(m) => {
                if !m.is_dir()
                    || m.uid() != nix::unistd::geteuid().as_raw()
                    || m.mode() & 0o022 != 0
                {
                    anyhow::bail!(
                        "{} is not a directory that only this user can write; not using it",
                        dir.display()
                    );
                }
            }
            Err(_) => {
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&dir)
                    .or_else(|e| {
                        // Another agent made it between the check and now.
                        if e.kind() == std::io::ErrorKind::AlreadyExists {
                            Ok(())
                        } else {
                            Err(e)
                        }
                    })
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
        }
        Ok(Claims { dir: Arc::new(dir) })
    }

    /// Runs `act` unless another agent ran it; waits (at most `wait`)
    /// while another runs it. `key` names the action (see [`claim_key`]).
    /// A claim that cannot be made (an I/O error) runs `act` anyway.
    pub async fn once<F, Fut>(&self, key: &str, wait: Duration, act: F) -> Once
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let path = self.dir.join(key);
        let until = Instant::now() + wait;
        let mut f = match open_private(&path) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(claim = %path.display(), %e, "cannot claim; running it anyway");
                act().await;
                return Once::Ran;
            }
        };
        let mut lock = loop {
            match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => break lock,
                Err((back, Errno::EWOULDBLOCK)) => {
                    if Instant::now() >= until {
                        return Once::Busy;
                    }
                    f = back;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err((_, e)) => {
                    tracing::warn!(claim = %path.display(), %e, "cannot lock the claim; running it anyway");
                    act().await;
                    return Once::Ran;
                }
            }
        };
        let mut seen = Vec::new();
        let _ = (&mut *lock).take(16).read_to_end(&mut seen);
        if seen == DONE {
            return Once::Done;
        }
        act().await;
        let _ = lock.rewind();
        let _ = lock.write_all(DONE);
        Once::Ran
    }

    /// Removes claims unchanged for [`CLAIM_TTL`], except those of
    /// containers for which `live` holds (given the claim's first part,
    /// [`claim_prefix`]): a container's hooks stay claimed while it lives,
    /// so that an agent that starts later (a rollout's) and finds it does
    /// not run its hooks again.
    pub fn sweep(&self, live: impl Fn(&str) -> bool) -> usize {
        // Never through a directory swapped for a link since it was opened.
        let ours = std::fs::symlink_metadata(&*self.dir)
            .is_ok_and(|m| m.is_dir() && m.uid() == nix::unistd::geteuid().as_raw());
        if !ours {
            return 0;
        }
        let Ok(entries) = std::fs::read_dir(&*self.dir) else {
            return 0;
        };
        let now = std::time::SystemTime::now();
        let mut removed = 0;
        for e in entries.flatten() {
            let name = e.file_name();
            let prefix = name.to_string_lossy();
            let prefix = prefix.split('.').next().unwrap_or_default();
            if live(prefix) {
                continue;
            }
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > CLAIM_TTL);
            if old && std::fs::remove_file(e.path()).is_ok() {
                removed += 1;
            }
        }
        removed
    }
}

/// Writes `path` through a temporary file renamed over it, 0600.
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc_o_nofollow())
        .open(&tmp)?;
    let written = f.write_all(bytes);
    drop(f);
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The file at `path` (never through a symbolic link), at most `limit`
/// bytes; `None` if it is missing, unreadable or longer.
fn read_limited(path: &Path, limit: u64) -> Option<Vec<u8>> {
    // O_NONBLOCK: a FIFO planted there does not hang the open.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_o_nofollow() | nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut out = Vec::new();
    f.take(limit + 1).read_to_end(&mut out).ok()?;
    (out.len() as u64 <= limit).then_some(out)
}

/// What a serving agent leaves for its successor (see the module docs):
/// `.<socket>.gates` beside the socket.
#[derive(Debug, Clone)]
pub struct Book {
    gates: PathBuf,
}

/// The gates file's form of a subscription.
#[derive(serde::Serialize, serde::Deserialize)]
struct GateEntry {
    name: String,
    deadline_ms: u64,
    fail_closed: bool,
    /// The subscriber's uid: only the same uid (or root) takes the parked
    /// subscription back.
    #[serde(default)]
    uid: u32,
    runtimes: Vec<String>,
    namespaces: Vec<String>,
    pod_labels: Vec<(String, String)>,
    annotations: Vec<(String, String)>,
    // N.B. a predecessor's book may lack the later criteria: then its
    // subscribers set none. Never drop one on the way through: a gate
    // that selected by workload would come back selecting everything.
    #[serde(default)]
    workloads: Vec<String>,
    #[serde(default)]
    cgroup_ids: Vec<u64>,
    #[serde(default)]
    image_digests: Vec<String>,
}

/// The gates file's limit. 64 subscribers with the largest filters
/// allowed (64 entries of 1 KiB in each of six string lists) take 24 MiB
/// of plain strings; escaped control characters could make that six
/// times as much, so subscriptions past this are left out (and logged).
const GATES_LIMIT: u64 = 16 << 20;

impl Book {
    /// The book beside `socket`.
    pub fn new(socket: &Path) -> Book {
        Book {
            gates: beside(socket, "gates"),
        }
    }
}

/// The hub saves its gate subscriptions in the gates file, with their
/// peers' uids, and a successor's hub loads them from there.
impl SubscriptionStore for Book {
    fn save(&self, subs: &[(Subscription, u32)]) {
        let mut out = b"[".to_vec();
        let mut left_out = 0;
        for (s, uid) in subs {
            let entry = GateEntry {
                name: s.name.clone(),
                deadline_ms: s.deadline.as_millis() as u64,
                fail_closed: s.on_failure == FailurePolicy::Closed,
                uid: *uid,
                runtimes: s.filter.runtimes.clone(),
                namespaces: s.filter.namespaces.clone(),
                pod_labels: s.filter.pod_labels.clone(),
                annotations: s.filter.annotations.clone(),
                workloads: s.filter.workloads.clone(),
                cgroup_ids: s.filter.cgroup_ids.clone(),
                image_digests: s.filter.image_digests.clone(),
            };
            let Ok(b) = serde_json::to_vec(&entry) else {
                left_out += 1;
                continue;
            };
            if (out.len() + b.len() + 2) as u64 > GATES_LIMIT {
                left_out += 1;
                continue;
            }
            if out.len() > 1 {
                out.push(b',');
            }
            out.extend_from_slice(&b);
        }
        out.push(b']');
        if left_out > 0 {
            tracing::warn!(
                left_out,
                "gate subscriptions too large to record for a successor: a rollout would not \
                 hold starts for them until their subscribers are back"
            );
        }
        let result = write_whole(&self.gates, &out);
        if let Err(e) = result {
            tracing::warn!(
                file = %self.gates.display(),
                %e,
                "cannot record the gate subscriptions for a successor"
            );
        }
    }

    /// None if the serving agent recorded none, or the file is unreadable
    /// (that is logged).
    fn load(&self) -> Vec<(Subscription, u32)> {
        let Some(bytes) = read_limited(&self.gates, GATES_LIMIT) else {
            return Vec::new();
        };
        match serde_json::from_slice::<Vec<GateEntry>>(&bytes) {
            Ok(entries) => entries
                .into_iter()
                .map(|e| {
                    let sub = Subscription {
                        name: e.name,
                        filter: Filter {
                            runtimes: e.runtimes,
                            namespaces: e.namespaces,
                            pod_labels: e.pod_labels,
                            annotations: e.annotations,
                            workloads: e.workloads,
                            cgroup_ids: e.cgroup_ids,
                            image_digests: e.image_digests,
                        },
                        deadline: Duration::from_millis(e.deadline_ms),
                        on_failure: if e.fail_closed {
                            FailurePolicy::Closed
                        } else {
                            FailurePolicy::Open
                        },
                    };
                    (sub, e.uid)
                })
                .collect(),
            Err(e) => {
                tracing::warn!(
                    file = %self.gates.display(),
                    %e,
                    "the serving agent's gate subscriptions are unreadable; ignored"
                );
                Vec::new()
            }
        }
    }
}

/// A claim's file name: the container id (when it is a plain one, else
/// its digest) and a digest of `what` (the stage, and the hook as
/// configured: a hook changed by the upgrade is another hook, and runs).
pub fn claim_key(id: &str, what: &str) -> String {
    use sha2::Digest;
    let what = &hex(&sha2::Sha256::digest(what.as_bytes()))[..24];
    format!("{}.{what}", claim_prefix(id))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The first part of the claims of container `id`: the id when it is a
/// plain one, else its digest.
pub fn claim_prefix(id: &str) -> String {
    use sha2::Digest;
    let plain = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        && !id.starts_with('-');
    if plain {
        id.to_owned()
    } else {
        format!("h{}", &hex(&sha2::Sha256::digest(id.as_bytes()))[..32])
    }
}

/// Whether the directory of `socket` may hold the files that coordinate
/// two agents: owned by this user (root) and writable by nobody else. A
/// socket placed in a directory others can write to (`--socket /tmp/x`)
/// gets none: anyone there could hold the lease, plant gates or claims.
pub fn trusted_dir(socket: &Path) -> anyhow::Result<()> {
    let dir = socket.parent().unwrap_or(Path::new("/"));
    let m = std::fs::symlink_metadata(dir).with_context(|| format!("stat {}", dir.display()))?;
    let euid = nix::unistd::geteuid().as_raw();
    if !m.is_dir() {
        anyhow::bail!("{} is not a directory", dir.display());
    }
    if m.uid() != euid || m.mode() & 0o022 != 0 {
        anyhow::bail!(
            "{} is not owned by uid {euid} or is writable by others (mode {:o})",
            dir.display(),
            m.mode() & 0o7777
        );
    }
    Ok(())
}

/// Follows the serving agent's `Watch` into `hub` (which is in standby)
/// until `stop` resolves and then until the stream ends, or for `drain`
/// after `stop` at most. Returns whether the predecessor ended the stream
/// itself ([`wire::CLOSING`]) after its last change: then nothing it published
/// is missing here.
pub async fn mirror(
    socket: PathBuf,
    hub: Arc<Hub>,
    stop: impl std::future::Future<Output = ()>,
    drain: Duration,
) -> bool {
    tokio::pin!(stop);
    let mut stopped_at: Option<tokio::time::Instant> = None;
    let mut pause = Duration::from_millis(20);
    loop {
        let since = hub.revision_mirrored();
        let stream = async {
            let client = lookout_client::Client::connect_with(
                &socket,
                lookout_client::ConnectOptions::new().retry_for(Duration::ZERO),
            )
            .await
            .ok()?;
            client
                .grpc()
                .watch(pb::WatchRequest {
                    since,
                    filter: None,
                })
                .await
                .ok()
                .map(tonic::Response::into_inner)
        };
        let mut stream = tokio::select! {
            s = stream => s,
            () = &mut stop, if stopped_at.is_none() => {
                stopped_at = Some(tokio::time::Instant::now());
                continue;
            }
        };
        let mut snapshot: Vec<Live> = Vec::new();
        while let Some(s) = stream.as_mut() {
            let deadline = stopped_at.map(|t| t + drain);
            let message = tokio::select! {
                m = s.message() => m,
                () = &mut stop, if stopped_at.is_none() => {
                    stopped_at = Some(tokio::time::Instant::now());
                    continue;
                }
                () = sleep_until(deadline) => return false,
            };
            match message {
                Ok(Some(e)) => {
                    pause = Duration::from_millis(20);
                    apply(&hub, e, &mut snapshot);
                }
                Ok(None) => break,
                Err(status) => {
                    if status.code() == tonic::Code::Unavailable
                        && status.message() == wire::CLOSING
                    {
                        return true;
                    }
                    tracing::debug!(%status, "standby: the serving agent's watch ended");
                    break;
                }
            }
        }
        if let Some(t) = stopped_at {
            // The lease is ours: the predecessor is gone, or going without
            // a clean end. Whatever it had not sent is lost to us.
            if tokio::time::Instant::now() >= t + drain || stream.is_none() {
                return false;
            }
        }
        let wait = tokio::time::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(1));
        tokio::select! {
            () = wait => {}
            () = &mut stop, if stopped_at.is_none() => {
                stopped_at = Some(tokio::time::Instant::now());
            }
        }
    }
}

async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// The most containers a mirrored snapshot keeps.
const MAX_MIRRORED: usize = 1 << 18;

/// One `WatchEvent` of the serving agent, applied to the standby hub.
fn apply(hub: &Hub, e: pb::WatchEvent, snapshot: &mut Vec<Live>) {
    use pb::watch_event::Kind;
    match Kind::try_from(e.kind).ok() {
        Some(Kind::Snapshot) => {
            // Bounded: more containers than a node runs is not a snapshot.
            if let Some(c) = e.container
                && snapshot.len() < MAX_MIRRORED
            {
                snapshot.push(wire::live_of(c));
            }
        }
        Some(Kind::SnapshotEnd) => {
            tracing::info!(
                revision = e.revision,
                containers = snapshot.len(),
                "standby: mirroring the serving agent's changes from its snapshot"
            );
            hub.mirror_snapshot(e.revision, std::mem::take(snapshot));
        }
        _ => {
            let kind = e.kind;
            match wire::change_of(e) {
                Some(change) => hub.mirror_change(change),
                None => tracing::debug!(kind, "standby: skipping a watch event it cannot apply"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_keys_are_plain_file_names_and_differ_by_action() {
        let a = claim_key("abc123", "prestart sh -c true");
        let b = claim_key("abc123", "prestart sh -c false");
        assert_ne!(a, b);
        assert!(a.starts_with("abc123."), "{a}");
        for hostile in ["../../etc/passwd", "", "-rf", "a/b", &"x".repeat(300)] {
            let k = claim_key(hostile, "x");
            assert!(
                !k.contains('/') && !k.starts_with('-') && k.len() < 80,
                "{k}"
            );
        }
    }

    #[tokio::test]
    async fn a_claim_runs_once_and_the_second_waits_for_the_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let claims = Claims::open(&dir.path().join("s.sock")).expect("claims");
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let run = |runs: Arc<std::sync::atomic::AtomicU32>| async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        };
        let (a, b) = tokio::join!(
            claims.once("k1", Duration::from_secs(5), || run(Arc::clone(&runs))),
            claims.once("k1", Duration::from_secs(5), || run(Arc::clone(&runs))),
        );
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        let mut outcomes = [a, b];
        outcomes.sort_by_key(|o| *o as u8);
        assert_eq!(outcomes, [Once::Ran, Once::Done]);
        // Busy: the other holds it past the wait. Ordered by channels, not
        // by time: `quick` tries once `slow` runs, and `slow` ends only
        // after `quick` gave up.
        let (holding, held) = tokio::sync::oneshot::channel::<()>();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let slow = claims.once("k2", Duration::from_secs(5), move || async move {
            let _ = holding.send(());
            let _ = released.await;
        });
        let quick = async {
            held.await.expect("slow runs its action");
            let q = claims
                .once("k2", Duration::from_millis(50), || async {
                    panic!("runs while held")
                })
                .await;
            let _ = release.send(());
            q
        };
        let (_, q) = tokio::join!(slow, quick);
        assert_eq!(q, Once::Busy);
    }

    #[test]
    fn the_book_gives_back_the_subscriptions_saved_in_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let book = Book::new(&dir.path().join("s.sock"));
        assert!(book.load().is_empty(), "nothing saved yet");
        let sub = Subscription {
            name: "tracer".into(),
            filter: Filter {
                runtimes: vec!["runc".into()],
                namespaces: vec!["default".into()],
                pod_labels: vec![("app".into(), "web".into())],
                annotations: vec![("a".into(), "b".into())],
                workloads: vec!["Deployment/shop/api".into()],
                cgroup_ids: vec![4242],
                image_digests: vec!["sha256:abc".into()],
            },
            deadline: Duration::from_millis(300),
            on_failure: FailurePolicy::Closed,
        };
        book.save(&[(sub.clone(), 1000)]);
        let loaded = book.load();
        assert_eq!(loaded.len(), 1);
        let (got, uid) = &loaded[0];
        assert_eq!(*uid, 1000);
        assert_eq!(
            (&got.name, &got.filter, got.deadline, got.on_failure),
            (&sub.name, &sub.filter, sub.deadline, sub.on_failure)
        );
    }

    #[test]
    fn the_lease_is_exclusive_and_free_once_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = lease_path(&dir.path().join("s.sock"));
        let first = Lease::try_take(&path).expect("take").expect("free");
        assert_eq!(Lease::holder(&path), Some(std::process::id()));
        // flock locks belong to the open file description: a second open
        // in this process conflicts like another process would.
        assert!(Lease::try_take(&path).expect("take").is_none());
        drop(first);
        assert!(Lease::try_take(&path).expect("take").is_some());
    }

    #[test]
    fn a_symlink_at_the_lease_path_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = lease_path(&dir.path().join("s.sock"));
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &path).expect("symlink");
        assert!(Lease::try_take(&path).is_err());
        assert!(!dir.path().join("elsewhere").exists());
    }
}
