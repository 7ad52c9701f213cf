//! `EchoService.Echo`: answers an `EchoResponse` carrying the request's message (RPCF v1
//! semantics).

use bytes::BytesMut;
use prost::Message;
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse, RpcRequest};

use super::{ServiceError, decode};

/// Service name.
pub const SERVICE: &str = "EchoService";
/// Method name.
pub const METHOD: &str = "Echo";

/// The handler.
pub fn echo(request: RpcRequest, out: &mut BytesMut) -> Result<(), ServiceError> {
    let req: EchoRequest = decode(request.payload, "rpc.EchoRequest")?;
    let resp = EchoResponse {
        message: req.message,
    };
    resp.encode(out)
        .map_err(|e| ServiceError::Failed(e.to_string()))
}
