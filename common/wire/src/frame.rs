//! RPCF v1 frames: the fixed 18-byte header and the CRC32 trailer around a body, rpcmesh's
//! extension bits, and [`FrameWriter`], which writes a frame in place. Where a frame is
//! parsed: [`Frame::from_bytes`] (once [`crate::codec`] has found a whole one in a stream).
//!
//! Pure: byte slices in, typed values out, typed values appended to a `BytesMut`. It never
//! touches a socket (that is `rpcmesh_common::net`) and never looks inside a protobuf
//! payload (that is [`crate::envelope`]). What the bodies hold is [`crate::body`];
//! splitting a byte stream into frames, with its limits, is [`crate::codec`].
//!
//! Layout (all integers big-endian):
//!
//! ```text
//! 0      4      5          6          10         18            18+len     22+len
//! | magic | ver | msg_type | body_len | req_id   | body ...     | crc32    |
//! ```
//!
//! The extension flags live in the high bits of `msg_type` (see `docs/protocol.md`): a plain
//! v1 frame has them all clear and is therefore byte-identical to what v1 peers send.

use std::sync::LazyLock;

use bytes::{BufMut, Bytes, BytesMut};

/// `"RPCF"` as a big-endian u32.
pub const MAGIC: u32 = 0x5250_4346;
/// The only protocol version rpcmesh speaks.
pub const VERSION: u8 = 1;
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 18;
/// Bytes of the CRC32 trailer.
pub const TRAILER_LEN: usize = 4;
/// Bytes a frame adds around its body.
pub const FRAME_OVERHEAD: usize = HEADER_LEN + TRAILER_LEN;
/// Largest body accepted unless configured otherwise: 10 MiB, the limit existing RPCF v1
/// peers enforce, so anything rpcmesh accepts they accept too.
pub const DEFAULT_MAX_BODY_LEN: u32 = 10 * 1024 * 1024;

/// Offset of the `msg_type` byte (type in the low bits, flags in the high ones).
const TYPE_AT: usize = 5;
/// Offset of `body_len` in the header.
const BODY_LEN_AT: usize = 6;
/// Offset of `req_id` in the header.
const REQ_ID_AT: usize = 10;
/// Low bits of the `msg_type` byte: the message type proper.
const TYPE_MASK: u8 = 0x0f;

/// Why bytes could not be read as a frame or a body. Each variant says whether the
/// stream is still in step ([`FrameError::is_fatal`]); the metrics layer gives each a
/// label (`ErrorKind::of_frame` in `rpcmesh_common::metrics`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The stream did not start with `"RPCF"` and no magic was found in the buffered bytes.
    #[error("bad magic 0x{found:08x}: not an RPCF stream")]
    BadMagic {
        /// The four bytes found where the magic should be.
        found: u32,
    },
    /// Junk before a magic was dropped; the stream resumed at the magic.
    #[error("skipped {skipped} bytes of junk before a frame")]
    Resynced {
        /// Bytes dropped.
        skipped: usize,
    },
    /// A protocol version other than 1: nothing after it can be trusted.
    #[error("unsupported protocol version {version}")]
    BadVersion {
        /// The version byte found.
        version: u8,
    },
    /// `body_len` over the configured limit: refused before anything is buffered.
    #[error("frame too large: body of {body_len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The announced body length.
        body_len: u32,
        /// The configured limit.
        max: u32,
        /// The header's request id, for an error reply.
        req_id: u64,
        /// The header's message type byte.
        raw_type: u8,
    },
    /// The CRC trailer does not match header + body; the frame was skipped.
    #[error("crc mismatch on frame {req_id}: trailer 0x{expected:08x}, computed 0x{actual:08x}")]
    Crc {
        /// The header's request id (itself possibly corrupt).
        req_id: u64,
        /// The header's message type byte.
        raw_type: u8,
        /// CRC carried by the frame.
        expected: u32,
        /// CRC computed over what arrived.
        actual: u32,
    },
    /// A message type this side does not know (or reserved flag bits set); skipped.
    #[error("unknown message type byte 0x{raw_type:02x} on frame {req_id}")]
    UnknownType {
        /// The header's request id.
        req_id: u64,
        /// The type byte found.
        raw_type: u8,
    },
    /// The peer closed the connection in the middle of a frame.
    #[error("connection closed inside a frame ({buffered} bytes buffered)")]
    Truncated {
        /// Bytes of the partial frame that had arrived.
        buffered: usize,
    },
    /// The body's inner lengths do not add up to `body_len`, or a name is not UTF-8.
    #[error("malformed {what} body: {reason}")]
    BadBody {
        /// Which body kind.
        what: &'static str,
        /// What was wrong.
        reason: &'static str,
    },
    /// The body to encode does not fit in the 32-bit length fields.
    #[error("body of {len} bytes does not fit in a frame")]
    Unencodable {
        /// The body length that was attempted.
        len: usize,
    },
}

