//! lookout's consumer API (`lookout.v1`), generated from
//! `proto/lookout/v1/lookout.proto`.
#![allow(missing_docs)]

/// The `lookout.v1` package.
#[allow(clippy::large_enum_variant)]
pub mod v1 {
    tonic::include_proto!("lookout.v1");
}
