//! Splits a byte stream into [`Frame`]s: the frame decoder every connection uses.
//!
//! Owns the stream-level rules: the body-length limit, checked on the header *before*
//! anything is read of the body (room for it is the reader's to make, as its bytes
//! arrive, never on the header's claim); zero-copy bodies (each frame is `split_to` off the
//! read buffer and frozen, so bodies are `Bytes` slices of it); and what happens to bad
//! input. It leaves the meaning of a frame to [`crate::frame`] and sockets to the net layer
//! (`rpcmesh_common::net::connection`).
//!
//! Bad input, and what the decoder does (see `docs/protocol.md`):
//!
//! | input                        | result                                   | stream |
//! |------------------------------|------------------------------------------|--------|
//! | junk, then a magic, within the buffered bytes (at most 1 KiB looked at) | junk dropped, [`FrameError::Resynced`] | goes on |
//! | no magic in the first 1 KiB / bytes that cannot start one | [`FrameError::BadMagic`] | fatal |
//! | version other than 1         | [`FrameError::BadVersion`]               | fatal  |
//! | `body_len` over the limit    | [`FrameError::TooLarge`] (with `req_id`) | fatal  |
//! | CRC mismatch                 | frame dropped, [`FrameError::Crc`]       | goes on |
//! | unknown type / reserved bit  | frame dropped, [`FrameError::UnknownType`] | goes on |
//! | end of stream inside a frame | [`FrameError::Truncated`]                | fatal  |

use bytes::{Buf, BytesMut};

use crate::frame::{
    DEFAULT_MAX_BODY_LEN, FRAME_OVERHEAD, Frame, FrameError, HEADER_LEN, Header, MAGIC, MsgType,
    Prefix, VERSION,
};

/// How far past a bad magic the decoder looks for the next one before giving up on the
/// stream: 1 KiB, the same distance existing RPCF v1 peers scan.
pub const RESYNC_SCAN_LIMIT: usize = 1024;

const MAGIC_BYTES: [u8; 4] = MAGIC.to_be_bytes();

/// Decoder of RPCF v1 frames with a body-length limit (frames are written by `frame`).
#[derive(Clone, Copy, Debug)]
pub struct FrameCodec {
    max_body_len: u32,
}

impl Default for FrameCodec {
    fn default() -> Self {
        FrameCodec::new(DEFAULT_MAX_BODY_LEN)
    }
}

impl FrameCodec {
    /// A codec that refuses bodies longer than `max_body_len` bytes.
    pub fn new(max_body_len: u32) -> Self {
        FrameCodec { max_body_len }
    }

    /// Takes the next frame off the front of `src`, if a whole one is there.
    ///
    /// `Ok(None)` means more bytes are needed (nothing is reserved for them: the reader
    /// makes room as they arrive). On an error that is not
    /// [fatal](FrameError::is_fatal) the offending bytes have been consumed and the caller
    /// may call again.
    pub fn decode_frame(&self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        Ok(self.peek_frame(src)?.map(|h| split_frame(src, h)))
    }

    /// As [`decode_frame`](Self::decode_frame), but a whole frame that passes its checks is
    /// left where it lies and only its header returned: the caller reads the body in place
    /// ([`body_in_place`]), then drops the frame ([`skip_frame`]) or takes it
    /// ([`split_frame`]). A reply the broker copies straight to its caller needs no frame
    /// of its own, nor a reference to the read buffer. Errors consume the bad bytes as
    /// `decode_frame` does.
    pub fn peek_frame(&self, src: &mut BytesMut) -> Result<Option<Header>, FrameError> {
        if src.len() < HEADER_LEN {
            // Catch garbage early, without waiting for 18 bytes that may never come.
            let n = src.len().min(4);
            if src[..n] != MAGIC_BYTES[..n] {
                return Err(self.resync(src));
            }
            return Ok(None);
        }
        let p = Prefix::read(src);
        if p.magic != MAGIC {
            return Err(self.resync(src));
        }
        if p.version != VERSION {
            return Err(FrameError::BadVersion { version: p.version });
        }
        if p.body_len > self.max_body_len {
            return Err(FrameError::TooLarge {
                body_len: p.body_len,
                max: self.max_body_len,
                req_id: p.req_id,
                raw_type: p.raw_type,
            });
        }
        let total = FRAME_OVERHEAD + p.body_len as usize;
        if src.len() < total {
            // Nothing reserved on the header's claim: a thousand headers claiming 10 MiB
            // each cost nothing until the bytes come, and the reader grows its buffer as
            // they do, within its memory budget (`rpcmesh_common::net::connection`).
            return Ok(None);
        }
        // Checked where it lies; a bad frame's bytes are gone.
        match Frame::check(&src[..total], &p) {
            Ok(header) => Ok(Some(header)),
            Err(e) => {
                src.advance(total);
                Err(e)
            }
        }
    }

