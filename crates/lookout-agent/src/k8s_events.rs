//! Kubernetes Events for new containers (`--k8s-events`): a note that says
//! what a container is, never what it holds, posted on the Node under a
//! per-node rate limit. Events over the limit are dropped, never queued.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lookout_model::ContainerEvent;

/// Posts a Kubernetes Event for every new container.
#[derive(Clone)]
pub struct Events {
    pub client: kube::Client,
    pub node: String,
    /// `--k8s-events-unsafe-values`: the note also carries environment
    /// variable and annotation values (see [`summary`]).
    pub unsafe_values: bool,
    /// The per-node rate limit; Events over it are dropped.
    pub limit: Arc<EventLimit>,
}

/// A token bucket: `burst` tokens, refilled at `per_minute` a minute (0:
/// never), one taken per admitted Event. The clock is the caller's `now`,
/// so tests drive it without sleeping.
///
/// Counted in exact integers: a token is [`NANOS_PER_MINUTE`] units, and
/// every nanosecond that passes adds `per_minute` units, so no rounding
/// builds up between refills.
#[derive(Debug)]
pub struct TokenBucket {
    /// The most units the bucket holds (`burst` tokens).
    capacity: u128,
    per_minute: u128,
    units: u128,
    /// When `units` was last brought up to date.
    last: std::time::Instant,
}

const NANOS_PER_MINUTE: u128 = 60_000_000_000;

impl TokenBucket {
    /// A full bucket.
    pub fn new(burst: u32, per_minute: u32, now: std::time::Instant) -> TokenBucket {
        let capacity = u128::from(burst) * NANOS_PER_MINUTE;
        TokenBucket {
            capacity,
            per_minute: u128::from(per_minute),
            units: capacity,
            last: now,
        }
    }

    /// Takes a token if there is one. A `now` earlier than a previous one
    /// adds nothing (and does not move the bucket's clock back).
    pub fn try_take(&mut self, now: std::time::Instant) -> bool {
        if now > self.last {
            let elapsed = (now - self.last).as_nanos();
            self.units = self
                .units
                .saturating_add(elapsed.saturating_mul(self.per_minute))
                .min(self.capacity);
            self.last = now;
        }
        match self.units.checked_sub(NANOS_PER_MINUTE) {
            Some(rest) => {
                self.units = rest;
                true
            }
            None => false,
        }
    }
}

/// The most often the agent warns that Events were dropped.
pub const DROP_WARNING_INTERVAL: Duration = Duration::from_secs(60);

/// What [`EventLimit::admit_at`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Post the Event.
    Post,
    /// Drop it; `warn` is `Some(n)` when a warning is due, `n` Events
    /// dropped since the previous one (this one included).
    Drop { warn: Option<u64> },
}

/// The per-node rate limit of Kubernetes Events (`--k8s-events-burst`,
/// `--k8s-events-per-minute`): a [`TokenBucket`] behind a mutex held for
/// a few arithmetic operations, never across an await. Events over the
/// limit are dropped, never queued: counted in `dropped`
/// (`lookout_k8s_events_dropped_total`) and warned about at most once per
/// [`DROP_WARNING_INTERVAL`].
pub struct EventLimit {
    state: Mutex<LimitState>,
    dropped: prometheus_client::metrics::counter::Counter,
}

struct LimitState {
    bucket: TokenBucket,
    /// Dropped since the last warning.
    unreported: u64,
    last_warning: Option<std::time::Instant>,
}

impl EventLimit {
    /// A full bucket of `burst`; `dropped` counts the Events refused.
    pub fn new(
        burst: u32,
        per_minute: u32,
        dropped: prometheus_client::metrics::counter::Counter,
    ) -> EventLimit {
        EventLimit::starting_at(burst, per_minute, dropped, std::time::Instant::now())
    }