impl FrameError {
    /// True when the byte stream can no longer be split into frames and the connection
    /// must be closed; false when the bad frame was consumed and reading can go on.
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            FrameError::Resynced { .. }
                | FrameError::Crc { .. }
                | FrameError::UnknownType { .. }
                | FrameError::BadBody { .. }
        )
    }

    /// The request this error concerns, when it was a request and its id is known: the
    /// caller can then be sent an error reply instead of waiting for its timeout.
    pub fn request_id(&self) -> Option<u64> {
        self.frame_id()
            .filter(|(_, t)| matches!(t, Some(MsgType::Request | MsgType::ExtRequest)))
            .map(|(id, _)| id)
    }

    /// Request id and message type of the frame the error concerns, whatever its type,
    /// when the header could be read (too large, CRC mismatch).
    pub fn frame_id(&self) -> Option<(u64, Option<MsgType>)> {
        self.raw_header()
            .map(|(id, raw)| (id, MsgType::from_low_bits(raw & TYPE_MASK)))
    }

    /// Flags of the frame the error concerns (for choosing the reply's status codes).
    pub fn flags(&self) -> Flags {
        self.raw_header()
            .map_or(Flags::NONE, |(_, raw)| Flags::from_bits(raw))
    }

    /// Request id and raw `msg_type` byte, when the header could be read.
    fn raw_header(&self) -> Option<(u64, u8)> {
        match *self {
            FrameError::TooLarge {
                req_id, raw_type, ..
            }
            | FrameError::Crc {
                req_id, raw_type, ..
            } => Some((req_id, raw_type)),
            _ => None,
        }
    }
}

/// The message type in the low bits of the `msg_type` byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MsgType {
    /// A call.
    Request = 0,
    /// The answer to a call.
    Response = 1,
    /// Liveness probe; answered with a heartbeat carrying the same `req_id`.
    Heartbeat = 2,
    /// A call with an extension block before its request body (`crate::ext`): sent only
    /// to peers that said they take it.
    ExtRequest = 3,
}

impl MsgType {
    fn from_low_bits(b: u8) -> Option<MsgType> {
        match b {
            0 => Some(MsgType::Request),
            1 => Some(MsgType::Response),
            2 => Some(MsgType::Heartbeat),
            3 => Some(MsgType::ExtRequest),
            _ => None,
        }
    }
}

/// rpcmesh extension bits in the high nibble of the `msg_type` byte. All clear in a plain
/// v1 frame; set only towards peers that sent them first or are configured to take them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Flags(u8);

