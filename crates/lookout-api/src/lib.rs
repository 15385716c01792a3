//! lookout's consumer API (`lookout.v1`), generated from
//! `proto/lookout/v1/lookout.proto`.
//!
//! With the `unix-server` feature, [`unix::AuthorityFix`] lets a tonic
//! server on a Unix socket accept the `:authority` that Python (grpc
//! C-core) and Java clients send there, which h2 alone refuses.
#![allow(missing_docs)]

/// The `lookout.v1` package.
#[allow(clippy::large_enum_variant)]
pub mod v1 {
    tonic::include_proto!("lookout.v1");
}

/// The encoded `google.protobuf.FileDescriptorSet` of `lookout.v1` (with
/// source info), for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/lookout.v1.bin"));

#[cfg(feature = "unix-server")]
pub mod unix;
