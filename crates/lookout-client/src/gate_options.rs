//! A builder for `lookout.v1.Subscribe`, what [`crate::Client::gate`]
//! subscribes with.

use std::time::Duration;

use lookout_api::v1;

use crate::Filter;

/// What a gate subscription asks of the agent: its name, which container
/// starts to hold ([`Filter`]), how long each hold waits for an answer, and
/// what happens to a hold nobody answered ([`OnFailure`]). Passed to
/// [`Client::gate`](crate::Client::gate).
///
/// Every field of `lookout.v1.Subscribe` has a method here. Fields left
/// unset take the agent's defaults: every container, its
/// `--gate-deadline` (2 s), fail-open.
///
/// ```
/// use std::time::Duration;
/// use lookout_client::{Filter, GateOptions, OnFailure, proto};
///
/// let options = GateOptions::new("tracer")
///     .filter(Filter::all().namespace("payments"))
///     .deadline(Duration::from_millis(500))
///     .on_failure(OnFailure::FailClosed);
/// let subscribe = proto::Subscribe::from(options);
/// assert_eq!(subscribe.name, "tracer");
/// assert_eq!(subscribe.deadline_ms, 500);
/// assert_eq!(subscribe.on_failure(), proto::FailurePolicy::FailClosed);
/// ```
///
/// The protobuf message converts both ways ([`GateOptions::into_proto`],
/// `From<proto::Subscribe>`), for a subscription built elsewhere; a field
/// this crate does not know yet is kept.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GateOptions {
    inner: v1::Subscribe,
}

impl GateOptions {
    /// A subscription called `name`, holding every container's start,
    /// with the agent's deadline, fail-open.
    ///
    /// The name appears in the agent's logs, metrics and denial reasons
    /// ("denied by gate `name`: ..."); a new agent of a rollout gives
    /// the holds it kept for a gate back to the subscriber of the same
    /// name. The agent keeps `[A-Za-z0-9-_.:/]`, at most 64 of them
    /// ([`Gate::name`](crate::Gate::name) says what it kept).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            inner: v1::Subscribe {
                name: name.into(),
                ..Default::default()
            },
        }
    }

    /// Holds only the starts of containers that match `filter` (by default
    /// [`Filter::all`]).
    pub fn filter(mut self, filter: Filter) -> Self {
        self.inner.filter = Some(filter.into_proto());
        self
    }

    /// How long each hold waits for a decision, counted from
    /// [`HoldGuard::monotonic_ns`](crate::HoldGuard::monotonic_ns), before
    /// the [`OnFailure`] policy applies. Rounded up to whole milliseconds.
    ///
    /// By default, and with [`Duration::ZERO`], the agent's
    /// `--gate-deadline` (2 s). The agent lowers one above its
    /// `--gate-max-deadline` (10 s);
    /// [`Gate::deadline`](crate::Gate::deadline) says what it applies.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.inner.deadline_ms = deadline_ms(deadline);
        self
    }

    /// What the agent does with a hold not answered by the deadline, or
    /// whose subscriber went away (by default [`OnFailure::FailOpen`]).
    pub fn on_failure(mut self, on_failure: OnFailure) -> Self {
        self.inner.set_on_failure(on_failure.into());
        self
    }

    /// The protobuf message sent to the agent.
    pub fn into_proto(self) -> v1::Subscribe {
        self.inner
    }
}

impl From<GateOptions> for v1::Subscribe {
    fn from(options: GateOptions) -> Self {
        options.inner
    }
}

impl From<v1::Subscribe> for GateOptions {
    fn from(inner: v1::Subscribe) -> Self {
        Self { inner }
    }
}

/// `Subscribe.deadline_ms`: 0 (the agent's default) only for zero; else
/// rounded up, so that a sub-millisecond deadline does not become the
/// default, and saturated (the agent lowers it anyway).
fn deadline_ms(deadline: Duration) -> u32 {
    let ms = deadline.as_nanos().div_ceil(1_000_000);
    u32::try_from(ms).unwrap_or(u32::MAX)
}

/// What the agent does with a hold that was not answered by the
/// subscription's deadline, or whose subscriber went away (the [`Gate`]
/// was dropped, the process died).
///
/// A subscriber that answers late is *overdue*: the agent applies this
/// policy to its next holds at once, without waiting, until it answers in
/// time again.
///
/// [`Gate`]: crate::Gate
#[doc(alias = "FailurePolicy")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OnFailure {
    /// Let the container start: a slow or dead subscriber never blocks the
    /// node. The default.
    #[doc(alias = "FAIL_OPEN")]
    #[default]
    FailOpen,
    /// Deny the start (the runtime's start fails and the container is
    /// removed), except in the agent's exempt namespaces (`kube-system` and
    /// lookout's own by default, so that the node can recover).
    #[doc(alias = "FAIL_CLOSED")]
    FailClosed,
}

impl From<OnFailure> for v1::FailurePolicy {
    fn from(on_failure: OnFailure) -> Self {
        match on_failure {
            OnFailure::FailOpen => v1::FailurePolicy::FailOpen,
            OnFailure::FailClosed => v1::FailurePolicy::FailClosed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_is_mapped() {
        let subscribe = GateOptions::new("tracer")
            .filter(Filter::all().runtime("runc"))
            .deadline(Duration::from_millis(750))
            .on_failure(OnFailure::FailClosed)
            .into_proto();
        // A struct literal: a field added to the proto fails to compile
        // here, as a reminder to give it a method.
        let v1::Subscribe {
            name,
            filter,
            deadline_ms,
            on_failure,
        } = subscribe;
        assert_eq!(name, "tracer");
        assert_eq!(filter.map(|f| f.runtimes), Some(vec!["runc".to_owned()]));
        assert_eq!(deadline_ms, 750);
        assert_eq!(on_failure, v1::FailurePolicy::FailClosed as i32);
    }

    #[test]
    fn defaults_are_the_agents() {
        let subscribe = GateOptions::new("tracer").into_proto();
        assert_eq!(
            subscribe,
            v1::Subscribe {
                name: "tracer".to_owned(),
                filter: None,
                deadline_ms: 0,
                on_failure: v1::FailurePolicy::FailOpen as i32,
            }
        );
        assert_eq!(OnFailure::default(), OnFailure::FailOpen);
    }

    #[test]
    fn deadlines_round_up_and_saturate() {
        assert_eq!(deadline_ms(Duration::ZERO), 0);
        assert_eq!(deadline_ms(Duration::from_nanos(1)), 1);
        assert_eq!(deadline_ms(Duration::from_micros(1500)), 2);
        assert_eq!(deadline_ms(Duration::from_secs(2)), 2000);
        assert_eq!(deadline_ms(Duration::MAX), u32::MAX);
    }

    #[test]
    fn the_proto_converts_both_ways() {
        // An on_failure this client does not know survives the round trip.
        let raw = v1::Subscribe {
            name: "raw".to_owned(),
            on_failure: 7,
            ..Default::default()
        };
        let options = GateOptions::from(raw.clone());
        assert_eq!(v1::Subscribe::from(options), raw);
    }
}
