//! `Watch` encoded once per change, not once per watcher.
//!
//! The generated server encodes each `WatchEvent` for each stream, so that
//! with 100 watchers a change's container would be converted to its
//! protobuf form (every string and map cloned) and encoded 100 times.
//! [`FramedLookout`] serves `Watch` itself, with [`FrameCodec`]: a change
//! goes out as the bytes [`Frames`] encoded for the first watcher that sent
//! it, and every other method goes to the generated server. The bytes are
//! what prost writes for the same message, so no client can tell.
//!
//! The service behind it is any [`Lookout`] that also streams `Watch` as
//! frames ([`WatchFrames`]): the consumer API's, in `grpc`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use lookout_api::v1 as pb;
use lookout_api::v1::lookout_server::{Lookout, LookoutServer};
use prost::Message;
use prost::bytes::BufMut;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{
    Body, BoxFuture, Bytes, Context, Poll, Service as TowerService, StdError, http,
};
use tonic::server::NamedService;

use crate::hub::Change;
use crate::wire;

/// A stream of replies, as tonic's server takes it.
pub(crate) type Out<T> = Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>>;

/// A service whose `Watch` streams [`WatchFrame`]s: changes encoded once
/// for every watcher, anything else as a message.
pub(crate) trait WatchFrames: Send + Sync + 'static {
    /// `Watch`, as frames.
    fn watch_frames(
        &self,
        req: tonic::Request<pb::WatchRequest>,
    ) -> impl Future<Output = Result<tonic::Response<Out<WatchFrame>>, Status>> + Send;
}

/// One message of a `Watch` stream.
pub(crate) enum WatchFrame {
    /// A change, encoded once for every watcher ([`Frames`]).
    Encoded(Bytes),
    /// Anything else (a snapshot's containers, its end): one watcher's.
    Message(Box<pb::WatchEvent>),
}

/// The changes most recently encoded, by revision. Every watcher sends
/// the same changes within moments of each other, so a few are enough;
/// a watcher that falls further behind encodes its own again.
#[derive(Default)]
pub(crate) struct Frames {
    recent: Mutex<VecDeque<(u64, Bytes)>>,
}

/// Encoded changes kept at most.
const KEPT: usize = 16;

impl Frames {
    /// The encoding of the change at `revision`: the one kept, or
    /// `encode()`'s (then kept).
    pub(crate) fn get_or_encode(
        &self,
        revision: u64,
        encode: impl FnOnce() -> pb::WatchEvent,
    ) -> Bytes {
        if let Some(b) = self.find(revision) {
            return b;
        }
        // Encoded outside the lock: another watcher may do the same
        // meanwhile, which costs one encoding, not a wait.
        let bytes = Bytes::from(encode().encode_to_vec());
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if !recent.iter().any(|(r, _)| *r == revision) {
            if recent.len() >= KEPT {
                recent.pop_front();
            }
            recent.push_back((revision, bytes.clone()));
        }
        bytes
    }

    /// The encoding of `change`, as [`Frames::get_or_encode`] keeps it.
    pub(crate) fn change(&self, change: &Change) -> Bytes {
        self.get_or_encode(change.revision, || wire::change_pb(change))
    }

    fn find(&self, revision: u64) -> Option<Bytes> {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        recent
            .iter()
            .rev()
            .find(|(r, _)| *r == revision)
            .map(|(_, b)| b.clone())
    }
}

/// Encodes [`WatchFrame`]s (as they are, or with prost) and decodes
/// `WatchRequest`s with prost.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FrameCodec;

impl Codec for FrameCodec {
    type Encode = WatchFrame;
    type Decode = pb::WatchRequest;
    type Encoder = FrameCodec;
    type Decoder = FrameCodec;

    fn encoder(&mut self) -> Self::Encoder {
        FrameCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        FrameCodec
    }
}

impl Encoder for FrameCodec {
    type Item = WatchFrame;
    type Error = Status;

