//! Finding containers from the runtimes' state directories, and the `scan`
//! discovery mode built on it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lookout_model::{Container, ContainerEvent, RuntimeKind, Sink, Source, Status};
use tokio::sync::mpsc;

use crate::container::fill_init;
use crate::oci::read_config_within;

/// How long a scan waits for one bundle's config.json (a hung file system
/// must not stall discovery of the others).
const SCAN_CONFIG_DEADLINE: Duration = Duration::from_secs(1);
use crate::state::{read_state_under, scan_roots};
use crate::{argv, pidfd};
use lookout_host::proc;

/// Containers whose state files name a live process (start time checked
/// against pid reuse), skipping ids for which `known` is true.
pub fn scan_state(host_root: &Path, known: &dyn Fn(&str) -> bool) -> Vec<Container> {
    scan_state_in(host_root, &[], known)
}

/// [`scan_state`] in the default roots and in `extra` roots (host paths,
/// e.g. `--root` values seen in runtime argv).
pub fn scan_state_in(
    host_root: &Path,
    extra: &[(RuntimeKind, PathBuf)],
    known: &dyn Fn(&str) -> bool,
) -> Vec<Container> {
    let mut found = Vec::new();
    let mut roots = scan_roots(host_root);
    for r in extra {
        if !roots.contains(r) {
            roots.push(r.clone());
        }
    }
    for (runtime, root) in roots {
        let Ok(entries) = std::fs::read_dir(lookout_host::host_path(host_root, &root)) else {
            continue;
        };
        for e in entries.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            // runsc: one `<id>_sandbox:<sandbox id>.state` file per
            // container; the others: one directory per container.
            let id = if runtime == RuntimeKind::Runsc {
                match crate::state::runsc_container_of(&name) {
                    Some(id) => id.to_owned(),
                    None => continue,
                }
            } else {
                name
            };
            if !argv::valid_container_id(&id) || known(&id) {
                continue;
            }
            let state = match read_state_under(host_root, &runtime, &root, &id) {
                Ok(s) => s,
                Err(err) => {
                    tracing::debug!(error = %lookout_model::Chain(&err), "skipping state entry");
                    continue;
                }
            };
            let init = match proc::container_init(state.pid, state.start_time) {
                Ok(init) => init,
                // A stopped container's state stays until its delete, and
                // its pid may have been taken by then.
                Err(proc::NotInit::NotAlive(_) | proc::NotInit::Reused { .. }) => {
                    tracing::debug!(id, pid = state.pid, "state file names a dead or reused pid");
                    continue;
                }
                Err(why) => {
                    let why = why.to_string();
                    if first_warning(&id, state.pid) {
                        tracing::warn!(
                            id,
                            pid = state.pid,
                            why,
                            "state file names no container process; skipped"
                        );
                    }
                    continue;
                }
            };
            let config = state.bundle.as_ref().and_then(|b| {
                read_config_within(host_root, b, None, SCAN_CONFIG_DEADLINE)
                    .map_err(|e| {
                        tracing::warn!(
                            id,
                            error = %lookout_model::Chain(&e),
                            "cannot read the container's config"
                        )
                    })
                    .ok()
            });
            let mut c = Container::new(id.clone(), runtime.clone());
            c.bundle = state.bundle.clone();
            c.runtime_root = Some(root.clone());
            fill_init(&mut c, &init, config, Status::Running);
            found.push(c);
        }
    }
    found
}

/// Whether this is the first warning about `id` naming `pid`: a rescan
/// every few seconds must not repeat it. Bounded: past 4096 entries the
/// memory is cleared (and each still-bad state warned about once more).
fn first_warning(id: &str, pid: u32) -> bool {
    static WARNED: std::sync::Mutex<Option<std::collections::HashSet<(String, u32)>>> =
        std::sync::Mutex::new(None);
    let mut g = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    let set = g.get_or_insert_with(Default::default);
    if set.len() >= 4096 {
        set.clear();
    }
    set.insert((id.to_owned(), pid))
}

/// The `scan` mode: rescans the state directories every `interval` for new
/// containers; exits are reported at once through pidfds.
#[derive(Debug)]
pub struct Scanner {
    host_root: PathBuf,
    interval: Duration,
    tracked: HashMap<String, u32>,
    roots: Vec<(RuntimeKind, PathBuf)>,
}

impl Scanner {
    /// A scanner of the state directories under `host_root`.
    pub fn new(host_root: PathBuf, interval: Duration) -> Scanner {
        Scanner {
            host_root,
            interval,
            tracked: HashMap::new(),
            roots: Vec::new(),
        }
    }

    /// Scans another state root (runc's `--root`, a host path) besides
    /// the usual ones.
    #[must_use]
    pub fn state_root(mut self, runtime: RuntimeKind, root: impl Into<PathBuf>) -> Scanner {
        self.roots.push((runtime, root.into()));
        self
    }

    /// Runs until `shutdown` completes.
    pub async fn run(
        mut self,
        sink: &mut dyn Sink,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let (tx, mut rx) = mpsc::channel::<(Container, u32)>(1024);
        let mut tick = tokio::time::interval(self.interval);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = tick.tick() => {
                    let tracked = &self.tracked;
                    for c in scan_state_in(&self.host_root, &self.roots, &|id| tracked.contains_key(id)) {
                        let Some(pid) = c.pid else { continue };
                        self.tracked.insert(c.id.clone(), pid);
                        let (tx, gone, exited) = (tx.clone(), c.clone(), pidfd::exit_of(pid));
                        tokio::spawn(async move {
                            exited.await;
                            let _ = tx.send((gone, pid)).await;
                        });
                        sink.emit(ContainerEvent::added(Source::StateScan, c));
                    }
                }
                Some((c, pid)) = rx.recv() => {
                    if self.tracked.get(&c.id) == Some(&pid) {
                        self.tracked.remove(&c.id);
                        sink.emit(ContainerEvent::removed(Source::StateScan, c, None));
                    }
                }
            }
        }
    }
}
