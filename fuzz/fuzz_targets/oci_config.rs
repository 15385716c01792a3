//! config.json, written by whoever created the bundle (any user who can
//! run a runtime): its annotations are bounded whatever their number and
//! size.
//!
//! Input: a first byte, then (even) config.json's bytes, or (odd) a
//! structured input from which a well-formed config is written.
#![no_main]

use std::collections::BTreeMap;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lookout_runtime_hook::oci::{
    MAX_ANNOTATION_BYTES, MAX_ANNOTATIONS, TRUNCATED_ANNOTATION, parse_config,
};

/// A well-formed config with chosen fields, so that the bounds are
/// reached (raw bytes rarely get past the JSON parser).
#[derive(Arbitrary, Debug)]
struct Shaped {
    annotations: BTreeMap<String, String>,
    /// Repeats the first annotations many times, with longer values.
    blow_up: u16,
    args: Vec<String>,
    env: Vec<String>,
    hostname: Option<String>,
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bytes = if mode % 2 == 0 {
        rest.to_vec()
    } else {
        let Ok(Shaped {
            mut annotations,
            blow_up,
            args,
            env,
            hostname,
        }) = Shaped::arbitrary_take_rest(Unstructured::new(rest))
        else {
            return;
        };
        {
            let extra: Vec<(String, String)> = annotations
                .iter()
                .take(4)
                .flat_map(|(k, v)| {
                    // Up to 2400 entries of up to 256 bytes: past both
                    // bounds (1024 entries, 256 KiB), in at most ~600 KiB.
                    let v: String = v.chars().take(64).collect::<String>().repeat(4);
                    (0..blow_up % 600).map(move |i| (format!("{k}{i}"), v.clone()))
                })
                .collect();
            annotations.extend(extra);
            serde_json::to_vec(&serde_json::json!({
                "ociVersion": "1.0.2",
                "process": {"args": args, "env": env, "cwd": "/"},
                "root": {"path": "rootfs"},
                "hostname": hostname,
                "annotations": annotations,
            }))
            .expect("serialise")
        }
    };
    if let Ok((cfg, dropped)) = parse_config(&bytes) {
        let a = &cfg.annotations;
        let marker = a.get(TRUNCATED_ANNOTATION);
        if dropped.is_some() {
            assert!(marker.is_some(), "a cut is recorded");
        }
        let kept: usize = a
            .iter()
            .filter(|(k, _)| dropped.is_none() || k.as_str() != TRUNCATED_ANNOTATION)
            .map(|(k, v)| k.len() + v.len())
            .sum();
        assert!(kept <= MAX_ANNOTATION_BYTES, "{kept} bytes kept");
        assert!(a.len() <= MAX_ANNOTATIONS + 1, "{} kept", a.len());
    }
});