impl Flags {
    /// No extension: a plain v1 frame.
    pub const NONE: Flags = Flags(0);
    /// The payload (the `P` bytes) is a zlib stream of the protobuf message.
    pub const COMPRESSED: Flags = Flags(0x80);
    /// On a request: the caller accepts a compressed reply.
    pub const ACCEPT_COMPRESSED: Flags = Flags(0x40);
    /// On a request: the caller accepts the extended statuses (3 = unavailable,
    /// 4 = overloaded, 5 = bad request). Without it they are sent as status 1.
    pub const EXT_STATUS: Flags = Flags(0x20);
    /// On a response (with status 3, unavailable): the callee did not start the call,
    /// because it is draining, so the call is safe to send to another provider or broker
    /// ([`Flags::NOT_RUN`] is what makes a drain invisible to callers). Sent only to
    /// callers that set [`Flags::EXT_STATUS`]; a request with this bit is an unknown type.
    pub const NOT_RUN: Flags = Flags(0x10);
    /// Every bit rpcmesh defines.
    pub const ALL: Flags = Flags(0xf0);

    /// The flags carried by a raw `msg_type` byte (unknown bits dropped).
    pub const fn from_bits(raw_type: u8) -> Flags {
        Flags(raw_type & Flags::ALL.0)
    }
    /// The raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
    /// True when every bit of `other` is set.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }
    /// Both sets of bits.
    pub const fn union(self, other: Flags) -> Flags {
        Flags(self.0 | other.0)
    }
    /// These bits without those of `other`.
    pub const fn without(self, other: Flags) -> Flags {
        Flags(self.0 & !other.0)
    }
    /// True for a plain v1 frame.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl std::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        self.union(rhs)
    }
}

/// The fixed header of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the body is.
    pub msg_type: MsgType,
    /// Extension bits (empty for plain v1).
    pub flags: Flags,
    /// Length of the body in bytes.
    pub body_len: u32,
    /// Caller-chosen id, echoed in the reply.
    pub req_id: u64,
}

impl Header {
    /// The `msg_type` byte as sent: type in the low bits, flags in the high bits.
    pub fn raw_type(&self) -> u8 {
        self.msg_type as u8 | self.flags.bits()
    }

    /// Appends the 18 header bytes.
    pub fn put(&self, dst: &mut BytesMut) {
        // One copy of the assembled header: five `put_*` calls check the capacity five times.
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        h[4] = VERSION;
        h[5] = self.raw_type();
        h[6..10].copy_from_slice(&self.body_len.to_be_bytes());
        h[10..18].copy_from_slice(&self.req_id.to_be_bytes());
        dst.extend_from_slice(&h);
    }
}

/// What the first bytes of a buffer say about a frame, before its body has arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Prefix {
    pub magic: u32,
    pub version: u8,
    pub raw_type: u8,
    pub body_len: u32,
    pub req_id: u64,
}

impl Prefix {
    /// The header these fields make, if its type byte names a known type with flags it
    /// may carry (its CRC is the frame's to check).
    pub(crate) fn header(&self) -> Result<Header, FrameError> {
        let msg_type = match MsgType::from_low_bits(self.raw_type & TYPE_MASK) {
            // Every high bit is a flag; NOT_RUN is one on responses only.
            Some(t) if t == MsgType::Response || self.raw_type & Flags::NOT_RUN.bits() == 0 => t,
            _ => {
                return Err(FrameError::UnknownType {
                    req_id: self.req_id,
                    raw_type: self.raw_type,
                });
            }
        };
        Ok(Header {
            msg_type,
            flags: Flags::from_bits(self.raw_type),
            body_len: self.body_len,
            req_id: self.req_id,
        })
    }

    /// Reads the header fields without judging them. `buf` holds at least `HEADER_LEN`.
    pub(crate) fn read(buf: &[u8]) -> Prefix {
        // One bounds check for the whole header instead of one per field.
        let h: &[u8; HEADER_LEN] = buf[..HEADER_LEN].try_into().expect("HEADER_LEN bytes");
        Prefix {
            magic: be_u32(&h[0..4]),
            version: h[4],
            raw_type: h[TYPE_AT],
            body_len: be_u32(&h[BODY_LEN_AT..BODY_LEN_AT + 4]),
            req_id: be_u64(&h[REQ_ID_AT..REQ_ID_AT + 8]),
        }
    }
}

