//! The loop engine (`rpcmesh_broker::engine`) in front of real providers, as the broker
//! on Tokio is tested: every call answered with its own reply (plain, with its deadline,
//! from a v1 caller), the broker's own answers where it refuses (an unknown service, a
//! cap, a bad frame, a call that outlives its timeout), a provider connection lost and
//! made again, and a drain that answers every call. Each run ends with the engine's
//! counts adding up: every call read has exactly one outcome.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use bytes::BytesMut;
use rpcmesh_broker::BrokerConfig;
use rpcmesh_broker::engine::{self, LoopHandle, Summary};
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::{Gate, echo_calls, echo_request, read_frames, wait_for, wait_until};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::ext::{deadline_block, put_ext_request};
use rpcmesh_wire::frame::{Flags, Frame, MsgType};
use rpcmesh_wire::proto::rpc::EchoResponse;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The system allocator, counted per thread, so that the engine's rounds can show what
/// they allocate (`rpcmesh_common::alloc`).
#[global_allocator]
static ALLOCATOR: rpcmesh_common::alloc::Counting = rpcmesh_common::alloc::Counting::system();

/// Calls in flight on each client connection at once: several per read, both ways.
const CALLS_PER_CLIENT: usize = 64;

fn start(config: BrokerConfig) -> LoopHandle {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    engine::spawn(config, listener).unwrap()
}

/// Stops the engine and waits for its drain to end (on a thread of its own: the
/// providers it waits for run on the test's runtime). Its counts must add up.
async fn stop(h: LoopHandle) -> Summary {
    h.stop();
    let s = tokio::task::spawn_blocking(move || h.join())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        s.calls,
        s.replied + s.answered + s.orphaned,
        "every call read has one outcome: {s:?}"
    );
    s
}

async fn client_of(h: &LoopHandle, config: ClientConfig) -> Client {
    let c = Client::connect(h.local_addr(), config).await.unwrap();
    until_ready(&c).await;
    c
}

/// Echo call `id` carrying `message`, with `budget` left, as a driver sends it.
fn with_deadline(id: u64, message: &str, budget: Duration) -> BytesMut {
    let plain = Frame::from_bytes(echo_request(id, message).freeze()).unwrap();
    let mut out = BytesMut::new();
    put_ext_request(
        &mut out,
        Flags::EXT_STATUS,
        id,
        &deadline_block(budget),
        &plain.body,
    );
    out
}

#[tokio::test]
async fn the_loop_engine_answers_every_call_with_its_own_reply() {
    let p = provider(Default::default()).await;
    let mut cfg = broker_config(&[p.addr]);
    cfg.pool_size = 2;
    let h = start(cfg);
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(client_of(&h, ClientConfig::default()).await);
    }
    let calls: Vec<_> = clients
        .iter()
        .map(|c| echo_calls(c, CALLS_PER_CLIENT))
        .collect();
    for handles in calls {
        for (i, call) in handles.into_iter().enumerate() {
            let r = call.await.unwrap().unwrap();
            assert_eq!(r.status, Status::Success, "call {i}");
            let echoed = r.decode::<EchoResponse>().unwrap().message;
            assert_eq!(echoed, format!("m{i}"));
        }
    }
    // A plain v1 caller, answered as one.
    let v1 = client_of(&h, ClientConfig::plain_v1()).await;
    let r = v1.call("EchoService", "Echo", &echo("v1")).await.unwrap();
    assert_eq!(r.status, Status::Success);
    // Calls with their deadlines, which the provider says it takes: each answered.
    let mut s = TcpStream::connect(h.local_addr()).await.unwrap();
    let mut out = BytesMut::new();
    for id in 1..=8u64 {
        out.extend_from_slice(&with_deadline(
            id,
            &format!("d{id}"),
            Duration::from_secs(5),
        ));
    }
    s.write_all(&out).await.unwrap();
    let mut buf = BytesMut::new();
    let replies = read_frames(&mut s, &mut buf, 8).await.unwrap();
    let mut codec = CallCodec::new(None, 1 << 20);
    for f in replies {
        assert_eq!(f.header.msg_type, MsgType::Response);
        let r = codec.decode_response(&f).unwrap();
        assert_eq!(r.status, Status::Success, "{}", r.rpc.error_msg);
        let echoed = <EchoResponse as prost::Message>::decode(&r.rpc.payload[..]).unwrap();
        assert_eq!(echoed.message, format!("d{}", f.header.req_id));
    }
    let summary = stop(h).await;
    assert!(
        summary.replied >= 4 * CALLS_PER_CLIENT as u64 + 9,
        "{summary:?}"
    );
    p.stop().await;
}

