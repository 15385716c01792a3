//! One stream of events from several backends: the runtime hook (or the
//! scan) and the fallback Pod informer report the same containers; each
//! container is added once and removed once, by whichever source saw it
//! first. Events are enriched with the informer's Kubernetes metadata.
//!
//! A second source's `added` of a live container is a duplicate, but what
//! it knows and the first did not (the informer's image digest of a
//! container the runtime hook reported at `create`, which no pod status
//! named yet) goes out as an `updated` of the live record.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lookout_informer::Index;
use lookout_model::{Container, ContainerEvent, EventKind, Sink, Source};

/// The Pod informer's index, once one runs, for a backend that fills in
/// its containers' Kubernetes identity itself (the runtime hook, before it
/// tracks them: its record is then shared, not copied, downstream).
pub(crate) type IndexSlot = Arc<std::sync::RwLock<Option<Index>>>;

/// Fills `c` from the index in `slot`, if one is set.
pub(crate) fn enrich_from(slot: &IndexSlot, c: &mut lookout_model::Container) {
    let index = slot.read().ok().and_then(|s| s.clone());
    if let Some(i) = index {
        i.enrich(c);
    }
}

/// A live container: who reported it, its record as added (shared with
/// the backend's table and the hub, not copied), and the identity learnt
/// since (identity fields only: a container's annotations can be 256 KiB,
/// and the hub keeps its own merged record).
struct Live {
    source: Source,
    added: Arc<Container>,
    learnt: Option<Box<Container>>,
}

impl Live {
    /// Whether `other` teaches identity not known yet.
    fn lacks_identity_of(&self, other: &Container) -> bool {
        match &self.learnt {
            Some(l) => l.lacks_identity_of(other),
            None => self.added.lacks_identity_of(other),
        }
    }

    /// Learns `other`'s identity; returns the whole record as now known.
    fn learn(&mut self, other: &Container) -> Container {
        let mut full = (*self.added).clone();
        if let Some(l) = &self.learnt {
            full.fill_identity_from(l);
        }
        full.fill_identity_from(other);
        let mut identity = Container::new(full.id.clone(), full.runtime.clone());
        identity.fill_identity_from(&full);
        self.learnt = Some(Box::new(identity));
        full
    }
}

/// Live containers by id, and who reported them.
struct Merger<S> {
    out: S,
    live: HashMap<String, Live>,
    index: Option<Index>,
    /// Docker lookups for Docker's containers, once added.
    docker: Option<crate::docker::Enricher>,
    /// Whether a hook or scan backend runs beside the informer: then an
    /// informer-only container is worth a warning.
    fallback: bool,
    metrics: Arc<crate::metrics::Metrics>,
}

/// A cloneable [`Sink`] over the merger; every clone feeds the same output.
pub struct MergeSink<S> {
    inner: Arc<Mutex<Merger<S>>>,
}

