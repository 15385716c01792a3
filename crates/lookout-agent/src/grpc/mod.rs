//! The consumer API: `lookout.v1.Lookout` over gRPC on a Unix socket, on
//! a thread and runtime of its own (consumers never share a thread with
//! the path that answers runtime execs). Peers are known by `SO_PEERCRED`:
//! `Gate` is for root and allow-listed uids/gids; `List` and `Watch` for
//! whoever can open the socket (mode 0660, group `--socket-group`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use lookout_api::v1 as pb;
use lookout_api::v1::lookout_server::{Lookout, LookoutServer};
use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Response, Status, Streaming};

use crate::hub::{Hub, Refused, Responder, Subscription, Verdict, WatchEnd, WatchItem, WeakLive};
use crate::watch_wire::{FramedLookout, Frames, Out, WatchFrame, WatchFrames};
use crate::wire;

mod limit;
mod socket;

use limit::ConnectionLimit;
pub use socket::{bind, create_socket_dir, unbind};

/// Who may use `Gate` besides root.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// Allowed uids.
    pub uids: Vec<u32>,
    /// Allowed gids (the peer's primary gid).
    pub gids: Vec<u32>,
}

impl Auth {
    fn gate(&self, uid: u32, gid: u32) -> bool {
        uid == 0 || self.uids.contains(&uid) || self.gids.contains(&gid)
    }
}

/// The gRPC service over the hub.
pub struct Service {
    hub: Arc<Hub>,
    auth: Auth,
    default_deadline: Duration,
    /// The changes encoded for the watchers lately.
    frames: Arc<Frames>,
}

/// Bytes at most in one request message (a Subscribe with the largest
/// filter fits with room to spare).
pub const MAX_REQUEST_BYTES: usize = 256 * 1024;

/// A subscriber name fit for logs and metric labels.
fn clean_name(name: &str) -> String {
    let n: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "-_.:/".contains(*c))
        .take(64)
        .collect();
    if n.is_empty() { "unnamed".into() } else { n }
}

impl WatchFrames for Service {
    /// `Watch`: a snapshot first when asked, then every change, each
    /// encoded once for all watchers ([`Frames`]).
    async fn watch_frames(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Out<WatchFrame>>, Status> {
        let root = req
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|i| i.peer_cred)
            .is_some_and(|c| c.uid() == 0);
        let r = req.into_inner();
        let mut w = self
            .hub
            .watch_as(r.since, wire::filter_of(r.filter)?, root)
            .map_err(refused)?;
        let frames = Arc::clone(&self.frames);
        let out = async_stream::stream! {
            loop {
                match w.next().await {
                    Ok(WatchItem::Snapshot { revision, containers }) => {
                        // Held weakly while they are sent: a consumer that
                        // stops reading in the middle keeps no record alive
                        // that the table and the window let go.
                        let pending: Vec<WeakLive> = containers.iter().map(WeakLive::new).collect();
                        drop(containers);
                        for l in &pending {
                            let Some(l) = l.upgrade() else {
                                let e = w.fell_behind();
                                yield Err(Status::resource_exhausted(e.to_string()));
                                return;
                            };
                            // Nothing strong is held across the yield (a
                            // stream that is not polled again keeps it).
                            let event = wire::snapshot_pb(revision, &l);
                            drop(l);
                            yield Ok(WatchFrame::Message(Box::new(event)));
                        }
                        yield Ok(WatchFrame::Message(Box::new(wire::snapshot_end_pb(revision))));
                    }
                    Ok(WatchItem::Change(c)) => {
                        let frame = frames.change(&c);
                        drop(c);
                        yield Ok(WatchFrame::Encoded(frame));
                    }
                    Err(e @ WatchEnd::Lagged(_)) => {
                        yield Err(Status::resource_exhausted(e.to_string()));
                        break;
                    }
                    Err(WatchEnd::Closed) => {
                        // After the last change: a standby agent that reads
                        // this has them all.
                        yield Err(Status::unavailable(wire::CLOSING));
                        break;
                    }
                }
            }
        };
        Ok(Response::new(Box::pin(out)))
    }
}

#[tonic::async_trait]
impl Lookout for Service {
    async fn list(
        &self,
        req: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        // Handed over: the successor numbers what follows.
        if self.hub.is_closed() {
            return Err(refused(Refused::Closing));
        }
        let (revision, live) = self.hub.list(&wire::filter_of(req.into_inner().filter)?);
        Ok(Response::new(pb::ListResponse {
            revision,
            containers: live.iter().map(wire::container_pb).collect(),
        }))
    }

