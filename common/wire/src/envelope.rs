//! Calls as the two ends see them: an application message wrapped in `rpc.RpcRequest`,
//! optionally zlib-compressed, in a request frame; and `rpc.RpcResponse` with a status in a
//! response frame. The provider, the driver and the test client encode and decode calls
//! here; the broker, which never decodes a payload it forwards, uses only
//! [`put_error_response`] and [`service_not_found`], for the replies it makes itself.
//!
//! Owns the protobuf envelope and the compression decision. Frame and body layout are
//! [`crate::frame`]'s and [`crate::body`]'s; the zlib mechanics are [`crate::compress`]'s;
//! timing compression into metrics is the caller's, through [`CompressionObserver`].
//!
//! Encoding writes straight into the connection's write buffer: the envelope's fields are
//! written by hand (they are two or three tags) around the inner message, so a plain call
//! costs no allocation. A compressed one goes through a reused scratch buffer.

use std::collections::HashMap;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};

use crate::body::{Request, Response, payload_range};
use crate::compress::{CompressError, CompressionConfig, Compressor, Inflater};
use crate::frame::{Flags, Frame, FrameError, FrameWriter, MsgType};
use crate::peer::PeerKind;
use crate::proto::rpc::{RpcRequest, RpcResponse};
use crate::status::Status;

/// Why a call's payload could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The body's framing was wrong.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The payload was flagged compressed but did not inflate.
    #[error("{0}")]
    Inflate(#[from] CompressError),
    /// The payload is not the expected protobuf message.
    #[error("payload does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// A response with a status byte no version defines.
    #[error("unknown status byte {0}")]
    UnknownStatus(u8),
    /// The request envelope's metadata is over the limit (checked before it is decoded).
    #[error("request metadata over the limit of {limit} bytes")]
    MetadataTooLarge {
        /// The limit, bytes of metadata entries as encoded.
        limit: usize,
    },
    /// The frame is not of the expected type.
    #[error("expected a {expected:?} frame, got {got:?}")]
    WrongType {
        /// What the caller expected.
        expected: MsgType,
        /// What arrived.
        got: MsgType,
    },
}

/// Most bytes of metadata a request envelope may carry unless told otherwise: 8 KiB, gRPC's
/// default for its metadata. Decoding a map costs an allocation and a hash per entry, so
/// without a limit one 1.9 MB compressed request of 873,796 entries costs a provider
/// 0.6-0.8 s of CPU; the limit is checked on the encoded bytes, before any of that is paid.
pub const DEFAULT_MAX_METADATA_BYTES: usize = 8 * 1024;

/// The field number of `RpcRequest.metadata` (rpc.proto).
const METADATA_FIELD: u64 = 2;

/// Walks the top-level fields of an encoded `RpcRequest` and fails as soon as its metadata
/// entries (tags, lengths and contents) pass `limit` bytes. Malformed input is left to the
/// decoder, which says what is wrong with it.
fn metadata_within(mut buf: &[u8], limit: usize) -> Result<(), CallError> {
    use prost::encoding::decode_varint;
    let mut used = 0usize;
    while !buf.is_empty() {
        let before = buf.len();
        let Ok(key) = decode_varint(&mut buf) else {
            return Ok(());
        };
        let skip = match key & 7 {
            0 => match decode_varint(&mut buf) {
                Ok(_) => 0,
                Err(_) => return Ok(()),
            },
            1 => 8,
            2 => match decode_varint(&mut buf) {
                Ok(n) => usize::try_from(n).unwrap_or(usize::MAX),
                Err(_) => return Ok(()),
            },
            5 => 4,
            _ => return Ok(()),
        };
        if skip > buf.len() {
            return Ok(());
        }
        buf = &buf[skip..];
        if key >> 3 == METADATA_FIELD {
            used += before - buf.len();
            if used > limit {
                return Err(CallError::MetadataTooLarge { limit });
            }
        }
    }
    Ok(())
}

/// Payload sizes of one encoded or decoded message: before compression and on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PayloadSize {
    /// Bytes of the protobuf envelope before compression.
    pub plain: usize,
    /// Bytes of the payload as framed (equal to `plain` unless compressed).
    pub wire: usize,
}

