//! Forwarding a call allocates nothing in steady state: the real broker, between a real
//! provider and a real driver at 64 calls in flight over 8 connections, counted by its own
//! allocator (`rpcmesh_allocations_total`), for the echo workload on one thread and the
//! platform workload on two (two cells).
//!
//! The count is that of the broker's sessions and upstream connections
//! (`rpcmesh_forwarding_allocations_total`): what its scrapes, its pool keepers and its
//! `/proc` readings allocate is not counted, so two scrapes while the load runs, after a
//! warm-up and some calls later, bound the calls' own allocations.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rpcmesh_common::metrics::catalogue::{CALLS_TOTAL, FORWARDING_ALLOCATIONS_TOTAL};
use rpcmesh_testkit::{self as testkit, ChildGuard, Spawned, wait_until};

/// Calls before the first scrape: every connection, buffer and table has met the load.
const WARM_UP_CALLS: f64 = 10_000.0;
/// Calls counted.
const COUNTED_CALLS: f64 = 20_000.0;
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
    for at in [WARM_UP_CALLS, WARM_UP_CALLS + COUNTED_CALLS] {
        wait_until(&format!("{at} calls through the broker"), || {
            provider_calls(&provider) >= at
        })
        .await;
        points.push(broker_allocations(&broker));
    }
    let (a, b) = (points[0], points[1]);
    let per_call = (b.0 - a.0) / (b.1 - a.1);
    println!(
        "{workload}, {threads} thread(s): {} allocations over {} calls: {per_call:.5} per call",
        b.0 - a.0,
        b.1 - a.1
    );
    per_call
}

#[tokio::test]
async fn forwarding_an_echo_call_allocates_nothing_in_steady_state() {
    let per_call = allocations_per_call("echo", "1").await;
    assert!(per_call <= MAX_PER_CALL, "{per_call} allocations per call");
}

#[tokio::test]
async fn forwarding_a_platform_call_allocates_nothing_in_steady_state() {
    // On two cells (the 8 connections dealt 4 and 4): the one-cell path is the echo
    // test's.
    let per_call = allocations_per_call("platform", "2").await;
    assert!(per_call <= MAX_PER_CALL, "{per_call} allocations per call");
}
