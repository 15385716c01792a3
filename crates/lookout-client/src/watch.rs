//! `Watch`: a stream of typed events, snapshots collapsed, resumed after a
//! drop.

use std::fmt;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::FusedStream;
use lookout_api::v1::{self, lookout_client::LookoutClient, watch_event::Kind};
use tonic::codec::Streaming;
use tonic::transport::Channel;

use crate::Error;
use crate::connect::{self, Backoff, ConnectOptions};
use crate::error::code_is_retryable;
use crate::step::{Driver, Machine, Step};

/// The largest message the client accepts (the agent bounds each
/// container's annotations at 256 KiB, so a `List` of many containers can
/// pass tonic's 4 MiB default).
pub(crate) const MAX_MESSAGE: usize = 256 << 20;

/// One change seen by a [`Watcher`].
///
/// A consumer that mirrors the node's containers keeps a map by
/// [`Container::id`](v1::Container::id): it *replaces* the map with a
/// `Snapshot`, inserts on `Added` and `Updated` (replacing what it had) and
/// removes on `Removed`.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// Every matching container live at `revision`, in full. Replace your
    /// state with it: containers you knew that are not in it are gone.
    ///
    /// It comes first when watching from revision 0, and again whenever the
    /// agent no longer retains the changes after the last revision seen
    /// (after a long disconnect, or an agent restart).
    Snapshot {
        /// The revision the set is current at.
        revision: u64,
        /// The containers, in the agent's order.
        containers: Vec<v1::Container>,
    },
    /// A container was reported.
    Added {
        /// The change's revision.
        revision: u64,
        /// The container.
        container: v1::Container,
        /// `CLOCK_MONOTONIC` nanoseconds when the agent observed the change.
        monotonic_ns: u64,
    },
    /// The agent learnt more of a live container after `Added` (Docker's
    /// name, image and labels, which dockerd gives only once the start is
    /// over). `container` is the whole container as now known: replace
    /// yours. A watcher whose filter did not match it before may get this
    /// first: take it as `Added`. Never after `Removed`.
    Updated {
        /// The change's revision.
        revision: u64,
        /// The container, as now known.
        container: v1::Container,
        /// `CLOCK_MONOTONIC` nanoseconds when the agent observed the change.
        monotonic_ns: u64,
    },
    /// A container is gone (exited, denied, its pod deleted).
    Removed {
        /// The change's revision.
        revision: u64,
        /// The container, as it was last reported.
        container: v1::Container,
        /// The exit code, when known.
        exit_code: Option<i32>,
        /// Why, when the agent knows (for example "denied by gate tracer: ...").
        reason: String,
        /// `CLOCK_MONOTONIC` nanoseconds when the agent observed the change.
        monotonic_ns: u64,
    },
}

impl Event {
    /// The event's revision: the change's, or the snapshot's.
    pub fn revision(&self) -> u64 {
        match self {
            Event::Snapshot { revision, .. }
            | Event::Added { revision, .. }
            | Event::Updated { revision, .. }
            | Event::Removed { revision, .. } => *revision,
        }
    }
}

/// What the watcher knows between stream messages, advanced by
/// [`Fold::step`]: the last revision passed on, and a snapshot being
/// received. Pure, so the resume rules are unit-tested without a server.
#[derive(Debug, Default)]
pub(crate) struct Fold {
    /// The last revision passed on to the consumer (`since` on reconnect).
    revision: u64,
    /// `SNAPSHOT` containers received so far, with their revision.
    snapshot: Option<(u64, Vec<v1::Container>)>,
}

impl Fold {
    /// Starts after `since` (0: nothing seen yet).
    pub(crate) fn new(since: u64) -> Self {
        Self {
            revision: since,
            snapshot: None,
        }
    }

    /// The last revision passed on.
    pub(crate) fn revision(&self) -> u64 {
        self.revision
    }

