//! A small CRI client (kubernetes/cri-api `runtime.v1` over gRPC on a
//! Unix socket) that runs pods like a kubelet: sandbox, create, start,
//! stop, remove.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use super::api;
use api::image_service_client::ImageServiceClient;
use api::runtime_service_client::RuntimeServiceClient;

/// A pod to run, as a kubelet would pass it down: metadata, labels,
/// annotations and containers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSpec {
    /// The pod's Kubernetes namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID.
    pub uid: String,
    /// The pod's labels (the sandbox's, with the kubelet's own
    /// `io.kubernetes.pod.*` labels added).
    pub labels: BTreeMap<String, String>,
    /// The pod's annotations (the sandbox's).
    pub annotations: BTreeMap<String, String>,
    /// Its containers, created and started in this order.
    pub containers: Vec<ContainerSpec>,
}

/// One container of a [`PodSpec`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerSpec {
    /// Its name in the pod.
    pub name: String,
    /// Its image (already in the node: [`super::BUSYBOX_IMAGE`], say).
    pub image: String,
    /// Its argv: the CRI `command` (as a pod's `command:` replaces the
    /// image's entrypoint).
    pub args: Vec<String>,
    /// Host directories or files bind-mounted into it.
    pub mounts: Vec<HostMount>,
}

/// A bind mount from the host into a container (a `hostPath` volume).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostMount {
    /// The path on the host.
    pub host_path: PathBuf,
    /// Where it appears in the container.
    pub container_path: String,
    /// Mounted read-only.
    pub readonly: bool,
}

impl PodSpec {
    /// A pod `namespace/name` with a fresh UID and no container.
    pub fn new(namespace: &str, name: &str) -> PodSpec {
        PodSpec {
            namespace: namespace.into(),
            name: name.into(),
            uid: new_uid(),
            ..PodSpec::default()
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: &str, value: &str) -> PodSpec {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds an annotation.
    pub fn annotation(mut self, key: &str, value: &str) -> PodSpec {
        self.annotations.insert(key.into(), value.into());
        self
    }

    /// Adds a container that runs `args` in `image`.
    pub fn container(mut self, name: &str, image: &str, args: &[&str]) -> PodSpec {
        self.containers.push(ContainerSpec {
            name: name.into(),
            image: image.into(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            mounts: Vec::new(),
        });
        self
    }

    /// Bind-mounts `host_path` at `container_path` in the container added
    /// last.
    ///
    /// # Panics
    /// If no container was added yet.
    pub fn mount(mut self, host_path: &Path, container_path: &str, readonly: bool) -> PodSpec {
        self.containers
            .last_mut()
            .expect("PodSpec::mount after PodSpec::container")
            .mounts
            .push(HostMount {
                host_path: host_path.to_path_buf(),
                container_path: container_path.into(),
                readonly,
            });
        self
    }
}

/// A UUID-shaped UID, unique in this process and across processes.
fn new_uid() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        std::process::id(),
        n & 0xffff,
        (t >> 48) & 0xfff,
        (t >> 36) & 0xfff,
        t & 0xffff_ffff_ffff
    )
}

/// A pod the runtime runs: its sandbox and containers, with how long each
/// step took.
#[derive(Debug, Clone)]
pub struct Pod {
    /// What was asked for.
    pub spec: PodSpec,
    /// The sandbox's id (also its pause container's id).
    pub sandbox_id: String,
    /// The containers' ids, in the spec's order.
    pub container_ids: Vec<String>,
    /// The sandbox's log directory (each container logs to
    /// `<log_directory>/<name>/0.log`), when the client has a log root.
    pub log_directory: Option<PathBuf>,
    /// How long `RunPodSandbox` took.
    pub sandbox_took: Duration,
    /// How long each `CreateContainer` took.
    pub create_took: Vec<Duration>,
    /// How long each `StartContainer` took (empty until started).
    pub start_took: Vec<Duration>,
}

impl Pod {
    /// The id of the container named `name`.
    pub fn container(&self, name: &str) -> Option<&str> {
        let i = self.spec.containers.iter().position(|c| c.name == name)?;
        self.container_ids.get(i).map(String::as_str)
    }

