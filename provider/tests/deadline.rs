//! Calls that carry their caller's deadline (the call extension's `deadline` field,
//! `rpcmesh_wire::ext`), sent by hand over a plain socket: the provider says in its
//! heartbeat answer that it takes the field, never starts a call whose deadline has
//! passed (answered "timeout: deadline exceeded", counted `deadline_exceeded`), and serves
//! one with time left as the plain call inside.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::BytesMut;
use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::{InProcess, echo_request, read_frames};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::ext::{self, deadline_block, put_ext_request};
use rpcmesh_wire::frame::{Flags, Frame, MsgType};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

async fn start() -> InProcess<ServeSummary> {
    InProcess::start(|l, t, s| {
        let registry = rpcmesh_provider::Registry::builtin();
        rpcmesh_provider::run_with(ProviderConfig::default(), registry, t, l, s)
    })
    .await
}

/// The echo call `id` with `budget` left, as a driver sends it.
fn with_deadline(id: u64, budget: Duration) -> BytesMut {
    let plain = Frame::from_bytes(echo_request(id, "hi").freeze()).unwrap();
    let mut out = BytesMut::new();
    let block = deadline_block(budget);
    put_ext_request(&mut out, Flags::EXT_STATUS, id, &block, &plain.body);
    out
}

#[tokio::test]
async fn the_provider_says_it_takes_deadlines_and_never_starts_a_call_past_one() {
    let p = start().await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let mut buf = BytesMut::new();

    let mut ask = BytesMut::new();
    Heartbeat::put_now_with(&mut ask, 77, "t", "t", &[(ext::HEARTBEAT_KEY, "")]).unwrap();
    s.write_all(&ask).await.unwrap();
    let answer = read_frames(&mut s, &mut buf, 1).await.unwrap().remove(0);
    assert_eq!(answer.header.msg_type, MsgType::Heartbeat);
    let hb = Heartbeat::parse(&answer.body).unwrap();
    let fields = hb.extra_value(ext::HEARTBEAT_KEY).unwrap();
    assert!(ext::takes(fields, ext::DEADLINE_FIELD), "{fields}");

    // No time left, then plenty, on one connection: the first is answered without being
    // started, and the second, read after it, is served.
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
        "timeout: deadline exceeded before the provider started the call"
    );
    let served = codec.decode_response(by_id(2)).unwrap();
    assert_eq!(served.status, Status::Success, "{}", served.rpc.error_msg);

    let dropped = p.metric(
        "rpcmesh_errors_total",
        &[("kind", "deadline_exceeded"), ("side", "client")],
    );
    assert_eq!(dropped, 1.0);
    // The echo handler ran once: for the call with time left.
    let ran = p.metric(
        "rpcmesh_calls_total",
        &[("service", "EchoService"), ("status", "ok")],
    );
    assert_eq!(ran, 1.0);
    assert_eq!(
        p.metric("rpcmesh_calls_total", &[("status", "timeout")]),
        1.0
    );
    p.stop().await;
}

/// The answer to a heartbeat carrying `extra`, on `s`: the fields the provider says it
/// takes.
async fn ask_fields(s: &mut TcpStream, buf: &mut BytesMut, extra: &[(&str, &str)]) -> String {
    let mut ask = BytesMut::new();
    Heartbeat::put_now_with(&mut ask, 77, "t", "t", extra).unwrap();
    s.write_all(&ask).await.unwrap();
    let answer = read_frames(s, buf, 1).await.unwrap().remove(0);
    let hb = Heartbeat::parse(&answer.body).unwrap();
    hb.extra_value(ext::HEARTBEAT_KEY).unwrap().to_string()
}

/// The statuses of the answers to `frames`, sent in one write, by request id.
async fn statuses(s: &mut TcpStream, buf: &mut BytesMut, frames: &[BytesMut]) -> Vec<Status> {
    let all: Vec<u8> = frames.iter().flat_map(|f| f.iter().copied()).collect();
    s.write_all(&all).await.unwrap();
    let mut replies = read_frames(s, buf, frames.len()).await.unwrap();
    replies.sort_by_key(|f| f.header.req_id);
    let mut codec = CallCodec::new(None, 1 << 20);
    replies
        .iter()
        .map(|f| codec.decode_response(f).unwrap().status)
        .collect()
}

/// A broker gives a cap in its heartbeats (`ext::CAP_KEY`, its call timeout): every call on
/// that connection then has at most that budget, a plain one and one whose own deadline is
/// longer alike, so that the broker may forward calls as they came. A cap of 0 drops both
/// unstarted; the provider says it applies the cap only where it was given one, and a
/// call's own shorter deadline still wins.
#[tokio::test]
async fn a_connections_cap_bounds_every_call_on_it_and_only_there() {
    let p = start().await;
    let plain = |id: u64| echo_request(id, "hi");
    let long = |id: u64| with_deadline(id, Duration::from_secs(10));
    let none_left = |id: u64| with_deadline(id, Duration::ZERO);

    // Without a cap: the provider does not say it takes one, and both calls run.
    let (mut s, mut buf) = (TcpStream::connect(p.addr).await.unwrap(), BytesMut::new());
    let fields = ask_fields(&mut s, &mut buf, &[(ext::HEARTBEAT_KEY, "")]).await;
    assert!(!ext::takes(&fields, ext::DEADLINE_CAP_FIELD), "{fields}");
    let got = statuses(&mut s, &mut buf, &[plain(1), long(2)]).await;
    assert_eq!(got, [Status::Success, Status::Success]);

    // A cap of 0 on another connection: both are dropped unstarted.
    let (mut c, mut cbuf) = (TcpStream::connect(p.addr).await.unwrap(), BytesMut::new());
    let zero = ext::cap_value(Duration::ZERO);
    let ask = [(ext::HEARTBEAT_KEY, ""), (ext::CAP_KEY, zero.as_str())];
    let fields = ask_fields(&mut c, &mut cbuf, &ask).await;
    assert!(ext::takes(&fields, ext::DEADLINE_CAP_FIELD), "{fields}");
    let got = statuses(&mut c, &mut cbuf, &[plain(3), long(4)]).await;
    assert_eq!(got, [Status::Timeout, Status::Timeout]);

    // The first connection is still uncapped; a cap of 10 s on the second lets its plain
    // call run, and a call's own deadline, shorter, still wins.
    let got = statuses(&mut s, &mut buf, &[plain(5)]).await;
    assert_eq!(got, [Status::Success]);
    let ten = ext::cap_value(Duration::from_secs(10));
    let ask = [(ext::HEARTBEAT_KEY, ""), (ext::CAP_KEY, ten.as_str())];
    ask_fields(&mut c, &mut cbuf, &ask).await;
    let got = statuses(&mut c, &mut cbuf, &[plain(6), none_left(7)]).await;
    assert_eq!(got, [Status::Success, Status::Timeout]);

    let dropped = p.metric(
        "rpcmesh_errors_total",
        &[("kind", "deadline_exceeded"), ("side", "client")],
    );
    assert_eq!(dropped, 3.0);
    p.stop().await;
}
