//! The call extension: fields a broker adds to a call it forwards, carried in a frame of
//! its own type so that v1 frames stay exactly as they are.
//!
//! A forwarded request is `msg_type` low nibble 3 ([`MsgType::ExtRequest`]), with the
//! high-nibble flags of the request it carries. Its body is an extension block, then the
//! plain v1 request body, unchanged:
//!
//! ```text
//! +-----------+----------------------------------+------------------------------+
//! | u16 len L | L bytes of fields (TLV)          | v1 request body              |
//! +-----------+----------------------------------+------------------------------+
//!   field: u8 tag, u16 length N, N bytes of value
//! ```
//!
//! Fields, by tag (a receiver skips the tags it does not know, so fields can be added
//! without a new frame type; a sender adds one only when the peer said it takes it):
//!
//! | tag | name     | value |
//! |-----|----------|-------|
//! | 1   | `caller` | the identity of the caller the broker serves this call for (UTF-8, at most 2,048 bytes); empty: a caller without one (anonymous) |
//! | 2   | `deadline` | the call's remaining time budget: `u32` microseconds, big-endian, counted from when the receiver reads the frame; 0: already past |
//!
//! The deadline is relative, not a point in time, so that hosts need no common clock (as
//! gRPC's `grpc-timeout`): the receiver's deadline is the instant it read the frame plus
//! the budget, and the time the frame spent on the wire is not counted.
//!
//! A peer says which fields it takes in its heartbeat answer ([`HEARTBEAT_KEY`]), and only
//! rpcmesh peers are asked, so a plain v1 server never sees this type, nor a v1 client
//! (replies are plain responses). A broker is asked by its clients too: it takes the
//! deadline from them (never a caller field: its callers are whom their certificates
//! name). The broker never decodes or inflates the
//! payload it forwards: it writes the block before the request's body, whose bytes it
//! copies as before, and the frame's CRC covers both.

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::frame::{FRAME_OVERHEAD, Flags, FrameError, Header, MsgType, crc32};

/// A malformed block, for `reason`.
fn bad(reason: &'static str) -> FrameError {
    FrameError::BadBody {
        what: "extension",
        reason,
    }
}

/// Tag of the caller's identity.
pub const TAG_CALLER: u8 = 1;
/// Tag of the call's deadline (its remaining budget).
pub const TAG_DEADLINE: u8 = 2;
/// Length of the deadline field's value: a `u32` of microseconds.
pub const DEADLINE_LEN: usize = 4;
/// The longest budget carried: `u32::MAX` microseconds (about 71 minutes), far beyond any
/// call timeout; a longer one is sent as this.
pub const MAX_DEADLINE: Duration = Duration::from_micros(u32::MAX as u64);
/// The name of the deadline field in [`HEARTBEAT_KEY`]'s value.
pub const DEADLINE_FIELD: &str = "deadline";
/// A block holding only a deadline: its length.
pub const DEADLINE_BLOCK_LEN: usize = 2 + 3 + DEADLINE_LEN;
/// How a block holding only a deadline begins: its length (one field), the field's tag and
/// the value's length; the value's four bytes follow.
pub const DEADLINE_ONLY: [u8; 5] = [
    0,
    (3 + DEADLINE_LEN) as u8,
    TAG_DEADLINE,
    0,
    DEADLINE_LEN as u8,
];
/// The longest extension block taken: 4 KiB holds the caller (2 KiB at most) and the
/// fields to come; a longer one is refused as malformed.
pub const MAX_BLOCK_LEN: usize = 4096;
/// The longest caller identity carried (a SPIFFE ID's limit).
pub const MAX_CALLER_LEN: usize = 2048;
/// The heartbeat pair by which a broker asks a provider which fields it takes (an empty
/// value), and the provider answers (their names, comma-separated: `caller`).
pub const HEARTBEAT_KEY: &str = "rpcmesh-call-ext";
/// The name of the caller field in [`HEARTBEAT_KEY`]'s value.
pub const CALLER_FIELD: &str = "caller";
/// What a broker answers its clients' [`HEARTBEAT_KEY`] question with: it takes the
/// deadline (never a caller: its callers are whom their certificates name), and tells of
/// its drain those that ask.
pub const BROKER_FIELDS: &str = "deadline,drain-notice";
/// What a provider answers [`HEARTBEAT_KEY`] with: it takes both fields (a broker sends
/// the caller only over TLS), and tells of its drain those that ask.
pub const PROVIDER_FIELDS: &str = "caller,deadline,drain-notice";
/// The heartbeat pair by which a broker gives a provider the longest budget of any call on
/// that connection (its own call timeout: it answers "timeout" then whatever comes), in
/// microseconds, decimal. From then on every call the provider reads there, with a
/// deadline field or without, has at most that budget from when it is read. So a call the
/// broker writes in the round that read it, whose time left is exactly that cap or its
/// caller's own deadline field, goes on as it came (no re-encoding, no CRC pass), and the
/// provider still drops it unstarted once the broker has given up on it.
pub const CAP_KEY: &str = "rpcmesh-deadline-cap";
/// The name, in a provider's [`HEARTBEAT_KEY`] answer, that says it applies the cap the
/// same heartbeat gave ([`CAP_KEY`]).
pub const DEADLINE_CAP_FIELD: &str = "deadline-cap";
/// What a provider given a cap answers [`HEARTBEAT_KEY`] with.
pub const PROVIDER_FIELDS_CAPPED: &str = "caller,deadline,deadline-cap,drain-notice";

