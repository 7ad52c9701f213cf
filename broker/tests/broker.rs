//! Black-box tests of the broker in front of real providers, all on 127.0.0.1: calls and
//! fan-out through it, v1 interop, compression, bad input, balancing and fail-over,
//! several brokers, shedding and timeouts.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use rpcmesh_broker::UpstreamSpec;
use rpcmesh_common::metrics::recorder::sample;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::{self as testkit, wait_until};
use rpcmesh_wire::body::Request;
use rpcmesh_wire::compress::CompressionConfig;
use rpcmesh_wire::proto::platform::{QueryRequest, QueryResponse};
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use rpcmesh_wire::{PeerKind, Status};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn query() -> QueryRequest {
    rpcmesh_wire::proto::platform::reference_query()
}

fn echo(m: &str) -> EchoRequest {
    EchoRequest { message: m.into() }
}

#[tokio::test]
async fn echo_and_platform_calls_go_through_the_broker() {
    let Mesh { p, b, c } = mesh(|_| {}).await;
    let r = c
        .call("EchoService", "Echo", &echo("through"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Success);
    assert_eq!(r.decode::<EchoResponse>().unwrap().message, "through");
    let r = c
        .call("PlatformService", "doQuery", &query())
        .await
        .unwrap();
    let q: QueryResponse = r.decode().unwrap();
    assert_eq!(q.nodes.len(), 2);
    // the provider saw the calls, the broker counted them
    let platform_ok = [("service", "PlatformService"), ("status", "ok")];
    assert!(p.metric("rpcmesh_calls_total", &platform_ok) >= 1.0);
    assert!(b.metric("rpcmesh_calls_total", &platform_ok) >= 1.0);
    b.stop().await;
    p.stop().await;
}

/// The reference workload's request shape: 5 calls in a row per user request, many users
/// at once on one multiplexed connection; and the parallel variant.
#[tokio::test]
async fn five_call_fan_out_requests_complete_through_the_broker() {
    let Mesh { p, b, c } = mesh(|_| {}).await;
    let users: Vec<_> = (0..50)
        .map(|u| {
            let c = c.clone();
            tokio::spawn(async move {
                for req in 0..4 {
                    for call in 0..5 {
                        let r = c
                            .call("PlatformService", "doQuery", &query())
                            .await
                            .unwrap();
                        assert_eq!(
                            r.status,
                            Status::Success,
                            "user {u} request {req} call {call}"
                        );
                    }
                    let parallel: Vec<_> = (0..5)
                        .map(|i| testkit::echo_call(&c, format!("{u}-{i}")))
                        .collect();
                    for (i, h) in parallel.into_iter().enumerate() {
                        let r = h.await.unwrap().unwrap();
                        assert_eq!(
                            r.decode::<EchoResponse>().unwrap().message,
                            format!("{u}-{i}")
                        );
                    }
                }
            })
        })
        .collect();
    for u in users {
        u.await.unwrap();
    }
    assert_eq!(b.calls("ok"), p.calls("ok"));
    assert!(b.calls("ok") >= 2000.0);
    b.stop().await;
    p.stop().await;
}

/// A plain v1 client sending the reference's golden request through the broker gets the
/// reference's golden reply, byte for byte: the broker's id remapping is invisible.
#[tokio::test]
async fn a_v1_client_gets_byte_identical_v1_replies_through_the_broker() {
    let p = provider(ProviderConfig::default()).await;
    let b = broker(broker_config(&[p.addr])).await;
    until_ready(&client(b.addr).await).await;
    let (got, want) = testkit::golden_exchange(b.addr, "echo_request_id1", "echo_response_ok_id1")
        .await
        .unwrap();
    assert_eq!(got, want);
    b.stop().await;
    p.stop().await;
}

#[tokio::test]
async fn compression_gives_identical_replies_and_fewer_bytes_for_the_platform_workload() {
    let Mesh { p, b, c: plain } = mesh(|_| {}).await;
    let zipped = Client::connect(
        b.addr,
        ClientConfig {
            compression: Some(CompressionConfig::default()),
            ..ClientConfig::default()
        },
    )
    .await
    .unwrap();
    let wire = || b.metric("rpcmesh_wire_bytes_total", &[("side", "inbound")]);
    const N: usize = 200;
    let w0 = wire();
    let mut plain_replies = Vec::new();
    for _ in 0..N {
        plain_replies.push(
            plain
                .call("PlatformService", "doQuery", &query())
                .await
                .unwrap(),
        );
    }
    let w1 = wire();
    let mut zipped_replies = Vec::new();
    for _ in 0..N {
        zipped_replies.push(
            zipped
                .call("PlatformService", "doQuery", &query())
                .await
                .unwrap(),
        );
    }
    let w2 = wire();
    for (a, z) in plain_replies.iter().zip(&zipped_replies) {
        assert_eq!(a.status, Status::Success);
        assert_eq!(z.status, Status::Success);
        assert_eq!(a.payload, z.payload, "identical replies");
        assert!(!a.compressed);
        assert!(z.compressed);
    }
    let (plain_bytes, zipped_bytes) = (w1 - w0, w2 - w1);
    println!("platform x{N}: plain {plain_bytes} B, compressed {zipped_bytes} B on the wire");
    assert!(
        zipped_bytes < plain_bytes,
        "compression saves bytes: {zipped_bytes} vs {plain_bytes}"
    );
    b.stop().await;
    p.stop().await;
}

#[tokio::test]
async fn unknown_service_fails_with_a_message() {
    let p = provider(ProviderConfig::default()).await;
    // One route with named services: the broker itself knows the rest are unknown.
    let mut cfg = broker_config(&[]);
    cfg.upstreams =
        vec![UpstreamSpec::parse(&format!("EchoService={}", p.addr), PeerKind::Rpcmesh).unwrap()];
    let b = broker(cfg).await;
    let c = Client::connect(b.addr, ClientConfig::plain_v1())
        .await
        .unwrap();
    until_ready(&c).await;
    let r = c.call("Nope", "x", &echo("?")).await.unwrap();
    assert_eq!(r.status, Status::Failed);
    assert_eq!(r.error_msg, "service not found: Nope");
    assert_eq!(b.errors("unknown_service"), 1.0);
    // The caller asked for a service no one provides: its side, not the broker's.
    assert_eq!(b.errors_from("unknown_service", "client"), 1.0);
    b.stop().await;

    // With an any-service upstream the provider answers, in the same words.
    let b = broker(broker_config(&[p.addr])).await;
    let c = Client::connect(b.addr, ClientConfig::plain_v1())
        .await
        .unwrap();
    until_ready(&c).await;
    let r = c.call("Nope", "x", &echo("?")).await.unwrap();
    assert_eq!(r.status, Status::Failed);
    assert_eq!(r.error_msg, "service not found: Nope");
    b.stop().await;
    p.stop().await;
}

#[tokio::test]
async fn bad_input_to_the_broker_gets_an_error_reply_or_a_close_and_is_counted() {
    let max = 4096;
    let p = provider(ProviderConfig::default()).await;
    let mut cfg = broker_config(&[p.addr]);
    cfg.max_body_len = max;
    let b = broker(cfg).await;
    let good = client(b.addr).await;
    until_ready(&good).await;
    for input in testkit::bad_inputs(max) {
        let before = b.errors(input.kind.label());
        let seen = testkit::probe(b.addr, &input).await.unwrap();
        assert_eq!(seen.closed, input.closes, "{}: {seen:?}", input.name);
        if let Some(id) = input.reply_to {
            let f = seen
                .frames
                .iter()
                .find(|f| f.header.req_id == id)
                .unwrap_or_else(|| panic!("{}: no error reply", input.name));
            assert!(Request::parse(&f.body).is_err());
        }
        if let Some(id) = input.then_answered {
            assert!(
                seen.frames.iter().any(|f| f.header.req_id == id),
                "{}: next frame not answered",
                input.name
            );
        }
        assert_eq!(
            b.errors(input.kind.label()),
            before + 1.0,
            "{} not counted",
            input.name
        );
        let r = good
            .call("EchoService", "Echo", &echo(input.name))
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success, "{}", input.name);
    }
    b.stop().await;
    p.stop().await;
}

