//! Serving gRPC on a Unix socket to clients in every language.
//!
//! Over a Unix socket there is no host name, and each gRPC stack sends its
//! own HTTP/2 `:authority`: grpc C-core (Python, Ruby, C++, PHP, C#) the
//! percent-encoded socket path (`tmp%2Flookout.sock`, since grpc 1.57),
//! grpc-java and grpc-swift the raw path (`/run/lookout/lookout.sock`),
//! grpc-go `localhost`, tonic the URI's host. h2, under tonic, accepts only
//! a valid URI authority and resets every other stream with
//! `PROTOCOL_ERROR`, so Python and Java clients fail every call with
//! `INTERNAL` unless they set `grpc.default_authority` (hyperium/h2#487).
//!
//! [`AuthorityFix`] sits below h2, on the accepted stream. It reads the
//! client's HTTP/2 frames and decodes the first request's header block
//! (HPACK, with the client's dynamic table):
//!
//! - if its `:authority` is one h2 accepts, or absent (the common case:
//!   tonic, grpc-go), the connection is passed through untouched from then
//!   on, without copies;
//! - otherwise every header block of the connection is decoded and
//!   re-encoded as literals without indexing (so h2's decoding table stays
//!   empty and in step), with an unacceptable `:authority` replaced by
//!   `localhost`. Every other frame passes through as it came.
//!
//! A client that sends bytes that are not HTTP/2 gets them passed through,
//! and h2 answers as it would. A header block that cannot be decoded, or
//! is larger than 64 KiB, ends the connection with an error (h2 would end
//! it with `COMPRESSION_ERROR` or `ENHANCE_YOUR_CALM`).
//!
//! ```no_run
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! use lookout_api::unix::AuthorityFix;
//! use tokio_stream::StreamExt;
//! let listener = tokio::net::UnixListener::bind("/tmp/api.sock")?;
//! let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
//!     .map(|conn| conn.map(AuthorityFix::new));
//! # let routes = tonic::service::Routes::default();
//! tonic::transport::Server::builder()
//!     .add_routes(routes)
//!     .serve_with_incoming(incoming)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [`QuietStream`] is the accepted stream to wrap: registered for reading
//! only, it does not wake the server each time a client reads a frame.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The largest header block (all its frames) this layer collects. hyper
/// limits a request's decoded header list to 16 KiB; a block is smaller.
pub const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// The frame size of re-encoded blocks: the smallest
/// SETTINGS_MAX_FRAME_SIZE, which every HTTP/2 peer accepts.
const OUT_FRAME: usize = 16_384;
/// The largest decoded header list (the sum of name + value + 32 over its
/// fields, as RFC 7541 counts them). A one-byte reference to a 4 KiB table
/// entry decodes to 4 KiB, so without this bound 64 KiB of HPACK could
/// decode to gigabytes. hyper accepts 16 KiB.
pub const MAX_HEADER_LIST: usize = 64 * 1024;
/// The most fields in one block (hyper's 16 KiB header list holds at most
/// 512 fields of 32 bytes each; a gRPC request has about 10).
pub const MAX_FIELDS: usize = 256;
/// The most Huffman-coded strings in one block. Each costs the decoder
/// (loona-hpack) a table of its own, about 10 us, so a block of empty
/// Huffman strings would cost seconds without this bound.
pub const MAX_HUFFMAN_STRINGS: usize = 64;
/// The decoding table's size: the client's encoder may use
/// SETTINGS_HEADER_TABLE_SIZE, which h2 leaves at its default, 4096.
const TABLE_SIZE: usize = 4096;
/// What replaces an authority that h2 refuses.
const LOCALHOST: &[u8] = b"localhost";

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// Why [`AuthorityFix`] ended a connection.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A header block larger than [`MAX_HEADER_BLOCK`].
    #[error("an HTTP/2 header block of more than {MAX_HEADER_BLOCK} bytes")]
    BlockTooLarge,
    /// A HEADERS frame whose padding or priority does not fit in it.
    #[error("a malformed HEADERS frame on stream {0}")]
    MalformedHeaders(u32),
    /// A header block not followed by its CONTINUATION frames.
    #[error("a header block on stream {0} was interrupted by a frame of type {1}")]
    Interrupted(u32, u8),
    /// A header block with more fields, Huffman strings or decoded bytes
    /// than [`MAX_FIELDS`], [`MAX_HUFFMAN_STRINGS`] or [`MAX_HEADER_LIST`].
    #[error("an HTTP/2 header block on stream {stream} over the layer's limits: {what}")]
    OverLimits {
        /// The stream of the block.
        stream: u32,
        /// Which limit.
        what: String,
    },
    /// HPACK that does not decode with the client's table.
    #[error("an HTTP/2 header block on stream {stream} does not decode: {reason}")]
    Compression {
        /// The stream of the block.
        stream: u32,
        /// The decoder's complaint.
        reason: String,
    },
}

