//! Records from the BPF ring buffers, and the pinned container maps'
//! entries. The programs write the records, but their contents (filename,
//! argv) are a process's own bytes; an entry may be another agent's (a
//! later layout): a decoder must survive any bytes of any length.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lookout_ebpf_common::{ContainerEntry, ExecEvent, ProbeEvent};
use lookout_runtime_hook::ExecRecord;

fuzz_target!(|data: &[u8]| {
    let _ = ProbeEvent::from_bytes(data);
    if let Some(e) = ContainerEntry::from_bytes(data) {
        // Whatever id_len says, the id is within its 64 bytes, and the
        // entry encodes back to the bytes it came from.
        assert!(e.id().len() <= lookout_ebpf_common::CONTAINER_ID_LEN);
        assert_eq!(&e.to_bytes()[..], &data[..ContainerEntry::SIZE]);
    }
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
