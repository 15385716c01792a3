//! Compiles proto/lookout/v1/lookout.proto with protox (pure Rust: no
//! protoc needed), generates the tonic client and server, and writes the
//! encoded descriptor set that server reflection serves.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    use prost::Message;
    let proto = "proto/lookout/v1/lookout.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("lookout.v1.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
