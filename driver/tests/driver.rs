//! Black-box tests of the driver: the embedded default run, runs against real providers
//! and brokers on 127.0.0.1, counts that add up, failures counted by kind, and the CLI with
//! its JSON report.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::metrics::recorder::sample;
use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_driver::config::ProgressMode;
use rpcmesh_driver::pacer::{Pacing, Schedule};
use rpcmesh_driver::{DriverConfig, Report, Stop, WorkloadKind};
use rpcmesh_provider::service::{Held, ServiceTime, platform};
use rpcmesh_provider::{ProviderConfig, Registry};
use rpcmesh_testkit::{self as testkit, Gate, InProcess, wait_until};
use tokio::net::TcpListener;

async fn provider(config: ProviderConfig) -> InProcess<ServeSummary> {
    provider_with(config, Registry::builtin()).await
}

async fn provider_with(config: ProviderConfig, registry: Registry) -> InProcess<ServeSummary> {
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(config, registry, telemetry, listener, stop)
    })
    .await
}

/// A provider whose `PlatformService.doQuery` calls (the default workload's) wait at
/// `gate` before they answer: replies that come when the test says, never during a run
/// that must see none.
async fn held_provider(gate: &Arc<Gate>) -> InProcess<ServeSummary> {
    let mut registry = Registry::builtin();
    let held = Held {
        inner: platform::do_query,
        hold: gate.holder(),
    };
    registry.register(platform::SERVICE, platform::METHOD, held);
    provider_with(ProviderConfig::default(), registry).await
}

/// A run of a fixed number of requests, not of a duration: what it proves does not
/// depend on how fast the machine is.
const QUICK_REQUESTS: u64 = 200;

fn quick(targets: Vec<String>) -> DriverConfig {
    DriverConfig {
        targets,
        stop: Stop::Requests(QUICK_REQUESTS),
        warmup: Duration::ZERO,
        progress: ProgressMode::Off,
        concurrency: 20,
        connections: 4,
        ..DriverConfig::default()
    }
}

