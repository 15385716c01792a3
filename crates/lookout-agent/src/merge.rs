//! One stream of events from several backends: the runtime hook (or the
//! scan) and the fallback Pod informer report the same containers; each
//! container is added once and removed once, by whichever source saw it
//! first. Events are enriched with the informer's Kubernetes metadata.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lookout_informer::Index;
use lookout_model::{ContainerEvent, EventKind, Sink, Source};

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

/// Live containers by id, and who reported them.
struct Merger<S> {
    out: S,
    live: HashMap<String, Source>,
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
        let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // The record is shared with the hook's table: copied only when the
        // informer adds something.
        if let Some(k) = m.index.as_ref().and_then(|i| i.enriched(&event.container)) {
            Arc::make_mut(&mut event.container).kubernetes = Some(k);
        }
        let id = event.container.id.clone();
        match event.event {
            EventKind::Added => {
                if let Some(first) = m.live.get(&id) {
                    tracing::debug!(id, first = %first, again = %event.source, "already reported");
                    m.metrics.duplicate();
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
                m.live.insert(id, event.source);
            }
            EventKind::Removed => {
                if m.live.remove(&id).is_none() {
                    m.metrics.duplicate();
                    return;
                }
            }
            // Gone already: nothing to update.
            EventKind::Updated => {
                if !m.live.contains_key(&id) {
                    return;
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
}
