//! Compiles the vendored NRI protocol (proto/nri/api.proto, containerd/nri
//! v0.6.1) into prost messages with protox (pure Rust: no protoc needed).
//! The ttRPC envelope messages are few and written by hand in src/ttrpc.rs.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/nri/api.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
