//! Compiles the vendored CRI API (kubernetes/cri-api's
//! `pkg/apis/runtime/v1/api.proto`) with protox (pure Rust: no protoc
//! needed) and generates its tonic client, for `lookout_testsupport::cri`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/api.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