#[tokio::test]
async fn two_providers_share_the_calls_and_one_stopping_sends_all_to_the_other() {
    let p1 = provider(ProviderConfig::default()).await;
    let p2 = provider(ProviderConfig::default()).await;
    let b = broker(broker_config(&[p1.addr, p2.addr])).await;
    let c = client(b.addr).await;
    until_ready(&c).await;
    let healthy = |p: &Running| {
        let upstream = p.addr.to_string();
        b.metric(
            "rpcmesh_pool_healthy_connections",
            &[("upstream", upstream.as_str())],
        )
    };
    let pool = f64::from(rpcmesh_broker::config::DEFAULT_POOL_SIZE);
    wait_until("both pools to be up", || {
        healthy(&p1) >= pool && healthy(&p2) >= pool
    })
    .await;
    let run = |n: usize| {
        let c = c.clone();
        async move {
            let mut statuses = Vec::new();
            for h in testkit::echo_calls(&c, n) {
                statuses.push(h.await.unwrap().unwrap().status);
            }
            statuses
        }
    };
    // One call at a time, so that each is a read of its own and the broker picks a
    // provider for each: calls sent together may reach the broker in one read, and a
    // read's calls go to one provider together, so how they share would depend on how
    // the scheduler happened to batch them.
    for i in 0..400 {
        let r = c.call("EchoService", "Echo", &echo(&format!("{i}"))).await;
        assert_eq!(r.unwrap().status, Status::Success);
    }
    let (c1, c2) = (p1.calls("ok"), p2.calls("ok"));
    println!("shared: provider 1 {c1}, provider 2 {c2}");
    assert!(
        c1 >= 50.0 && c2 >= 50.0,
        "both providers take calls: {c1} / {c2}"
    );

    let p1_before = p1.calls("ok");
    let p1_addr = p1.addr.to_string();
    p1.stop().await;
    // Calls racing the stop may fail ("unavailable"), but each gets an answer; once the
    // broker has noticed, every call goes to provider 2.
    let _ = run(50).await;
    wait_until("the broker to drop provider 1's connections", || {
        b.metric(
            "rpcmesh_pool_healthy_connections",
            &[("upstream", p1_addr.as_str())],
        ) == 0.0
    })
    .await;
    let p2_before = p2.calls("ok");
    let s = run(300).await;
    assert!(s.iter().all(|s| *s == Status::Success), "{s:?}");
    assert_eq!(p2.calls("ok") - p2_before, 300.0);
    assert!(p1_before > 0.0);
    b.stop().await;
    p2.stop().await;
}

