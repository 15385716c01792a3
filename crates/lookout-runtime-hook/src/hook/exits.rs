//! Exit watches of tracked containers: a pidfd per init, whose exit is
//! stepped as [`Input::Exited`] with the code BPF saw; a `delete` that ends
//! a container in a shared sandbox stops its watch.

use std::sync::Arc;

use lookout_model::Sink;

use super::{ExitWatch, RuntimeHook};
use crate::lifecycle::Input;
use crate::pidfd;

impl RuntimeHook {
    /// Watches the exit of `pid`, the init of `id`, as exit watch `watch`.
    pub(super) fn watch_exit(&mut self, id: String, pid: u32, watch: u64) {
        if let Some(cap) = self.capture.as_mut() {
            cap.watch_exit(pid);
        }
        let fd = pidfd::pidfd_open(pid).ok().map(Arc::new);
        let exited = pidfd::exit_of_fd(fd.clone());
        let task = self.notify_after(async move {
            exited.await;
            Input::Exited {
                id,
                watch,
                pid,
                code: None,
            }
        });
        self.exits.insert(watch, ExitWatch { fd, task });
    }

    /// Exit watch `watch` saw init `pid` of `id` exit.
    pub(super) fn on_exit(
        &mut self,
        id: String,
        watch: u64,
        pid: u32,
        code: Option<i32>,
        sink: &mut dyn Sink,
    ) {
        // An exit's code is in the BPF capture by the time its exit is
        // handled. Not for a late notice of an earlier container, while a
        // newer one has its pid (reused): that code is the newer one's, to
        // come.
        let ours =
            self.lifecycle.tracked_watch(&id) == Some(watch) || !self.lifecycle.holds_pid(pid);
        let code = match (ours, &self.capture) {
            (true, Some(cap)) => cap.exit_code(pid),
            (true, None) => None,
            (false, _) => code,
        };
        // Each watch is for one container: whether its exit ends it now,
        // or ended nothing (an earlier notice did), the watch is done.
        let done = self.exits.remove(&watch);
        self.step(
            Input::Exited {
                id,
                watch,
                pid,
                code,
            },
            sink,
        );
        // The clean-up waits until the event is out (the pidfd's close and
        // two map deletions are a third of the time from the exit's
        // wake-up to `removed`). No other input runs in between, so no
        // newer container can have taken the pid's watch meanwhile.
        drop(done);
        if ours && let Some(cap) = self.capture.as_mut() {
            cap.forget_exit(pid);
        }
    }

    /// The runtime deleted `id`: a container in a shared sandbox ends with
    /// it, and its watch, which would wait for the sandbox's exit, stops.
    pub(super) fn on_delete(&mut self, id: String, sink: &mut dyn Sink) {
        let watch = self.lifecycle.tracked_watch(&id);
        self.step(Input::Deleted { id: id.clone() }, sink);
        if let Some(watch) = watch
            && self.lifecycle.tracked_watch(&id) != Some(watch)
            && let Some(w) = self.exits.remove(&watch)
        {
            w.task.abort();
        }
    }

    /// Ends tracked container `id` now if its init has exited, though the
    /// notice of that exit may still be queued (see `on_create_read`). The
    /// notice, handled later, then ends nothing: it is for a watch no
    /// longer tracked. Asks the watch's own pidfd, without waiting.
    pub(super) fn end_if_exited(&mut self, id: &str, sink: &mut dyn Sink) {
        let (Some(watch), Some(pid)) = (
            self.lifecycle.tracked_watch(id),
            self.lifecycle.tracked_pid(id),
        ) else {
            return;
        };
        if !self.watch_saw_exit(watch) {
            return;
        }
        tracing::debug!(
            id,
            pid,
            "init exited before the notice of its exit was handled"
        );
        self.on_exit(id.to_owned(), watch, pid, None, sink);
    }

    /// Ends every tracked container whose init has exited (as
    /// [`RuntimeHook::end_if_exited`]), before a scan of the state
    /// directories: the scan skips the ids it knows, and a container made
    /// anew with an id whose old exit is still queued would be skipped.
    /// One `poll` per tracked container; scans are rare.
    pub(super) fn end_all_exited(&mut self, sink: &mut dyn Sink) {
        let ended: Vec<String> = self
            .lifecycle
            .tracked_watches()
            .filter(|&(_, watch)| self.watch_saw_exit(watch))
            .map(|(id, _)| id.to_owned())
            .collect();
        for id in ended {
            self.end_if_exited(&id, sink);
        }
    }

    /// Whether the init behind exit watch `watch` has exited.
    fn watch_saw_exit(&self, watch: u64) -> bool {
        match self.exits.get(&watch).map(|w| &w.fd) {
            Some(Some(fd)) => pidfd::has_exited(fd),
            // No pidfd: its notice comes at once, and ends the container.
            Some(None) => true,
            None => false,
        }
    }
}
