//! `--gate SOCKET`: the least a start gate does, for the gated-start row of
//! `cargo xtask bench`.
//!
//! A plain tonic server on its own thread serves `lookout.v1.Lookout/Gate`
//! (nothing else, no peer check) to one subscriber at a time. When the work
//! floor reports a created container, it sends the subscriber a `Hold`; a
//! `start` of that container that comes before the `Decision` is kept
//! unanswered, and the server's thread answers it when the decision
//! arrives, without handing it back. A start with nothing open goes on at
//! once.
//!
//! What it leaves out, and the agent does not: several subscribers, filters,
//! deadlines and failure policies (a subscriber that never answers holds
//! its starts for ever here), peer credentials, metrics.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use lookout_api::v1 as pb;
use lookout_fanotify::Permission;
use lookout_model::Container;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;

/// The gate, shared by the answering thread and the server's.
#[derive(Clone, Default)]
pub struct Gate(Arc<Mutex<State>>);

#[derive(Default)]
struct State {
    /// The subscriber's queue of holds, while one is connected.
    subscriber: Option<mpsc::UnboundedSender<pb::Hold>>,
    last_id: u64,
    /// Open holds by id: the container's id, and its start once it came
    /// (and when).
    open: HashMap<u64, (String, Option<(Permission, Instant)>)>,
    /// Containers decided before their start came.
    decided: std::collections::HashSet<String>,
}

impl Gate {
    /// Serves the gate on `socket` from a thread of its own.
    pub fn serve(socket: &Path) -> Result<Gate, Box<dyn std::error::Error>> {
        let _ = std::fs::remove_file(socket);
        let listener = std::os::unix::net::UnixListener::bind(socket)
            .map_err(|e| format!("binding {}: {e}", socket.display()))?;
        listener.set_nonblocking(true)?;
        let gate = Gate::default();
        let service = pb::lookout_server::LookoutServer::new(gate.clone());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let listener = {
            let _in = runtime.enter();
            tokio::net::UnixListener::from_std(listener)?
        };
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        std::thread::Builder::new()
            .name("gate-floor".into())
            .spawn(move || {
                let served = runtime.block_on(
                    tonic::transport::Server::builder()
                        .add_service(service)
                        .serve_with_incoming(incoming),
                );
                if let Err(e) = served {
                    eprintln!("the gate floor's server stopped: {e}");
                }
            })?;
        Ok(gate)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds the start of `c`, just reported, if a subscriber is connected.
    pub fn hold(&self, c: &Container) {
        let mut s = self.lock();
        let Some(tx) = s.subscriber.clone() else {
            return;
        };
        s.last_id += 1;
        let hold_id = s.last_id;
        s.open.insert(hold_id, (c.id.clone(), None));
        let hold = pb::Hold {
            hold_id,
            container: Some(container_pb(c)),
            held: true,
            monotonic_ns: lookout_model::monotonic_ns(),
        };
        if tx.send(hold).is_err() {
            s.open.remove(&hold_id);
        }
    }

    /// The exec of `start ID`: gives `perm` back to be answered now when
    /// nothing holds the start; else keeps it for the decision.
    ///
    /// Each start of a container it held logs `held ID MICROSECONDS` to
    /// stderr: how long the start waited (0: decided before it came), the
    /// figure the agent's `lookout_gate_start_wait_seconds` keeps.
    pub fn start(&self, id: &str, perm: Permission) -> Option<Permission> {
        let mut s = self.lock();
        let open = s
            .open
            .values_mut()
            .find(|(held, p)| held == id && p.is_none());
        match open {
            Some((_, slot)) => {
                *slot = Some((perm, Instant::now()));
                None
            }
            None => Some(perm),
        }
    }

    /// After a start that [`Gate::start`] gave back was answered: logs a
    /// start decided before it came as `held ID 0`.
    pub fn answered(&self, id: &str) {
        if self.lock().decided.remove(id) {
            eprintln!("held {id} 0");
        }
    }

    /// The subscriber's decision on `hold_id`: answers its start if it came.
    fn decide(&self, hold_id: u64, allow: bool) {
        let mut s = self.lock();
        let Some((id, start)) = s.open.remove(&hold_id) else {
            return;
        };
        let Some((perm, since)) = start else {
            s.decided.insert(id);
            return;
        };
        drop(s);
        let answered = if allow { perm.allow() } else { perm.deny() };
        if let Err(e) = answered {
            eprintln!("answering a held start: {e}");
        }
        eprintln!("held {id} {}", since.elapsed().as_micros());
    }

    /// The subscriber went away: every start it held goes on.
    fn gone(&self) {
        let mut s = self.lock();
        s.subscriber = None;
        // Dropping an unanswered permission allows it.
        s.open.clear();
        s.decided.clear();
    }
}

type Out<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl pb::lookout_server::Lookout for Gate {
    async fn list(
        &self,
        _: tonic::Request<pb::ListRequest>,
    ) -> Result<tonic::Response<pb::ListResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the gate floor serves Gate only",
        ))
    }

    type WatchStream = Out<pb::WatchEvent>;

    async fn watch(
        &self,
        _: tonic::Request<pb::WatchRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the gate floor serves Gate only",
        ))
    }

    type GateStream = Out<pb::GateResponse>;

    async fn gate(
        &self,
        req: tonic::Request<tonic::Streaming<pb::GateRequest>>,
    ) -> Result<tonic::Response<Self::GateStream>, tonic::Status> {
        let mut inbound = req.into_inner();
        let Some(pb::GateRequest {
            msg: Some(pb::gate_request::Msg::Subscribe(sub)),
        }) = inbound.message().await?
        else {
            return Err(tonic::Status::invalid_argument("send Subscribe first"));
        };
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut s = self.lock();
            if s.subscriber.as_ref().is_some_and(|t| !t.is_closed()) {
                return Err(tonic::Status::resource_exhausted(
                    "the gate floor takes one subscriber",
                ));
            }
            s.subscriber = Some(tx);
        }
        let gate = self.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                if let Some(pb::gate_request::Msg::Decision(d)) = m.msg {
                    gate.decide(d.hold_id, d.allow);
                }
            }
            gate.gone();
        });
        let subscribed = pb::GateResponse {
            msg: Some(pb::gate_response::Msg::Subscribed(pb::Subscribed {
                name: sub.name,
                deadline_ms: u32::MAX,
            })),
        };
        let holds = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|h| {
            Ok(pb::GateResponse {
                msg: Some(pb::gate_response::Msg::Hold(h)),
            })
        });
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::once(Ok(subscribed)).chain(holds),
        )))
    }
}

/// What the work floor knows of a container, as a subscriber reads it.
fn container_pb(c: &Container) -> pb::Container {
    let text = |p: &Option<std::path::PathBuf>| {
        p.as_ref()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    pb::Container {
        id: c.id.clone(),
        runtime: c.runtime.to_string(),
        pid: c.pid.unwrap_or(0),
        status: "created".into(),
        bundle: text(&c.bundle),
        cgroup: c.cgroup.clone().unwrap_or_default(),
        annotations: c.annotations.clone().into_iter().collect(),
        args: c.args.clone(),
        source: "runtime-hook".into(),
        namespaces: Some(pb::Namespaces {
            mnt: c.namespaces.mnt.unwrap_or(0),
            pid: c.namespaces.pid.unwrap_or(0),
            net: c.namespaces.net.unwrap_or(0),
            ..Default::default()
        }),
        ..Default::default()
    }
}