#[tokio::test]
async fn two_brokers_in_front_of_one_provider_both_serve() {
    let p = provider(ProviderConfig::default()).await;
    // One busy-polls (the default), the other sleeps at once.
    let b1 = broker(broker_config(&[p.addr])).await;
    let mut quiet = broker_config(&[p.addr]);
    quiet.busy_poll = rpcmesh_broker::BusyPoll::Off;
    let b2 = broker(quiet).await;
    let c1 = client(b1.addr).await;
    let c2 = client(b2.addr).await;
    until_ready(&c1).await;
    until_ready(&c2).await;
    for i in 0..50 {
        let (ea, eb) = (echo(&format!("a{i}")), echo(&format!("b{i}")));
        let (a, b) = tokio::join!(
            c1.call("EchoService", "Echo", &ea),
            c2.call("EchoService", "Echo", &eb)
        );
        assert_eq!(
            a.unwrap().decode::<EchoResponse>().unwrap().message,
            format!("a{i}")
        );
        assert_eq!(
            b.unwrap().decode::<EchoResponse>().unwrap().message,
            format!("b{i}")
        );
    }
    assert!(b1.calls("ok") >= 50.0 && b2.calls("ok") >= 50.0);
    b1.stop().await;
    b2.stop().await;
    p.stop().await;
}

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

#[tokio::test]
async fn the_broker_answers_heartbeats() {
    let p = provider(ProviderConfig::default()).await;
    let b = broker(broker_config(&[p.addr])).await;
    let c = client(b.addr).await;
    let hb = c.heartbeat().await.unwrap();
    assert_eq!(hb.service_name, "broker");
    b.stop().await;
    p.stop().await;
}

