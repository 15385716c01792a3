//! ttRPC's wire format (containerd/ttrpc `channel.go`, `request.proto`),
//! the unary subset NRI uses.
//!
//! A message is a 10-byte header, a big-endian `u32` payload length, a
//! big-endian `u32` stream id, a `u8` type (1 request, 2 response, 3 data)
//! and a `u8` of flags, then the payload: a protobuf [`Request`] or
//! [`Response`]. A client numbers its streams with odd ids from 1; the
//! response carries the request's id. ttRPC's limit for a message is 4 MiB.
//!
//! Why not the `ttrpc` crate: its async server only serves connections it
//! accepts from a listening socket it owns (`Server::bind`,
//! `add_listener`), while NRI's plugin side serves on a channel of a
//! connection the plugin itself opened. Bridging would take a listening
//! socket per connection (an abstract one can be reached by any process in
//! the network namespace, which could then feed the plugin forged events),
//! and its messages are rust-protobuf types next to this workspace's prost.
//! The unary protocol is this file.

use crate::Error;

/// Length of a message header.
pub(crate) const HEADER_LEN: usize = 10;
/// ttRPC's own limit for a message's payload (`messageLengthMax`).
pub(crate) const MAX_MESSAGE: u32 = 4 << 20;
/// Message type of a request.
pub(crate) const REQUEST: u8 = 1;
/// Message type of a response.
pub(crate) const RESPONSE: u8 = 2;

/// One ttRPC message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Message {
    pub(crate) stream_id: u32,
    pub(crate) kind: u8,
    pub(crate) flags: u8,
    pub(crate) payload: Vec<u8>,
}

/// A ttRPC request (`ttrpc.Request`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Request {
    #[prost(string, tag = "1")]
    pub(crate) service: String,
    #[prost(string, tag = "2")]
    pub(crate) method: String,
    #[prost(bytes = "vec", tag = "3")]
    pub(crate) payload: Vec<u8>,
    /// The caller's deadline, as nanoseconds from when it sent the request
    /// (0: none).
    #[prost(int64, tag = "4")]
    pub(crate) timeout_nano: i64,
    #[prost(message, repeated, tag = "5")]
    pub(crate) metadata: Vec<KeyValue>,
}

/// A metadata pair of a request.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct KeyValue {
    #[prost(string, tag = "1")]
    pub(crate) key: String,
    #[prost(string, tag = "2")]
    pub(crate) value: String,
}

/// A ttRPC response (`ttrpc.Response`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Response {
    #[prost(message, optional, tag = "1")]
    pub(crate) status: Option<Status>,
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) payload: Vec<u8>,
}

/// `google.rpc.Status` without its `details` (unknown fields are skipped).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Status {
    #[prost(int32, tag = "1")]
    pub(crate) code: i32,
    #[prost(string, tag = "2")]
    pub(crate) message: String,
}

/// Encodes one message with its header. Only this crate's own messages (a
/// few bytes each) are encoded, far below [`MAX_MESSAGE`].
pub(crate) fn encode(stream_id: u32, kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    debug_assert!(payload.len() <= MAX_MESSAGE as usize);
    let len = payload.len() as u32;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(payload);
    out
}

/// Reassembles messages from one multiplexer channel's byte stream.
///
/// Memory is bounded: a header is checked against [`MAX_MESSAGE`] as soon
/// as its 10 bytes are in, before its payload is waited for, and complete
/// messages are taken out as they complete, so the buffer holds at most one
/// partial message and one frame.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    buf: Vec<u8>,
}

impl Decoder {
    /// Adds bytes received on the channel.
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete message, if one is in. An oversized header is an
    /// error (the stream cannot be resynchronized after it).
    pub(crate) fn next_message(&mut self) -> Result<Option<Message>, Error> {
        let Some(h) = self.buf.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
        if len > MAX_MESSAGE {
            return Err(Error::MessageTooLarge {
                len,
                max: MAX_MESSAGE,
            });
        }
        let stream_id = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
        let (kind, flags) = (h[8], h[9]);
        let end = HEADER_LEN + len as usize;
        if self.buf.len() < end {
            return Ok(None);
        }
        let payload = self.buf[HEADER_LEN..end].to_vec();
        self.buf.drain(..end);
        Ok(Some(Message {
            stream_id,
            kind,
            flags,
            payload,
        }))
    }

    /// Bytes held (a partial message).
    #[cfg(test)]
    pub(crate) fn buffered(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests: a panic is the failure report")]
mod tests {
    use prost::Message as _;

    use super::*;

    #[test]
    fn header_layout_matches_ttrpc() {
        let m = encode(3, RESPONSE, 0, b"ab");
        assert_eq!(m, [0, 0, 0, 2, 0, 0, 0, 3, 2, 0, b'a', b'b']);
    }

    #[test]
    fn request_round_trips_through_the_decoder_byte_by_byte() {
        let req = Request {
            service: "nri.pkg.api.v1alpha1.Plugin".into(),
            method: "Configure".into(),
            payload: vec![1, 2, 3],
            timeout_nano: 2_000_000_000,
            metadata: vec![KeyValue {
                key: "k".into(),
                value: "v".into(),
            }],
        };
        let wire = [
            encode(1, REQUEST, 0, &req.encode_to_vec()),
            encode(3, REQUEST, 0, &[]),
        ]
        .concat();
        let mut d = Decoder::default();
        let mut got = Vec::new();
        // Frames can split a message anywhere.
        for b in &wire {
            d.push(std::slice::from_ref(b));
            while let Some(m) = d.next_message().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].stream_id, got[0].kind), (1, REQUEST));
        assert_eq!(Request::decode(&got[0].payload[..]).unwrap(), req);
        assert_eq!((got[1].stream_id, got[1].payload.len()), (3, 0));
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn response_status_decodes_and_details_are_skipped() {
        // Status{code: 3, message: "bad", details: [Any{type_url: "x"}]}
        let mut status = Status {
            code: 3,
            message: "bad".into(),
        }
        .encode_to_vec();
        status.extend_from_slice(&[0x1a, 0x03, 0x0a, 0x01, b'x']);
        let mut resp = vec![0x0a, status.len() as u8];
        resp.extend_from_slice(&status);
        let r = Response::decode(&resp[..]).unwrap();
        assert_eq!(
            r.status.map(|s| (s.code, s.message)),
            Some((3, "bad".into()))
        );
    }

    #[test]
    fn oversized_message_is_rejected_from_its_header() {
        let mut d = Decoder::default();
        let mut h = (MAX_MESSAGE + 1).to_be_bytes().to_vec();
        h.extend_from_slice(&[0, 0, 0, 1, REQUEST, 0]);
        d.push(&h);
        assert!(matches!(
            d.next_message(),
            Err(Error::MessageTooLarge { len, .. }) if len == MAX_MESSAGE + 1
        ));
    }

    #[test]
    fn partial_header_waits() {
        let mut d = Decoder::default();
        d.push(&[0, 0, 0]);
        assert!(d.next_message().unwrap().is_none());
    }

    #[test]
    fn garbage_payload_is_a_decode_error_not_a_panic() {
        // Field 1 as a length-delimited string that claims 100 bytes.
        assert!(Request::decode(&[0x0a, 100, b'x'][..]).is_err());
        // Invalid wire type 7.
        assert!(Request::decode(&[0x0f][..]).is_err());
    }
}