/// What the layer does with the rest of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Before the client's preface.
    Preface,
    /// Decoding until the first header block says whether to rewrite.
    Decide,
    /// Re-encoding every header block.
    Rewrite,
    /// Passing everything through.
    Pass,
}

/// A header block being collected (a HEADERS frame and its CONTINUATIONs).
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// The frames as they came, to pass on unchanged.
    raw: Vec<u8>,
}

/// The byte-level state machine: HTTP/2 from the client in, HTTP/2 for h2
/// out. Pure (no I/O), so it can be tested and fuzzed on its own.
pub(crate) struct Rewriter {
    mode: Mode,
    input: Vec<u8>,
    /// Bytes of a passed-through frame's payload still to copy.
    pending: usize,
    block: Option<Block>,
    decoder: loona_hpack::Decoder<'static>,
    rewritten: u64,
}

impl Rewriter {
    pub(crate) fn new() -> Rewriter {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Rewriter {
            mode: Mode::Preface,
            input: Vec::new(),
            pending: 0,
            block: None,
            decoder,
            rewritten: 0,
        }
    }

    /// Whether everything from now on passes through unchanged.
    pub(crate) fn passing(&self) -> bool {
        self.mode == Mode::Pass && self.input.is_empty()
    }

    /// Feeds the client's bytes, appending what h2 should read to `out`.
    pub(crate) fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
        self.input.extend_from_slice(data);
        let mut at = 0;
        let result = loop {
            match self.step(at, out) {
                Ok(Some(next)) => at = next,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        self.input.drain(..at);
        result
    }

    /// The client closed: whatever is left goes to h2 as it is.
    pub(crate) fn finish(&mut self, out: &mut Vec<u8>) {
        if let Some(b) = self.block.take() {
            out.extend_from_slice(&b.raw);
        }
        out.append(&mut self.input);
    }

    /// One step from `input[at..]`: the new position, or `None` when more
    /// input is needed.
    fn step(&mut self, at: usize, out: &mut Vec<u8>) -> Result<Option<usize>, Error> {
        let rest = &self.input[at..];
        if rest.is_empty() {
            return Ok(None);
        }
        if self.mode == Mode::Pass {
            out.extend_from_slice(rest);
            return Ok(Some(self.input.len()));
        }
        if self.pending > 0 {
            let n = self.pending.min(rest.len());
            out.extend_from_slice(&rest[..n]);
            self.pending -= n;
            return Ok(Some(at + n));
        }
        if self.mode == Mode::Preface {
            let n = rest.len().min(PREFACE.len());
            if rest[..n] != PREFACE[..n] {
                // Not HTTP/2 with prior knowledge: h2 will say so.
                self.mode = Mode::Pass;
                return Ok(Some(at));
            }
            if n < PREFACE.len() {
                return Ok(None);
            }
            out.extend_from_slice(PREFACE);
            self.mode = Mode::Decide;
            return Ok(Some(at + n));
        }
        if rest.len() < 9 {
            return Ok(None);
        }
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        let (kind, flags) = (rest[3], rest[4]);
        let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
        let collecting = self.block.as_ref().map(|b| b.stream);
        match (kind, collecting) {
            (CONTINUATION, Some(s)) if s == stream => {}
            (_, Some(s)) => return Err(Error::Interrupted(s, kind)),
            (HEADERS, None) => {}
            _ => {
                // Any other frame (DATA, SETTINGS, a stray CONTINUATION,
                // which h2 refuses itself) passes through.
                out.extend_from_slice(&rest[..9]);
                self.pending = len;
                return Ok(Some(at + 9));
            }
        }
        if len > MAX_HEADER_BLOCK {
            return Err(Error::BlockTooLarge);
        }
        if rest.len() < 9 + len {
            return Ok(None);
        }
        let frame = &rest[..9 + len];
        let mut payload = &frame[9..];
        let block = match self.block.take() {
            Some(b) => b,
            None => {
                if flags & PADDED != 0 {
                    let pad = usize::from(*payload.first().ok_or(Error::MalformedHeaders(stream))?);
                    payload = payload
                        .get(1..payload.len().saturating_sub(pad))
                        .filter(|_| pad < payload.len())
                        .ok_or(Error::MalformedHeaders(stream))?;
                }
                let mut priority = None;
                if flags & PRIORITY != 0 {
                    let p: [u8; 5] = payload
                        .get(..5)
                        .and_then(|p| p.try_into().ok())
                        .ok_or(Error::MalformedHeaders(stream))?;
                    priority = Some(p);
                    payload = &payload[5..];
                }
                Block {
                    stream,
                    end_stream: flags & END_STREAM != 0,
                    priority,
                    fragment: Vec::new(),
                    raw: Vec::new(),
                }
            }
        };
        let mut block = block;
        if block.raw.len() + frame.len() > MAX_HEADER_BLOCK + 9 * 8 {
            return Err(Error::BlockTooLarge);
        }
        block.fragment.extend_from_slice(payload);
        block.raw.extend_from_slice(frame);
        let next = at + frame.len();
        if flags & END_HEADERS == 0 {
            self.block = Some(block);
        } else {
            self.finish_block(block, out)?;
        }
        Ok(Some(next))
    }

    /// Decodes a complete header block and passes it on, as it came or
    /// re-encoded.
    fn finish_block(&mut self, block: Block, out: &mut Vec<u8>) -> Result<(), Error> {
        let stream = block.stream;
        let over = |what: String| Error::OverLimits { stream, what };
        let (fields, huffman) = shape(&block.fragment).map_err(|reason| Error::Compression {
            stream,
            reason: reason.into(),
        })?;
        if fields > MAX_FIELDS {
            return Err(over(format!("{fields} fields, at most {MAX_FIELDS}")));
        }
        if huffman > MAX_HUFFMAN_STRINGS {
            return Err(over(format!(
                "{huffman} Huffman strings, at most {MAX_HUFFMAN_STRINGS}"
            )));
        }
        let refused = |name: &[u8], value: &[u8]| {
            name == b":authority" && http::uri::Authority::try_from(value).is_err()
        };
        // Fields are borrowed from the block or the table, never copied:
        // counted, checked, and in Rewrite mode encoded at once.
        let rewrite = self.mode == Mode::Rewrite;
        let mut decoded = 0usize;
        let mut needs_rewrite = false;
        let mut encoded = Vec::new();
        let mut replaced = 0;
        let result = self.decoder.decode_with_cb(&block.fragment, |name, value| {
            decoded = decoded.saturating_add(name.len() + value.len() + 32);
            if decoded > MAX_HEADER_LIST {
                return;
            }
            let bad = refused(&name, &value);
            needs_rewrite |= bad;
            if rewrite {
                // A literal field without indexing, with a literal name.
                encoded.push(0);
                string(&mut encoded, &name);
                string(&mut encoded, if bad { LOCALHOST } else { &value });
                replaced += u64::from(bad);
            }
        });
        result.map_err(|e| Error::Compression {
            stream,
            reason: format!("{e:?}"),
        })?;
        if decoded > MAX_HEADER_LIST {
            return Err(over(format!(
                "a header list of more than {MAX_HEADER_LIST} bytes decoded"
            )));
        }
        if !rewrite {
            if !needs_rewrite {
                // h2 accepts this client as it is: step aside.
                out.extend_from_slice(&block.raw);
                self.mode = Mode::Pass;
                self.decoder = loona_hpack::Decoder::new();
                return Ok(());
            }
            // From now on every block is re-encoded, this one too: decode
            // it again from the table as it was (the first block of a
            // connection, whose table started empty; entries it added are
            // read back in the same order).
            self.mode = Mode::Rewrite;
            let mut fresh = loona_hpack::Decoder::new();
            fresh.set_max_allowed_table_size(TABLE_SIZE);
            self.decoder = fresh;
            return self.finish_block(block, out);
        }
        self.rewritten += replaced;
        frames(&block, &encoded, out);
        Ok(())
    }

    /// How many `:authority` values were replaced.
    pub(crate) fn rewritten(&self) -> u64 {
        self.rewritten
    }
}

/// Appends an HPACK string literal without Huffman coding (RFC 7541 §5.2).
fn string(out: &mut Vec<u8>, s: &[u8]) {
    // The length as an integer with a 7-bit prefix (§5.1).
    let mut n = s.len();
    if n < 0x7f {
        out.push(n as u8);
    } else {
        out.push(0x7f);
        n -= 0x7f;
        while n >= 0x80 {
            out.push((n & 0x7f) as u8 | 0x80);
            n >>= 7;
        }
        out.push(n as u8);
    }
    out.extend_from_slice(s);
}

/// Walks an HPACK block's representations without decoding them: how many
/// fields it has, and how many of its strings are Huffman-coded.
fn shape(block: &[u8]) -> Result<(usize, usize), &'static str> {
    /// An integer with an `n`-bit prefix (RFC 7541 §5.1): (value, bytes).
    fn int(b: &[u8], n: u8) -> Result<(usize, usize), &'static str> {
        let mask = (1u16 << n) as usize - 1;
        let first = usize::from(*b.first().ok_or("a truncated integer")?) & mask;
        if first < mask {
            return Ok((first, 1));
        }
        let mut value = mask;
        for (i, byte) in b.iter().enumerate().skip(1) {
            if i > 4 {
                return Err("an integer of more than 4 continuation bytes");
            }
            value += usize::from(byte & 0x7f) << (7 * (i - 1));
            if byte & 0x80 == 0 {
                return Ok((value, i + 1));
            }
        }
        Err("a truncated integer")
    }
    /// A string literal: (is Huffman, bytes).
    fn text(b: &[u8]) -> Result<(bool, usize), &'static str> {
        let huffman = b.first().is_some_and(|h| h & 0x80 != 0);
        let (len, n) = int(b, 7)?;
        let end = n.checked_add(len).filter(|&e| e <= b.len());
        Ok((huffman, end.ok_or("a truncated string")?))
    }
    let (mut fields, mut huffman, mut at) = (0, 0, 0);
    while let Some(&first) = block.get(at) {
        let rest = &block[at..];
        let (index, mut n) = match first {
            f if f & 0x80 != 0 => {
                fields += 1;
                at += int(rest, 7)?.1;
                continue;
            }
            f if f & 0xe0 == 0x20 => {
                at += int(rest, 5)?.1;
                continue;
            }
            f if f & 0xc0 == 0x40 => int(rest, 6)?,
            _ => int(rest, 4)?,
        };
        fields += 1;
        let strings = if index == 0 { 2 } else { 1 };
        for _ in 0..strings {
            let (h, len) = text(&rest[n..])?;
            huffman += usize::from(h);
            n += len;
        }
        at += n;
    }
    Ok((fields, huffman))
}

