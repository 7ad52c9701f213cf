//! Protobuf messages generated at build time from `common/proto/*.proto` (by `prost` with
//! the pure-Rust `protox` compiler; no system `protoc`). `bytes` fields are `bytes::Bytes`.

#![allow(missing_docs, clippy::all)]

/// Envelope and echo messages of RPCF v1 (package `rpc`).
pub mod rpc {
    include!(concat!(env!("OUT_DIR"), "/rpc.rs"));
}

/// The reference capacity workload's messages (package `platform`).
pub mod platform {
    include!(concat!(env!("OUT_DIR"), "/platform.rs"));
}
