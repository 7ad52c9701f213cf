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
//! | 2   | `deadline` | reserved for the call's deadline |
//!
//! A peer says which fields it takes in its heartbeat answer ([`HEARTBEAT_KEY`]), and only
//! rpcmesh providers are asked, so a plain v1 server never sees this type; nor does any
//! client, since replies are plain responses. The broker never decodes or inflates the
//! payload it forwards: it writes the block before the request's body, whose bytes it
//! copies as before, and the frame's CRC covers both.

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
/// Tag reserved for the call's deadline.
pub const TAG_DEADLINE: u8 = 2;
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

/// The fields of an extension block, as far as this side knows them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fields<'a> {
    /// The forwarded caller: `Some("")` for an anonymous one; `None` when absent.
    pub caller: Option<&'a str>,
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

/// Splits an extension request's body into its fields and the v1 request body (a slice of
/// `body`, no copy). Malformed: a block longer than the body or than [`MAX_BLOCK_LEN`], a
/// field running past the block, a caller that is not UTF-8 or is too long.
pub fn split(body: &Bytes) -> Result<(Fields<'_>, Bytes), FrameError> {
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
        }
        block = rest;
    }
    Ok((fields, body.slice(2 + len..)))
}

/// Whether a heartbeat answer's [`HEARTBEAT_KEY`] value lists `field`.
pub fn takes(value: &str, field: &str) -> bool {
    value.split(',').any(|f| f.trim() == field)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::Request;
    use crate::codec::FrameCodec;
    use proptest::prelude::*;

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

    #[test]
    fn unknown_fields_are_skipped_and_broken_blocks_refused() {
        let body = v1_body();
        // A deadline field (tag 2, 8 bytes) before the caller: skipped by this side.
        let mut b = BytesMut::new();
        b.put_u16(3 + 8 + 3);
        b.put_u8(TAG_DEADLINE);
        b.put_u16(8);
        b.put_u64(5);
        b.put_u8(TAG_CALLER);
        b.put_u16(0);
        b.extend_from_slice(&body);
        let b = b.freeze();
        let (fields, inner) = split(&b).unwrap();
        assert_eq!(fields.caller, Some(""), "an anonymous caller");
        assert_eq!(inner, body);
        for bad in [
            &b"\x00"[..],
            b"\x00\x05\x01\x00",
            b"\x00\x04\x01\x00\x09x",
            b"\x00\x05\x01\x00\x02\xff\xfe",
        ] {
            assert!(split(&Bytes::copy_from_slice(bad)).is_err(), "{bad:?}");
        }
        assert!(takes("caller,deadline", CALLER_FIELD));
        assert!(!takes("deadline", CALLER_FIELD));
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
