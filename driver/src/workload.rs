//! The calls the driver's users make: the reference "platform query" and echo of a given
//! size. Builds each request message once and encodes it for every call (as a real client
//! would), and checks each reply's application message.

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use prost::Message;
use rpcmesh_wire::envelope::{CallCodec, PayloadSize};
use rpcmesh_wire::frame::{Flags, FrameError};
use rpcmesh_wire::proto::platform::{QueryRequest, QueryResponse};
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};

use crate::config::WorkloadKind;

use rpcmesh_wire::proto::platform::reference_query;

/// Why a reply's application message was not the expected one.
#[derive(Debug, thiserror::Error)]
pub enum BadReply {
    /// It did not decode.
    #[error("reply does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// It decoded to something else than the service answers.
    #[error("unexpected reply: not the answer the service gives")]
    Content,
}

/// A workload, ready to encode calls.
#[derive(Debug, Clone)]
pub struct Workload {
    kind: WorkloadKind,
    echo: EchoRequest,
    query: QueryRequest,
    metadata: HashMap<String, String>,
    /// The reply's application message, encoded.
    expected: Bytes,
}

impl Workload {
    /// Builds the request message once.
    pub fn new(kind: WorkloadKind, payload_size: usize) -> Self {
        let message = "x".repeat(payload_size);
        let expected = match kind {
            WorkloadKind::Platform => {
                rpcmesh_wire::proto::platform::reference_answer().encode_to_vec()
            }
            WorkloadKind::Echo => EchoResponse {
                message: message.clone(),
            }
            .encode_to_vec(),
        };
        Workload {
            kind,
            echo: EchoRequest { message },
            query: reference_query(),
            metadata: HashMap::new(),
            expected: expected.into(),
        }
    }

    /// `(service, method)` called.
    pub fn target(&self) -> (&'static str, &'static str) {
        match self.kind {
            WorkloadKind::Platform => ("PlatformService", "doQuery"),
            WorkloadKind::Echo => ("EchoService", "Echo"),
        }
    }

    /// Appends one call's request frame, behind the extension block `block` when it is
    /// not empty (`rpcmesh_wire::ext`).
    pub fn encode(
        &self,
        codec: &mut CallCodec,
        dst: &mut BytesMut,
        req_id: u64,
        flags: Flags,
        block: &[u8],
    ) -> Result<PayloadSize, FrameError> {
        let (s, m) = self.target();
        match self.kind {
            WorkloadKind::Platform => codec.put_request_after(
                dst,
                req_id,
                flags,
                block,
                s.as_bytes(),
                m.as_bytes(),
                &self.query,
                &self.metadata,
            ),
            WorkloadKind::Echo => codec.put_request_after(
                dst,
                req_id,
                flags,
                block,
                s.as_bytes(),
                m.as_bytes(),
                &self.echo,
                &self.metadata,
            ),
        }
    }

    /// Checks a successful reply's application message: it must be exactly what the
    /// service answers (echo: the message sent; platform: the fixed two-entry list). A byte
    /// comparison, so checking costs no decoding and no allocation.
    pub fn check(&self, payload: &[u8]) -> Result<(), BadReply> {
        if payload == &self.expected[..] {
            return Ok(());
        }
        // Tell a reply that does not decode from one that decodes to something else.
        match self.kind {
            WorkloadKind::Platform => {
                QueryResponse::decode(payload)?;
            }
            WorkloadKind::Echo => {
                EchoResponse::decode(payload)?;
            }
        }
        Err(BadReply::Content)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpcmesh_wire::frame::Frame;

    #[test]
    fn requests_decode_as_the_service_expects() {
        for kind in [WorkloadKind::Platform, WorkloadKind::Echo] {
            let w = Workload::new(kind, 32);
            let mut codec = CallCodec::new(None, 1 << 20);
            let mut b = BytesMut::new();
            w.encode(&mut codec, &mut b, 9, Flags::NONE, &[]).unwrap();
            let f = Frame::from_bytes(b.freeze()).unwrap();
            let call = codec.decode_request(&f).unwrap();
            assert_eq!(call.request.service_name(), w.target().0);
            match kind {
                WorkloadKind::Platform => assert_eq!(
                    QueryRequest::decode(call.rpc.payload).unwrap(),
                    reference_query()
                ),
                WorkloadKind::Echo => assert_eq!(
                    EchoRequest::decode(call.rpc.payload).unwrap().message.len(),
                    32
                ),
            }
        }
    }

    #[test]
    fn replies_are_checked() {
        let w = Workload::new(WorkloadKind::Platform, 0);
        let good = rpcmesh_wire::proto::platform::reference_answer().encode_to_vec();
        assert!(w.check(&good).is_ok());
        assert!(w.check(&QueryResponse::default().encode_to_vec()).is_err());
        assert!(matches!(w.check(&[0xff, 0xff]), Err(BadReply::Decode(_))));
        let e = Workload::new(WorkloadKind::Echo, 5);
        let reply = EchoResponse {
            message: "xxxxx".into(),
        }
        .encode_to_vec();
        assert!(e.check(&reply).is_ok());
        let other = EchoResponse {
            message: "xxxxy".into(),
        }
        .encode_to_vec();
        assert!(matches!(e.check(&other), Err(BadReply::Content)));
    }
}
