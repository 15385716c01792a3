//! Writes each container's entries into the pinned maps as its events
//! pass, on the way to the hub.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use lookout_ebpf_common as common;
use lookout_ebpf_common::ContainerEntry;
use lookout_model::{Container, ContainerEvent, ContainerKind, EventKind, RuntimeKind, Sink};

use super::{Maps, PinMetrics, Which};

/// `BPF_ANY`: create or replace.
const BPF_ANY: u64 = 0;
/// A warning of one kind at most this often (the rest are counted).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What this agent wrote for one container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Written {
    cgroup: Option<u64>,
    mntns: Option<u64>,
    entry: ContainerEntry,
}

impl Written {
    fn key(&self, which: Which) -> Option<u64> {
        match which {
            Which::Cgroup => self.cgroup,
            Which::Mntns => self.mntns,
        }
    }

    fn set_key(&mut self, which: Which, key: Option<u64>) {
        match which {
            Which::Cgroup => self.cgroup = key,
            Which::Mntns => self.mntns = key,
        }
    }
}

/// The maps and what this agent wrote into them: the sink writes, the
/// sweep reads who owns what.
pub(crate) struct Pinned {
    maps: Maps,
    /// By container id.
    written: HashMap<String, Written>,
    /// Who holds each key: a key is written for one live container.
    owners: HashMap<(Which, u64), String>,
    /// Keys held, by map (`Which as usize`).
    held: [usize; 2],
    /// A mount namespace no container may be a key for, besides the host's
    /// and the agent's ([`lookout_host::proc::is_host_mount_namespace`]);
    /// for the tests.
    host_mntns: Option<u64>,
    metrics: PinMetrics,
    last_warning: Option<Instant>,
    quiet: u64,
}

impl Pinned {
    pub(crate) fn new(maps: Maps, metrics: PinMetrics) -> Pinned {
        Pinned {
            maps,
            written: HashMap::new(),
            owners: HashMap::new(),
            held: [0; 2],
            host_mntns: None,
            metrics,
            last_warning: None,
            quiet: 0,
        }
    }

    /// Whether this agent holds `key` of `which` for a live container.
    pub(crate) fn owns(&self, which: Which, key: u64) -> bool {
        self.owners.contains_key(&(which, key))
    }

    /// The maps, to remove a stale entry under the same lock as the
    /// writes.
    pub(crate) fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    pub(crate) fn metrics(&self) -> &PinMetrics {
        &self.metrics
    }

    fn apply(&mut self, event: &ContainerEvent) {
        let c = &event.container;
        match event.event {
            EventKind::Added | EventKind::Updated => {
                let Some(want) = wanted(c, self.host_mntns) else {
                    return;
                };
                self.write(&c.id, want);
            }
            EventKind::Removed => self.remove(&c.id),
        }
    }

    /// Writes what changed between what is written for `id` and `want`. A
    /// key `want` does not know is kept: a later event may know less.
    fn write(&mut self, id: &str, want: Written) {
        let had = self.written.get(id).copied();
        let mut now = had.unwrap_or(Written {
            cgroup: None,
            mntns: None,
            entry: want.entry,
        });
        let mut entry = want.entry;
        // What the entry says of its keys is what is written.
        entry.cgroup_id = want.cgroup.or(now.cgroup).unwrap_or(0);
        entry.mnt_ns = want.mntns.or(now.mntns).unwrap_or(0);
        for which in Which::BOTH {
            let old = now.key(which);
            let key = want.key(which).or(old);
            let Some(key) = key else { continue };
            if old == Some(key) && had.is_some_and(|h| h.entry == entry) {
                continue;
            }
            if old.is_some_and(|o| o != key) {
                self.delete(which, old.unwrap_or(0), id);
                now.set_key(which, None);
            }
            if let Some(holder) = self.owners.get(&(which, key)).filter(|h| *h != id) {
                self.metrics.failed(which, "conflict");
                let holder = holder.clone();
                self.warn(|| {
                    tracing::warn!(
                        id,
                        holder,
                        map = which.pin_name(),
                        key,
                        "container shares its key with another live container: the first keeps it"
                    )
                });
                continue;
            }
            match self
                .maps
                .get_mut(which)
                .insert(key, entry.to_bytes(), BPF_ANY)
            {
                Ok(()) => {
                    self.metrics.written(which);
                    now.set_key(which, Some(key));
                    if self.owners.insert((which, key), id.to_owned()).is_none() {
                        self.held[which as usize] += 1;
                    }
                }
                Err(e) => {
                    let full = is_errno(&e, libc::E2BIG);
                    self.metrics
                        .failed(which, if full { "full" } else { "error" });
                    self.warn(|| {
                        if full {
                            tracing::warn!(
                                id,
                                map = which.pin_name(),
                                "pinned map is full (--bpf-map-max-entries): container not in it"
                            )
                        } else {
                            tracing::warn!(id, map = which.pin_name(), %e, "cannot write pinned map entry")
                        }
                    });
                }
            }
        }
        now.entry = entry;
        if now.cgroup.is_some() || now.mntns.is_some() {
            self.written.insert(id.to_owned(), now);
        } else {
            self.written.remove(id);
        }
        self.count();
    }

