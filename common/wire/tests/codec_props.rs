//! Property tests of the wire layer: arbitrary frames round-trip through the codec however
//! the stream is cut, and arbitrary bytes never panic the decoder: every input ends in
//! frames, a request for more bytes, or a typed error.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use rpcmesh_wire::body::{Heartbeat, Request, Response};
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::frame::{Flags, Frame, FrameError, MsgType};

#[derive(Debug, Clone)]
enum Body {
    Request {
        service: String,
        method: String,
        payload: Vec<u8>,
    },
    Response {
        status: u8,
        payload: Vec<u8>,
    },
    Heartbeat(Heartbeat),
}

fn name() -> impl Strategy<Value = String> {
    "[A-Za-z][A-Za-z0-9_.]{0,20}|\\PC{0,8}"
}

fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        (
            name(),
            name(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(service, method, payload)| Body::Request {
                service,
                method,
                payload
            }),
        (0u8..6, proptest::collection::vec(any::<u8>(), 0..300))
            .prop_map(|(status, payload)| Body::Response { status, payload }),
        (
            name(),
            name(),
            any::<u64>(),
            proptest::collection::vec((name(), name()), 0..4)
        )
            .prop_map(
                |(service_name, node_id, timestamp_ms, extra)| Body::Heartbeat(Heartbeat {
                    service_name,
                    node_id,
                    timestamp_ms,
                    extra
                })
            ),
    ]
}

fn flags() -> impl Strategy<Value = Flags> {
    prop_oneof![
        Just(Flags::NONE),
        Just(Flags::COMPRESSED),
        Just(Flags::EXT_STATUS | Flags::ACCEPT_COMPRESSED),
        // Every request flag (NOT_RUN is a response flag: a request with it is skipped).
        Just(Flags::ALL.without(Flags::NOT_RUN)),
    ]
}

fn encode(b: &Body, flags: Flags, id: u64, out: &mut BytesMut) {
    match b {
        Body::Request {
            service,
            method,
            payload,
        } => Request {
            service: Bytes::from(service.clone()),
            method: Bytes::from(method.clone()),
            payload: Bytes::from(payload.clone()),
        }
        .put(out, flags, id)
        .unwrap(),
        Body::Response { status, payload } => Response {
            status: *status,
            payload: Bytes::from(payload.clone()),
        }
        .put(out, flags, id)
        .unwrap(),
        Body::Heartbeat(h) => h.put(out, id).unwrap(),
    }
}

fn check(b: &Body, flags: Flags, id: u64, f: &Frame) {
    assert_eq!(f.header.req_id, id);
    match b {
        Body::Request {
            service,
            method,
            payload,
        } => {
            assert_eq!(f.header.msg_type, MsgType::Request);
            assert_eq!(f.header.flags, flags);
            let r = Request::parse(&f.body).unwrap();
            assert_eq!(r.service_name(), service);
            assert_eq!(r.method_name(), method);
            assert_eq!(&r.payload[..], &payload[..]);
        }
        Body::Response { status, payload } => {
            assert_eq!(f.header.msg_type, MsgType::Response);
            let r = Response::parse(&f.body).unwrap();
            assert_eq!(r.status, *status);
            assert_eq!(&r.payload[..], &payload[..]);
        }
        Body::Heartbeat(h) => {
            assert_eq!(f.header.msg_type, MsgType::Heartbeat);
            assert_eq!(&Heartbeat::parse(&f.body).unwrap(), h);
        }
    }
}

proptest! {
    #[test]
    fn frames_round_trip_however_the_stream_is_cut(
        frames in proptest::collection::vec((body(), flags(), any::<u64>()), 1..8),
        cuts in proptest::collection::vec(1usize..64, 0..40),
    ) {
        let mut stream = BytesMut::new();
        for (b, f, id) in &frames {
            encode(b, *f, *id, &mut stream);
        }
        let stream = stream.freeze();
        let codec = FrameCodec::default();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        let mut at = 0;
        let mut cuts = cuts.into_iter();
        while at < stream.len() {
            let n = cuts.next().unwrap_or(usize::MAX).min(stream.len() - at);
            buf.extend_from_slice(&stream[at..at + n]);
            at += n;
            while let Some(f) = codec.decode_frame(&mut buf).unwrap() {
                got.push(f);
            }
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got.len(), frames.len());
        for ((b, f, id), frame) in frames.iter().zip(&got) {
            let flags = if matches!(b, Body::Heartbeat(_)) { Flags::NONE } else { *f };
            check(b, flags, *id, frame);
            // and re-encoding the decoded frame gives the same bytes
            let mut again = BytesMut::new();
            encode(b, flags, *id, &mut again);
            prop_assert_eq!(frame.to_bytes(), again.freeze());
        }
    }

    /// Whatever the bytes, each call of the decoder either takes a frame within the limit
    /// or skips bad bytes (both consume input), or asks for more, or gives up on the
    /// stream: it always reaches a verdict, never loops in place.
    #[test]
    fn arbitrary_bytes_are_consumed_until_a_request_for_more_or_a_fatal_error(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        max in 0u32..4096,
    ) {
        let codec = FrameCodec::new(max);
        let mut buf = BytesMut::from(&bytes[..]);
        let mut verdict = None;
        for _ in 0..=bytes.len() {
            let before = buf.len();
            match codec.decode_frame(&mut buf) {
                Ok(Some(f)) => {
                    prop_assert!(f.header.body_len <= max, "a frame over the limit was taken");
                    prop_assert!(buf.len() < before, "a frame consumed no bytes");
                }
                Ok(None) => {
                    verdict = Some("more bytes needed");
                    break;
                }
                Err(e) if e.is_fatal() => {
                    verdict = Some("fatal");
                    break;
                }
                Err(e) => prop_assert!(buf.len() < before, "{} consumed no bytes", e),
            }
        }
        prop_assert!(verdict.is_some(), "no verdict after {} calls", bytes.len() + 1);
    }

    #[test]
    fn a_frame_with_junk_in_front_or_flipped_bits_never_panics(
        prefix in proptest::collection::vec(any::<u8>(), 0..64),
        flip in any::<(usize, u8)>(),
        payload in proptest::collection::vec(any::<u8>(), 0..100),
    ) {
        let mut frame = BytesMut::new();
        Request {
            service: Bytes::from_static(b"EchoService"),
            method: Bytes::from_static(b"Echo"),
            payload: Bytes::from(payload),
        }
        .put(&mut frame, Flags::NONE, 77)
        .unwrap();
        let i = flip.0 % frame.len();
        frame[i] ^= flip.1 | 1;
        let mut buf = BytesMut::from(&prefix[..]);
        buf.extend_from_slice(&frame);
        let codec = FrameCodec::default();
        for _ in 0..256 {
            match codec.decode_frame(&mut buf) {
                Ok(Some(f)) => { let _ = Request::parse(&f.body); }
                Ok(None) => break,
                Err(e @ (FrameError::Resynced { .. } | FrameError::Crc { .. } | FrameError::UnknownType { .. })) => {
                    prop_assert!(!e.is_fatal());
                }
                Err(e) => {
                    let expected = e.is_fatal() || matches!(e, FrameError::BadBody { .. });
                    prop_assert!(expected, "unexpected error {}", e);
                    break;
                }
            }
        }
    }
}