/// A provider reply over the broker's frame limit fails its own call only: the pooled
/// connection, and every other call on it, carry on.
#[tokio::test]
async fn an_oversized_reply_fails_its_call_and_spares_the_connection() {
    use bytes::BytesMut;
    use rpcmesh_wire::frame::Flags;
    let Mesh { p, b, c: others } = mesh(|cfg| {
        cfg.max_body_len = 4096;
        cfg.pool_size = 1;
    })
    .await;
    // A small compressed request whose plain echo is 5,000 bytes; no compressed reply taken.
    let big = EchoRequest {
        message: "x".repeat(5000),
    };
    let frame = testkit::compressed_request(77, Flags::EXT_STATUS, "EchoService", "Echo", &big);
    let mut s = TcpStream::connect(b.addr).await.unwrap();
    s.write_all(&frame).await.unwrap();
    let calls = testkit::echo_calls(&others, 50);
    let f = testkit::read_frames(&mut s, &mut BytesMut::new(), 1)
        .await
        .unwrap()
        .remove(0);
    let r = rpcmesh_wire::envelope::CallCodec::new(None, 1 << 20)
        .decode_response(&f)
        .unwrap();
    assert_eq!(f.header.req_id, 77);
    assert_eq!(r.status, Status::Failed);
    assert!(r.rpc.error_msg.contains("too large"), "{}", r.rpc.error_msg);
    for c in calls {
        assert_eq!(c.await.unwrap().unwrap().status, Status::Success);
    }
    let closed = b.metric("rpcmesh_connections_closed_total", &[("side", "upstream")]);
    assert_eq!(closed, 0.0, "the pooled connection was kept");
    b.stop().await;
    p.stop().await;
}

/// A provider that accepts connections and never answers: connections that fail their
/// health check are closed, not left behind one per health interval.
#[tokio::test]
async fn connections_to_a_silent_provider_are_not_leaked() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let mut cfg = broker_config(&[addr]);
    cfg.pool_size = 2;
    cfg.health_interval = Duration::from_millis(50);
    cfg.health_timeout = Duration::from_millis(50);
    let b = broker(cfg).await;
    // Many rounds of health checks: each fails, and the pool replaces its connections.
    let upstream = [("side", "upstream")];
    let (mut opened, mut open) = (0.0, 0.0);
    wait_until(
        "the broker to replace its connections 10 times over",
        || {
            let text = b.telemetry.render();
            opened = sample(&text, "rpcmesh_connections_opened_total", &upstream).unwrap_or(0.0);
            open = sample(&text, "rpcmesh_connections_open", &upstream).unwrap_or(0.0);
            opened >= 20.0
        },
    )
    .await;
    println!("silent provider: {opened} opened, {open} open");
    assert!(
        opened >= 4.0,
        "the broker kept trying ({opened} connections)"
    );
    assert!(open <= 4.0, "{open} connections left open after {opened}");
    b.stop().await;
    hold.abort();
}

/// Requests a caller sends while the broker drains are answered "unavailable", not lost
/// with a closed connection.
#[tokio::test]
async fn a_draining_broker_answers_late_requests_unavailable() {
    let Mesh { p, b, c } = mesh(|_| {}).await;
    let stopping = tokio::spawn(b.stop());
    // Every call gets an answer: served until the session learns of the drain, refused
    // from then on.
    let r = testkit::wait_for("a call refused by the draining broker", || async {
        let r = c.call("EchoService", "Echo", &echo("late")).await.unwrap();
        (r.status != Status::Success).then_some(r)
    })
    .await;
    assert_eq!(r.status, Status::Unavailable);
    assert!(r.error_msg.contains("shutting down"), "{}", r.error_msg);
    stopping.await.unwrap();
    p.stop().await;
}