#[tokio::test]
async fn the_loop_engine_answers_what_it_refuses_or_times_out() {
    let gate = Gate::new();
    let p = held_provider(&gate).await;
    let mut cfg = broker_config(&[p.addr]);
    cfg.max_in_flight_per_conn = 2;
    cfg.call_timeout = Duration::from_millis(300);
    let h = start(cfg);
    let c = client_of(&h, ClientConfig::default()).await;

    let r = c.call("Nope", "x", &echo("?")).await.unwrap();
    assert_eq!(
        r.status,
        Status::Failed,
        "the provider's answer: {}",
        r.error_msg
    );

    // Two calls held by the provider fill the connection's cap: the third is shed.
    let held = [held_call(&c, "a"), held_call(&c, "b")];
    wait_until("both calls to reach the provider", || gate.arrived() == 2).await;
    let r = c
        .call("EchoService", "Echo", &echo("shed me"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Overloaded);
    assert!(
        r.error_msg.contains("2 calls in flight on this connection"),
        "{}",
        r.error_msg
    );
    // Held past the call timeout: answered by the broker, the late replies dropped.
    for call in held {
        let r = call.await.unwrap().unwrap();
        assert_eq!(r.status, Status::Timeout, "{}", r.error_msg);
        assert!(
            r.error_msg.contains("no reply from provider"),
            "{}",
            r.error_msg
        );
    }
    gate.open();
    let r = c.call("EchoService", "Echo", &echo("after")).await.unwrap();
    assert_eq!(r.status, Status::Success);

    // A frame whose CRC does not match is answered under its id; junk ends the
    // connection.
    let mut s = TcpStream::connect(h.local_addr()).await.unwrap();
    let mut bad = echo_request(7, "crc");
    let last = bad.len() - 5;
    bad[last] ^= 0xff;
    s.write_all(&bad).await.unwrap();
    let mut buf = BytesMut::new();
    let f = read_frames(&mut s, &mut buf, 1).await.unwrap().remove(0);
    assert_eq!(f.header.req_id, 7);
    let r = CallCodec::new(None, 1 << 20).decode_response(&f).unwrap();
    assert_ne!(r.status, Status::Success, "{}", r.rpc.error_msg);
    s.write_all(&[0x55; 64]).await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(
        read.is_ok(),
        "the engine closes a connection that sends junk"
    );
    // A header over the frame limit cannot be got past either: its call is answered
    // before the connection closes.
    let mut s = TcpStream::connect(h.local_addr()).await.unwrap();
    let mut big = echo_request(9, "big");
    big[6..10].copy_from_slice(&u32::MAX.to_be_bytes());
    s.write_all(&big[..18]).await.unwrap();
    let mut buf = BytesMut::new();
    let f = read_frames(&mut s, &mut buf, 1).await.unwrap().remove(0);
    assert_eq!(f.header.req_id, 9);
    let r = CallCodec::new(None, 1 << 20).decode_response(&f).unwrap();
    assert_ne!(r.status, Status::Success);
    assert!(r.rpc.error_msg.contains("too large"), "{}", r.rpc.error_msg);
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "then the connection closes");

    let summary = stop(h).await;
    assert!(summary.answered >= 4, "{summary:?}");
    p.stop().await;
}

/// The next call the engine writes on `sock`, a provider played by hand; heartbeats
/// before it are answered when `answer` says so.
async fn next_call(sock: &mut TcpStream, buf: &mut BytesMut, answer: bool) -> Frame {
    loop {
        let f = read_frames(sock, buf, 1).await.unwrap().remove(0);
        match f.header.msg_type {
            MsgType::Request | MsgType::ExtRequest => return f,
            MsgType::Heartbeat if answer => {
                let mut out = BytesMut::new();
                Heartbeat::put_now_with(
                    &mut out,
                    f.header.req_id,
                    "p",
                    "p",
                    &[] as &[(&str, &str)],
                )
                .unwrap();
                sock.write_all(&out).await.unwrap();
            }
            _ => {}
        }
    }
}

