//! The BTF reader that finds `task_struct.exit_code` in
//! /sys/kernel/btf/vmlinux: offsets and lengths in the blob must never
//! send it out of bounds. Input: a BTF blob.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lookout_runtime_hook::btf::member_offset;

fuzz_target!(|blob: &[u8]| {
    for (strukt, member) in [
        ("task_struct", "exit_code"),
        ("task_struct", "pid"),
        ("task_struct", ""),
        ("", ""),
    ] {
        let _ = member_offset(blob, strukt, member);
    }
});
