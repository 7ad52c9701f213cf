//! Protobuf messages generated at build time from `common/wire/proto/*.proto` (by `prost` with
//! the pure-Rust `protox` compiler; no system `protoc`). `bytes` fields are `bytes::Bytes`.

#![allow(missing_docs, clippy::all)]

/// Envelope and echo messages of RPCF v1 (package `rpc`).
pub mod rpc {
    include!(concat!(env!("OUT_DIR"), "/rpc.rs"));
}

/// The reference capacity workload's messages (package `platform`), and its request and
/// answer: the "platform query" of the published broker capacity report, whose figures
/// rpcmesh is compared with.
pub mod platform {
    include!(concat!(env!("OUT_DIR"), "/platform.rs"));

    /// The reference workload's request.
    pub fn reference_query() -> QueryRequest {
        QueryRequest {
            system_id: "PL".into(),
            app_version: "qq.qq.qq".into(),
            company_id: "12".into(),
            source_ip: "DESKTOP-NDOHT79".into(),
            dest_ip: "DESKTOP-NDOHT79".into(),
            spider_opts: ::std::collections::HashMap::new(),
            company_name: "機構1".into(),
            create_date: "20160101".into(),
            company_type: 1,
        }
    }

    /// The reference workload's answer: a list of two identical entries.
    pub fn reference_answer() -> QueryResponse {
        let node = NodeInfo {
            node_id: 100_001,
            node_name: "機構100001".into(),
            company_id: "1200".into(),
            create_date: "20160101".into(),
        };
        QueryResponse {
            nodes: vec![node.clone(), node],
        }
    }
}
