//! What the NRI plugin reads from the runtime's socket: the multiplexer's
//! frames, ttRPC messages split across them, requests, and the NRI payloads
//! mapped into lookout-nri's pods and containers. Any process that can
//! reach the socket's directory could speak to a plugin that connects to
//! the wrong socket; the runtime itself may send what a newer NRI defines.
//! Lengths are checked before allocation (`cfg(fuzzing)` only).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lookout_nri::fuzzing::feed(data);
});
