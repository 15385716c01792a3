//! `Gate`: a stream of holds on container starts, answered through guards.

use std::fmt;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use futures::stream::FusedStream;
use lookout_api::v1::{self, gate_request, gate_response, lookout_client::LookoutClient};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::codec::Streaming;
use tonic::transport::Channel;

use crate::Error;
use crate::connect::{self, ConnectOptions};
use crate::step::{Driver, Machine, Step};

/// The reason sent for a held guard dropped without an answer.
pub const DROPPED_UNANSWERED: &str = "dropped unanswered";

/// A subscription to the agent's gate: a [`Stream`] of [`HoldGuard`]s, one
/// per container start that matches the subscription's filter. Made by
/// [`crate::Client::gate`] from [`crate::GateOptions`].
///
/// Read it with [`Gate::next`], or with any `Stream` combinator
/// ([`futures::StreamExt`], `tokio_stream::StreamExt`).
///
/// Keep the `Gate` alive while answering: when it goes, the agent sees the
/// subscriber leave and applies the subscription's
/// [failure policy](crate::OnFailure) to every hold still open.
///
/// # Recovery
///
/// When the agent ends the gate (it shuts down, or is replaced by a
/// rollout) or the stream drops, the gate redials the socket and
/// subscribes again with the same [`crate::GateOptions`], for
/// [`ConnectOptions::retry_for`]. A new agent that took over from the old
/// one keeps the old one's subscriptions for a while and holds the starts
/// they would hold until their subscribers are back: the holds queued
/// meanwhile arrive right after the new subscription, and none escapes a
/// fail-closed gate. Guards from the old stream can no longer be answered
/// (their agent is gone; the new one asks again).
///
/// If the stream *dropped* and subscribing again fails for the whole
/// window, the gate yields that error ([`Error::is_retryable`] is true),
/// and polling it again starts retrying anew.
///
/// # End of the stream
///
/// The gate ends ([`Gate::next`] returns `None`, for good):
///
/// - when the agent ended the gate itself and no agent took the
///   subscription again within the retry window (the agent was stopped or
///   removed, not replaced);
/// - right after it yielded an error that is not retryable: the agent
///   refused the subscription (`PERMISSION_DENIED`: this peer is neither
///   root nor allow-listed) or failed the stream with a code that would
///   repeat.
///
/// A malformed hold ([`Error::Protocol`]) is yielded as an error and the
/// gate goes on with the next one.
pub struct Gate {
    /// The confirmed name and deadline, kept here because the state is
    /// inside the step's future while a step runs.
    name: String,
    deadline: Duration,
    driver: Driver<Subscription>,
}

impl fmt::Debug for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate")
            .field("name", &self.name)
            .field("deadline", &self.deadline)
            .field("state", &self.driver)
            .finish()
    }
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
        let opened = connect::retry(&options, || open(client.clone(), subscribe.clone())).await?;
        Ok(Self {
            name: opened.name.clone(),
            deadline: opened.deadline,
            driver: Driver::new(Subscription {
                name: opened.name,
                deadline: opened.deadline,
                live: Some(opened.live),
                path,
                options,
                subscribe,
            }),
        })
    }

    /// The subscription's name, as the agent confirmed it (it keeps
    /// `[A-Za-z0-9-_.:/]`, at most 64 of them).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How long the agent waits for each decision before applying the
    /// failure policy, as it confirmed it (its default for none asked,
    /// lowered to its `--gate-max-deadline`).
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The next hold, subscribing again when the stream ends or drops (see
    /// [Recovery](Gate#recovery)). The same as
    /// [`StreamExt::next`](futures::StreamExt::next), without the import.
    ///
    /// `None` when the gate ended for good (see
    /// [End of the stream](Gate#end-of-the-stream)).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the work in progress (waiting for a hold, subscribing
    /// again) stays in the gate, and the next call goes on with it. No hold
    /// is lost, so it can be used in `tokio::select!` or under a timeout.
    pub async fn next(&mut self) -> Option<Result<HoldGuard, Error>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }
}

impl Stream for Gate {
    type Item = Result<HoldGuard, Error>;

    /// See [`Gate::next`]: the same stream, the same cancel safety.
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let (name, deadline) = (&mut this.name, &mut this.deadline);
        this.driver.poll_next(cx, |subscription| {
            if *name != subscription.name {
                name.clone_from(&subscription.name);
            }
            *deadline = subscription.deadline;
        })
    }
}

impl FusedStream for Gate {
    fn is_terminated(&self) -> bool {
        self.driver.is_done()
    }
}