    fn starting_at(
        burst: u32,
        per_minute: u32,
        dropped: prometheus_client::metrics::counter::Counter,
        now: std::time::Instant,
    ) -> EventLimit {
        EventLimit {
            state: Mutex::new(LimitState {
                bucket: TokenBucket::new(burst, per_minute, now),
                unreported: 0,
                last_warning: None,
            }),
            dropped,
        }
    }

    /// Whether container `id`'s Event may be posted now; a dropped one is
    /// counted and logged (at warn at most once per
    /// [`DROP_WARNING_INTERVAL`]).
    pub(crate) fn admit(&self, id: &str) -> bool {
        match self.admit_at(std::time::Instant::now()) {
            Admission::Post => true,
            Admission::Drop { warn } => {
                tracing::debug!(id, "Kubernetes Event dropped: over the rate limit");
                if let Some(n) = warn {
                    tracing::warn!(
                        dropped = n,
                        "Kubernetes Events dropped: over --k8s-events-burst/--k8s-events-per-minute \
                         (the number since the last warning)"
                    );
                }
                false
            }
        }
    }

    /// [`EventLimit::admit`] at `now`, without logging.
    fn admit_at(&self, now: std::time::Instant) -> Admission {
        // N.B. a poisoned lock still holds a consistent bucket: every
        // update is a plain assignment.
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.bucket.try_take(now) {
            return Admission::Post;
        }
        self.dropped.inc();
        s.unreported += 1;
        let due = s
            .last_warning
            .is_none_or(|t| now.saturating_duration_since(t) >= DROP_WARNING_INTERVAL);
        let warn = due.then(|| {
            s.last_warning = Some(now);
            std::mem::take(&mut s.unreported)
        });
        Admission::Drop { warn }
    }
}

/// The k8s limit on an Event's note.
const NOTE_LIMIT: usize = 1024;

/// Words in a name that mark its value as a secret.
const SECRET_WORDS: [&str; 8] = [
    "pass", "secret", "token", "key", "cred", "auth", "cert", "private",
];

fn secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    SECRET_WORDS.iter().any(|w| n.contains(w))
}

/// `args` with the values of secret-looking flags masked: `--password=x`,
/// `PASSWORD=x`, and the argument after a bare `--token`.
fn masked_args(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut mask_next = false;
    for a in args {
        if mask_next {
            out.push("***".to_owned());
            mask_next = false;
            continue;
        }
        match a.split_once('=') {
            Some((k, _)) if secret_name(k) => out.push(format!("{k}=***")),
            Some(_) => out.push(a.clone()),
            None => {
                mask_next = a.starts_with('-') && secret_name(a);
                out.push(a.clone());
            }
        }
    }
    out
}

