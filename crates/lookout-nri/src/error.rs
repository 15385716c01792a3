//! The crate's one error type.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// What went wrong with the plugin's configuration or with one connection
/// to the runtime.
///
/// [`PluginBuilder::build`](crate::PluginBuilder::build) returns the
/// configuration variants ([`Error::Name`], [`Error::Index`]). Every other
/// variant ends one connection: [`Plugin::run`](crate::Plugin::run) reports
/// it as [`Event::Disconnected`](crate::Event::Disconnected) and connects
/// again after a backoff, so they are all retryable. [`probe`](crate::probe)
/// returns them directly.
///
/// Causes are kept as the [`source`](std::error::Error::source), not
/// repeated in the message: print with `lookout_model::Chain` or `{:#}`
/// (anyhow) to see them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The plugin name is empty or contains `/` or NUL (the runtime uses it
    /// in file names and refuses an empty one).
    #[error("invalid NRI plugin name {0:?}")]
    Name(String),
    /// The plugin index is not two ASCII digits (`"00"` to `"99"`), which
    /// the runtime requires.
    #[error("invalid NRI plugin index {0:?}: two digits, 00 to 99")]
    Index(String),
    /// The NRI socket could not be connected to (the runtime is not
    /// running, NRI is disabled, or the path is wrong).
    #[error("cannot connect to the NRI socket {}", path.display())]
    Connect {
        /// The socket's path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// What is at the socket's path is not a socket.
    #[error("{} is not a socket", path.display())]
    NotASocket {
        /// Where the socket was looked for.
        path: PathBuf,
    },
    /// The socket is owned by another user than
    /// [`PluginBuilder::socket_owner`](crate::PluginBuilder::socket_owner)
    /// asks for: whoever made it is not the runtime, and what it says
    /// about pods and containers would be believed.
    #[error("{} is owned by uid {uid}, not uid {want}: not the runtime's socket", path.display())]
    SocketOwner {
        /// Where the socket was looked for.
        path: PathBuf,
        /// Its owner.
        uid: u32,
        /// The owner asked for.
        want: u32,
    },
    /// Reading from or writing to the runtime's connection failed.
    #[error("NRI connection {op} failed")]
    Io {
        /// `"read"` or `"write"`.
        op: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The consumer's queue ([`PluginBuilder::queue`](crate::PluginBuilder::queue))
    /// was full, so events were dropped. The plugin closes the connection
    /// (the runtime goes on without it), waits until half the queue is
    /// free, and connects again: the runtime's Synchronize then reports
    /// what the consumer missed.
    #[error("the consumer's event queue was full: {dropped} NRI events dropped")]
    Overflow {
        /// Events dropped on the connection.
        dropped: u64,
    },
    /// The runtime closed the connection (it stopped, restarted, or dropped
    /// this plugin).
    #[error("the runtime closed the NRI connection")]
    Closed,
    /// A multiplexer frame announced more bytes than the limit; nothing was
    /// allocated for it.
    #[error("NRI multiplexer frame of {len} bytes on channel {conn} exceeds the limit of {max}")]
    FrameTooLarge {
        /// The multiplexer channel (1: plugin services, 2: runtime
        /// services).
        conn: u32,
        /// The announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A multiplexer frame used the reserved channel 0.
    #[error("NRI multiplexer frame on the reserved channel 0")]
    ReservedChannel,
    /// A ttRPC message announced more bytes than ttRPC's own limit (4 MiB).
    #[error("ttRPC message of {len} bytes exceeds the limit of {max}")]
    MessageTooLarge {
        /// The announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A ttRPC message of a type this side of the connection never
    /// receives (a request on the runtime's channel, a response on the
    /// plugin's, or a streaming data message).
    #[error("unexpected ttRPC message type {kind} on channel {conn}")]
    UnexpectedMessage {
        /// The multiplexer channel.
        conn: u32,
        /// The ttRPC message type byte.
        kind: u8,
    },
    /// A protobuf message from the runtime could not be decoded.
    #[error("malformed {what} from the runtime")]
    Decode {
        /// Which message.
        what: &'static str,
        /// Why.
        #[source]
        source: prost::DecodeError,
    },
    /// The runtime answered RegisterPlugin with an error.
    #[error("the runtime refused the registration: {message} (ttRPC status {code})")]
    Refused {
        /// The gRPC status code.
        code: i32,
        /// The runtime's message.
        message: String,
    },
    /// The runtime did not answer RegisterPlugin, or did not call Configure
    /// and Synchronize, in time.
    #[error("NRI registration not complete after {0:?}")]
    RegistrationTimeout(Duration),
}

impl Error {
    /// Whether the socket does not exist: the runtime has NRI off, is not
    /// running, or the path is wrong.
    pub fn is_absent(&self) -> bool {
        matches!(self, Error::Connect { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// Whether an I/O error means the peer went away rather than a fault.
pub(crate) fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
    )
}
