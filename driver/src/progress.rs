//! The once-a-second progress line: requests/s, calls/s, that second's call p99 and errors.
//! A live line rewritten in place on a terminal, one plain line per second otherwise. It
//! goes to stderr, so that stdout carries only the report.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpcmesh_common::net::shutdown::CancellationToken;

use crate::config::ProgressMode;
use crate::stats::Tally;
use crate::worker::RunShared;

/// Each second until `done`: updates the rate gauges and prints a line (unless progress
/// is off).
pub(crate) async fn show(shared: Arc<RunShared>, started: Instant, done: CancellationToken) {
    let mode = shared.config.progress;
    let live = mode == ProgressMode::Auto && std::io::stderr().is_terminal();
    let mut tick = tokio::time::interval_at(
        (started + Duration::from_secs(1)).into(),
        Duration::from_secs(1),
    );
    let mut last = started;
    let mut second = Tally::interval();
    let mut printed = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = done.cancelled() => break,
        }
        let now = Instant::now();
        second.clear();
        for m in &shared.intervals {
            let mut t = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            second.add(&t);
            t.clear();
        }
        let secs = now.duration_since(last).as_secs_f64().max(1e-3);
        last = now;
        let m = &shared.metrics;
        m.offered_rate.set(second.sent as f64 / secs);
        m.achieved_rate.set(second.ok() as f64 / secs);
        if mode == ProgressMode::Off {
            continue;
        }
        // The phase of the second just past (its middle).
        let mid = now.checked_sub(Duration::from_millis(500)).unwrap_or(now);
        let phase = if mid < shared.measure_from {
            "warm-up"
        } else if shared.until.is_some_and(|u| mid >= u) || shared.stop.is_cancelled() {
            "draining"
        } else {
            "measuring"
        };
        let line = format!(
            "[{:>4.0}s {:<9}] {:>9.0} req/s {:>10.0} calls/s   p99 {:>8.3} ms   errors {}",
            now.duration_since(started).as_secs_f64(),
            phase,
            (second.requests_ok + second.requests_failed) as f64 / secs,
            (second.ok() + second.failed()) as f64 / secs,
            second.calls.quantile_us(0.99) as f64 / 1000.0,
            second.failed()
        );
        let mut err = std::io::stderr().lock();
        if live {
            let _ = write!(err, "\r\x1b[2K{line}");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
        printed = true;
    }
    if live && printed {
        eprintln!();
    }
}