/// A provider played by hand answers a call with a reply whose CRC is wrong (that call
/// alone fails, at once), loses its connection with a call in flight (that call is
/// answered), then, connected again, answers no heartbeat (the engine gives the
/// connection up after its health timeout); a real provider on the same port is then
/// connected to and serves.
#[tokio::test]
async fn the_loop_engine_answers_a_providers_bad_reply_silence_and_loss() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut cfg = broker_config(&[listener.local_addr().unwrap()]);
    cfg.pool_size = 1;
    cfg.call_timeout = Duration::from_secs(3600);
    let h = start(cfg);
    let (mut sock, _) = listener.accept().await.unwrap();
    let c = Client::connect(h.local_addr(), ClientConfig::default())
        .await
        .unwrap();
    let mut buf = BytesMut::new();

    let call = echo_calls(&c, 1).remove(0);
    let f = next_call(&mut sock, &mut buf, true).await;
    let mut reply = BytesMut::new();
    CallCodec::new(None, 1 << 20)
        .put_ok_response(&mut reply, f.header.req_id, f.header.flags, b"")
        .unwrap();
    let last = reply.len() - 5;
    reply[last] ^= 0xff;
    sock.write_all(&reply).await.unwrap();
    let r = call.await.unwrap().unwrap();
    assert_ne!(r.status, Status::Success);
    assert!(r.error_msg.contains("refused"), "{}", r.error_msg);

    let call = echo_calls(&c, 1).remove(0);
    next_call(&mut sock, &mut buf, true).await;
    drop(sock);
    let r = call.await.unwrap().unwrap();
    assert_ne!(r.status, Status::Success);
    assert!(
        r.error_msg.contains("lost with the call in flight"),
        "{}",
        r.error_msg
    );

    // Connected again; silent: the engine closes the connection itself.
    let (mut sock, _) = listener.accept().await.unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), sock.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok(),
        "the engine gives up a connection whose heartbeats go unanswered"
    );

    let p = provider_on(listener, Default::default());
    until_ready(&c).await;
    stop(h).await;
    p.stop().await;
}

#[tokio::test]
async fn the_loop_engine_drains_refusing_new_calls_and_answering_those_in_flight() {
    let gate = Gate::new();
    let p = held_provider(&gate).await;
    let h = start(broker_config(&[p.addr]));
    let c = client_of(&h, ClientConfig::default()).await;
    let held = held_call(&c, "held");
    wait_until("the call to reach the provider", || gate.arrived() == 1).await;
    h.stop();
    // Refused, not run: the caller may go to another broker.
    let refused = wait_for("the engine to refuse new calls", || async {
        let r = c.call("EchoService", "Echo", &echo("new")).await.unwrap();
        (r.status != Status::Success).then_some(r)
    })
    .await;
    assert_eq!(refused.status, Status::Unavailable, "{}", refused.error_msg);
    gate.open();
    let r = held.await.unwrap().unwrap();
    assert_eq!(r.status, Status::Success);
    let summary = stop(h).await;
    assert_eq!(summary.orphaned, 0, "{summary:?}");
    p.stop().await;
}

