//! The broker in front of providers that fail or slow down while they answer their
//! heartbeats (docs/resilience.md), black-box on 127.0.0.1 with real processes: a black
//! hole is ejected, a slow provider gets almost no call under PeakEWMA, and retries of
//! calls a provider shed stay within the budget; each on both engines (`--engine`). Each
//! test runs the broker as it was before (ejection off, least loaded of two, no budget)
//! beside it, so that the cause is shown along with the cure; figures are printed, never
//! compared with the clock.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use rpcmesh_common::metrics::catalogue::{
    CALLS_REROUTED_TOTAL, CONFIG_RELOADS_TOTAL, POOL_HEALTHY_CONNECTIONS,
    RETRY_BUDGET_EXHAUSTED_TOTAL, UPSTREAM_CALLS_TOTAL, UPSTREAM_EJECTIONS_TOTAL,
    UPSTREAMS_EJECTED,
};
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::Spawned;
use rpcmesh_wire::Status;
use rpcmesh_wire::proto::rpc::EchoRequest;

/// Held by the tests whose load would disturb the latency estimate another test reads.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Makes `calls` echo calls through `addr`, `parallel` at a time; returns how many did not
/// succeed.
async fn failed_calls(addr: SocketAddr, calls: usize, parallel: usize) -> usize {
    let client = Arc::new(
        Client::connect(addr, ClientConfig::default())
            .await
            .unwrap(),
    );
    let each = calls / parallel;
    let tasks = (0..parallel).map(|_| {
        let c = client.clone();
        tokio::spawn(async move {
            let mut failed = 0;
            for _ in 0..each {
                let r = c
                    .call(
                        "EchoService",
                        "Echo",
                        &EchoRequest {
                            message: "x".into(),
                        },
                    )
                    .await;
                if !matches!(r, Ok(ref r) if r.status == Status::Success) {
                    failed += 1;
                }
            }
            failed
        })
    });
    let mut failed = 0;
    for t in futures_util::future::join_all(tasks).await {
        failed += t.unwrap();
    }
    failed
}

/// The broker's engines (`--engine`): each test runs on both.
const ENGINES: [&str; 2] = ["tokio", "loop"];

