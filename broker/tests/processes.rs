//! Failure tests with the real programs as separate processes on 127.0.0.1, started by the
//! test and stopped by PID: a provider killed with calls in flight, and a broker drained by
//! SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rpcmesh_common::net::client::{Client, ClientConfig, ClientError};
use rpcmesh_common::testkit::{self, ChildGuard};
use rpcmesh_wire::Status;
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use support::*;
use tokio::net::TcpStream;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_killed_with_calls_in_flight_leaves_no_call_without_an_outcome() {
    let port = testkit::free_port();
    let bin = testkit::bin_path("provider");
    let listen = addr(port).to_string();
    let mut prov = ChildGuard::spawn(
        &bin,
        &[
            "--listen",
            &listen,
            "--metrics-listen",
            "off",
            "--service-time",
            "400ms",
            "--threads",
            "1",
        ],
    )
    .unwrap();
    assert!(
        testkit::wait_listening(addr(port), Duration::from_secs(10)).await,
        "provider did not start"
    );

    let mut cfg = broker_config(&[addr(port)]);
    cfg.call_timeout = Duration::from_secs(3);
    let b = broker(cfg).await;
    let c = Client::connect(
        b.addr,
        ClientConfig {
            timeout: Duration::from_secs(10),
            ..ClientConfig::default()
        },
    )
    .await
    .unwrap();
    until_ready(&c).await;

    // Keep a steady stream of calls in flight, kill the provider under them.
    const SENT: usize = 300;
    let started = Instant::now();
    let calls: Vec<_> = (0..SENT)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i as u64 * 4)).await;
                let t = Instant::now();
                let r = c
                    .call(
                        "EchoService",
                        "Echo",
                        &EchoRequest {
                            message: i.to_string(),
                        },
                    )
                    .await;
                (r, t.elapsed())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    prov.signal("KILL");
    assert!(
        prov.wait_timeout(Duration::from_secs(5)).is_some(),
        "provider exited"
    );

    let (mut ok, mut failed, mut timed_out) = (0, 0, 0);
    for h in calls {
        let (r, took) = h.await.unwrap();
        // every call is answered by the broker, within its timeout (plus slack)
        let r = match r {
            Ok(r) => r,
            Err(ClientError::Timeout(_)) => panic!("a call was never answered"),
            Err(e) => panic!("client error: {e}"),
        };
        assert!(
            took < Duration::from_secs(4),
            "answered within the call timeout, took {took:?}"
        );
        match r.status {
            Status::Success => ok += 1,
            Status::Timeout => timed_out += 1,
            _ => {
                assert!(!r.error_msg.is_empty());
                failed += 1;
            }
        }
    }
    println!(
        "sent {SENT}: ok {ok}, failed {failed}, timed out {timed_out} in {:?}",
        started.elapsed()
    );
    assert_eq!(ok + failed + timed_out, SENT);
    assert!(ok > 0, "calls before the kill succeeded");
    assert!(failed > 0, "calls in flight at the kill failed");
    // The broker's counts add up the same way.
    let total: f64 = [
        "ok",
        "failed",
        "timeout",
        "unavailable",
        "overloaded",
        "bad_request",
    ]
    .iter()
    .map(|s| b.calls(s))
    .sum();
    assert!(total >= SENT as f64);
    assert!(b.errors("unavailable") >= 1.0);
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_broker_process_and_it_exits_zero() {
    let p = provider(rpcmesh_provider::ProviderConfig {
        service_time: Duration::from_millis(700),
        ..Default::default()
    })
    .await;
    let port = testkit::free_port();
    let bin = env!("CARGO_BIN_EXE_broker");
    let listen = addr(port).to_string();
    let up = p.addr.to_string();
    let mut broker = ChildGuard::spawn(
        std::path::Path::new(bin),
        &[
            "--listen",
            &listen,
            "--upstream",
            &up,
            "--metrics-listen",
            "off",
            "--grace",
            "5s",
            "--threads",
            "1",
            "--health-interval",
            "100ms",
        ],
    )
    .unwrap();
    assert!(
        testkit::wait_listening(addr(port), Duration::from_secs(10)).await,
        "broker did not start"
    );
    let c = Client::connect(addr(port), ClientConfig::default())
        .await
        .unwrap();
    until_ready(&c).await;

    let calls = testkit::echo_calls(&c, 20);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    broker.signal("TERM");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        TcpStream::connect(addr(port)).await.is_err(),
        "new connections are refused while draining"
    );
    for (i, h) in calls.into_iter().enumerate() {
        let r = h.await.unwrap().expect("call in flight completes");
        assert_eq!(r.status, Status::Success);
        assert_eq!(r.decode::<EchoResponse>().unwrap().message, format!("m{i}"));
    }
    let status = tokio::task::spawn_blocking(move || broker.wait_timeout(Duration::from_secs(6)))
        .await
        .unwrap();
    let status = status.expect("broker exited within the grace period");
    assert!(status.success(), "exit status {status:?}");
    assert!(t.elapsed() < Duration::from_secs(5));
    p.stop().await;
}
