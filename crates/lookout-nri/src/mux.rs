//! NRI's connection multiplexer (containerd/nri `pkg/net/multiplex`).
//!
//! One Unix connection carries two byte streams. Each frame is an 8-byte
//! header, a big-endian `u32` channel id then a big-endian `u32` payload
//! length, followed by the payload. Channel 1 carries the plugin's services
//! (the runtime calls Configure, Synchronize, CreateContainer, ... on it);
//! channel 2 the runtime's (the plugin calls RegisterPlugin on it); 0 is
//! reserved. A frame is a chunk of its channel's byte stream, not a message:
//! the Go side writes ttRPC through a 4 KiB `bufio.Writer`, so a large
//! message arrives split over frames. [`crate::ttrpc::Decoder`] reassembles.

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::Error;
use crate::error::is_disconnect;

/// Length of a frame header.
pub(crate) const HEADER_LEN: usize = 8;
/// The channel of the plugin's services (runtime → plugin requests).
pub(crate) const PLUGIN_CONN: u32 = 1;
/// The channel of the runtime's services (plugin → runtime requests).
pub(crate) const RUNTIME_CONN: u32 = 2;
/// The largest frame payload accepted: one whole ttRPC message at ttRPC's
/// own limit, with its header. (The Go multiplexer would allocate up to
/// 4 GiB on a header's word; we refuse before allocating.)
pub(crate) const MAX_FRAME: u32 = crate::ttrpc::MAX_MESSAGE + crate::ttrpc::HEADER_LEN as u32;
/// The Go reader (`bufio.Reader`, 4 KiB) fails a channel read with ENOMEM
/// when a frame does not fit the buffer it reads into, so a message is sent
/// as the Go writer sends it: the first 4 KiB in one frame, the rest in
/// one more.
const GO_BUFIO_SIZE: usize = 4096;

/// Parses a frame header: `(channel, payload length)`. Rejects the reserved
/// channel and lengths over `max`.
pub(crate) fn decode_header(h: [u8; HEADER_LEN], max: u32) -> Result<(u32, u32), Error> {
    let conn = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
    if conn == 0 {
        return Err(Error::ReservedChannel);
    }
    if len > max {
        return Err(Error::FrameTooLarge { conn, len, max });
    }
    Ok((conn, len))
}

/// Appends `data` to `out` as frames on channel `conn`, split like the Go
/// writer splits (see [`GO_BUFIO_SIZE`]).
pub(crate) fn encode_frames(conn: u32, data: &[u8], out: &mut Vec<u8>) {
    let (first, rest) = data.split_at(data.len().min(GO_BUFIO_SIZE));
    for chunk in [first, rest] {
        if chunk.is_empty() {
            continue;
        }
        out.extend_from_slice(&conn.to_be_bytes());
        // Our messages are a few bytes; a chunk is at most MAX_FRAME
        // because a ttRPC message is (ttrpc::encode checks).
        out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        out.extend_from_slice(chunk);
    }
}

/// Reads one frame: `(channel, payload)`. The length is checked against
/// `max` before anything is allocated for the payload.
///
/// # Cancel safety
///
/// Not cancel safe (a cancelled read loses its place in the stream); the
/// plugin reads frames on a task of their own.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u32,
) -> Result<(u32, Vec<u8>), Error> {
    let mut h = [0u8; HEADER_LEN];
    // EOF before the first byte of a header is an orderly close.
    let n = r.read(&mut h).await.map_err(read_error)?;
    if n == 0 {
        return Err(Error::Closed);
    }
    r.read_exact(&mut h[n..]).await.map_err(read_error)?;
    let (conn, len) = decode_header(h, max)?;
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).await.map_err(read_error)?;
    Ok((conn, payload))
}

fn read_error(e: std::io::Error) -> Error {
    if is_disconnect(&e) {
        Error::Closed
    } else {
        Error::Io {
            op: "read",
            source: e,
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests: a panic is the failure report")]
mod tests {
    use super::*;

    fn header(conn: u32, len: u32) -> [u8; 8] {
        let mut h = [0u8; 8];
        h[..4].copy_from_slice(&conn.to_be_bytes());
        h[4..].copy_from_slice(&len.to_be_bytes());
        h
    }

    #[test]
    fn header_is_big_endian_channel_then_length() {
        assert_eq!(
            decode_header([0, 0, 0, 2, 0, 0, 1, 0], MAX_FRAME).unwrap(),
            (2, 256)
        );
    }

    #[test]
    fn reserved_channel_is_rejected() {
        assert!(matches!(
            decode_header(header(0, 1), MAX_FRAME),
            Err(Error::ReservedChannel)
        ));
    }

    #[test]
    fn oversized_frame_is_rejected_from_its_header() {
        assert!(decode_header(header(1, MAX_FRAME), MAX_FRAME).is_ok());
        let err = decode_header(header(1, MAX_FRAME + 1), MAX_FRAME).unwrap_err();
        assert!(
            matches!(err, Error::FrameTooLarge { conn: 1, len, max } if len == MAX_FRAME + 1 && max == MAX_FRAME),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn huge_frame_is_refused_without_reading_its_payload() {
        // A header announcing 4 GiB and no payload: the read must fail at the
        // header (an allocation of u32::MAX bytes would abort the test).
        let bytes = header(1, u32::MAX);
        let mut r = &bytes[..];
        let err = read_frame(&mut r, MAX_FRAME).await.unwrap_err();
        assert!(matches!(err, Error::FrameTooLarge { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn frames_round_trip_and_split_like_go() {
        let small = b"hello".to_vec();
        let big: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut wire = Vec::new();
        encode_frames(PLUGIN_CONN, &small, &mut wire);
        encode_frames(RUNTIME_CONN, &big, &mut wire);
        let mut r = &wire[..];
        assert_eq!(
            read_frame(&mut r, MAX_FRAME).await.unwrap(),
            (PLUGIN_CONN, small)
        );
        let (c, first) = read_frame(&mut r, MAX_FRAME).await.unwrap();
        assert_eq!((c, first.len()), (RUNTIME_CONN, 4096));
        let (c, rest) = read_frame(&mut r, MAX_FRAME).await.unwrap();
        assert_eq!((c, rest.len()), (RUNTIME_CONN, 10_000 - 4096));
        assert_eq!([first, rest].concat(), big);
        assert!(matches!(
            read_frame(&mut r, MAX_FRAME).await,
            Err(Error::Closed)
        ));
    }

    #[tokio::test]
    async fn truncated_frame_is_a_close_not_a_panic() {
        let mut wire = Vec::new();
        encode_frames(PLUGIN_CONN, b"0123456789", &mut wire);
        for cut in 1..wire.len() {
            let mut r = &wire[..cut];
            assert!(
                matches!(read_frame(&mut r, MAX_FRAME).await, Err(Error::Closed)),
                "cut at {cut}"
            );
        }
    }
}
