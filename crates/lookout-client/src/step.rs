//! What [`crate::Watcher`] and [`crate::Gate`] share: a state machine,
//! advanced one `step` at a time, polled as a `Stream`.
//!
//! The shape is kube-runtime's `watcher`: the state is moved into the
//! future of one step, which gives it back with what to yield. Unlike
//! `futures::stream::unfold`, [`Driver`] hands the state to the caller
//! after each step, so that accessors (`Watcher::revision`, `Gate::name`)
//! stay right while the next step runs.
//!
//! # Cancel safety
//!
//! The step in progress lives in the [`Driver`], not in the future that
//! polls it: dropping that future (a `tokio::select!` branch that lost, a
//! timeout) loses nothing, and the next poll goes on with the same step.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};

/// What one step gives back besides the state.
#[derive(Debug)]
pub(crate) enum Step<T> {
    /// Pass on `T`; the machine goes on.
    Yield(T),
    /// Pass on `T`; the stream then ends (a failure that would repeat).
    Last(T),
    /// The stream ends now.
    End,
}

/// A state machine that a [`Driver`] advances.
pub(crate) trait Machine: Sized + Send + 'static {
    /// What the stream yields.
    type Item: Send + 'static;

    /// Runs until there is something to pass on (or the end), then gives
    /// the state back.
    fn step(self) -> impl Future<Output = (Self, Step<Self::Item>)> + Send + 'static;
}

type StepFuture<M> = Pin<Box<dyn Future<Output = (M, Step<<M as Machine>::Item>)> + Send>>;

/// Polls a [`Machine`] as a stream: `Idle` between items, `Stepping`
/// while a step runs, `Done` once the stream ended (fused: `None` for
/// good).
pub(crate) struct Driver<M: Machine> {
    state: State<M>,
}

enum State<M: Machine> {
    Idle(M),
    Stepping(SyncFuture<M>),
    Done,
}

impl<M: Machine> Driver<M> {
    /// Starts idle, in `machine`.
    pub(crate) fn new(machine: M) -> Self {
        Self {
            state: State::Idle(machine),
        }
    }

    /// Whether the stream has ended (every poll now gives `None`).
    pub(crate) fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Polls the step in progress, starting one if none is. `observe` sees
    /// the state each time a step finishes, before it is kept (or dropped,
    /// at the end).
    pub(crate) fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
        observe: impl FnOnce(&M),
    ) -> Poll<Option<M::Item>> {
        loop {
            // N.B. `Done` while the step is polled: a step that panics
            // leaves an ended stream, not a future polled after its panic.
            match std::mem::replace(&mut self.state, State::Done) {
                State::Idle(machine) => {
                    self.state = State::Stepping(SyncFuture::new(Box::pin(machine.step())));
                }
                State::Stepping(mut future) => {
                    let Poll::Ready((machine, step)) = future.poll(cx) else {
                        self.state = State::Stepping(future);
                        return Poll::Pending;
                    };
                    observe(&machine);
                    return Poll::Ready(match step {
                        Step::Yield(item) => {
                            self.state = State::Idle(machine);
                            Some(item)
                        }
                        Step::Last(item) => Some(item),
                        Step::End => None,
                    });
                }
                State::Done => return Poll::Ready(None),
            }
        }
    }
}

impl<M: Machine + fmt::Debug> fmt::Debug for Driver<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            State::Idle(machine) => f.debug_tuple("Idle").field(machine).finish(),
            State::Stepping(_) => f.write_str("Stepping"),
            State::Done => f.write_str("Done"),
        }
    }
}

/// A step's future, `Sync` although the future is only `Send`: it is only
/// ever reached through `&mut` ([`Mutex::get_mut`] takes no lock), so a
/// shared `&Watcher` exposes nothing of it. This keeps `Watcher` and
/// `Gate` `Sync`, as they were before they became streams.
struct SyncFuture<M: Machine>(Mutex<StepFuture<M>>);

impl<M: Machine> SyncFuture<M> {
    fn new(future: StepFuture<M>) -> Self {
        Self(Mutex::new(future))
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<(M, Step<M::Item>)> {
        // N.B. never locked, so never poisoned; a step that panicked is
        // dropped by the driver before it could be polled again.
        let future = self.0.get_mut().unwrap_or_else(PoisonError::into_inner);
        future.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use futures::{Stream as _, StreamExt};

    /// Counts down from `n`, yielding each number, then ends; `fail_at`
    /// yields an error that ends the stream.
    #[derive(Debug)]
    struct Countdown {
        n: u32,
        fail_at: Option<u32>,
    }

    impl Machine for Countdown {
        type Item = Result<u32, String>;

        async fn step(mut self) -> (Self, Step<Self::Item>) {
            // A real await point, so that cancellation can cut in.
            tokio::task::yield_now().await;
            let step = match self.n {
                0 => Step::End,
                n if Some(n) == self.fail_at => Step::Last(Err(format!("failed at {n}"))),
                n => Step::Yield(Ok(n)),
            };
            self.n = self.n.saturating_sub(1);
            (self, step)
        }
    }

    struct Stream(Driver<Countdown>, Vec<u32>);

    impl futures::Stream for Stream {
        type Item = Result<u32, String>;

        fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            let this = self.get_mut();
            let seen = &mut this.1;
            this.0.poll_next(cx, |c| seen.push(c.n))
        }
    }

    #[tokio::test]
    async fn yields_until_the_end_then_stays_ended() {
        let mut s = Stream(
            Driver::new(Countdown {
                n: 3,
                fail_at: None,
            }),
            Vec::new(),
        );
        let items: Vec<_> = (&mut s).collect().await;
        assert_eq!(items, [Ok(3), Ok(2), Ok(1)]);
        assert!(s.0.is_done());
        assert_eq!(s.next().await, None);
        // The state after each step, end included.
        assert_eq!(s.1, [2, 1, 0, 0]);
    }

    #[tokio::test]
    async fn a_last_item_ends_the_stream() {
        let machine = Countdown {
            n: 3,
            fail_at: Some(2),
        };
        let mut s = Stream(Driver::new(machine), Vec::new());
        let items: Vec<_> = (&mut s).collect().await;
        assert_eq!(items, [Ok(3), Err("failed at 2".to_owned())]);
        assert!(s.0.is_done());
    }

    #[tokio::test]
    async fn a_cancelled_poll_keeps_the_step() {
        let mut s = Stream(
            Driver::new(Countdown {
                n: 2,
                fail_at: None,
            }),
            Vec::new(),
        );
        // Polled once (the step starts and waits), then dropped.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut s).poll_next(&mut cx).is_pending());
        assert!(matches!(s.0.state, State::Stepping(_)));
        // The same step goes on: nothing lost, nothing repeated.
        assert_eq!(s.next().await, Some(Ok(2)));
        assert_eq!(s.next().await, Some(Ok(1)));
        assert_eq!(s.next().await, None);
    }

    fn is_send_sync_unpin<T: Send + Sync + Unpin>() {}

    #[test]
    fn the_driver_is_send_sync_and_unpin() {
        is_send_sync_unpin::<Driver<Countdown>>();
    }
}