    /// Takes one message off the stream. `Ok(None)`: nothing to pass on
    /// (part of a snapshot, a change already seen, a kind this client does
    /// not know). `Err`: the message breaks the contract.
    pub(crate) fn step(&mut self, message: v1::WatchEvent) -> Result<Option<Event>, String> {
        let kind = Kind::try_from(message.kind).unwrap_or(Kind::Unspecified);
        let revision = message.revision;
        match kind {
            Kind::Snapshot => {
                let container = message.container.ok_or_else(|| {
                    format!("SNAPSHOT at revision {revision} without a container")
                })?;
                let (snapshot_revision, containers) =
                    self.snapshot.get_or_insert_with(|| (revision, Vec::new()));
                if *snapshot_revision != revision {
                    let expected = *snapshot_revision;
                    self.snapshot = None;
                    return Err(format!(
                        "SNAPSHOT at revision {revision} inside the snapshot of revision {expected}"
                    ));
                }
                containers.push(container);
                Ok(None)
            }
            Kind::SnapshotEnd => {
                // No SNAPSHOT before the end is an empty snapshot.
                let (snapshot_revision, containers) =
                    self.snapshot.take().unwrap_or((revision, Vec::new()));
                if snapshot_revision != revision {
                    return Err(format!(
                        "SNAPSHOT_END at revision {revision} ends the snapshot of revision {snapshot_revision}"
                    ));
                }
                // N.B. taken even when lower than the last revision seen: a
                // snapshot replaces everything (the agent's revisions grow
                // across restarts, but a consumer may meet another agent,
                // or a node whose clock went back).
                self.revision = revision;
                Ok(Some(Event::Snapshot {
                    revision,
                    containers,
                }))
            }
            Kind::Added | Kind::Removed | Kind::Updated => {
                if self.snapshot.is_some() {
                    self.snapshot = None;
                    return Err(format!(
                        "{} at revision {revision} before SNAPSHOT_END",
                        kind.as_str_name()
                    ));
                }
                let container = message.container.ok_or_else(|| {
                    format!(
                        "{} at revision {revision} without a container",
                        kind.as_str_name()
                    )
                })?;
                if revision <= self.revision {
                    tracing::debug!(
                        revision,
                        last = self.revision,
                        "skipping a change already seen"
                    );
                    return Ok(None);
                }
                self.revision = revision;
                Ok(Some(match kind {
                    Kind::Added => Event::Added {
                        revision,
                        container,
                        monotonic_ns: message.monotonic_ns,
                    },
                    Kind::Updated => Event::Updated {
                        revision,
                        container,
                        monotonic_ns: message.monotonic_ns,
                    },
                    _ => Event::Removed {
                        revision,
                        container,
                        exit_code: message.exit_code,
                        reason: message.reason,
                        monotonic_ns: message.monotonic_ns,
                    },
                }))
            }
            Kind::Unspecified => {
                // A kind added to the contract after this client was built.
                tracing::debug!(
                    kind = message.kind,
                    revision,
                    "skipping an unknown event kind"
                );
                Ok(None)
            }
        }
    }

    /// The stream dropped: a partial snapshot is worthless (the agent sends
    /// it again, whole, on resume).
    pub(crate) fn stream_dropped(&mut self) {
        self.snapshot = None;
    }
}

