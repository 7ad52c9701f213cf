//! The once-a-second progress line: requests/s, calls/s, that second's call p99, errors
//! and, in the open loop, the requests not sent.
//! A live line rewritten in place on a terminal, one plain line per second otherwise. It
//! goes to stderr, so that stdout carries only the report. Every line the driver prints
//! there (this one, `driver capacity`'s through [`say!`]) leaves in a single `write`.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpcmesh_common::log_sink;
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
    let mut steps = StepLines::default();
    let print = |live: bool, done: Option<StepDone>| {
        if let (Some(sched), Some(d)) = (schedule, done) {
            if mode != ProgressMode::Off {
                say!(
                    "{}{}",
                    if live { CLEAR_LINE } else { "" },
                    step_text(sched, &d)
                );
            }
        }
    };
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
            // The step of the second's middle: none in the warm-up, nor once the run's
            // requests stop (what comes then is the last replies, not a step's).
            let running = shared.until.is_none_or(|u| mid < u);
            let step = mid
                .checked_duration_since(shared.measure_from)
                .filter(|_| running)
                .map(|since| sched.step_of(since));
            print(live, steps.second(step, &second, secs));
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
        if second.retried() > 0 {
            // Calls that did not run (a target drained, shed or lost them) went again.
            let _ = write!(line, "   retried {}", second.retried());
        }
        if live {
            write_whole(&format!("{CLEAR_LINE}{line}"));
        } else {
            say!("{line}");
        }
        printed = true;
    }
    print(live, steps.finish());
    if live && printed {
        write_whole("\n");
    }
}

/// A step of the schedule whose seconds are over: its figures and how long they took.
#[derive(Debug)]
struct StepDone {
    /// Its index in the schedule.
    index: usize,
    /// The figures of its seconds.
    tally: Tally,
    /// The seconds they cover.
    secs: f64,
}

/// The steps' figures as the seconds come: each second goes to the step its middle falls
/// in, with its own length, so that a step's rate is its requests over its own seconds
/// (by completion, as the per-second line's; the report gives them by intended start).
#[derive(Debug, Default)]
struct StepLines {
    current: Option<StepDone>,
}

impl StepLines {
    /// A second of `secs` with figures `t`, in step `step` (`None`: no step, the warm-up
    /// or the last replies after the schedule); returns the step that it ended, if any.
    fn second(&mut self, step: Option<usize>, t: &Tally, secs: f64) -> Option<StepDone> {
        if let Some(c) = &mut self.current {
            if Some(c.index) == step {
                c.tally.add(t);
                c.secs += secs;
                return None;
            }
        }
        let done = self.current.take();
        self.current = step.map(|index| {
            let mut tally = Tally::interval();
            tally.add(t);
            StepDone { index, tally, secs }
        });
        done
    }

    /// The run is over: the step under way, if any.
    fn finish(&mut self) -> Option<StepDone> {
        self.current.take()
    }
}

/// The line of a step that has ended: the rate offered (a ramp's mean over the step) and
/// the step's own figures.
fn step_text(sched: &Schedule, d: &StepDone) -> String {
    let t = &d.tally;
    let secs = d.secs.max(1e-3);
    format!(
        "step {} ({:.0} requests/s offered): {:.0} requests/s done, p99 {:.3} ms from the intended start, {} not sent, {} calls failed",
        d.index + 1,
        step_rate(sched, d.index),
        (t.requests_ok + t.requests_failed) as f64 / secs,
        t.requests.quantile_us(0.99) as f64 / 1000.0,
        t.requests_not_sent,
        t.failed()
    )
}

/// The rate offered over step `i`: its mean (the rates at its start and end: along a ramp
/// the rate is linear within a step).
fn step_rate(sched: &Schedule, i: usize) -> f64 {
    let each = sched.step_length().unwrap_or_default();
    let start = each * i as u32;
    match sched {
        Schedule::Steps { .. } => sched.rate_at(start),
        _ => (sched.rate_at(start) + sched.rate_at(start + each)) / 2.0,
    }
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
///
/// Once the program's log sink runs (`startup::start` installs it), the text goes through
/// it, in order with the log lines: a progress line never waits on a stderr that takes
/// nothing, and one that cannot be written is dropped and counted with them. Before (a
/// library caller that has no sink), it is written directly.
fn write_whole(text: &str) {
    if log_sink::is_installed() {
        log_sink::submit(text.as_bytes());
    } else {
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn second(requests: u64) -> Tally {
        Tally {
            requests_ok: requests,
            ..Tally::interval()
        }
    }

    fn rate(line: &str) -> f64 {
        let done = line.split("offered): ").nth(1).unwrap();
        done.split(' ').next().unwrap().parse().unwrap()
    }

    #[test]
    fn a_steps_line_gives_its_own_rate_over_its_own_seconds() {
        let sched = Schedule::Steps {
            rates: vec![1000.0, 2000.0, 5000.0],
            each: Duration::from_secs(2),
        };
        let mut lines = StepLines::default();
        let mut done = Vec::new();
        // The warm-up, two seconds a step, the last replies after the schedule.
        for (step, n, secs) in [
            (None, 500, 1.0),
            (Some(0), 1000, 1.0),
            (Some(0), 1000, 1.0),
            (Some(1), 2000, 1.0),
            (Some(1), 2000, 1.0),
            (Some(2), 5000, 1.0),
            (Some(2), 4000, 0.8),
            (None, 3000, 1.0),
        ] {
            done.extend(lines.second(step, &second(n), secs));
        }
        done.extend(lines.finish());
        let text: Vec<String> = done.iter().map(|d| step_text(&sched, d)).collect();
        let rates: Vec<f64> = text.iter().map(|l| rate(l)).collect();
        assert_eq!(rates, [1000.0, 2000.0, 5000.0], "{text:#?}");
        assert!(
            text[2].starts_with("step 3 (5000 requests/s offered)"),
            "{}",
            text[2]
        );

        // A run that ends within a step: its line at the end, over the seconds it had.
        let mut lines = StepLines::default();
        assert!(lines.second(Some(0), &second(300), 0.3).is_none());
        let last = lines.finish().unwrap();
        assert_eq!(rate(&step_text(&sched, &last)), 1000.0);
    }

    #[test]
    fn a_ramps_step_offers_its_mean_rate() {
        let sched = Schedule::Ramp {
            from: 1000.0,
            to: 20_000.0,
            over: Duration::from_secs(60),
        };
        let d = StepDone {
            index: 59,
            tally: second(19_800),
            secs: 1.0,
        };
        let line = step_text(&sched, &d);
        assert!(
            line.starts_with("step 60 (19842 requests/s offered): 19800 requests/s done"),
            "{line}"
        );
    }
}