/// A broker on `engine` in front of `upstreams` (flag, address) with `extra` flags.
fn broker(engine: &str, upstreams: &[(&str, SocketAddr)], extra: &[&str]) -> Spawned {
    let mut args: Vec<String> = ["--engine", engine, "--health-interval", "100ms"]
        .map(String::from)
        .to_vec();
    for (flag, addr) in upstreams {
        args.push((*flag).into());
        args.push(addr.to_string());
    }
    args.extend(extra.iter().map(|s| (*s).to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Spawned::start("broker", &args)
}

/// Ejection off, as the broker was before it (with the least loaded of two, then the
/// default).
const NO_EJECTION: &[&str] = &[
    "--eject-consecutive-failures",
    "0",
    "--eject-success-rate",
    "0",
];

/// A plain v1 server that answers every heartbeat and fails every call at once, beside a
/// healthy rpcmesh provider: without ejection, the calls it gets fail (and, failing fast,
/// it gets many); with it, it is ejected after five failures in a row, and under 1 % of
/// the calls fail. It is one of two providers, so the cap (half of them) lets it go. On
/// both engines (the cause shown on the Tokio engine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_hole_beside_a_healthy_provider_is_ejected_and_under_one_percent_fail() {
    let _alone = ALONE.lock().await;
    let healthy = Spawned::start("provider", &[]);
    let hole = Spawned::start("provider", &["--classic", "--fail-calls"]);
    let ups = [("--upstream", healthy.rpc), ("--upstream-v1", hole.rpc)];
    const CALLS: usize = 4000;

    let mut old: Vec<&str> = NO_EJECTION.to_vec();
    old.extend(["--balance", "p2c"]);
    let before = broker("tokio", &ups, &old);
    let failed_before = failed_calls(before.rpc, CALLS, 4).await;
    drop(before);
    println!("black hole: {failed_before} of {CALLS} calls failed without ejection");
    assert!(
        failed_before * 5 > CALLS,
        "without ejection the black hole fails many calls: {failed_before}"
    );
    for engine in ENGINES {
        black_hole_ejected(engine, &healthy, &hole, CALLS).await;
    }
}

/// The black hole `hole` beside `healthy`, behind a broker on `engine` with ejection on:
/// ejected once, and under 1 % of `calls` fail.
async fn black_hole_ejected(engine: &str, healthy: &Spawned, hole: &Spawned, calls: usize) {
    let ups = [("--upstream", healthy.rpc), ("--upstream-v1", hole.rpc)];
    // The black hole, not yet measured, gets a probe call at once; failing fast, it then
    // looks fast, and takes calls until it is ejected.
    let b = broker(engine, &ups, &[]);
    let hole_label = hole.rpc.to_string();
    for p in [healthy.rpc.to_string(), hole_label.clone()] {
        rpcmesh_testkit::wait_until(&format!("{p} is healthy at the broker"), || {
            b.metric(POOL_HEALTHY_CONNECTIONS.name, &[("upstream", &p)]) > 0.0
        })
        .await;
    }
    let failed = failed_calls(b.rpc, calls, 4).await;
    let ejections = b.metric(
        UPSTREAM_EJECTIONS_TOTAL.name,
        &[
            ("upstream", &hole_label),
            ("reason", "consecutive_failures"),
        ],
    );
    let ejected = b.metric(UPSTREAMS_EJECTED.name, &[]);
    println!("black hole, {engine} engine: {failed} of {calls} calls failed with ejection");
    assert!(failed * 100 < calls, "{engine}: {failed} of {calls} failed");
    assert_eq!(ejections, 1.0, "{engine}: ejected once, for the whole run");
    assert_eq!(ejected, 1.0, "{engine}");
}

/// A provider 20 ms slow beside a healthy one, 4 calls in flight (a light load, as an open
/// loop at 5,000 calls/s is: the healthy one holds about one call): the least loaded of two
/// sends the slow one a call whenever it holds fewer than the other (and that call waits
/// 20 ms); PeakEWMA sends it few once its first reply showed it slow. (Under a
/// deep queue PeakEWMA does send it calls: once the healthy one's latency × its calls in
/// flight exceeds 20 ms, the slow one is the quicker way.) The shares
/// come from the broker's count of calls per provider (a few warm-up calls first, one at
/// a time, so that each provider has answered once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_provider_gets_almost_no_call_under_peak_ewma() {
    // Alone: the other tests' floods of calls would stall the healthy provider, and each
    // stall is a peak the estimate keeps for seconds.
    let _alone = ALONE.lock().await;
    let healthy = Spawned::start("provider", &[]);
    let slow = Spawned::start("provider", &["--service-time", "20ms"]);
    let ups = [("--upstream", healthy.rpc), ("--upstream", slow.rpc)];
    let slow_label = slow.rpc.to_string();
    const CALLS: usize = 4000;
    for engine in ENGINES {
        let mut shares = Vec::new();
        for balance in ["p2c", "peak-ewma"] {
            let b = broker(engine, &ups, &["--balance", balance]);
            assert_eq!(failed_calls(b.rpc, 20, 1).await, 0, "warm-up");
            let at_slow = || {
                b.metric(
                    UPSTREAM_CALLS_TOTAL.name,
                    &[("upstream", &slow_label), ("status", "ok")],
                )
            };
            let before = at_slow();
            assert_eq!(failed_calls(b.rpc, CALLS, 4).await, 0);
            let share = (at_slow() - before) / CALLS as f64;
            println!(
                "{engine} engine, {balance}: the slow provider took {:.2} % of the calls",
                share * 100.0
            );
            shares.push(share);
        }
        // Under 1 % on a quiet machine (docs/resilience.md has the figures); a machine busy
        // with other work stalls the healthy one now and then, and a stall is a peak the
        // estimate remembers for seconds: the test asks only for a clear difference.
        assert!(
            shares[1] * 2.0 < shares[0],
            "{engine}: PeakEWMA sends it far fewer than least loaded: {shares:?}"
        );
    }
}

