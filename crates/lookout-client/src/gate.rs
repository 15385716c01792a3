//! `Gate`: holds on container starts, answered through guards.

use std::path::PathBuf;
use std::time::Duration;

use lookout_api::v1::{self, gate_request, gate_response, lookout_client::LookoutClient};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::codec::Streaming;
use tonic::transport::Channel;

use crate::Error;
use crate::connect::{self, ConnectOptions};

/// The reason sent for a held guard dropped without an answer.
pub const DROPPED_UNANSWERED: &str = "dropped unanswered";

/// A subscription to the agent's gate: a stream of [`HoldGuard`]s, one per
/// container start that matches the subscription's filter. Made by
/// [`crate::Client::gate`].
///
/// Keep the `Gate` alive while answering: when it goes, the agent sees the
/// subscriber leave and applies the subscription's
/// [failure policy](v1::FailurePolicy) to every hold still open.
///
/// # Recovery
///
/// When the agent ends the gate (it shuts down, or is replaced by a
/// rollout) or the stream drops, [`Gate::next`] redials the socket and
/// subscribes again under the same name, for
/// [`ConnectOptions::retry_for`]. A new agent that took over from the old
/// one keeps the old one's subscriptions for a while and holds the starts
/// they would hold until their subscribers are back: the holds queued
/// meanwhile arrive right after the new subscription, and none escapes a
/// fail-closed gate. Guards from the old stream can no longer be answered
/// (their agent is gone; the new one asks again).
#[derive(Debug)]
pub struct Gate {
    name: String,
    deadline: Duration,
    responses: Streaming<v1::GateResponse>,
    requests: mpsc::UnboundedSender<v1::GateRequest>,
    /// What resubscribing needs.
    path: PathBuf,
    options: ConnectOptions,
    subscribe: v1::Subscribe,
}

impl Gate {
    /// Subscribes through `client` (retried as `options` say), and
    /// resubscribes through `path` later.
    pub(crate) async fn subscribe(
        client: LookoutClient<Channel>,
        path: PathBuf,
        options: ConnectOptions,
        subscribe: v1::Subscribe,
    ) -> Result<Self, Error> {
        let (name, deadline, responses, requests) =
            connect::retry(&options, || Gate::open(client.clone(), subscribe.clone())).await?;
        Ok(Self {
            name,
            deadline,
            responses,
            requests,
            path,
            options,
            subscribe,
        })
    }

    /// Redials and subscribes again (see [Recovery](Gate#recovery)).
    async fn resubscribe(&mut self) -> Result<(), Error> {
        let (path, subscribe) = (&self.path, &self.subscribe);
        let (name, deadline, responses, requests) = connect::retry(&self.options, || async move {
            let channel = connect::dial(path).await?;
            let client = LookoutClient::new(channel);
            Gate::open(client, subscribe.clone()).await
        })
        .await?;
        tracing::info!(gate = name, "subscribed again to the agent's gate");
        (self.name, self.deadline, self.responses, self.requests) =
            (name, deadline, responses, requests);
        Ok(())
    }

    /// Sends `subscribe` and waits for the agent's `Subscribed`.
    async fn open(
        mut client: LookoutClient<Channel>,
        subscribe: v1::Subscribe,
    ) -> Result<
        (
            String,
            Duration,
            Streaming<v1::GateResponse>,
            mpsc::UnboundedSender<v1::GateRequest>,
        ),
        Error,
    > {
        let (requests, outgoing) = mpsc::unbounded_channel();
        send(
            &requests,
            v1::GateRequest {
                msg: Some(gate_request::Msg::Subscribe(subscribe)),
            },
        )?;
        let mut responses = client
            .gate(UnboundedReceiverStream::new(outgoing))
            .await
            .map_err(|status| Error::Rpc {
                rpc: "Gate",
                status,
            })?
            .into_inner();
        let subscribed = match responses.message().await {
            Ok(Some(v1::GateResponse {
                msg: Some(gate_response::Msg::Subscribed(subscribed)),
            })) => subscribed,
            Ok(Some(other)) => {
                return Err(Error::Protocol {
                    rpc: "Gate",
                    detail: format!("expected Subscribed first, got {other:?}"),
                });
            }
            Ok(None) => {
                return Err(Error::Protocol {
                    rpc: "Gate",
                    detail: "the agent ended the gate before Subscribed".to_owned(),
                });
            }
            Err(status) => {
                return Err(Error::Rpc {
                    rpc: "Gate",
                    status,
                });
            }
        };
        Ok((
            subscribed.name,
            Duration::from_millis(u64::from(subscribed.deadline_ms)),
            responses,
            requests,
        ))
    }

    /// The subscription's name, as the agent confirmed it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How long the agent waits for each decision before applying the
    /// failure policy.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The next hold, subscribing again when the stream ends or drops (see
    /// [Recovery](Gate#recovery)). `None` when the agent ended the gate and
    /// no agent took the subscription again within the retry window; an
    /// error when the stream failed and resubscribing did too, or the
    /// error cannot be retried.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe while waiting for a hold: no hold is lost if the future
    /// is dropped before it completes. A resubscription cut short starts
    /// over on the next call.
    pub async fn next(&mut self) -> Option<Result<HoldGuard, Error>> {
        loop {
            let response = match self.responses.message().await {
                Ok(Some(response)) => response,
                Ok(None) => {
                    tracing::info!(
                        gate = self.name,
                        "the agent ended the gate; subscribing again"
                    );
                    match self.resubscribe().await {
                        Ok(()) => continue,
                        Err(e) => {
                            tracing::warn!(
                                gate = self.name,
                                error = %crate::error::chain(&e),
                                "no agent took the gate again"
                            );
                            return None;
                        }
                    }
                }
                Err(status) if crate::error::code_is_retryable(status.code()) => {
                    tracing::warn!(
                        gate = self.name,
                        code = ?status.code(),
                        message = status.message(),
                        "the gate's stream dropped; subscribing again"
                    );
                    match self.resubscribe().await {
                        Ok(()) => continue,
                        Err(e) => return Some(Err(e)),
                    }
                }
                Err(status) => {
                    return Some(Err(Error::Rpc {
                        rpc: "Gate",
                        status,
                    }));
                }
            };
            match response.msg {
                Some(gate_response::Msg::Hold(hold)) => return Some(self.guard(hold)),
                Some(gate_response::Msg::Subscribed(_)) => {
                    return Some(Err(Error::Protocol {
                        rpc: "Gate",
                        detail: "a second Subscribed".to_owned(),
                    }));
                }
                // A message added to the contract after this client was built.
                None => tracing::debug!("skipping an unknown gate response"),
            }
        }
    }

