//! Discovery embedded in a Rust program: the agent's engine (mode ladder,
//! runtime hook, merger, hooks, hub) on threads of its own, with the hub
//! handed to the caller instead of a socket (which stays available).

use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;

use crate::hub::Hub;
use crate::run::{Control, RunArgs};

/// `lookout run`'s flags, parsed the same way.
#[derive(Debug, Parser)]
struct Flags {
    #[command(flatten)]
    args: RunArgs,
}

/// Discovery running in this process. Dropping it stops it (as
/// [`Discovery::stop`] does, without waiting).
pub struct Discovery {
    hub: Arc<Hub>,
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

/// Configures [`Discovery`] with the flags of `lookout run` (the same
/// names, defaults and checks; `lookout run --help` lists them). Unlike
/// the binary, it prints no events (`--output none`), serves its HTTP
/// endpoints on an ephemeral loopback port unless [`Builder::listen`]
/// says where, and installs no signal handlers.
#[derive(Debug, Clone)]
pub struct Builder {
    args: Vec<OsString>,
    listen: bool,
    ready_within: Duration,
}

impl Discovery {
    /// A builder with the agent's defaults.
    pub fn builder() -> Builder {
        Builder {
            args: Vec::new(),
            listen: false,
            ready_within: Duration::from_secs(60),
        }
    }

    /// The hub: list, watch and gate the node's containers.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Stops discovery (the fanotify marks go, queued runtime execs are
    /// answered) and waits for it.
    pub fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        match self.thread.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => bail!("the discovery thread panicked"),
            None => Ok(()),
        }
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl Builder {
    /// Any `lookout run` flag, with its value (`arg("--mode", "fanotify")`).
    pub fn arg(mut self, flag: &str, value: impl Into<OsString>) -> Builder {
        self.args.push(flag.into());
        self.args.push(value.into());
        self
    }

    /// Any `lookout run` flag without a value (`flag("--k8s-events")`).
    pub fn flag(mut self, flag: &str) -> Builder {
        self.args.push(flag.into());
        self
    }

    /// `--mode`: `auto` (the default), `fanotify-ebpf`, `fanotify`,
    /// `podinformer` or `scan`.
    pub fn mode(self, mode: &str) -> Builder {
        self.arg("--mode", mode)
    }

    /// `--host-root`.
    pub fn host_root(self, path: impl AsRef<Path>) -> Builder {
        self.arg("--host-root", path.as_ref().as_os_str())
    }

    /// `--runtime-path` (repeatable): an extra runtime binary to watch.
    pub fn runtime_path(self, path: impl AsRef<Path>) -> Builder {
        self.arg("--runtime-path", path.as_ref().as_os_str())
    }

    /// `--no-default-runtimes`: watch only the `runtime_path`s.
    pub fn no_default_runtimes(self) -> Builder {
        self.flag("--no-default-runtimes")
    }

    /// `--socket`: serve the gRPC API there too.
    pub fn socket(self, path: impl AsRef<Path>) -> Builder {
        self.arg("--socket", path.as_ref().as_os_str())
    }

    /// `--no-socket`: the hub only.
    pub fn no_socket(self) -> Builder {
        self.flag("--no-socket")
    }

    /// Serve `/healthz`, `/readyz` and `/metrics` on `addr`.
    pub fn listen(mut self, addr: &str) -> Builder {
        self.listen = true;
        self.arg("--listen", addr)
    }

    /// How long [`Builder::start`] waits for discovery to be ready (60 s).
    pub fn ready_within(mut self, d: Duration) -> Builder {
        self.ready_within = d;
        self
    }

    /// Probes the node, starts the best (or the asked) mode on threads of
    /// its own, reports what already runs, and returns once discovery is
    /// ready. Errors: bad flags, an asked mode that cannot start, or
    /// discovery not ready in time.
    pub fn start(self) -> anyhow::Result<Discovery> {
        let mut argv: Vec<OsString> = vec!["lookout".into(), "--output".into(), "none".into()];
        if !self.listen {
            // No endpoint by default; an ephemeral port nobody reads
            // would only cost a thread.
            argv.push("--listen".into());
            argv.push("127.0.0.1:0".into());
        }
        argv.extend(self.args);
        let args = Flags::try_parse_from(argv).context("discovery flags")?.args;
        args.check()
            .map_err(|why| anyhow::anyhow!("discovery flags: {why}"))?;
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let (ready, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("lookout-main".into())
            .spawn(move || {
                crate::run::run_with(
                    args,
                    crate::ebpf_object(),
                    Control::Embedded {
                        stop: stop_rx,
                        ready,
                    },
                )
            })
            .context("starting the discovery thread")?;
        match ready_rx.recv_timeout(self.ready_within) {
            Ok(hub) => Ok(Discovery {
                hub,
                stop,
                thread: Some(thread),
            }),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match thread.join() {
                Ok(Err(e)) => Err(e.context("discovery did not start")),
                Ok(Ok(())) => bail!("discovery stopped before it was ready"),
                Err(_) => bail!("the discovery thread panicked"),
            },
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let _ = stop.send(true);
                bail!("discovery not ready within {:?}", self.ready_within)
            }
        }
    }
}