/// Appends `encoded` as a HEADERS frame and as many CONTINUATION frames as
/// [`OUT_FRAME`] needs, with the block's stream, END_STREAM and priority.
fn frames(block: &Block, encoded: &[u8], out: &mut Vec<u8>) {
    let priority: &[u8] = block.priority.as_ref().map_or(&[], |p| p);
    let first = encoded.len().min(OUT_FRAME - priority.len());
    let (head, mut tail) = encoded.split_at(first);
    let mut flags = 0;
    if block.end_stream {
        flags |= END_STREAM;
    }
    if !priority.is_empty() {
        flags |= PRIORITY;
    }
    if tail.is_empty() {
        flags |= END_HEADERS;
    }
    frame_header(
        out,
        priority.len() + head.len(),
        HEADERS,
        flags,
        block.stream,
    );
    out.extend_from_slice(priority);
    out.extend_from_slice(head);
    while !tail.is_empty() {
        let n = tail.len().min(OUT_FRAME);
        let last = n == tail.len();
        let flags = if last { END_HEADERS } else { 0 };
        frame_header(out, n, CONTINUATION, flags, block.stream);
        out.extend_from_slice(&tail[..n]);
        tail = &tail[n..];
    }
}

fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = (len as u32).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// An accepted connection whose HTTP/2 `:authority` h2 will accept,
/// whatever the client sent (see the [module](self) docs).
pub struct AuthorityFix<S> {
    inner: S,
    rewriter: Rewriter,
    /// Rewritten bytes not yet read by h2.
    out: Vec<u8>,
    at: usize,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> AuthorityFix<S> {
        AuthorityFix {
            inner,
            rewriter: Rewriter::new(),
            out: Vec::new(),
            at: 0,
            eof: false,
        }
    }

