//! Black-box tests of calls through the broker in front of real providers, all on
//! 127.0.0.1: echo and platform calls, fan-out, byte-identical v1 replies, compression,
//! unknown services, bad input, heartbeats, oversized replies and the labels of names.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use rpcmesh_broker::{CellPlacement, PlacementTuning, UpstreamSpec};
use rpcmesh_common::metrics::recorder::sample;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::Gate;
use rpcmesh_testkit::{self as testkit};
use rpcmesh_wire::body::Request;
use rpcmesh_wire::compress::CompressionConfig;
use rpcmesh_wire::proto::platform::QueryResponse;
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use rpcmesh_wire::{PeerKind, Status};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

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
/// reference's golden reply, byte for byte: the broker's id remapping is invisible. On
/// both engines.
#[tokio::test]
async fn a_v1_client_gets_byte_identical_v1_replies_through_the_broker() {
    let p = provider(ProviderConfig::default()).await;
    for engine in ENGINES {
        let b = broker_with(engine, broker_config(&[p.addr])).await;
        until_ready(&client(b.addr()).await).await;
        let golden = ("echo_request_id1", "echo_response_ok_id1");
        let (got, want) = testkit::golden_exchange(b.addr(), golden.0, golden.1)
            .await
            .unwrap();
        assert_eq!(got, want, "{engine:?}");
        b.stop().await;
    }
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
async fn the_broker_answers_heartbeats() {
    let p = provider(ProviderConfig::default()).await;
    for engine in ENGINES {
        let b = broker_with(engine, broker_config(&[p.addr])).await;
        let c = client(b.addr()).await;
        let hb = c.heartbeat().await.unwrap();
        assert_eq!(hb.service_name, "broker", "{engine:?}");
        b.stop().await;
    }
    p.stop().await;
}

/// A client that asks to be told of the drain (`ext::DRAIN_NOTICE_FIELD`) is told as it
/// begins, and its connection is not closed under it after the plain linger: a call it
/// sends well after that linger is answered "not run", where a connection closed after
/// `DRAIN_LINGER` would have lost it (or run it unseen). The broker then waits for that
/// client to close. A plain v1 client is told nothing (its frames stay v1) and is closed
/// after the linger. On both engines.
#[tokio::test]
async fn a_client_that_asks_is_told_of_the_drain_and_closes_first() {
    use bytes::BytesMut;
    use rpcmesh_common::net::session::{DRAIN_LINGER, NOTICED_DRAIN_LINGER};
    use rpcmesh_wire::body::Heartbeat;
    use rpcmesh_wire::envelope::CallCodec;
    use rpcmesh_wire::ext;
    use rpcmesh_wire::frame::Flags;
    use tokio::io::AsyncReadExt;
    let p = provider(ProviderConfig::default()).await;
    for engine in ENGINES {
        let b = broker_with(engine, broker_config(&[p.addr])).await;
        until_ready(&client(b.addr()).await).await;
        let (mut told, mut plain) = (
            TcpStream::connect(b.addr()).await.unwrap(),
            TcpStream::connect(b.addr()).await.unwrap(),
        );
        let (mut buf, mut plain_buf) = (BytesMut::new(), BytesMut::new());
        let mut ask = BytesMut::new();
        let asked = [(ext::HEARTBEAT_KEY, ext::DRAIN_NOTICE_FIELD)];
        Heartbeat::put_now_with(&mut ask, 7, "t", "t", &asked).unwrap();
        told.write_all(&ask).await.unwrap();
        let answer = testkit::read_frames(&mut told, &mut buf, 1).await.unwrap();
        let fields = Heartbeat::parse(&answer[0].body).unwrap();
        let fields = fields.extra_value(ext::HEARTBEAT_KEY).unwrap();
        assert!(
            ext::takes(fields, ext::DRAIN_NOTICE_FIELD),
            "{engine:?}: {fields}"
        );
        // The plain client has made a call: its session is up.
        plain
            .write_all(&testkit::echo_request(1, "v1"))
            .await
            .unwrap();
        testkit::read_frames(&mut plain, &mut plain_buf, 1)
            .await
            .unwrap();

        let stopped = tokio::spawn(b.stop());
        let notice = testkit::read_frames(&mut told, &mut buf, 1).await.unwrap();
        assert!(ext::is_drain_notice(&notice[0]), "{engine:?}: {notice:?}");
        // Long after the plain linger, within the told one.
        tokio::time::sleep(DRAIN_LINGER * 3).await;
        assert!(DRAIN_LINGER * 3 < NOTICED_DRAIN_LINGER / 2);
        let mut late = BytesMut::new();
        rpcmesh_wire::body::Request {
            service: bytes::Bytes::from_static(b"EchoService"),
            method: bytes::Bytes::from_static(b"Echo"),
            payload: bytes::Bytes::new(),
        }
        .put(&mut late, Flags::EXT_STATUS, 2)
        .unwrap();
        told.write_all(&late).await.unwrap();
        let refused = testkit::read_frames(&mut told, &mut buf, 1).await;
        let refused = refused.unwrap_or_else(|e| panic!("{engine:?}: the late call was lost: {e}"));
        assert!(
            refused[0].header.flags.contains(Flags::NOT_RUN),
            "{engine:?}"
        );
        let r = CallCodec::new(None, 1 << 20)
            .decode_response(&refused[0])
            .unwrap();
        assert_eq!(r.status, Status::Unavailable, "{engine:?}");

        // The plain client was closed after the linger, told nothing.
        let mut rest = Vec::new();
        let read = tokio::time::timeout(testkit::PROBE_TIMEOUT, plain.read_to_end(&mut rest));
        read.await.unwrap().unwrap();
        assert!(
            rest.is_empty() && plain_buf.is_empty(),
            "{engine:?}: {rest:?}"
        );

        // The told client closes: the drain ends.
        drop(told);
        tokio::time::timeout(testkit::PROBE_TIMEOUT, stopped)
            .await
            .unwrap()
            .unwrap();
    }
    p.stop().await;
}

/// A provider that takes connections and never answers their heartbeats is given no call:
/// a connection takes calls only once it answered its first heartbeat, so a call for it
/// is answered "unavailable" at once instead of waiting at a provider that will never
/// answer. On both engines.
#[tokio::test]
async fn a_provider_that_never_answers_a_heartbeat_is_given_no_call() {
    use rpcmesh_wire::frame::MsgType;
    use std::sync::atomic::AtomicUsize;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let seen = requests.clone();
    let server = tokio::spawn(async move {
        loop {
            let (mut s, _) = silent.accept().await.unwrap();
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = bytes::BytesMut::new();
                while let Ok(frames) = testkit::read_frames(&mut s, &mut buf, 1).await {
                    let calls = frames.iter().filter(|f| {
                        matches!(f.header.msg_type, MsgType::Request | MsgType::ExtRequest)
                    });
                    seen.fetch_add(calls.count(), Ordering::SeqCst);
                }
            });
        }
    });
    for engine in ENGINES {
        let mut cfg = broker_config(&[]);
        cfg.upstreams =
            vec![UpstreamSpec::parse(&format!("EchoService={addr}"), PeerKind::Rpcmesh).unwrap()];
        // The start waits for it this long (then serves); its connections are given up
        // and made again meanwhile, and are up, unanswered, when the call comes.
        cfg.health_timeout = Duration::from_secs(2);
        cfg.connect_timeout = Duration::from_secs(1);
        let b = broker_with(engine, cfg).await;
        let c = client(b.addr()).await;
        let r = c.call("EchoService", "Echo", &echo("x")).await.unwrap();
        assert_eq!(r.status, Status::Unavailable, "{engine:?}");
        b.stop().await;
    }
    server.abort();
    assert_eq!(
        requests.load(Ordering::SeqCst),
        0,
        "a call reached the silent provider"
    );
}