    fn encode(&mut self, item: WatchFrame, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        match item {
            WatchFrame::Encoded(bytes) => {
                dst.put_slice(&bytes);
                Ok(())
            }
            WatchFrame::Message(m) => m
                .encode(dst)
                .map_err(|e| Status::internal(format!("encoding a watch event: {e}"))),
        }
    }
}

impl Decoder for FrameCodec {
    type Item = pb::WatchRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<pb::WatchRequest>, Status> {
        pb::WatchRequest::decode(src)
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("a malformed WatchRequest: {e}")))
    }
}

/// `lookout.v1.Lookout` with `Watch` served here, as frames, and every
/// other method by the generated server over the same service.
pub(crate) struct FramedLookout<S> {
    generated: LookoutServer<S>,
    service: Arc<S>,
    /// Requests larger than this are refused, as by the generated server.
    max_request_bytes: usize,
}

impl<S: Lookout + WatchFrames> FramedLookout<S> {
    pub(crate) fn new(service: S, max_request_bytes: usize) -> FramedLookout<S> {
        let service = Arc::new(service);
        FramedLookout {
            generated: LookoutServer::from_arc(Arc::clone(&service))
                .max_decoding_message_size(max_request_bytes),
            service,
            max_request_bytes,
        }
    }
}

// By hand: a derived `Clone` would ask for `S: Clone`.
impl<S> Clone for FramedLookout<S> {
    fn clone(&self) -> Self {
        FramedLookout {
            generated: self.generated.clone(),
            service: Arc::clone(&self.service),
            max_request_bytes: self.max_request_bytes,
        }
    }
}

impl<S: Lookout> NamedService for FramedLookout<S> {
    const NAME: &'static str = <LookoutServer<S> as NamedService>::NAME;
}

/// `Watch`, for tonic's server-streaming call.
struct WatchCall<S>(Arc<S>);

impl<S: WatchFrames> tonic::server::ServerStreamingService<pb::WatchRequest> for WatchCall<S> {
    type Response = WatchFrame;
    type ResponseStream = Out<WatchFrame>;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<pb::WatchRequest>) -> Self::Future {
        let service = Arc::clone(&self.0);
        Box::pin(async move { service.watch_frames(request).await })
    }
}

/// The path of `Watch` in the service.
const WATCH: &str = "/lookout.v1.Lookout/Watch";

impl<S, B> TowerService<http::Request<B>> for FramedLookout<S>
where
    S: Lookout + WatchFrames,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        TowerService::<http::Request<B>>::poll_ready(&mut self.generated, cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != WATCH {
            return self.generated.call(req);
        }
        let (service, max) = (Arc::clone(&self.service), self.max_request_bytes);
        Box::pin(async move {
            let mut grpc =
                tonic::server::Grpc::new(FrameCodec).apply_max_message_size_config(Some(max), None);
            Ok(grpc.server_streaming(WatchCall(service), req).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(revision: u64, id: &str) -> pb::WatchEvent {
        pb::WatchEvent {
            revision,
            container: Some(pb::Container {
                id: id.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_change_is_encoded_once_and_as_prost_would() {
        let frames = Frames::default();
        let mut encoded = 0;
        let mut get = |revision, id: &str| {
            frames.get_or_encode(revision, || {
                encoded += 1;
                event(revision, id)
            })
        };
        let first = get(7, "a");
        assert_eq!(first, Bytes::from(event(7, "a").encode_to_vec()));
        assert_eq!(get(7, "a"), first);
        assert_eq!(encoded, 1, "the second watcher sends the first's bytes");
        let decoded = pb::WatchEvent::decode(first).expect("prost decodes it");
        assert_eq!(decoded, event(7, "a"));
    }

    #[test]
    fn only_the_latest_changes_are_kept() {
        let frames = Frames::default();
        for r in 0..(KEPT as u64 + 4) {
            frames.get_or_encode(r, || event(r, "c"));
        }
        assert!(frames.find(0).is_none(), "the oldest went");
        assert!(frames.find(KEPT as u64 + 3).is_some());
        assert_eq!(frames.recent.lock().expect("lock").len(), KEPT);
    }
}