    /// The connection.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// How many `:authority` values were replaced on this connection.
    pub fn rewritten(&self) -> u64 {
        self.rewriter.rewritten()
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for AuthorityFix<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthorityFix")
            .field("inner", &self.inner)
            .field("mode", &self.rewriter.mode)
            .field("rewritten", &self.rewriter.rewritten)
            .finish_non_exhaustive()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.at < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.at);
                buf.put_slice(&this.out[this.at..this.at + n]);
                this.at += n;
                if this.at == this.out.len() {
                    this.out.clear();
                    this.at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            if this.rewriter.passing() {
                // Decided: h2 reads the connection itself.
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
            }
            if read.filled().is_empty() {
                this.eof = true;
                this.rewriter.finish(&mut this.out);
                continue;
            }
            if let Err(e) = this.rewriter.feed(read.filled(), &mut this.out) {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The peer's credentials reach the service as they would without the
/// layer (`request.extensions().get::<UdsConnectInfo>()` for a
/// `UnixStream`, or whatever the wrapped connection gives).
impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityFix<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Runs the rewriter over `data` cut at every `cut`-th byte, for the
/// fuzzer: it must never panic, and must give the same output however the
/// input is split.
#[cfg(fuzzing)]
pub fn fuzz(data: &[u8], cut: usize) {
    let mut whole = Rewriter::new();
    let mut a = Vec::new();
    let ra = whole.feed(data, &mut a);
    let mut split = Rewriter::new();
    let mut b = Vec::new();
    let mut rb = Ok(());
    for piece in data.chunks(cut.max(1)) {
        rb = split.feed(piece, &mut b);
        if rb.is_err() {
            break;
        }
    }
    assert_eq!(
        ra.is_ok(),
        rb.is_ok(),
        "same verdict however the input is cut"
    );
    if ra.is_ok() {
        assert_eq!(a, b, "same output however the input is cut");
    }
}

mod quiet;
pub use quiet::QuietStream;

#[cfg(test)]
mod tests;