    fn guard(&self, hold: v1::Hold) -> Result<HoldGuard, Error> {
        if hold.held && hold.hold_id == 0 {
            return Err(Error::Protocol {
                rpc: "Gate",
                detail: "a held Hold with hold_id 0 cannot be answered".to_owned(),
            });
        }
        let answer = hold.held.then(|| self.requests.clone());
        let Some(container) = hold.container else {
            // Fail open, as for a dropped guard: the consumer cannot decide
            // on a container it was not told about.
            if let Some(answer) = answer {
                send(
                    &answer,
                    decision(hold.hold_id, true, "hold without a container"),
                )?;
            }
            return Err(Error::Protocol {
                rpc: "Gate",
                detail: format!("Hold {} without a container", hold.hold_id),
            });
        };
        Ok(HoldGuard {
            hold_id: hold.hold_id,
            held: hold.held,
            container,
            monotonic_ns: hold.monotonic_ns,
            answer,
        })
    }
}

/// One container start reported by a [`Gate`].
///
/// If [`HoldGuard::held`], the container's start waits until this guard is
/// answered with [`HoldGuard::allow`] or [`HoldGuard::deny`] (or the
/// subscription's deadline passes). A held guard dropped unanswered sends
/// **allow** with the reason [`DROPPED_UNANSWERED`] and logs a warning:
/// *fail-open on drop*, so that an early return or a panic in the consumer
/// never blocks a start for the whole deadline. (When the subscriber goes
/// away entirely, the agent applies the subscription's failure policy
/// instead.)
///
/// A guard that is not held (the container could not be held: the Pod
/// informer or a scan saw it, or `runc run` created and started it in one
/// step) needs no answer; `allow` and `deny` do nothing on it.
#[derive(Debug)]
pub struct HoldGuard {
    hold_id: u64,
    held: bool,
    container: v1::Container,
    monotonic_ns: u64,
    /// Some while a decision is owed.
    answer: Option<mpsc::UnboundedSender<v1::GateRequest>>,
}

impl HoldGuard {
    /// The container whose start is held (or was reported).
    pub fn container(&self) -> &v1::Container {
        &self.container
    }

    /// Whether the start waits for this guard's decision.
    pub fn held(&self) -> bool {
        self.held
    }

    /// The agent's id for the hold (0 when not held).
    pub fn hold_id(&self) -> u64 {
        self.hold_id
    }

    /// `CLOCK_MONOTONIC` nanoseconds when the hold began.
    pub fn monotonic_ns(&self) -> u64 {
        self.monotonic_ns
    }

    /// Lets the container start. Does nothing if it was not held.
    ///
    /// Fails with [`Error::GateClosed`] if the gate's stream is gone; the
    /// agent then applies the failure policy.
    pub fn allow(self) -> Result<(), Error> {
        self.decide(true, String::new())
    }

    /// Lets the container start, with a reason for the agent's log.
    pub fn allow_because(self, reason: impl Into<String>) -> Result<(), Error> {
        self.decide(true, reason.into())
    }

    /// Denies the start: the runtime's start fails and the container is
    /// removed (a `Removed` event carries `reason`). Does nothing if it was
    /// not held: stopping a container that already runs is up to you.
    pub fn deny(self, reason: impl Into<String>) -> Result<(), Error> {
        self.decide(false, reason.into())
    }

    fn decide(mut self, allow: bool, reason: String) -> Result<(), Error> {
        match self.answer.take() {
            Some(answer) => send(&answer, decision(self.hold_id, allow, &reason)),
            None => {
                tracing::debug!(
                    id = %self.container.id,
                    allow,
                    "not held: no decision to send"
                );
                Ok(())
            }
        }
    }
}

impl Drop for HoldGuard {
    fn drop(&mut self) {
        if let Some(answer) = self.answer.take() {
            tracing::warn!(
                hold_id = self.hold_id,
                id = %self.container.id,
                "a held container's guard was dropped unanswered; allowing its start"
            );
            // N.B. if the gate is closed the agent already applies the
            // failure policy; nothing more to do.
            let _ = send(&answer, decision(self.hold_id, true, DROPPED_UNANSWERED));
        }
    }
}

fn decision(hold_id: u64, allow: bool, reason: &str) -> v1::GateRequest {
    v1::GateRequest {
        msg: Some(gate_request::Msg::Decision(v1::Decision {
            hold_id,
            allow,
            reason: reason.to_owned(),
        })),
    }
}

fn send(
    requests: &mpsc::UnboundedSender<v1::GateRequest>,
    request: v1::GateRequest,
) -> Result<(), Error> {
    requests.send(request).map_err(|_| Error::GateClosed)
}
