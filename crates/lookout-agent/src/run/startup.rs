//! Start-up, split by phase: so that a slower start names the part that
//! got slower. Logged at debug level (`lookout_agent::run::startup`) on
//! `ready`; `cargo xtask bench` reads that line.

use std::time::{Duration, Instant};

/// Laps from the start of `lookout run` to `ready`.
#[derive(Debug)]
pub(super) struct StartupClock {
    started: Instant,
    last: Instant,
    laps: Vec<(&'static str, Duration)>,
}

impl StartupClock {
    /// Starts the clock now.
    pub fn start() -> StartupClock {
        let now = Instant::now();
        StartupClock {
            started: now,
            last: now,
            laps: Vec::new(),
        }
    }

    /// Ends phase `name` now.
    pub fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.laps.push((name, now.duration_since(self.last)));
        self.last = now;
    }

    /// Splits the last lap: `parts` of it (measured inside it) are their
    /// own phases, and what remains keeps the lap's name.
    pub fn split_last(&mut self, parts: &[(&'static str, Duration)]) {
        let Some((_, last)) = self.laps.last_mut() else {
            return;
        };
        for (_, d) in parts {
            *last = last.saturating_sub(*d);
        }
        let at = self.laps.len() - 1;
        for (k, part) in parts.iter().enumerate() {
            self.laps.insert(at + k, *part);
        }
    }

    /// The phases so far and the total, as `name=1.2ms` pairs.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for (name, d) in &self.laps {
            s.push_str(&format!("{name}={:.1}ms ", d.as_secs_f64() * 1e3));
        }
        s.push_str(&format!(
            "total={:.1}ms",
            self.last.duration_since(self.started).as_secs_f64() * 1e3
        ));
        s
    }

    /// Logs the phases (debug level).
    pub fn log(&self) {
        tracing::debug!(target: "lookout_agent::run::startup", "start-up phases: {}", self.summary());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_lap_keeps_its_remainder_and_the_total() {
        let mut c = StartupClock::start();
        c.laps = vec![
            ("probe", Duration::from_millis(30)),
            ("backend", Duration::from_millis(100)),
        ];
        c.last = c.started + Duration::from_millis(130);
        c.split_last(&[
            ("bpf", Duration::from_millis(70)),
            ("marks", Duration::from_millis(5)),
        ]);
        assert_eq!(
            c.summary(),
            "probe=30.0ms bpf=70.0ms marks=5.0ms backend=25.0ms total=130.0ms"
        );
    }

    #[test]
    fn a_split_longer_than_its_lap_leaves_zero() {
        let mut c = StartupClock::start();
        c.laps = vec![("backend", Duration::from_millis(10))];
        c.split_last(&[("bpf", Duration::from_millis(20))]);
        assert_eq!(c.laps[1], ("backend", Duration::ZERO));
    }
}