/// The name a client lists in its [`HEARTBEAT_KEY`] question (and a server in its answer)
/// to say that it takes a drain notice ([`DRAINING_KEY`]).
pub const DRAIN_NOTICE_FIELD: &str = "drain-notice";
/// The heartbeat pair (empty value) by which a server that has begun to drain tells a
/// client that asked ([`DRAIN_NOTICE_FIELD`]) that this connection takes no more calls,
/// as HTTP/2's GOAWAY does. A server closes an idle draining connection after a linger,
/// and a call its client wrote just as it closed would cross the close and be lost,
/// perhaps run (a plain v1 client has only the linger). A client told instead stops
/// writing calls there and closes the connection itself once its calls are answered; the
/// server answers the calls it still reads "not run" and waits for that close (bounded),
/// so that no call crosses it.
pub const DRAINING_KEY: &str = "rpcmesh-draining";
/// The request id of a drain notice: 0, which no call has (a client's ids count from 1)
/// and which answers no heartbeat of its own.
pub const DRAIN_NOTICE_ID: u64 = 0;

/// The cap of a [`CAP_KEY`] value: decimal microseconds, at most [`MAX_DEADLINE`]; `None`
/// for anything else (a provider then applies none and does not say it does).
pub fn parse_cap(value: &str) -> Option<Duration> {
    value
        .parse::<u32>()
        .ok()
        .map(|us| Duration::from_micros(u64::from(us)))
}

/// A [`CAP_KEY`] value for `cap` (rounded down to the microsecond, as a deadline field).
pub fn cap_value(cap: Duration) -> String {
    deadline_micros(cap).to_string()
}

/// The fields of an extension block, as far as this side knows them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fields<'a> {
    /// The forwarded caller: `Some("")` for an anonymous one; `None` when absent.
    pub caller: Option<&'a str>,
    /// The call's remaining budget, from when the frame was read; `None` when absent.
    pub deadline: Option<Duration>,
}

/// The `u32` of microseconds that carries `budget` ([`MAX_DEADLINE`] at most; rounded
/// down, so that a receiver never gets more time than the sender had).
pub fn deadline_micros(budget: Duration) -> u32 {
    u32::try_from(budget.as_micros()).unwrap_or(u32::MAX)
}

