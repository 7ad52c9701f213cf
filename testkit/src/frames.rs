//! Frames made by hand for tests that speak the wire protocol without a client (a plain
//! echo request, a compressed one, one carrying metadata such as a bomb), and reading
//! whole frames off a socket with a bound on each read.

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use rpcmesh_wire::body::Request;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::frame::{Flags, Frame};
use rpcmesh_wire::proto::rpc::{EchoRequest, RpcRequest};

use crate::bad_input::PROBE_TIMEOUT;

/// The header of a request whose body would be 10 MiB (the largest the default allows),
/// alone: what a caller that claims a large frame and sends its body slowly, or never,
/// sends first.
pub fn large_claim(req_id: u64) -> Vec<u8> {
    let mut b = BytesMut::new();
    rpcmesh_wire::frame::Header {
        msg_type: rpcmesh_wire::frame::MsgType::Request,
        flags: Flags::NONE,
        body_len: rpcmesh_wire::frame::DEFAULT_MAX_BODY_LEN,
        req_id,
    }
    .put(&mut b);
    b.to_vec()
}

/// A well-formed echo request frame, no flags.
pub fn echo_request(req_id: u64, message: &str) -> BytesMut {
    let mut b = BytesMut::new();
    let payload = prost::Message::encode_to_vec(&RpcRequest {
        payload: prost::Message::encode_to_vec(&EchoRequest {
            message: message.into(),
        })
        .into(),
        metadata: Default::default(),
    });
    Request {
        service: Bytes::from_static(b"EchoService"),
        method: Bytes::from_static(b"Echo"),
        payload: payload.into(),
    }
    .put(&mut b, Flags::NONE, req_id)
    .expect("a small request encodes");
    b
}

/// A request frame whose payload is the zlib of `RpcRequest { payload: inner }`, flagged
/// `COMPRESSED` plus `flags`: small on the wire whatever `inner` inflates to.
pub fn compressed_request(
    req_id: u64,
    flags: Flags,
    service: &'static str,
    method: &'static str,
    inner: &impl prost::Message,
) -> BytesMut {
    let envelope = prost::Message::encode_to_vec(&RpcRequest {
        payload: prost::Message::encode_to_vec(inner).into(),
        metadata: Default::default(),
    });
    let mut z = BytesMut::new();
    let mut c =
        rpcmesh_wire::compress::Compressor::new(rpcmesh_wire::compress::CompressionConfig {
            threshold: 1,
            level: 6,
        });
    assert!(c.compress_into(&envelope, &mut z), "the payload compresses");
    let mut b = BytesMut::new();
    Request {
        service: Bytes::from_static(service.as_bytes()),
        method: Bytes::from_static(method.as_bytes()),
        payload: z.freeze(),
    }
    .put(&mut b, flags | Flags::COMPRESSED, req_id)
    .expect("a small request encodes");
    b
}

/// Request metadata with `entries` empty entries (`k0`, `k1`...): a "metadata bomb", cheap
/// to send and, without the metadata limit, costly to decode.
pub fn metadata_bomb(entries: usize) -> std::collections::HashMap<String, String> {
    (0..entries)
        .map(|i| (format!("k{i}"), String::new()))
        .collect()
}

/// Appends to `b` an echo request (`"boom"`, flagged [`Flags::EXT_STATUS`]) carrying
/// `metadata`, as a client that sends a [`metadata_bomb`] writes it.
pub fn put_echo_with_metadata(
    b: &mut BytesMut,
    req_id: u64,
    metadata: &std::collections::HashMap<String, String>,
) {
    let msg = EchoRequest {
        message: "boom".into(),
    };
    rpcmesh_wire::envelope::CallCodec::new(None, rpcmesh_wire::compress::DEFAULT_MAX_INFLATED_LEN)
        .put_request(
            b,
            req_id,
            Flags::EXT_STATUS,
            b"EchoService",
            b"Echo",
            &msg,
            metadata,
        )
        .expect("an echo request with its metadata encodes");
}

/// Reads frames from `s` into `buf` until `n` whole ones have arrived (each read waits at
/// most [`PROBE_TIMEOUT`]).
pub async fn read_frames(
    s: &mut TcpStream,
    buf: &mut BytesMut,
    n: usize,
) -> std::io::Result<Vec<Frame>> {
    let codec = FrameCodec::default();
    let mut frames = Vec::new();
    while frames.len() < n {
        while let Some(f) = codec
            .decode_frame(buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?
        {
            frames.push(f);
        }
        if frames.len() >= n {
            break;
        }
        let read = tokio::time::timeout(PROBE_TIMEOUT, s.read_buf(buf))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(frames)
}
