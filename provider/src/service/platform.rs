//! `PlatformService.doQuery`: the reference capacity workload (`shared/workloads.md` §1).
//! Decodes the query and answers the fixed two-entry list, as the reference handler did:
//! no database, no I/O.

use bytes::BytesMut;
use prost::Message;
use rpcmesh_common::proto::platform::{NodeInfo, QueryRequest, QueryResponse};
use rpcmesh_common::proto::rpc::RpcRequest;

use super::{ServiceError, decode};

/// Service name.
pub const SERVICE: &str = "PlatformService";
/// Method name.
pub const METHOD: &str = "doQuery";

/// The answer of the reference workload: two identical entries.
pub fn fixed_response() -> QueryResponse {
    let node = NodeInfo {
        node_id: 100_001,
        node_name: "機構100001".to_string(),
        company_id: "1200".to_string(),
        create_date: "20160101".to_string(),
    };
    QueryResponse {
        nodes: vec![node.clone(), node],
    }
}

/// The handler. Builds the response anew for every call, as the reference did.
pub fn do_query(request: RpcRequest, out: &mut BytesMut) -> Result<(), ServiceError> {
    let _query: QueryRequest = decode(request.payload, "platform.QueryRequest")?;
    fixed_response()
        .encode(out)
        .map_err(|e| ServiceError::Failed(e.to_string()))
}
