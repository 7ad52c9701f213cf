//! The once-a-second progress line: requests/s, calls/s, that second's call p99, errors
//! and, in the open loop, the requests not sent.
//! A live line rewritten in place on a terminal, one plain line per second otherwise. It
//! goes to stderr, so that stdout carries only the report. Every line the driver prints
//! there (this one, `driver capacity`'s through [`say!`]) leaves in a single `write`.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpcmesh_common::net::shutdown::CancellationToken;

use crate::config::ProgressMode;
use crate::pacer::Schedule;
use crate::shared::RunShared;
use crate::stats::Tally;

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
    // Open loop with a schedule of several steps: a line when each ends.
    let schedule = shared
        .config
        .schedule
        .as_ref()
        .filter(|s| s.length().is_some());
    let mut step: Option<(usize, Tally, Instant)> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = done.cancelled() => break,
        }
        let now = Instant::now();
        second.clear();
        second.take_from(&shared.intervals);
        let secs = now.duration_since(last).as_secs_f64().max(1e-3);
        last = now;
        let m = &shared.metrics;
        m.offered_rate.set(second.sent as f64 / secs);
        m.achieved_rate.set(second.ok() as f64 / secs);
        // The middle of the second just past: which step and phase it was in.
        let mid = now.checked_sub(Duration::from_millis(500)).unwrap_or(now);
        if let Some(sched) = schedule {
            if let Some(since) = mid.checked_duration_since(shared.measure_from) {
                let i = sched.step_of(since);
                match &mut step {
                    Some((j, t, _)) if *j == i => t.add(&second),
                    _ => {
                        if let Some((j, t, from)) = step.take() {
                            if mode != ProgressMode::Off {
                                step_line(live, j, sched, &t, now.duration_since(from));
                            }
                        }
                        let mut t = Tally::interval();
                        t.add(&second);
                        step = Some((i, t, now));
                    }
                }
            }
        }
        if mode == ProgressMode::Off {
            continue;
        }
        let phase = if mid < shared.measure_from {
            "warm-up"
        } else if shared.until.is_some_and(|u| mid >= u) || shared.stop.is_cancelled() {
            "draining"
        } else {
            "measuring"
        };
        let mut line = format!(
            "[{:>4.0}s {:<9}] {:>9.0} req/s {:>10.0} calls/s   p99 {:>8.3} ms   errors {}",
            now.duration_since(started).as_secs_f64(),
            phase,
            (second.requests_ok + second.requests_failed) as f64 / secs,
            (second.ok() + second.failed()) as f64 / secs,
            second.calls.quantile_us(0.99) as f64 / 1000.0,
            second.failed()
        );
        if shared.config.schedule.is_some() {
            // Open loop: requests due that found every slot busy and the backlog full.
            let _ = write!(line, "   not sent {}", second.requests_not_sent);
        }
        if second.rerouted > 0 {
            // A target is draining: its refusals went elsewhere.
            let _ = write!(line, "   re-routed {}", second.rerouted);
        }
        if live {
            write_whole(&format!("{CLEAR_LINE}{line}"));
        } else {
            say!("{line}");
        }
        printed = true;
    }
    if let (Some(sched), Some((j, t, from))) = (schedule, step) {
        if mode != ProgressMode::Off {
            step_line(live, j, sched, &t, Instant::now().duration_since(from));
        }
    }
    if live && printed {
        write_whole("\n");
    }
}

/// The line of a step of the schedule that has ended (figures by completion, as the
/// per-second line's; the report gives them by intended start).
fn step_line(live: bool, i: usize, sched: &Schedule, t: &Tally, took: Duration) {
    let secs = took.as_secs_f64().max(1e-3);
    let line = format!(
        "step {} ({:.0} requests/s offered): {:.0} requests/s done, p99 {:.3} ms from the intended start, {} not sent, {} calls failed",
        i + 1,
        step_rate(sched, i),
        (t.requests_ok + t.requests_failed) as f64 / secs,
        t.requests.quantile_us(0.99) as f64 / 1000.0,
        t.requests_not_sent,
        t.failed()
    );
    say!("{}{line}", if live { CLEAR_LINE } else { "" });
}

/// The offered rate at the start of step `i`.
fn step_rate(sched: &Schedule, i: usize) -> f64 {
    let each = sched.step_length().unwrap_or_default();
    sched.rate_at(each * i as u32)
}

/// Back to the start of the terminal's line, and clear it (the live line is redrawn there).
const CLEAR_LINE: &str = "\r\x1b[2K";

/// `eprintln!`, but the line leaves in one `write` ([`write_line`]).
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::progress::write_line(format_args!($($arg)*))
    };
}
pub(crate) use say;

/// Writes one whole line to stderr ([`write_whole`]); use it through [`say!`].
pub(crate) fn write_line(line: std::fmt::Arguments<'_>) {
    write_whole(&format!("{line}\n"));
}

/// Writes `text` to stderr in a single `write`. The servers of `driver capacity`'s local
/// mesh share the driver's stderr, and text written piece by piece (as `eprintln!` writes
/// to the unbuffered stderr: one `write` per piece of the format) can be cut in two by one
/// of their log lines; a pipe keeps a single write of up to 4 KiB whole.
fn write_whole(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}
