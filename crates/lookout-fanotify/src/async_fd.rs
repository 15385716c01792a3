//! An async (tokio) view of a non-blocking group.

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::{Error, Event, Fanotify, MIN_READ_BUFFER};

/// A [`Fanotify`] group registered with the tokio reactor.
///
/// Must be created inside a tokio runtime with IO enabled, from a group
/// built with [`Builder::nonblock(true)`](crate::Builder::nonblock) (the
/// default).
#[derive(Debug)]
pub struct AsyncFanotify {
    inner: AsyncFd<Fanotify>,
    buf: Vec<u8>,
}

impl AsyncFanotify {
    /// Registers `group` with the reactor.
    pub fn new(group: Fanotify) -> Result<Self, Error> {
        if !group.is_nonblocking() {
            return Err(Error::Blocking);
        }
        // SAFETY: `Fanotify` owns its fd (behind an `Arc` that the
        // `AsyncFd` keeps alive) and `as_raw_fd` always returns that fd, so
        // it stays open and the same for the lifetime of the registration.
        let inner = unsafe { AsyncFd::register_with_interest(group, Interest::READABLE) }
            .map_err(|e| Error::Read { source: e.into() })?;
        Ok(AsyncFanotify {
            inner,
            buf: vec![0u8; MIN_READ_BUFFER * 4],
        })
    }

    /// The group, for marks.
    pub fn get_ref(&self) -> &Fanotify {
        self.inner.get_ref()
    }

    /// Waits until at least one event is queued, then reads what is queued
    /// into `out`. Returns the number of events added (at least 1).
    ///
    /// # Cancel safety
    /// Cancel safe: events are only taken from the kernel in the same poll
    /// that returns them, so dropping the future loses nothing.
    pub async fn read_events(&mut self, out: &mut Vec<Event>) -> Result<usize, Error> {
        loop {
            let mut guard = self
                .inner
                .readable()
                .await
                .map_err(|source| Error::Read { source })?;
            // Readiness is edge-triggered: try the read first and clear
            // readiness only when the kernel says there is nothing left.
            let n = guard.get_inner().read_events(&mut self.buf, out)?;
            if n > 0 {
                return Ok(n);
            }
            guard.clear_ready();
        }
    }
}