    type WatchStream = Out<pb::WatchEvent>;

    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        // The socket serves `Watch` through `FramedLookout`, which sends
        // the frames as they are; this is the generated server's path, the
        // same stream with each change decoded again.
        use futures::StreamExt;
        use prost::Message;
        let frames = self.watch_frames(req).await?.into_inner();
        Ok(Response::new(Box::pin(frames.map(|f| {
            f.and_then(|f| match f {
                WatchFrame::Message(m) => Ok(*m),
                WatchFrame::Encoded(b) => pb::WatchEvent::decode(b)
                    .map_err(|e| Status::internal(format!("decoding a watch event: {e}"))),
            })
        }))))
    }

    type GateStream = Out<pb::GateResponse>;

    async fn gate(
        &self,
        req: Request<Streaming<pb::GateRequest>>,
    ) -> Result<Response<Self::GateStream>, Status> {
        let cred = req
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|i| i.peer_cred);
        let Some(cred) = cred else {
            return Err(Status::permission_denied("peer credentials unknown"));
        };
        let (uid, gid) = (cred.uid(), cred.gid());
        if !self.auth.gate(uid, gid) {
            tracing::warn!(
                pid = cred.pid(),
                uid,
                gid,
                "Gate refused: the peer is neither root nor allow-listed (--gate-allow-uid/--gate-allow-gid)"
            );
            return Err(Status::permission_denied(format!(
                "uid {uid} may not gate containers (root or --gate-allow-uid/--gate-allow-gid only)"
            )));
        }
        let mut inbound = req.into_inner();
        let first = tokio::time::timeout(Duration::from_secs(10), inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("send Subscribe first, within 10 s"))??;
        let Some(pb::GateRequest {
            msg: Some(pb::gate_request::Msg::Subscribe(s)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "the first message must be Subscribe",
            ));
        };
        let name = clean_name(&s.name);
        let deadline = match s.deadline_ms {
            0 => self.default_deadline,
            ms => Duration::from_millis(u64::from(ms)),
        };
        let filter = wire::filter_of(s.filter)?;
        let on_failure = wire::failure_policy_of(s.on_failure)?;
        let sub = self
            .hub
            .gate_as(
                Subscription {
                    name: name.clone(),
                    filter,
                    deadline,
                    on_failure,
                },
                uid,
            )
            .map_err(refused)?;
        tracing::info!(
            gate = name,
            pid = cred.pid(),
            uid,
            deadline = ?sub.deadline,
            ?on_failure,
            "gate subscriber connected"
        );
        let deadline_ms = sub.deadline.as_millis().min(u128::from(u32::MAX)) as u32;
        let out = async_stream::stream! {
            // The whole subscriber, registration included, lives as long
            // as the stream (a closure would capture only `sub.holds`).
            let mut sub = sub;
            yield Ok(pb::GateResponse {
                msg: Some(pb::gate_response::Msg::Subscribed(pb::Subscribed {
                    name: name.clone(),
                    deadline_ms,
                })),
            });
            // Holds waiting for this subscriber's decision. Dropped with
            // the stream when the subscriber goes away: each hold then
            // resolves at once by the subscriber's policy.
            let mut pending: HashMap<u64, Responder> = HashMap::new();
            // Logs the end however it comes (a killed subscriber's stream
            // is dropped, not ended).
            let _gone = Gone(name.clone());
            loop {
                tokio::select! {
                    hold = sub.holds.recv() => {
                        let Some(h) = hold else {
                            tracing::debug!(gate = name, "gate: the hub closed the subscription");
                            break;
                        };
                        let held = h.respond.is_some();
                        if let Some(tx) = h.respond {
                            pending.retain(|_, tx| !tx.is_closed());
                            pending.insert(h.hold_id, tx);
                        }
                        yield Ok(pb::GateResponse {
                            msg: Some(pb::gate_response::Msg::Hold(pb::Hold {
                                hold_id: h.hold_id,
                                container: Some(wire::container_pb(&h.live)),
                                held,
                                monotonic_ns: h.monotonic_ns,
                            })),
                        });
                    }
                    msg = inbound.message() => match msg {
                        Ok(Some(pb::GateRequest { msg: Some(pb::gate_request::Msg::Decision(d)) })) => {
                            if let Some(tx) = pending.remove(&d.hold_id) {
                                let v = if d.allow {
                                    if !d.reason.is_empty() {
                                        tracing::debug!(gate = name, hold = d.hold_id, reason = d.reason, "allowed");
                                    }
                                    Verdict::Allow
                                } else {
                                    Verdict::Deny(if d.reason.is_empty() { "no reason given".into() } else { d.reason.chars().take(256).collect() })
                                };
                                let _ = tx.send(v);
                            }
                        }
                        Ok(Some(_)) => {
                            yield Err(Status::invalid_argument("only Decision messages after Subscribe"));
                            break;
                        }
                        Ok(None) => {
                            tracing::debug!(gate = name, "gate: the subscriber closed its stream");
                            break;
                        }
                        Err(e) => {
                            tracing::debug!(gate = name, %e, "gate: the subscriber's stream failed");
                            break;
                        }
                    },
                }
            }
        };
        Ok(Response::new(Box::pin(out)))
    }
}