/// The Event note for a new container: what it is, never what it holds.
/// config.json carries `process.env` (secrets injected as environment
/// variables) and annotations (tokens, keys); a Node Event is readable by
/// anyone who may list Events. So: id, runtime, Kubernetes identity, image,
/// args with secret-looking values masked, environment variable *names*,
/// annotation *keys*, hostname.
///
/// With `unsafe_values` (`--k8s-events-unsafe-values`, an operator's
/// explicit choice) the environment and annotations are copied whole,
/// values and all; args stay masked.
fn summary(c: &lookout_model::Container, cfg: &serde_json::Value, unsafe_values: bool) -> String {
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut parts = vec![format!("container {} ({})", c.id, c.runtime)];
    if let Some(k) = &c.kubernetes {
        parts.push(format!(
            "pod {}/{} container {}",
            k.namespace.as_deref().unwrap_or("?"),
            k.pod.as_deref().unwrap_or("?"),
            k.container.as_deref().unwrap_or("?")
        ));
    }
    let annotations = cfg["annotations"].as_object();
    if let Some(image) = annotations
        .and_then(|a| a.get("io.kubernetes.cri.image-name"))
        .and_then(|v| v.as_str())
    {
        parts.push(format!("image {image}"));
    }
    if let Some(h) = cfg["hostname"].as_str() {
        parts.push(format!("hostname {h}"));
    }
    parts.push(format!(
        "args {:?}",
        masked_args(&strings(&cfg["process"]["args"]))
    ));
    let env = strings(&cfg["process"]["env"]);
    if unsafe_values {
        parts.push(format!("env {env:?}"));
        let all: Vec<(&String, &str)> = annotations
            .map(|a| {
                a.iter()
                    .map(|(k, v)| (k, v.as_str().unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        parts.push(format!("annotations {all:?}"));
    } else {
        let names: Vec<&str> = env
            .iter()
            .map(|e| e.split('=').next().unwrap_or_default())
            .collect();
        parts.push(format!("env names {names:?}"));
        let keys: Vec<&String> = annotations.map(|a| a.keys().collect()).unwrap_or_default();
        parts.push(format!("annotation keys {keys:?}"));
    }
    parts.join("; ")
}

impl Events {
    /// Posts the Event for container `e` on this node: its config's
    /// [`summary`], or why it has none. A failure is logged, not retried.
    pub(crate) async fn post(self, e: &ContainerEvent, config: Option<&serde_json::Value>) {
        let ev = self;
        use k8s_openapi::api::core::v1::ObjectReference;
        use kube::runtime::events::{Event, EventType, Recorder, Reporter};
        let c = &e.container;
        let (reason, note) = match config {
            Some(cfg) => ("NewContainerConfig", summary(c, cfg, ev.unsafe_values)),
            None => (
                "ContainerConfigNotFound",
                format!(
                    "container {} ({}, found by {}): no readable config.json{}",
                    c.id,
                    c.runtime,
                    e.source,
                    c.bundle
                        .as_ref()
                        .map(|b| format!(" in {}", b.display()))
                        .unwrap_or_default()
                ),
            ),
        };
        let mut note = note;
        if note.len() > NOTE_LIMIT {
            let mut cut = NOTE_LIMIT - 3;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            note.truncate(cut);
            note.push_str("...");
        }
        let reporter = Reporter {
            controller: "lookout".into(),
            instance: Some(format!("lookout-{}", ev.node)),
        };
        // A recorder per container: one recorder folds events with the
        // same reason and object into one series, which would keep only
        // the first container's config.
        let recorder = Recorder::new(ev.client, reporter);
        let node = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(ev.node.clone()),
            ..ObjectReference::default()
        };
        let event = Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some(note),
            action: "ContainerAdded".into(),
            secondary: None,
        };
        if let Err(err) = recorder.publish(&event, &node).await {
            tracing::warn!(id = c.id, %err, "posting the Kubernetes Event failed");
        }
    }
}

#[cfg(test)]
mod summary_tests {
    use super::*;

    #[test]
    fn the_event_summary_keeps_no_secret() {
        let mut c = lookout_model::Container::new("c1", lookout_model::RuntimeKind::Runc);
        c.kubernetes = Some({
            let mut k = lookout_model::Kubernetes::default();
            k.namespace = Some("shop".into());
            k.pod = Some("cart-0".into());
            k.container = Some("cart".into());
            k
        });
        let cfg = serde_json::json!({
            "hostname": "h1",
            "process": {
                "args": ["/app", "--password=hunter2", "--token", "t0k3n", "--port=80", "DB_SECRET=s3", "-v"],
                "env": ["PATH=/bin", "PASSWORD=hunter3", "API_TOKEN=abc123"],
            },
            "annotations": {
                "io.kubernetes.cri.image-name": "shop/cart:2",
                "example.com/token": "tok-s3cr3t",
            },
        });
        let s = summary(&c, &cfg, false);
        for secret in [
            "hunter2",
            "t0k3n",
            "s3\"",
            "hunter3",
            "abc123",
            "tok-s3cr3t",
        ] {
            assert!(!s.contains(secret), "{secret} leaked: {s}");
        }
        for kept in [
            "container c1 (runc)",
            "pod shop/cart-0 container cart",
            "image shop/cart:2",
            "hostname h1",
            "--port=80",
            "--password=***",
            "DB_SECRET=***",
            "PASSWORD",
            "API_TOKEN",
            "example.com/token",
        ] {
            assert!(s.contains(kept), "{kept} missing: {s}");
        }
    }

    #[test]
    fn unsafe_values_add_env_and_annotation_values_and_still_mask_args() {
        let c = lookout_model::Container::new("c1", lookout_model::RuntimeKind::Runc);
        let cfg = serde_json::json!({
            "process": {
                "args": ["/app", "--password=hunter2"],
                "env": ["PATH=/bin", "PASSWORD=hunter3"],
            },
            "annotations": {"example.com/token": "tok-s3cr3t"},
        });
        let s = summary(&c, &cfg, true);
        for kept in [
            "PASSWORD=hunter3",
            "PATH=/bin",
            "example.com/token",
            "tok-s3cr3t",
            "--password=***",
        ] {
            assert!(s.contains(kept), "{kept} missing: {s}");
        }
        assert!(!s.contains("hunter2"), "args are masked: {s}");
    }
}

#[cfg(test)]
mod limit_tests {
    use std::time::{Duration, Instant};

    use prometheus_client::metrics::counter::Counter;

    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_bucket_without_refill_admits_the_burst_then_nothing_ever() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2, 0, t0);
        assert!(b.try_take(t0));
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0));
        assert!(!b.try_take(t0 + 3600 * S));
    }

    #[test]
    fn a_bucket_refills_at_its_rate_up_to_the_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(3, 60, t0);
        for _ in 0..3 {
            assert!(b.try_take(t0));
        }
        assert!(!b.try_take(t0));
        // 60 a minute: one a second, exactly.
        assert!(!b.try_take(t0 + Duration::from_millis(999)));
        assert!(b.try_take(t0 + S));
        assert!(!b.try_take(t0 + S));
        // Half a token and half a token make one.
        assert!(!b.try_take(t0 + Duration::from_millis(1500)));
        assert!(b.try_take(t0 + 2 * S));
        // A long pause refills only up to the burst.
        let later = t0 + 600 * S;
        for _ in 0..3 {
            assert!(b.try_take(later));
        }
        assert!(!b.try_take(later));
        // A clock going back adds nothing and breaks nothing.
        assert!(!b.try_take(t0));
        assert!(b.try_take(later + S));
    }

    #[test]
    fn slow_rates_and_huge_values_are_exact_and_do_not_overflow() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1, 1, t0);
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0 + 59 * S));
        assert!(b.try_take(t0 + 60 * S));
        let mut b = TokenBucket::new(u32::MAX, u32::MAX, t0);
        // A century later, at the largest rate: no overflow.
        assert!(b.try_take(t0 + Duration::from_secs(100 * 365 * 86_400)));
    }

    #[test]
    fn drops_are_counted_and_warned_about_once_a_minute_with_the_count() {
        let t0 = Instant::now();
        let dropped = Counter::default();
        let l = EventLimit::starting_at(1, 0, dropped.clone(), t0);
        assert_eq!(l.admit_at(t0), Admission::Post);
        // The first drop warns at once.
        assert_eq!(l.admit_at(t0), Admission::Drop { warn: Some(1) });
        assert_eq!(l.admit_at(t0 + S), Admission::Drop { warn: None });
        assert_eq!(l.admit_at(t0 + 59 * S), Admission::Drop { warn: None });
        // A minute after the last warning: the three since then.
        assert_eq!(l.admit_at(t0 + 60 * S), Admission::Drop { warn: Some(3) });
        assert_eq!(l.admit_at(t0 + 61 * S), Admission::Drop { warn: None });
        assert_eq!(l.admit_at(t0 + 200 * S), Admission::Drop { warn: Some(2) });
        assert_eq!(dropped.get(), 6);
    }
}
