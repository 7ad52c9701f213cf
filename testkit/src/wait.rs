//! Waiting on a condition instead of sleeping: a test waits for the fact it needs (a
//! metric, a connection refused, a listener up), looking again every [`WAIT_POLL`], and
//! fails naming what it waited for after [`WAIT_TIMEOUT`], a hang detector and never a
//! measurement.

use std::future::Future;
use std::time::Duration;

use tokio::net::TcpStream;

/// How long [`wait_until`] and [`wait_for`] wait before they fail the test: a hang
/// detector, not a measurement. Every condition waited on normally holds within
/// milliseconds; 30 s is far beyond what a loaded 2-core machine needs, and short enough
/// that a hung test fails on its own instead of stalling the run.
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(30);

/// How often [`wait_until`] and [`wait_for`] look again: often enough that waiting costs
/// the test nothing noticeable, rarely enough not to load the machine it waits on.
pub const WAIT_POLL: Duration = Duration::from_millis(10);

/// Waits until `condition` holds, looking every [`WAIT_POLL`]; fails the test, naming
/// `what`, if it still does not after [`WAIT_TIMEOUT`].
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    wait_for(what, || std::future::ready(condition().then_some(()))).await;
}

/// Runs `probe` until it yields a value, and returns it; looks every [`WAIT_POLL`] and
/// fails the test, naming `what`, after [`WAIT_TIMEOUT`]. For conditions that take I/O to
/// check (a call, a connection attempt).
pub async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    // Wall time on purpose: the deadline stops a hung test, whatever clock the test runs.
    let give_up = std::time::Instant::now() + WAIT_TIMEOUT;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            std::time::Instant::now() < give_up,
            "timed out after {WAIT_TIMEOUT:?} waiting for {what}"
        );
        tokio::time::sleep(WAIT_POLL).await;
    }
}

/// Looks every `every` until `f` holds, from a plain (non-async) test; false if it still
/// does not after `timeout`.
pub fn eventually(timeout: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    // Wall time on purpose: the deadline only stops a hung test.
    let end = std::time::Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// [`wait_until`] for a plain (non-async) test: looks every [`WAIT_POLL`] and fails the
/// test, naming `what`, after [`WAIT_TIMEOUT`].
pub fn wait_until_blocking(what: &str, f: impl FnMut() -> bool) {
    assert!(
        eventually(WAIT_TIMEOUT, WAIT_POLL, f),
        "timed out after {WAIT_TIMEOUT:?} waiting for {what}"
    );
}

/// Waits until nothing accepts connections on `addr` any more (a draining server has
/// closed its listener); fails the test after [`WAIT_TIMEOUT`].
pub async fn wait_refused(addr: std::net::SocketAddr) {
    let what = format!("{addr} to refuse new connections");
    wait_for(&what, || async {
        TcpStream::connect(addr).await.is_err().then_some(())
    })
    .await;
}

/// Waits until `addr` accepts connections (a server process has started); panics after
/// [`WAIT_TIMEOUT`].
pub async fn wait_listening(addr: std::net::SocketAddr) {
    let what = format!("{addr} to accept connections");
    wait_for(&what, || async {
        TcpStream::connect(addr).await.is_ok().then_some(())
    })
    .await;
}
