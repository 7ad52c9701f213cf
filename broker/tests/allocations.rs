//! Forwarding a call allocates nothing in steady state: the real broker, between a real
//! provider and a real driver at 64 calls in flight over 8 connections, counted by its own
//! allocator (`rpcmesh_allocations_total`), for the echo workload on one thread and the
//! platform workload on two (two cells).
//!
//! The count is that of the broker's sessions and upstream connections
//! (`rpcmesh_forwarding_allocations_total`): what its scrapes, its pool keepers and its
//! `/proc` readings allocate is not counted, so scrapes while the load runs, after a
//! warm-up and then every [`WINDOW_CALLS`] calls, bound the calls' own allocations.
//!
//! The best of [`WINDOWS`] windows is judged: an allocation per call, or per few hundred
//! calls, shows in every window alike, while a buffer that grows to a size first seen
//! (a burst of replies while the machine held the broker off its CPU) is a one-off that a
//! loaded machine may show in any window. The two workloads take turns, so that each has
//! the cores its three processes need.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rpcmesh_common::metrics::catalogue::{CALLS_TOTAL, FORWARDING_ALLOCATIONS_TOTAL};
use rpcmesh_testkit::{self as testkit, ChildGuard, Spawned, wait_until};

/// Calls before the first scrape: every connection, buffer and table has met the load.
const WARM_UP_CALLS: f64 = 10_000.0;
/// Calls in each window counted.
const WINDOW_CALLS: f64 = 10_000.0;
/// Windows counted, one after another.
const WINDOWS: usize = 3;
/// One workload at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// Allocations per call allowed: none, but for a few in all (a buffer or a table reaching
/// a size first seen after the warm-up, a block of the health checks' channel). One in 50
/// calls, what a read buffer pinned by calls in flight cost, is far above it, and so is a
/// histogram block per few hundred samples.
const MAX_PER_CALL: f64 = 0.001;

fn broker_allocations(broker: &Spawned) -> (f64, f64) {
    let text = broker.scrape();
    let get = |name: &str, labels: &[(&str, &str)]| {
        rpcmesh_common::metrics::recorder::sample(&text, name, labels)
            .unwrap_or_else(|| panic!("{name} missing from the broker's metrics"))
    };
    (
        get(FORWARDING_ALLOCATIONS_TOTAL.name, &[]),
        get(CALLS_TOTAL.name, &[("status", "ok")]),
    )
}

fn provider_calls(provider: &Spawned) -> f64 {
    provider.metric(CALLS_TOTAL.name, &[("status", "ok")])
}

/// Allocations per call of a broker of `threads` threads (cells) forwarding `workload`.
async fn allocations_per_call(workload: &str, threads: &str) -> f64 {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let broker = Spawned::start(
        "broker",
        &[
            "--threads",
            threads,
            "--upstream",
            &provider.rpc.to_string(),
        ],
    );
    let target = broker.rpc.to_string();
    let _driver = ChildGuard::spawn(
        &testkit::bin_path("driver"),
        &[
            "--target",
            &target,
            "--workload",
            workload,
            "--payload-size",
            "32",
            "--fanout",
            "1",
            "--concurrency",
            "64",
            "--connections",
            "8",
            "--duration",
            "120s",
            "--progress",
            "off",
            "--metrics-listen",
            "off",
            "--threads",
            "1",
        ],
    )
    .unwrap();
    let mut points = Vec::new();
    for k in 0..=WINDOWS {
        let at = WARM_UP_CALLS + k as f64 * WINDOW_CALLS;
        wait_until(&format!("{at} calls through the broker"), || {
            provider_calls(&provider) >= at
        })
        .await;
        points.push(broker_allocations(&broker));
    }
    let per_window: Vec<f64> = points
        .windows(2)
        .map(|w| (w[1].0 - w[0].0) / (w[1].1 - w[0].1))
        .collect();
    println!(
        "{workload}, {threads} thread(s): allocations per call in each window: {per_window:.5?}"
    );
    per_window.into_iter().fold(f64::INFINITY, f64::min)
}

#[tokio::test]
async fn forwarding_an_echo_call_allocates_nothing_in_steady_state() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let per_call = allocations_per_call("echo", "1").await;
    assert!(per_call <= MAX_PER_CALL, "{per_call} allocations per call");
}

#[tokio::test]
async fn forwarding_a_platform_call_allocates_nothing_in_steady_state() {
    let _turn = ONE_AT_A_TIME.lock().await;
    // On two cells (the 8 connections dealt 4 and 4): the one-cell path is the echo
    // test's.
    let per_call = allocations_per_call("platform", "2").await;
    assert!(per_call <= MAX_PER_CALL, "{per_call} allocations per call");
}
