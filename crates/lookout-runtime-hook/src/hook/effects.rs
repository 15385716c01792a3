//! The lifecycle's effects, carried out: every input goes through
//! [`RuntimeHook::step`], which applies it and does what it returns.

use std::sync::Arc;

use lookout_model::{RuntimeKind, Sink};
use tokio::sync::mpsc;

use super::{Notice, RuntimeHook};
use crate::answer::Held;
use crate::lifecycle::{self, Effect, Input};
use crate::run_watch::RunSeen;

impl RuntimeHook {
    /// Applies `input` to the lifecycle and carries out its effects.
    pub(super) fn step(&mut self, input: Input<Held>, sink: &mut dyn Sink) {
        for effect in self.lifecycle.step(input) {
            match effect {
                Effect::Allow(perm) => perm.allow(),
                Effect::WatchCreate {
                    id,
                    pid,
                    runtime,
                    read,
                    handoff,
                } => self.watch_create(id, pid, runtime, read, handoff),
                Effect::WatchRun {
                    id,
                    pid,
                    runtime,
                    root,
                    started,
                } => self.watch_run(id, pid, runtime, root, started),
                Effect::Read {
                    id,
                    read,
                    pending,
                    seen,
                } => self.read_now(id, read, pending, seen),
                Effect::ReadNow { id, read, handoff } => {
                    // Taken already: the reader that waited for the exit
                    // reads it, and its `Read` comes.
                    if let Some(pending) = lifecycle::take(&handoff) {
                        self.read_now(id, read, pending, None);
                    }
                }
                Effect::WatchExit { id, pid, watch } => self.watch_exit(id, pid, watch),
                Effect::Emit(event) => sink.emit(event),
                Effect::ReleaseStart { id, pid, perm } => self.release_start(id, pid, perm),
            }
        }
    }

    /// Steps the input `input` resolves to, on this task, once it is ready.
    pub(super) fn notify_after(
        &self,
        input: impl std::future::Future<Output = Input<Held>> + Send + 'static,
    ) -> tokio::task::AbortHandle {
        let tx = self.notices_tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(Notice::Step(Box::new(input.await))).await;
        })
        .abort_handle()
    }

    /// `run` creates and starts in one process: catch the state file of
    /// `id` under `root` while the container lives, and step
    /// [`Input::Observed`].
    fn watch_run(
        &self,
        id: String,
        pid: u32,
        runtime: RuntimeKind,
        root: std::path::PathBuf,
        started: Option<u64>,
    ) {
        let (tx, mut rx) = mpsc::channel(1);
        let root = lookout_host::host_path(&self.config.host_root, &root);
        crate::run_watch::spawn(runtime.clone(), root, id.clone(), pid, started, tx);
        let notices = self.notices_tx.clone();
        let counters = Arc::clone(&self.counters);
        tokio::spawn(async move {
            match rx.recv().await {
                Some(RunSeen::Observed(obs)) => {
                    let _ = notices
                        .send(Notice::Step(Box::new(Input::Observed(obs))))
                        .await;
                }
                // N.B. not silent: the container is gone, and what
                // config.json said is not enough to report it as having
                // run.
                Some(RunSeen::Vanished) => {
                    counters.missed(&runtime, "run-unobserved");
                    tracing::warn!(
                        runtime = %runtime,
                        id,
                        "`run` made a container that ended before its state could be read; not reported"
                    );
                }
                None => tracing::debug!(id, "`run` ended without a container"),
            }
        });
    }

    /// Lets `start` of container `id` (init `pid`) go on, after its
    /// prestart hooks (the start barrier), waiting on a task so that other
    /// execs go on.
    fn release_start(&self, id: String, pid: Option<u32>, perm: Held) {
        match self.config.start_barrier.as_ref().and_then(|b| b.wait(&id)) {
            Some(barrier) => {
                let cap = self.config.start_barrier_cap;
                let mut wait = Box::pin(tokio::time::timeout(cap, barrier));
                // Decided already (the gates answered between create and
                // start): answer here, without a task and its wake-up.
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                if let std::task::Poll::Ready(decided) =
                    std::future::Future::poll(wait.as_mut(), &mut cx)
                {
                    perm.answer_start(&id, pid, decided.ok(), cap);
                    return;
                }
                tokio::spawn(async move {
                    perm.answer_start(&id, pid, wait.await.ok(), cap);
                });
            }
            None => perm.allow(),
        }
    }
}
