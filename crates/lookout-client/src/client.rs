//! The connection to the agent.

use std::path::{Path, PathBuf};

use lookout_api::v1::{self, lookout_client::LookoutClient};
use tonic::transport::Channel;

use crate::connect::{self, ConnectOptions};
use crate::{Error, Filter, Gate, GateOptions, Watcher};

/// A connection to the agent's API socket. Cheap to clone: clones share
/// the connection (HTTP/2 multiplexes their calls).
///
/// Every call retries retryable failures (the agent restarting) for
/// [`ConnectOptions::retry_for`], then returns the error.
#[derive(Clone, Debug)]
pub struct Client {
    grpc: LookoutClient<Channel>,
    path: PathBuf,
    options: ConnectOptions,
}

impl Client {
    /// Connects to the socket at `path` (usually
    /// [`DEFAULT_SOCKET`](crate::DEFAULT_SOCKET)) with the default
    /// [`ConnectOptions`]: retries for 10 s while the socket is missing or
    /// refuses connections.
    ///
    /// # Errors
    ///
    /// [`Error::SocketMissing`] when the socket still does not exist after
    /// retrying, [`Error::PermissionDenied`] at once when this process may
    /// not connect to it.
    pub async fn connect(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::connect_with(path, ConnectOptions::new()).await
    }

    /// Connects to the socket at `path` with `options`.
    ///
    /// # Errors
    ///
    /// As [`Client::connect`].
    pub async fn connect_with(
        path: impl AsRef<Path>,
        options: ConnectOptions,
    ) -> Result<Self, Error> {
        let path = path.as_ref().to_owned();
        let channel = connect::retry(&options, || connect::dial(&path)).await?;
        Ok(Self {
            grpc: LookoutClient::new(channel).max_decoding_message_size(crate::watch::MAX_MESSAGE),
            path,
            options,
        })
    }

    /// The socket this client dials.
    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// The generated gRPC client on this connection, for what this crate
    /// does not wrap.
    pub fn grpc(&self) -> LookoutClient<Channel> {
        self.grpc.clone()
    }

    /// The containers matching `filter` now, and the revision they are
    /// current at: [`Client::watch_since`] with that revision goes on from
    /// there without loss or duplicate.
    pub async fn list(&self, filter: Filter) -> Result<(u64, Vec<v1::Container>), Error> {
        let request = v1::ListRequest {
            filter: Some(filter.into_proto()),
        };
        let response = connect::retry(&self.options, || {
            let mut grpc = self.grpc.clone();
            let request = request.clone();
            async move {
                grpc.list(request).await.map_err(|status| Error::Rpc {
                    rpc: "List",
                    status,
                })
            }
        })
        .await?
        .into_inner();
        Ok((response.revision, response.containers))
    }

    /// Watches the containers matching `filter`: a stream of an
    /// [`crate::Event::Snapshot`] of those live now, then every change. See
    /// [`Watcher`] for how it survives agent restarts and when it ends.
    pub async fn watch(&self, filter: Filter) -> Result<Watcher, Error> {
        self.watch_since(filter, 0).await
    }

    /// Watches the changes after revision `since` (from [`Client::list`] or
    /// [`Watcher::revision`]); 0 starts with a snapshot, as does a `since`
    /// the agent no longer retains.
    pub async fn watch_since(&self, filter: Filter, since: u64) -> Result<Watcher, Error> {
        Watcher::open(
            self.grpc.clone(),
            self.path.clone(),
            self.options.clone(),
            filter.into_proto(),
            since,
        )
        .await
    }

    /// Subscribes to the gate with `options`: sends their `Subscribe`,
    /// waits for the agent's `Subscribed`, and returns the [`Gate`], a
    /// stream of one [`crate::HoldGuard`] per matching container start.
    /// See [`Gate`] for how it survives agent restarts and when it ends.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use lookout_client::{Client, Filter, GateOptions, OnFailure};
    /// # async fn f(client: Client) -> Result<(), lookout_client::Error> {
    /// let options = GateOptions::new("tracer")
    ///     .filter(Filter::all().namespace("payments"))
    ///     .deadline(Duration::from_millis(500))
    ///     .on_failure(OnFailure::FailOpen);
    /// let mut gate = client.gate(options).await?;
    /// while let Some(hold) = gate.next().await {
    ///     hold?.allow()?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// A `Subscribe` built as a protobuf message converts:
    /// `client.gate(subscribe.into())`.
    ///
    /// # Errors
    ///
    /// [`Error::Rpc`] with `PERMISSION_DENIED` when this peer is neither
    /// root nor allow-listed by the agent, with `INVALID_ARGUMENT` for an
    /// `on_failure` the agent does not know; the connection errors of
    /// [`Client::connect`] when the agent stays unreachable for
    /// [`ConnectOptions::retry_for`].
    pub async fn gate(&self, options: GateOptions) -> Result<Gate, Error> {
        Gate::subscribe(
            self.grpc.clone(),
            self.path.clone(),
            self.options.clone(),
            options.into_proto(),
        )
        .await
    }
}
