//! Every golden frame from the reference implementation decodes, means what its name says,
//! and re-encodes (through the typed bodies, not by copying bytes) to the same bytes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use bytes::{Bytes, BytesMut};
use prost::Message;
use rpcmesh_wire::body::{Heartbeat, Request, Response};
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{Flags, Frame, MsgType};
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use rpcmesh_wire::status::Status;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn vector_files() -> Vec<PathBuf> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![here.join("tests/data/vectors.txt")];
    // The shared copy beside the project, when there is one, is checked too: it is the
    // source of truth, the in-repo copy only makes the test self-contained.
    let shared = here.join("../../../shared/protocol/vectors.txt");
    if shared.exists() {
        files.push(shared);
    }
    files
}

fn vectors() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for f in vector_files() {
        let text = std::fs::read_to_string(&f).expect("read vectors");
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let (name, h) = line.split_once(' ').expect("name hex");
            out.push((name.to_string(), hex(h.trim())));
        }
    }
    assert!(out.len() >= 6, "expected the six reference vectors");
    out
}

fn decode_one(bytes: &[u8]) -> Frame {
    let mut buf = BytesMut::from(bytes);
    let f = FrameCodec::default()
        .decode_frame(&mut buf)
        .expect("valid frame")
        .expect("whole frame");
    assert!(buf.is_empty(), "frame length must be exactly 22 + body_len");
    f
}

fn reencode(f: &Frame) -> Bytes {
    let mut out = BytesMut::new();
    match f.header.msg_type {
        MsgType::Request => Request::parse(&f.body)
            .unwrap()
            .put(&mut out, f.header.flags, f.header.req_id)
            .unwrap(),
        MsgType::Response => Response::parse(&f.body)
            .unwrap()
            .put(&mut out, f.header.flags, f.header.req_id)
            .unwrap(),
        MsgType::Heartbeat => Heartbeat::parse(&f.body)
            .unwrap()
            .put(&mut out, f.header.req_id)
            .unwrap(),
        MsgType::ExtRequest => panic!("the reference implementation has no extension requests"),
    }
    out.freeze()
}

#[test]
fn every_golden_frame_decodes_and_reencodes_byte_for_byte() {
    for (name, bytes) in vectors() {
        let f = decode_one(&bytes);
        assert!(
            f.header.flags.is_empty(),
            "{name}: reference frames are plain v1"
        );
        assert_eq!(&reencode(&f)[..], &bytes[..], "{name}");
        assert_eq!(&f.to_bytes()[..], &bytes[..], "{name}");
    }
}

#[test]
fn golden_frames_mean_what_their_names_say() {
    let mut codec = CallCodec::new(None, 1 << 20);
    for (name, bytes) in vectors() {
        let f = decode_one(&bytes);
        match name.as_str() {
            "echo_request_id1" | "echo_request_trace_id42" => {
                let call = codec.decode_request(&f).unwrap();
                assert_eq!(call.request.service_name(), "EchoService");
                assert_eq!(call.request.method_name(), "Echo");
                let echo = EchoRequest::decode(call.rpc.payload).unwrap();
                assert_eq!(echo.message, "hello");
                if name.ends_with("42") {
                    assert_eq!(f.header.req_id, 42);
                    assert_eq!(
                        call.rpc.metadata.get("trace-id").map(String::as_str),
                        Some("abc123")
                    );
                    // Our encoder produces the same bytes from the same message.
                    let mut out = BytesMut::new();
                    codec
                        .put_request(
                            &mut out,
                            42,
                            Flags::NONE,
                            b"EchoService",
                            b"Echo",
                            &echo,
                            &call.rpc.metadata,
                        )
                        .unwrap();
                    assert_eq!(&out[..], &bytes[..]);
                } else {
                    assert_eq!(f.header.req_id, 1);
                    let mut out = BytesMut::new();
                    codec
                        .put_request(
                            &mut out,
                            1,
                            Flags::NONE,
                            b"EchoService",
                            b"Echo",
                            &echo,
                            &Default::default(),
                        )
                        .unwrap();
                    assert_eq!(&out[..], &bytes[..]);
                }
            }
            "echo_response_ok_id1" => {
                let r = codec.decode_response(&f).unwrap();
                assert_eq!(r.status, Status::Success);
                assert!(r.rpc.success);
                let echo = EchoResponse::decode(r.rpc.payload.clone()).unwrap();
                assert_eq!(echo.message, "hello");
                let mut out = BytesMut::new();
                codec
                    .put_ok_response(&mut out, 1, Flags::NONE, &echo.encode_to_vec())
                    .unwrap();
                assert_eq!(&out[..], &bytes[..]);
            }
            "response_failed_id7" => {
                let r = codec.decode_response(&f).unwrap();
                assert_eq!(r.status, Status::Failed);
                assert!(!r.rpc.success);
                assert_eq!(r.rpc.error_msg, "service not found: Nope");
                let mut out = BytesMut::new();
                rpcmesh_wire::envelope::put_error_response(
                    &mut out,
                    7,
                    Flags::NONE,
                    Status::Failed,
                    &rpcmesh_wire::envelope::service_not_found("Nope"),
                );
                assert_eq!(&out[..], &bytes[..]);
            }
            "heartbeat_id9" => {
                let hb = Heartbeat::parse(&f.body).unwrap();
                assert_eq!(hb.service_name, "client");
                assert_eq!(hb.node_id, "n1");
                assert_eq!(hb.timestamp_ms, 1_700_000_000_000);
                assert!(hb.extra.is_empty());
            }
            "empty_request_id18446744073709551615" => {
                assert_eq!(f.header.req_id, u64::MAX);
                let r = Request::parse(&f.body).unwrap();
                assert_eq!(r.service_name(), "S");
                assert_eq!(r.method_name(), "M");
                assert!(r.payload.is_empty());
            }
            other => {
                // A vector added later: the byte-for-byte test above covers it.
                eprintln!("no semantic check for {other}");
            }
        }
    }
}
