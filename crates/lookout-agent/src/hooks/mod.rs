//! OCI hooks and Kubernetes Events for the containers lookout reports.
//!
//! [`HookSink`] sits after the merger (so each container gets its hooks
//! once) and before stdout. The runtime spec's stages run at their points
//! ([`stages`]):
//!
//! - on `added` of a container whose start lookout holds (the runtime
//!   hook or NRI reported it still `created`): `prestart`, then
//!   `createRuntime`, in the host's namespaces, then `createContainer` and `startContainer`
//!   in the container's, one after the other. The start waits for them
//!   (the [`Barrier`], within `--hook-timeout`); a failure or a timeout
//!   refuses it (`--hook-failure stop`, the default), and the container's
//!   `poststop` hooks run when its killed init is reported removed;
//! - when the holder saw the start happen ([`StartBarrier::started`]):
//!   `poststart`;
//! - on `removed`: `poststop`.
//!
//! A container found after it started (informer, state scan, `runc run`)
//! gets every stage but `poststop` at once, with `io.lookout.hook.late`:
//! nothing can be refused there, so a failure only warns. Nothing here
//! blocks the caller: hooks run on tasks of the side runtime, each with
//! its own timeout.

mod stages;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lookout_model::{
    Chain, Container, ContainerEvent, EventKind, Sink, StartBarrier, StartDecision, StartWait,
};
use lookout_oci_hooks::oci_spec::runtime::{Hook, HookBuilder, State};
use lookout_oci_hooks::{HooksDirs, RunOptions, Target, run_hook, state_of};
use tokio::sync::watch;

use crate::handover::{CLAIM_TTL, Claims, Once, claim_key};
use crate::hub::Counted;
use crate::k8s_events::Events;
use crate::metrics::Metrics;
use stages::{BEFORE_START, Group, GroupResult, Named, holds_start};

pub use stages::OnHookFailure;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct HookSettings {
    /// `--prestart CMD` (each through `sh -c`), run with `createRuntime`.
    pub prestart: Vec<String>,
    /// `--poststop CMD`.
    pub poststop: Vec<String>,
    /// `--hooks-dir DIR`, later ones override earlier ones by file name.
    pub dirs: Vec<PathBuf>,
    /// `--hook-timeout`: each hook's default timeout, and the longest a
    /// runtime's `start` waits for a container's hooks before its start.
    pub timeout: Duration,
    /// `--hook-failure`: what a failing hook before the start does.
    pub on_failure: OnHookFailure,
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

/// A container whose start lookout holds: the decision its hooks before
/// the start reach (or the deadline sets), and what `poststart` needs.
struct Held {
    /// `None` until decided; set once, by the hooks or by the deadline.
    decision: Arc<watch::Sender<Option<StartDecision>>>,
    /// The `added` event, for `poststart`.
    event: ContainerEvent,
}

struct Dispatcher {
    settings: HookSettings,
    prestart: Vec<Named>,
    poststop: Vec<Named>,
    dirs: Mutex<HooksDirs>,
    /// Containers whose start is held, until `started` or `removed`.
    held: Mutex<HashMap<String, Held>>,
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
    metrics: Option<Arc<Metrics>>,
}

/// A [`Sink`] that runs hooks and posts Events, then hands the event on.
pub struct HookSink<S> {
    out: S,
    d: Arc<Dispatcher>,
}

/// The start's view: wait for a container's hooks before the start, and
/// hear that it started (`poststart`).
pub struct Barrier(Arc<Dispatcher>);

impl Barrier {
    fn wait_by(&self, id: &str, until: Option<Instant>) -> Option<StartWait> {
        let decision = Arc::clone(&self.0.held.lock().ok()?.get(id)?.decision);
        let mut deadline = Instant::now() + self.0.settings.timeout;
        if let Some(u) = until {
            deadline = deadline.min(u);
        }
        let on_failure = self.0.settings.on_failure;
        let (id, timeout) = (id.to_owned(), self.0.settings.timeout);
        Some(Box::pin(async move {
            let mut rx = decision.subscribe();
            let deadline = tokio::time::Instant::from_std(deadline);
            if let Ok(Ok(d)) = tokio::time::timeout_at(deadline, rx.wait_for(Option::is_some)).await
                && let Some(d) = d.clone()
            {
                return d;
            }
            // Not decided in time: a timeout is a failure. Set here, so
            // that the hooks still running stop before their next one.
            let reason = format!(
                "the container's hooks before its start did not finish within {timeout:?} \
                 (--hook-timeout, or the runtime's deadline)"
            );
            decision.send_if_modified(|d| {
                if d.is_some() {
                    return false;
                }
                *d = Some(decide(on_failure, &id, reason.clone()));
                true
            });
            let d = decision.borrow().clone();
            d.unwrap_or(StartDecision::Proceed)
        }))
    }
}

impl StartBarrier for Barrier {
    fn wait(&self, id: &str) -> Option<StartWait> {
        self.wait_by(id, None)
    }

    fn wait_until(&self, id: &str, until: Instant) -> Option<StartWait> {
        self.wait_by(id, Some(until))
    }

    fn started(&self, id: &str) {
        let Some(held) = self.0.held.lock().ok().and_then(|mut h| h.remove(id)) else {
            return;
        };
        let d = Arc::clone(&self.0);
        let flight = Counted::new(&d.in_flight);
        self.0.side.spawn(async move {
            let _flight = flight;
            // Started after the hooks before the start decided (the start
            // waited for them, or went on at their deadline).
            let mut rx = held.decision.subscribe();
            let decided = rx
                .wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|d| d.clone());
            if let Some(StartDecision::Deny(_)) = decided {
                return;
            }
            let config = d.config_of(&held.event).await;
            d.run_group(&held.event, Group::Poststart, config.as_ref(), None)
                .await
                .ok();
        });
    }
}

