//! What a consumer sends to the agent's gRPC socket, as the layer below h2
//! reads it (`lookout_api::unix::AuthorityFix`): HTTP/2 frames, HPACK
//! header blocks decoded with the client's table and re-encoded. Any peer
//! that may open the socket controls these bytes. The first byte chooses
//! where the input is cut: the layer must give the same output and the
//! same verdict however its reads split the stream.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((&cut, rest)) = data.split_first() {
        lookout_api::unix::fuzz(rest, usize::from(cut));
    }
});
