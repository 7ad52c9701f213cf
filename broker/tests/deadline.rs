//! Calls that carry their caller's deadline (the call extension's `deadline` field,
//! `rpcmesh_wire::ext`), sent by hand to a broker over a plain socket: the broker says in
//! its heartbeat answer that it takes the field, never forwards a call already past its
//! deadline (answered "timeout: deadline exceeded", counted `deadline_exceeded` on the
//! broker), and forwards one with time left.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use bytes::BytesMut;
use rpcmesh_testkit::{echo_request, read_frames};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::ext::{self, deadline_block, put_ext_request};
use rpcmesh_wire::frame::{Flags, Frame, MsgType};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The echo call `id` with `budget` left, as a driver sends it.
fn with_deadline(id: u64, budget: Duration) -> BytesMut {
    let plain = Frame::from_bytes(echo_request(id, "hi").freeze()).unwrap();
    let mut out = BytesMut::new();
    let block = deadline_block(budget);
    put_ext_request(&mut out, Flags::EXT_STATUS, id, &block, &plain.body);
    out
}

/// The expired call is sent first, on one connection to a broker with one connection to
/// its provider: had it been forwarded, the provider would have counted it before the
/// call sent after it, whose answer the test waits for.
#[tokio::test]
async fn a_call_past_its_deadline_is_answered_by_the_broker_and_never_forwarded() {
    let m = mesh(|cfg| cfg.pool_size = 1).await;
    let ok = [("service", "EchoService"), ("status", "ok")];
    let before = m.p.metric("rpcmesh_calls_total", &ok);
    let mut s = TcpStream::connect(m.b.addr).await.unwrap();
    let mut buf = BytesMut::new();

    let mut ask = BytesMut::new();
    Heartbeat::put_now_with(&mut ask, 77, "t", "t", &[(ext::HEARTBEAT_KEY, "")]).unwrap();
    s.write_all(&ask).await.unwrap();
    let answer = read_frames(&mut s, &mut buf, 1).await.unwrap().remove(0);
    assert_eq!(answer.header.msg_type, MsgType::Heartbeat);
    let hb = Heartbeat::parse(&answer.body).unwrap();
    assert_eq!(
        hb.extra_value(ext::HEARTBEAT_KEY),
        Some(ext::DEADLINE_FIELD),
        "a broker takes deadlines from its callers, never callers' identities"
    );

    let mut two = with_deadline(1, Duration::ZERO);
    two.extend_from_slice(&with_deadline(2, Duration::from_secs(10)));
    s.write_all(&two).await.unwrap();
    let replies = read_frames(&mut s, &mut buf, 2).await.unwrap();
    let mut codec = CallCodec::new(None, 1 << 20);
    let by_id = |id: u64| replies.iter().find(|f| f.header.req_id == id).unwrap();
    let expired = codec.decode_response(by_id(1)).unwrap();
    assert_eq!(expired.status, Status::Timeout);
    assert_eq!(
        expired.rpc.error_msg,
        "timeout: deadline exceeded before the broker forwarded the call"
    );
    let served = codec.decode_response(by_id(2)).unwrap();
    assert_eq!(served.status, Status::Success, "{}", served.rpc.error_msg);

    assert_eq!(
        m.p.metric("rpcmesh_calls_total", &ok) - before,
        1.0,
        "only the call with time left reached the provider"
    );
    let dropped = [("kind", "deadline_exceeded"), ("side", "client")];
    assert_eq!(m.b.metric("rpcmesh_errors_total", &dropped), 1.0);
    assert_eq!(m.p.metric("rpcmesh_errors_total", &dropped), 0.0);
    m.stop().await;
}