/// The extension block of a call carrying only its deadline, `budget` (the driver's).
pub fn deadline_block(budget: Duration) -> [u8; DEADLINE_BLOCK_LEN] {
    let mut b = [0u8; DEADLINE_BLOCK_LEN];
    b[..2].copy_from_slice(&((3 + DEADLINE_LEN) as u16).to_be_bytes());
    b[2] = TAG_DEADLINE;
    b[3..5].copy_from_slice(&(DEADLINE_LEN as u16).to_be_bytes());
    b[5..].copy_from_slice(&deadline_micros(budget).to_be_bytes());
    b
}

/// Appends the extension block of a call forwarded for `caller` (`None`: anonymous).
/// Fails when the identity is over [`MAX_CALLER_LEN`].
pub fn put_caller_block(dst: &mut BytesMut, caller: Option<&str>) -> Result<(), FrameError> {
    let c = caller.unwrap_or("");
    if c.len() > MAX_CALLER_LEN {
        return Err(bad("caller identity too long"));
    }
    dst.put_u16((3 + c.len()) as u16);
    dst.put_u8(TAG_CALLER);
    dst.put_u16(c.len() as u16);
    dst.extend_from_slice(c.as_bytes());
    Ok(())
}

/// Appends an extension request frame: `block` (from [`put_caller_block`]) before `body`
/// (a v1 request body), under `req_id` with `flags`, the CRC over all of it.
pub fn put_ext_request(dst: &mut BytesMut, flags: Flags, req_id: u64, block: &[u8], body: &[u8]) {
    let start = dst.len();
    dst.reserve(FRAME_OVERHEAD + block.len() + body.len());
    Header {
        msg_type: MsgType::ExtRequest,
        flags,
        body_len: (block.len() + body.len()) as u32,
        req_id,
    }
    .put(dst);
    dst.extend_from_slice(block);
    dst.extend_from_slice(body);
    let crc = crc32(&dst[start..]);
    dst.put_u32(crc);
}

/// Appends an extension request frame whose block is `block` (a whole block, as
/// [`put_caller_block`] makes it, or empty for none) with, when `deadline` is given, a
/// deadline field added at its end; then `body`, the CRC over all of it. The broker's: the
/// caller's block is made once per session, the deadline per call.
pub fn put_ext_request_with_deadline(
    dst: &mut BytesMut,
    flags: Flags,
    req_id: u64,
    block: &[u8],
    deadline: Option<Duration>,
    body: &[u8],
) {
    let Some(budget) = deadline else {
        return put_ext_request(dst, flags, req_id, block, body);
    };
    let fields = block.get(2..).unwrap_or_default();
    let block_len = 2 + fields.len() + 3 + DEADLINE_LEN;
    let start = dst.len();
    dst.reserve(FRAME_OVERHEAD + block_len + body.len());
    Header {
        msg_type: MsgType::ExtRequest,
        flags,
        body_len: (block_len + body.len()) as u32,
        req_id,
    }
    .put(dst);
    dst.put_u16((block_len - 2) as u16);
    dst.extend_from_slice(fields);
    dst.put_u8(TAG_DEADLINE);
    dst.put_u16(DEADLINE_LEN as u16);
    dst.put_u32(deadline_micros(budget));
    dst.extend_from_slice(body);
    let crc = crc32(&dst[start..]);
    dst.put_u32(crc);
}