    /// The header of the frame at the front of `src` while its body is still on its way,
    /// when it is a call: what a reader may decide on before the body comes (a call it
    /// refuses whatever the body holds, whose bytes it then drops as they arrive rather
    /// than buffer them). `None` unless `src` holds a whole header that
    /// [`peek_frame`](Self::peek_frame) would take, of a request or an extension request,
    /// and less than the whole frame. Its CRC, not yet there, is not checked.
    pub fn pending_call(&self, src: &[u8]) -> Option<Header> {
        if src.len() < HEADER_LEN {
            return None;
        }
        let p = Prefix::read(src);
        if p.magic != MAGIC
            || p.version != VERSION
            || p.body_len > self.max_body_len
            || src.len() >= FRAME_OVERHEAD + p.body_len as usize
        {
            return None;
        }
        p.header()
            .ok()
            .filter(|h| matches!(h.msg_type, MsgType::Request | MsgType::ExtRequest))
    }

    /// The stream does not start with a magic: drop junk up to the next magic found in
    /// the first [`RESYNC_SCAN_LIMIT`] buffered bytes, or give up.
    fn resync(&self, src: &mut BytesMut) -> FrameError {
        let found = {
            let mut b = [0u8; 4];
            let n = src.len().min(4);
            b[..n].copy_from_slice(&src[..n]);
            u32::from_be_bytes(b)
        };
        // The next offset where a magic starts, or where the buffered bytes end in the
        // beginning of one (the rest may still be on its way).
        let limit = src.len().min(RESYNC_SCAN_LIMIT);
        let next = (1..limit).find(|&i| {
            let w = &src[i..src.len().min(i + 4)];
            w == &MAGIC_BYTES[..w.len()]
        });
        match next {
            Some(skipped) => {
                src.advance(skipped);
                FrameError::Resynced { skipped }
            }
            None => FrameError::BadMagic { found },
        }
    }

    /// Called when the stream ended: leftover bytes are a cut-off frame.
    pub fn check_eof(&self, src: &BytesMut) -> Result<(), FrameError> {
        if src.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated {
                buffered: src.len(),
            })
        }
    }
}

/// The body of the frame [`FrameCodec::peek_frame`] found at the front of `src`.
pub fn body_in_place<'a>(src: &'a BytesMut, header: &Header) -> &'a [u8] {
    &src[HEADER_LEN..HEADER_LEN + header.body_len as usize]
}

/// The CRC trailer, as received (already checked), of the frame [`FrameCodec::peek_frame`]
/// found at the front of `src`: a forwarder that only changes the frame's id to a neutral
/// one (`crate::neutral`) writes it unchanged.
pub fn trailer_in_place(src: &[u8], header: &Header) -> u32 {
    let at = HEADER_LEN + header.body_len as usize;
    u32::from_be_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]])
}

/// Drops the frame [`FrameCodec::peek_frame`] found at the front of `src`.
pub fn skip_frame(src: &mut BytesMut, header: &Header) {
    src.advance(FRAME_OVERHEAD + header.body_len as usize);
}

/// Takes the frame [`FrameCodec::peek_frame`] found at the front of `src`: the body is
/// cut out of the split part in place, so that the frame shares the read buffer through
/// one reference, not two.
pub fn split_frame(src: &mut BytesMut, header: Header) -> Frame {
    split_frame_with_trailer(src, header).0
}

