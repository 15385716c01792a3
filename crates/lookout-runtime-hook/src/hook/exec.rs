//! A runtime exec turned into a lifecycle input: `create`/`run` once its
//! config.json is read off the task, `start`, and the commands that make
//! no container.

use std::sync::Arc;
use std::time::Instant;

use lookout_host::proc;
use lookout_model::{Sink, Status};

use super::{CreateRead, Notice, RuntimeHook};
use crate::answer::{Exec, Held};
use crate::argv::{self, Command, Invocation};
use crate::lifecycle::{Input, Pending};
use crate::state::default_root;

impl RuntimeHook {
    /// A runtime exec handed over by the permission thread.
    pub(super) fn on_exec(&mut self, exec: Exec, sink: &mut dyn Sink) {
        match exec {
            // The answer's latency is recorded when it is given (`Held`).
            Exec::Command { pid, inv, perm } => self.on_invocation(pid, &inv, Some(perm), sink),
            Exec::Unseen(u) => self.follow_late(u),
            Exec::Deleted(inv) => self.on_invocation(0, &inv, None, sink),
        }
    }

    /// Acts on a runtime command line. `perm` is the exec's pending
    /// permission (answered here, after anything that must precede the
    /// exec), or `None` when the exec was already allowed (fanotify-only
    /// mode reads argv afterwards).
    pub(super) fn on_argv(
        &mut self,
        pid: u32,
        binary: &str,
        argv: &[String],
        perm: Option<Held>,
        sink: &mut dyn Sink,
    ) {
        match argv::parse(argv, binary) {
            Ok(inv) => self.on_invocation(pid, &inv, perm, sink),
            Err(e) => {
                self.counters.error("argv");
                tracing::warn!(error = %e, ?argv, "cannot parse runtime command line; allowing it");
                if let Some(perm) = perm {
                    self.step(Input::Other { perm }, sink);
                }
            }
        }
    }

    /// Acts on a parsed runtime command line; `perm` as for `on_argv`.
    fn on_invocation(
        &mut self,
        pid: u32,
        inv: &Invocation,
        perm: Option<Held>,
        sink: &mut dyn Sink,
    ) {
        match &inv.command {
            Command::Create(a) | Command::Run(a) => {
                // config.json is read off this task (a hung file system
                // holds only this exec, for at most the deadline); the
                // exec goes on once it is noted (`Notice::CreateRead`).
                let cwd = proc::cwd(pid);
                // What tells a `run`'s container from an earlier one with
                // its id (see `run_watch`): read while the exec is held,
                // before the container can exist.
                let started = match &inv.command {
                    Command::Run(_) => proc::start_time(pid),
                    _ => None,
                };
                let bundle = inv.bundle(cwd.as_deref());
                let read = bundle.clone().map(|b| {
                    crate::oci::read_config_async(
                        self.config.host_root.clone(),
                        b,
                        a.config.clone(),
                        self.config.answer_deadline,
                    )
                });
                let (tx, counters, id) = (
                    self.notices_tx.clone(),
                    Arc::clone(&self.counters),
                    a.id.clone(),
                );
                let inv = inv.clone();
                tokio::spawn(async move {
                    let config = match read {
                        Some(read) => read
                            .await
                            .map_err(|e| {
                                counters.error("config");
                                tracing::warn!(
                                    id,
                                    error = %lookout_model::Chain(&e),
                                    "cannot read the container's config"
                                );
                            })
                            .ok(),
                        None => None,
                    };
                    let notice = Notice::CreateRead(Box::new(CreateRead {
                        pid,
                        started,
                        inv,
                        perm,
                        cwd,
                        bundle,
                        config,
                    }));
                    // A closed channel (shutting down) drops the notice:
                    // dropping its permission allows the exec.
                    let _ = tx.send(notice).await;
                });
            }
            // The container is still `created`: the lifecycle reports it
            // before its process may run.
            Command::Start { id } => {
                let mut perm = perm;
                if let Some(barrier) = self.config.start_barrier.as_ref().filter(|_| pid != 0) {
                    let root = inv
                        .root
                        .clone()
                        .unwrap_or_else(|| default_root(&inv.runtime));
                    let fifo = lookout_host::host_path(
                        &self.config.host_root,
                        &root.join(id).join("exec.fifo"),
                    );
                    // What the init runs while it waits, read now.
                    let init = super::started::waiting(self.lifecycle.tracked_pid(id));
                    let (id, barrier) = (id.clone(), Arc::clone(barrier));
                    let watch = move || super::started::watch(pid, init, fifo, id, barrier);
                    // Watched once allowed: a start held for its hooks or
                    // gates holds no watcher (nor its pidfd) meanwhile.
                    match perm.as_mut() {
                        Some(held) => held.after_allow(watch),
                        None => watch(),
                    }
                }
                self.step(
                    Input::Start {
                        id: id.clone(),
                        perm,
                    },
                    sink,
                )
            }
            Command::Delete { id } => {
                if let Some(perm) = perm {
                    self.step(Input::Other { perm }, sink);
                }
                // Only a container in a shared sandbox needs it (see
                // `Input::Deleted`); a full queue costs that report.
                if self.lifecycle.is_sandboxed(id) {
                    let _ = self
                        .notices_tx
                        .try_send(Notice::Step(Box::new(Input::Deleted { id: id.clone() })));
                }
            }
            Command::ReExec | Command::Other(_) => {
                if let Some(perm) = perm {
                    self.step(Input::Other { perm }, sink);
                }
            }
        }
    }

    /// A `create`/`run` whose config.json was read: remember the container,
    /// let the exec go on, and watch for what it makes.
    pub(super) fn on_create_read(&mut self, r: CreateRead, sink: &mut dyn Sink) {
        let CreateRead {
            pid,
            started,
            inv,
            perm,
            cwd,
            bundle,
            config,
        } = r;
        let (args, status) = match &inv.command {
            Command::Create(a) => (a, Status::Created),
            Command::Run(a) => (a, Status::Running),
            _ => return,
        };
        let id = args.id.clone();
        let root = inv
            .root
            .clone()
            .unwrap_or_else(|| default_root(&inv.runtime));
        self.learn_root(&inv.runtime, &root);
        let pid_file = args
            .pid_file
            .as_ref()
            .map(|p| match (&cwd, p.is_absolute()) {
                (Some(cwd), false) => cwd.join(p),
                _ => p.clone(),
            });
        let pending = Pending {
            runtime: inv.runtime.clone(),
            root: root.clone(),
            bundle,
            pid_file,
            config,
            status,
            since: Instant::now(),
            started,
        };
        // An id used again (`runc run` under a service manager, a script):
        // the container that had it ended, its init exited and it was
        // deleted, but the notice of that exit can still be queued behind
        // this create (the task takes notices and execs in no fixed order,
        // and the exec comes first when this thread was not scheduled).
        // Ended first, or the lifecycle would take the new container for
        // the one it reported, and never watch it.
        self.end_if_exited(&id, sink);
        self.step(
            Input::Created {
                id,
                pending,
                pid,
                perm,
            },
            sink,
        );
    }
}
