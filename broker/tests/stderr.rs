//! Logging never fails or blocks a program. With its stderr a pipe whose reader has gone
//! (`broker … 2>&1 | head` once `head` has exited, a journald restarted), or a full pipe
//! nobody reads, the provider and the broker serve the driver's load, count the log lines
//! they drop (`rpcmesh_log_lines_dropped_total`), and exit 0 on SIGTERM; the driver, its
//! stderr the same, runs its load and exits 0. All three are real processes, logging at
//! `debug` so that every connection writes lines.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::{AsFd, OwnedFd};
use std::process::Stdio;

use rpcmesh_common::log_sink::LOG_QUEUE_LINES;
use rpcmesh_common::metrics::catalogue::{CALLS_TOTAL, LOG_LINES_DROPPED_TOTAL};
use rpcmesh_testkit::{
    self as testkit, ChildGuard, Launch, Signal, Spawned, WAIT_TIMEOUT, closed_pipe, full_pipe,
    wait_for,
};

/// Requests the driver makes (5 echo calls each).
const REQUESTS: &str = "400";

/// A stderr that takes nothing: the write end the children get, and the read end the test
/// holds (and never reads) for a full pipe.
struct DeadStderr {
    write: OwnedFd,
    _read: Option<OwnedFd>,
}

fn closed() -> DeadStderr {
    DeadStderr {
        write: closed_pipe(),
        _read: None,
    }
}

fn full() -> DeadStderr {
    let (read, write) = full_pipe();
    DeadStderr {
        write,
        _read: Some(read),
    }
}

const DEBUG: &[(&str, &str)] = &[("RUST_LOG", "debug")];

fn start(name: &str, args: &[&str], stderr: &DeadStderr) -> Spawned {
    Spawned::start_with(
        name,
        args,
        Launch {
            env: DEBUG,
            stderr_fd: Some(stderr.write.as_fd()),
            ..Launch::default()
        },
    )
}

/// Opens and closes connections to `to` (each logs a line or two there) until it counts
/// log lines dropped: at once for a closed stderr, once its queue of [`LOG_QUEUE_LINES`]
/// is full for a full one.
async fn until_lines_dropped(to: &Spawned) -> f64 {
    let batch = LOG_QUEUE_LINES / 8;
    wait_for("log lines counted as dropped", || async {
        for _ in 0..batch {
            let c = tokio::net::TcpStream::connect(to.rpc).await.unwrap();
            drop(c);
        }
        let dropped = to.metric(LOG_LINES_DROPPED_TOTAL.name, &[]);
        (dropped > 0.0).then_some(dropped)
    })
    .await
}

/// The driver's load through `broker`, its stderr `stderr`: it must exit 0.
fn drive(broker: &Spawned, stderr: &DeadStderr) {
    let target = broker.rpc.to_string();
    let child = std::process::Command::new(testkit::bin_path("driver"))
        .args(["--target", &target, "--workload", "echo"])
        .args(["--concurrency", "8", "--requests", REQUESTS])
        .args(["--metrics-listen", "127.0.0.1:0", "--progress", "off"])
        .envs(DEBUG.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr.write.try_clone().unwrap()))
        .spawn()
        .unwrap();
    let mut driver = ChildGuard(Some(child));
    let status = driver
        .wait_timeout(WAIT_TIMEOUT)
        .expect("the driver ends its run");
    assert!(status.success(), "driver: {status}");
}

/// SIGTERM: it must exit 0 (the wait is a hang detector, beyond the grace period).
fn stops_cleanly(name: &str, mut p: Spawned) {
    p.child.signal(Signal::TERM);
    let status = p
        .child
        .wait_timeout(WAIT_TIMEOUT)
        .unwrap_or_else(|| panic!("{name} did not exit on SIGTERM"));
    assert!(status.success(), "{name}: {status}");
}

async fn serve_with(stderr: fn() -> DeadStderr) {
    let (for_provider, for_broker, for_driver) = (stderr(), stderr(), stderr());
    let provider = start("provider", &["--threads", "1"], &for_provider);
    let upstream = provider.rpc.to_string();
    let broker = start(
        "broker",
        &["--threads", "1", "--upstream", &upstream],
        &for_broker,
    );
    broker.wait_serving().await;
    drive(&broker, &for_driver);
    let ok = broker.metric(CALLS_TOTAL.name, &[("status", "ok")]);
    assert!(
        ok >= 5.0 * REQUESTS.parse::<f64>().unwrap(),
        "{ok} calls ok"
    );
    assert_eq!(
        broker.metric(CALLS_TOTAL.name, &[]),
        ok,
        "every call through the broker succeeded"
    );
    assert!(until_lines_dropped(&broker).await > 0.0);
    assert!(until_lines_dropped(&provider).await > 0.0);
    // Still serving after dropping lines.
    broker.wait_serving().await;
    stops_cleanly("broker", broker);
    stops_cleanly("provider", provider);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_stderr_closed_the_programs_serve_count_dropped_lines_and_stop_cleanly() {
    serve_with(closed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_stderr_full_the_programs_serve_count_dropped_lines_and_stop_cleanly() {
    serve_with(full).await;
}
