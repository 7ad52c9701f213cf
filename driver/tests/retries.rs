//! The driver's retries (docs/resilience.md), black-box against real provider processes:
//! a call a target shed goes to the other target, within the retry budget; a call lost in
//! flight goes again only when the calls are marked idempotent. What happens when is
//! proved by order (a provider with calls in flight, then killed; the run's successful
//! calls growing after), never by the clock; the runs' figures are printed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::{finish, start};

use std::net::SocketAddr;
use std::time::Duration;

use rpcmesh_common::cli::flags::RetryBudgetArgs;
use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::metrics::catalogue::CALLS_IN_FLIGHT;
use rpcmesh_common::metrics::recorder::sample;
use rpcmesh_common::retry::Idempotent;
use rpcmesh_driver::config::{ProgressMode, WorkloadKind};
use rpcmesh_driver::{DriverConfig, Report, Stop};
use rpcmesh_testkit::{Signal, Spawned, WAIT_TIMEOUT, wait_until};

/// Echo calls, one per request, to `targets`, for `stop`.
fn driver(targets: &[SocketAddr], stop: Stop) -> DriverConfig {
    DriverConfig {
        targets: targets.iter().map(ToString::to_string).collect(),
        workload: WorkloadKind::Echo,
        fanout: 1,
        stop,
        warmup: Duration::ZERO,
        progress: ProgressMode::Off,
        ..DriverConfig::default()
    }
}

/// Every call sent has exactly one outcome.
fn assert_accounted(r: &Report) {
    let failed: u64 = r.calls.errors.values().sum();
    assert_eq!(r.calls.sent, r.calls.ok + failed, "{r:#?}");
    let retried: u64 = r.calls.retries.values().sum();
    assert_eq!(r.calls.rerouted, retried, "{r:#?}");
}

/// A provider that sheds (one call in flight per connection, each held 20 ms).
fn shedding() -> Spawned {
    Spawned::start(
        "provider",
        &[
            "--service-time",
            "20ms",
            "--max-in-flight-per-conn",
            "1",
            "--threads",
            "1",
        ],
    )
}

/// Two providers that shed, called directly by 32 workers of two users each: half the
/// calls are shed. A worker leaves a target that shed a call (at most once a second) and
/// sends the call to the other, as long as the budget lasts: with a budget of 10 retries
/// (no share of the calls, one a second over 10 s), exactly 10 are sent again and the
/// calls the budget refuses are counted. (Without the budget every worker's move would
/// retry: 32 workers, each once a second or so.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shed_calls_go_to_the_other_target_and_retries_stay_within_the_budget() {
    let (a, b) = (shedding(), shedding());
    let mut config = driver(&[a.rpc, b.rpc], Stop::Duration(Duration::from_secs(3)));
    config.concurrency = 64;
    config.connections = 32;
    config.retry = RetryBudgetArgs {
        retry_budget_percent: 0,
        retry_budget_min_per_second: 1,
    };
    let (_t, stop, run) = start(config);
    let r = tokio::time::timeout(WAIT_TIMEOUT, run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    drop(stop);
    let retried = r.calls.retries.get("overloaded").copied().unwrap_or(0);
    let refused = r
        .calls
        .retry_budget_exhausted
        .get("overloaded")
        .copied()
        .unwrap_or(0);
    let shed = r.calls.errors.get("overloaded").copied().unwrap_or(0);
    println!(
        "{} calls, {shed} shed, {retried} sent to the other target, {refused} not for want of budget",
        r.calls.sent
    );
    assert_accounted(&r);
    assert_eq!(retried, 10, "the budget's 10 retries, no more: {r:#?}");
    assert!(refused > 0, "the budget refused retries: {r:#?}");
}

/// The run's successful calls so far.
fn ok_calls(t: &Telemetry) -> f64 {
    sample(&t.render(), "rpcmesh_calls_total", &[("status", "ok")]).unwrap_or(0.0)
}

/// Two providers that hold each call 200 ms; the first is killed (SIGKILL) while it holds
/// calls: they are lost in flight. Returns the run's report.
async fn kill_one_with_calls_in_flight(idempotent: Idempotent) -> Report {
    let slow = || Spawned::start("provider", &["--service-time", "200ms", "--threads", "1"]);
    let (mut a, b) = (slow(), slow());
    let mut config = driver(&[a.rpc, b.rpc], Stop::Requests(1_000_000));
    config.concurrency = 8;
    config.connections = 2;
    config.idempotent = idempotent;
    let (t, stop, run) = start(config);
    wait_until("the first provider holds calls", || {
        a.metric(CALLS_IN_FLIGHT.name, &[]) > 0.0
    })
    .await;
    a.child.signal(Signal::KILL);
    let killed = tokio::task::spawn_blocking(move || a.child.wait_timeout(WAIT_TIMEOUT))
        .await
        .unwrap();
    assert!(killed.is_some(), "the provider is gone");
    let from = ok_calls(&t);
    wait_until("more successful calls on the other provider", || {
        ok_calls(&t) >= from + 40.0
    })
    .await;
    let r = finish(run, stop).await;
    drop(b);
    assert_accounted(&r);
    r
}

/// Calls lost in flight fail (`connection`: they may have run) unless the calls are
/// marked idempotent: then they are sent to the other provider, and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_lost_in_flight_go_again_only_when_marked_idempotent() {
    let plain = kill_one_with_calls_in_flight(Idempotent::default()).await;
    let lost = plain.calls.errors.get("connection").copied().unwrap_or(0);
    println!("not idempotent: {lost} calls lost in flight failed");
    assert!(lost > 0, "{plain:#?}");
    assert!(!plain.calls.retries.contains_key("lost"), "{plain:#?}");

    let marked = Idempotent::parse(&["EchoService.*"]).unwrap();
    let r = kill_one_with_calls_in_flight(marked).await;
    let again = r.calls.retries.get("lost").copied().unwrap_or(0);
    println!("idempotent: {again} calls lost in flight sent again");
    assert!(again > 0, "{r:#?}");
    assert!(r.calls.errors.is_empty(), "no call failed: {r:#?}");
}
