//! The one error type of this crate.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong talking to the agent.
///
/// [`Error::is_retryable`] says whether trying again later can help: a
/// missing socket or a refused connection (the agent is starting or
/// restarting), an unavailable agent, a dropped stream. A denied permission,
/// an invalid request or a protocol violation will repeat.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The socket file does not exist: the agent is not running on this node,
    /// has not created its socket yet, or listens elsewhere (`lookout run --socket`).
    /// Retryable.
    #[error("the lookout socket {path} does not exist (is the agent running on this node?)")]
    SocketMissing {
        /// The socket path dialled.
        path: PathBuf,
        /// `ENOENT` from `connect(2)`.
        #[source]
        source: io::Error,
    },
    /// `connect(2)` on the socket failed with `EACCES`/`EPERM`: this process
    /// may not write to the socket (it is root-only by default). Not
    /// retryable.
    #[error(
        "permission denied on the lookout socket {path} (run as root, or as a user the agent's socket permissions allow)"
    )]
    PermissionDenied {
        /// The socket path dialled.
        path: PathBuf,
        /// `EACCES` or `EPERM` from `connect(2)`.
        #[source]
        source: io::Error,
    },
    /// `connect(2)` on the socket failed otherwise. `ECONNREFUSED` (a stale
    /// socket file, nobody listening: the agent is restarting) and `EAGAIN`
    /// (its listen backlog is full: the agent is busy, or another local
    /// user floods it with connections) are retryable; anything else
    /// (`ENOTSOCK`, ...) is not.
    #[error("could not connect to the lookout socket {path}")]
    Connect {
        /// The socket path dialled.
        path: PathBuf,
        /// The error from `connect(2)`.
        #[source]
        source: io::Error,
    },
    /// The socket accepted the connection but the HTTP/2 handshake failed:
    /// something other than a lookout agent listens there, or it went away
    /// mid-handshake. Retryable.
    #[error("the HTTP/2 handshake on the lookout socket {path} failed")]
    Handshake {
        /// The socket path dialled.
        path: PathBuf,
        /// tonic's transport error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The agent answered an RPC with an error status. Whether it is
    /// retryable depends on the code (see [`Error::is_retryable`]);
    /// `PERMISSION_DENIED` on `Gate` means this peer is neither root nor
    /// allow-listed.
    #[error("lookout.v1.Lookout/{rpc} failed with {code:?}", code = status.code())]
    Rpc {
        /// The RPC: `List`, `Watch` or `Gate`.
        rpc: &'static str,
        /// The status the agent (or the transport) returned.
        #[source]
        status: tonic::Status,
    },
    /// The agent sent something the contract does not allow (a `Hold`
    /// before `Subscribed`, an `ADDED` event without a container, ...). Not
    /// retryable: a [`crate::Watcher`] drops its stream and ends after it; a
    /// [`crate::Gate`] passes it on for the one malformed hold and goes on.
    #[error("lookout.v1.Lookout/{rpc}: the agent broke the protocol: {detail}")]
    Protocol {
        /// The RPC: `List`, `Watch` or `Gate`.
        rpc: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The gate's stream is closed (the agent ended it, or the [`crate::Gate`]
    /// was dropped), so a decision cannot be sent. The agent applies the
    /// subscription's failure policy to the holds still open.
    #[error("the gate stream is closed; the agent applies the failure policy to open holds")]
    GateClosed,
}

impl Error {
    /// Whether trying the same thing again later can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::SocketMissing { .. } | Error::Handshake { .. } => true,
            Error::Connect { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::WouldBlock
            ),
            Error::Rpc { status, .. } => code_is_retryable(status.code()),
            Error::PermissionDenied { .. } | Error::Protocol { .. } | Error::GateClosed => false,
        }
    }

    /// The gRPC status code, for [`Error::Rpc`].
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Error::Rpc { status, .. } => Some(status.code()),
            _ => None,
        }
    }

    /// Classifies an error from `connect(2)` on `path`.
    pub(crate) fn from_connect(path: PathBuf, source: io::Error) -> Self {
        match source.kind() {
            io::ErrorKind::NotFound => Error::SocketMissing { path, source },
            io::ErrorKind::PermissionDenied => Error::PermissionDenied { path, source },
            _ => Error::Connect { path, source },
        }
    }
}

/// `e` and its causes, `outer: cause: root`: this crate's messages leave
/// their causes to `source()`, so a log line needs the whole chain.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// Codes that describe a passing condition: the agent is restarting or went
/// away (`UNAVAILABLE`, and `UNKNOWN`/`INTERNAL`/`CANCELLED`, which is how a
/// connection reset mid-stream surfaces), or dropped a slow consumer
/// (`RESOURCE_EXHAUSTED`). The others (`PERMISSION_DENIED`,
/// `INVALID_ARGUMENT`, `UNIMPLEMENTED`, ...) will repeat.
pub(crate) fn code_is_retryable(code: tonic::Code) -> bool {
    use tonic::Code;
    matches!(
        code,
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::Aborted
            | Code::DeadlineExceeded
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(kind: io::ErrorKind) -> Error {
        Error::from_connect(
            PathBuf::from("/run/lookout/lookout.sock"),
            io::Error::from(kind),
        )
    }

    #[test]
    fn connect_errors_are_classified() {
        let missing = classify(io::ErrorKind::NotFound);
        assert!(matches!(missing, Error::SocketMissing { .. }));
        assert!(missing.is_retryable());
        assert!(missing.to_string().contains("/run/lookout/lookout.sock"));

        let denied = classify(io::ErrorKind::PermissionDenied);
        assert!(matches!(denied, Error::PermissionDenied { .. }));
        assert!(!denied.is_retryable());

        assert!(classify(io::ErrorKind::ConnectionRefused).is_retryable());
        assert!(classify(io::ErrorKind::WouldBlock).is_retryable());
        assert!(!classify(io::ErrorKind::InvalidInput).is_retryable());
    }

    #[test]
    fn messages_leave_the_cause_to_the_chain() {
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused).to_string();
        let e = classify(io::ErrorKind::ConnectionRefused);
        assert_eq!(
            e.to_string(),
            "could not connect to the lookout socket /run/lookout/lookout.sock"
        );
        assert_eq!(
            chain(&e),
            format!("could not connect to the lookout socket /run/lookout/lookout.sock: {refused}")
        );
        assert_eq!(chain(&e).matches(&refused).count(), 1);
    }

    #[test]
    fn status_codes_are_classified() {
        let rpc = |status| Error::Rpc {
            rpc: "Watch",
            status,
        };
        assert!(rpc(tonic::Status::resource_exhausted("slow")).is_retryable());
        assert!(rpc(tonic::Status::unavailable("restarting")).is_retryable());
        assert!(!rpc(tonic::Status::permission_denied("not root")).is_retryable());
        assert!(!rpc(tonic::Status::invalid_argument("filter")).is_retryable());
        let e = rpc(tonic::Status::permission_denied("not root"));
        assert_eq!(e.code(), Some(tonic::Code::PermissionDenied));
        assert_eq!(
            e.to_string(),
            "lookout.v1.Lookout/Watch failed with PermissionDenied"
        );
    }
}