    fn remove(&mut self, id: &str) {
        let Some(had) = self.written.remove(id) else {
            return;
        };
        for which in Which::BOTH {
            if let Some(key) = had.key(which) {
                self.delete(which, key, id);
            }
        }
        self.count();
    }

    /// Deletes `key` of `which`, which this agent holds for container `id`,
    /// unless the map now says another container's: in a surge, the other
    /// agent may have written a new container's entry under a mount
    /// namespace number the kernel gave again (this one's removal came
    /// late). Then only this agent's hold goes.
    fn delete(&mut self, which: Which, key: u64, id: &str) {
        if self.owners.remove(&(which, key)).is_some() {
            self.held[which as usize] -= 1;
        }
        let now = self.maps.get(which).get(&key, 0).ok();
        if let Some(other) = now
            .and_then(|b| ContainerEntry::from_bytes(&b))
            .filter(|e| e.id() != ContainerEntry::new(id.as_bytes()).id())
        {
            tracing::debug!(
                map = which.pin_name(),
                key,
                id,
                now = %String::from_utf8_lossy(other.id()),
                "the entry is another container's now: left"
            );
            return;
        }
        match self.maps.get_mut(which).remove(&key) {
            Ok(()) => {}
            // Gone already: the other agent of a surge removed it first.
            Err(e) if is_errno(&e, libc::ENOENT) => {}
            Err(e) => {
                self.metrics.failed(which, "error");
                self.warn(|| tracing::warn!(map = which.pin_name(), key, %e, "cannot remove pinned map entry"));
            }
        }
    }

    fn count(&self) {
        for which in Which::BOTH {
            self.metrics.set_entries(which, self.held[which as usize]);
        }
    }

    /// Runs `log` unless a warning went out less than [`WARN_EVERY`] ago.
    fn warn(&mut self, log: impl FnOnce()) {
        let now = Instant::now();
        if self
            .last_warning
            .is_some_and(|t| now.duration_since(t) < WARN_EVERY)
        {
            self.quiet += 1;
            return;
        }
        if self.quiet > 0 {
            tracing::warn!(
                suppressed = self.quiet,
                "pinned maps: earlier warnings suppressed (see lookout_pinned_map_write_failures)"
            );
            self.quiet = 0;
        }
        self.last_warning = Some(now);
        log();
    }
}

/// Whether `e` is a failed syscall with `errno`.
pub(super) fn is_errno(e: &aya::maps::MapError, errno: i32) -> bool {
    matches!(e, aya::maps::MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(errno))
}

/// The keys and entry of `c`, if it has a key a host BPF program sees.
fn wanted(c: &Container, host_mntns: Option<u64>) -> Option<Written> {
    // A gVisor container's processes run in the sandbox's own kernel: no
    // host program sees them, and the sandbox's host process is shared by
    // the pod's containers.
    if c.sandbox.is_some() {
        return None;
    }
    // A container that shares the host's (or the agent's) mount namespace
    // (a runtime can be told to join any) would claim every host process.
    let mntns = c
        .namespaces
        .mnt
        .filter(|m| Some(*m) != host_mntns && !lookout_host::proc::is_host_mount_namespace(*m));
    if c.cgroup_id.is_none() && mntns.is_none() {
        return None;
    }
    let mut entry = ContainerEntry::new(c.id.as_bytes());
    entry.kind = match c.kind {
        Some(ContainerKind::Regular) => common::CONTAINER_KIND_REGULAR,
        Some(ContainerKind::Init) => common::CONTAINER_KIND_INIT,
        Some(ContainerKind::Ephemeral) => common::CONTAINER_KIND_EPHEMERAL,
        Some(ContainerKind::Sandbox) => common::CONTAINER_KIND_SANDBOX,
        None if c.pod_sandbox => common::CONTAINER_KIND_SANDBOX,
        _ => common::CONTAINER_KIND_UNKNOWN,
    };
    entry.runtime = match c.runtime {
        RuntimeKind::Runc => common::RUNTIME_RUNC,
        RuntimeKind::Crun => common::RUNTIME_CRUN,
        RuntimeKind::Runsc => common::RUNTIME_RUNSC,
        RuntimeKind::Youki => common::RUNTIME_YOUKI,
        RuntimeKind::Conmon => common::RUNTIME_CONMON,
        _ => common::RUNTIME_OTHER,
    };
    entry.pid_ns = c.namespaces.pid.unwrap_or(0);
    Some(Written {
        cgroup: c.cgroup_id,
        mntns,
        entry,
    })
}

