//! Compiles proto/lookout/v1/lookout.proto with protox (pure Rust: no
//! protoc needed) and generates the tonic client and server.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/lookout/v1/lookout.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
