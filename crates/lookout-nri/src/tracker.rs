//! What the plugin has reported, so that a resynchronization reports only
//! the difference. Pure: unit-tested without a runtime.

use std::collections::{HashMap, HashSet};

use crate::types::{Container, ContainerPhase, Pod, PodPhase, Runtime, Snapshot};

/// The pods and containers reported so far, by id.
///
/// It holds what the consumer was told: an event the consumer's queue had
/// no room for is undone here ([`Known::undo_pod`], [`Known::undo_container`]),
/// so the next synchronization reports it again.
#[derive(Debug, Default, Clone)]
pub(crate) struct Known {
    pods: HashMap<String, Pod>,
    containers: HashMap<String, Container>,
    synchronized: bool,
}

impl Known {
    /// Records a pod event; returns what undoes it.
    pub(crate) fn pod(&mut self, phase: PodPhase, pod: &Pod) -> PodUndo {
        match phase {
            PodPhase::Remove => {
                let previous = self.pods.remove(&pod.id);
                let mut containers = Vec::new();
                self.containers.retain(|_, c| {
                    let keep = c.pod_sandbox_id != pod.id;
                    if !keep {
                        containers.push(c.clone());
                    }
                    keep
                });
                PodUndo {
                    previous,
                    containers,
                }
            }
            PodPhase::Run | PodPhase::Stop => PodUndo {
                previous: self.pods.insert(pod.id.clone(), pod.clone()),
                containers: Vec::new(),
            },
        }
    }

    /// Undoes a pod event the consumer never got. A removal is put back
    /// (the next synchronization reports the pod gone); otherwise the pod
    /// is forgotten unless it was known before (then reported as new if it
    /// still runs).
    pub(crate) fn undo_pod(&mut self, phase: PodPhase, id: &str, undo: PodUndo) {
        match (phase, undo.previous) {
            (PodPhase::Remove, previous) => {
                if let Some(p) = previous {
                    self.pods.insert(p.id.clone(), p);
                }
                for c in undo.containers {
                    self.containers.insert(c.id.clone(), c);
                }
            }
            (_, Some(previous)) => {
                self.pods.insert(previous.id.clone(), previous);
            }
            (_, None) => {
                self.pods.remove(id);
            }
        }
    }

    /// Records a container event; returns the entry it replaced.
    pub(crate) fn container(
        &mut self,
        phase: ContainerPhase,
        container: &Container,
    ) -> Option<Container> {
        if phase == ContainerPhase::Remove {
            self.containers.remove(&container.id)
        } else {
            self.containers
                .insert(container.id.clone(), container.clone())
        }
    }

    /// Undoes a container event the consumer never got. A removal is put
    /// back (the next synchronization reports the container gone); any
    /// other event forgets the container, so the next synchronization
    /// reports it as new if it still exists: a consumer that reports
    /// containers at one phase (StartContainer, say) must not miss one
    /// whose event at that phase was lost.
    pub(crate) fn undo_container(
        &mut self,
        phase: ContainerPhase,
        id: &str,
        previous: Option<Container>,
    ) {
        if phase == ContainerPhase::Remove {
            if let Some(c) = previous {
                self.containers.insert(c.id.clone(), c);
            }
        } else {
            self.containers.remove(id);
        }
    }

    /// Replaces the state with the runtime's and says what changed.
    pub(crate) fn synchronize(
        &mut self,
        runtime: Runtime,
        pods: Vec<Pod>,
        containers: Vec<Container>,
    ) -> Snapshot {
        let resync = self.synchronized;
        self.synchronized = true;
        let pod_ids: HashSet<&str> = pods.iter().map(|p| p.id.as_str()).collect();
        let container_ids: HashSet<&str> = containers.iter().map(|c| c.id.as_str()).collect();
        let new_pods = pods
            .iter()
            .filter(|p| !self.pods.contains_key(&p.id))
            .map(|p| p.id.clone())
            .collect();
        let new_containers = containers
            .iter()
            .filter(|c| !self.containers.contains_key(&c.id))
            .map(|c| c.id.clone())
            .collect();
        let mut gone_pods: Vec<Pod> = self
            .pods
            .values()
            .filter(|p| !pod_ids.contains(p.id.as_str()))
            .cloned()
            .collect();
        let mut gone_containers: Vec<Container> = self
            .containers
            .values()
            .filter(|c| !container_ids.contains(c.id.as_str()))
            .cloned()
            .collect();
        gone_pods.sort_by(|a, b| a.id.cmp(&b.id));
        gone_containers.sort_by(|a, b| a.id.cmp(&b.id));
        self.pods = pods.iter().map(|p| (p.id.clone(), p.clone())).collect();
        self.containers = containers
            .iter()
            .map(|c| (c.id.clone(), c.clone()))
            .collect();
        Snapshot {
            runtime,
            resync,
            pods,
            containers,
            new_pods,
            new_containers,
            gone_pods,
            gone_containers,
        }
    }
}

