//! OCI hooks and Kubernetes Events for the containers lookout reports.
//!
//! [`HookSink`] sits after the merger (so each container gets its hooks
//! once) and before stdout. On `added` it starts the prestart-stage hooks
//! on a task; for a container the runtime hook reported while still
//! `created`, it also registers a *start barrier*, which the runtime hook
//! awaits (bounded by `--hook-timeout`) before it lets `runc start` run.
//! On `removed` it starts the poststop hooks with status `stopped`. Hooks
//! for containers found after they started (informer, state scan) carry
//! the `io.lookout.hook.late` annotation. Nothing here blocks the caller:
//! every hook runs on its own task with its own timeout.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lookout_model::{Chain, ContainerEvent, EventKind, Sink, Source, Status};
use lookout_oci_hooks::oci_spec::runtime::{ContainerState, Hook, HookBuilder};
use lookout_oci_hooks::{HooksDirs, RunOptions, Target, run_hook, state_of};
use std::sync::atomic::AtomicU64;
use tokio::sync::watch;

use crate::handover::{CLAIM_TTL, Claims, Once, claim_key};
use crate::hub::Counted;
use crate::k8s_events::Events;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct HookSettings {
    /// `--prestart CMD` (each through `sh -c`).
    pub prestart: Vec<String>,
    /// `--poststop CMD`.
    pub poststop: Vec<String>,
    /// `--hooks-dir DIR`, later ones override earlier ones by file name.
    pub dirs: Vec<PathBuf>,
    /// `--hook-timeout`: each hook's default timeout, and the longest a
    /// runtime's `start` waits for a container's prestart hooks.
    pub timeout: Duration,
    /// Where the host's root is mounted (bundles and `hook.path`s are
    /// host paths).
    pub host_root: PathBuf,
    /// The process whose namespaces hooks enter (`--host-namespaces-pid`);
    /// 0: hooks stay in the agent's.
    pub host_namespaces_pid: u32,
}

impl HookSettings {
    /// Whether anything would run.
    pub fn any(&self) -> bool {
        !self.prestart.is_empty() || !self.poststop.is_empty() || !self.dirs.is_empty()
    }
}

fn sh_hook(cmd: &str) -> Option<Hook> {
    HookBuilder::default()
        .path("/bin/sh")
        .args(vec!["sh".to_owned(), "-c".to_owned(), cmd.to_owned()])
        .env(vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned(),
        ])
        .build()
        .ok()
}

struct Dispatcher {
    settings: HookSettings,
    prestart: Vec<(String, Hook)>,
    poststop: Vec<(String, Hook)>,
    dirs: Mutex<HooksDirs>,
    barriers: Mutex<HashMap<String, watch::Receiver<bool>>>,
    events: Option<Events>,
    /// File descriptors hooks must not inherit (the fanotify group).
    close_fds: Mutex<Vec<std::os::fd::RawFd>>,
    /// Permits to run a hook process ([`MAX_RUNNING_HOOKS`]).
    running: Arc<tokio::sync::Semaphore>,
    /// Where hooks and Events run.
    side: tokio::runtime::Handle,
    /// Shared with another agent on the node (a surge rollout's): each
    /// hook and Event runs once between them.
    claims: Option<Claims>,
    /// Stages and Events not yet finished ([`HookSink::in_flight`]).
    in_flight: Arc<AtomicU64>,
}

/// A [`Sink`] that runs hooks and posts Events, then hands the event on.
pub struct HookSink<S> {
    out: S,
    d: Arc<Dispatcher>,
}

/// The runtime hook's view: wait for a container's prestart hooks.
pub struct Barrier(Arc<Dispatcher>);

impl lookout_model::StartBarrier for Barrier {
    fn wait(&self, id: &str) -> Option<lookout_model::StartWait> {
        let mut rx = self.0.barriers.lock().ok()?.get(id).cloned()?;
        Some(Box::pin(async move {
            let _ = rx.wait_for(|done| *done).await;
            lookout_model::StartDecision::Proceed
        }))
    }
}

impl<S: Sink> HookSink<S> {
    /// Wraps `out`. Returns the sink and the barrier for the runtime hook.
    /// Hooks and Events run as tasks on `side`, never on the caller's
    /// runtime.
    pub fn new(
        out: S,
        settings: HookSettings,
        events: Option<Events>,
        side: tokio::runtime::Handle,
        claims: Option<Claims>,
    ) -> (HookSink<S>, Barrier) {
        let named = |cmds: &[String]| {
            cmds.iter()
                .filter_map(|c| sh_hook(c).map(|h| (format!("sh -c {c:?}"), h)))
                .collect::<Vec<_>>()
        };
        let d = Arc::new(Dispatcher {
            prestart: named(&settings.prestart),
            poststop: named(&settings.poststop),
            dirs: Mutex::new(HooksDirs::with_hook_root(
                settings.dirs.clone(),
                settings.host_root.clone(),
            )),
            barriers: Mutex::new(HashMap::new()),
            settings,
            events,
            close_fds: Mutex::new(Vec::new()),
            running: Arc::new(tokio::sync::Semaphore::new(MAX_RUNNING_HOOKS)),
            side,
            claims,
            in_flight: Arc::new(AtomicU64::new(0)),
        });
        (
            HookSink {
                out,
                d: Arc::clone(&d),
            },
            Barrier(d),
        )
    }
}