/// A `Watch` that survives the agent: a [`Stream`] of typed [`Event`]s,
/// with snapshots collapsed into one event, resumed after a dropped stream.
/// Made by [`crate::Client::watch`] and [`crate::Client::watch_since`].
///
/// Read it with [`Watcher::next`], or with any `Stream` combinator
/// ([`futures::StreamExt`], `tokio_stream::StreamExt`).
///
/// ```no_run
/// use futures::{StreamExt, TryStreamExt};
/// use lookout_client::{Client, Event, Filter};
///
/// # async fn f(client: Client) -> Result<(), lookout_client::Error> {
/// let watcher = client.watch(Filter::all()).await?;
/// // The first three containers added, failing on the first error.
/// let added: Vec<String> = watcher
///     .try_filter_map(|event| async move {
///         Ok(match event {
///             Event::Added { container, .. } => Some(container.id),
///             _ => None,
///         })
///     })
///     .take(3)
///     .try_collect()
///     .await?;
/// # Ok(()) }
/// ```
///
/// # Recovery
///
/// When the stream drops (the agent restarts, or disconnects this consumer
/// with `RESOURCE_EXHAUSTED` for not keeping up, or ends the stream), the
/// watcher redials the socket and resumes with `since` =
/// [`Watcher::revision`]. The agent then sends the changes after it, which
/// are neither lost nor passed on twice (changes at or below the last
/// revision are skipped), or, if it no longer has them, a fresh
/// [`Event::Snapshot`]. Each outage is retried for
/// [`ConnectOptions::retry_for`]; after that the watcher yields the error
/// ([`Error::is_retryable`] is true), and polling it again starts retrying
/// anew.
///
/// # End of the stream
///
/// The watcher ends ([`Watcher::next`] returns `None`, for good) only
/// right after it yielded an error that is not retryable, one that would
/// repeat: the socket refuses this process ([`Error::PermissionDenied`]),
/// the agent refuses the watch (`PERMISSION_DENIED`, `INVALID_ARGUMENT`,
/// `UNIMPLEMENTED`, ...), or its stream broke the contract
/// ([`Error::Protocol`]). Agent restarts and rollouts never end it. To try
/// again after such an error anyway, watch anew from where this one was:
/// [`Client::watch_since`](crate::Client::watch_since)`(filter,
/// watcher.revision())`.
pub struct Watcher {
    /// The last revision passed on, kept here because the state is inside
    /// the step's future while a step runs.
    revision: u64,
    driver: Driver<Watching>,
}

impl fmt::Debug for Watcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watcher")
            .field("revision", &self.revision)
            .field("state", &self.driver)
            .finish()
    }
}

impl Watcher {
    /// Opens the first stream on `client`'s connection.
    pub(crate) async fn open(
        client: LookoutClient<Channel>,
        path: PathBuf,
        options: ConnectOptions,
        filter: v1::Filter,
        since: u64,
    ) -> Result<Self, Error> {
        let stream =
            connect::retry(&options, || start(client.clone(), filter.clone(), since)).await?;
        Ok(Self {
            revision: since,
            driver: Driver::new(Watching {
                path,
                backoff: options.backoff(),
                options,
                filter,
                fold: Fold::new(since),
                stream: Some(stream),
                drops: 0,
            }),
        })
    }

    /// The last revision passed on (`since` for the next resume): the
    /// latest change's, or the latest snapshot's; the `since` watched from
    /// before the first event.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The next event, resuming the stream as needed (see
    /// [Recovery](Watcher#recovery)). The same as
    /// [`StreamExt::next`](futures::StreamExt::next), without the import.
    ///
    /// `None` only after a non-retryable error (see
    /// [End of the stream](Watcher#end-of-the-stream)); agent restarts
    /// never end it.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: the work in progress (a snapshot received in part, a
    /// reconnect, a backoff pause) stays in the watcher, and the next call
    /// goes on with it. No event is lost or repeated, so it can be used in
    /// `tokio::select!` or under a timeout.
    pub async fn next(&mut self) -> Option<Result<Event, Error>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }
}

impl Stream for Watcher {
    type Item = Result<Event, Error>;

    /// See [`Watcher::next`]: the same stream, the same cancel safety.
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let revision = &mut this.revision;
        this.driver
            .poll_next(cx, |watching| *revision = watching.fold.revision())
    }
}

impl FusedStream for Watcher {
    fn is_terminated(&self) -> bool {
        self.driver.is_done()
    }
}

/// The watcher's state between events, moved into each step: the resume
/// rules ([`Fold`]), the live stream, and what reconnecting needs.
#[derive(Debug)]
struct Watching {
    path: PathBuf,
    options: ConnectOptions,
    filter: v1::Filter,
    fold: Fold,
    /// `None` after a drop, until the reconnect.
    stream: Option<Streaming<v1::WatchEvent>>,
    /// Pauses between reconnects while no event gets through.
    backoff: Backoff,
    /// Streams dropped since the last event passed on.
    drops: u32,
}