/// A client that sends and never reads makes the engine stop reading it once its
/// answers waiting to be written pass the write backlog limit: what it can send is
/// bounded by that and the sockets' buffers, not by the broker's memory. Once it reads,
/// the engine reads again what waits in the socket (which raises no new readiness), and
/// every call it sent is answered once.
#[tokio::test]
async fn a_client_that_does_not_read_is_not_read_until_it_does() {
    let p = provider(Default::default()).await;
    let mut cfg = broker_config(&[]);
    cfg.upstreams = vec![
        rpcmesh_broker::UpstreamSpec::parse(
            &format!("EchoService={}", p.addr),
            rpcmesh_wire::PeerKind::Rpcmesh,
        )
        .unwrap(),
    ];
    let h = start(cfg);
    // Calls of a service no provider serves, each answered by the engine itself; all of
    // one length (they differ only in their ids).
    let mut codec = CallCodec::new(None, 1 << 20);
    let mut batch = BytesMut::new();
    const PER_BATCH: u64 = 4096;
    let mut s = TcpStream::connect(h.local_addr()).await.unwrap();
    let (mut next_id, mut written) = (0u64, 0usize);
    // Far more than the limit's worth of answers, if the engine read it all.
    let most = 40 * rpcmesh_common::net::session::WRITE_BACKLOG_LIMIT;
    'writing: while written < most {
        batch.clear();
        for id in next_id..next_id + PER_BATCH {
            let meta = Default::default();
            codec
                .put_request(
                    &mut batch,
                    id,
                    Flags::EXT_STATUS,
                    b"Nope",
                    b"x",
                    &echo("?"),
                    &meta,
                )
                .unwrap();
        }
        next_id += PER_BATCH;
        let mut at = 0;
        while at < batch.len() {
            // Stalled for a second: the engine has stopped reading.
            match tokio::time::timeout(Duration::from_secs(1), s.writable()).await {
                Err(_) => break 'writing,
                Ok(r) => r.unwrap(),
            }
            match s.try_write(&batch[at..]) {
                Ok(n) => {
                    at += n;
                    written += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
    }
    assert!(
        written < most,
        "the engine read {written} B of calls from a client that reads nothing"
    );
    // Nothing more is written, and the client closes its side while the engine does not
    // read it: the whole frames sent are answered, each once, and then the engine
    // closes too.
    s.shutdown().await.unwrap();
    let whole = (written / (batch.len() / PER_BATCH as usize)) as u64;
    let (mut buf, mut answered) = (BytesMut::new(), 0u64);
    let reader = async {
        while answered < whole {
            answered += read_frames(&mut s, &mut buf, 1).await.unwrap().len() as u64;
        }
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
        rest.len()
    };
    let rest = tokio::time::timeout(Duration::from_secs(60), reader)
        .await
        .expect("every call answered once the client reads, then the connection closed");
    assert_eq!((answered, rest), (whole, 0));
    let summary = stop(h).await;
    assert_eq!(summary.calls, whole, "{summary:?}");
    p.stop().await;
}

/// Rounds of 512 calls made before the allocations are counted.
const WARM_UP_ROUNDS: usize = 80;

/// An echo call's status.
async fn c_call(c: &Client) -> Status {
    c.call("EchoService", "Echo", &echo("barrier"))
        .await
        .unwrap()
        .status
}

/// Forwarding allocates nothing in steady state: once the buffers have grown to what 64
/// calls in flight on each of 8 connections need, echo and platform calls go through the
/// engine with no allocation at all (item 2 of the lean broker). The warm-up is long
/// (about 40,000 calls): in runs with a quarter of it, the buffers still grew a few times
/// in the next 30,000. Of three windows of 20 rounds of calls after it, the best is taken:
/// a buffer meeting a size it has not met before (a read that brought more at once, on a
/// loaded machine) grows once, and that is not per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_engine_forwards_without_allocating() {
    assert!(
        rpcmesh_common::alloc::counting(),
        "the counting allocator is installed"
    );
    let p = provider(Default::default()).await;
    let mut cfg = broker_config(&[p.addr]);
    // No heartbeat within the windows: they are not per call.
    cfg.health_interval = Duration::from_secs(3600);
    cfg.health_timeout = Duration::from_secs(3600);
    let h = start(cfg);
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(client_of(&h, ClientConfig::default()).await);
    }
    let round = |clients: &[Client]| {
        let calls: Vec<_> = clients
            .iter()
            .flat_map(|c| {
                let echo = echo_calls(c, 32);
                let platform = (0..32).map(|_| {
                    let c = c.clone();
                    tokio::spawn(
                        async move { c.call("PlatformService", "doQuery", &query()).await },
                    )
                });
                echo.into_iter().chain(platform).collect::<Vec<_>>()
            })
            .collect();
        async move {
            for call in calls {
                assert_eq!(call.await.unwrap().unwrap().status, Status::Success);
            }
        }
    };
    for _ in 0..WARM_UP_ROUNDS {
        round(&clients).await;
    }
    let mut windows = Vec::new();
    for _ in 0..3 {
        let before = h.allocations();
        for _ in 0..20 {
            round(&clients).await;
        }
        // One more call answered: the round that sent the window's last reply has been
        // counted (a heartbeat would do as well, but its answer allocates, and may be
        // counted in the next window).
        let barrier = c_call(&clients[0]).await;
        assert_eq!(barrier, Status::Success);
        windows.push(h.allocations() - before);
    }
    let calls = 20 * 8 * 64;
    println!("allocations in three windows of {calls} calls: {windows:?}");
    assert_eq!(windows.iter().min(), Some(&0), "{windows:?}");
    stop(h).await;
    p.stop().await;
}