impl<S> HookSink<S> {
    /// Hook stages and Events still running (a shutdown waits for them, so
    /// that an agent replaced by a rollout finishes what it claimed).
    pub fn in_flight(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.d.in_flight)
    }

    /// Hooks close `fd` before they exec (give the fanotify group: a hook
    /// that execs a runtime binary while holding it keeps the group alive,
    /// and with it every exec waiting on a dead agent).
    pub fn close_in_hooks(&self, fd: std::os::fd::RawFd) {
        if let Ok(mut v) = self.d.close_fds.lock() {
            v.push(fd);
        }
    }
}

impl<S: Sink> Sink for HookSink<S> {
    fn emit(&mut self, event: ContainerEvent) {
        Dispatcher::dispatch(&self.d, &event);
        self.out.emit(event);
    }
}

/// At most this many hook processes run at once; more wait their turn
/// (each holds a process and three pipes).
pub const MAX_RUNNING_HOOKS: usize = 32;

/// How long an agent waits for the other to post a container's Event.
const EVENT_WAIT: Duration = Duration::from_secs(15);

fn has_bind_mounts(config: &serde_json::Value) -> bool {
    config["mounts"].as_array().is_some_and(|ms| {
        ms.iter().any(|m| {
            m["type"] == "bind"
                || m["options"]
                    .as_array()
                    .is_some_and(|o| o.iter().any(|x| x == "bind" || x == "rbind"))
        })
    })
}

impl Dispatcher {
    fn dispatch(self: &Arc<Self>, event: &ContainerEvent) {
        let c = &event.container;
        match event.event {
            EventKind::Added => {
                let runs = !self.prestart.is_empty() || !self.settings.dirs.is_empty();
                if !runs && self.events.is_none() {
                    return;
                }
                // Registered now, before `emit` returns: the runtime hook
                // asks for the barrier right after reporting the container.
                let barrier = (runs
                    && matches!(event.source, Source::RuntimeHook | Source::Nri)
                    && c.status == Status::Created)
                    .then(|| {
                        let (tx, rx) = watch::channel(false);
                        if let Ok(mut b) = self.barriers.lock() {
                            b.insert(c.id.clone(), rx);
                        }
                        tx
                    });
                let d = Arc::clone(self);
                let e = event.clone();
                let flight = Counted::new(&self.in_flight);
                self.side.spawn(async move {
                    let _flight = flight;
                    // The rate limit first, here on the side runtime (never
                    // on the caller's): a dropped Event costs no read.
                    let events = d
                        .events
                        .as_ref()
                        .filter(|ev| ev.limit.admit(&e.container.id))
                        .cloned();
                    if !runs && events.is_none() {
                        return;
                    }
                    // One read of config.json serves the hooks and the Event.
                    let config = d.config_of(&e).await;
                    if let Some(ev) = events {
                        let (d, e, config) = (Arc::clone(&d), e.clone(), config.clone());
                        let flight = Counted::new(&d.in_flight);
                        tokio::spawn(async move {
                            let _flight = flight;
                            let post = || ev.post(&e, config.as_ref());
                            match &d.claims {
                                // One Event a container, whichever agent posts it.
                                Some(claims) => {
                                    let what = format!(
                                        "kubernetes-event {}",
                                        e.container.pid.unwrap_or(0)
                                    );
                                    let key = claim_key(&e.container.id, &what);
                                    if claims.once(&key, EVENT_WAIT, post).await == Once::Done {
                                        tracing::debug!(
                                            id = e.container.id,
                                            "Kubernetes Event already posted by the other agent \
                                             on this node"
                                        );
                                    }
                                }
                                None => post().await,
                            }
                        });
                    }
                    if runs {
                        d.run_stage(&e, true, config.as_ref()).await;
                    }
                    if let Some(tx) = barrier {
                        let _ = tx.send(true);
                        if let Ok(mut b) = d.barriers.lock() {
                            b.remove(&e.container.id);
                        }
                    }
                });
            }
            EventKind::Removed => {
                if !self.poststop.is_empty() || !self.settings.dirs.is_empty() {
                    let d = Arc::clone(self);
                    let e = event.clone();
                    let flight = Counted::new(&self.in_flight);
                    self.side.spawn(async move {
                        let _flight = flight;
                        let config = d.config_of(&e).await;
                        d.run_stage(&e, false, config.as_ref()).await;
                    });
                }
            }
            // Hooks run at `added` and `removed`, with what was known then.
            EventKind::Updated => {}
        }
    }

