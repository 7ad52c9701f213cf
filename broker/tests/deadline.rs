//! Calls that carry their caller's deadline (the call extension's `deadline` field,
//! `rpcmesh_wire::ext`), sent by hand to a broker over a plain socket: the broker says in
//! its heartbeat answer that it takes the field, never forwards a call already past its
//! deadline (answered "timeout: deadline exceeded", counted `deadline_exceeded` on the
//! broker), and forwards one with time left.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
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
    let fields = hb.extra_value(ext::HEARTBEAT_KEY).unwrap();
    assert!(
        ext::takes(fields, ext::DEADLINE_FIELD) && !ext::takes(fields, ext::CALLER_FIELD),
        "a broker takes deadlines from its callers, never callers' identities: {fields}"
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

/// What a [`recording_upstream`] saw of each call: its type, and its body as it came.
type Seen = Arc<std::sync::Mutex<Vec<(u64, MsgType, bytes::Bytes)>>>;

/// A provider played by hand: it answers every heartbeat saying it takes the call fields
/// `fields` (`ext::HEARTBEAT_KEY`), records every call as it arrives, and answers each
/// with an empty success.
async fn recording_upstream(fields: &'static str) -> (std::net::SocketAddr, Seen) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let (mut s, mut buf) = (s, BytesMut::new());
                let mut codec = CallCodec::new(None, 1 << 20);
                while let Ok(frames) = read_frames(&mut s, &mut buf, 1).await {
                    let mut out = BytesMut::new();
                    for f in frames {
                        let id = f.header.req_id;
                        match f.header.msg_type {
                            MsgType::Heartbeat => {
                                let extra = [(ext::HEARTBEAT_KEY, fields)];
                                Heartbeat::put_now_with(&mut out, id, "p", "p", &extra).unwrap();
                            }
                            MsgType::Request | MsgType::ExtRequest => {
                                let (t, body) = (f.header.msg_type, f.body.clone());
                                record.lock().unwrap().push((id, t, body));
                                codec
                                    .put_ok_response(&mut out, id, Flags::NONE, &[])
                                    .unwrap();
                            }
                            MsgType::Response => {}
                        }
                    }
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// What reaches `fields`' upstream through a broker (call timeout 5 s, one pooled
/// connection) of a plain call, one whose deadline (10 s) is past the call timeout and one
/// within it (1 s), sent by hand in one write: each call's type and body as it arrived.
/// The calls of one read go to one upstream connection, in order.
async fn forwarded(fields: &'static str, engine: Engine) -> Vec<(MsgType, bytes::Bytes)> {
    let (up, seen) = recording_upstream(fields).await;
    let mut cfg = broker_config(&[up]);
    cfg.pool_size = 1;
    let b = broker_with(engine, cfg).await;
    until_ready(&client(b.addr()).await).await;
    let warm = seen.lock().unwrap().len();
    let mut s = TcpStream::connect(b.addr()).await.unwrap();
    let mut buf = BytesMut::new();
    s.write_all(&three_calls().concat()).await.unwrap();
    let replies = read_frames(&mut s, &mut buf, 3).await.unwrap();
    assert!(
        replies
            .iter()
            .all(|r| r.header.msg_type == MsgType::Response)
    );
    b.stop().await;
    let seen = seen.lock().unwrap()[warm..].to_vec();
    assert_eq!(seen.len(), 3, "{seen:?}");
    seen.into_iter().map(|(_, t, body)| (t, body)).collect()
}

/// A plain call, one with a deadline past the broker's call timeout, one within it.
fn three_calls() -> [BytesMut; 3] {
    [
        echo_request(1, "hi"),
        with_deadline(2, Duration::from_secs(10)),
        with_deadline(3, Duration::from_secs(1)),
    ]
}

/// A provider that caps every call on a broker's connection at the broker's call timeout
/// (`ext::CAP_KEY`) gets each call as its caller sent it: the plain call plain, both
/// deadline blocks as they came (no re-encoding, no CRC pass in the broker). One that does
/// not gets every call with the time left to it: the call timeout, or the caller's own
/// shorter deadline. On both engines.
#[tokio::test]
async fn a_provider_that_caps_calls_gets_them_as_they_came() {
    for engine in ENGINES {
        provider_gets_calls_as_they_came(engine).await;
    }
}

async fn provider_gets_calls_as_they_came(engine: Engine) {
    let capped = forwarded(ext::PROVIDER_FIELDS_CAPPED, engine).await;
    let body = |f: &BytesMut| Frame::from_bytes(f.clone().freeze()).unwrap().body;
    let [plain, long, short] = three_calls();
    assert_eq!(capped[0], (MsgType::Request, body(&plain)));
    // A deadline past the call timeout goes as it came too: the provider takes the
    // earlier of it and the cap.
    assert_eq!(capped[1], (MsgType::ExtRequest, body(&long)));
    assert_eq!(capped[2], (MsgType::ExtRequest, body(&short)));

    let uncapped = forwarded(ext::PROVIDER_FIELDS, engine).await;
    let deadline = |(t, body): &(MsgType, bytes::Bytes)| {
        assert_eq!(*t, MsgType::ExtRequest);
        ext::split(body).unwrap().0.deadline.unwrap()
    };
    let timeout = rpcmesh_broker::config::DEFAULT_CALL_TIMEOUT;
    let (plain, long, short) = (
        deadline(&uncapped[0]),
        deadline(&uncapped[1]),
        deadline(&uncapped[2]),
    );
    assert!(plain <= timeout && plain > timeout / 2, "{plain:?}");
    assert!(long <= timeout && long > timeout / 2, "{long:?}");
    assert!(
        short <= Duration::from_secs(1) && short > Duration::from_millis(500),
        "{short:?}"
    );
}
