//! The broker's limits, black-box on 127.0.0.1: calls over the per-connection and the
//! broker-wide in-flight caps answered "overloaded" at once, calls past their timeout
//! answered "timeout", and no healthy provider answered "unavailable" at once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::wait_until;
use rpcmesh_wire::Status;
use support::*;

/// A call over the per-connection cap is answered "overloaded" while the call that fills
/// the cap is still held at the provider: the answer never waits for a slot to free.
#[tokio::test]
async fn over_the_in_flight_cap_calls_are_answered_overloaded_at_once() {
    let (m, gate) = held_mesh(|cfg| cfg.max_in_flight_per_conn = 1).await;
    let (b, ext) = (&m.b, &m.c);
    let v1 = Client::connect(b.addr, ClientConfig::plain_v1())
        .await
        .unwrap();
    let slow = held_call(ext, "slow");
    wait_until("the slow call to reach the provider", || {
        gate.arrived() == 1
    })
    .await;
    let r = ext
        .call("EchoService", "Echo", &echo("shed me"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Overloaded);
    assert!(
        r.error_msg.contains("1 calls in flight on this connection"),
        "the reply names the cap: {}",
        r.error_msg
    );
    assert!(
        !slow.is_finished(),
        "answered at once: before the slow call's reply, which the provider still holds"
    );
    // A plain v1 client sees status failed, with a message that says overloaded.
    let v1_slow = held_call(&v1, "slow");
    wait_until("the v1 slow call to reach the provider", || {
        gate.arrived() == 2
    })
    .await;
    let r = v1
        .call("EchoService", "Echo", &echo("shed me"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Failed);
    assert!(r.error_msg.starts_with("overloaded"), "{}", r.error_msg);
    assert!(
        !v1_slow.is_finished(),
        "answered before the slow call's reply"
    );
    gate.open();
    assert_eq!(slow.await.unwrap().unwrap().status, Status::Success);
    assert_eq!(v1_slow.await.unwrap().unwrap().status, Status::Success);
    assert_eq!(b.errors("overloaded"), 2.0);
    // Shed by the broker's own cap.
    assert_eq!(b.errors_from("overloaded", "broker"), 2.0);
    m.stop().await;
}

#[tokio::test]
async fn over_the_broker_wide_cap_a_call_on_any_connection_is_answered_overloaded() {
    let (m, gate) = held_mesh(|cfg| cfg.max_in_flight = 1).await;
    let second = client(m.b.addr).await;
    let slow = held_call(&m.c, "slow");
    wait_until("the slow call to reach the provider", || {
        gate.arrived() == 1
    })
    .await;
    // The other connection has nothing in flight: the broker-wide cap sheds it.
    let r = second
        .call("EchoService", "Echo", &echo("shed me"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Overloaded);
    assert!(
        r.error_msg.contains("broker has 1 calls in flight")
            && !r.error_msg.contains("on this connection"),
        "the reply names the broker-wide cap: {}",
        r.error_msg
    );
    assert!(!slow.is_finished(), "answered before the slow call's reply");
    gate.open();
    assert_eq!(slow.await.unwrap().unwrap().status, Status::Success);
    // The slow call's slot is free again.
    let r = second
        .call("EchoService", "Echo", &echo("now"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Success);
    assert_eq!(m.b.errors("overloaded"), 1.0);
    m.stop().await;
}

/// The provider holds the call: the "timeout" answer is the broker's own, at its
/// configured deadline, and the provider's answer, let through after it, is dropped.
#[tokio::test]
async fn a_call_past_its_timeout_is_answered_timeout_and_the_late_reply_is_dropped() {
    let (Mesh { p, b, c }, gate) =
        held_mesh(|cfg| cfg.call_timeout = Duration::from_millis(300)).await;
    let call = held_call(&c, "late");
    wait_until("the call to reach the provider", || gate.arrived() == 1).await;
    let r = call.await.unwrap().unwrap();
    assert_eq!(r.status, Status::Timeout, "{}", r.error_msg);
    assert!(
        r.error_msg.contains("within 300ms"),
        "timed out at the configured deadline: {}",
        r.error_msg
    );
    // the provider's answer, let through now, arrives later and is dropped, counted
    gate.open();
    wait_until("the late reply to be counted", || {
        b.errors("late_reply") >= 1.0
    })
    .await;
    assert!(b.errors("timeout") >= 1.0);
    // The provider did not answer in time: its side.
    assert_eq!(b.errors_from("timeout", "provider"), b.errors("timeout"));
    b.stop().await;
    p.stop().await;
}

/// With no healthy provider the broker answers "unavailable" itself, at once: not after
/// its call timeout (an hour here, which no test outlives), nor by waiting for a provider
/// to come back.
#[tokio::test]
async fn no_healthy_provider_is_answered_unavailable_at_once() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut cfg = broker_config(&[dead]);
    cfg.call_timeout = Duration::from_secs(3600);
    let b = broker(cfg).await;
    let c = client(b.addr).await;
    wait_until("the broker to fail to connect to the provider", || {
        b.metric("rpcmesh_upstream_connect_failures_total", &[]) >= 1.0
    })
    .await;
    let r = c
        .call("EchoService", "Echo", &echo("anyone?"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Unavailable);
    assert!(
        r.error_msg.contains("no healthy provider"),
        "{}",
        r.error_msg
    );
    assert_eq!(b.errors("timeout"), 0.0, "answered, not timed out");
    assert_eq!(b.metric("rpcmesh_pool_healthy_connections", &[]), 0.0);
    b.stop().await;
}

/// Callers in the churn test that each send one held call and close without reading.
const CHURNERS: usize = 200;

/// A request of [`HELD_SERVICE`], as raw bytes.
fn held_request(id: u64) -> bytes::BytesMut {
    let payload = prost::Message::encode_to_vec(&rpcmesh_wire::proto::rpc::RpcRequest {
        payload: prost::Message::encode_to_vec(&echo("gone")).into(),
        metadata: Default::default(),
    });
    let mut b = bytes::BytesMut::new();
    rpcmesh_wire::body::Request {
        service: bytes::Bytes::from_static(HELD_SERVICE.as_bytes()),
        method: bytes::Bytes::from_static(rpcmesh_provider::service::echo::METHOD.as_bytes()),
        payload: payload.into(),
    }
    .put(&mut b, rpcmesh_wire::frame::Flags::NONE, id)
    .unwrap();
    b
}

/// Callers that send a call and close without reading cost no session: the broker (a real
/// process) ends each caller's session as soon as it closes, while its call is still held
/// at the provider, so open sessions track the live callers; once the provider answers,
/// every abandoned reply is dropped and counted. Without it, each session stayed until its
/// reply came (up to the cap, 10,000, under churn). On both engines.
#[tokio::test]
async fn callers_that_leave_end_their_sessions_and_their_replies_are_counted_dropped() {
    for engine in ["tokio", "loop"] {
        callers_leave(engine).await;
    }
}

async fn callers_leave(engine: &str) {
    use std::io::Write;
    let gate = rpcmesh_testkit::Gate::new();
    let p = held_provider(&gate).await;
    let upstream = p.addr.to_string();
    let broker = rpcmesh_testkit::Spawned::start(
        "broker",
        &[
            "--engine",
            engine,
            "--threads",
            "1",
            "--call-timeout",
            "60s",
            "--upstream",
            &upstream,
        ],
    );
    broker.wait_serving().await;
    let live = client(broker.rpc).await;
    let held = held_call(&live, "live");
    wait_until("the live caller's call is held", || gate.arrived() == 1).await;
    for i in 0..CHURNERS {
        let mut s = std::net::TcpStream::connect(broker.rpc).unwrap();
        s.write_all(&held_request(i as u64)).unwrap();
        drop(s);
    }
    wait_until("every churner's call is held", || {
        gate.arrived() == CHURNERS + 1
    })
    .await;
    let open = || broker.metric("rpcmesh_connections_open", &[("side", "inbound")]);
    // Only the live caller is left (the gate is still shut: no reply has come).
    wait_until("the churners' sessions end", || open() == 1.0).await;
    assert_eq!(
        gate.arrived(),
        CHURNERS + 1,
        "no call was answered meanwhile"
    );
    gate.open();
    let r = held.await.unwrap().unwrap();
    assert_eq!(r.status, Status::Success, "the live caller is answered");
    wait_until("the abandoned replies are counted", || {
        broker.metric("rpcmesh_abandoned_replies_total", &[]) == CHURNERS as f64
    })
    .await;
    assert_eq!(open(), 1.0);
    assert_eq!(broker.metric("rpcmesh_calls_in_flight", &[]), 0.0);
}
