//! The payloads the study measures, built by the programs' own encoders: requests by
//! the driver's [`Workload::encode`] through [`CallCodec`], replies by the provider's
//! built-in handlers (looked up in [`Registry::builtin`]) and
//! [`CallCodec::put_ok_response`], exactly as a session does; and a synthetic reply of
//! 30 distinct entries for a payload that compresses well.

use bytes::{Bytes, BytesMut};
use prost::Message;
use rpcmesh_driver::WorkloadKind;
use rpcmesh_driver::workload::Workload;
use rpcmesh_provider::service::{Lookup, Outcome, Registry};
use rpcmesh_wire::body::{Request, Response};
use rpcmesh_wire::compress::{CompressionConfig, DEFAULT_MAX_INFLATED_LEN};
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{Flags, Frame, HEADER_LEN, TRAILER_LEN};
use rpcmesh_wire::proto::rpc::RpcRequest;

/// One message as it travels.
pub(crate) struct Payload {
    pub(crate) name: &'static str,
    /// The application message (protobuf), as the handler or the workload encodes it.
    pub(crate) app: Bytes,
    /// The `rpc.RpcRequest` / `rpc.RpcResponse` envelope: what the compressor is given.
    pub(crate) envelope: Bytes,
    /// The whole plain frame.
    pub(crate) frame_plain: usize,
    /// The whole frame as `CallCodec` writes it with the default compression config.
    pub(crate) frame_default: usize,
    /// Whether it went out compressed with the default config.
    pub(crate) compressed_by_default: bool,
    /// Frame bytes by part: header, names/status, payload length field, CRC.
    pub(crate) parts: FrameParts,
}

impl Payload {
    /// `name`'s message `app` in `envelope`, as the frames `plain` and `default` (written
    /// with the default compression config) carry it; `prefix` bytes (names, or the status)
    /// come before the payload's length field.
    fn new(
        name: &'static str,
        app: Bytes,
        envelope: Bytes,
        (plain, default): (&Frame, &Frame),
        prefix: usize,
    ) -> Payload {
        Payload {
            name,
            app,
            envelope,
            frame_plain: HEADER_LEN + plain.body.len() + TRAILER_LEN,
            frame_default: HEADER_LEN + default.body.len() + TRAILER_LEN,
            compressed_by_default: default.header.flags.contains(Flags::COMPRESSED),
            parts: FrameParts {
                header: HEADER_LEN,
                prefix,
                len_field: 4,
                crc: TRAILER_LEN,
            },
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct FrameParts {
    pub(crate) header: usize,
    pub(crate) prefix: usize,
    pub(crate) len_field: usize,
    pub(crate) crc: usize,
}

/// Flags the driver sets when compression is on (worker.rs): extended statuses and
/// compressed replies accepted.
pub(crate) fn call_flags() -> Flags {
    Flags::EXT_STATUS | Flags::ACCEPT_COMPRESSED
}

/// The request and the provider's reply of one workload, as the driver and the provider
/// encode them.
pub(crate) fn call_payloads(
    req_name: &'static str,
    reply_name: &'static str,
    kind: WorkloadKind,
    size: usize,
) -> [Payload; 2] {
    let workload = Workload::new(kind, size);
    let (service, method) = workload.target();

    // Request: the driver's encoder, plain and with the default compression.
    let mut plain = CallCodec::new(None, DEFAULT_MAX_INFLATED_LEN);
    let mut zdef = CallCodec::new(Some(CompressionConfig::default()), DEFAULT_MAX_INFLATED_LEN);
    let mut b = BytesMut::new();
    workload
        .encode(&mut plain, &mut b, 1, call_flags(), &[])
        .expect("request encodes");
    let req_frame = Frame::from_bytes(b.split().freeze()).expect("request frame parses");
    workload
        .encode(&mut zdef, &mut b, 1, call_flags(), &[])
        .expect("request encodes");
    let req_default = Frame::from_bytes(b.split().freeze()).expect("request frame parses");
    let req = Request::parse(&req_frame.body).expect("request body parses");
    let rpc = RpcRequest::decode(req.payload.clone()).expect("envelope decodes");
    // Each name goes with its 2-byte length.
    let names = 2 + service.len() + 2 + method.len();
    let request = Payload::new(
        req_name,
        rpc.payload.clone(),
        req.payload.clone(),
        (&req_frame, &req_default),
        names,
    );

    // Reply: the provider's own handler, then the session's response encoder.
    let registry = Registry::builtin();
    let Lookup::Found(handler, _) = registry.lookup(service.as_bytes(), method.as_bytes()) else {
        panic!("{service}.{method} is not a built-in method");
    };
    let mut answer = BytesMut::new();
    match handler.call(rpc, &mut answer) {
        Outcome::Ready(Ok(())) => {}
        other => panic!("the handler did not answer inline: {other:?}"),
    }
    assert!(
        workload.check(&answer).is_ok(),
        "the reply is the expected one"
    );
    let reply = reply_payload(reply_name, answer.freeze());
    [request, reply]
}

/// A successful reply carrying `answer`, as the provider's session writes it.
pub(crate) fn reply_payload(name: &'static str, answer: Bytes) -> Payload {
    let mut plain = CallCodec::new(None, DEFAULT_MAX_INFLATED_LEN);
    let mut zdef = CallCodec::new(Some(CompressionConfig::default()), DEFAULT_MAX_INFLATED_LEN);
    let mut b = BytesMut::new();
    plain
        .put_ok_response(&mut b, 1, call_flags(), &answer)
        .expect("reply encodes");
    let resp_frame = Frame::from_bytes(b.split().freeze()).expect("reply frame parses");
    zdef.put_ok_response(&mut b, 1, call_flags(), &answer)
        .expect("reply encodes");
    let resp_default = Frame::from_bytes(b.split().freeze()).expect("reply frame parses");
    let resp = Response::parse(&resp_frame.body).expect("reply body parses");
    // Before the payload: the status byte.
    let (envelope, frames) = (resp.payload.clone(), (&resp_frame, &resp_default));
    Payload::new(name, answer, envelope, frames, 1)
}

/// Not a workload of the driver: a platform answer of 30 distinct entries (ids, names,
/// company ids and dates all differ), to see a bigger protobuf message with realistic
/// redundancy (field tags and common prefixes, no verbatim repeats).
pub(crate) fn synthetic_answer() -> Bytes {
    use rpcmesh_wire::proto::platform::{NodeInfo, QueryResponse};
    let nodes = (0..30u32)
        .map(|i| NodeInfo {
            node_id: 100_001 + i64::from(i) * 37,
            node_name: format!("機構{}", 100_001 + i * 37),
            company_id: format!("{}", 1200 + (i * 7919) % 1000),
            create_date: format!("2016{:02}{:02}", 1 + i % 12, 1 + (i * 11) % 28),
        })
        .collect();
    QueryResponse { nodes }.encode_to_vec().into()
}