/// CRC-32 of `bytes` (the trailer's). `crc32fast` picks its implementation (SIMD where
/// the CPU has it) in `Hasher::new`, for every hasher; cloning one made once spares that
/// check on each of the four CRCs of a forwarded call.
pub(crate) fn crc32(bytes: &[u8]) -> u32 {
    static PROTOTYPE: LazyLock<crc32fast::Hasher> = LazyLock::new(crc32fast::Hasher::new);
    let mut h = PROTOTYPE.clone();
    h.update(bytes);
    h.finalize()
}

/// A complete, CRC-checked frame. `body` is a slice of the buffer it was read into: no copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// The header as received.
    pub header: Header,
    /// The body (between header and trailer).
    pub body: Bytes,
}

impl Frame {
    /// Checks and splits one whole frame (`22 + body_len` bytes, nothing more; anything
    /// shorter or longer is `Truncated`). Finding the frame's end in a stream and the
    /// body limit belong to the caller ([`crate::codec::FrameCodec`]).
    pub fn from_bytes(frame: Bytes) -> Result<Frame, FrameError> {
        if frame.len() < HEADER_LEN {
            return Err(FrameError::Truncated {
                buffered: frame.len(),
            });
        }
        let p = Prefix::read(&frame);
        if p.magic != MAGIC {
            return Err(FrameError::BadMagic { found: p.magic });
        }
        if p.version != VERSION {
            return Err(FrameError::BadVersion { version: p.version });
        }
        let end = HEADER_LEN + p.body_len as usize;
        if frame.len() != end + TRAILER_LEN {
            return Err(FrameError::Truncated {
                buffered: frame.len(),
            });
        }
        let header = Frame::check(&frame, &p)?;
        Ok(Frame {
            header,
            body: frame.slice(HEADER_LEN..end),
        })
    }

    /// Checks a whole frame in place (`22 + body_len` bytes, its header `p` already read
    /// and its magic and version checked): its CRC and its type. Returns its header. The
    /// codec checks frames where they lie in the read buffer, before splitting them off.
    #[inline]
    pub(crate) fn check(frame: &[u8], p: &Prefix) -> Result<Header, FrameError> {
        let end = HEADER_LEN + p.body_len as usize;
        let expected = be_u32(&frame[end..]);
        let actual = crc32(&frame[..end]);
        if expected != actual {
            return Err(FrameError::Crc {
                req_id: p.req_id,
                raw_type: p.raw_type,
                expected,
                actual,
            });
        }
        p.header()
    }

    /// Appends the frame as it is: header, body, freshly computed CRC.
    pub fn put(&self, dst: &mut BytesMut) {
        put_frame(dst, &self.header, &self.body);
    }

    /// The frame's bytes on the wire.
    pub fn to_bytes(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(FRAME_OVERHEAD + self.body.len());
        self.put(&mut b);
        b.freeze()
    }
}

/// Appends a frame with the given header fields (its `body_len` is taken from `body`),
/// its body, and `trailer` as its CRC: no CRC pass. Right only when these bytes have that
/// CRC: a frame copied as it came under an id neutral to its own (`crate::neutral`).
pub fn put_frame_with_trailer(dst: &mut BytesMut, header: &Header, body: &[u8], trailer: u32) {
    put_header_and_body(dst, header, body);
    dst.put_u32(trailer);
}

/// Appends a frame with the given header fields (its `body_len` is taken from `body`)
/// and body. This is the forwarding path: the body is copied once, into `dst`.
pub fn put_frame(dst: &mut BytesMut, header: &Header, body: &[u8]) {
    let start = dst.len();
    put_header_and_body(dst, header, body);
    let crc = crc32(&dst[start..]);
    dst.put_u32(crc);
}