/// The broker asks its providers to be told of their drain, and closes its connections to
/// a provider that tells it once their calls are answered: the draining provider's
/// sessions all end closed by their peer, none cut by its own linger (where a call the
/// broker wrote just then would have been lost). On both engines.
#[tokio::test]
async fn a_draining_provider_tells_the_broker_which_closes_its_connections_first() {
    for engine in ENGINES {
        let p = provider(ProviderConfig::default()).await;
        let b = broker_with(engine, broker_config(&[p.addr])).await;
        until_ready(&client(b.addr()).await).await;
        let telemetry = p.telemetry.clone();
        let t0 = std::time::Instant::now();
        p.stop().await;
        println!("{engine:?}: provider drained in {:?}", t0.elapsed());
        let closed = |reason| {
            let labels = [("role", "provider"), ("reason", reason)];
            sample(
                &telemetry.render(),
                "rpcmesh_connections_closed_total",
                &labels,
            )
            .unwrap_or(0.0)
        };
        assert!(closed("peer") >= 1.0, "{engine:?}: {}", telemetry.render());
        assert_eq!(
            closed("shutdown"),
            0.0,
            "{engine:?}: {}",
            telemetry.render()
        );
        b.stop().await;
    }
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

/// With two cells spread (`--threads 2 --cell-placement spread`), client connections are
/// dealt to both: each cell
/// answers the calls of its own connections over its own share of the provider's pool,
/// and the cells' counts, kept apart, add up to the broker's count of calls at a scrape,
/// as the pool gauges of the two cells add up to the configured pool.
#[tokio::test]
async fn two_cells_each_serve_their_connections_and_their_counts_add_up() {
    const CONNECTIONS: usize = 4;
    const CALLS: usize = 20;
    for engine in ENGINES {
        let p = provider(ProviderConfig::default()).await;
        let mut cfg = broker_config(&[p.addr]);
        cfg.cells = 2;
        cfg.cell_placement = CellPlacement::Spread;
        let pool_size = cfg.pool_size;
        let b = broker_with(engine, cfg).await;
        let clients = ready_clients(b.addr(), CONNECTIONS).await;
        let calls = clients.iter().enumerate().map(|(i, c)| async move {
            for k in 0..CALLS {
                let m = format!("conn {i} call {k}");
                let r = c.call("EchoService", "Echo", &echo(&m)).await.unwrap();
                assert_eq!(r.status, Status::Success);
                assert_eq!(r.decode::<EchoResponse>().unwrap().message, m);
            }
        });
        futures_util::future::join_all(calls).await;
        let cell = |k: &str| b.metric("rpcmesh_cell_calls_total", &[("cell", k)]);
        let (first, second) = (cell("0"), cell("1"));
        let total = b.metric("rpcmesh_calls_total", &[]);
        assert!(
            first >= CALLS as f64 && second >= CALLS as f64,
            "both cells answered calls of their connections: {first} and {second}"
        );
        assert_eq!(first + second, total, "the cells' counts add up");
        assert!(total >= (CONNECTIONS * CALLS) as f64, "{total}");
        // Each cell has its share of the pool, and the gauges show their sum.
        testkit::wait_for("both cells' pools to be published", || async {
            (b.metric("rpcmesh_pool_healthy_connections", &[]) == f64::from(pool_size))
                .then_some(())
        })
        .await;
        assert_eq!(
            b.metric("rpcmesh_pool_connections", &[]),
            f64::from(pool_size)
        );
        b.stop().await;
        p.stop().await;
    }
}

/// Two cells gathering (`--threads 2`, the default placement): a light load stays on the
/// first cell, the second serves nothing and no connection moves.
#[tokio::test]
async fn two_gathered_cells_keep_a_light_load_on_one() {
    const CONNECTIONS: usize = 4;
    for engine in ENGINES {
        let p = provider(ProviderConfig::default()).await;
        let mut cfg = broker_config(&[p.addr]);
        cfg.cells = 2;
        cfg.placement_tuning.review = Duration::from_millis(50);
        let b = broker_with(engine, cfg).await;
        let clients = ready_clients(b.addr(), CONNECTIONS).await;
        for (i, c) in clients.iter().enumerate() {
            for k in 0..10 {
                let m = echo(&format!("{i} {k}"));
                let r = c.call("EchoService", "Echo", &m).await.unwrap();
                assert_eq!(r.status, Status::Success);
            }
            // Several reviews pass while the connections are open.
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        let cell = |k: &str| b.metric("rpcmesh_cell_calls_total", &[("cell", k)]);
        assert_eq!(cell("1"), 0.0, "the second cell served nothing");
        assert_eq!(cell("0"), b.metric("rpcmesh_calls_total", &[]));
        assert_eq!(b.metric("rpcmesh_cells_open", &[]), 1.0);
        assert_eq!(b.metric("rpcmesh_cell_moves_total", &[]), 0.0);
        b.stop().await;
        p.stop().await;
    }
}

/// Connections move between cells with their calls in flight: with every trial of a
/// second cell made at once and failed (a placement tuned so), half of the connections
/// move to the second cell and back while their calls wait at the provider. Every call
/// is answered once, on the connection that made it, with its own reply; the calls made
/// after the moves are too; and the counts add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_move_between_cells_with_their_calls_in_flight() {
    const CONNECTIONS: usize = 4;
    const HELD: usize = 3;
    let gate = Gate::new();
    let p = held_provider(&gate).await;
    let mut cfg = broker_config(&[p.addr]);
    cfg.cells = 2;
    cfg.placement_tuning = PlacementTuning {
        review: Duration::from_millis(50),
        spread_busy_pct: 0,
        spread_gain_pct: u32::MAX,
        steady_reviews: 0,
        ..PlacementTuning::default()
    };
    let b = broker(cfg).await;
    let clients = ready_clients(b.addr, CONNECTIONS).await;
    let held: Vec<_> = (0..CONNECTIONS)
        .flat_map(|i| (0..HELD).map(move |k| (format!("conn {i} held {k}"), i)))
        .map(|(m, i)| (held_call(&clients[i], &m), m))
        .collect();
    testkit::wait_for("the held calls to reach the provider", || async {
        (gate.arrived() == CONNECTIONS * HELD).then_some(())
    })
    .await;
    // A trial moves half the connections to the second cell; it fails, and they move
    // back.
    testkit::wait_for("connections to move out and back", || async {
        (b.metric("rpcmesh_cell_moves_total", &[]) >= CONNECTIONS as f64).then_some(())
    })
    .await;
    gate.open();
    for (call, m) in held {
        let r = call.await.unwrap().unwrap();
        assert_eq!(r.status, Status::Success, "{m}");
        assert_eq!(r.decode::<EchoResponse>().unwrap().message, m);
    }
    for (i, c) in clients.iter().enumerate() {
        let m = format!("conn {i} after");
        let r = c.call("EchoService", "Echo", &echo(&m)).await.unwrap();
        assert_eq!(r.decode::<EchoResponse>().unwrap().message, m);
    }
    let cell = |k: &str| b.metric("rpcmesh_cell_calls_total", &[("cell", k)]);
    let total = b.metric("rpcmesh_calls_total", &[]);
    assert_eq!(cell("0") + cell("1"), total, "the cells' counts add up");
    assert_eq!(
        b.metric("rpcmesh_calls_total", &[("status", "ok")]),
        total,
        "no call failed"
    );
    assert_eq!(b.metric("rpcmesh_calls_in_flight", &[]), 0.0);
    b.stop().await;
    p.stop().await;
}

/// Echo calls on each of `clients`, each checked, until `stop` (bounded: each ends by
/// itself after 20 s), connection `i` pausing `pause(i)` after each call; each task
/// returns its calls.
fn echo_loads(
    clients: &[Client],
    stop: &Arc<AtomicBool>,
    pause: impl Fn(usize) -> Option<Duration>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (c, stop, pause) = (c.clone(), stop.clone(), pause(i));
            tokio::spawn(async move {
                let end = std::time::Instant::now() + Duration::from_secs(20);
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < end {
                    let m = format!("conn {i} call {k}");
                    let r = c.call("EchoService", "Echo", &echo(&m)).await.unwrap();
                    assert_eq!(r.decode::<EchoResponse>().unwrap().message, m);
                    k += 1;
                    if let Some(p) = pause {
                        tokio::time::sleep(p).await;
                    }
                }
                k
            })
        })
        .collect()
}

