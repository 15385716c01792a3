//! An NRI (Node Resource Interface) plugin that reports pods and containers
//! from containerd or CRI-O, and can hold a container briefly before its
//! program runs.
//!
//! # Overview
//!
//! NRI runtimes (containerd 1.7 with NRI enabled, containerd 2.x and
//! CRI-O 1.26+ by default) listen on a Unix socket, by default
//! [`/var/run/nri/nri.sock`](DEFAULT_SOCKET). A [`Plugin`] connects to it,
//! registers as `<index>-<name>` (`10-lookout` by default), subscribes to
//! every pod and container lifecycle event, and hands them out through
//! [`Events`] as typed [`Event`]s, in the runtime's order:
//!
//! - [`Event::Synchronized`] once registered: every pod and container the
//!   runtime has, as a [`Snapshot`], with what is new and gone since the
//!   last one (after a reconnect).
//! - [`Event::Pod`] for RunPodSandbox, StopPodSandbox and RemovePodSandbox.
//! - [`Event::Container`] for CreateContainer, PostCreateContainer,
//!   StartContainer, PostStartContainer, StopContainer and RemoveContainer
//!   (and the Update pair with [`PluginBuilder::updates`]), each with its
//!   [`Pod`].
//! - [`Event::Shutdown`] and [`Event::Disconnected`] for the connection.
//!
//! Each event comes as a [`Delivery`] with an [`Ack`]. For CreateContainer
//! and StartContainer the runtime waits for the plugin's answer before the
//! container goes on, and the plugin answers when the consumer releases
//! (or drops) the `Ack`, or at its [deadline](Ack::deadline), whichever
//! comes first: the consumer can act before the container's program runs,
//! within a [budget](PluginBuilder::budget) kept under the runtime's
//! request timeout (2 s). Past it the plugin answers anyway (fail open) and
//! counts it ([`Stats::late`]). The plugin never answers with an error or
//! an adjustment, so it is never the reason a container fails or the
//! runtime drops the plugin.
//!
//! When the runtime goes away (a restart of containerd), the plugin
//! reconnects with exponential backoff and synchronizes again. It
//! remembers the pods and containers it reported, so the new
//! [`Snapshot`] says which are new and which are gone: nothing is reported
//! twice and nothing that happened meanwhile is missed.
//!
//! The plugin never waits for the consumer: events go to a bounded queue
//! ([`PluginBuilder::queue`]). An event that finds the queue full is
//! dropped ([`Stats::dropped`]) and taken back from what the plugin
//! remembers reporting; the plugin then leaves the runtime
//! ([`Error::Overflow`]), waits until half the queue is free and registers
//! again, and that Synchronize reports what the consumer missed. A
//! container whose event was lost mid-lifecycle (its StartContainer, say)
//! is reported as new once more.
//!
//! [`probe`] checks, once, that a runtime accepts a plugin.
//!
//! ```no_run
//! # async fn f() -> Result<(), lookout_nri::Error> {
//! use lookout_nri::{Event, Plugin};
//! let (plugin, mut events) = Plugin::builder()
//!     .socket("/var/run/nri/nri.sock")
//!     .build()?;
//! tokio::spawn(plugin.run());
//! while let Some(delivery) = events.recv().await {
//!     if let Event::Container { phase, pod, container } = &delivery.event {
//!         let pod = pod.as_ref().map(|p| format!("{}/{}", p.namespace, p.name));
//!         println!("{phase:?} {} in {pod:?}", container.name);
//!     }
//!     // The runtime goes on once the ack is released or dropped.
//!     delivery.ack.release();
//! }
//! # Ok(()) }
//! ```
//!
//! # Protocol
//!
//! The messages are containerd/nri v0.6.1's `pkg/api/api.proto` (vendored
//! in `proto/`), the release containerd 1.7.24 is built with. In that
//! release only Configure, Synchronize, Shutdown, CreateContainer,
//! UpdateContainer and StopContainer are calls of their own; every other
//! event (RunPodSandbox, StopPodSandbox, RemovePodSandbox,
//! PostCreateContainer, StartContainer, PostStartContainer,
//! PostUpdateContainer, RemoveContainer) comes through `StateChange` with
//! an event number. Both forms are handled. NRI v0.6.1 carries no exit
//! code: a stopped container's state is only [`ContainerState::Stopped`].
//!
//! The transport is ttRPC over NRI's connection multiplexer: one Unix
//! connection with 8-byte frame headers (channel, length), channel 1 for
//! the plugin's services and 2 for the runtime's. ttRPC's unary framing is
//! implemented here rather than taken from the `ttrpc` crate, whose async
//! server only serves connections it accepts on a listening socket of its
//! own (NRI's plugin serves on a channel of a connection it opened), and
//! whose messages are rust-protobuf types beside this workspace's prost.
//!
//! Frames and messages are bounded (4 MiB, ttRPC's own limit) before
//! anything is allocated for them; a malformed frame or message ends the
//! connection with an [`Error`] and the plugin reconnects.
#![deny(missing_docs)]