/// A decoded request.
#[derive(Debug)]
pub struct IncomingCall {
    /// Names and raw payload.
    pub request: Request,
    /// The decoded envelope; `payload` holds the application message.
    pub rpc: RpcRequest,
    /// Payload sizes.
    pub size: PayloadSize,
}

/// A decoded response.
#[derive(Debug)]
pub struct IncomingReply {
    /// The status as sent.
    pub status: Status,
    /// The decoded envelope.
    pub rpc: RpcResponse,
    /// Payload sizes.
    pub size: PayloadSize,
}

/// Told how long each compression and inflation took (the metrics layer records them as
/// `rpcmesh_compression_seconds`). Called only for payloads that are compressed or
/// inflated, so the cost of a call through it is nothing beside zlib's.
pub trait CompressionObserver: Send + Sync + std::fmt::Debug {
    /// One payload was compressed (or tried: it may have come out longer and been sent
    /// plain) in `took`.
    fn compressed(&self, took: std::time::Duration);
    /// One payload was inflated (or tried) in `took`.
    fn inflated(&self, took: std::time::Duration);
}

/// A response read in place: the envelope's fields borrow the frame (or the inflated
/// copy), so reading it costs no allocation and no reference count. What a load
/// generator needs for every reply.
#[derive(Debug)]
pub struct ReplyView<'a> {
    /// The status as sent.
    pub status: Status,
    /// `RpcResponse.success`.
    pub success: bool,
    /// `RpcResponse.payload`: the application message.
    pub payload: &'a [u8],
    /// `RpcResponse.error_msg` as sent (UTF-8 by the protocol, unchecked here): what a
    /// failure says, empty for a success.
    pub error_msg: &'a [u8],
    /// Payload sizes.
    pub size: PayloadSize,
}

/// Per-connection encoding state: the reused zlib state and scratch buffers.
#[derive(Debug)]
pub struct CallCodec {
    /// Most bytes of metadata entries a request envelope may carry.
    max_metadata: usize,
    compressor: Option<Compressor>,
    inflater: Inflater,
    scratch: BytesMut,
    timers: Option<std::sync::Arc<dyn CompressionObserver>>,
    /// Largest frame body this side writes: a bigger one is refused here, since the peer
    /// would refuse it.
    max_body: u32,
}

impl CallCodec {
    /// `compression`: `None` never compresses (but still inflates what arrives flagged).
    /// `max_inflated`: limit on an inflated payload.
    pub fn new(compression: Option<CompressionConfig>, max_inflated: usize) -> Self {
        CallCodec {
            max_metadata: DEFAULT_MAX_METADATA_BYTES,
            compressor: compression.map(Compressor::new),
            inflater: Inflater::new(max_inflated),
            scratch: BytesMut::new(),
            timers: None,
            max_body: u32::MAX,
        }
    }

    /// Refuses request envelopes whose metadata entries take more than `max` bytes (as
    /// encoded) with [`CallError::MetadataTooLarge`], before decoding them.
    pub fn with_max_metadata(mut self, max: usize) -> Self {
        self.max_metadata = max;
        self
    }

    /// Refuses to write a frame whose body exceeds `max` (the peer's frame limit) with
    /// [`FrameError::TooLarge`], leaving `dst` as it was.
    pub fn with_max_body(mut self, max: u32) -> Self {
        self.max_body = max;
        self
    }

    /// Tells `timers` how long every compression and inflation took.
    pub fn timed(mut self, timers: std::sync::Arc<dyn CompressionObserver>) -> Self {
        self.timers = Some(timers);
        self
    }

    /// True when this side compresses.
    pub fn compresses(&self) -> bool {
        self.compressor.is_some()
    }

    /// Appends a request frame whose `RpcRequest.payload` is `inner`. Sets
    /// [`Flags::COMPRESSED`] when compression is on and pays; `flags` adds the caller's
    /// other extension bits (e.g. `ACCEPT_COMPRESSED | EXT_STATUS`, or none for plain v1).
    #[allow(clippy::too_many_arguments)]
    pub fn put_request<M: Message>(
        &mut self,
        dst: &mut BytesMut,
        req_id: u64,
        flags: Flags,
        service: &[u8],
        method: &[u8],
        inner: &M,
        metadata: &HashMap<String, String>,
    ) -> Result<PayloadSize, FrameError> {
        self.put_request_after(dst, req_id, flags, &[], service, method, inner, metadata)
    }