fn assert_counts_add_up(r: &Report) {
    let failed: u64 = r.calls.errors.values().sum();
    assert_eq!(
        r.calls.sent,
        r.calls.ok + failed,
        "every call has exactly one outcome: {r:#?}"
    );
    assert_eq!(r.requests.completed, r.requests.ok + r.requests.failed);
    // No warm-up: every call belongs to a measured request, and every request finishes.
    assert_eq!(
        r.calls.sent,
        r.requests.completed * u64::from(r.setup.fanout),
        "{r:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_run_starts_its_own_mesh_and_reports() {
    let c = quick(Vec::new());
    let r = rpcmesh_driver::run(c, CancellationToken::new())
        .await
        .unwrap();
    assert!(r.setup.embedded);
    assert_eq!(r.setup.workload, "platform");
    assert_eq!(r.setup.fanout, 5);
    assert!(r.calls.ok > 100, "{r:#?}");
    assert!(r.calls.errors.is_empty(), "{:?}", r.calls.errors);
    assert!(r.requests.latency.p50_ms > 0.0);
    assert!(r.requests.latency.p50_ms >= r.calls.latency.p50_ms);
    assert!(r.bytes.wire_out > 0 && r.bytes.wire_in > 0);
    assert_counts_add_up(&r);
    let text = r.render_text();
    assert!(
        text.contains("requests") && text.contains("p99.99"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_direct_to_a_provider_with_parallel_fan_out() {
    let p = provider(ProviderConfig::default()).await;
    let mut c = quick(vec![p.addr.to_string()]);
    c.workload = WorkloadKind::Echo;
    c.payload_size = 100;
    c.fanout = 3;
    c.parallel = true;
    let r = rpcmesh_driver::run(c, CancellationToken::new())
        .await
        .unwrap();
    assert!(r.calls.ok > 100);
    assert!(r.calls.errors.is_empty(), "{:?}", r.calls.errors);
    assert_counts_add_up(&r);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_run_makes_exactly_that_many_requests() {
    let p = provider(ProviderConfig::default()).await;
    let mut c = quick(vec![p.addr.to_string()]);
    c.stop = Stop::Requests(777);
    let r = rpcmesh_driver::run(c, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.requests.completed, 777);
    assert_eq!(r.calls.sent, 777 * 5);
    assert_counts_add_up(&r);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_sends_fewer_bytes_for_the_platform_workload() {
    let p = provider(ProviderConfig::default()).await;
    let run = |compress: bool| {
        let mut c = quick(vec![p.addr.to_string()]);
        c.stop = Stop::Requests(400);
        c.compression = compress.then(Default::default);
        rpcmesh_driver::run(c, CancellationToken::new())
    };
    let plain = run(false).await.unwrap();
    let zipped = run(true).await.unwrap();
    assert!(plain.calls.errors.is_empty() && zipped.calls.errors.is_empty());
    let per_call = |r: &Report| r.bytes.wire_per_call;
    println!(
        "wire bytes per call: plain {:.1}, compressed {:.1}",
        per_call(&plain),
        per_call(&zipped)
    );
    assert!(per_call(&zipped) < per_call(&plain));
    assert!(
        zipped.bytes.payload_in_wire < zipped.bytes.payload_in_plain,
        "replies arrive compressed"
    );
    p.stop().await;
}

/// The provider holds every call for the whole run: no reply can beat the driver's
/// timeout, so each call counts as no reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_replies_past_the_drivers_timeout_count_as_no_reply() {
    let gate = Gate::new();
    let p = held_provider(&gate).await;
    let mut c = quick(vec![p.addr.to_string()]);
    c.call_timeout = Duration::from_millis(150);
    c.fanout = 1;
    c.stop = Stop::Requests(20);
    let r = rpcmesh_driver::run(c, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.calls.ok, 0);
    assert_eq!(
        r.calls.errors.get("no_reply").copied().unwrap_or(0),
        20,
        "{:?}",
        r.calls.errors
    );
    assert_counts_add_up(&r);
    gate.open();
    p.stop().await;
}

/// A timeout the broker answered is the broker's reply, not the driver's own timeout: it is
/// counted `timeout` (the reply's status), and in the driver's errors on the server side.
/// The provider holds every call, so the broker's timeout is the only answer there can be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_the_broker_answers_is_told_apart_from_the_drivers_own() {
    let gate = Gate::new();
    let p = held_provider(&gate).await;
    let mut bc = rpcmesh_broker::BrokerConfig::with_upstreams([p.addr.to_string()]);
    bc.call_timeout = Duration::from_millis(100);
    let b = InProcess::start(|listener, telemetry, stop| {
        rpcmesh_broker::run_with(bc, telemetry, listener, stop)
    })
    .await;
    wait_until("the broker's pool to be up", || {
        b.metric("rpcmesh_pool_healthy_connections", &[]) > 0.0
    })
    .await;
    let mut c = quick(vec![b.addr.to_string()]);
    c.call_timeout = Duration::from_secs(10);
    c.fanout = 1;
    c.stop = Stop::Requests(20);
    let telemetry = Telemetry::new();
    let r = rpcmesh_driver::run_with(c, telemetry.clone(), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.calls.ok, 0);
    let timeouts = r.calls.errors.get("timeout").copied().unwrap_or(0);
    assert_eq!(timeouts, 20, "{:?}", r.calls.errors);
    assert_eq!(r.calls.errors.get("no_reply"), None, "{:?}", r.calls.errors);
    let text = telemetry.render();
    let seen = sample(
        &text,
        "rpcmesh_errors_total",
        &[("kind", "timeout"), ("side", "server")],
    );
    assert!(seen.is_some_and(|n| n >= timeouts as f64), "{text}");
    assert_counts_add_up(&r);
    gate.open();
    b.stop().await;
    p.stop().await;
}

/// The provider stops once the run is under way. The run is of more requests than it
/// could make before the test gives up, so that it can only end because the driver gave
/// up on the vanished provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_going_away_mid_run_is_counted_and_the_run_ends() {
    const BUDGET: u64 = 1_000_000;
    let p = provider(ProviderConfig::default()).await;
    let mut c = quick(vec![p.addr.to_string()]);
    c.stop = Stop::Requests(BUDGET);
    c.call_timeout = Duration::from_secs(1);
    let telemetry = Telemetry::new();
    let run = tokio::spawn(rpcmesh_driver::run_with(
        c,
        telemetry.clone(),
        CancellationToken::new(),
    ));
    wait_until("the run's first successful calls", || {
        sample(
            &telemetry.render(),
            "rpcmesh_calls_total",
            &[("status", "ok")],
        )
        .is_some_and(|n| n > 0.0)
    })
    .await;
    p.stop().await;
    let r = tokio::time::timeout(rpcmesh_testkit::WAIT_TIMEOUT, run)
        .await
        .expect("the run ends")
        .unwrap()
        .unwrap();
    assert!(
        r.requests.completed < BUDGET,
        "the run ended for the outage"
    );
    assert!(r.calls.ok > 0);
    let failed: u64 = r.calls.errors.values().sum();
    assert!(failed > 0 || r.calls.connect_failures > 0, "{r:#?}");
    // Every call sent has one outcome; requests cut short by the outage end failed,
    // without their unsent calls.
    assert_eq!(r.calls.sent, r.calls.ok + failed);
    assert!(r.calls.sent <= r.requests.completed * 5);
    assert!(r.requests.failed > 0);
}

/// Every call fails, and the report says why: by outcome and by the status text the
/// provider answered, in the JSON and in the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_reported_by_outcome_and_by_what_the_replies_said() {
    // A provider that hosts no service: every call is answered "service not found".
    let p = provider_with(ProviderConfig::default(), Registry::new()).await;
    let r = rpcmesh_driver::run(quick(vec![p.addr.to_string()]), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.calls.ok, 0, "{r:#?}");
    assert_counts_add_up(&r);
    let f = &r.calls.failures;
    assert_eq!(f.len(), 1, "{f:#?}");
    assert_eq!(f[0].outcome, "failed");
    assert_eq!(
        f[0].text.as_deref(),
        Some("service not found: PlatformService")
    );
    assert_eq!(f[0].count, r.calls.sent);
    let text = r.render_text();
    let line = format!(
        "failed {0}: service not found: PlatformService ×{0}",
        rpcmesh_common::format::thousands(r.calls.sent as f64)
    );
    assert!(text.contains(&line), "{line:?} not in\n{text}");
    // The headline counts successful requests: none; the failed ones have a row apart.
    let q = &r.requests;
    assert_eq!((q.ok_per_second, q.latency.count), (0.0, 0), "{q:#?}");
    assert_eq!(q.failed_latency.count, q.failed);
    assert!(q.failed_per_second > 0.0);
    let headline = text
        .lines()
        .find(|l| l.trim_start().starts_with("requests "))
        .unwrap();
    assert_eq!(
        headline.split_whitespace().nth(1),
        Some("0"),
        "no request succeeded: {headline}"
    );
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("failed ")),
        "{text}"
    );
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_runs_against_a_target_and_writes_json() {
    let p = provider(ProviderConfig::default()).await;
    let dir = std::env::temp_dir().join(format!("rpcmesh-driver-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_driver"))
        .args([
            "--target",
            &p.addr.to_string(),
            "--workload",
            "echo",
            "--fanout",
            "2",
            "--concurrency",
            "8",
            "--requests",
            "100",
            "--warmup",
            "0s",
            "--compress",
            "on",
            "--metrics-listen",
            "off",
            "--progress",
            "plain",
            "--json",
        ])
        .arg(&json)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("calls") && stdout.contains("p99"),
        "{stdout}"
    );
    let r: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r.setup.workload, "echo");
    assert!(r.setup.compression);
    assert!(r.calls.ok > 0);
    assert_counts_add_up(&r);
    let _ = std::fs::remove_dir_all(&dir);
    p.stop().await;
}