/// Appends the header (its `body_len` taken from `body`) and the body, with room reserved
/// for the trailer that follows.
fn put_header_and_body(dst: &mut BytesMut, header: &Header, body: &[u8]) {
    dst.reserve(FRAME_OVERHEAD + body.len());
    Header {
        body_len: body.len() as u32,
        ..*header
    }
    .put(dst);
    dst.extend_from_slice(body);
}

/// Appends a response frame whose body is `body` (a response body as received from
/// elsewhere) with its status byte set to `status`: the broker's path back to the caller,
/// with the body copied once. `body` must hold at least the status byte.
pub fn put_forwarded_response(
    dst: &mut BytesMut,
    req_id: u64,
    flags: Flags,
    body: &[u8],
    status: u8,
) {
    let start = dst.len();
    dst.reserve(FRAME_OVERHEAD + body.len());
    Header {
        msg_type: MsgType::Response,
        flags,
        body_len: body.len() as u32,
        req_id,
    }
    .put(dst);
    dst.put_u8(status);
    dst.extend_from_slice(body.get(1..).unwrap_or_default());
    let crc = crc32(&dst[start..]);
    dst.put_u32(crc);
}

/// A frame being appended to a buffer body-part by body-part; [`FrameWriter::finish`]
/// patches the lengths and appends the CRC. Lets payloads be encoded straight into the
/// write buffer without an intermediate copy.
#[derive(Debug)]
#[must_use = "a frame is not complete until finish() is called"]
pub struct FrameWriter {
    start: usize,
    /// Where the 4-byte payload length of a request or response body sits (set by the
    /// body's `begin_*`, [`crate::body`]).
    pub(crate) payload_len_at: Option<usize>,
}

impl FrameWriter {
    /// Starts a frame: writes the header with a zero `body_len`.
    pub fn begin(dst: &mut BytesMut, msg_type: MsgType, flags: Flags, req_id: u64) -> Self {
        let start = dst.len();
        Header {
            msg_type,
            flags,
            body_len: 0,
            req_id,
        }
        .put(dst);
        FrameWriter {
            start,
            payload_len_at: None,
        }
    }
    /// Patches `body_len` (and the payload length), then appends the CRC.
    pub fn finish(self, dst: &mut BytesMut) -> Result<(), FrameError> {
        let body_len = dst.len() - self.start - HEADER_LEN;
        let body_len =
            u32::try_from(body_len).map_err(|_| FrameError::Unencodable { len: body_len })?;
        dst[self.start + BODY_LEN_AT..self.start + BODY_LEN_AT + 4]
            .copy_from_slice(&body_len.to_be_bytes());
        if let Some(at) = self.payload_len_at {
            let p = (dst.len() - at - 4) as u32;
            dst[at..at + 4].copy_from_slice(&p.to_be_bytes());
        }
        let crc = crc32(&dst[self.start..]);
        dst.put_u32(crc);
        Ok(())
    }

    /// As [`finish`](Self::finish), but a body over `max` bytes, which the peer would
    /// refuse, is taken back out of `dst` and refused here with
    /// [`FrameError::TooLarge`].
    pub fn finish_within(self, dst: &mut BytesMut, max: u32) -> Result<(), FrameError> {
        let body_len = dst.len() - self.start - HEADER_LEN;
        if body_len > max as usize {
            let p = Prefix::read(&dst[self.start..]);
            self.abandon(dst);
            return Err(FrameError::TooLarge {
                body_len: u32::try_from(body_len).unwrap_or(u32::MAX),
                max,
                req_id: p.req_id,
                raw_type: p.raw_type,
            });
        }
        self.finish(dst)
    }

    /// Sets `flags` in the frame's header, e.g. `COMPRESSED` once the payload is written.
    pub fn add_flags(&self, dst: &mut BytesMut, flags: Flags) {
        dst[self.start + TYPE_AT] |= flags.bits();
    }

    /// Drops a half-written frame from the buffer (after an encoding error).
    pub fn abandon(self, dst: &mut BytesMut) {
        dst.truncate(self.start);
    }
}

