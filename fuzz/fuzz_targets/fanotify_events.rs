//! The fanotify event parser (metadata, info records: FID, DFID_NAME,
//! PIDFD, unknown ones). The kernel writes the buffer, but a parser that
//! trusts lengths can be walked off the end, or lose a permission event's
//! fd. Runs the parser without adopting any fd (`cfg(fuzzing)` only).
#![no_main]

use libfuzzer_sys::fuzz_target;

const METADATA_LEN: usize = 24;

fuzz_target!(|data: &[u8]| {
    let (fds, ok) = lookout_fanotify::fuzzing::parse(data);
    // Walk the headers as the kernel lays them out: the parser must have
    // seen the fd of every event it could reach, in order.
    let mut off = 0;
    let mut expected = Vec::new();
    while data.len() - off >= METADATA_LEN {
        let rest = &data[off..];
        let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        expected.push(i32::from_ne_bytes([rest[16], rest[17], rest[18], rest[19]]));
        if len < METADATA_LEN || len > rest.len() {
            break;
        }
        off += len;
    }
    assert_eq!(fds, expected, "fds seen, in order");
    if ok {
        assert_eq!(off, data.len(), "accepted buffers are whole events");
    }
});
