//! Records from the BPF ring buffers. The programs write them, but their
//! contents (filename, argv) are a process's own bytes, and a decoder
//! must survive a record of any length.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lookout_ebpf_common::{ExecEvent, ProbeEvent};
use lookout_runtime_hook::ExecRecord;

fuzz_target!(|data: &[u8]| {
    let _ = ProbeEvent::from_bytes(data);
    let _ = ExecRecord::from_bytes(data);
    // Most inputs are shorter than a record: lay them over a full-size one
    // so that every field, the argv lengths included, is reached.
    let mut rec = vec![0u8; ExecEvent::SIZE];
    let n = data.len().min(rec.len());
    rec[..n].copy_from_slice(&data[..n]);
    if let Some(r) = ExecRecord::from_bytes(&rec) {
        assert!(r.argv.iter().map(|a| a.len() + 1).sum::<usize>() <= 3 * ExecEvent::SIZE);
    }
});