/// A call made as soon as the broker runs waits for the provider's first connections
/// instead of being answered "unavailable" at once: the broker accepts calls only once
/// its pools have settled. The provider here answers nothing, heartbeats included, until
/// the test sends it a request of its own, so the broker's pool cannot be ready before.
#[tokio::test]
async fn a_call_made_as_the_broker_starts_waits_for_the_providers_first_connections() {
    let server = V1Server::start(true).await;
    server.hold_replies_until(1);
    let mut cfg = broker_config(&[server.addr]);
    // The broker waits at most one connect and one heartbeat timeout for its pools.
    cfg.health_timeout = Duration::from_secs(30);
    let b = broker(cfg).await;
    let c = client(b.addr).await;
    let first = {
        let c = c.clone();
        tokio::spawn(async move { c.call("EchoService", "Echo", &echo("first")).await })
    };
    // Whatever the broker would answer before the provider's heartbeats, it has had the
    // time to: a broker that accepted calls before its pool was ready answered
    // "unavailable" here.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !first.is_finished(),
        "answered before the provider's first connection was ready: {:?}",
        first.await
    );
    // The test's own request lets the server answer everything it holds.
    server.release().await;
    let r = first.await.unwrap().unwrap();
    assert_eq!(r.status, Status::Success);
    assert_eq!(r.decode::<EchoResponse>().unwrap().message, "first");
    b.stop().await;
    server.stop();
}

/// A broker whose provider is down starts at once (the failed connect settles its pool)
/// and answers "unavailable", not after the pool's connection timeout.
#[tokio::test]
async fn a_broker_whose_provider_is_down_answers_unavailable_without_waiting_for_it() {
    // A port nothing listens on: bound, then closed.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut cfg = broker_config(&[dead]);
    cfg.connect_timeout = Duration::from_secs(60);
    cfg.health_timeout = Duration::from_secs(60);
    let b = broker(cfg).await;
    let c = client(b.addr).await;
    // Were the broker waiting out the pool's connection timeout, this call would wait
    // two minutes: the client's own timeout (shorter) would end it instead.
    let r = c
        .call("EchoService", "Echo", &echo("to nobody"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Unavailable);
    b.stop().await;
}

/// A strict RPCF v1 server behind the broker (`--upstream-v1`): it drops any frame with
/// extension bits, as v1 peers skip unknown types. The broker strips the bits of extended
/// callers before forwarding, and refuses compressed payloads, which v1 cannot read.
#[tokio::test]
async fn a_plain_v1_server_can_sit_behind_the_broker() {
    let server = V1Server::start(false).await;
    let v1 = server.addr;
    let mut cfg = broker_config(&[]);
    cfg.upstreams = vec![UpstreamSpec::parse(&v1.to_string(), PeerKind::V1).unwrap()];
    let b = broker(cfg).await;
    // An rpcmesh client (extended statuses, compressed replies accepted) and a plain one.
    let ext = Client::connect(b.addr, ClientConfig::compressed(100_000))
        .await
        .unwrap();
    until_ready(&ext).await;
    let plain = Client::connect(b.addr, ClientConfig::plain_v1())
        .await
        .unwrap();
    for c in [&ext, &plain] {
        let r = c
            .call("EchoService", "Echo", &echo("to a v1 server"))
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success);
        assert_eq!(
            r.decode::<EchoResponse>().unwrap().message,
            "to a v1 server"
        );
    }
    assert_eq!(
        server.flagged.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the v1 server never saw an extension bit"
    );
    // A compressed payload cannot go to a v1 server: refused at once, with the reason.
    let zipped = Client::connect(b.addr, ClientConfig::compressed(1))
        .await
        .unwrap();
    let r = zipped
        .call("EchoService", "Echo", &echo(&"z".repeat(200)))
        .await
        .unwrap();
    assert_eq!(r.status, Status::BadRequest);
    assert!(r.error_msg.contains("compressed"), "{}", r.error_msg);
    b.stop().await;
    server.stop();
}

