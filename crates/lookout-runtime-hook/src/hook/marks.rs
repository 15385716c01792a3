//! The runtime binaries the group marks: at start, and each one a rescan
//! finds later.

use std::path::{Path, PathBuf};

use lookout_fanotify::{MarkFlags, Mask};

use super::RuntimeHook;
use crate::Error;

impl RuntimeHook {
    /// Marks runtime binary `path` ([`RuntimeHook::watch_binary`]).
    pub(super) fn mark(&mut self, path: &Path) -> Result<(), Error> {
        if self.is_marked(path) {
            return Ok(());
        }
        if let (Some(c), Some(name)) = (
            self.capture.as_mut(),
            path.file_name().and_then(|n| n.to_str()),
        ) {
            c.watch_name(name)?;
        }
        // Known before the mark exists, so that the first `runc init`
        // through the new binary is recognised.
        if let Ok(mut m) = self.marked.paths.write() {
            m.insert(path.to_path_buf());
        }
        let file = nix::sys::stat::stat(path)
            .ok()
            .map(|st| (st.st_dev, st.st_ino));
        if let (Some(file), Ok(mut m)) = (file, self.marked.files.write()) {
            m.insert(file);
        }
        if let Err(e) = self
            .group
            .add_mark(path, MarkFlags::empty(), Mask::OPEN_EXEC_PERM)
        {
            if let Ok(mut m) = self.marked.paths.write() {
                m.remove(path);
            }
            if let (Some(file), Ok(mut m)) = (file, self.marked.files.write()) {
                m.remove(&file);
            }
            return Err(Error::Fanotify(e));
        }
        tracing::info!(binary = %path.display(), "watching runtime binary");
        Ok(())
    }

    pub(super) fn is_marked(&self, path: &Path) -> bool {
        self.marked.paths.read().is_ok_and(|m| m.contains(path))
    }

    /// Marks the binaries `find` returns that are not marked yet (a
    /// rescan: runtimes installed after start).
    pub(super) fn mark_found(&mut self, find: &(dyn Fn() -> Vec<PathBuf> + Send + Sync)) {
        for path in find() {
            if !self.is_marked(&path)
                && let Err(e) = self.watch_binary(&path)
            {
                self.counters.error("mark");
                tracing::warn!(
                    error = %lookout_model::Chain(&e),
                    "cannot watch a newly found runtime binary"
                );
            }
        }
    }
}