impl Machine for Watching {
    type Item = Result<Event, Error>;

    async fn step(mut self) -> (Self, Step<Self::Item>) {
        let step = self.next_step().await;
        (self, step)
    }
}

impl Watching {
    /// Reads (and reconnects) until an event can be passed on, or an
    /// error must be.
    async fn next_step(&mut self) -> Step<Result<Event, Error>> {
        loop {
            let stream = match self.stream.as_mut() {
                Some(stream) => stream,
                None => match self.reopen().await {
                    Ok(stream) => self.stream.insert(stream),
                    Err(error) if error.is_retryable() => return Step::Yield(Err(error)),
                    Err(error) => return Step::Last(Err(error)),
                },
            };
            match stream.message().await {
                Ok(Some(message)) => match self.fold.step(message) {
                    Ok(Some(event)) => {
                        self.drops = 0;
                        self.backoff.reset();
                        return Step::Yield(Ok(event));
                    }
                    Ok(None) => {}
                    Err(detail) => {
                        self.drop_stream();
                        return Step::Last(Err(Error::Protocol {
                            rpc: "Watch",
                            detail,
                        }));
                    }
                },
                Ok(None) => {
                    tracing::info!(
                        revision = self.fold.revision(),
                        "the agent ended the watch, resuming"
                    );
                    self.drop_stream();
                }
                Err(status) => {
                    self.drop_stream();
                    if !code_is_retryable(status.code()) {
                        return Step::Last(Err(Error::Rpc {
                            rpc: "Watch",
                            status,
                        }));
                    }
                    tracing::warn!(
                        code = ?status.code(),
                        message = status.message(),
                        revision = self.fold.revision(),
                        "the watch stream dropped, resuming"
                    );
                }
            }
        }
    }

    fn drop_stream(&mut self) {
        self.stream = None;
        self.fold.stream_dropped();
        self.drops = self.drops.saturating_add(1);
    }

    /// Redials and resumes from the last revision. The first reconnect after
    /// an event is immediate; repeated drops without an event back off.
    async fn reopen(&mut self) -> Result<Streaming<v1::WatchEvent>, Error> {
        if self.drops > 1 {
            tokio::time::sleep(self.backoff.next_pause()).await;
        }
        let since = self.fold.revision();
        let (path, filter) = (&self.path, &self.filter);
        connect::retry(&self.options, || async move {
            // A new connection: the old one may be to an agent that is gone,
            // and dialling anew reports a missing socket as such.
            let channel = connect::dial(path).await?;
            start(LookoutClient::new(channel), filter.clone(), since).await
        })
        .await
    }
}

