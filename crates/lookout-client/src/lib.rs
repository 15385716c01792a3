//! Async client for lookout's node-local API (`lookout.v1`, gRPC on a Unix
//! socket, by default [`DEFAULT_SOCKET`]).
//!
//! # Overview
//!
//! - [`Client`] is a connection: [`Client::connect`] dials the socket,
//!   retrying while the agent starts ([`ConnectOptions`]), and says clearly
//!   when the socket is missing or not accessible.
//! - [`Client::list`] returns the containers now and their revision.
//! - [`Client::watch`] returns a [`Watcher`], a [`Stream`](futures::Stream)
//!   of typed [`Event`]s, with a `SNAPSHOT ... SNAPSHOT_END` sequence
//!   collapsed into one [`Event::Snapshot`] holding the full set. When the
//!   stream drops (agent restart, slow-consumer disconnect) it redials and
//!   resumes from the last revision, with no event lost or repeated.
//! - [`Client::gate`] subscribes with [`GateOptions`] (name, [`Filter`],
//!   deadline, [`OnFailure`] policy) and returns a [`Gate`], a `Stream` of
//!   one [`HoldGuard`] per container start, answered with
//!   [`HoldGuard::allow`] or [`HoldGuard::deny`]. A held guard dropped
//!   unanswered allows the start (fail-open on drop).
//! - [`Filter`] builds the filter the agent applies: runtimes, Kubernetes
//!   namespaces, pod labels, annotations, workloads, cgroup ids, image
//!   digests.
//! - [`proto`] is the generated `lookout.v1` code ([`proto::Container`], ...).
//! - [`ContainerExt`] reads a `proto::Container`'s fields typed, with
//!   "not known" as `None`: [`cgroup_id`](ContainerExt::cgroup_id) (the
//!   key a BPF program sees), [`kind`](ContainerExt::kind) ([`ContainerKind`]),
//!   [`workload_key`](ContainerExt::workload_key),
//!   [`image_digest`](ContainerExt::image_digest), the eight
//!   [`namespace_inodes`](ContainerExt::namespace_inodes), host ids through
//!   [`host_uid`](ContainerExt::host_uid) / [`host_gid`](ContainerExt::host_gid),
//!   and why a field is missing ([`unresolved`](ContainerExt::unresolved)).
//!
//! `Watcher` and `Gate` are read alike: an inherent `next()` (no import
//! needed), or any [`futures::StreamExt`] / `tokio_stream::StreamExt`
//! combinator. Both yield `Result`s and end (`None`) only when going on
//! cannot help; both are cancel-safe (see their `# End of the stream` and
//! `next` docs).
//!
//! All failures are one [`Error`]; [`Error::is_retryable`] says whether
//! trying again can help.
//!
//! # Example
//!
//! ```no_run
//! use lookout_client::{Client, ContainerExt, Event, Filter};
//!
//! # async fn f() -> Result<(), lookout_client::Error> {
//! let client = Client::connect(lookout_client::DEFAULT_SOCKET).await?;
//! let mut watcher = client.watch(Filter::all().namespace("payments")).await?;
//! while let Some(event) = watcher.next().await {
//!     match event? {
//!         Event::Snapshot { containers, .. } => println!("{} running", containers.len()),
//!         Event::Added { container, .. } => println!(
//!             "+ {} pid {} cgroup {:?} workload {:?}",
//!             container.id,
//!             container.pid,
//!             container.cgroup_id(),
//!             container.workload_key(),
//!         ),
//!         Event::Removed { container, .. } => println!("- {}", container.id),
//!         _ => {}
//!     }
//! }
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod client;
mod connect;
mod container;
mod error;
mod filter;
mod gate;
mod gate_options;
mod step;
mod watch;

pub use client::Client;
pub use connect::{ConnectOptions, DEFAULT_SOCKET};
pub use container::{ContainerExt, ContainerKind, NamespaceInodes};
pub use error::Error;
pub use filter::Filter;
pub use gate::{DROPPED_UNANSWERED, Gate, HoldGuard};
pub use gate_options::{GateOptions, OnFailure};
pub use watch::{Event, Watcher};

/// The generated `lookout.v1` messages and gRPC stubs (from
/// `lookout-api`), so that users need not depend on it themselves.
pub use lookout_api::v1 as proto;

// Compiles the README's examples as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