/// Behind a plain v1 server with Nagle's algorithm on (the classic server), a read that
/// leaves calls in flight on the connection is ACKed at once (`TCP_QUICKACK`), so that the
/// server's next reply need not wait for a delayed ACK; towards an rpcmesh provider
/// (`TCP_NODELAY`, no such wait) never. Two calls leave in one write on the broker's one
/// pooled connection; the second is held at the server until the first's reply is through.
#[tokio::test]
async fn reads_from_a_plain_v1_server_with_calls_in_flight_are_acked_at_once() {
    use rpcmesh_common::metrics::catalogue::UPSTREAM_QUICK_ACKS_TOTAL;
    for v1 in [true, false] {
        let gate = testkit::Gate::new();
        let server = if v1 {
            held_classic(&gate).await
        } else {
            held_provider(&gate).await
        };
        let mut cfg = broker_config(&[]);
        let kind = if v1 { PeerKind::V1 } else { PeerKind::Rpcmesh };
        cfg.upstreams = vec![UpstreamSpec::parse(&server.addr.to_string(), kind).unwrap()];
        cfg.pool_size = 1;
        let b = broker(cfg).await;
        until_ready(&client(b.addr).await).await;
        let quick_acks = || b.metric(UPSTREAM_QUICK_ACKS_TOTAL.name, &[]);
        let before = quick_acks();
        // One segment, so one read: the broker routes both calls to its one connection
        // before that connection's task writes them, in one write, in this order.
        let mut two = testkit::echo_request(1, "first");
        let mut held = bytes::BytesMut::new();
        let payload = prost::Message::encode_to_vec(&rpcmesh_wire::proto::rpc::RpcRequest {
            payload: prost::Message::encode_to_vec(&echo("held")).into(),
            metadata: Default::default(),
        });
        Request {
            service: bytes::Bytes::from_static(HELD_SERVICE.as_bytes()),
            method: bytes::Bytes::from_static(b"Echo"),
            payload: payload.into(),
        }
        .put(&mut held, rpcmesh_wire::frame::Flags::NONE, 2)
        .unwrap();
        two.extend_from_slice(&held);
        let mut raw = TcpStream::connect(b.addr).await.unwrap();
        raw.write_all(&two).await.unwrap();
        let mut buf = bytes::BytesMut::new();
        let first = testkit::read_frames(&mut raw, &mut buf, 1).await.unwrap();
        assert_eq!(first[0].header.req_id, 1);
        // The first reply was read with the held call still in flight (it is at the gate,
        // or behind the first reply at the classic server), and counted before it was
        // passed on.
        if v1 {
            assert!(
                quick_acks() > before,
                "no quick ACK after a read from the v1 server with a call in flight"
            );
        } else {
            assert_eq!(quick_acks(), 0.0, "a quick ACK towards an rpcmesh provider");
        }
        wait_until("the held call to reach the server", || gate.arrived() == 1).await;
        gate.open();
        let second = testkit::read_frames(&mut raw, &mut buf, 1).await.unwrap();
        assert_eq!(second[0].header.req_id, 2);
        if !v1 {
            assert_eq!(quick_acks(), 0.0, "a quick ACK towards an rpcmesh provider");
        }
        b.stop().await;
        server.stop().await;
    }
}

/// Calls are packed onto a provider's oldest connection (so that they travel in large
/// batches) until it has `--pack-in-flight` (64) in flight (this test server never reports
/// a time per call, so nothing lowers the depth); more spread over the others (a client's
/// read of many calls still goes to one connection, so the split is uneven).
#[tokio::test]
async fn calls_are_packed_onto_one_connection_until_it_is_busy() {
    let server = V1Server::start(true).await;
    let mut cfg = broker_config(&[server.addr]);
    cfg.pool_size = 4;
    // The heavy phase holds replies (heartbeats too) until all its calls are in: no call
    // or heartbeat may time out behind them on a slow machine.
    cfg.call_timeout = Duration::from_secs(30);
    cfg.health_timeout = Duration::from_secs(10);
    let b = broker(cfg).await;
    let c = client(b.addr).await;
    until_ready(&c).await;
    wait_until("all four pooled connections to be published", || {
        b.metric("rpcmesh_pool_healthy_connections", &[]) >= 4.0
    })
    .await;
    let run = |n: usize| {
        let calls = testkit::echo_calls(&c, n);
        async move {
            for call in calls {
                assert_eq!(call.await.unwrap().unwrap().status, Status::Success);
            }
        }
    };
    // Requests per connection since `before` (connections opened since count in full).
    let delta = |before: &[usize], after: &[usize]| -> Vec<usize> {
        after
            .iter()
            .enumerate()
            .map(|(i, a)| a - before.get(i).copied().unwrap_or(0))
            .collect()
    };
    // 40 at a time, 5 times: all on one connection.
    let before = server.counts();
    for _ in 0..5 {
        run(40).await;
    }
    let light = delta(&before, &server.counts());
    println!("40 in flight: requests per connection {light:?}");
    assert_eq!(light.iter().sum::<usize>(), 200);
    assert_eq!(light.iter().filter(|n| **n > 0).count(), 1, "{light:?}");
    // 300 at once, all held in flight until the last has reached the server: the first
    // connection fills, the rest spread.
    let before = server.counts();
    server.hold_replies_until(300);
    run(300).await;
    let heavy = delta(&before, &server.counts());
    println!("300 in flight: requests per connection {heavy:?}");
    assert_eq!(heavy.iter().sum::<usize>(), 300);
    assert!(heavy.iter().filter(|n| **n > 0).count() >= 2, "{heavy:?}");
    b.stop().await;
    server.stop();
}