/// A spread moves the connections that carry half the calls, not half the connections:
/// one connection calling without pause beside three that call now and then, at a
/// placement tuned to try one more cell once the load is steady and to keep it. The busy
/// connection moves alone, and the second cell answers its calls; the light ones stay.
/// Split by count, two connections moved, often light ones only.
// One thread: the first cell is the test's runtime, whose busy time the placement reads
// on the thread it runs on, as a broker's first cell is.
#[tokio::test(flavor = "current_thread")]
async fn a_spread_moves_the_heavy_connection_and_leaves_the_light_ones() {
    const LIGHT: usize = 3;
    for engine in ENGINES {
        let p = provider(ProviderConfig::default()).await;
        let mut cfg = broker_config(&[p.addr]);
        cfg.cells = 2;
        cfg.placement_tuning = PlacementTuning {
            review: Duration::from_millis(100),
            spread_busy_pct: 0,
            spread_gain_pct: 0,
            // The load runs a few reviews before the trial: each connection's calls/s shows.
            steady_reviews: 3,
            // A spread stays: no trial of one fewer undoes it (how trials are judged is the
            // placement's unit tests').
            gather_trials: false,
            // Nor does a light load gather it: a test starved of CPU looks light.
            gather_below_pct: 0,
        };
        let b = broker_with(engine, cfg).await;
        let clients = ready_clients(b.addr(), 1 + LIGHT).await;
        let stop = Arc::new(AtomicBool::new(false));
        // The first connection calls without pause, the light ones every 100 ms.
        let loads = echo_loads(&clients, &stop, |i| {
            (i > 0).then_some(Duration::from_millis(100))
        });
        let cell = |k: &str| b.metric("rpcmesh_cell_calls_total", &[("cell", k)]);
        testkit::wait_for(
            "the second cell to answer the busy connection's calls",
            || async { (cell("1") >= 500.0).then_some(()) },
        )
        .await;
        let moves = b.metric("rpcmesh_cell_moves_total", &[]);
        // The light connections' calls meanwhile: still answered by the first cell.
        let first = cell("0");
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::Relaxed);
        let mut made = Vec::new();
        for l in loads {
            made.push(l.await.unwrap());
        }
        assert_eq!(moves, 1.0, "only the busy connection moved");
        assert!(
            cell("0") > first,
            "the light connections stayed on the first cell: {first} then {}",
            cell("0")
        );
        let total = b.metric("rpcmesh_calls_total", &[]);
        assert_eq!(cell("0") + cell("1"), total, "the cells' counts add up");
        assert_eq!(b.metric("rpcmesh_calls_total", &[("status", "ok")]), total);
        assert!(made[0] > 10 * made[1], "the load was uneven: {made:?}");
        b.stop().await;
        p.stop().await;
    }
}