/// One `Watch` call.
async fn start(
    client: LookoutClient<Channel>,
    filter: v1::Filter,
    since: u64,
) -> Result<Streaming<v1::WatchEvent>, Error> {
    let request = v1::WatchRequest {
        since,
        filter: Some(filter),
    };
    client
        .max_decoding_message_size(MAX_MESSAGE)
        .watch(request)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| Error::Rpc {
            rpc: "Watch",
            status,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(id: &str) -> v1::Container {
        v1::Container {
            id: id.to_owned(),
            ..Default::default()
        }
    }

    fn message(kind: Kind, revision: u64, id: Option<&str>) -> v1::WatchEvent {
        v1::WatchEvent {
            kind: kind as i32,
            revision,
            container: id.map(container),
            ..Default::default()
        }
    }

    #[test]
    fn a_snapshot_is_collapsed_into_one_event() {
        let mut fold = Fold::new(0);
        assert_eq!(fold.step(message(Kind::Snapshot, 7, Some("a"))), Ok(None));
        assert_eq!(fold.step(message(Kind::Snapshot, 7, Some("b"))), Ok(None));
        let event = fold.step(message(Kind::SnapshotEnd, 7, None));
        assert_eq!(
            event,
            Ok(Some(Event::Snapshot {
                revision: 7,
                containers: vec![container("a"), container("b")],
            }))
        );
        assert_eq!(fold.revision(), 7);
    }

    #[test]
    fn an_empty_snapshot_is_just_its_end() {
        let mut fold = Fold::new(3);
        let event = fold.step(message(Kind::SnapshotEnd, 9, None));
        assert_eq!(
            event,
            Ok(Some(Event::Snapshot {
                revision: 9,
                containers: vec![],
            }))
        );
    }

    #[test]
    fn changes_already_seen_are_skipped() {
        let mut fold = Fold::new(5);
        assert_eq!(fold.step(message(Kind::Added, 4, Some("old"))), Ok(None));
        assert_eq!(fold.step(message(Kind::Removed, 5, Some("old"))), Ok(None));
        let event = fold
            .step(message(Kind::Added, 6, Some("new")))
            .expect("valid");
        assert_eq!(event.map(|e| e.revision()), Some(6));
        assert_eq!(fold.step(message(Kind::Added, 6, Some("new"))), Ok(None));
        assert_eq!(fold.revision(), 6);
    }

    #[test]
    fn a_snapshot_replaces_even_a_higher_revision() {
        // An agent that restarted counts from 1 again.
        let mut fold = Fold::new(100);
        fold.step(message(Kind::Snapshot, 2, Some("a")))
            .expect("valid");
        let event = fold
            .step(message(Kind::SnapshotEnd, 2, None))
            .expect("valid");
        assert_eq!(event.map(|e| e.revision()), Some(2));
        assert_eq!(fold.revision(), 2);
        let event = fold
            .step(message(Kind::Added, 3, Some("b")))
            .expect("valid");
        assert_eq!(event.map(|e| e.revision()), Some(3));
    }

    #[test]
    fn a_dropped_stream_discards_a_partial_snapshot() {
        let mut fold = Fold::new(0);
        fold.step(message(Kind::Snapshot, 4, Some("a")))
            .expect("valid");
        fold.stream_dropped();
        fold.step(message(Kind::Snapshot, 5, Some("b")))
            .expect("valid");
        let event = fold.step(message(Kind::SnapshotEnd, 5, None));
        assert_eq!(
            event,
            Ok(Some(Event::Snapshot {
                revision: 5,
                containers: vec![container("b")],
            }))
        );
        assert_eq!(fold.revision(), 5);
    }

    #[test]
    fn removed_carries_exit_code_and_reason() {
        let mut fold = Fold::new(0);
        let mut removed = message(Kind::Removed, 1, Some("a"));
        removed.exit_code = Some(137);
        removed.reason = "denied by gate tracer: no".to_owned();
        removed.monotonic_ns = 42;
        let event = fold.step(removed);
        assert_eq!(
            event,
            Ok(Some(Event::Removed {
                revision: 1,
                container: container("a"),
                exit_code: Some(137),
                reason: "denied by gate tracer: no".to_owned(),
                monotonic_ns: 42,
            }))
        );
    }

    #[test]
    fn contract_violations_are_errors() {
        let mut fold = Fold::new(0);
        assert!(fold.step(message(Kind::Added, 1, None)).is_err());
        assert!(fold.step(message(Kind::Snapshot, 1, None)).is_err());

        let mut fold = Fold::new(0);
        fold.step(message(Kind::Snapshot, 2, Some("a")))
            .expect("valid");
        assert!(fold.step(message(Kind::Added, 3, Some("b"))).is_err());

        let mut fold = Fold::new(0);
        fold.step(message(Kind::Snapshot, 2, Some("a")))
            .expect("valid");
        assert!(fold.step(message(Kind::SnapshotEnd, 3, None)).is_err());
        assert_eq!(fold.revision(), 0);
    }

    #[test]
    fn unknown_kinds_are_skipped() {
        let mut fold = Fold::new(1);
        let mut future = message(Kind::Added, 2, Some("a"));
        future.kind = 99;
        assert_eq!(fold.step(future), Ok(None));
        assert_eq!(fold.revision(), 1);
    }
}
