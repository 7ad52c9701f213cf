//! Rolling restarts under load cost no call while another target is healthy: real broker
//! and provider processes, the driver with two targets, and one target at a time stopped
//! with SIGTERM (it drains: calls that arrive after the drain began are refused unstarted,
//! flagged `NOT_RUN`, and the driver sends them to the other target).
//!
//! Each run is of more requests than it can make ([`BUDGET`]); the test ends it (the stop
//! token) once every step of its scenario is done and calls went on after the last one.
//! What happens when is proved by order (each step waits for the run's successful calls to
//! grow, for a broker's pool to be healthy, for a process to exit), never by the clock.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::{finish, start};

use std::net::SocketAddr;
use std::time::Duration;

use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::metrics::recorder::sample;
use rpcmesh_driver::config::ProgressMode;
use rpcmesh_driver::pacer::{Pacing, Schedule};
use rpcmesh_driver::{DriverConfig, Report, Stop};
use rpcmesh_testkit::{self as testkit, Spawned, WAIT_TIMEOUT, wait_until};
use rpcmesh_wire::envelope::{CallCodec, put_not_run_response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Requests a run may make: more than it makes before the test stops it (a bound, not the
/// end).
const BUDGET: u64 = 1_000_000;
/// Successful calls the run makes after each step of a scenario before the next step:
/// enough that every worker has made calls on its new connections.
const CALLS_PER_STEP: f64 = 400.0;

fn driver(targets: &[SocketAddr]) -> DriverConfig {
    DriverConfig {
        targets: targets.iter().map(ToString::to_string).collect(),
        stop: Stop::Requests(BUDGET),
        warmup: Duration::ZERO,
        progress: ProgressMode::Off,
        concurrency: 8,
        connections: 4,
        ..DriverConfig::default()
    }
}

/// A one-thread provider process.
fn provider() -> Spawned {
    Spawned::start("provider", &["--threads", "1"])
}

/// A one-thread broker process over `provider`, on `listen` (a fixed address, to be
/// restarted on) or a port of its own.
fn broker(provider: &Spawned, listen: Option<SocketAddr>) -> Spawned {
    let upstream = provider.rpc.to_string();
    let args = ["--upstream", &upstream, "--threads", "1"];
    match listen {
        Some(addr) => Spawned::start_at("broker", addr, &args),
        None => Spawned::start("broker", &args),
    }
}

/// Waits until `broker` has a healthy connection to its provider (before that it would
/// answer "unavailable", which is no drain).
async fn healthy(broker: &Spawned) {
    wait_until("the broker's pool to be healthy", || {
        broker.metric("rpcmesh_pool_healthy_connections", &[]) > 0.0
    })
    .await;
}

/// The run's successful calls so far.
fn ok_calls(t: &Telemetry) -> f64 {
    sample(&t.render(), "rpcmesh_calls_total", &[("status", "ok")]).unwrap_or(0.0)
}

/// Waits until the run has made [`CALLS_PER_STEP`] more successful calls.
async fn more_calls(t: &Telemetry) {
    let from = ok_calls(t);
    wait_until("more successful calls", || {
        ok_calls(t) >= from + CALLS_PER_STEP
    })
    .await;
}

/// Sends SIGTERM to `p` and waits for it to exit (it drains first); it must exit cleanly.
async fn terminate(mut p: Spawned) {
    p.child.signal(testkit::Signal::TERM);
    let status = tokio::task::spawn_blocking(move || p.child.wait_timeout(WAIT_TIMEOUT))
        .await
        .unwrap()
        .expect("the drained process exits");
    assert!(status.success(), "{status:?}");
}

/// Calls served successfully by a broker or provider process.
fn served(p: &Spawned) -> f64 {
    p.metric("rpcmesh_calls_total", &[("status", "ok")])
}

/// No call failed and every call sent has one outcome. (Calls re-routed may be none: a
/// target that tells the driver of its drain is left before it refuses any.)
fn assert_nothing_lost(r: &Report) {
    assert!(r.calls.errors.is_empty(), "no call may fail: {r:#?}");
    assert_eq!(r.calls.sent, r.calls.ok, "{r:#?}");
    assert_eq!(r.requests.failed, 0, "{r:#?}");
    assert!(r.calls.ok > 0);
}

/// Prints what a run sent, re-routed and failed to connect (for the test's log).
fn print_counts(r: &Report) {
    println!(
        "{} calls, {} re-routed, {} failed connection attempts",
        r.calls.sent, r.calls.rerouted, r.calls.connect_failures
    );
}

/// Closed loop: every request started finished, each of its calls once.
fn assert_every_call_accounted(r: &Report) {
    let failed: u64 = r.calls.errors.values().sum();
    assert_eq!(r.calls.sent, r.calls.ok + failed, "{r:#?}");
    assert_eq!(r.requests.completed, r.requests.ok + r.requests.failed);
    assert_eq!(r.requests.due, r.requests.completed, "{r:#?}");
    assert_eq!(
        r.calls.sent,
        r.requests.completed * u64::from(r.setup.fanout),
        "{r:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_drained_mid_run_costs_no_call_its_calls_go_to_the_other() {
    let provider = provider();
    let a = broker(&provider, None);
    let b = broker(&provider, None);
    healthy(&a).await;
    healthy(&b).await;
    let (telemetry, stop, run) = start(driver(&[a.rpc, b.rpc]));
    more_calls(&telemetry).await;
    assert!(served(&a) > 0.0, "both brokers carry the load");
    let on_b = served(&b);
    terminate(a).await;
    more_calls(&telemetry).await;
    let r = finish(run, stop).await;
    assert_nothing_lost(&r);
    assert_every_call_accounted(&r);
    assert!(served(&b) > on_b);
    print_counts(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_both_brokers_costs_no_call() {
    let provider = provider();
    let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let (addr_a, addr_b) = (at(testkit::free_port()), at(testkit::free_port()));
    let a = broker(&provider, Some(addr_a));
    let b = broker(&provider, Some(addr_b));
    healthy(&a).await;
    healthy(&b).await;
    let (telemetry, stop, run) = start(driver(&[addr_a, addr_b]));
    more_calls(&telemetry).await;
    // A restarts: its calls go to B meanwhile.
    terminate(a).await;
    let a = broker(&provider, Some(addr_a));
    healthy(&a).await;
    // The workers that started on A go back to it: both carry calls again before B goes.
    back_on(&a).await;
    more_calls(&telemetry).await;
    // Then B: its calls go to the new A, and come back to the new B.
    terminate(b).await;
    let b = broker(&provider, Some(addr_b));
    healthy(&b).await;
    back_on(&b).await;
    more_calls(&telemetry).await;
    let r = finish(run, stop).await;
    assert_nothing_lost(&r);
    assert_every_call_accounted(&r);
    assert!(served(&a) > 0.0, "the restarted A took the calls B refused");
    assert!(
        r.calls.returned_home >= 2,
        "workers of both brokers went back: {r:#?}"
    );
    drop(b);
    print_counts(&r);
}

/// Waits until the restarted `broker` has served calls: workers that started on it came
/// back once it answered (without that, a worker stays where its fail-over took it).
async fn back_on(broker: &Spawned) {
    wait_until("workers back on their own broker", || served(broker) > 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_drained_under_a_direct_driver_costs_no_call() {
    let p1 = provider();
    let p2 = provider();
    let (telemetry, stop, run) = start(driver(&[p1.rpc, p2.rpc]));
    more_calls(&telemetry).await;
    assert!(served(&p1) > 0.0 && served(&p2) > 0.0);
    terminate(p1).await;
    more_calls(&telemetry).await;
    let r = finish(run, stop).await;
    assert_nothing_lost(&r);
    assert_every_call_accounted(&r);
}

/// The open loop through a drain: requests due while a worker moves to the other target
/// wait (timed from their intended start) and none is dropped or failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_requests_due_during_a_drain_wait_for_the_other_target_and_none_fails() {
    let p1 = provider();
    let p2 = provider();
    let mut c = driver(&[p1.rpc, p2.rpc]);
    c.schedule = Some(Schedule::Constant(500.0));
    // Sleeping, not spinning: the machine's cores are the mesh's too.
    c.pacing = Pacing::Lean;
    c.concurrency = 32;
    // A bound: the test stops the run long before.
    c.stop = Stop::Duration(WAIT_TIMEOUT);
    let (telemetry, stop, run) = start(c);
    more_calls(&telemetry).await;
    terminate(p1).await;
    more_calls(&telemetry).await;
    let r = finish(run, stop).await;
    assert_nothing_lost(&r);
    let q = &r.requests;
    assert_eq!(q.due, q.completed + q.not_sent, "{r:#?}");
    assert_eq!(q.not_sent, 0, "the backlog holds what waited: {r:#?}");
    assert_eq!(
        r.calls.sent,
        q.completed * u64::from(r.setup.fanout),
        "{r:#?}"
    );
}

/// The driver's side of a drain, seen from the refusing server (a test's own): a
/// connection that refused a call unstarted takes no new call, the refused one goes to the
/// other target, the call still on it is waited for, and then the driver closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_refused_a_call_takes_no_more_and_is_closed_once_its_calls_are_answered()
{
    let other = provider();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refusing = listener.local_addr().unwrap();
    // One connection, two users, one call each: both first calls come to the refusing
    // server together.
    let mut c = driver(&[refusing, other.rpc]);
    // A worker away from its own target dials it again after the home retry: here that is
    // beyond the run, so a new connection could only come from the refusal itself.
    c.home_retry = Duration::from_secs(3600);
    c.connections = 1;
    c.concurrency = 2;
    c.fanout = 1;
    // The test's server reads calls only: no question about call fields comes first.
    c.deadline = false;
    let (telemetry, stop, run) = start(c);
    let (mut s, _) = listener.accept().await.unwrap();
    let mut buf = bytes::BytesMut::new();
    let calls = testkit::read_frames(&mut s, &mut buf, 2).await.unwrap();
    let (held, refused) = (&calls[0], &calls[1]);
    let mut out = bytes::BytesMut::new();
    put_not_run_response(
        &mut out,
        refused.header.req_id,
        refused.header.flags,
        "shutting down",
    );
    s.write_all(&out).await.unwrap();
    // The refused call, then its user's next ones, are answered by the other target.
    more_calls(&telemetry).await;
    // Answer the held call: the driver has nothing more on this connection and closes it.
    out.clear();
    let answer = prost::Message::encode_to_vec(&rpcmesh_wire::proto::platform::reference_answer());
    CallCodec::new(None, 1 << 20)
        .put_ok_response(&mut out, held.header.req_id, held.header.flags, &answer)
        .unwrap();
    s.write_all(&out).await.unwrap();
    let eof = tokio::time::timeout(WAIT_TIMEOUT, async {
        loop {
            if s.read_buf(&mut buf).await.unwrap() == 0 {
                break;
            }
        }
    })
    .await;
    assert!(eof.is_ok(), "the driver closes the drained connection");
    assert!(
        buf.is_empty(),
        "no call was written on the connection after its refusal: {} bytes",
        buf.len()
    );
    let r = finish(run, stop).await;
    assert!(r.calls.errors.is_empty(), "{r:#?}");
    assert_eq!(r.calls.rerouted, 1, "{r:#?}");
    assert_eq!(r.calls.sent, r.calls.ok, "{r:#?}");
    // The worker never came back to the refusing server (its connection attempts would
    // be waiting in the listener's queue by now).
    let again = tokio::time::timeout(Duration::ZERO, listener.accept()).await;
    assert!(again.is_err(), "no new connection to the drained server");
}

/// The driver's side of a drain notice (`rpcmesh_wire::ext::DRAINING_KEY`), seen from a
/// test's own server: the driver asks for it, and once told, the connection takes no new
/// call (its users' next calls go to the other target), the call still on it is waited
/// for, and then the driver closes it: the server never has to close under a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_told_of_the_drain_takes_no_more_calls_and_is_closed_by_the_driver() {
    use rpcmesh_wire::body::Heartbeat;
    use rpcmesh_wire::ext;
    let other = provider();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let draining = listener.local_addr().unwrap();
    let mut c = driver(&[draining, other.rpc]);
    // As above: a new connection could only come from the notice itself.
    c.home_retry = Duration::from_secs(3600);
    c.connections = 1;
    c.concurrency = 2;
    c.fanout = 1;
    let (telemetry, stop, run) = start(c);
    let (mut s, _) = listener.accept().await.unwrap();
    let mut buf = bytes::BytesMut::new();
    let ask = testkit::read_frames(&mut s, &mut buf, 1).await.unwrap();
    let asked = Heartbeat::parse(&ask[0].body).unwrap();
    let asked = asked.extra_value(ext::HEARTBEAT_KEY).unwrap();
    assert!(ext::takes(asked, ext::DRAIN_NOTICE_FIELD), "{asked}");
    let mut out = bytes::BytesMut::new();
    let fields = [(ext::HEARTBEAT_KEY, ext::BROKER_FIELDS)];
    Heartbeat::put_now_with(&mut out, ask[0].header.req_id, "t", "t", &fields).unwrap();
    s.write_all(&out).await.unwrap();
    // Both users' first calls; one is held, and the notice follows.
    let calls = testkit::read_frames(&mut s, &mut buf, 2).await.unwrap();
    let answer = prost::Message::encode_to_vec(&rpcmesh_wire::proto::platform::reference_answer());
    let mut codec = CallCodec::new(None, 1 << 20);
    out.clear();
    codec
        .put_ok_response(
            &mut out,
            calls[1].header.req_id,
            calls[1].header.flags,
            &answer,
        )
        .unwrap();
    ext::put_drain_notice(&mut out, "t", "t");
    s.write_all(&out).await.unwrap();
    // The answered user's next calls are answered by the other target.
    more_calls(&telemetry).await;
    out.clear();
    codec
        .put_ok_response(
            &mut out,
            calls[0].header.req_id,
            calls[0].header.flags,
            &answer,
        )
        .unwrap();
    s.write_all(&out).await.unwrap();
    let eof = tokio::time::timeout(WAIT_TIMEOUT, async {
        while s.read_buf(&mut buf).await.unwrap() > 0 {}
    })
    .await;
    assert!(
        eof.is_ok(),
        "the driver closes the connection told of the drain"
    );
    assert!(
        buf.is_empty(),
        "no call was written on the connection after the notice: {} bytes",
        buf.len()
    );
    let r = finish(run, stop).await;
    assert!(r.calls.errors.is_empty(), "{r:#?}");
    assert_eq!(r.calls.sent, r.calls.ok, "{r:#?}");
    let again = tokio::time::timeout(Duration::ZERO, listener.accept()).await;
    assert!(again.is_err(), "no new connection to the drained server");
}