/// A provider that sheds (one call in flight per connection, each held 20 ms) beside a
/// healthy one: the calls it answers "overloaded" are sent to the other, as long as the
/// budget lasts; with a budget of 10 retries (no share of the calls, one a second over
/// 10 s), exactly 10 are retried and the rest are counted as the budget's exhaustion.
/// Retries never exceed the budget: the counter stays under 20 % of the calls plus 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_of_shed_calls_go_to_another_provider_within_the_budget() {
    let _alone = ALONE.lock().await;
    let healthy = Spawned::start("provider", &[]);
    let shedding = Spawned::start(
        "provider",
        &["--service-time", "20ms", "--max-in-flight-per-conn", "1"],
    );
    let ups = [("--upstream", healthy.rpc), ("--upstream", shedding.rpc)];
    const CALLS: usize = 4000;
    // Least loaded of two, so that the shedding provider keeps getting calls.
    let retried = |b: &Spawned| b.metric(CALLS_REROUTED_TOTAL.name, &[("reason", "overloaded")]);
    let exhausted = |b: &Spawned| {
        b.metric(
            RETRY_BUDGET_EXHAUSTED_TOTAL.name,
            &[("reason", "overloaded")],
        )
    };

    for engine in ENGINES {
        let tight = broker(
            engine,
            &ups,
            &[
                "--balance",
                "p2c",
                "--retry-budget-percent",
                "0",
                "--retry-budget-min-per-second",
                "1",
            ],
        );
        let failed_tight = failed_calls(tight.rpc, CALLS, 32).await;
        let (r, e) = (retried(&tight), exhausted(&tight));
        println!(
            "{engine} engine, budget of 10: {r} retried, {e} not for want of budget, {failed_tight} failed"
        );
        assert_eq!(r, 10.0, "{engine}");
        assert!(e > 0.0 && failed_tight > 0, "{engine}");
        drop(tight);

        let b = broker(engine, &ups, &["--balance", "p2c"]);
        let failed = failed_calls(b.rpc, CALLS, 32).await;
        let (r, e) = (retried(&b), exhausted(&b));
        println!(
            "{engine} engine, default budget: {r} retried, {e} not for want of budget, {failed} failed"
        );
        assert!(r > 10.0, "{engine}: more shed calls were retried: {r}");
        assert!(
            r <= 0.2 * CALLS as f64 + 100.0,
            "{engine}: {r} retries for {CALLS} calls"
        );
        assert_eq!(
            e, failed as f64,
            "{engine}: each call not retried is a failure its caller sees"
        );
    }
}

/// Calls whose caller's deadline (the driver's `--timeout 100ms`) passes while two slow
/// providers (300 ms) run them: the broker answers each "timeout" at the caller's deadline,
/// and none of it counts against a provider, since the caller chose it: no ejection.
/// (Judged by the deadline instead of the broker's own call timeout, five such timeouts in
/// a row would eject one of the two.)
#[test]
fn timeouts_at_a_deadline_the_caller_set_shorter_eject_no_provider() {
    let slow: Vec<Spawned> = (0..2)
        .map(|_| Spawned::start("provider", &["--service-time", "300ms"]))
        .collect();
    for engine in ENGINES {
        let b = broker(
            engine,
            &[("--upstream", slow[0].rpc), ("--upstream", slow[1].rpc)],
            &[],
        );
        let out = std::process::Command::new(rpcmesh_testkit::bin_path("driver"))
            .args([
                "--target",
                &b.rpc.to_string(),
                "--workload",
                "echo",
                "--fanout",
                "1",
            ])
            .args([
                "--concurrency",
                "4",
                "--connections",
                "1",
                "--requests",
                "40",
            ])
            .args([
                "--timeout",
                "100ms",
                "--progress",
                "off",
                "--metrics-listen",
                "off",
            ])
            .output()
            .unwrap();
        let timeouts = b.metric("rpcmesh_calls_total", &[("status", "timeout")]);
        let ejections = b.metric(UPSTREAM_EJECTIONS_TOTAL.name, &[]);
        println!(
            "{engine} engine, caller's deadlines: {timeouts} calls timed out at the broker, {ejections} ejections"
        );
        assert!(
            timeouts >= 5.0,
            "{engine}: the broker answered timeouts: {timeouts}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            ejections, 0.0,
            "{engine}: no provider is blamed for its caller's deadline"
        );
    }
}

/// Two providers that both shed (one call in flight per connection, each held 20 ms):
/// the broker is overloaded, and nearly every call it forwards is answered "overloaded".
/// Each such call could be sent on to the other provider and back, up to three times; the
/// budget holds the retries to a fifth of the calls plus its floor (10 a second over 10 s),
/// and counts the ones it refuses. (Without the budget the retries are several times the
/// calls.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_overload_retries_never_exceed_the_budget() {
    let _alone = ALONE.lock().await;
    let shedding = || {
        Spawned::start(
            "provider",
            &["--service-time", "20ms", "--max-in-flight-per-conn", "1"],
        )
    };
    let (p, q) = (shedding(), shedding());
    const CALLS: usize = 2048;
    for engine in ENGINES {
        let b = broker(engine, &[("--upstream", p.rpc), ("--upstream", q.rpc)], &[]);
        let failed = failed_calls(b.rpc, CALLS, 32).await;
        let calls = b.metric("rpcmesh_calls_total", &[]);
        let retried = b.metric(CALLS_REROUTED_TOTAL.name, &[]);
        let refused = b.metric(RETRY_BUDGET_EXHAUSTED_TOTAL.name, &[]);
        println!(
            "{engine} engine, overload: {calls} calls, {failed} failed, {retried} retried, {refused} not for want of budget"
        );
        assert_eq!(calls, CALLS as f64, "{engine}");
        assert!(refused > 0.0, "{engine}: the budget was spent: {refused}");
        assert!(
            retried <= 0.2 * calls + 100.0,
            "{engine}: {retried} retries for {calls} calls: over 20 % plus the floor"
        );
    }
}

