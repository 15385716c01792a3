//! What the plugin has reported, so that a resynchronization reports only
//! the difference. Pure: unit-tested without a runtime.

use std::collections::{HashMap, HashSet};

use crate::types::{Container, ContainerPhase, Pod, PodPhase, Runtime, Snapshot};

/// The pods and containers reported so far, by id.
#[derive(Debug, Default)]
pub(crate) struct Known {
    pods: HashMap<String, Pod>,
    containers: HashMap<String, Container>,
    synchronized: bool,
}

impl Known {
    /// Records a pod event.
    pub(crate) fn pod(&mut self, phase: PodPhase, pod: &Pod) {
        match phase {
            PodPhase::Remove => {
                self.pods.remove(&pod.id);
                self.containers.retain(|_, c| c.pod_sandbox_id != pod.id);
            }
            PodPhase::Run | PodPhase::Stop => {
                self.pods.insert(pod.id.clone(), pod.clone());
            }
        }
    }

    /// Records a container event.
    pub(crate) fn container(&mut self, phase: ContainerPhase, container: &Container) {
        if phase == ContainerPhase::Remove {
            self.containers.remove(&container.id);
        } else {
            self.containers
                .insert(container.id.clone(), container.clone());
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
}
