//! Calls a broker forwards with its caller's identity (frame type 3, `rpcmesh_wire::ext`),
//! sent by hand over plain sockets: without a policy the call inside is served as it is;
//! with one, a peer that is no forwarder (here an anonymous plaintext one) is never
//! believed (a call carrying only a deadline names no one, and is the peer's own); a block
//! that does not add up is answered "bad request", not left unanswered.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::{Bytes, BytesMut};
use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::{InProcess, echo_request, read_frames};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Response;
use rpcmesh_wire::ext::{deadline_block, put_caller_block, put_ext_request};
use rpcmesh_wire::frame::{Flags, Frame};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

async fn start(config: ProviderConfig) -> InProcess<ServeSummary> {
    InProcess::start(|l, t, s| {
        rpcmesh_provider::run_with(config, rpcmesh_provider::Registry::builtin(), t, l, s)
    })
    .await
}

/// The echo call `id` forwarded for `caller`, with the given block (or a proper one).
fn forwarded(id: u64, caller: &str, block: Option<&[u8]>) -> BytesMut {
    let plain = Frame::from_bytes(echo_request(id, "hi").freeze()).unwrap();
    let mut b = BytesMut::new();
    put_caller_block(&mut b, Some(caller)).unwrap();
    let block = block.map_or(b.freeze(), Bytes::copy_from_slice);
    let mut out = BytesMut::new();
    put_ext_request(&mut out, Flags::EXT_STATUS, id, &block, &plain.body);
    out
}

async fn answer(p: &InProcess<ServeSummary>, frame: &[u8]) -> (Status, String) {
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    s.write_all(frame).await.unwrap();
    let mut buf = BytesMut::new();
    let f = read_frames(&mut s, &mut buf, 1).await.unwrap().remove(0);
    let r = Response::parse(&f.body).unwrap();
    let call = rpcmesh_wire::envelope::CallCodec::new(None, 1 << 20)
        .decode_response(&f)
        .unwrap();
    (Status::from_wire(r.status).unwrap(), call.rpc.error_msg)
}

#[tokio::test]
async fn without_a_policy_a_forwarded_call_is_served_and_a_broken_block_answered() {
    let p = start(ProviderConfig::default()).await;
    let (status, _) = answer(&p, &forwarded(1, "spiffe://t/driver/d1", None)).await;
    assert_eq!(status, Status::Success);
    // A field that runs past its block.
    let (status, msg) = answer(&p, &forwarded(2, "x", Some(b"\x00\x04\x01\x00\x09x"))).await;
    assert_eq!(status, Status::BadRequest, "{msg}");
    assert!(msg.contains("malformed extension body"), "{msg}");
    p.stop().await;
}

#[tokio::test]
async fn with_a_policy_an_anonymous_peer_may_not_forward_whoever_it_names() {
    let dir = std::env::temp_dir().join(format!("rpcmesh-call-ext-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.toml");
    // Everyone may forward and call: still, a peer without a certificate is no forwarder.
    std::fs::write(
        &policy,
        "forwarders = [\"*\"]\n[[allow]]\ncallers = [\"*\"]\ncalls = [\"*\"]\n",
    )
    .unwrap();
    let p = start(ProviderConfig {
        authz_policy: Some(policy),
        ..ProviderConfig::default()
    })
    .await;
    let (status, msg) = answer(&p, &forwarded(1, "spiffe://t/ops/admin", None)).await;
    assert_eq!(status, Status::PermissionDenied);
    assert_eq!(
        msg,
        "permission denied: anonymous may not forward callers' identities"
    );
    // Its own calls are anonymous ones, which this policy allows.
    let (status, _) = answer(&p, &echo_request(2, "hi")).await;
    assert_eq!(status, Status::Success);
    // A call carrying only its deadline names no one: it is the peer's own call too.
    let plain = Frame::from_bytes(echo_request(3, "hi").freeze()).unwrap();
    let block = deadline_block(std::time::Duration::from_secs(10));
    let mut only_deadline = BytesMut::new();
    put_ext_request(
        &mut only_deadline,
        Flags::EXT_STATUS,
        3,
        &block,
        &plain.body,
    );
    let (status, msg) = answer(&p, &only_deadline).await;
    assert_eq!(status, Status::Success, "{msg}");
    p.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