#[test]
fn every_program_answers_help() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_driver"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("--target"));
    for (name, must) in [("provider", "--listen"), ("broker", "--upstream")] {
        let out = std::process::Command::new(rpcmesh_testkit::bin_path(name))
            .arg("--help")
            .output()
            .unwrap();
        assert!(out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(must),
            "{name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_starts_requests_at_the_rate_whatever_the_replies() {
    let p = provider(ProviderConfig::default()).await;
    for pacing in [Pacing::Exact, Pacing::Lean] {
        let mut c = quick(vec![p.addr.to_string()]);
        c.schedule = Some(Schedule::Constant(2000.0));
        c.pacing = pacing;
        c.concurrency = 64;
        c.stop = Stop::Duration(Duration::from_secs(1));
        let r = rpcmesh_driver::run(c, CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(r.setup.rate, Some(2000.0));
        assert_eq!(r.setup.pacing, Some(pacing));
        // About 2000 requests due in the second (pacing and the window's edges allow some
        // slack), each started (at once or from the backlog) or counted not sent: the
        // schedule holds however fast the replies come back.
        let due = r.requests.due as f64;
        assert!(
            (1500.0..=2500.0).contains(&due),
            "{pacing}: {due} requests due: {r:#?}"
        );
        assert_eq!(r.requests.due, r.requests.completed + r.requests.not_sent);
        assert!(r.requests.completed > 0, "{r:#?}");
        assert!(r.requests.start_lag.is_some());
        assert_counts_add_up(&r);
    }
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_requests_wait_in_the_backlog_and_beyond_it_are_counted_not_sent() {
    // A slow provider, two slots and room for ten in the backlog: most requests due find
    // no free slot and no room to wait.
    let p = provider(ProviderConfig {
        service_time: ServiceTime::Fixed(Duration::from_millis(100)),
        ..ProviderConfig::default()
    })
    .await;
    let mut c = quick(vec![p.addr.to_string()]);
    c.schedule = Some(Schedule::Constant(200.0));
    c.concurrency = 2;
    c.connections = 2;
    c.backlog = 10;
    c.fanout = 1;
    c.stop = Stop::Duration(Duration::from_millis(800));
    let r = rpcmesh_driver::run(c, CancellationToken::new())
        .await
        .unwrap();
    let q = &r.requests;
    assert!(q.not_sent > 50, "{r:#?}");
    assert!(q.backlogged > 0, "{r:#?}");
    assert!(q.completed <= 40, "{r:#?}");
    assert_eq!(
        q.due,
        q.completed + q.not_sent,
        "every request due has an outcome"
    );
    // Those that waited are timed from their intended start: the wait shows.
    assert!(q.latency.max_ms >= 100.0, "{r:#?}");
    assert_counts_add_up(&r);
    p.stop().await;
}

/// Open loop against a target that never accepts: the requests due meanwhile wait in the
/// (bounded) backlog or are not sent, and every one of them has its outcome, although none
/// could be sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_requests_due_while_the_connection_is_down_are_counted_not_sent() {
    let mut c = quick(vec![format!("127.0.0.1:{}", testkit::free_port())]);
    c.schedule = Some(Schedule::Constant(1000.0));
    c.concurrency = 4;
    c.connections = 2;
    c.backlog = 20;
    c.stop = Stop::Duration(Duration::from_millis(500));
    let r = rpcmesh_driver::run(c, CancellationToken::new())
        .await
        .unwrap();
    let q = &r.requests;
    assert!(q.due > 100, "the schedule's requests are due: {r:#?}");
    assert_eq!(q.completed, 0, "{r:#?}");
    assert_eq!(
        q.due, q.not_sent,
        "every request due has an outcome: {r:#?}"
    );
    assert!(r.calls.connect_failures > 0, "{r:#?}");
    assert_counts_add_up(&r);
}

/// A server that accepts and closes at once (a broker at its connection cap does): the
/// driver backs off instead of reconnecting in a tight loop, and counts the failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_die_unanswered_are_retried_with_backoff() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    let server = tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            drop(s);
        }
    });
    let mut c = quick(vec![addr.to_string()]);
    c.connections = 4;
    c.stop = Stop::Duration(Duration::from_secs(1));
    let r = rpcmesh_driver::run(c, CancellationToken::new())
        .await
        .unwrap();
    let n = accepted.load(std::sync::atomic::Ordering::Relaxed);
    println!("{n} connections accepted in 1 s");
    assert!(n < 100, "{n} connections in a second: no backoff");
    assert!(r.calls.connect_failures > 0, "{r:#?}");
    assert_eq!(r.calls.ok, 0);
    server.abort();
}
