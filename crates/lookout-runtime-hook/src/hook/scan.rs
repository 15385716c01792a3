//! What the runtimes' state directories hold: the start-up scan, the
//! reconciliation's scans, and the state roots learnt from argv.

use std::path::Path;

use lookout_model::{Container, RuntimeKind};

use super::{MAX_LEARNED_ROOTS, RuntimeHook};
use crate::state::default_root;

impl RuntimeHook {
    /// Containers in the state directories (the default roots and those
    /// seen in argv) that are neither tracked, pending nor being reported.
    pub(super) fn scan_untracked(&self) -> Vec<Container> {
        let lifecycle = &self.lifecycle;
        let mut found =
            crate::scan::scan_state_in(&self.config.host_root, &self.learned_roots, &|id| {
                lifecycle.knows(id)
            });
        if let Some(f) = &self.config.enrich {
            found.iter_mut().for_each(|c| f(c));
        }
        found
    }

    /// Remembers a `--root` for reconciliation scans.
    pub(super) fn learn_root(&mut self, runtime: &RuntimeKind, root: &Path) {
        if root == default_root(runtime)
            || self.learned_roots.len() >= MAX_LEARNED_ROOTS
            || self.learned_roots.iter().any(|(_, r)| r == root)
        {
            return;
        }
        self.learned_roots
            .push((runtime.clone(), root.to_path_buf()));
    }
}