/// A second cell that answers more calls is kept, and gathered back when the load falls:
/// with a placement tuned to try at once and to keep any trial that answers calls,
/// connections under load move to the second cell, which answers their calls; once the
/// load stops, one cell is open again and every connection is served.
// One thread: the first cell is the test's runtime, whose busy time the placement reads
// on the thread it runs on, as a broker's first cell is.
#[tokio::test(flavor = "current_thread")]
async fn a_spread_that_pays_is_kept_and_gathered_back_when_the_load_falls() {
    const CONNECTIONS: usize = 4;
    for engine in ENGINES {
        let p = provider(ProviderConfig::default()).await;
        let mut cfg = broker_config(&[p.addr]);
        cfg.cells = 2;
        cfg.placement_tuning = PlacementTuning {
            review: Duration::from_millis(50),
            spread_busy_pct: 0,
            spread_gain_pct: 0,
            steady_reviews: 0,
            // A spread stays: no trial of one fewer undoes it (how trials are judged is the
            // placement's unit tests').
            gather_trials: false,
            ..PlacementTuning::default()
        };
        let b = broker_with(engine, cfg).await;
        let clients = ready_clients(b.addr(), CONNECTIONS).await;
        let stop = Arc::new(AtomicBool::new(false));
        let loads = echo_loads(&clients, &stop, |_| None);
        let cell = |k: &str| b.metric("rpcmesh_cell_calls_total", &[("cell", k)]);
        testkit::wait_for(
            "the second cell to answer calls of connections moved to it",
            || async { (cell("1") >= 100.0).then_some(()) },
        )
        .await;
        stop.store(true, Ordering::Relaxed);
        let mut made = 0;
        for l in loads {
            made += l.await.unwrap();
        }
        // Gathered back by the light load. (That the moves back carry their calls is
        // `connections_move_between_cells_with_their_calls_in_flight`'s.)
        testkit::wait_for("the connections to be gathered on one cell", || async {
            (b.metric("rpcmesh_cells_open", &[]) == 1.0).then_some(())
        })
        .await;
        for c in &clients {
            let r = c.call("EchoService", "Echo", &echo("after")).await.unwrap();
            assert_eq!(r.status, Status::Success);
        }
        let total = b.metric("rpcmesh_calls_total", &[]);
        assert_eq!(cell("0") + cell("1"), total, "the cells' counts add up");
        assert_eq!(b.metric("rpcmesh_calls_total", &[("status", "ok")]), total);
        assert!(total >= made as f64, "{total} answered, {made} made");
        b.stop().await;
        p.stop().await;
    }
}

