//! The consumer API's life in `lookout run`: served at once when this
//! agent takes the lease, or after a standby while another agent (the old
//! one of a surge rollout) serves the socket; and handed over in order at
//! shutdown (see [`crate::handover`]).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::RunArgs;
use crate::grpc::{Auth, Health};
use crate::handover::{self, Lease};
use crate::hub::Hub;

/// How long a new agent reads its predecessor's last changes after it
/// got the lease, when the predecessor did not end the stream itself.
const DRAIN: Duration = Duration::from_secs(1);

/// How long a shutting-down agent waits for its consumers' streams to be
/// written out before it lets its successor in.
const FLUSH: Duration = Duration::from_secs(2);

/// How long a shutting-down agent goes on deciding starts while its
/// successor takes over, at most.
const SUCCESSOR_WAIT: Duration = Duration::from_secs(5);

/// How long it goes on once the successor serves: a runtime exec its
/// group received just before is read and decided (reading takes
/// microseconds).
const SETTLE: Duration = Duration::from_millis(100);

/// What serving the socket needs from the flags.
#[derive(Clone)]
struct Config {
    socket: PathBuf,
    group: Option<String>,
    auth: Auth,
    default_deadline: Duration,
    /// `--api-max-connections` (bounded by the open-file limit) and
    /// `--api-max-connections-per-uid`.
    max_connections: (usize, usize),
}

#[derive(Default)]
struct State {
    health: Option<Health>,
    /// The socket's device and inode, once bound.
    bound: Option<(u64, u64)>,
    lease: Option<Lease>,
    ready: bool,
    stopping: bool,
    /// [`Api::hand_over`] ran.
    handed_over: bool,
}