/// Eight clients make one call each per round, all in flight together (each its own read
/// at the broker, so each routed on its own; with `hold`, the server answers none before
/// it has all eight), through a broker with a pool of four connections to `server` (an
/// rpcmesh provider or a plain v1 server, as `kind` says) and `--pack-wait` `wait`. Returns the connections used in
/// each round, and the time per call the pool published after them
/// (`rpcmesh_upstream_pace_seconds`, waited for).
async fn connections_used_per_round(
    server: &V1Server,
    kind: PeerKind,
    wait: Duration,
    hold: bool,
) -> (Vec<usize>, f64) {
    use rpcmesh_common::metrics::catalogue::UPSTREAM_PACE_SECONDS;
    const CLIENTS: usize = 8;
    const ROUNDS: usize = 12;
    let mut cfg = broker_config(&[]);
    cfg.upstreams = vec![UpstreamSpec::parse(&server.addr.to_string(), kind).unwrap()];
    cfg.pool_size = 4;
    cfg.pack_wait = wait;
    let b = broker(cfg).await;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(client(b.addr).await);
    }
    until_ready(&clients[0]).await;
    wait_until("all four pooled connections to be published", || {
        b.metric("rpcmesh_pool_healthy_connections", &[]) >= 4.0
    })
    .await;
    let mut used = Vec::new();
    for _ in 0..ROUNDS {
        let before = server.counts();
        if hold {
            server.hold_replies_until(CLIENTS);
        }
        let calls: Vec<_> = clients.iter().map(|c| testkit::echo_call(c, "x")).collect();
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap().status, Status::Success);
        }
        let after = server.counts();
        let per_conn: Vec<usize> = after
            .iter()
            .enumerate()
            .map(|(i, a)| a - before.get(i).copied().unwrap_or(0))
            .collect();
        assert_eq!(per_conn.iter().sum::<usize>(), CLIENTS, "{per_conn:?}");
        used.push(per_conn.iter().filter(|n| **n > 0).count());
    }
    let pace = || b.metric(UPSTREAM_PACE_SECONDS.name, &[]);
    wait_until("the time per call to be published", || pace() > 0.0).await;
    let published = pace();
    b.stop().await;
    (used, published)
}

/// Behind a plain v1 server, which answers a connection's calls one at a time, calls are
/// packed onto one pooled connection only as deep as the server's measured pace allows
/// (`--pack-wait`). The same server, writing each reply 2 ms after the one before, gets
/// the calls of eight clients spread over the pool with the default wait (100 µs: no call
/// may wait behind another), and packed onto one connection with a wait of 10 s.
#[tokio::test]
async fn a_plain_v1_server_is_packed_only_as_deep_as_its_pace_allows() {
    use rpcmesh_broker::config::DEFAULT_PACK_WAIT;
    for (wait, packs) in [(DEFAULT_PACK_WAIT, false), (Duration::from_secs(10), true)] {
        let server = V1Server::one_by_one(Duration::from_millis(2)).await;
        let (used, pace) = connections_used_per_round(&server, PeerKind::V1, wait, false).await;
        println!("wait {wait:?}: connections used per round {used:?}");
        // The pool publishes what it measured: more than the default wait per call.
        assert!(
            pace > DEFAULT_PACK_WAIT.as_secs_f64(),
            "a 2 ms server measured at {pace} s per call"
        );
        if packs {
            // The first round, unmeasured, spreads; once a reply's pace is known (a
            // connection read with a call still waiting behind it), every call goes to
            // the first connection.
            let first = used.iter().position(|u| *u == 1);
            let first = first.unwrap_or_else(|| panic!("never packed: {used:?}"));
            assert!(used[first..].iter().all(|u| *u == 1), "{used:?}");
            assert!(first < used.len() / 2, "{used:?}");
        } else {
            assert!(
                used.iter().all(|u| *u >= 2),
                "a 2 ms server packed: {used:?}"
            );
        }
        server.stop();
    }
}

