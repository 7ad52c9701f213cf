//! `PlatformService.doQuery`: the reference capacity workload (`shared/workloads.md` §1).
//! Decodes the query and answers the fixed two-entry list, as the reference handler did:
//! no database, no I/O.

use bytes::BytesMut;
use prost::Message;
use rpcmesh_common::proto::platform::{QueryRequest, QueryResponse, reference_answer};
use rpcmesh_common::proto::rpc::RpcRequest;

use super::{ServiceError, decode};

/// Service name.
pub const SERVICE: &str = "PlatformService";
/// Method name.
pub const METHOD: &str = "doQuery";

/// The answer of the reference workload: two identical entries.
pub fn fixed_response() -> QueryResponse {
    reference_answer()
}

/// The handler. Builds the response anew for every call, as the reference did.
pub fn do_query(request: RpcRequest, out: &mut BytesMut) -> Result<(), ServiceError> {
    let _query: QueryRequest = decode(request.payload, "platform.QueryRequest")?;
    fixed_response()
        .encode(out)
        .map_err(|e| ServiceError::Failed(e.to_string()))
}