/// Splits an extension request's body into its fields and the v1 request body (a slice of
/// `body`, no copy). Malformed: a block longer than the body or than [`MAX_BLOCK_LEN`], a
/// field running past the block, a caller that is not UTF-8 or is too long, a deadline
/// whose value is not [`DEADLINE_LEN`] bytes.
pub fn split(body: &Bytes) -> Result<(Fields<'_>, Bytes), FrameError> {
    // The block of nearly every call: its deadline alone, read without the walk.
    if let Some(d) = body.get(..DEADLINE_BLOCK_LEN) {
        if d[..DEADLINE_ONLY.len()] == DEADLINE_ONLY {
            let micros = u32::from_be_bytes([d[5], d[6], d[7], d[8]]);
            let fields = Fields {
                caller: None,
                deadline: Some(Duration::from_micros(u64::from(micros))),
            };
            return Ok((fields, body.slice(DEADLINE_BLOCK_LEN..)));
        }
    }
    let mut b = &body[..];
    if b.len() < 2 {
        return Err(bad("no block length"));
    }
    let len = usize::from(b.get_u16());
    if len > MAX_BLOCK_LEN || len > b.len() {
        return Err(bad("block longer than allowed or than the body"));
    }
    let mut block = &b[..len];
    let mut fields = Fields::default();
    while !block.is_empty() {
        if block.len() < 3 {
            return Err(bad("a field cut short"));
        }
        let tag = block.get_u8();
        let n = usize::from(block.get_u16());
        if n > block.len() {
            return Err(bad("a field past the block"));
        }
        let (value, rest) = block.split_at(n);
        if tag == TAG_CALLER {
            if n > MAX_CALLER_LEN {
                return Err(bad("caller identity too long"));
            }
            fields.caller = Some(std::str::from_utf8(value).map_err(|_| bad("caller not UTF-8"))?);
        } else if tag == TAG_DEADLINE {
            let micros: [u8; DEADLINE_LEN] =
                value.try_into().map_err(|_| bad("deadline not 4 bytes"))?;
            fields.deadline = Some(Duration::from_micros(u64::from(u32::from_be_bytes(micros))));
        }
        block = rest;
    }
    Ok((fields, body.slice(2 + len..)))
}

/// Whether a heartbeat answer's [`HEARTBEAT_KEY`] value lists `field`.
pub fn takes(value: &str, field: &str) -> bool {
    value.split(',').any(|f| f.trim() == field)
}

/// Whether heartbeat body `body` asks for a drain notice: its [`HEARTBEAT_KEY`] value lists
/// [`DRAIN_NOTICE_FIELD`]. A malformed body asks for nothing.
pub fn asks_drain_notice(body: &[u8]) -> bool {
    crate::body::Heartbeat::extra_value_in(body, HEARTBEAT_KEY)
        .is_ok_and(|v| v.is_some_and(|v| takes(v, DRAIN_NOTICE_FIELD)))
}

/// Appends a drain notice ([`DRAINING_KEY`]) from `service_name` on `node_id`.
pub fn put_drain_notice(dst: &mut BytesMut, service_name: &str, node_id: &str) {
    // A heartbeat of two short names and one empty pair cannot be too large.
    let _ = crate::body::Heartbeat::put_now_with(
        dst,
        DRAIN_NOTICE_ID,
        service_name,
        node_id,
        &[(DRAINING_KEY, "")],
    );
}

/// Whether `frame` is a drain notice: a heartbeat carrying [`DRAINING_KEY`].
pub fn is_drain_notice(frame: &crate::frame::Frame) -> bool {
    frame.header.msg_type == MsgType::Heartbeat && tells_drain(&frame.body)
}