/// An rpcmesh provider reports its time per call in its heartbeat answers, and its
/// connections are packed by the same rule as a plain v1 server's: with the eight calls of
/// a round all in flight together, one that reports 30 µs per call gets four on each of
/// two connections in every round (100 µs ÷ 30 µs = 3 calls ahead, plus the call), one
/// that reports 2 ms none packed: spread over the pool by the less loaded of two. Both
/// from the first round: the pool's first heartbeats come before it is published. The
/// broker before this packed both onto one connection, as it still packs a provider that
/// reports nothing (`calls_are_packed_onto_one_connection_until_it_is_busy`).
#[tokio::test]
async fn an_rpcmesh_provider_is_packed_only_as_deep_as_its_reported_time_allows() {
    use rpcmesh_broker::config::DEFAULT_PACK_WAIT;
    for per_call in [Duration::from_micros(30), Duration::from_millis(2)] {
        let server = V1Server::reporting(per_call).await;
        let (used, pace) =
            connections_used_per_round(&server, PeerKind::Rpcmesh, DEFAULT_PACK_WAIT, true).await;
        println!("reported {per_call:?}: connections used per round {used:?}");
        assert_eq!(pace, per_call.as_secs_f64(), "the report, published");
        if per_call < DEFAULT_PACK_WAIT {
            assert!(used.iter().all(|u| *u == 2), "{used:?}");
        } else {
            assert!(
                used.iter().all(|u| *u >= 2),
                "a 2 ms provider packed: {used:?}"
            );
        }
        server.stop();
    }
}

/// End to end with the real provider: it times its own work per call (here a handler
/// that burns 2 ms of CPU) and the broker publishes what it reported.
#[tokio::test]
async fn a_providers_reported_time_per_call_reaches_the_broker() {
    use rpcmesh_common::metrics::catalogue::UPSTREAM_PACE_SECONDS;
    use rpcmesh_provider::service::{ServiceMode, ServiceTime};
    let p = provider(ProviderConfig {
        service_time: ServiceTime::Fixed(Duration::from_millis(2)),
        service_mode: ServiceMode::Work,
        ..ProviderConfig::default()
    })
    .await;
    let b = broker(broker_config(&[p.addr])).await;
    let c = client(b.addr).await;
    until_ready(&c).await;
    for _ in 0..3 {
        let r = testkit::echo_call(&c, "x").await.unwrap().unwrap();
        assert_eq!(r.status, Status::Success);
    }
    let pace = || b.metric(UPSTREAM_PACE_SECONDS.name, &[]);
    wait_until("the provider's time per call to be published", || {
        pace() >= 0.002
    })
    .await;
    assert!(pace() < 1.0, "{}", pace());
    b.stop().await;
    p.stop().await;
}

/// Callers choose the service and method names; only names that have been answered
/// successfully get their own labels, so bogus names cannot use up the label budget.
#[tokio::test]
async fn only_names_that_succeed_get_their_own_labels() {
    let Mesh { p, b, c } = mesh(|_| {}).await;
    for i in 0..300 {
        let r = c.call(&format!("Bogus{i}"), "x", &echo("?")).await.unwrap();
        assert_eq!(r.status, Status::Failed);
    }
    let r = c
        .call("PlatformService", "doQuery", &query())
        .await
        .unwrap();
    assert_eq!(r.status, Status::Success);
    let text = b.telemetry.render();
    assert!(!text.contains("Bogus"), "bogus names got labels");
    assert_eq!(
        sample(
            &text,
            "rpcmesh_calls_total",
            &[("service", "PlatformService"), ("status", "ok")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "rpcmesh_calls_total",
            &[("service", "_other"), ("status", "failed")]
        ),
        Some(300.0)
    );
    b.stop().await;
    p.stop().await;
}