/// The sink that writes the pinned maps, then passes every event on.
pub(crate) struct PinSink<S> {
    out: S,
    pinned: Option<Arc<Mutex<Pinned>>>,
}

impl<S> PinSink<S> {
    /// Writes into `pinned` (none: passes events on untouched).
    pub(crate) fn new(out: S, pinned: Option<Arc<Mutex<Pinned>>>) -> PinSink<S> {
        PinSink { out, pinned }
    }

    /// The sink events go to next.
    pub(crate) fn inner(&self) -> &S {
        &self.out
    }
}

impl<S: Sink> Sink for PinSink<S> {
    fn emit(&mut self, event: ContainerEvent) {
        if let Some(p) = &self.pinned {
            // Held for a syscall or two per key; the sweep holds it no
            // longer.
            p.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .apply(&event);
        }
        self.out.emit(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(id: &str) -> Container {
        let mut c = Container::new(id, RuntimeKind::Crun);
        c.cgroup_id = Some(77);
        c.namespaces.mnt = Some(4026532001);
        c.namespaces.pid = Some(4026532002);
        c.kind = Some(ContainerKind::Init);
        c
    }

    #[test]
    fn entry_names_the_container_and_its_keys() {
        let w = wanted(&container("abc"), None).expect("has keys");
        assert_eq!(w.cgroup, Some(77));
        assert_eq!(w.mntns, Some(4026532001));
        assert_eq!(w.entry.id(), b"abc");
        assert_eq!(w.entry.kind, common::CONTAINER_KIND_INIT);
        assert_eq!(w.entry.runtime, common::RUNTIME_CRUN);
        assert_eq!(w.entry.pid_ns, 4026532002);
    }

    #[test]
    fn no_entry_without_a_key_or_in_a_sandbox() {
        let mut c = container("abc");
        c.sandbox = Some("gvisor".into());
        assert!(wanted(&c, None).is_none());
        let mut c = container("abc");
        c.cgroup_id = None;
        c.namespaces.mnt = None;
        assert!(wanted(&c, None).is_none());
    }

    /// Unpinned maps made as the agent makes them; `None` (loudly, and a
    /// failure under CI) without the privilege to make BPF maps.
    fn maps(test: &str) -> Option<Pinned> {
        let make = || {
            let def = |_| {
                aya_obj::Map::new_from_params(
                    1,
                    8,
                    ContainerEntry::SIZE as u32,
                    4,
                    common::CONTAINER_MAPS_FLAGS,
                )
            };
            let one = |which: Which| {
                aya::maps::MapData::create(def(which), "lookout_test", None)
                    .and_then(|d| super::super::EntryMap::try_from(aya::maps::Map::HashMap(d)))
            };
            Ok::<_, aya::maps::MapError>(Maps {
                by_cgroup: one(Which::Cgroup)?,
                by_mntns: one(Which::Mntns)?,
            })
        };
        match make() {
            Ok(maps) => {
                let metrics =
                    PinMetrics::register(&mut prometheus_client::registry::Registry::default());
                let mut p = Pinned::new(maps, metrics);
                p.host_mntns = Some(4026531840);
                Some(p)
            }
            Err(e) => {
                let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false");
                assert!(!ci, "{test}: cannot make BPF maps under CI: {e}");
                eprintln!("\n!!! SKIPPED {test}: cannot make BPF maps (root needed): {e}\n");
                None
            }
        }
    }

    fn read(p: &Pinned, which: Which, key: u64) -> Option<ContainerEntry> {
        p.maps
            .get(which)
            .get(&key, 0)
            .ok()
            .and_then(|b| ContainerEntry::from_bytes(&b))
    }

    fn event(kind: EventKind, c: Container) -> ContainerEvent {
        let c = std::sync::Arc::new(c);
        match kind {
            EventKind::Added => ContainerEvent::added(lookout_model::Source::RuntimeHook, c),
            EventKind::Updated => ContainerEvent::updated(lookout_model::Source::Informer, c),
            _ => ContainerEvent::removed(lookout_model::Source::RuntimeHook, c, None),
        }
    }

    #[test]
    fn entries_follow_added_updated_and_removed() {
        let Some(mut p) = maps("pinned_sink_lifecycle") else {
            return;
        };
        let mut c = container("abc");
        c.kind = None;
        p.apply(&event(EventKind::Added, c.clone()));
        let e = read(&p, Which::Cgroup, 77).expect("written at added");
        assert_eq!(
            (e.kind, e.cgroup_id, e.mnt_ns),
            (common::CONTAINER_KIND_UNKNOWN, 77, 4026532001)
        );
        assert_eq!(read(&p, Which::Mntns, 4026532001), Some(e));
        // An update that knows the kind rewrites both entries; one that
        // knows less (no keys) keeps them.
        c.kind = Some(ContainerKind::Sandbox);
        p.apply(&event(EventKind::Updated, c.clone()));
        assert_eq!(
            read(&p, Which::Cgroup, 77).map(|e| e.kind),
            Some(common::CONTAINER_KIND_SANDBOX)
        );
        assert_eq!(
            read(&p, Which::Mntns, 4026532001).map(|e| e.kind),
            Some(common::CONTAINER_KIND_SANDBOX)
        );
        let mut less = c.clone();
        less.cgroup_id = None;
        less.namespaces.mnt = None;
        p.apply(&event(EventKind::Updated, less.clone()));
        assert!(read(&p, Which::Cgroup, 77).is_some());
        // A new cgroup id moves the entry.
        let mut moved = c.clone();
        moved.cgroup_id = Some(78);
        p.apply(&event(EventKind::Updated, moved));
        assert!(read(&p, Which::Cgroup, 77).is_none());
        assert_eq!(read(&p, Which::Cgroup, 78).map(|e| e.cgroup_id), Some(78));
        assert_eq!(
            read(&p, Which::Mntns, 4026532001).map(|e| e.cgroup_id),
            Some(78)
        );
        // Removed: whatever the event says, what was written goes.
        p.apply(&event(EventKind::Removed, less));
        assert!(read(&p, Which::Cgroup, 78).is_none());
        assert!(read(&p, Which::Mntns, 4026532001).is_none());
        assert!(!p.owns(Which::Cgroup, 78));
    }

    #[test]
    fn a_key_another_live_container_holds_is_not_taken() {
        let Some(mut p) = maps("pinned_sink_conflict") else {
            return;
        };
        p.apply(&event(EventKind::Added, container("first")));
        // Same cgroup and mount namespace (a runtime told to join them).
        p.apply(&event(EventKind::Added, container("second")));
        assert_eq!(
            read(&p, Which::Cgroup, 77).map(|e| e.id().to_vec()),
            Some(b"first".to_vec())
        );
        // The second's removal leaves the first's entries.
        p.apply(&event(EventKind::Removed, container("second")));
        assert_eq!(
            read(&p, Which::Cgroup, 77).map(|e| e.id().to_vec()),
            Some(b"first".to_vec())
        );
        assert!(read(&p, Which::Mntns, 4026532001).is_some());
    }

    #[test]
    fn a_late_removal_leaves_another_containers_entry() {
        let Some(mut p) = maps("pinned_sink_surge") else {
            return;
        };
        p.apply(&event(EventKind::Added, container("old")));
        // The other agent of a surge wrote a new container's entry under
        // the same (reused) mount namespace number before this one saw
        // the old container go.
        let mut new = ContainerEntry::new(b"new");
        new.mnt_ns = 4026532001;
        p.maps
            .get_mut(Which::Mntns)
            .insert(4026532001, new.to_bytes(), 0)
            .expect("the other agent's write");
        p.apply(&event(EventKind::Removed, container("old")));
        assert_eq!(read(&p, Which::Mntns, 4026532001), Some(new));
        assert!(read(&p, Which::Cgroup, 77).is_none(), "its own entry goes");
        assert!(!p.owns(Which::Mntns, 4026532001));
    }

    #[test]
    fn a_full_map_is_counted_and_the_rest_goes_on() {
        let Some(mut p) = maps("pinned_sink_full") else {
            return;
        };
        // The test maps hold 4.
        for n in 0..5u64 {
            let mut c = container(&format!("c{n}"));
            c.cgroup_id = Some(100 + n);
            c.namespaces.mnt = Some(5000 + n);
            p.apply(&event(EventKind::Added, c));
        }
        assert!(read(&p, Which::Cgroup, 103).is_some());
        assert!(
            read(&p, Which::Cgroup, 104).is_none(),
            "a fifth entry in a map of 4"
        );
        // Room again once one goes.
        let mut gone = container("c0");
        gone.cgroup_id = Some(100);
        p.apply(&event(EventKind::Removed, gone));
        let mut again = container("c4");
        again.cgroup_id = Some(104);
        again.namespaces.mnt = Some(5004);
        p.apply(&event(EventKind::Updated, again));
        assert!(read(&p, Which::Cgroup, 104).is_some());
    }

    #[test]
    fn the_hosts_mount_namespace_is_never_a_key() {
        let w = wanted(&container("abc"), Some(4026532001)).expect("cgroup key");
        assert_eq!(w.mntns, None);
        assert_eq!(w.cgroup, Some(77));
    }
}