/// The status for a refused consumer.
fn refused(e: Refused) -> Status {
    match e {
        Refused::Full { .. } => Status::resource_exhausted(e.to_string()),
        Refused::Closing => Status::unavailable(e.to_string()),
    }
}

/// Logs a gate subscriber's departure when its stream goes.
struct Gone(String);

impl Drop for Gone {
    fn drop(&mut self) {
        tracing::info!(
            gate = self.0,
            "gate subscriber gone; its open holds follow its policy"
        );
    }
}

/// The consumer socket's `grpc.health.v1.Health` statuses: the overall
/// service (`""`) and `lookout.v1.Lookout` are NOT_SERVING until the agent
/// is ready, SERVING while it runs, and NOT_SERVING from the moment it
/// starts to shut down.
///
/// Setting them never blocks the caller (the start-up and shutdown path of
/// discovery): the API's own runtime applies the latest value.
pub struct Health(tokio::sync::watch::Sender<bool>);

impl Health {
    /// SERVING or NOT_SERVING, both statuses.
    pub fn set(&self, serving: bool) {
        self.0.send_replace(serving);
    }
}

/// Sets the overall status and `lookout.v1.Lookout`'s.
async fn set_health(
    reporter: &tonic_health::server::HealthReporter,
    status: tonic_health::ServingStatus,
) {
    for name in ["", LOOKOUT_SERVICE] {
        reporter.set_service_status(name, status).await;
    }
}

/// Applies every change of `serving` to `reporter`, on the API's runtime.
async fn report_health(
    reporter: tonic_health::server::HealthReporter,
    mut serving: tokio::sync::watch::Receiver<bool>,
) {
    use tonic_health::ServingStatus;
    loop {
        let status = if *serving.borrow_and_update() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        set_health(&reporter, status).await;
        if serving.changed().await.is_err() {
            // The agent's run ended: it is shutting down.
            set_health(&reporter, ServingStatus::NotServing).await;
            return;
        }
    }
}

/// `lookout.v1.Lookout`.
const LOOKOUT_SERVICE: &str = <LookoutServer<Service> as tonic::server::NamedService>::NAME;

/// Reflection for `lookout.v1` and `grpc.health.v1`, in the v1 and the
/// older v1alpha protocol (grpcurl and evans try v1 first, grpcui and older
/// tools ask for v1alpha).
fn reflection() -> anyhow::Result<(
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
)> {
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(lookout_api::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let v1 = builder().build_v1().context("reflection (v1)")?;
    let v1alpha = builder().build_v1alpha().context("reflection (v1alpha)")?;
    Ok((v1, v1alpha))
}

/// Serves the API on `listener` (a std listener, registered on the
/// server's own runtime) from a thread of its own. The health statuses
/// start NOT_SERVING; the caller sets them with the returned [`Health`].
pub fn spawn(
    listener: std::os::unix::net::UnixListener,
    path: PathBuf,
    hub: Arc<Hub>,
    auth: Auth,
    default_deadline: Duration,
    (max_connections, max_per_uid): (usize, usize),
) -> anyhow::Result<Health> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let (serving, serving_rx) = tokio::sync::watch::channel(false);
    let (reflection_v1, reflection_v1alpha) = reflection()?;
    crate::listen::on_own_thread("lookout-grpc", "the consumer API", move || async move {
        // Before the first connection is served: NOT_SERVING (the reporter
        // starts with "" SERVING), then whatever the agent says.
        set_health(&reporter, tonic_health::ServingStatus::NotServing).await;
        tokio::spawn(report_health(reporter, serving_rx));
        let listener = match tokio::net::UnixListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(%e, "consumer API: cannot register the socket");
                return;
            }
        };
        // Below h2: the `:authority` that Python and Java clients send on
        // a Unix socket, which h2 refuses, becomes `localhost`.
        let limit = Arc::new(ConnectionLimit::new(
            max_connections,
            max_per_uid,
            hub.metrics().clone(),
        ));
        let incoming = tokio_stream::StreamExt::filter_map(
            crate::listen::accepted(listener, "consumer API"),
            move |stream| {
                limit
                    .admit(stream)
                    .map(|c| Ok::<_, std::io::Error>(lookout_api::unix::AuthorityFix::new(c)))
            },
        );
        let svc = Service {
            hub,
            auth,
            default_deadline,
            frames: Arc::default(),
        };
        tracing::info!(socket = %path.display(), "consumer API listening");
        if let Err(e) = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .add_service(FramedLookout::new(svc, MAX_REQUEST_BYTES))
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .serve_with_incoming(incoming)
            .await
        {
            tracing::error!(%e, "consumer API stopped");
        }
    })
    .context("spawning the consumer API thread")?;
    Ok(Health(serving))
}