/// Whether heartbeat body `body` is a drain notice's: it carries [`DRAINING_KEY`].
pub fn tells_drain(body: &[u8]) -> bool {
    crate::body::Heartbeat::extra_value_in(body, DRAINING_KEY).is_ok_and(|v| v.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::Request;
    use crate::codec::FrameCodec;
    use proptest::prelude::*;

    #[test]
    fn a_drain_notice_is_told_apart_from_other_heartbeats_and_asked_for_by_name() {
        let mut out = BytesMut::new();
        put_drain_notice(&mut out, "broker", "b1");
        let notice = FrameCodec::default()
            .decode_frame(&mut out)
            .unwrap()
            .unwrap();
        assert_eq!(notice.header.req_id, DRAIN_NOTICE_ID);
        assert!(is_drain_notice(&notice));
        let mut ask = BytesMut::new();
        let pairs = [(HEARTBEAT_KEY, "drain-notice")];
        crate::body::Heartbeat::put_now_with(&mut ask, 9, "t", "t", &pairs).unwrap();
        let ask = FrameCodec::default()
            .decode_frame(&mut ask)
            .unwrap()
            .unwrap();
        assert!(!is_drain_notice(&ask));
        assert!(asks_drain_notice(&ask.body));
        let mut plain = BytesMut::new();
        crate::body::Heartbeat::put_now_with(&mut plain, 9, "t", "t", &[(HEARTBEAT_KEY, "")])
            .unwrap();
        let plain = FrameCodec::default()
            .decode_frame(&mut plain)
            .unwrap()
            .unwrap();
        assert!(!asks_drain_notice(&plain.body) && !is_drain_notice(&plain));
    }

    fn v1_body() -> Bytes {
        let mut b = BytesMut::new();
        Request {
            service: Bytes::from_static(b"EchoService"),
            method: Bytes::from_static(b"Echo"),
            payload: Bytes::from_static(b"hi"),
        }
        .put(&mut b, Flags::NONE, 1)
        .unwrap();
        let f = crate::frame::Frame::from_bytes(b.freeze()).unwrap();
        f.body
    }

    /// The frame of a call forwarded for `spiffe://t/driver/d1`, byte for byte: the block
    /// (length 23: tag 1, length 20, the identity) before the v1 body, type 0x23 (an
    /// extension request taking extended statuses).
    #[test]
    fn a_forwarded_call_is_the_block_then_the_v1_body_under_type_3() {
        let body = v1_body();
        let mut block = BytesMut::new();
        put_caller_block(&mut block, Some("spiffe://t/driver/d1")).unwrap();
        assert_eq!(&block[..], b"\x00\x17\x01\x00\x14spiffe://t/driver/d1");
        let mut frame = BytesMut::new();
        put_ext_request(&mut frame, Flags::EXT_STATUS, 9, &block, &body);
        assert_eq!(&frame[..6], b"RPCF\x01\x23");
        let f = FrameCodec::default()
            .decode_frame(&mut frame)
            .unwrap()
            .unwrap();
        assert_eq!(f.header.msg_type, MsgType::ExtRequest);
        assert_eq!(f.header.flags, Flags::EXT_STATUS);
        let (fields, inner) = split(&f.body).unwrap();
        assert_eq!(fields.caller, Some("spiffe://t/driver/d1"));
        assert_eq!(inner, body, "the v1 body is untouched");
    }

    /// A deadline of 1.5 s, byte for byte: tag 2, length 4, 1,500,000 µs big-endian; read
    /// back whole, alone or after the caller the broker puts first.
    #[test]
    fn a_deadline_is_four_bytes_of_microseconds_under_tag_2() {
        let block = deadline_block(Duration::from_millis(1500));
        assert_eq!(block, *b"\x00\x07\x02\x00\x04\x00\x16\xe3\x60");
        let body = v1_body();
        let mut b = BytesMut::from(&block[..]);
        b.extend_from_slice(&body);
        let b = b.freeze();
        let (fields, inner) = split(&b).unwrap();
        assert_eq!(fields.deadline, Some(Duration::from_micros(1_500_000)));
        assert_eq!(
            fields.caller, None,
            "no caller field: the sender's own call"
        );
        assert_eq!(inner, body);

        let mut caller = BytesMut::new();
        put_caller_block(&mut caller, Some("spiffe://t/driver/d1")).unwrap();
        let mut frame = BytesMut::new();
        let budget = Some(Duration::from_micros(250));
        put_ext_request_with_deadline(&mut frame, Flags::NONE, 4, &caller, budget, &body);
        let f = FrameCodec::default()
            .decode_frame(&mut frame)
            .unwrap()
            .unwrap();
        let (fields, inner) = split(&f.body).unwrap();
        assert_eq!(fields.caller, Some("spiffe://t/driver/d1"));
        assert_eq!(fields.deadline, Some(Duration::from_micros(250)));
        assert_eq!(inner, body);
        // No caller block: the deadline alone.
        let mut frame = BytesMut::new();
        put_ext_request_with_deadline(&mut frame, Flags::NONE, 4, &[], budget, &body);
        let f = FrameCodec::default()
            .decode_frame(&mut frame)
            .unwrap()
            .unwrap();
        assert_eq!(
            &f.body[..DEADLINE_BLOCK_LEN],
            &deadline_block(Duration::from_micros(250))
        );
        // Past the u32's range: the longest budget; below a microsecond: none left.
        assert_eq!(deadline_micros(Duration::from_secs(10_000)), u32::MAX);
        assert_eq!(deadline_micros(Duration::from_nanos(999)), 0);
        assert!(takes(PROVIDER_FIELDS, DEADLINE_FIELD) && takes(PROVIDER_FIELDS, CALLER_FIELD));
    }

    #[test]
    fn unknown_fields_are_skipped_and_broken_blocks_refused() {
        let body = v1_body();
        // A field of a tag this side does not know (9, 8 bytes) before the caller: skipped.
        let mut b = BytesMut::new();
        b.put_u16(3 + 8 + 3);
        b.put_u8(9);
        b.put_u16(8);
        b.put_u64(5);
        b.put_u8(TAG_CALLER);
        b.put_u16(0);
        b.extend_from_slice(&body);
        let b = b.freeze();
        let (fields, inner) = split(&b).unwrap();
        assert_eq!(fields.caller, Some(""), "an anonymous caller");
        assert_eq!(fields.deadline, None);
        assert_eq!(inner, body);
        for bad in [
            &b"\x00"[..],
            b"\x00\x05\x01\x00",
            b"\x00\x04\x01\x00\x09x",
            b"\x00\x05\x01\x00\x02\xff\xfe",
            // A deadline of 8 bytes, 2 and none: not the 4 a deadline is.
            b"\x00\x0b\x02\x00\x08\x00\x00\x00\x00\x00\x00\x00\x05",
            b"\x00\x05\x02\x00\x02\x00\x05",
            b"\x00\x03\x02\x00\x00",
        ] {
            assert!(split(&Bytes::copy_from_slice(bad)).is_err(), "{bad:?}");
        }
        assert!(takes("caller,deadline", CALLER_FIELD));
        assert!(takes(PROVIDER_FIELDS_CAPPED, DEADLINE_CAP_FIELD));
        assert!(!takes(PROVIDER_FIELDS, DEADLINE_CAP_FIELD));
        assert!(!takes("deadline", CALLER_FIELD));
    }

    #[test]
    fn a_cap_is_decimal_microseconds_and_nothing_else() {
        let cap = Duration::from_millis(5_000);
        assert_eq!(cap_value(cap), "5000000");
        assert_eq!(parse_cap(&cap_value(cap)), Some(cap));
        assert_eq!(
            parse_cap(&cap_value(Duration::from_secs(1 << 40))),
            Some(MAX_DEADLINE)
        );
        for bad in ["", "-1", "5s", "4294967296", " 5", "1.5"] {
            assert_eq!(parse_cap(bad), None, "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn any_caller_and_body_split_back(caller in "[ -~]{0,300}", body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut b = BytesMut::new();
            put_caller_block(&mut b, Some(&caller)).unwrap();
            b.extend_from_slice(&body);
            let b = b.freeze();
            let (fields, inner) = split(&b).unwrap();
            prop_assert_eq!(fields.caller, Some(caller.as_str()));
            prop_assert_eq!(&inner[..], &body[..]);
        }

        #[test]
        fn splitting_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = split(&Bytes::from(bytes));
        }
    }
}