/// Two providers that hold each call 200 ms; one is killed (SIGKILL) while it holds calls:
/// they are lost in flight. Returns how many of `CALLS` calls failed, and how many the
/// broker (on `engine`) sent again as lost.
async fn kill_one_with_calls_in_flight(engine: &str, extra: &[&str]) -> (usize, f64) {
    let slow = || Spawned::start("provider", &["--service-time", "200ms"]);
    let (a, b) = (slow(), slow());
    let bk = broker(
        engine,
        &[("--upstream", a.rpc), ("--upstream", b.rpc)],
        extra,
    );
    for p in [a.rpc.to_string(), b.rpc.to_string()] {
        rpcmesh_testkit::wait_until(&format!("{p} is healthy at the broker"), || {
            bk.metric(POOL_HEALTHY_CONNECTIONS.name, &[("upstream", &p)]) > 0.0
        })
        .await;
    }
    const CALLS: usize = 64;
    let addr = bk.rpc;
    let calls = tokio::spawn(failed_calls(addr, CALLS, 16));
    rpcmesh_testkit::wait_until("the first provider holds calls", || {
        a.metric("rpcmesh_calls_in_flight", &[]) > 0.0
    })
    .await;
    a.child.signal(rpcmesh_testkit::Signal::KILL);
    let failed = calls.await.unwrap();
    let lost = bk.metric(CALLS_REROUTED_TOTAL.name, &[("reason", "lost")]);
    (failed, lost)
}

/// Calls lost in flight with a provider that was killed fail (they may have run), unless
/// the broker marks them idempotent: then they go to the other provider, and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_lost_in_flight_go_to_another_provider_only_when_marked_idempotent() {
    for engine in ENGINES {
        let (failed, lost) = kill_one_with_calls_in_flight(engine, &[]).await;
        println!("{engine} engine, not idempotent: {failed} calls failed, {lost} sent again");
        assert!(failed > 0 && lost == 0.0, "{engine}");
        let idempotent = ["--idempotent", "EchoService.*"];
        let (failed, lost) = kill_one_with_calls_in_flight(engine, &idempotent).await;
        println!("{engine} engine, idempotent: {failed} calls failed, {lost} sent again");
        assert!(
            lost > 0.0,
            "{engine}: the calls lost in flight were sent again"
        );
        assert_eq!(failed, 0, "{engine}: none failed");
    }
}

/// A provider added by the providers file beside a fast one that has been taking calls
/// gets calls at once: not yet measured, it is sent a probe call, whose reply measures it,
/// and then its share as calls overlap. (Scored at PeakEWMA's default latency, 30 ms, it
/// would get none until that had decayed below the fast one's latency × its calls in
/// flight, tens of seconds.) Proved by order: the calls made after it joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_added_beside_a_fast_one_takes_calls_at_once() {
    for engine in ENGINES {
        added_beside_a_fast_one(engine).await;
    }
}

/// [`a_provider_added_beside_a_fast_one_takes_calls_at_once`] on `engine`.
async fn added_beside_a_fast_one(engine: &str) {
    let (a, b) = (
        Spawned::start("provider", &[]),
        Spawned::start("provider", &[]),
    );
    let dir = std::env::temp_dir().join(format!("rpcmesh-probe-{}-{engine}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("providers");
    std::fs::write(&file, format!("{}\n", a.rpc)).unwrap();
    let bk = broker(engine, &[], &["--providers-file", file.to_str().unwrap()]);
    assert_eq!(
        failed_calls(bk.rpc, 50, 1).await,
        0,
        "{engine}: A alone, measured"
    );
    let tmp = dir.join("providers.tmp");
    std::fs::write(&tmp, format!("{}\n{}\n", a.rpc, b.rpc)).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    bk.child.signal(rpcmesh_testkit::Signal::HUP);
    let b_label = b.rpc.to_string();
    rpcmesh_testkit::wait_until("B joined and is healthy", || {
        bk.metric(CONFIG_RELOADS_TOTAL.name, &[("result", "ok")]) >= 1.0
            && bk.metric(POOL_HEALTHY_CONNECTIONS.name, &[("upstream", &b_label)]) > 0.0
    })
    .await;
    assert_eq!(failed_calls(bk.rpc, 200, 4).await, 0, "{engine}");
    let at_b = bk.metric(
        UPSTREAM_CALLS_TOTAL.name,
        &[("upstream", &b_label), ("status", "ok")],
    );
    println!(
        "{engine} engine: the provider that joined took {at_b} of the 200 calls made after, 4 at a time"
    );
    assert!(at_b > 0.0, "{engine}: B took calls");
    let _ = std::fs::remove_dir_all(&dir);
}
