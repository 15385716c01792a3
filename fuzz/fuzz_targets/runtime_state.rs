//! runc's state.json, crun's status file and pid files: written by a
//! runtime, but in directories a container's processes may share.
//!
//! Input: a first byte (odd: crun), the container id up to the first
//! newline, then the file's bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lookout_model::RuntimeKind;
use lookout_runtime_hook::state::{parse_pid, parse_state};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let runtime = if mode % 2 == 1 {
        RuntimeKind::Crun
    } else {
        RuntimeKind::Runc
    };
    let (id, bytes) = match rest.iter().position(|&b| b == b'\n') {
        Some(n) => (String::from_utf8_lossy(&rest[..n]), &rest[n + 1..]),
        None => ("c1".into(), rest),
    };
    if let Ok(s) = parse_state(&runtime, &id, bytes) {
        assert_ne!(s.pid, 0);
        assert_eq!(s.id, id);
    }
    if let Ok(pid) = parse_pid(bytes) {
        assert_ne!(pid, 0);
    }
});