/// The consumer API of one `lookout run`.
#[derive(Clone)]
pub(super) struct Api {
    config: Option<Config>,
    state: Arc<Mutex<State>>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Api {
    /// Serves the socket now, or stands by (the hub too) while another
    /// agent holds the lease, then takes over on `side`. Nothing when
    /// `--no-socket`. The API is a consumer like any other: when it cannot
    /// be served, discovery goes on.
    /// Without `shared` (the socket's directory is not one only root can
    /// write to), no lease: the socket is served at once. Without
    /// `may_stand_by` (embedded: the caller gates through the hub itself,
    /// and a standby hub holds nothing), a lease held by another agent
    /// leaves the socket unserved instead.
    pub(super) fn start(
        args: &RunArgs,
        hub: &Arc<Hub>,
        side: &tokio::runtime::Handle,
        shared: bool,
        may_stand_by: bool,
    ) -> Api {
        let config = (!args.no_socket).then(|| Config {
            socket: args.socket.clone(),
            group: args.socket_group.clone(),
            auth: Auth {
                uids: args.gate_allow_uids.clone(),
                gids: args.gate_allow_gids.clone(),
            },
            default_deadline: args.gate_deadline.min(args.gate_max_deadline),
            max_connections: (
                connection_bound(args.api_max_connections as usize),
                args.api_max_connections_per_uid as usize,
            ),
        });
        let api = Api {
            config,
            state: Arc::new(Mutex::new(State::default())),
        };
        let Some(config) = &api.config else {
            return api;
        };
        if !shared {
            api.serve(hub);
            return api;
        }
        let lease_file = handover::lease_path(&config.socket);
        // Marked before trying: an agent that stops after this try and
        // before the mark would otherwise not wait for this one.
        handover::mark_standby(&config.socket);
        match Lease::try_take(&lease_file) {
            Ok(Some(lease)) => {
                handover::unmark_standby(&config.socket);
                lock(&api.state).lease = Some(lease);
                // No gates yet: a file left by an agent that is gone says so.
                hub.save_subscriptions();
                api.serve(hub);
            }
            Ok(None) if !may_stand_by => {
                handover::unmark_standby(&config.socket);
                tracing::error!(
                    socket = %config.socket.display(),
                    serving_pid = Lease::holder(&lease_file),
                    "consumer API not served: another agent serves this socket (embedded \
                     discovery does not stand by; give it a socket of its own)"
                );
            }
            Ok(None) => {
                hub.stand_by();
                tracing::info!(
                    socket = %config.socket.display(),
                    serving_pid = Lease::holder(&lease_file),
                    "another agent serves the consumer socket; standing by to take it over \
                     when it stops (its changes are mirrored here, so that revisions go on)"
                );
                let (api, hub) = (api.clone(), Arc::clone(hub));
                side.spawn(async move { api.stand_by(hub, lease_file).await });
            }
            Err(e) => {
                handover::unmark_standby(&config.socket);
                tracing::warn!(
                    "cannot use the lease {} ({e:#}); serving the socket without one (a second \
                     agent on this node takes it over at once)",
                    lease_file.display()
                );
                api.serve(hub);
            }
        }
        api
    }

    /// Binds and serves the socket.
    fn serve(&self, hub: &Arc<Hub>) {
        let Some(config) = &self.config else { return };
        match serve(config, Arc::clone(hub)) {
            Ok((id, health)) => {
                let mut s = lock(&self.state);
                health.set(s.ready && !s.stopping);
                s.bound = Some(id);
                s.health = Some(health);
            }
            Err(e) => tracing::error!("consumer API not served: {e:#}"),
        }
    }

    /// Mirrors the serving agent until the lease is ours, then takes over.
    async fn stand_by(self, hub: Arc<Hub>, lease_file: PathBuf) {
        let Some(socket) = self.config.as_ref().map(|c| c.socket.clone()) else {
            return;
        };
        let mirrored_socket = socket.clone();
        let (got, lease_taken) = tokio::sync::oneshot::channel::<()>();
        let lease = async {
            let lease = Lease::wait(lease_file).await;
            let _ = got.send(());
            lease
        };
        let mirror = handover::mirror(
            mirrored_socket,
            Arc::clone(&hub),
            async {
                let _ = lease_taken.await;
            },
            DRAIN,
        );
        let (lease, clean) = tokio::join!(lease, mirror);
        let lease = match lease {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("consumer API not served: waiting for the lease: {e:#}");
                return;
            }
        };
        let got_at = Instant::now();
        {
            let mut s = lock(&self.state);
            if s.stopping || s.handed_over {
                // Stopping too: let a later agent have it.
                drop(lease);
                handover::unmark_standby(&socket);
                return;
            }
            s.lease = Some(lease);
        }
        let t = hub.take_over(clean);
        self.serve(&hub);
        // The old agent decides starts until this mark goes.
        handover::unmark_standby(&socket);
        tracing::info!(
            clean,
            predecessor_last_revision = t.mirrored,
            next_revision = t.next,
            added = t.added,
            removed = t.removed,
            took_ms = got_at.elapsed().as_millis() as u64,
            "took the consumer socket over from the agent that served it"
        );
    }

    /// Discovery runs.
    pub(super) fn ready(&self) {
        let mut s = lock(&self.state);
        s.ready = true;
        if let Some(h) = &s.health {
            h.set(!s.stopping);
        }
    }

    /// The shutdown began: NOT_SERVING.
    pub(super) fn stopping(&self) {
        let mut s = lock(&self.state);
        s.stopping = true;
        if let Some(h) = &s.health {
            h.set(false);
        }
    }

