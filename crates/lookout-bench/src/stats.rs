//! Percentiles and the shuffled orders the measurements interleave in.

use serde_json::{Value, json};

pub(crate) fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[idx.min(v.len() - 1)]
}

pub(crate) fn stats(v: &[f64]) -> Value {
    let mut v = v.to_vec();
    json!({
        "n": v.len(), "p50": pct(&mut v, 0.5), "p90": pct(&mut v, 0.9),
        "p99": pct(&mut v, 0.99), "max": pct(&mut v, 1.0),
    })
}

/// A new random order of `order` from the xorshift state `rng`.
///
/// An exec's cost depends on what ran just before it (caches, which CPU is
/// awake), and a fixed or rotating order gives each configuration a fixed
/// predecessor.
pub(crate) fn shuffle<T>(rng: &mut u64, order: &mut [T]) {
    for k in (1..order.len()).rev() {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        order.swap(k, (*rng % (k as u64 + 1)) as usize);
    }
}