    /// The container's config.json, parsed, if it has a readable one.
    async fn config_of(&self, e: &ContainerEvent) -> Option<serde_json::Value> {
        let b = e.container.bundle.clone()?;
        let bytes = lookout_runtime_hook::oci::read_config_bytes_async(
            self.settings.host_root.clone(),
            b,
            None,
            self.settings.timeout,
        )
        .await
        .map_err(|e| tracing::debug!(error = %Chain(&e), "config.json for hooks"))
        .ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Runs the prestart-stage (`create`) or poststop hooks for `e`, one
    /// after the other, in order.
    async fn run_stage(
        &self,
        e: &ContainerEvent,
        create: bool,
        config: Option<&serde_json::Value>,
    ) {
        let c = &e.container;
        let mut hooks: Vec<(String, Hook)> = if create {
            self.prestart.clone()
        } else {
            self.poststop.clone()
        };
        let process_args: Option<Vec<String>> = match &config {
            Some(cfg) if cfg.get("process").is_some() => Some(
                cfg["process"]["args"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default(),
            ),
            Some(_) => None,
            None => (!c.args.is_empty()).then(|| c.args.clone()),
        };
        let target = Target {
            annotations: &c.annotations,
            args: process_args.as_deref(),
            has_bind_mounts: config.is_some_and(has_bind_mounts),
        };
        if let Ok(mut dirs) = self.dirs.lock() {
            for h in &dirs.current().hooks {
                let stage = if create {
                    h.stages.iter().any(|s| s.runs_at_create())
                } else {
                    h.stages.contains(&lookout_oci_hooks::Stage::Poststop)
                };
                if stage && h.when.matches(&target) {
                    hooks.push((h.name.clone(), h.hook.clone()));
                }
            }
        }
        if hooks.is_empty() {
            return;
        }
        let (status, late) = match (create, c.status) {
            (false, _) => (ContainerState::Stopped, false),
            (true, Status::Created) => (ContainerState::Created, false),
            (true, _) => (ContainerState::Running, true),
        };
        let state = match state_of(c, status, e.source, late) {
            Ok(s) => s,
            Err(err) => {
                tracing::warn!(
                    id = c.id,
                    error = %Chain(&err),
                    "cannot build the OCI state; hooks skipped"
                );
                return;
            }
        };
        let mut opts = RunOptions::default();
        opts.default_timeout = self.settings.timeout;
        // A host path: the hook runs in the host's mount namespace, or
        // under host_root when it cannot enter it.
        opts.cwd = c.bundle.clone().unwrap_or_else(|| PathBuf::from("/"));
        opts.host_root = self.settings.host_root.clone();
        opts.close_fds = self.close_fds.lock().map(|v| v.clone()).unwrap_or_default();
        // The host's namespaces: pid 1 of a hostPID pod is the host's init.
        // A no-op when the agent already runs in them.
        opts.namespaces_of = Some(self.settings.host_namespaces_pid).filter(|p| *p != 0);
        let stage = if create { "prestart" } else { "poststop" };
        for (name, hook) in hooks {
            let run = || self.run_one(c, &name, &hook, &state, &opts);
            let Some(claims) = &self.claims else {
                run().await;
                continue;
            };
            // The hook as configured names the claim: the same hook in
            // the other agent of a rollout is this one, a changed one is
            // another (and runs).
            // The init pid too: a container created again under the same
            // id (runc lets a name be reused) is another container.
            let what = format!(
                "{stage} {} {name} {}",
                c.pid.unwrap_or(0),
                serde_json::to_string(&hook).unwrap_or_default()
            );
            // Wait while the other agent runs it (or waits for a hook
            // process slot to run it): it finishes, or dies and leaves the
            // claim undone to this agent. Not past the claims' lifetime.
            match claims.once(&claim_key(&c.id, &what), CLAIM_TTL, run).await {
                Once::Ran => {}
                Once::Done => tracing::debug!(
                    id = c.id,
                    hook = name,
                    "hook already run by the other agent on this node"
                ),
                Once::Busy => tracing::warn!(
                    id = c.id,
                    hook = name,
                    "the other agent on this node is still running this hook; not waiting longer"
                ),
            }
        }
    }

    /// Runs one hook and logs how it went.
    async fn run_one(
        &self,
        c: &lookout_model::Container,
        name: &str,
        hook: &Hook,
        state: &lookout_oci_hooks::oci_spec::runtime::State,
        opts: &RunOptions,
    ) {
        let status = state.status();
        // N.B. the semaphore is never closed, so acquire cannot fail.
        let Ok(_running) = self.running.acquire().await else {
            return;
        };
        match run_hook(hook, state, opts).await {
            Ok(o) if o.success() => tracing::info!(
                id = c.id,
                hook = name,
                status = %status,
                duration_ms = o.duration.as_millis() as u64,
                stdout = o.stdout.trim_end(),
                stderr = o.stderr.trim_end(),
                "hook ran"
            ),
            Ok(o) => tracing::warn!(
                id = c.id,
                hook = name,
                status = %status,
                result = o.describe(),
                duration_ms = o.duration.as_millis() as u64,
                stdout = o.stdout.trim_end(),
                stderr = o.stderr.trim_end(),
                "hook failed"
            ),
            Err(err) => tracing::warn!(
                id = c.id,
                hook = name,
                error = %Chain(&err),
                "hook did not run"
            ),
        }
    }
}
