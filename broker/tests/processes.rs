//! Failure tests with the real programs as separate processes on 127.0.0.1, started by the
//! test and stopped by PID: a provider killed with calls in flight, and a broker drained by
//! SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rpcmesh_common::net::client::{Client, ClientConfig, ClientError};
use rpcmesh_testkit::{self as testkit, ChildGuard, Gate, wait_until};
use rpcmesh_wire::Status;
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use support::*;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Calls sent after the kill, on top of those in flight at it: they find no provider.
const SENT_AFTER_KILL: usize = 50;

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
    testkit::wait_listening(addr(port)).await;

    let mut cfg = broker_config(&[addr(port)]);
    cfg.call_timeout = Duration::from_secs(3);
    let b = broker(cfg).await;
    // The client waits far longer than the broker's call timeout: a client timeout means
    // the broker never answered.
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
    let ok_before = b.calls("ok");

    // Keep a steady stream of calls in flight until many have succeeded, kill the
    // provider under them, and send some more after the kill.
    let killed = Arc::new(AtomicBool::new(false));
    let stream = {
        let (c, killed) = (c.clone(), killed.clone());
        tokio::spawn(async move {
            let mut calls = Vec::new();
            let mut after_kill = 0;
            while after_kill < SENT_AFTER_KILL {
                if killed.load(Ordering::SeqCst) {
                    after_kill += 1;
                }
                let (c, message) = (c.clone(), calls.len().to_string());
                calls.push(tokio::spawn(async move {
                    c.call("EchoService", "Echo", &EchoRequest { message })
                        .await
                }));
                tokio::time::sleep(Duration::from_millis(4)).await;
            }
            calls
        })
    };
    wait_until(
        "50 calls through the provider to succeed, with more in flight",
        || b.calls("ok") >= ok_before + 50.0 && b.metric("rpcmesh_calls_in_flight", &[]) > 0.0,
    )
    .await;
    prov.signal(testkit::Signal::KILL);
    assert!(
        prov.wait_timeout(Duration::from_secs(5)).is_some(),
        "provider exited"
    );
    killed.store(true, Ordering::SeqCst);
    let calls = stream.await.unwrap();
    let sent = calls.len();

    let (mut ok, mut failed, mut timed_out) = (0, 0, 0);
    for h in calls {
        // every call is answered by the broker (within its call timeout: the client's is
        // longer)
        let r = match h.await.unwrap() {
            Ok(r) => r,
            Err(ClientError::Timeout(_)) => panic!("a call was never answered"),
            Err(e) => panic!("client error: {e}"),
        };
        match r.status {
            Status::Success => ok += 1,
            Status::Timeout => timed_out += 1,
            _ => {
                assert!(!r.error_msg.is_empty());
                failed += 1;
            }
        }
    }
    println!("sent {sent}: ok {ok}, failed {failed}, timed out {timed_out}");
    assert_eq!(ok + failed + timed_out, sent);
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
    assert!(total >= sent as f64);
    assert!(b.errors("unavailable") >= 1.0);
    b.stop().await;
}

/// SIGTERM with calls in flight (held at the provider): the broker refuses new
/// connections while it drains, its calls get their replies once the provider answers,
/// and it exits 0 as soon as they are done. The grace period is an hour, so that exiting
/// at all proves it exits because it has drained, not because the grace ran out; the call
/// timeout too, so that no held call times out however slow the machine is.
/// On both engines (`--engine`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_broker_process_and_it_exits_zero() {
    for engine in ENGINES {
        sigterm_drains(engine).await;
    }
}

async fn sigterm_drains(engine: Engine) {
    let gate = Gate::new();
    let p = held_provider(&gate).await;
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
            "1h",
            "--call-timeout",
            "1h",
            "--threads",
            "1",
            "--health-interval",
            "100ms",
            "--engine",
            &engine.to_string(),
        ],
    )
    .unwrap();
    testkit::wait_listening(addr(port)).await;
    let c = Client::connect(
        addr(port),
        ClientConfig {
            timeout: testkit::WAIT_TIMEOUT,
            ..ClientConfig::default()
        },
    )
    .await
    .unwrap();
    until_ready(&c).await;

    let calls: Vec<_> = (0..20).map(|i| held_call(&c, &format!("m{i}"))).collect();
    wait_until("all 20 calls to reach the provider", || {
        gate.arrived() == 20
    })
    .await;
    broker.signal(testkit::Signal::TERM);
    // "Refused while draining": the calls are still held at the provider.
    testkit::wait_refused(addr(port)).await;
    assert!(
        calls.iter().all(|h| !h.is_finished()),
        "the calls in flight are still waiting for the provider"
    );
    gate.open();
    for (i, h) in calls.into_iter().enumerate() {
        let r = h.await.unwrap().expect("call in flight completes");
        assert_eq!(r.status, Status::Success, "{engine}");
        assert_eq!(r.decode::<EchoResponse>().unwrap().message, format!("m{i}"));
    }
    let status = tokio::task::spawn_blocking(move || broker.wait_timeout(testkit::WAIT_TIMEOUT))
        .await
        .unwrap();
    let status = status.expect("broker exited once drained, long before its grace period");
    assert!(status.success(), "{engine}: exit status {status:?}");
    p.stop().await;
}