mod error;
#[cfg(test)]
mod fake_runtime;
mod mux;
mod plugin;
mod socket;
mod stats;
mod tracker;
mod ttrpc;
mod types;

/// The NRI v0.6.1 messages, generated by prost from `proto/nri/api.proto`.
#[allow(missing_docs, dead_code, clippy::all, clippy::pedantic)]
mod proto {
    include!(concat!(env!("OUT_DIR"), "/nri.pkg.api.v1alpha1.rs"));
}

pub use error::Error;
pub use plugin::{
    Ack, DEFAULT_SOCKET, Delivery, Events, Plugin, PluginBuilder, RUNTIME_REQUEST_TIMEOUT, probe,
};
pub use stats::Stats;
pub use types::{
    Container, ContainerPhase, ContainerState, Event, Mount, Namespace, Pod, PodPhase, Runtime,
    Snapshot,
};

/// The plugin's parsing of bytes from the runtime's socket, for
/// `cargo fuzz` (fuzz/fuzz_targets/nri_frames.rs).
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing {
    use crate::{mux, proto, ttrpc, types};

    fn each<M: prost::Message + Default>(bytes: &[u8]) -> Option<M> {
        M::decode(bytes).ok()
    }

    /// Feeds `data`, as read from the socket, through every layer the
    /// plugin parses: multiplexer frames, ttRPC messages, requests, the NRI
    /// payloads, and their mapping into [`types`]. Must never panic or
    /// allocate more than the frame limit at once.
    pub fn feed(data: &[u8]) {
        let mut rest = data;
        let mut channels: [ttrpc::Decoder; 3] = Default::default();
        while let Some((h, tail)) = rest.split_first_chunk::<{ mux::HEADER_LEN }>() {
            let Ok((conn, len)) = mux::decode_header(*h, mux::MAX_FRAME) else {
                return;
            };
            let Some(payload) = tail.get(..len as usize) else {
                return;
            };
            rest = &tail[len as usize..];
            let Some(decoder) = channels.get_mut(conn as usize) else {
                return;
            };
            decoder.push(payload);
            loop {
                match decoder.next_message() {
                    Ok(Some(m)) if m.kind == ttrpc::REQUEST => request(&m.payload),
                    Ok(Some(m)) => {
                        let _ = each::<ttrpc::Response>(&m.payload);
                    }
                    Ok(None) => break,
                    Err(_) => return,
                }
            }
        }
    }

    fn request(payload: &[u8]) {
        let Some(req) = each::<ttrpc::Request>(payload) else {
            return;
        };
        let p = &req.payload[..];
        let pair = |pod: Option<proto::PodSandbox>, c: Option<proto::Container>| {
            let _ = pod.map(types::Pod::from);
            let _ = c.map(types::Container::from);
        };
        match req.method.as_str() {
            "Configure" => {
                let _ = each::<proto::ConfigureRequest>(p);
            }
            "Synchronize" => {
                if let Some(s) = each::<proto::SynchronizeRequest>(p) {
                    s.pods.into_iter().for_each(|x| pair(Some(x), None));
                    s.containers.into_iter().for_each(|x| pair(None, Some(x)));
                }
            }
            "CreateContainer" => {
                if let Some(r) = each::<proto::CreateContainerRequest>(p) {
                    pair(r.pod, r.container);
                }
            }
            "UpdateContainer" => {
                if let Some(r) = each::<proto::UpdateContainerRequest>(p) {
                    pair(r.pod, r.container);
                }
            }
            "StopContainer" => {
                if let Some(r) = each::<proto::StopContainerRequest>(p) {
                    pair(r.pod, r.container);
                }
            }
            "StateChange" => {
                if let Some(e) = each::<proto::StateChangeEvent>(p) {
                    pair(e.pod, e.container);
                }
            }
            _ => {}
        }
    }
}

/// Displays an error with its causes, `: `-separated, for logs.
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}