/// The gate's state between holds, moved into each step: the live
/// exchange with the agent and what subscribing again needs.
#[derive(Debug)]
struct Subscription {
    /// As the agent confirmed it.
    name: String,
    deadline: Duration,
    /// The exchange with the agent; `None` once it ended, until subscribed
    /// again.
    live: Option<Live>,
    path: PathBuf,
    options: ConnectOptions,
    subscribe: v1::Subscribe,
}

impl Machine for Subscription {
    type Item = Result<HoldGuard, Error>;

    async fn step(mut self) -> (Self, Step<Self::Item>) {
        let step = self.next_step().await;
        (self, step)
    }
}

impl Subscription {
    /// Reads (and subscribes again) until a hold can be passed on, or an
    /// error must be.
    async fn next_step(&mut self) -> Step<Result<HoldGuard, Error>> {
        loop {
            let Some(live) = self.live.as_mut() else {
                // The stream dropped: subscribe again, and say so if the
                // agent does not come back in time.
                match self.resubscribe().await {
                    Ok(()) => continue,
                    Err(e) if e.is_retryable() => return Step::Yield(Err(e)),
                    Err(e) => return Step::Last(Err(e)),
                }
            };
            let response = match live.responses.message().await {
                Ok(Some(response)) => response,
                Ok(None) => {
                    tracing::info!(
                        gate = self.name,
                        "the agent ended the gate; subscribing again"
                    );
                    self.end_exchange();
                    match self.resubscribe().await {
                        Ok(()) => continue,
                        Err(e) if e.is_retryable() => {
                            tracing::warn!(
                                gate = self.name,
                                error = %crate::error::chain(&e),
                                "no agent took the gate again"
                            );
                            return Step::End;
                        }
                        Err(e) => return Step::Last(Err(e)),
                    }
                }
                Err(status) if crate::error::code_is_retryable(status.code()) => {
                    tracing::warn!(
                        gate = self.name,
                        code = ?status.code(),
                        message = status.message(),
                        "the gate's stream dropped; subscribing again"
                    );
                    self.end_exchange();
                    continue;
                }
                Err(status) => {
                    self.end_exchange();
                    return Step::Last(Err(Error::Rpc {
                        rpc: "Gate",
                        status,
                    }));
                }
            };
            match response.msg {
                Some(gate_response::Msg::Hold(hold)) => return Step::Yield(live.guard(hold)),
                Some(gate_response::Msg::Subscribed(_)) => {
                    return Step::Yield(Err(Error::Protocol {
                        rpc: "Gate",
                        detail: "a second Subscribed".to_owned(),
                    }));
                }
                // A message added to the contract after this client was built.
                None => tracing::debug!("skipping an unknown gate response"),
            }
        }
    }

    /// Redials and subscribes again (see [Recovery](Gate#recovery)).
    async fn resubscribe(&mut self) -> Result<(), Error> {
        let (path, subscribe) = (&self.path, &self.subscribe);
        let opened = connect::retry(&self.options, || async move {
            let channel = connect::dial(path).await?;
            open(LookoutClient::new(channel), subscribe.clone()).await
        })
        .await?;
        tracing::info!(gate = opened.name, "subscribed again to the agent's gate");
        self.name = opened.name;
        self.deadline = opened.deadline;
        self.live = Some(opened.live);
        Ok(())
    }

    /// Drops the exchange that ended: this side's half too, so that an
    /// agent draining for shutdown does not wait for it (guards still held
    /// keep it open until they go).
    fn end_exchange(&mut self) {
        self.live = None;
    }
}

impl Live {
    /// The guard for `hold`, answered through this exchange.
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

/// A subscribed `Gate` stream, as the agent confirmed it.
struct Opened {
    name: String,
    deadline: Duration,
    live: Live,
}

/// Both halves of one `Gate` call.
#[derive(Debug)]
struct Live {
    /// Holds from the agent.
    responses: Streaming<v1::GateResponse>,
    /// Where decisions go: each held guard has a clone.
    requests: mpsc::UnboundedSender<v1::GateRequest>,
}

/// Sends `subscribe` and waits for the agent's `Subscribed`.
async fn open(
    mut client: LookoutClient<Channel>,
    subscribe: v1::Subscribe,
) -> Result<Opened, Error> {
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
    Ok(Opened {
        name: subscribed.name,
        deadline: Duration::from_millis(u64::from(subscribed.deadline_ms)),
        live: Live {
            responses,
            requests,
        },
    })
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