/// The counts one scenario leaves in the broker's metrics, on `engine`: calls by pair and
/// status, errors by kind, calls shed, client connections, bytes, calls in flight.
async fn counts_of(engine: Engine) -> Vec<(String, f64)> {
    use rpcmesh_common::metrics::catalogue::{
        CALLS_IN_FLIGHT, CALLS_TOTAL, CONNECTIONS_CLOSED_TOTAL, CONNECTIONS_OPENED_TOTAL,
        ERRORS_TOTAL, SHED_TOTAL, WIRE_BYTES_TOTAL,
    };
    let gate = Gate::new();
    let p = held_provider(&gate).await;
    let mut cfg = broker_config(&[]);
    let spec = format!("EchoService,PlatformService,{HELD_SERVICE}={}", p.addr);
    cfg.upstreams =
        vec![rpcmesh_broker::UpstreamSpec::parse(&spec, rpcmesh_wire::PeerKind::Rpcmesh).unwrap()];
    cfg.max_in_flight_per_conn = 1;
    let b = broker_with(engine, cfg).await;
    let c = Client::connect(b.addr(), ClientConfig::default())
        .await
        .unwrap();
    until_ready(&c).await;
    let metric = |name: &str, labels: &[(&str, &str)]| b.metric(name, labels);
    // The first call counted: what came before the scenario is all in `before`.
    let echo_ok = [("service", "EchoService"), ("status", "ok")];
    wait_until("the first call to be counted", || {
        metric(CALLS_TOTAL.name, &echo_ok) >= 1.0
    })
    .await;
    let watched: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (
            CALLS_TOTAL.name,
            vec![("service", "EchoService"), ("status", "ok")],
        ),
        (
            CALLS_TOTAL.name,
            vec![("service", "PlatformService"), ("status", "ok")],
        ),
        (
            CALLS_TOTAL.name,
            vec![("service", HELD_SERVICE), ("status", "ok")],
        ),
        (CALLS_TOTAL.name, vec![("service", "_other")]),
        (
            ERRORS_TOTAL.name,
            vec![("kind", "unknown_service"), ("side", "client")],
        ),
        (SHED_TOTAL.name, vec![("cap", "per_connection")]),
        (
            ERRORS_TOTAL.name,
            vec![("kind", "unexpected"), ("side", "client")],
        ),
        (
            ERRORS_TOTAL.name,
            vec![("kind", "bad_magic"), ("side", "client")],
        ),
        (CONNECTIONS_OPENED_TOTAL.name, vec![("side", "inbound")]),
        (
            CONNECTIONS_CLOSED_TOTAL.name,
            vec![("side", "inbound"), ("reason", "peer")],
        ),
    ];
    let before: Vec<f64> = watched.iter().map(|(n, l)| metric(n, l)).collect();
    let bytes_before = metric(WIRE_BYTES_TOTAL.name, &[("side", "inbound")]);

    for i in 0..5 {
        let r = c
            .call("EchoService", "Echo", &echo(&format!("{i}")))
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success);
    }
    for _ in 0..2 {
        let r = c
            .call("PlatformService", "doQuery", &query())
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success);
    }
    let r = c.call("Nope", "x", &echo("?")).await.unwrap();
    assert_ne!(r.status, Status::Success);
    let held = held_call(&c, "held");
    wait_until("the call to reach the provider", || gate.arrived() == 1).await;
    let r = c.call("EchoService", "Echo", &echo("shed")).await.unwrap();
    assert_eq!(r.status, Status::Overloaded);
    gate.open();
    assert_eq!(held.await.unwrap().unwrap().status, Status::Success);
    // A client that sends a reply, then bytes that are no frame: kept open until the
    // counts are read (the broker ends it for its bad input, a close of its own).
    let mut hostile = tokio::net::TcpStream::connect(b.addr()).await.unwrap();
    let mut reply = bytes::BytesMut::new();
    rpcmesh_wire::envelope::put_error_response(&mut reply, 1, Flags::NONE, Status::Failed, "?");
    reply.extend_from_slice(&[b'X'; 24]);
    tokio::io::AsyncWriteExt::write_all(&mut hostile, &reply)
        .await
        .unwrap();
    let garbage = [("kind", "bad_magic"), ("side", "client")];
    wait_until("the bad input to be counted", || {
        metric(ERRORS_TOTAL.name, &garbage) > before[7]
    })
    .await;
    // A second client that comes and goes.
    let other = Client::connect(b.addr(), ClientConfig::default())
        .await
        .unwrap();
    until_ready(&other).await;
    drop(other);
    wait_until("the broker to count the closed connection", || {
        metric(
            CONNECTIONS_CLOSED_TOTAL.name,
            &[("side", "inbound"), ("reason", "peer")],
        ) > before[9]
    })
    .await;

    let mut counts: Vec<(String, f64)> = watched
        .iter()
        .zip(&before)
        .map(|((n, l), b)| (format!("{n}{l:?}"), metric(n, l) - b))
        .collect();
    let bytes = metric(WIRE_BYTES_TOTAL.name, &[("side", "inbound")]) - bytes_before;
    counts.push((
        "inbound bytes moved".into(),
        f64::from(u8::from(bytes > 0.0)),
    ));
    counts.push((
        CALLS_IN_FLIGHT.name.into(),
        metric(CALLS_IN_FLIGHT.name, &[]),
    ));
    drop(hostile);
    b.stop().await;
    p.stop().await;
    counts
}

