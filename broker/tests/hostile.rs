//! The hostile-client suite against the broker and the provider as real processes on
//! 127.0.0.1: sockets that hold a connection without using it, partial frames, calls in
//! flight when the grace period ends, big-body headers, a caller that never reads and a
//! spent memory budget; the broker's idle, partial-frame and write-timeout cases on both
//! engines (`--engine`).
//! Facts come from the programs' own `/metrics` and from what the sockets see; the only
//! times here are the timeouts under test (set short by flag), never an assertion on how
//! long something took. The hostile tests that measure rates, CPU or peak memory over
//! wall-clock windows are the system tier's (`system-tests/tests/hostile.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::{self as testkit, Spawned};
use rpcmesh_wire::Status;

/// Hostile sockets of each kind (idle, partial frame); together they fill the cap.
const EACH: usize = 12;
/// How long a hostile socket waits for the server to close it before the test fails (a
/// hang detector, far beyond the timeouts set below).
const CLOSE_WAIT: Duration = Duration::from_secs(20);

/// The connection cap, the idle timeout and the frame timeout of the server under test.
const CAP_FLAGS: [&str; 6] = [
    "--max-connections",
    "24",
    "--idle-timeout",
    "3s",
    "--frame-timeout",
    "1500ms",
];

fn inbound(reason: &str) -> [(&'static str, &str); 2] {
    [("side", "inbound"), ("reason", reason)]
}

/// Fills the cap of `server` with idle sockets and sockets that sent half a header, and
/// shows that a newcomer is refused while they hold it, then served once the timeouts
/// have closed them, each counted by its reason.
async fn the_cap_is_not_held_by_idle_or_partial_sockets(server: &Spawned) {
    let header_part = &testkit::echo_request(1, "never finished")[..10];
    let idle: Vec<TcpStream> = (0..EACH)
        .map(|_| TcpStream::connect(server.rpc).unwrap())
        .collect();
    let partial: Vec<TcpStream> = (0..EACH)
        .map(|_| {
            let mut s = TcpStream::connect(server.rpc).unwrap();
            s.write_all(header_part).unwrap();
            s
        })
        .collect();
    testkit::wait_until("the hostile sockets are accepted", || {
        server.metric("rpcmesh_connections_open", &[("side", "inbound")]) == (2 * EACH) as f64
    })
    .await;
    // The cap is full: a newcomer is accepted and closed at once.
    let mut newcomer = TcpStream::connect(server.rpc).unwrap();
    newcomer.set_read_timeout(Some(CLOSE_WAIT)).unwrap();
    assert!(
        matches!(newcomer.read(&mut [0; 1]), Ok(0) | Err(_)),
        "a newcomer is refused while the cap is held"
    );
    // Once the timeouts pass, it gets in.
    testkit::wait_for("a newcomer's call succeeds", || async {
        server.call_succeeds().await.then_some(())
    })
    .await;
    for mut s in idle.into_iter().chain(partial) {
        s.set_read_timeout(Some(CLOSE_WAIT)).unwrap();
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(_) => assert!(rest.is_empty(), "a hostile socket got no answer"),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
    }
    let m = server.scrape();
    let closed = |reason| {
        rpcmesh_common::metrics::recorder::sample(
            &m,
            "rpcmesh_connections_closed_total",
            &inbound(reason),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(closed("idle_timeout"), EACH as f64, "{m}");
    assert_eq!(closed("frame_timeout"), EACH as f64, "{m}");
    assert!(
        server.metric("rpcmesh_connections_refused_total", &[("side", "inbound")]) >= 1.0,
        "the newcomer was counted as refused"
    );
}

#[tokio::test]
async fn idle_and_partial_sockets_cannot_lock_a_provider() {
    let mut args = vec!["--threads", "1"];
    args.extend(CAP_FLAGS);
    let provider = Spawned::start("provider", &args);
    the_cap_is_not_held_by_idle_or_partial_sockets(&provider).await;
}

/// The broker's engines (`--engine`): the broker's tests here run on both.
const ENGINES: [&str; 2] = ["tokio", "loop"];

#[tokio::test]
async fn idle_and_partial_sockets_cannot_lock_a_broker() {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    for engine in ENGINES {
        let broker = broker_with(engine, &upstream, &CAP_FLAGS);
        the_cap_is_not_held_by_idle_or_partial_sockets(&broker).await;
    }
}

/// A broker on `engine`, one thread, in front of `upstream`, with `extra` flags.
fn broker_with(engine: &str, upstream: &str, extra: &[&str]) -> Spawned {
    let mut args = vec!["--engine", engine, "--threads", "1", "--upstream", upstream];
    args.extend(extra);
    Spawned::start("broker", &args)
}

/// Replies in the write-timeout test: each as large as its call, 64 KiB.
const STALLED_CALLS: usize = 128;

/// A caller that sends calls and never reads their replies: once the replies fill its
/// socket and the broker's backlog, the broker stops reading it and, the client taking
/// nothing for `--write-timeout`, closes it, counted as a write timeout. Without the
/// timeout the backlog and the connection stay for as long as the caller likes.
#[tokio::test]
async fn a_caller_that_never_reads_is_closed_by_the_write_timeout() {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    let message = "x".repeat(64 * 1024);
    for engine in ENGINES {
        let broker = broker_with(engine, &upstream, &["--write-timeout", "1s"]);
        let mut s = TcpStream::connect(broker.rpc).unwrap();
        // Small receive room, so that the replies back up at the broker; writes that the
        // broker, once it stops reading, no longer takes give up.
        socket2::SockRef::from(&s)
            .set_recv_buffer_size(4096)
            .unwrap();
        s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        for id in 0..STALLED_CALLS {
            if s.write_all(&testkit::echo_request(id as u64, &message))
                .is_err()
            {
                break;
            }
        }
        let closed = || {
            broker.metric(
                "rpcmesh_connections_closed_total",
                &inbound("write_timeout"),
            )
        };
        testkit::wait_until(
            &format!("{engine}: the caller is closed by the write timeout"),
            || closed() == 1.0,
        )
        .await;
        assert_eq!(
            broker.metric("rpcmesh_connections_open", &[("side", "inbound")]),
            0.0,
            "{engine}"
        );
    }
}

/// Calls each end-of-grace test leaves in flight.
const HELD: usize = 20;

/// Sends [`HELD`] calls to `to` (each held far beyond the grace period by the provider's
/// service time), stops `server` with SIGTERM, and checks that every call is answered
/// "unavailable" with the message of the grace period's end, and that it exits 0.
async fn calls_in_flight_at_the_end_of_the_grace_period_are_answered(
    mut server: Spawned,
    expected_message: &str,
) {
    let client = Client::connect(server.rpc, ClientConfig::default())
        .await
        .unwrap();
    let calls = testkit::echo_calls(&client, HELD);
    testkit::wait_until("the calls are in flight", || {
        server.metric("rpcmesh_calls_in_flight", &[]) == HELD as f64
    })
    .await;
    server.child.signal(testkit::Signal::TERM);
    for call in calls {
        let reply = call
            .await
            .unwrap()
            .expect("an answer, not a closed connection");
        assert_eq!(reply.status, Status::Unavailable);
        assert!(
            reply.error_msg.contains(expected_message),
            "{}",
            reply.error_msg
        );
    }
    let status = server
        .child
        .wait_timeout(CLOSE_WAIT)
        .expect("it exits after the grace period");
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn a_provider_answers_its_calls_in_flight_when_the_grace_period_ends() {
    let provider = Spawned::start(
        "provider",
        &[
            "--threads",
            "1",
            "--service-time",
            "60s",
            "--grace",
            "300ms",
        ],
    );
    calls_in_flight_at_the_end_of_the_grace_period_are_answered(
        provider,
        "provider shutting down: the grace period ended",
    )
    .await;
}

#[tokio::test]
async fn a_broker_answers_its_calls_in_flight_when_the_grace_period_ends() {
    let provider = Spawned::start("provider", &["--threads", "1", "--service-time", "60s"]);
    let upstream = provider.rpc.to_string();
    let broker = Spawned::start(
        "broker",
        &[
            "--threads",
            "1",
            "--grace",
            "300ms",
            "--call-timeout",
            "60s",
            "--upstream",
            &upstream,
        ],
    );
    // The broker takes calls once its pool has settled, which a slow first heartbeat (over
    // the health timeout, on a loaded machine) can do with no connection ready: calls
    // would then be answered "unavailable" at once and never be in flight.
    testkit::wait_until("the broker's pool to be ready", || {
        broker.metric("rpcmesh_pool_healthy_connections", &[]) >= 1.0
    })
    .await;
    calls_in_flight_at_the_end_of_the_grace_period_are_answered(
        broker,
        "broker shutting down: the grace period ended",
    )
    .await;
}

/// The memory budget of the broker in the memory tests ([`testkit::budgeted_broker`]'s).
const BUDGET_MIB: usize = testkit::BROKER_BUDGET_MIB;
/// Connections that each send one header claiming the largest body.
const BIG_HEADERS: usize = 1000;

#[tokio::test]
async fn a_thousand_big_body_headers_cost_less_than_the_budget() {
    for engine in ENGINES {
        big_body_headers_on(engine).await;
    }
}

/// [`a_thousand_big_body_headers_cost_less_than_the_budget`] on `engine`.
async fn big_body_headers_on(engine: &str) {
    let budget = testkit::BROKER_BUDGET_MIB;
    let (_provider, broker) = testkit::budgeted_broker_with(budget, &["--engine", engine]).await;
    let (rss, vsz) = (broker.status_kib("VmRSS"), broker.status_kib("VmSize"));
    let held: Vec<TcpStream> = (0..BIG_HEADERS)
        .map(|i| {
            let mut s = TcpStream::connect(broker.rpc).unwrap();
            s.write_all(&testkit::large_claim(i as u64)).unwrap();
            s
        })
        .collect();
    testkit::wait_until("every header is read", || {
        broker.metric("rpcmesh_connections_open", &[("side", "inbound")]) >= BIG_HEADERS as f64
    })
    .await;
    // A call on a newer connection is answered once the older ones were served a read.
    assert!(broker.call_succeeds().await);
    let (rss_after, vsz_after) = (broker.status_kib("VmRSS"), broker.status_kib("VmSize"));
    let budget_kib = (BUDGET_MIB << 10) as u64;
    eprintln!(
        "{engine} engine, {BIG_HEADERS} big-body headers: RSS {rss} → {rss_after} KiB, address space {vsz} → {vsz_after} KiB"
    );
    assert!(
        rss_after.saturating_sub(rss) < budget_kib,
        "RSS {rss} → {rss_after} KiB"
    );
    assert!(
        vsz_after.saturating_sub(vsz) < budget_kib,
        "address space {vsz} → {vsz_after} KiB"
    );
    drop(held);
}

/// The size of each large call in the spent-budget test.
const LARGE_CALL: usize = 1 << 20;

/// Large calls held at a slow provider in the spent-budget test: more than the budget
/// holds (each counts its 1 MiB until its reply comes).
const HELD_LARGE: usize = 24;

/// One reference platform call (small) on a fresh connection; true when it succeeded.
async fn platform_succeeds(to: std::net::SocketAddr) -> bool {
    let Ok(c) = Client::connect(to, ClientConfig::default()).await else {
        return false;
    };
    let q = rpcmesh_wire::proto::platform::reference_query();
    matches!(
        c.call("PlatformService", "doQuery", &q).await,
        Ok(r) if r.status == Status::Success
    )
}

#[tokio::test]
async fn a_spent_budget_refuses_large_calls_overloaded_and_serves_small_ones() {
    // Large echo calls go to a provider that holds every call 20 s; small platform calls
    // to a fast one.
    let slow = Spawned::start("provider", &["--threads", "1", "--service-time", "20s"]);
    let fast = Spawned::start("provider", &["--threads", "1"]);
    let (to_slow, to_fast) = (
        format!("EchoService={}", slow.rpc),
        format!("PlatformService={}", fast.rpc),
    );
    for engine in ENGINES {
        spent_budget_on(engine, &to_slow, &to_fast).await;
    }
}

/// [`a_spent_budget_refuses_large_calls_overloaded_and_serves_small_ones`] on `engine`,
/// the large calls to `to_slow`, the small ones to `to_fast` (`--upstream` values).
async fn spent_budget_on(engine: &str, to_slow: &str, to_fast: &str) {
    let broker = Spawned::start(
        "broker",
        &[
            "--engine",
            engine,
            "--threads",
            "1",
            "--memory-budget",
            "16MiB",
            "--call-timeout",
            "30s",
            "--upstream",
            to_slow,
            "--upstream",
            to_fast,
        ],
    );
    testkit::wait_for("a platform call succeeds", || async {
        platform_succeeds(broker.rpc).await.then_some(())
    })
    .await;
    // Large calls one at a time, each on its own connection, until one is shed: each is
    // read whole (what the admitted ones hold stays under the mark past which the largest
    // holders stop reading) and is either admitted, held at the slow provider, or, once
    // the admitted ones hold half the budget, answered overloaded. Sent all at once
    // instead, their unfinished frames could pass that mark together and all wait, unread,
    // for the budget: backpressure, not shedding.
    let shed = || broker.metric("rpcmesh_shed_total", &[("cap", "memory")]);
    let held = || broker.metric("rpcmesh_calls_in_flight", &[]);
    let mut large = Vec::new();
    for _ in 0..HELD_LARGE {
        let (shed_before, held_before) = (shed(), held());
        let to = broker.rpc;
        large.push(tokio::spawn(async move {
            // Held calls wait longer than the test: no client-side timeout meanwhile.
            let config = ClientConfig {
                timeout: Duration::from_secs(120),
                ..ClientConfig::default()
            };
            let c = Client::connect(to, config).await.unwrap();
            let msg = rpcmesh_wire::proto::rpc::EchoRequest {
                message: "x".repeat(LARGE_CALL),
            };
            c.call("EchoService", "Echo", &msg).await
        }));
        testkit::wait_until("the large call admitted or shed", || {
            shed() > shed_before || held() > held_before
        })
        .await;
        if shed() > shed_before {
            break;
        }
    }
    testkit::wait_until("a large call is shed at the memory cap", || shed() >= 1.0).await;
    assert!(
        platform_succeeds(broker.rpc).await,
        "a small call is served while large ones are refused"
    );
    let sent = large.len();
    let mut refused = 0;
    for call in large {
        if !call.is_finished() {
            call.abort();
            continue;
        }
        let reply = call.await.unwrap().unwrap();
        assert_eq!(reply.status, Status::Overloaded, "{}", reply.error_msg);
        assert!(
            reply.error_msg.contains("memory budget"),
            "{}",
            reply.error_msg
        );
        refused += 1;
    }
    assert!(refused >= 1, "the shed calls were answered overloaded");
    eprintln!(
        "{engine} engine: {refused} of {sent} large calls answered overloaded; {:.1} MiB buffered",
        broker.metric("rpcmesh_buffered_bytes", &[]) / f64::from(1 << 20)
    );
}

/// Sockets in the heartbeat-only test.
const HEARTBEATERS: usize = 50;
/// Rounds of heartbeats sent at most (a hang detector: 100 ms apart, 40 idle timeouts).
const HEARTBEAT_ROUNDS: usize = 400;

/// Sockets that send nothing but a heartbeat, ten per idle period, are idle to the broker:
/// its idle timeout closes them all. Without it, each heartbeat reset the idle clock and
/// 9,998 such sockets held the connection cap for 3.7 KB/s.
#[test]
fn heartbeat_only_callers_are_closed_by_the_idle_timeout() {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    for engine in ENGINES {
        heartbeat_only_sockets_closed(engine, &upstream);
    }
}

/// [`heartbeat_only_callers_are_closed_by_the_idle_timeout`] on `engine`.
fn heartbeat_only_sockets_closed(engine: &str, upstream: &str) {
    let broker = broker_with(engine, upstream, &["--idle-timeout", "1s"]);
    let mut open: Vec<Option<TcpStream>> = (0..HEARTBEATERS)
        .map(|_| Some(TcpStream::connect(broker.rpc).unwrap()))
        .collect();
    let mut beat = bytes::BytesMut::new();
    rpcmesh_wire::body::Heartbeat::put_now(&mut beat, 1, "hostile", "0").unwrap();
    let closed = || broker.metric("rpcmesh_connections_closed_total", &inbound("idle_timeout"));
    let mut rounds = 0;
    while closed() < HEARTBEATERS as f64 && rounds < HEARTBEAT_ROUNDS {
        for slot in &mut open {
            if let Some(s) = slot {
                if s.write_all(&beat).is_err() {
                    *slot = None;
                }
            }
        }
        rounds += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "{engine} engine, {HEARTBEATERS} heartbeat-only sockets: {} closed idle after {rounds} rounds",
        closed()
    );
    assert_eq!(
        closed(),
        HEARTBEATERS as f64,
        "{engine}: every heartbeat-only socket was closed idle"
    );
}