impl<S> Clone for MergeSink<S> {
    fn clone(&self) -> Self {
        MergeSink {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S: Sink> MergeSink<S> {
    /// Merges into `out`. `fallback`: the informer runs beside another
    /// backend.
    pub fn new(out: S, metrics: Arc<crate::metrics::Metrics>, fallback: bool) -> MergeSink<S> {
        MergeSink {
            inner: Arc::new(Mutex::new(Merger {
                out,
                live: HashMap::new(),
                index: None,
                docker: None,
                fallback,
                metrics,
            })),
        }
    }

    /// Look Docker's containers up in dockerd once added (their
    /// `updated` comes back through this sink).
    pub fn set_docker(&self, docker: crate::docker::Enricher) {
        if let Ok(mut m) = self.inner.lock() {
            m.docker = Some(docker);
        }
    }

    /// Enrich events with what this informer knows (the hook fills in
    /// what it reports through `slot`, so that its record is not copied
    /// here).
    pub fn set_index(&self, index: Index, slot: &IndexSlot) {
        if let Ok(mut s) = slot.write() {
            *s = Some(index.clone());
        }
        if let Ok(mut m) = self.inner.lock() {
            m.index = Some(index);
        }
    }
}

impl<S: Sink> Sink for MergeSink<S> {
    fn emit(&mut self, mut event: ContainerEvent) {
        // N.B. a poisoned lock only means an earlier emit panicked; the
        // table is still consistent (it is updated before the write).
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // Borrowed field by field below.
        let m = &mut *guard;
        // The record is shared with the hook's table: copied only when the
        // informer adds something.
        if let Some(e) = m
            .index
            .as_ref()
            .and_then(|i| i.enrichment(&event.container))
        {
            e.apply(Arc::make_mut(&mut event.container));
        }
        let id = event.container.id.clone();
        match event.event {
            EventKind::Added => {
                if let Some(first) = m.live.get_mut(&id) {
                    tracing::debug!(id, first = %first.source, again = %event.source, "already reported");
                    m.metrics.duplicate();
                    // What the second source knows and the first did not
                    // (an image digest, a workload) is sent as `updated`.
                    if !first.lacks_identity_of(&event.container) {
                        return;
                    }
                    let known = first.learn(&event.container);
                    m.out.emit(ContainerEvent::updated(event.source, known));
                    return;
                }
                if m.fallback && event.source == Source::Informer {
                    tracing::warn!(
                        id,
                        pod = event
                            .container
                            .kubernetes
                            .as_ref()
                            .and_then(|k| k.pod.as_deref())
                            .unwrap_or("?"),
                        "container known only to the Pod informer (a gVisor or Kata sandbox, or a runtime the hook does not watch)"
                    );
                }
                let live = Live {
                    source: event.source,
                    added: Arc::clone(&event.container),
                    learnt: None,
                };
                m.live.insert(id, live);
            }
            EventKind::Removed => {
                if m.live.remove(&id).is_none() {
                    m.metrics.duplicate();
                    return;
                }
            }
            // Gone already: nothing to update.
            EventKind::Updated => {
                let Some(live) = m.live.get_mut(&id) else {
                    return;
                };
                // Known from now on: a later `added` teaches only the rest.
                if live.lacks_identity_of(&event.container) {
                    live.learn(&event.container);
                }
            }
        }
        let docker = (event.event == EventKind::Added)
            .then(|| m.docker.clone())
            .flatten();
        let container = docker.as_ref().map(|_| event.container.clone());
        m.out.emit(event);
        // After the `added` went out: the lookup's `updated` waits for this
        // lock, so it can never overtake it.
        if let (Some(d), Some(c)) = (docker, container) {
            d.request(&c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lookout_model::{Container, RuntimeKind};

    #[test]
    fn each_container_is_added_and_removed_once_whoever_reports_it() {
        let got: Arc<Mutex<Vec<String>>> = Arc::default();
        let g = Arc::clone(&got);
        let out = move |e: ContainerEvent| {
            if let Ok(mut v) = g.lock() {
                v.push(format!("{:?} {} {}", e.event, e.container.id, e.source));
            }
        };
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let mut hook = MergeSink::new(out, metrics, true);
        let mut informer = hook.clone();
        let c = |id: &str| Container::new(id, RuntimeKind::Runc);
        hook.emit(ContainerEvent::added(Source::RuntimeHook, c("a")));
        informer.emit(ContainerEvent::added(Source::Informer, c("a")));
        informer.emit(ContainerEvent::added(Source::Informer, c("gvisor")));
        hook.emit(ContainerEvent::removed(
            Source::RuntimeHook,
            c("a"),
            Some(0),
        ));
        informer.emit(ContainerEvent::removed(Source::Informer, c("a"), None));
        informer.emit(ContainerEvent::removed(Source::Informer, c("gvisor"), None));
        let got = got.lock().map(|v| v.clone()).unwrap_or_default();
        assert_eq!(
            got,
            [
                "Added a runtime-hook",
                "Added gvisor informer",
                "Removed a runtime-hook",
                "Removed gvisor informer",
            ]
        );
    }

    /// The runtime hook reports a CRI container at `create`; the informer
    /// sees it running later, with its image digest: one `updated` of the
    /// hook's record (its pid kept), none for what is known already, none
    /// after `removed`.
    #[test]
    fn a_second_source_that_teaches_identity_sends_it_as_updated() {
        let got: Arc<Mutex<Vec<ContainerEvent>>> = Arc::default();
        let g = Arc::clone(&got);
        let out = move |e: ContainerEvent| {
            if let Ok(mut v) = g.lock() {
                v.push(e);
            }
        };
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let mut hook = MergeSink::new(out, Arc::clone(&metrics), true);
        let mut informer = hook.clone();
        let mut created = Container::new("a", RuntimeKind::Runc);
        created.pid = Some(42);
        created.annotations.insert("big".into(), "x".repeat(1024));
        let created = Arc::new(created);
        hook.emit(ContainerEvent::added(
            Source::RuntimeHook,
            Arc::clone(&created),
        ));
        let mut seen = Container::new("a", RuntimeKind::Other("containerd".into()));
        seen.image_digest = Some("nginx@sha256:1".into());
        seen.kind = Some(lookout_model::ContainerKind::Regular);
        informer.emit(ContainerEvent::added(Source::Informer, seen.clone()));
        // Again (a status update after a relist): nothing new.
        informer.emit(ContainerEvent::added(Source::Informer, seen.clone()));
        hook.emit(ContainerEvent::removed(
            Source::RuntimeHook,
            created,
            Some(0),
        ));
        informer.emit(ContainerEvent::updated(Source::Informer, seen.clone()));
        informer.emit(ContainerEvent::added(Source::Informer, seen));
        let got = got.lock().map(|v| v.clone()).unwrap_or_default();
        let kinds: Vec<_> = got.iter().map(|e| (e.event, e.source)).collect();
        assert_eq!(
            kinds,
            [
                (EventKind::Added, Source::RuntimeHook),
                (EventKind::Updated, Source::Informer),
                (EventKind::Removed, Source::RuntimeHook),
                // A late informer report of a removed id is an add of its
                // own (as before), never an update.
                (EventKind::Added, Source::Informer),
            ]
        );
        let updated = &got[1].container;
        assert_eq!(updated.pid, Some(42), "the hook's record, filled");
        assert_eq!(updated.runtime, RuntimeKind::Runc);
        assert_eq!(updated.image_digest.as_deref(), Some("nginx@sha256:1"));
        assert_eq!(updated.kind, Some(lookout_model::ContainerKind::Regular));
        assert_eq!(updated.annotations.len(), 1);
    }
}