/// The loop engine counts what the Tokio engine counts, in the same families: one
/// scenario (calls of three pairs, one of an unknown service, one shed, a client that
/// sends a reply and bytes that are no frame, a client that comes and goes) leaves the
/// same counts on both.
#[tokio::test]
async fn the_loop_engine_counts_as_the_broker_does() {
    let tokio = counts_of(Engine::Tokio).await;
    let on_loop = counts_of(Engine::Loop).await;
    for (t, l) in tokio.iter().zip(&on_loop) {
        println!("{:<90} tokio {:>4} loop {:>4}", t.0, t.1, l.1);
    }
    assert_eq!(tokio, on_loop);
    // The scenario's own figures, so that two engines counting nothing do not agree.
    // Echo: five, and the second client's first call; `_other`: the unknown service's;
    // one reply and one run of garbage from the hostile client; two clients opened, the
    // second closed by its peer.
    let expect = [6.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 0.0];
    let got: Vec<f64> = on_loop.iter().map(|c| c.1).collect();
    assert_eq!(got, expect, "{on_loop:?}");
}

/// Every call timed (`stage_sample` 1): each of the twenty calls leaves one sample in
/// each of the five stages, on both engines (the loop engine recorded none before it
/// timed its calls).
#[tokio::test]
async fn both_engines_time_every_stage_of_the_calls_they_pick() {
    use rpcmesh_broker::metrics::STAGES;
    const CALLS: usize = 20;
    for engine in ENGINES {
        let p = provider(rpcmesh_provider::ProviderConfig::default()).await;
        let mut cfg = broker_config(&[p.addr]);
        cfg.stage_sample = 1;
        let b = broker_with(engine, cfg).await;
        let c = Client::connect(b.addr(), ClientConfig::default())
            .await
            .unwrap();
        until_ready(&c).await;
        let count = |stage: &str| b.metric("rpcmesh_stage_seconds_count", &[("stage", stage)]);
        let before: Vec<f64> = STAGES.iter().map(|s| count(s)).collect();
        for i in 0..CALLS {
            let r = c.call("EchoService", "Echo", &echo(&format!("{i}"))).await;
            assert_eq!(r.unwrap().status, Status::Success);
        }
        wait_until("the last call's stages to be recorded", || {
            count("total") >= before[4] + CALLS as f64
        })
        .await;
        let got: Vec<f64> = STAGES
            .iter()
            .zip(&before)
            .map(|(s, b)| count(s) - b)
            .collect();
        println!("{engine:?}: samples by stage {STAGES:?}: {got:?}");
        assert_eq!(got, [CALLS as f64; 5], "{engine:?}");
        b.stop().await;
        p.stop().await;
    }
}