    /// The shutdown's first step, while discovery still runs and decides
    /// starts: every watcher gets its last changes and the end of its
    /// stream (a successor's mirror reads that it has them all), the
    /// socket goes if it is still ours, and then the lease, at which
    /// instant a successor standing by takes over. Returns once that
    /// successor serves (at most [`SUCCESSOR_WAIT`]): until then, a start
    /// it let go while standing by is this agent's to decide. Runs once.
    pub(super) async fn hand_over(&self, hub: &Hub) {
        if std::mem::replace(&mut lock(&self.state).handed_over, true) {
            return;
        }
        hub.close();
        let until = Instant::now() + FLUSH;
        while hub.watches_open() > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The last frames leave the API's thread after its stream ends.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let Some(c) = &self.config else { return };
        // N.B. read before the lease goes: the successor takes it at that
        // instant and, once it serves, removes its standby mark, which a
        // read after the release could then miss (and with it the wait
        // below). Read after it too, for one that stood by meanwhile.
        let waiting = handover::successor(&c.socket);
        {
            let mut s = lock(&self.state);
            crate::grpc::unbind(&c.socket, s.bound);
            s.lease = None;
        }
        let Some(pid) = waiting.or_else(|| handover::successor(&c.socket)) else {
            return;
        };
        let started = Instant::now();
        while handover::successor(&c.socket) == Some(pid) && started.elapsed() < SUCCESSOR_WAIT {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if handover::successor(&c.socket) == Some(pid) {
            tracing::warn!(
                successor_pid = pid,
                waited = ?started.elapsed(),
                "the agent standing by did not take over in time; stopping anyway"
            );
        } else {
            // Execs the successor let go while it stood by, and this
            // agent's group has received but not yet read, are read and
            // decided before discovery stops (it would let them go).
            tokio::time::sleep(SETTLE).await;
            // Its mark also goes when it exits (stopping as well): it took
            // over only if the lease now names it.
            if Lease::holder(&handover::lease_path(&c.socket)) == Some(pid) {
                tracing::info!(
                    successor_pid = pid,
                    took_ms = started.elapsed().as_millis() as u64,
                    "handed the consumer socket over to the agent that stood by"
                );
            } else {
                tracing::warn!(
                    successor_pid = pid,
                    "the agent standing by did not take the lease over (it exited)"
                );
            }
        }
    }
}

/// `--socket-group`, as a gid.
fn socket_group(group: Option<&str>) -> anyhow::Result<Option<u32>> {
    let Some(g) = group else { return Ok(None) };
    Ok(Some(match g.parse::<u32>() {
        Ok(gid) => gid,
        Err(_) => nix::unistd::Group::from_name(g)
            .with_context(|| format!("looking up group {g}"))?
            .with_context(|| format!("--socket-group {g}: no such group"))?
            .gid
            .as_raw(),
    }))
}

/// Creates the socket's directory if missing (0750, `--socket-group`),
/// and checks that only this user may write to it: the files two agents
/// share live there ([`handover::trusted_dir`]).
pub(super) fn prepare_dir(args: &RunArgs) -> anyhow::Result<()> {
    let dir = args.socket.parent().unwrap_or(std::path::Path::new("/"));
    if !dir.exists() {
        let group = socket_group(args.socket_group.as_deref())?;
        crate::grpc::create_socket_dir(dir, group)?;
    }
    handover::trusted_dir(&args.socket)
}

/// Binds the consumer socket and serves it on its own thread; returns the
/// socket's device and inode, and its health statuses.
fn serve(config: &Config, hub: Arc<Hub>) -> anyhow::Result<((u64, u64), Health)> {
    let group = socket_group(config.group.as_deref())?;
    let listener = crate::grpc::bind(&config.socket, group)?;
    let id = {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(&config.socket)
            .with_context(|| format!("stat {}", config.socket.display()))?;
        (m.dev(), m.ino())
    };
    let health = crate::grpc::spawn(
        listener,
        config.socket.clone(),
        hub,
        config.auth.clone(),
        config.default_deadline,
        config.max_connections,
    )?;
    Ok((id, health))
}

/// `--api-max-connections`, at most an eighth of the open-file limit (read
/// after the agent raised it): the API must leave fds for fanotify, and a
/// connection takes two while a write to it waits for its reader
/// (`lookout_api::unix::QuietStream`).
fn connection_bound(asked: usize) -> usize {
    use nix::sys::resource::{Resource, getrlimit};
    let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return asked;
    };
    let bound = usize::try_from(soft / 8).unwrap_or(usize::MAX);
    if asked > bound {
        tracing::warn!(
            asked,
            bound,
            nofile = soft,
            "--api-max-connections lowered to an eighth of the open-file limit"
        );
    }
    asked.min(bound)
}
