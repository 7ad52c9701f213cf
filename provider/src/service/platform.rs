//! `PlatformService.doQuery`: the reference capacity workload, the "platform query" of the
//! published broker capacity report. Decodes the query and answers the fixed two-entry
//! list, as the reference handler does: no database, no I/O.

use bytes::BytesMut;
use prost::Message;
use rpcmesh_wire::proto::platform::{QueryRequest, reference_answer};
use rpcmesh_wire::proto::rpc::RpcRequest;

use super::{ServiceError, decode};

/// Service name.
pub const SERVICE: &str = "PlatformService";
/// Method name.
pub const METHOD: &str = "doQuery";

/// The handler. Builds the response anew for every call, as the reference handler does.
pub fn do_query(request: RpcRequest, out: &mut BytesMut) -> Result<(), ServiceError> {
    let _query: QueryRequest = decode(request.payload, "platform.QueryRequest")?;
    // The answer of the reference workload: two identical entries.
    reference_answer()
        .encode(out)
        .map_err(|e| ServiceError::Failed(e.to_string()))
}