    /// As [`CallCodec::put_request`], behind the extension block `block` (`crate::ext`;
    /// empty: a plain request).
    #[allow(clippy::too_many_arguments)]
    pub fn put_request_after<M: Message>(
        &mut self,
        dst: &mut BytesMut,
        req_id: u64,
        flags: Flags,
        block: &[u8],
        service: &[u8],
        method: &[u8],
        inner: &M,
        metadata: &HashMap<String, String>,
    ) -> Result<PayloadSize, FrameError> {
        self.put_request_with(dst, req_id, flags, block, service, method, |b| {
            put_rpc_request(b, inner.encoded_len(), |b| inner.encode_raw(b), metadata)
        })
    }

    /// As [`CallCodec::put_request`], with the application message already encoded.
    #[allow(clippy::too_many_arguments)]
    pub fn put_request_raw(
        &mut self,
        dst: &mut BytesMut,
        req_id: u64,
        flags: Flags,
        service: &[u8],
        method: &[u8],
        inner: &[u8],
        metadata: &HashMap<String, String>,
    ) -> Result<PayloadSize, FrameError> {
        self.put_request_with(dst, req_id, flags, &[], service, method, |b| {
            put_rpc_request(b, inner.len(), |b| b.extend_from_slice(inner), metadata)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn put_request_with(
        &mut self,
        dst: &mut BytesMut,
        req_id: u64,
        flags: Flags,
        block: &[u8],
        service: &[u8],
        method: &[u8],
        encode: impl FnOnce(&mut BytesMut),
    ) -> Result<PayloadSize, FrameError> {
        let flags = flags.without(Flags::COMPRESSED);
        let w = FrameWriter::begin_request_after(dst, flags, req_id, block, service, method)?;
        let size = self.put_payload(dst, &w, true, encode);
        w.finish_within(dst, self.max_body)?;
        Ok(size)
    }

    /// Appends a successful response frame whose `RpcResponse.payload` is `inner` (an
    /// already encoded application message). Compresses only when the request said
    /// [`Flags::ACCEPT_COMPRESSED`] and this side compresses.
    pub fn put_ok_response(
        &mut self,
        dst: &mut BytesMut,
        req_id: u64,
        request_flags: Flags,
        inner: &[u8],
    ) -> Result<PayloadSize, FrameError> {
        let w = FrameWriter::begin_response(dst, Flags::NONE, req_id, Status::Success as u8);
        let compress = request_flags.contains(Flags::ACCEPT_COMPRESSED);
        let size = self.put_payload(dst, &w, compress, |b| put_ok_envelope(b, inner));
        w.finish_within(dst, self.max_body)?;
        Ok(size)
    }

    /// Writes the payload made by `encode` straight into `dst` (in `frame`), then, when `compress` is
    /// allowed, this side compresses and the payload reaches the threshold, replaces it by
    /// its compressed form if that is shorter. Payloads under the threshold cost no copy and
    /// no timing.
    fn put_payload(
        &mut self,
        dst: &mut BytesMut,
        frame: &FrameWriter,
        compress: bool,
        encode: impl FnOnce(&mut BytesMut),
    ) -> PayloadSize {
        let at = dst.len();
        encode(dst);
        let plain = dst.len() - at;
        let Some(c) = self
            .compressor
            .as_mut()
            .filter(|c| compress && plain >= c.threshold())
        else {
            return PayloadSize { plain, wire: plain };
        };
        self.scratch.clear();
        self.scratch.extend_from_slice(&dst[at..]);
        dst.truncate(at);
        let started = self.timers.as_ref().map(|_| std::time::Instant::now());
        let compressed = c.compress_into(&self.scratch, dst);
        if let (Some(t), Some(s)) = (&self.timers, started) {
            t.compressed(s.elapsed());
        }
        if compressed {
            frame.add_flags(dst, Flags::COMPRESSED);
        } else {
            dst.extend_from_slice(&self.scratch);
        }
        PayloadSize {
            plain,
            wire: dst.len() - at,
        }
    }

    /// Decodes a request frame: names, then the envelope (inflated first if flagged).
    pub fn decode_request(&mut self, frame: &Frame) -> Result<IncomingCall, CallError> {
        expect_type(frame, MsgType::Request)?;
        let request = Request::parse(&frame.body)?;
        let (plain, wire) = self.plain_payload(frame.header.flags, &request.payload)?;
        let size = PayloadSize {
            plain: plain.len(),
            wire,
        };
        metadata_within(&plain, self.max_metadata)?;
        let rpc = RpcRequest::decode(plain)?;
        Ok(IncomingCall { request, rpc, size })
    }

    /// Decodes a response frame.
    pub fn decode_response(&mut self, frame: &Frame) -> Result<IncomingReply, CallError> {
        expect_type(frame, MsgType::Response)?;
        let response = Response::parse(&frame.body)?;
        let status =
            Status::from_wire(response.status).ok_or(CallError::UnknownStatus(response.status))?;
        let (plain, wire) = self.plain_payload(frame.header.flags, &response.payload)?;
        let size = PayloadSize {
            plain: plain.len(),
            wire,
        };
        let rpc = RpcResponse::decode(plain)?;
        Ok(IncomingReply { status, rpc, size })
    }

    /// Reads a response frame in place (see [`ReplyView`]).
    pub fn view_response<'a>(&'a mut self, frame: &'a Frame) -> Result<ReplyView<'a>, CallError> {
        expect_type(frame, MsgType::Response)?;
        let body = &frame.body[..];
        let bad = |reason| {
            CallError::Frame(FrameError::BadBody {
                what: "response",
                reason,
            })
        };
        let &raw = body.first().ok_or_else(|| bad("empty body"))?;
        let status = Status::from_wire(raw).ok_or(CallError::UnknownStatus(raw))?;
        let payload = &body[payload_range(body, 1, "response")?];
        let wire = payload.len();
        let envelope: &[u8] = if frame.header.flags.contains(Flags::COMPRESSED) {
            self.inflate_timed(payload)?;
            &self.scratch
        } else {
            payload
        };
        let (success, payload, error_msg) = read_response_envelope(envelope)?;
        Ok(ReplyView {
            status,
            success,
            payload,
            error_msg,
            size: PayloadSize {
                plain: envelope.len(),
                wire,
            },
        })
    }

    /// Inflates `payload` into the scratch buffer (emptied first), timed.
    fn inflate_timed(&mut self, payload: &[u8]) -> Result<(), CompressError> {
        self.scratch.clear();
        let started = self.timers.as_ref().map(|_| std::time::Instant::now());
        let inflated = self.inflater.inflate_into(payload, &mut self.scratch);
        if let (Some(t), Some(s)) = (&self.timers, started) {
            t.inflated(s.elapsed());
        }
        inflated
    }

    fn plain_payload(
        &mut self,
        flags: Flags,
        payload: &Bytes,
    ) -> Result<(Bytes, usize), CallError> {
        if flags.contains(Flags::COMPRESSED) {
            self.inflate_timed(payload)?;
            Ok((self.scratch.split().freeze(), payload.len()))
        } else {
            Ok((payload.clone(), payload.len()))
        }
    }
}

/// `RpcResponse { success, payload, error_msg }` read from its bytes without building it
/// (the other fields are skipped).
fn read_response_envelope(mut buf: &[u8]) -> Result<(bool, &[u8], &[u8]), CallError> {
    use prost::encoding::{DecodeContext, decode_key, decode_varint, skip_field};
    let (mut success, mut payload, mut error_msg): (bool, &[u8], &[u8]) = (false, &[], &[]);
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf)?;
        match (tag, wire_type) {
            (1, WireType::Varint) => success = decode_varint(&mut buf)? != 0,
            (2 | 3, WireType::LengthDelimited) => {
                let n = decode_varint(&mut buf)? as usize;
                if n > buf.len() {
                    return Err(CallError::Frame(FrameError::BadBody {
                        what: "response envelope",
                        reason: "a field overruns the envelope",
                    }));
                }
                let (field, rest) = buf.split_at(n);
                if tag == 2 {
                    payload = field;
                } else {
                    error_msg = field;
                }
                buf = rest;
            }
            _ => skip_field(wire_type, tag, &mut buf, DecodeContext::default())?,
        }
    }
    Ok((success, payload, error_msg))
}

fn expect_type(frame: &Frame, expected: MsgType) -> Result<(), CallError> {
    if frame.header.msg_type == expected {
        Ok(())
    } else {
        Err(CallError::WrongType {
            expected,
            got: frame.header.msg_type,
        })
    }
}

/// Writes `RpcRequest { payload: inner, metadata }` without building it; `inner_len`
/// bytes are written by `put_inner`.
fn put_rpc_request(
    dst: &mut BytesMut,
    inner_len: usize,
    put_inner: impl FnOnce(&mut BytesMut),
    metadata: &HashMap<String, String>,
) {
    if inner_len > 0 {
        dst.reserve(1 + encoded_len_varint(inner_len as u64) + inner_len);
        encode_key(1, WireType::LengthDelimited, dst);
        encode_varint(inner_len as u64, dst);
        put_inner(dst);
    }
    if !metadata.is_empty() {
        prost::encoding::hash_map::encode(
            prost::encoding::string::encode,
            prost::encoding::string::encoded_len,
            prost::encoding::string::encode,
            prost::encoding::string::encoded_len,
            2,
            metadata,
            dst,
        );
    }
}

/// Writes `RpcResponse { success: true, payload: inner }` without building it.
fn put_ok_envelope(dst: &mut BytesMut, inner: &[u8]) {
    dst.reserve(4 + encoded_len_varint(inner.len() as u64) + inner.len());
    encode_key(1, WireType::Varint, dst);
    dst.put_u8(1);
    if !inner.is_empty() {
        encode_key(2, WireType::LengthDelimited, dst);
        encode_varint(inner.len() as u64, dst);
        dst.extend_from_slice(inner);
    }
}

/// Appends a failure response made by this side (unknown service, overloaded, timeout...):
/// `RpcResponse { success: false, error_msg }`, never compressed. The status is degraded
/// to its v1 form unless the request carried [`Flags::EXT_STATUS`]; the message starts
/// with the status name either way.
pub fn put_error_response(
    dst: &mut BytesMut,
    req_id: u64,
    request_flags: Flags,
    status: Status,
    message: &str,
) {
    put_error(dst, req_id, request_flags, status, Flags::NONE, message);
}

/// Appends the refusal of a call this side did not start because it is draining:
/// "unavailable: `message`", with [`Flags::NOT_RUN`] for a caller that takes extended
/// statuses (it may send the call elsewhere); a v1 caller gets status 1 and no flag.
pub fn put_not_run_response(dst: &mut BytesMut, req_id: u64, request_flags: Flags, message: &str) {
    let flags = match PeerKind::of_caller(request_flags) {
        PeerKind::Rpcmesh => Flags::NOT_RUN,
        PeerKind::V1 => Flags::NONE,
    };
    put_error(
        dst,
        req_id,
        request_flags,
        Status::Unavailable,
        flags,
        message,
    );
}

fn put_error(
    dst: &mut BytesMut,
    req_id: u64,
    request_flags: Flags,
    status: Status,
    reply_flags: Flags,
    message: &str,
) {
    let wire = status.to_wire(PeerKind::of_caller(request_flags));
    let w = FrameWriter::begin_response(dst, reply_flags, req_id, wire);
    let prefix = status.message_prefix();
    let needs_prefix = !prefix.is_empty() && !message.starts_with(prefix);
    let len = message.len() + if needs_prefix { prefix.len() + 2 } else { 0 };
    encode_key(3, WireType::LengthDelimited, dst);
    encode_varint(len as u64, dst);
    if needs_prefix {
        dst.extend_from_slice(prefix.as_bytes());
        dst.extend_from_slice(b": ");
    }
    dst.extend_from_slice(message.as_bytes());
    // A message of a few bytes cannot overflow the 32-bit length fields.
    w.finish(dst).expect("error replies are far below 4 GiB");
}

/// The `error_msg` of a v1 "service not found" reply, as the reference framework words it.
pub fn service_not_found(service: &str) -> String {
    format!("service not found: {service}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::rpc::{EchoRequest, EchoResponse};

    fn frame(b: BytesMut) -> Frame {
        Frame::from_bytes(b.freeze()).unwrap()
    }

    #[test]
    fn a_not_run_refusal_is_flagged_only_for_callers_that_take_extended_statuses() {
        let mut b = BytesMut::new();
        put_not_run_response(&mut b, 7, Flags::EXT_STATUS, "provider shutting down");
        let f = frame(b);
        assert_eq!(f.header.flags, Flags::NOT_RUN);
        assert_eq!(f.body[0], Status::Unavailable as u8);
        let mut b = BytesMut::new();
        put_not_run_response(&mut b, 7, Flags::NONE, "provider shutting down");
        let f = frame(b);
        assert_eq!(
            f.header.flags,
            Flags::NONE,
            "a v1 caller gets a plain v1 frame"
        );
        assert_eq!(f.body[0], Status::Failed as u8);
        assert!(String::from_utf8_lossy(&f.body).contains("unavailable: provider shutting down"));
    }

    /// A request frame with `entries` metadata entries of about 18 bytes each.
    fn request_with_metadata(entries: usize) -> Frame {
        let mut codec = CallCodec::new(None, 1 << 20);
        let md: HashMap<String, String> = (0..entries)
            .map(|i| (format!("k{i}"), "v".repeat(10)))
            .collect();
        let mut b = BytesMut::new();
        let msg = EchoRequest {
            message: "hi".into(),
        };
        codec
            .put_request(&mut b, 1, Flags::NONE, b"EchoService", b"Echo", &msg, &md)
            .unwrap();
        frame(b)
    }

    #[test]
    fn metadata_over_its_limit_is_refused_before_it_is_decoded() {
        let mut codec = CallCodec::new(None, 1 << 20).with_max_metadata(1000);
        // About 18 bytes an entry: 50 fit in 1,000 bytes, 100 do not.
        let ok = codec.decode_request(&request_with_metadata(50));
        assert_eq!(ok.unwrap().rpc.metadata.len(), 50);
        let e = codec
            .decode_request(&request_with_metadata(100))
            .unwrap_err();
        assert!(
            matches!(e, CallError::MetadataTooLarge { limit: 1000 }),
            "{e}"
        );
        // The default takes what real callers send, and refuses a bomb.
        let mut codec = CallCodec::new(None, 1 << 20);
        assert!(codec.decode_request(&request_with_metadata(100)).is_ok());
        assert!(matches!(
            codec.decode_request(&request_with_metadata(100_000)),
            Err(CallError::MetadataTooLarge { .. })
        ));
    }

    #[test]
    fn malformed_envelopes_are_left_to_the_decoder() {
        for junk in [&[0x12, 0xff][..], &[0x12, 0x05, 0x01], &[0xff; 12], &[0x0b]] {
            assert!(metadata_within(junk, 8).is_ok(), "{junk:?}");
        }
    }

    #[test]
    fn plain_request_round_trips_and_matches_prost() {
        let mut codec = CallCodec::new(None, 1 << 20);
        let mut b = BytesMut::new();
        let msg = EchoRequest {
            message: "hello".into(),
        };
        let mut md = HashMap::new();
        md.insert("trace-id".to_string(), "abc123".to_string());
        codec
            .put_request(&mut b, 42, Flags::NONE, b"EchoService", b"Echo", &msg, &md)
            .unwrap();
        let f = frame(b);
        let call = codec.decode_request(&f).unwrap();
        let expect = RpcRequest {
            payload: msg.encode_to_vec().into(),
            metadata: md,
        };
        assert_eq!(call.rpc, expect);
        assert_eq!(call.request.payload, Bytes::from(expect.encode_to_vec()));
        assert_eq!(
            EchoRequest::decode(call.rpc.payload).unwrap().message,
            "hello"
        );
    }

    #[test]
    fn compressed_response_only_when_the_caller_accepts_it() {
        let mut codec = CallCodec::new(
            Some(CompressionConfig {
                threshold: 1,
                level: 6,
            }),
            1 << 20,
        );
        let inner = EchoResponse {
            message: "abcabcabcabcabcabcabcabcabcabcabcabcabcabc".into(),
        }
        .encode_to_vec();
        let mut b = BytesMut::new();
        let s = codec
            .put_ok_response(&mut b, 1, Flags::ACCEPT_COMPRESSED, &inner)
            .unwrap();
        assert!(s.wire < s.plain);
        let f = frame(b);
        assert!(f.header.flags.contains(Flags::COMPRESSED));
        let r = codec.decode_response(&f).unwrap();
        assert!(r.rpc.success);
        assert_eq!(&r.rpc.payload[..], &inner[..]);

        let mut b = BytesMut::new();
        codec
            .put_ok_response(&mut b, 1, Flags::NONE, &inner)
            .unwrap();
        assert!(frame(b).header.flags.is_empty());
    }

    #[test]
    fn a_frame_over_the_body_limit_is_refused_and_leaves_the_buffer_as_it_was() {
        let mut codec = CallCodec::new(None, 1 << 20).with_max_body(64);
        let mut b = BytesMut::from(&b"earlier frames"[..]);
        let e = codec
            .put_ok_response(&mut b, 5, Flags::NONE, &[7u8; 100])
            .unwrap_err();
        assert!(
            matches!(e, FrameError::TooLarge { max: 64, req_id: 5, body_len, .. } if body_len > 100),
            "{e:?}"
        );
        assert_eq!(&b[..], b"earlier frames");
        // Within the limit it is written as before.
        codec
            .put_ok_response(&mut b, 6, Flags::NONE, &[7u8; 8])
            .unwrap();
        assert_eq!(frame(b.split_off(14)).header.req_id, 6);
    }

    #[test]
    fn a_reply_read_in_place_matches_the_decoded_one() {
        let mut codec = CallCodec::new(
            Some(CompressionConfig {
                threshold: 1,
                level: 6,
            }),
            1 << 20,
        );
        let inner = EchoResponse {
            message: "in place in place in place".into(),
        }
        .encode_to_vec();
        for flags in [Flags::NONE, Flags::ACCEPT_COMPRESSED] {
            let mut b = BytesMut::new();
            codec.put_ok_response(&mut b, 9, flags, &inner).unwrap();
            let f = frame(b);
            let decoded = codec.decode_response(&f).unwrap();
            let view = codec.view_response(&f).unwrap();
            assert_eq!(view.status, decoded.status);
            assert_eq!(view.success, decoded.rpc.success);
            assert_eq!(view.payload, &decoded.rpc.payload[..]);
            assert_eq!(view.error_msg, decoded.rpc.error_msg.as_bytes());
            assert_eq!(view.size, decoded.size);
        }
        let mut b = BytesMut::new();
        put_error_response(&mut b, 3, Flags::EXT_STATUS, Status::Overloaded, "busy");
        let f = frame(b);
        let view = codec.view_response(&f).unwrap();
        assert_eq!(view.status, Status::Overloaded);
        assert!(!view.success);
        assert!(view.payload.is_empty());
        assert_eq!(view.error_msg, b"overloaded: busy", "what the failure says");
    }

    #[test]
    fn error_reply_degrades_for_v1_callers() {
        let mut codec = CallCodec::new(None, 1 << 20);
        let mut b = BytesMut::new();
        put_error_response(&mut b, 3, Flags::NONE, Status::Overloaded, "too many calls");
        let r = codec.decode_response(&frame(b)).unwrap();
        assert_eq!(r.status, Status::Failed);
        assert!(!r.rpc.success);
        assert_eq!(r.rpc.error_msg, "overloaded: too many calls");

        let mut b = BytesMut::new();
        put_error_response(
            &mut b,
            3,
            Flags::EXT_STATUS,
            Status::Overloaded,
            "overloaded: x",
        );
        let r = codec.decode_response(&frame(b)).unwrap();
        assert_eq!(r.status, Status::Overloaded);
        assert_eq!(r.rpc.error_msg, "overloaded: x");
    }

    #[test]
    fn bad_compressed_payload_is_an_inflate_error() {
        let mut codec = CallCodec::new(None, 1 << 20);
        let mut b = BytesMut::new();
        Request {
            service: Bytes::from_static(b"S"),
            method: Bytes::from_static(b"M"),
            payload: Bytes::from_static(b"definitely not zlib"),
        }
        .put(&mut b, Flags::COMPRESSED, 1)
        .unwrap();
        let e = codec.decode_request(&frame(b)).unwrap_err();
        assert!(matches!(e, CallError::Inflate(_)), "{e:?}");
    }
}
