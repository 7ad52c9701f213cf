//! The open loop under a stall: a real provider process is stopped (SIGSTOP) for a second
//! in the middle of an open-loop run and resumed (SIGCONT). The requests due meanwhile
//! must show in the latency measured from their intended start (no coordinated omission),
//! and every request due must have an outcome.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_driver::config::ProgressMode;
use rpcmesh_driver::{DriverConfig, Stop, WorkloadKind};
use rpcmesh_testkit::{self as testkit, ChildGuard};

/// How long the provider is stopped.
const STALL: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_shows_in_the_latency_from_the_intended_start_and_every_request_has_an_outcome() {
    let port = testkit::free_port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let provider = ChildGuard::spawn(
        &testkit::bin_path("provider"),
        &[
            "--listen",
            &addr.to_string(),
            "--metrics-listen",
            "off",
            "--threads",
            "1",
        ],
    )
    .unwrap();
    testkit::wait_listening(addr).await;

    let config = DriverConfig {
        targets: vec![addr.to_string()],
        workload: WorkloadKind::Echo,
        fanout: 1,
        schedule: Some(rpcmesh_driver::pacer::Schedule::Constant(1000.0)),
        concurrency: 50,
        connections: 2,
        stop: Stop::Duration(Duration::from_secs(3)),
        warmup: Duration::ZERO,
        progress: ProgressMode::Off,
        ..DriverConfig::default()
    };
    let telemetry = Telemetry::new();
    let run = tokio::spawn(rpcmesh_driver::run_with(
        config,
        telemetry.clone(),
        CancellationToken::new(),
    ));
    // Stall the provider once the run has calls answered (so the stall falls inside the
    // measured window), then resume it after STALL: the stall is the scenario, the sleep is
    // its length.
    testkit::wait_until("the run's first answered calls", || {
        let text = telemetry.render();
        rpcmesh_common::metrics::recorder::sample(
            &text,
            "rpcmesh_calls_total",
            &[("role", "driver"), ("status", "ok")],
        )
        .is_some_and(|n| n > 0.0)
    })
    .await;
    provider.signal(testkit::Signal::STOP);
    tokio::time::sleep(STALL).await;
    provider.signal(testkit::Signal::CONT);
    let r = run.await.unwrap().unwrap();

    let q = &r.requests;
    println!(
        "due {} completed {} not sent {} backlogged {}; p99 from the intended start {} ms, from the send {:?} ms",
        q.due,
        q.completed,
        q.not_sent,
        q.backlogged,
        q.latency.p99_ms,
        q.latency_uncorrected.map(|l| l.p99_ms)
    );
    assert_eq!(
        q.due,
        q.completed + q.not_sent,
        "every request due has an outcome"
    );
    assert!(
        q.backlogged > 0,
        "requests waited for a slot during the stall"
    );
    let half = STALL.as_secs_f64() * 1e3 / 2.0;
    assert!(
        q.latency.p99_ms >= half,
        "the stall shows in the p99 from the intended start: {} ms",
        q.latency.p99_ms
    );
    let uncorrected = q.latency_uncorrected.expect("the open loop reports both");
    assert!(
        uncorrected.p99_ms <= q.latency.p99_ms,
        "from the send it looks no worse: {} ms",
        uncorrected.p99_ms
    );
    let failed: u64 = r.calls.errors.values().sum();
    assert_eq!(
        r.calls.sent,
        r.calls.ok + failed,
        "every call has one outcome"
    );
}