/// A policy (`--authz-policy`) on a broker without TLS: its callers are anonymous, and
/// only what a rule naming `anonymous` allows goes through; the rest is answered
/// "permission denied" by the broker, counted, and never reaches a provider. The file
/// is read again when it changes. On both engines.
#[tokio::test]
async fn a_policy_lets_anonymous_callers_make_only_the_calls_it_allows() {
    for engine in ENGINES {
        let dir = std::env::temp_dir().join(format!(
            "rpcmesh-broker-policy-{engine}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("policy.toml");
        let allow =
            |calls: &str| format!("[[allow]]\ncallers = [\"anonymous\"]\ncalls = [{calls}]\n");
        std::fs::write(&file, allow("\"EchoService.Echo\"")).unwrap();
        let p = provider(ProviderConfig::default()).await;
        let mut cfg = broker_config(&[p.addr]);
        cfg.authz_policy = Some(file.clone());
        let b = broker_with(engine, cfg).await;
        let c = ready_clients(b.addr(), 1).await.remove(0);
        let r = c
            .call("EchoService", "Echo", &echo("allowed"))
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success, "{engine}");
        for _ in 0..3 {
            let r = c
                .call("PlatformService", "doQuery", &query())
                .await
                .unwrap();
            assert_eq!(r.status, Status::PermissionDenied, "{engine}");
        }
        let denied = || b.metric("rpcmesh_authz_denied_total", &[]);
        assert_eq!(denied(), 3.0, "{engine}");
        assert_eq!(
            p.metric("rpcmesh_calls_total", &[("service", "PlatformService")]),
            0.0,
            "{engine}: no denied call reached the provider"
        );
        // The file changes: platform calls are allowed from then on.
        std::fs::write(&file, allow("\"EchoService.*\", \"PlatformService.*\"")).unwrap();
        let reloads = || {
            b.metric(
                "rpcmesh_file_reloads_total",
                &[("file", "policy"), ("result", "ok")],
            )
        };
        testkit::wait_until("the new policy to be read", || reloads() >= 1.0).await;
        let r = c
            .call("PlatformService", "doQuery", &query())
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success, "{engine}");
        assert_eq!(denied(), 3.0, "{engine}");
        b.stop().await;
        p.stop().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}