/// The decision for a failure before the start: refuse it, or only warn.
fn decide(on_failure: OnHookFailure, id: &str, reason: String) -> StartDecision {
    match on_failure {
        OnHookFailure::Stop => StartDecision::Deny(format!("denied by hooks: {reason}")),
        OnHookFailure::Warn => {
            tracing::warn!(
                id,
                reason,
                "a hook before the start failed; the container starts anyway (--hook-failure warn)"
            );
            StartDecision::Proceed
        }
    }
}

impl<S: Sink> HookSink<S> {
    /// Wraps `out`. Returns the sink and the barrier for whatever holds
    /// starts. Hooks and Events run as tasks on `side`, never on the
    /// caller's runtime.
    pub fn new(
        out: S,
        settings: HookSettings,
        events: Option<Events>,
        side: tokio::runtime::Handle,
        claims: Option<Claims>,
        metrics: Option<Arc<Metrics>>,
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
            held: Mutex::new(HashMap::new()),
            settings,
            events,
            close_fds: Mutex::new(Vec::new()),
            running: Arc::new(tokio::sync::Semaphore::new(MAX_RUNNING_HOOKS)),
            side,
            claims,
            in_flight: Arc::new(AtomicU64::new(0)),
            metrics,
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
                // Registered now, before `emit` returns: the holder asks
                // for the barrier right after reporting the container.
                let decision = (runs && holds_start(event.source, c)).then(|| {
                    let decision = Arc::new(watch::Sender::new(None));
                    if let Ok(mut held) = self.held.lock() {
                        held.insert(
                            c.id.clone(),
                            Held {
                                decision: Arc::clone(&decision),
                                event: event.clone(),
                            },
                        );
                    }
                    decision
                });
                // The init's pidfd now, while the backend that reported
                // it knows it is the container's: a hook never enters a
                // process that reused the pid meanwhile. Only hooks.d files
                // run in a container, and only before a held start.
                let init = (decision.is_some() && !self.settings.dirs.is_empty())
                    .then(|| c.pid.and_then(|p| lookout_runtime_hook::pidfd_open(p).ok()))
                    .flatten()
                    .map(Arc::new);
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
                        d.post_event(ev, &e, config.clone());
                    }
                    if runs {
                        d.before_start(&e, config.as_ref(), decision, init).await;
                    }
                });
            }
            EventKind::Removed => {
                if let Ok(mut held) = self.held.lock() {
                    held.remove(&c.id);
                }
                if !self.poststop.is_empty() || !self.settings.dirs.is_empty() {
                    let d = Arc::clone(self);
                    let e = event.clone();
                    let flight = Counted::new(&self.in_flight);
                    self.side.spawn(async move {
                        let _flight = flight;
                        let config = d.config_of(&e).await;
                        d.run_group(&e, Group::Poststop, config.as_ref(), None)
                            .await
                            .ok();
                    });
                }
            }
            // Hooks run with what was known at `added` and `removed`.
            EventKind::Updated => {}
        }
    }

    /// Posts the Kubernetes Event of `e`, once per container between the
    /// agents of a node.
    fn post_event(
        self: &Arc<Self>,
        ev: Events,
        e: &ContainerEvent,
        config: Option<serde_json::Value>,
    ) {
        let (d, e) = (Arc::clone(self), e.clone());
        let flight = Counted::new(&d.in_flight);
        tokio::spawn(async move {
            let _flight = flight;
            let post = || ev.post(&e, config.as_ref());
            match &d.claims {
                // One Event a container, whichever agent posts it.
                Some(claims) => {
                    let what = format!("kubernetes-event {}", e.container.pid.unwrap_or(0));
                    let key = claim_key(&e.container.id, &what);
                    if claims.once(&key, EVENT_WAIT, post).await == Once::Done {
                        tracing::debug!(
                            id = e.container.id,
                            "Kubernetes Event already posted by the other agent on this node"
                        );
                    }
                }
                None => post().await,
            }
        });
    }

    /// The stages before the start, in order, stopping at the first
    /// failure; the start's `decision` (when lookout holds it) is set from
    /// how they went. A container found running gets `poststart` too.
    async fn before_start(
        &self,
        e: &ContainerEvent,
        config: Option<&serde_json::Value>,
        decision: Option<Arc<watch::Sender<Option<StartDecision>>>>,
        init: Option<Arc<OwnedFd>>,
    ) {
        // What is left of the start's budget caps every hook before it: a
        // hook never holds a process slot past its container's decision.
        // (With `--hook-failure warn` the start goes on at its deadline and
        // the hooks keep their own timeouts.)
        let until = decision
            .as_ref()
            .filter(|_| self.settings.on_failure == OnHookFailure::Stop)
            .map(|_| Instant::now() + self.settings.timeout);
        let mut result: GroupResult = Ok(());
        for group in BEFORE_START {
            if group.in_container_only() && decision.is_none() {
                // Found running (or not held): its createContainer and
                // startContainer moments are past, and running them now
                // would run them inside a container that already runs
                // code of its own.
                continue;
            }
            result = self
                .run_group_in(
                    e,
                    group,
                    config,
                    (decision.as_deref(), until),
                    init.as_ref(),
                )
                .await;
            if result.is_err() {
                break;
            }
        }
        let Some(decision) = decision else {
            // Nothing to refuse: a container found running, or one whose
            // start this agent does not hold. It has started.
            if let Err(reason) = &result {
                tracing::warn!(
                    id = e.container.id,
                    reason,
                    "a hook failed for a container that already runs: nothing to stop"
                );
            }
            if e.container.status != lookout_model::Status::Created {
                self.run_group(e, Group::Poststart, config, None).await.ok();
            }
            return;
        };
        let d = match result {
            Ok(()) => StartDecision::Proceed,
            Err(reason) => decide(self.settings.on_failure, &e.container.id, reason),
        };
        decision.send_if_modified(|now| {
            if now.is_some() {
                return false;
            }
            *now = Some(d);
            true
        });
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

    /// The hooks of `group` that apply to `e`, in order: the command-line
    /// ones first, then hooks.d files by lower-cased file name.
    fn hooks_of(
        &self,
        e: &ContainerEvent,
        group: Group,
        config: Option<&serde_json::Value>,
    ) -> Vec<Named> {
        let c = &e.container;
        let mut hooks: Vec<Named> = match group {
            Group::Prestart => self.prestart.clone(),
            Group::Poststop => self.poststop.clone(),
            _ => Vec::new(),
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
                if h.stages.iter().any(|s| group.has(s)) && h.when.matches(&target) {
                    hooks.push((h.name.clone(), h.hook.clone()));
                }
            }
        }
        hooks
    }

    /// Runs the hooks of `group` for `e`, one after the other, in order.
    /// In a group that stops the container, the first failure ends the
    /// group (the runtime spec), and so does a `decision` already made
    /// (the start's deadline passed).
    async fn run_group(
        &self,
        e: &ContainerEvent,
        group: Group,
        config: Option<&serde_json::Value>,
        decision: Option<&watch::Sender<Option<StartDecision>>>,
    ) -> GroupResult {
        self.run_group_in(e, group, config, (decision, None), None)
            .await
    }

    /// [`Dispatcher::run_group`], entering the container (its stages that
    /// run there) only while the process behind `init` lives.
    async fn run_group_in(
        &self,
        e: &ContainerEvent,
        group: Group,
        config: Option<&serde_json::Value>,
        (decision, until): (
            Option<&watch::Sender<Option<StartDecision>>>,
            Option<Instant>,
        ),
        init: Option<&Arc<OwnedFd>>,
    ) -> GroupResult {
        let hooks = self.hooks_of(e, group, config);
        if hooks.is_empty() {
            return Ok(());
        }
        let c = &e.container;
        let late = !holds_start(e.source, c) && group != Group::Poststop;
        let stops = group.stops_the_container() && !late;
        let (status, pid) = group.state(c, late);
        let mut shown = Container::clone(c);
        shown.pid = pid;
        let state = match state_of(&shown, status, e.source, late) {
            Ok(s) => s,
            Err(err) => {
                tracing::warn!(
                    id = c.id,
                    error = %Chain(&err),
                    "cannot build the OCI state; hooks skipped"
                );
                self.count(group, "not_run", hooks.len());
                return if stops {
                    Err(format!("cannot build the OCI state: {}", Chain(&err)))
                } else {
                    Ok(())
                };
            }
        };
        let in_container = group.in_container(c).map(|ic| match init {
            Some(fd) => ic.with_pidfd(Arc::clone(fd)),
            None => ic,
        });
        if group.in_container_only() && in_container.is_none() {
            // No process to enter: never run them in the host's
            // namespaces instead.
            tracing::warn!(
                id = c.id,
                stage = group.name(),
                "no pid for the container: its hooks that run in it cannot run"
            );
            self.count(group, "not_run", hooks.len());
            return if stops {
                Err(format!("{} hooks: the container has no pid", group.name()))
            } else {
                Ok(())
            };
        }
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
        opts.container = in_container;
        for (i, (name, hook)) in hooks.iter().enumerate() {
            if decision.is_some_and(|d| d.borrow().is_some()) {
                // The start's deadline decided: the rest would be late.
                self.count(group, "not_run", hooks.len() - i);
                return Err("the start's deadline passed".into());
            }
            opts.max_timeout = until.map(|u| u.saturating_duration_since(Instant::now()));
            let outcome = self.claimed(c, group, name, hook, &state, &opts).await;
            if let Err(reason) = outcome
                && stops
            {
                self.count(group, "not_run", hooks.len() - i - 1);
                return Err(format!("{} hook {name}: {reason}", group.name()));
            }
        }
        Ok(())
    }

    /// Runs one hook once between the agents of the node (the other agent
    /// of a rollout may have run it).
    async fn claimed(
        &self,
        c: &Container,
        group: Group,
        name: &str,
        hook: &Hook,
        state: &State,
        opts: &RunOptions,
    ) -> Result<(), String> {
        let run = || self.run_one(c, group, name, hook, state, opts);
        let Some(claims) = &self.claims else {
            return run().await;
        };
        // The hook as configured names the claim: the same hook in the
        // other agent of a rollout is this one, a changed one is another
        // (and runs). The init pid too: a container created again under
        // the same id (runc lets a name be reused) is another container.
        let what = format!(
            "{} {} {name} {}",
            group.name(),
            c.pid.unwrap_or(0),
            serde_json::to_string(hook).unwrap_or_default()
        );
        let mut result = Ok(());
        let outcome = claims
            .once(&claim_key(&c.id, &what), CLAIM_TTL, || async {
                result = run().await;
            })
            .await;
        match outcome {
            Once::Ran => result,
            Once::Done => {
                tracing::debug!(
                    id = c.id,
                    hook = name,
                    "hook already run by the other agent on this node"
                );
                Ok(())
            }
            Once::Busy => {
                tracing::warn!(
                    id = c.id,
                    hook = name,
                    "the other agent on this node is still running this hook; not waiting longer"
                );
                // Its outcome is the other agent's to act on.
                Ok(())
            }
        }
    }

    /// Runs one hook and logs how it went: `Err` with why it failed.
    async fn run_one(
        &self,
        c: &Container,
        group: Group,
        name: &str,
        hook: &Hook,
        state: &State,
        opts: &RunOptions,
    ) -> Result<(), String> {
        let stage = group.name();
        // N.B. the semaphore is never closed, so acquire cannot fail.
        let Ok(_running) = self.running.acquire().await else {
            return Err("no hook process slot".into());
        };
        match run_hook(hook, state, opts).await {
            Ok(o) if o.success() => {
                self.count(group, "ok", 1);
                tracing::info!(
                    id = c.id,
                    hook = name,
                    stage,
                    status = %state.status(),
                    duration_ms = o.duration.as_millis() as u64,
                    stdout = o.stdout.trim_end(),
                    stderr = o.stderr.trim_end(),
                    "hook ran"
                );
                Ok(())
            }
            Ok(o) => {
                self.count(group, if o.timed_out { "timed_out" } else { "failed" }, 1);
                tracing::warn!(
                    id = c.id,
                    hook = name,
                    stage,
                    status = %state.status(),
                    result = o.describe(),
                    duration_ms = o.duration.as_millis() as u64,
                    stdout = o.stdout.trim_end(),
                    stderr = o.stderr.trim_end(),
                    "hook failed"
                );
                Err(o.describe())
            }
            Err(err) => {
                self.count(group, "not_run", 1);
                let why = Chain(&err).to_string();
                tracing::warn!(
                    id = c.id,
                    hook = name,
                    stage,
                    error = why,
                    "hook did not run"
                );
                Err(why)
            }
        }
    }

    fn count(&self, group: Group, outcome: &str, n: usize) {
        if let Some(m) = &self.metrics {
            for _ in 0..n {
                m.hook_ran(group.name(), outcome);
            }
        }
    }
}