pub(crate) fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

pub(crate) fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::{Request, Response};

    fn request_frame(flags: Flags, id: u64) -> Bytes {
        let mut b = BytesMut::new();
        let req = Request {
            service: Bytes::from_static(b"EchoService"),
            method: Bytes::from_static(b"Echo"),
            payload: Bytes::from_static(b"\x0a\x03abc"),
        };
        req.put(&mut b, flags, id).unwrap();
        b.freeze()
    }

    #[test]
    fn request_round_trips_through_bytes() {
        let bytes = request_frame(Flags::NONE, 7);
        let f = Frame::from_bytes(bytes.clone()).unwrap();
        assert_eq!(f.header.msg_type, MsgType::Request);
        assert_eq!(f.header.req_id, 7);
        let r = Request::parse(&f.body).unwrap();
        assert_eq!(r.service_name(), "EchoService");
        assert_eq!(r.method_name(), "Echo");
        assert_eq!(f.to_bytes(), bytes);
    }

    #[test]
    fn flags_live_in_the_high_bits_of_msg_type() {
        let bytes = request_frame(Flags::COMPRESSED | Flags::EXT_STATUS, 1);
        assert_eq!(bytes[5], 0xa0);
        let f = Frame::from_bytes(bytes).unwrap();
        assert_eq!(f.header.msg_type, MsgType::Request);
        assert!(f.header.flags.contains(Flags::COMPRESSED));
        assert!(!f.header.flags.contains(Flags::ACCEPT_COMPRESSED));
    }

    #[test]
    fn a_buffer_shorter_than_a_header_is_truncated_not_a_panic() {
        let whole = request_frame(Flags::NONE, 3);
        for n in [0, 1, 4, HEADER_LEN - 1] {
            let e = Frame::from_bytes(whole.slice(..n)).unwrap_err();
            assert!(
                matches!(e, FrameError::Truncated { buffered } if buffered == n),
                "{e:?}"
            );
        }
    }

    #[test]
    fn not_run_bit_is_a_response_flag_only() {
        let with_type = |raw_type: u8| {
            let mut b = BytesMut::from(&request_frame(Flags::NONE, 3)[..]);
            b[5] = raw_type;
            let n = b.len();
            let crc = crc32fast::hash(&b[..n - 4]);
            b[n - 4..].copy_from_slice(&crc.to_be_bytes());
            Frame::from_bytes(b.freeze())
        };
        for raw in [0x10, 0x12, 0x30] {
            let e = with_type(raw).unwrap_err();
            assert!(matches!(e, FrameError::UnknownType { req_id: 3, .. }));
            assert!(!e.is_fatal());
        }
        let f = with_type(0x31).unwrap();
        assert_eq!(f.header.msg_type, MsgType::Response);
        assert!(f.header.flags.contains(Flags::NOT_RUN | Flags::EXT_STATUS));
        assert_eq!(f.header.raw_type(), 0x31);
    }

    #[test]
    fn crc_mismatch_is_reported_with_the_request_id() {
        let mut b = BytesMut::from(&request_frame(Flags::NONE, 42)[..]);
        let n = b.len();
        b[n - 1] ^= 0xff;
        let e = Frame::from_bytes(b.freeze()).unwrap_err();
        assert_eq!(e.request_id(), Some(42));
        assert!(matches!(e, FrameError::Crc { .. }));
    }

    #[test]
    fn frame_writer_patches_lengths() {
        let mut b = BytesMut::new();
        b.extend_from_slice(b"prefix");
        let w = FrameWriter::begin_response(&mut b, Flags::NONE, 5, 0);
        b.extend_from_slice(b"xyz");
        w.finish(&mut b).unwrap();
        let f = Frame::from_bytes(b.split_off(6).freeze()).unwrap();
        let r = Response::parse(&f.body).unwrap();
        assert_eq!(r.status, 0);
        assert_eq!(&r.payload[..], b"xyz");
    }
}
