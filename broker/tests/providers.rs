//! The broker and its providers, black-box on 127.0.0.1: balancing and fail-over between
//! two providers, two brokers in front of one, connections to a silent provider, a
//! provider down at the start, the start's wait for the providers' first connections, and
//! a draining broker, and a provider restarted on its port after the broker's connects
//! to it failed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use rpcmesh_common::metrics::catalogue::UPSTREAM_CONNECT_FAILURES_TOTAL;
use rpcmesh_common::metrics::recorder::sample;
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::{self as testkit, wait_until};
use rpcmesh_wire::Status;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::proto::rpc::EchoResponse;
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[tokio::test]
async fn two_providers_share_the_calls_and_one_stopping_sends_all_to_the_other() {
    let p1 = provider(ProviderConfig::default()).await;
    let p2 = provider(ProviderConfig::default()).await;
    // The least loaded of two: PeakEWMA sends calls made one at a time to the provider
    // that answered faster, until the other's estimate has decayed (docs/resilience.md).
    let mut cfg = broker_config(&[p1.addr, p2.addr]);
    cfg.balance = rpcmesh_broker::Balance::P2c;
    let b = broker(cfg).await;
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
/// The call is in the broker's listen backlog before the broker runs, and the broker's
/// pool has connected and asked for a heartbeat before the test lets the provider answer:
/// a broker that took calls before its pool was ready had the call all that time, and
/// answered it "unavailable".
#[tokio::test]
async fn a_call_made_as_the_broker_starts_waits_for_the_providers_first_connections() {
    let server = V1Server::start(true).await;
    server.hold_replies_until(1);
    let mut cfg = broker_config(&[server.addr]);
    // The broker waits at most one connect and one heartbeat timeout for its pools.
    cfg.health_timeout = Duration::from_secs(30);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut caller = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    caller
        .write_all(&testkit::echo_request(1, "first"))
        .await
        .unwrap();
    let b = broker_on(listener, cfg);
    wait_until(
        "the broker's pool to ask the provider for a heartbeat",
        || server.heartbeats() >= 1,
    )
    .await;
    let mut unread = [0; 1];
    let answered = caller.try_read(&mut unread);
    assert!(
        matches!(&answered, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "answered before the provider's first connection was ready: {answered:?}"
    );
    // The test's own request lets the server answer everything it holds.
    server.release().await;
    let mut buf = bytes::BytesMut::new();
    let f = testkit::read_frames(&mut caller, &mut buf, 1)
        .await
        .unwrap()
        .remove(0);
    let r = CallCodec::new(None, 1 << 20).decode_response(&f).unwrap();
    assert_eq!(r.status, Status::Success, "{}", r.rpc.error_msg);
    let echoed = <EchoResponse as prost::Message>::decode(r.rpc.payload).unwrap();
    assert_eq!(echoed.message, "first");
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

/// A provider stopped and started again on the same port, after the broker's connects to
/// it failed meanwhile: the broker takes it back within its reconnect back-off. bb8 tells
/// a waiting checkout nothing of a failed connect, so the keeper's round ends on one
/// instead of waiting out the checkout's timeout (`--connect-timeout` + `--health-timeout`,
/// a minute here: longer than the wait below, which fails without it).
#[tokio::test]
async fn a_provider_restarted_after_failed_connects_is_taken_back_at_once() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let p = provider_on(listener, ProviderConfig::default());
    let mut cfg = broker_config(&[addr]);
    cfg.connect_timeout = Duration::from_secs(60);
    let b = broker(cfg).await;
    let c = client(b.addr).await;
    until_ready(&c).await;

    p.stop().await;
    let failures = || b.metric(UPSTREAM_CONNECT_FAILURES_TOTAL.name, &[]);
    wait_until(
        "the broker's connects to the stopped provider to fail",
        || failures() >= 2.0,
    )
    .await;
    let r = c
        .call("EchoService", "Echo", &echo("to nobody"))
        .await
        .unwrap();
    assert_eq!(r.status, Status::Unavailable);

    let p = provider_on(
        tokio::net::TcpListener::bind(addr).await.unwrap(),
        ProviderConfig::default(),
    );
    until_ready(&c).await;
    b.stop().await;
    p.stop().await;
}
