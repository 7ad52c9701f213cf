//! The driver's deadlines, end to end on 127.0.0.1: a provider that works through its calls
//! one at a time (`--service-time 200ms --service-work`, one thread) is sent more calls at
//! once than it can finish within the driver's `--timeout`. The calls carry the time left
//! to them (the call extension's `deadline` field), and those whose time ran out while they
//! waited behind the others are never started: the provider's count of calls its handler
//! ran stays below the calls sent, and every call still has exactly one outcome. Without
//! the deadline the provider would run every one of them, for a caller long gone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_driver::config::ProgressMode;
use rpcmesh_driver::{DriverConfig, Report, Stop, WorkloadKind};
use rpcmesh_testkit::{Spawned, wait_until_blocking};

/// Calls sent at once: four times what the provider can finish within the timeout.
const CALLS: u64 = 8;
/// The provider's time per call, working (its one thread does nothing else meanwhile).
const SERVICE_TIME: &str = "200ms";
/// The driver's timeout: a call waiting behind two others has run out of time.
const TIMEOUT: Duration = Duration::from_millis(300);

fn slow_provider() -> Spawned {
    Spawned::start(
        "provider",
        &[
            "--threads",
            "1",
            "--service-time",
            SERVICE_TIME,
            "--service-work",
        ],
    )
}

async fn run(target: &Spawned) -> Report {
    let config = DriverConfig {
        targets: vec![target.rpc.to_string()],
        workload: WorkloadKind::Echo,
        stop: Stop::Requests(CALLS),
        warmup: Duration::ZERO,
        progress: ProgressMode::Off,
        concurrency: CALLS as usize,
        connections: 1,
        fanout: 1,
        call_timeout: TIMEOUT,
        ..DriverConfig::default()
    };
    rpcmesh_driver::run(config, CancellationToken::new())
        .await
        .unwrap()
}

const DROPPED: [(&str, &str); 2] = [("kind", "deadline_exceeded"), ("side", "client")];
const RAN: [(&str, &str); 2] = [("service", "EchoService"), ("status", "ok")];

/// Waits until every call sent has been either run or dropped by one of `programs` (the
/// provider answers the last ones after the driver has given up on them), and returns
/// (run, dropped).
fn settled(provider: &Spawned, programs: &[&Spawned], ran_before: f64) -> (f64, f64) {
    let count = || {
        let ran = provider.metric("rpcmesh_calls_total", &RAN) - ran_before;
        let dropped: f64 = programs
            .iter()
            .map(|p| p.metric("rpcmesh_errors_total", &DROPPED))
            .sum();
        (ran, dropped)
    };
    wait_until_blocking("every call to be run or dropped", || {
        let (ran, dropped) = count();
        ran + dropped >= CALLS as f64
    });
    count()
}

fn assert_one_outcome_each(r: &Report) {
    let failed: u64 = r.calls.errors.values().sum();
    assert_eq!(r.calls.sent, CALLS, "{r:#?}");
    assert_eq!(
        r.calls.sent,
        r.calls.ok + failed,
        "every call has exactly one outcome: {r:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_whose_deadline_passed_while_queued_at_the_provider_are_never_started() {
    let p = slow_provider();
    let r = run(&p).await;
    assert_one_outcome_each(&r);
    let (ran, dropped) = settled(&p, &[&p], 0.0);
    assert!(
        ran < CALLS as f64,
        "the provider ran {ran} of {CALLS} calls: the expired ones were started ({r:#?})"
    );
    assert_eq!(
        ran + dropped,
        CALLS as f64,
        "each call run or dropped, once"
    );
    assert!(r.calls.ok as f64 <= ran, "{r:#?}");
}

/// Through a broker with one connection to the provider: the broker forwards each call
/// with the time left to it (less its own), and the provider drops the ones that ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_broker_the_time_left_is_forwarded_and_expired_calls_never_started() {
    let p = slow_provider();
    let upstream = p.rpc.to_string();
    // Health checks that outlast the provider's busy spells, so that the connection the
    // calls wait on is never given up by the broker.
    let b = Spawned::start(
        "broker",
        &[
            "--threads",
            "1",
            "--pool-size",
            "1",
            "--health-timeout",
            "10s",
            "--upstream",
            &upstream,
        ],
    );
    b.wait_serving().await;
    let ran_before = p.metric("rpcmesh_calls_total", &RAN);
    let r = run(&b).await;
    assert_one_outcome_each(&r);
    let (ran, dropped) = settled(&p, &[&p, &b], ran_before);
    assert!(
        ran < CALLS as f64,
        "the provider ran {ran} of {CALLS} calls: the expired ones were started ({r:#?})"
    );
    assert_eq!(
        ran + dropped,
        CALLS as f64,
        "each call run or dropped, once"
    );
}