/// As [`split_frame`], and the frame's CRC trailer as received (already checked), for a
/// forwarder that gives the frame another id and keeps its CRC (`crate::neutral`).
pub fn split_frame_with_trailer(src: &mut BytesMut, header: Header) -> (Frame, u32) {
    let len = header.body_len as usize;
    let mut frame = src.split_to(FRAME_OVERHEAD + len);
    let trailer = trailer_in_place(&frame, &header);
    frame.advance(HEADER_LEN);
    frame.truncate(len);
    let frame = Frame {
        header,
        body: frame.freeze(),
    };
    (frame, trailer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::Request;
    use crate::frame::Flags;
    use bytes::Bytes;

    #[test]
    fn a_call_whose_body_is_still_coming_shows_its_header_and_nothing_else_does() {
        let codec = FrameCodec::default();
        let whole = req(5, b"a payload");
        let h = codec.pending_call(&whole[..HEADER_LEN + 3]).unwrap();
        assert_eq!((h.msg_type, h.req_id), (MsgType::Request, 5));
        assert_eq!(h.body_len as usize, whole.len() - FRAME_OVERHEAD);
        let names = crate::body::request_names_head(&whole[HEADER_LEN..]).unwrap();
        assert_eq!(&whole[HEADER_LEN..][names.0], b"S");
        assert_eq!(
            codec.pending_call(&whole[..HEADER_LEN - 1]),
            None,
            "no header yet"
        );
        assert_eq!(codec.pending_call(&whole), None, "whole: peek_frame's");
        let mut beat = BytesMut::new();
        crate::body::Heartbeat::put_now(&mut beat, 1, "a", "0").unwrap();
        assert_eq!(codec.pending_call(&beat[..HEADER_LEN]), None, "not a call");
        let mut bad = whole.clone();
        bad[0] ^= 0xff;
        assert_eq!(codec.pending_call(&bad[..HEADER_LEN]), None, "not a frame");
    }

    fn req(id: u64, payload: &'static [u8]) -> BytesMut {
        let mut b = BytesMut::new();
        Request {
            service: Bytes::from_static(b"S"),
            method: Bytes::from_static(b"M"),
            payload: Bytes::from_static(payload),
        }
        .put(&mut b, Flags::NONE, id)
        .unwrap();
        b
    }

    #[test]
    fn body_len_over_the_limit_is_refused_before_reserving() {
        let codec = FrameCodec::new(16);
        let mut b = req(1, &[0u8; 64]);
        b.truncate(HEADER_LEN);
        let cap_before = b.capacity();
        let e = codec.decode_frame(&mut b).unwrap_err();
        assert!(matches!(e, FrameError::TooLarge { req_id: 1, .. }));
        assert!(e.is_fatal());
        assert_eq!(b.capacity(), cap_before);
    }

    #[test]
    fn partial_frames_wait_for_more_bytes() {
        let codec = FrameCodec::default();
        let whole = req(2, b"hello");
        for cut in 0..whole.len() {
            let mut b = BytesMut::from(&whole[..cut]);
            assert!(
                codec.decode_frame(&mut b).unwrap().is_none(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn junk_before_a_frame_is_skipped() {
        let codec = FrameCodec::default();
        let mut b = BytesMut::from(&b"xyzRPC"[..]);
        b.extend_from_slice(&req(3, b"p"));
        let e = codec.decode_frame(&mut b).unwrap_err();
        assert!(matches!(e, FrameError::Resynced { skipped: 6 }));
        let f = codec.decode_frame(&mut b).unwrap().unwrap();
        assert_eq!(f.header.req_id, 3);
    }

    #[test]
    fn garbage_without_magic_is_fatal() {
        let codec = FrameCodec::default();
        let mut b = BytesMut::from(&b"GET / HTTP/1.1\r\n\r\n"[..]);
        let e = codec.decode_frame(&mut b).unwrap_err();
        assert!(matches!(e, FrameError::BadMagic { .. }));
        assert!(e.is_fatal());
    }

    #[test]
    fn crc_error_consumes_the_frame_and_decoding_goes_on() {
        let codec = FrameCodec::default();
        let mut bad = req(4, b"x");
        let n = bad.len();
        bad[n - 1] ^= 1;
        bad.extend_from_slice(&req(5, b"y"));
        let e = codec.decode_frame(&mut bad).unwrap_err();
        assert_eq!(e.request_id(), Some(4));
        assert_eq!(
            codec.decode_frame(&mut bad).unwrap().unwrap().header.req_id,
            5
        );
    }

    #[test]
    fn eof_inside_a_frame_is_truncated() {
        let codec = FrameCodec::default();
        let whole = req(6, b"abc");
        let mut b = BytesMut::from(&whole[..whole.len() - 2]);
        assert!(matches!(
            codec.decode_frame(&mut b).and_then(|_| codec.check_eof(&b)),
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn bodies_are_slices_of_the_read_buffer() {
        let codec = FrameCodec::default();
        let mut b = req(7, b"zero-copy");
        b.extend_from_slice(&req(8, b"second"));
        let base = b.as_ptr() as usize;
        let end = base + b.len();
        let f = codec.decode_frame(&mut b).unwrap().unwrap();
        let p = f.body.as_ptr() as usize;
        assert!(p >= base && p < end, "body was copied");
    }
}