/// What undoes a pod event: the pod it replaced or removed, and the
/// containers a removal forgot.
#[derive(Debug)]
pub(crate) struct PodUndo {
    previous: Option<Pod>,
    containers: Vec<Container>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(id: &str) -> Pod {
        Pod {
            id: id.into(),
            ..Default::default()
        }
    }

    fn ctr(id: &str, pod: &str) -> Container {
        Container {
            id: id.into(),
            pod_sandbox_id: pod.into(),
            ..Default::default()
        }
    }

    #[test]
    fn first_synchronization_reports_everything_new() {
        let mut k = Known::default();
        let s = k.synchronize(
            Runtime::default(),
            vec![pod("p1")],
            vec![ctr("c1", "p1"), ctr("c2", "p1")],
        );
        assert!(!s.resync);
        assert_eq!(s.new_pods, ["p1"]);
        assert_eq!(s.new_containers, ["c1", "c2"]);
        assert!(s.gone_pods.is_empty() && s.gone_containers.is_empty());
    }

    #[test]
    fn resync_reports_only_what_changed_while_away() {
        let mut k = Known::default();
        k.synchronize(Runtime::default(), vec![pod("p1")], vec![ctr("c1", "p1")]);
        // Seen live before the disconnect.
        k.pod(PodPhase::Run, &pod("p2"));
        k.container(ContainerPhase::Create, &ctr("c2", "p2"));
        k.container(ContainerPhase::Create, &ctr("c3", "p2"));
        // While away: c1 and p1 were removed, c3 removed, c4 created.
        let s = k.synchronize(
            Runtime::default(),
            vec![pod("p2")],
            vec![ctr("c2", "p2"), ctr("c4", "p2")],
        );
        assert!(s.resync);
        assert!(s.new_pods.is_empty());
        assert_eq!(s.new_containers, ["c4"]);
        let gone: Vec<_> = s.gone_containers.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(gone, ["c1", "c3"]);
        assert_eq!(s.gone_pods[0].id, "p1");
        // A third synchronization with nothing changed reports nothing.
        let s = k.synchronize(
            Runtime::default(),
            vec![pod("p2")],
            vec![ctr("c2", "p2"), ctr("c4", "p2")],
        );
        assert!(s.new_containers.is_empty() && s.gone_containers.is_empty());
    }

    #[test]
    fn removed_things_are_forgotten() {
        let mut k = Known::default();
        k.synchronize(Runtime::default(), vec![], vec![]);
        k.pod(PodPhase::Run, &pod("p"));
        k.container(ContainerPhase::Create, &ctr("c", "p"));
        k.container(ContainerPhase::Remove, &ctr("c", "p"));
        k.container(ContainerPhase::Create, &ctr("d", "p"));
        k.pod(PodPhase::Remove, &pod("p"));
        let s = k.synchronize(Runtime::default(), vec![], vec![]);
        assert!(s.gone_pods.is_empty() && s.gone_containers.is_empty());
    }

    #[test]
    fn undone_events_are_reported_by_the_next_synchronization() {
        let mut k = Known::default();
        k.synchronize(Runtime::default(), vec![pod("p1")], vec![ctr("c1", "p1")]);
        // Delivered: c2 created. Lost: c2's start, c3's create, c1's
        // removal, p2's run, p1's removal... one at a time below.
        k.container(ContainerPhase::Create, &ctr("c2", "p1"));
        let prev = k.container(ContainerPhase::Start, &ctr("c2", "p1"));
        k.undo_container(ContainerPhase::Start, "c2", prev);
        let prev = k.container(ContainerPhase::Create, &ctr("c3", "p1"));
        k.undo_container(ContainerPhase::Create, "c3", prev);
        let prev = k.container(ContainerPhase::Remove, &ctr("c1", "p1"));
        k.undo_container(ContainerPhase::Remove, "c1", prev);
        let undo = k.pod(PodPhase::Run, &pod("p2"));
        k.undo_pod(PodPhase::Run, "p2", undo);
        let s = k.synchronize(
            Runtime::default(),
            vec![pod("p1"), pod("p2")],
            vec![ctr("c2", "p1"), ctr("c3", "p1")],
        );
        // c2's start was lost: reported again as new, as are c3 and p2;
        // c1's removal was lost: reported gone.
        assert_eq!(s.new_containers, ["c2", "c3"]);
        assert_eq!(s.new_pods, ["p2"]);
        let gone: Vec<_> = s.gone_containers.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(gone, ["c1"]);

        // A lost pod removal puts back the pod and its containers.
        let undo = k.pod(PodPhase::Remove, &pod("p1"));
        k.undo_pod(PodPhase::Remove, "p1", undo);
        let s = k.synchronize(Runtime::default(), vec![pod("p2")], vec![]);
        assert_eq!(s.gone_pods.len(), 1);
        assert_eq!(s.gone_pods[0].id, "p1");
        let gone: Vec<_> = s.gone_containers.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(gone, ["c2", "c3"]);
    }
}
