//! The broker in front of plain RPCF v1 servers and how it packs calls onto a provider's
//! connections, black-box on 127.0.0.1: v1 interop behind the broker, quick ACKs, packing
//! until a connection is busy, and the packing depth a v1 server's measured pace or an
//! rpcmesh provider's reported time per call allows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use rpcmesh_broker::UpstreamSpec;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::{self as testkit, wait_until};
use rpcmesh_wire::body::Request;
use rpcmesh_wire::proto::rpc::EchoResponse;
use rpcmesh_wire::{PeerKind, Status};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

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
/// On both engines.
#[tokio::test]
async fn reads_from_a_plain_v1_server_with_calls_in_flight_are_acked_at_once() {
    use rpcmesh_common::metrics::catalogue::UPSTREAM_QUICK_ACKS_TOTAL;
    for engine in ENGINES {
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
            let b = broker_with(engine, cfg).await;
            until_ready(&client(b.addr()).await).await;
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
            let mut raw = TcpStream::connect(b.addr()).await.unwrap();
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
}

/// Calls are packed onto a provider's oldest connection (so that they travel in large
/// batches) until it has `--pack-in-flight` (64) in flight (this test server never reports
/// a time per call, so nothing lowers the depth); more spread over the others (a client's
/// read of many calls still goes to one connection, so the split is uneven). On both
/// engines.
#[tokio::test]
async fn calls_are_packed_onto_one_connection_until_it_is_busy() {
    for engine in ENGINES {
        packed_until_busy(engine).await;
    }
}

async fn packed_until_busy(engine: Engine) {
    let server = V1Server::start(true).await;
    let mut cfg = broker_config(&[server.addr]);
    cfg.pool_size = 4;
    // The heavy phase holds replies (heartbeats too) until all its calls are in: no call
    // or heartbeat may time out behind them on a slow machine.
    cfg.call_timeout = Duration::from_secs(30);
    cfg.health_timeout = Duration::from_secs(10);
    let b = broker_with(engine, cfg).await;
    let c = client(b.addr()).await;
    until_ready(&c).await;
    match &b {
        AnyBroker::Tokio(b) => {
            wait_until("all four pooled connections to be published", || {
                b.metric("rpcmesh_pool_healthy_connections", &[]) >= 4.0
            })
            .await
        }
        // Each connection's first heartbeat, answered: all four are up.
        AnyBroker::Loop(_) => {
            wait_until("all four connections to be made", || {
                server.heartbeats() >= 4
            })
            .await
        }
    }
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
    println!("{engine:?}, 40 in flight: requests per connection {light:?}");
    assert_eq!(light.iter().sum::<usize>(), 200);
    assert_eq!(light.iter().filter(|n| **n > 0).count(), 1, "{light:?}");
    // 300 at once, all held in flight until the last has reached the server: the first
    // connection fills, the rest spread.
    let before = server.counts();
    server.hold_replies_until(300);
    run(300).await;
    let heavy = delta(&before, &server.counts());
    println!("{engine:?}, 300 in flight: requests per connection {heavy:?}");
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
/// from the first round: the pool's first heartbeats come before it is published. A
/// provider that reports nothing is packed onto one connection
/// (`calls_are_packed_onto_one_connection_until_it_is_busy`).
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