/// `broker --engine loop` is the broker on the loop engine: it serves calls on the
/// workers `--threads` asks for, counts them on its metrics endpoint, and lives through
/// SIGHUP.
#[tokio::test]
async fn the_broker_program_runs_the_loop_engine_when_told() {
    let p = rpcmesh_testkit::Spawned::start("provider", &["--threads", "1"]);
    let up = p.rpc.to_string();
    // Two workers: the program runs as many as `--threads` says.
    let b = rpcmesh_testkit::Spawned::start(
        "broker",
        &["--upstream", &up, "--engine", "loop", "--threads", "2"],
    );
    b.wait_serving().await;
    let c = Client::connect(b.rpc, ClientConfig::default())
        .await
        .unwrap();
    for i in 0..10 {
        let r = c
            .call("EchoService", "Echo", &echo(&format!("{i}")))
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success);
    }
    let ok = [("service", "EchoService"), ("status", "ok")];
    wait_until("the calls to be counted", || {
        b.metric("rpcmesh_calls_total", &ok) >= 11.0
    })
    .await;
    // SIGHUP (a unit's reload) does not end it: there is no providers file to read again.
    b.child.signal(rpcmesh_testkit::Signal::HUP);
    let r = c.call("EchoService", "Echo", &echo("after")).await.unwrap();
    assert_eq!(r.status, Status::Success);
    wait_until("the call after SIGHUP to be counted", || {
        b.metric("rpcmesh_calls_total", &ok) >= 12.0
    })
    .await;
}

/// Connections move between the loop engine's workers between their calls: with every
/// trial of a second worker made at once and failed (a placement tuned so), connections
/// under load move to the second worker and back. Every call is answered once, with its
/// own reply, and the counts add up: a session moves only with no call in flight and
/// nothing to write, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_move_between_loop_workers_between_their_calls() {
    const CONNECTIONS: usize = 4;
    let p = provider(Default::default()).await;
    let mut cfg = broker_config(&[p.addr]);
    cfg.cells = 2;
    cfg.placement_tuning = rpcmesh_broker::PlacementTuning {
        review: Duration::from_millis(50),
        spread_busy_pct: 0,
        spread_gain_pct: u32::MAX,
        steady_reviews: 0,
        ..Default::default()
    };
    let b = broker_with(Engine::Loop, cfg).await;
    let clients = ready_clients(b.addr(), CONNECTIONS).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loads: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (c, stop) = (c.clone(), stop.clone());
            tokio::spawn(async move {
                let end = std::time::Instant::now() + Duration::from_secs(20);
                let mut k = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed)
                    && std::time::Instant::now() < end
                {
                    let m = format!("conn {i} call {k}");
                    let r = c.call("EchoService", "Echo", &echo(&m)).await.unwrap();
                    assert_eq!(r.status, Status::Success, "{m}");
                    assert_eq!(r.decode::<EchoResponse>().unwrap().message, m);
                    k += 1;
                }
                k
            })
        })
        .collect();
    // A trial moves half the calls' connections to the second worker; it fails, and
    // they move back.
    wait_until("connections to move out and back", || {
        b.metric("rpcmesh_cell_moves_total", &[]) >= 2.0
            && b.metric("rpcmesh_cells_open", &[]) == 1.0
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut made = 0;
    for l in loads {
        made += l.await.unwrap();
    }
    for (i, c) in clients.iter().enumerate() {
        let m = format!("conn {i} after");
        let r = c.call("EchoService", "Echo", &echo(&m)).await.unwrap();
        assert_eq!(r.decode::<EchoResponse>().unwrap().message, m);
    }
    let cell = |k: &str| b.metric("rpcmesh_cell_calls_total", &[("cell", k)]);
    wait_until("every call to be counted", || {
        b.metric("rpcmesh_calls_total", &[]) >= (made + CONNECTIONS as u64) as f64
    })
    .await;
    let total = b.metric("rpcmesh_calls_total", &[]);
    assert!(cell("1") > 0.0, "the second worker answered calls");
    assert_eq!(cell("0") + cell("1"), total, "the workers' counts add up");
    assert_eq!(
        b.metric("rpcmesh_calls_total", &[("status", "ok")]),
        total,
        "no call failed"
    );
    assert_eq!(
        b.metric("rpcmesh_connections_open", &[("side", "inbound")]),
        CONNECTIONS as f64
    );
    assert_eq!(b.metric("rpcmesh_calls_in_flight", &[]), 0.0);
    b.stop().await;
    p.stop().await;
}