    /// The log file of the container named `name` (CRI log format: `TIME
    /// STREAM TAG text` lines).
    pub fn log_path(&self, name: &str) -> Option<PathBuf> {
        Some(self.log_directory.as_ref()?.join(name).join("0.log"))
    }
}

/// An async CRI client on a runtime's Unix socket.
#[derive(Debug, Clone)]
pub struct Client {
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    log_root: Option<PathBuf>,
}

/// A CRI call's error.
pub type Status = tonic::Status;

impl Client {
    /// Connects to the CRI socket `socket` (containerd's gRPC socket).
    pub async fn connect(socket: &Path) -> io::Result<Client> {
        let path = socket.to_path_buf();
        // The URI is not used: every connection dials the socket.
        let channel = Endpoint::from_static("http://localhost")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, io::Error>(TokioIo::new(stream))
                }
            }))
            .await
            .map_err(|e| io::Error::other(format!("connect to {}: {e}", socket.display())))?;
        Ok(Client {
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            log_root: None,
        })
    }

    /// Pods' log directories go under `dir` (as the kubelet's
    /// `/var/log/pods`); without one, containers do not log.
    pub fn with_log_root(mut self, dir: &Path) -> Client {
        self.log_root = Some(dir.to_path_buf());
        self
    }

    /// The generated `RuntimeService` client, for calls this type lacks.
    pub fn runtime(&mut self) -> &mut RuntimeServiceClient<Channel> {
        &mut self.runtime
    }

    /// The generated `ImageService` client.
    pub fn images(&mut self) -> &mut ImageServiceClient<Channel> {
        &mut self.images
    }

    /// `Version`.
    pub async fn version(&mut self) -> Result<api::VersionResponse, Status> {
        let req = api::VersionRequest {
            version: "v1".into(),
        };
        Ok(self.runtime.version(req).await?.into_inner())
    }

    /// Whether the runtime knows `image` (`ImageStatus`).
    pub async fn has_image(&mut self, image: &str) -> Result<bool, Status> {
        let req = api::ImageStatusRequest {
            image: Some(image_spec(image)),
            verbose: false,
        };
        Ok(self
            .images
            .image_status(req)
            .await?
            .into_inner()
            .image
            .is_some())
    }

    /// `RunPodSandbox` for `spec` (host network, no hostname); the
    /// sandbox's id.
    pub async fn run_pod_sandbox(&mut self, spec: &PodSpec) -> Result<String, Status> {
        let config = self.sandbox_config(spec);
        if !config.log_directory.is_empty() {
            std::fs::create_dir_all(&config.log_directory)
                .map_err(|e| Status::internal(format!("{}: {e}", config.log_directory)))?;
        }
        let req = api::RunPodSandboxRequest {
            config: Some(config),
            runtime_handler: String::new(),
        };
        Ok(self
            .runtime
            .run_pod_sandbox(req)
            .await?
            .into_inner()
            .pod_sandbox_id)
    }

    /// `CreateContainer` for container `c` of `spec` in sandbox
    /// `sandbox_id`; the container's id.
    pub async fn create_container(
        &mut self,
        sandbox_id: &str,
        spec: &PodSpec,
        c: &ContainerSpec,
    ) -> Result<String, Status> {
        let mut labels = BTreeMap::from([
            ("io.kubernetes.container.name".to_owned(), c.name.clone()),
            ("io.kubernetes.pod.name".to_owned(), spec.name.clone()),
            (
                "io.kubernetes.pod.namespace".to_owned(),
                spec.namespace.clone(),
            ),
            ("io.kubernetes.pod.uid".to_owned(), spec.uid.clone()),
        ]);
        labels.retain(|_, v| !v.is_empty());
        let config = api::ContainerConfig {
            metadata: Some(api::ContainerMetadata {
                name: c.name.clone(),
                attempt: 0,
            }),
            image: Some(image_spec(&c.image)),
            command: c.args.clone(),
            mounts: c
                .mounts
                .iter()
                .map(|m| api::Mount {
                    container_path: m.container_path.clone(),
                    host_path: m.host_path.to_string_lossy().into_owned(),
                    readonly: m.readonly,
                    ..Default::default()
                })
                .collect(),
            labels: labels.into_iter().collect(),
            annotations: [
                ("io.kubernetes.container.restartCount", "0"),
                (
                    "io.kubernetes.container.terminationMessagePath",
                    "/dev/termination-log",
                ),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
            log_path: if self.log_root.is_some() {
                format!("{}/0.log", c.name)
            } else {
                String::new()
            },
            linux: Some(api::LinuxContainerConfig {
                security_context: Some(api::LinuxContainerSecurityContext {
                    namespace_options: Some(namespace_options()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let req = api::CreateContainerRequest {
            pod_sandbox_id: sandbox_id.into(),
            config: Some(config),
            sandbox_config: Some(self.sandbox_config(spec)),
        };
        Ok(self
            .runtime
            .create_container(req)
            .await?
            .into_inner()
            .container_id)
    }

    /// `StartContainer`.
    pub async fn start_container(&mut self, id: &str) -> Result<(), Status> {
        let req = api::StartContainerRequest {
            container_id: id.into(),
        };
        self.runtime.start_container(req).await?;
        Ok(())
    }

    /// `ContainerStatus` (not verbose).
    pub async fn container_status(&mut self, id: &str) -> Result<api::ContainerStatus, Status> {
        let req = api::ContainerStatusRequest {
            container_id: id.into(),
            verbose: false,
        };
        self.runtime
            .container_status(req)
            .await?
            .into_inner()
            .status
            .ok_or_else(|| Status::not_found(format!("no status for {id}")))
    }

    /// Polls `ContainerStatus` until the container has exited, or fails
    /// at `timeout`; its status then.
    pub async fn wait_exited(
        &mut self,
        id: &str,
        timeout: Duration,
    ) -> Result<api::ContainerStatus, Status> {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.container_status(id).await?;
            if s.state == api::ContainerState::ContainerExited as i32 {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                return Err(Status::deadline_exceeded(format!(
                    "{id} still {:?} after {timeout:?}",
                    api::ContainerState::try_from(s.state)
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// `StopContainer`, killing after `timeout` seconds (0: at once).
    pub async fn stop_container(&mut self, id: &str, timeout: i64) -> Result<(), Status> {
        let req = api::StopContainerRequest {
            container_id: id.into(),
            timeout,
        };
        self.runtime.stop_container(req).await?;
        Ok(())
    }

    /// `RemoveContainer`.
    pub async fn remove_container(&mut self, id: &str) -> Result<(), Status> {
        let req = api::RemoveContainerRequest {
            container_id: id.into(),
        };
        self.runtime.remove_container(req).await?;
        Ok(())
    }

    /// `StopPodSandbox`.
    pub async fn stop_pod_sandbox(&mut self, id: &str) -> Result<(), Status> {
        let req = api::StopPodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.runtime.stop_pod_sandbox(req).await?;
        Ok(())
    }

    /// `RemovePodSandbox`.
    pub async fn remove_pod_sandbox(&mut self, id: &str) -> Result<(), Status> {
        let req = api::RemovePodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.runtime.remove_pod_sandbox(req).await?;
        Ok(())
    }

    /// `ListContainers`, of sandbox `sandbox_id` or of all.
    pub async fn list_containers(
        &mut self,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<api::Container>, Status> {
        let req = api::ListContainersRequest {
            filter: sandbox_id.map(|s| api::ContainerFilter {
                pod_sandbox_id: s.into(),
                ..Default::default()
            }),
        };
        Ok(self
            .runtime
            .list_containers(req)
            .await?
            .into_inner()
            .containers)
    }

    /// `ListPodSandbox`, all of them.
    pub async fn list_pod_sandboxes(&mut self) -> Result<Vec<api::PodSandbox>, Status> {
        let req = api::ListPodSandboxRequest { filter: None };
        Ok(self.runtime.list_pod_sandbox(req).await?.into_inner().items)
    }

    /// The sandbox and its containers created, none started: the state in
    /// which a node agent must already have reported them.
    pub async fn create_pod(&mut self, spec: &PodSpec) -> Result<Pod, Status> {
        let t = Instant::now();
        let sandbox_id = self.run_pod_sandbox(spec).await?;
        let sandbox_took = t.elapsed();
        let mut pod = Pod {
            spec: spec.clone(),
            sandbox_id,
            container_ids: Vec::new(),
            log_directory: self.log_directory(spec).map(PathBuf::from),
            sandbox_took,
            create_took: Vec::new(),
            start_took: Vec::new(),
        };
        for c in &spec.containers {
            let t = Instant::now();
            match self.create_container(&pod.sandbox_id, spec, c).await {
                Ok(id) => {
                    pod.create_took.push(t.elapsed());
                    pod.container_ids.push(id);
                }
                Err(e) => {
                    let _ = self.remove_pod(&pod).await;
                    return Err(e);
                }
            }
        }
        Ok(pod)
    }

    /// Starts a created pod's containers, in order.
    pub async fn start_pod(&mut self, pod: &mut Pod) -> Result<(), Status> {
        pod.start_took.clear();
        for id in &pod.container_ids {
            let t = Instant::now();
            self.start_container(id).await?;
            pod.start_took.push(t.elapsed());
        }
        Ok(())
    }

    /// What a kubelet does for a new pod: `RunPodSandbox`, then
    /// `CreateContainer` and `StartContainer` for each container. A pod
    /// that fails half-way is removed.
    pub async fn run_pod(&mut self, spec: &PodSpec) -> Result<Pod, Status> {
        let mut pod = self.create_pod(spec).await?;
        if let Err(e) = self.start_pod(&mut pod).await {
            let _ = self.remove_pod(&pod).await;
            return Err(e);
        }
        Ok(pod)
    }

    /// What a kubelet does for a deleted pod (with no grace period):
    /// `StopContainer` and `RemoveContainer` for each container, then
    /// `StopPodSandbox` and `RemovePodSandbox`.
    pub async fn remove_pod(&mut self, pod: &Pod) -> Result<(), Status> {
        for id in &pod.container_ids {
            self.stop_container(id, 0).await?;
            self.remove_container(id).await?;
        }
        self.stop_pod_sandbox(&pod.sandbox_id).await?;
        self.remove_pod_sandbox(&pod.sandbox_id).await
    }

    fn log_directory(&self, spec: &PodSpec) -> Option<String> {
        let root = self.log_root.as_ref()?;
        let dir = root.join(format!("{}_{}_{}", spec.namespace, spec.name, spec.uid));
        Some(dir.to_string_lossy().into_owned())
    }

    fn sandbox_config(&self, spec: &PodSpec) -> api::PodSandboxConfig {
        let mut labels = spec.labels.clone();
        for (k, v) in [
            ("io.kubernetes.pod.name", &spec.name),
            ("io.kubernetes.pod.namespace", &spec.namespace),
            ("io.kubernetes.pod.uid", &spec.uid),
        ] {
            if !v.is_empty() {
                labels.insert(k.into(), v.clone());
            }
        }
        let mut annotations = spec.annotations.clone();
        annotations
            .entry("kubernetes.io/config.source".into())
            .or_insert_with(|| "api".into());
        api::PodSandboxConfig {
            metadata: Some(api::PodSandboxMetadata {
                name: spec.name.clone(),
                uid: spec.uid.clone(),
                namespace: spec.namespace.clone(),
                attempt: 0,
            }),
            // No hostname: the sandbox shares the host's UTS namespace, as
            // a hostNetwork pod's does.
            hostname: String::new(),
            log_directory: self.log_directory(spec).unwrap_or_default(),
            labels: labels.into_iter().collect(),
            annotations: annotations.into_iter().collect(),
            linux: Some(api::LinuxPodSandboxConfig {
                security_context: Some(api::LinuxSandboxSecurityContext {
                    namespace_options: Some(namespace_options()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

fn image_spec(image: &str) -> api::ImageSpec {
    api::ImageSpec {
        image: image.into(),
        ..Default::default()
    }
}

/// A hostNetwork pod's: the node's network (no CNI needed), a PID
/// namespace per container, the pod's IPC namespace.
fn namespace_options() -> api::NamespaceOption {
    api::NamespaceOption {
        network: api::NamespaceMode::Node as i32,
        pid: api::NamespaceMode::Container as i32,
        ipc: api::NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

/// A blocking [`Client`], with its own tokio runtime, for synchronous
/// tests. Not for use inside an async runtime (use [`Client`] there).
#[derive(Debug)]
pub struct Kubelet {
    rt: tokio::runtime::Runtime,
    client: Client,
}

impl Kubelet {
    /// Connects to the CRI socket `socket`; pods' logs go under `log_root`
    /// when given.
    pub fn connect(socket: &Path, log_root: Option<&Path>) -> io::Result<Kubelet> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let mut client = rt.block_on(Client::connect(socket))?;
        if let Some(dir) = log_root {
            client = client.with_log_root(dir);
        }
        Ok(Kubelet { rt, client })
    }

    /// The async client (for `block_on`).
    pub fn client(&mut self) -> &mut Client {
        &mut self.client
    }

    /// Runs `f` on the client to completion.
    pub fn block_on<T>(&mut self, f: impl AsyncFnOnce(&mut Client) -> T) -> T {
        self.rt.block_on(f(&mut self.client))
    }

    /// [`Client::version`].
    pub fn version(&mut self) -> Result<api::VersionResponse, Status> {
        self.rt.block_on(self.client.version())
    }

    /// [`Client::run_pod`].
    pub fn run_pod(&mut self, spec: &PodSpec) -> Result<Pod, Status> {
        self.rt.block_on(self.client.run_pod(spec))
    }

    /// [`Client::create_pod`].
    pub fn create_pod(&mut self, spec: &PodSpec) -> Result<Pod, Status> {
        self.rt.block_on(self.client.create_pod(spec))
    }

    /// [`Client::start_pod`].
    pub fn start_pod(&mut self, pod: &mut Pod) -> Result<(), Status> {
        self.rt.block_on(self.client.start_pod(pod))
    }

    /// [`Client::remove_pod`].
    pub fn remove_pod(&mut self, pod: &Pod) -> Result<(), Status> {
        self.rt.block_on(self.client.remove_pod(pod))
    }

    /// [`Client::container_status`].
    pub fn container_status(&mut self, id: &str) -> Result<api::ContainerStatus, Status> {
        self.rt.block_on(self.client.container_status(id))
    }

    /// [`Client::wait_exited`].
    pub fn wait_exited(
        &mut self,
        id: &str,
        timeout: Duration,
    ) -> Result<api::ContainerStatus, Status> {
        self.rt.block_on(self.client.wait_exited(id, timeout))
    }

    /// [`Client::list_containers`].
    pub fn list_containers(
        &mut self,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<api::Container>, Status> {
        self.rt.block_on(self.client.list_containers(sandbox_id))
    }

    /// [`Client::list_pod_sandboxes`].
    pub fn list_pod_sandboxes(&mut self) -> Result<Vec<api::PodSandbox>, Status> {
        self.rt.block_on(self.client.list_pod_sandboxes())
    }
}
