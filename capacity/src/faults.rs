//! The fault lab's report (`scripts/faults`, made by `driver fault-report`): for each run
//! with a fault, its success rate and latency before, during and after the fault against
//! the same run with no fault (its control), the time the mesh took to route around the
//! fault (to *detect* it) and to be back to normal once it was repaired (to *recover*),
//! and the timelines they are read from. The data ([`FaultReport`], JSON), and the text
//! ([`FaultReport::render_markdown`]); the page with its charts is `html::faults`'.
//!
//! Pure: the runs' timelines and their phases' latency are given ([`RunData`], and a
//! function that merges a run's latency histograms over a window); the driver reads them
//! from its reports and interval logs.
//!
//! **Healthy, detected, recovered.** An interval of a timeline is *unhealthy* when more of
//! its requests failed than in the control's worst interval by over
//! [`UNHEALTHY_FAILED_POINTS`] percentage points, or its p99 is over [`UNHEALTHY_P99_FACTOR`]
//! times the control's worst interval's: worse than anything the same mesh did with nothing
//! wrong, by a margin. The time to detect is from the fault to the end of the last
//! unhealthy interval while it lasts: from then on, callers see a mesh as healthy as the
//! control, so the mesh has routed around the fault (0 when no interval was unhealthy: the
//! fault never showed; none when the last interval before the repair is still unhealthy:
//! the mesh did not route around it). The time to recover is the same from the repair to
//! the run's end. An interval (of the timeline, or of the latency histograms) is *before*
//! when it ends by the fault, *after* when it starts at the repair or later, and *during*
//! otherwise: one the fault began or ended in counts with the fault. Requests are in the
//! interval they were meant to start in (the driver's steps).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use rpcmesh_common::format::{fixed, ms};

/// How many percentage points more failed requests than the control's worst interval make
/// an interval unhealthy: one request in a hundred is what a caller notices, and below it
/// a handful of calls lost at the moment of a fault (a connection's worth) would count.
pub const UNHEALTHY_FAILED_POINTS: f64 = 1.0;
/// How many times the control's worst interval's p99 make an interval unhealthy: the
/// control's own intervals vary by tens of per cent on a shared machine (a scheduling
/// stall), and twice its worst is a tail no healthy run of the mesh had.
pub const UNHEALTHY_P99_FACTOR: f64 = 2.0;

/// One interval of a run's timeline: the requests meant to start in it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    /// When it starts, seconds into the measured window.
    pub start_s: f64,
    /// How long it lasts, seconds.
    pub seconds: f64,
    /// Requests due in it.
    pub due: u64,
    /// Of which succeeded.
    pub ok: u64,
    /// p99 of the successful ones, ms, from the intended start (none: no success).
    pub p99_ms: Option<f64>,
}

impl Interval {
    /// The share of its requests that failed (none when none was due).
    fn failed_share(&self) -> Option<f64> {
        (self.due > 0).then(|| 1.0 - self.ok as f64 / self.due as f64)
    }
}

/// What is known of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunData {
    /// Its name (`control-1-broker`, `black-hole`, ...).
    pub name: String,
    /// What its fault did (none: a control).
    pub fault: Option<String>,
    /// The control it is compared with.
    pub control: Option<String>,
    /// When the fault began and when it was repaired, seconds into the measured window.
    pub window: Option<(f64, f64)>,
    /// Its timeline.
    pub timeline: Vec<Interval>,
    /// Provider 1's share of the broker's calls, per phase, when known.
    pub shares: Option<Shares>,
    /// Times the broker ejected provider 1, when known.
    pub ejections: Option<f64>,
}

/// Provider 1's share of the broker's calls in each phase.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Shares {
    /// Before the fault.
    pub before: Option<f64>,
    /// While it lasted.
    pub during: Option<f64>,
    /// After the repair.
    pub after: Option<f64>,
}

/// Percentiles of a window's successful requests, ms: (p50, p99, how many).
pub type WindowLatency = (f64, f64, u64);

/// The phases of a run with a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// Before the fault.
    Before,
    /// While it lasted.
    During,
    /// After the repair.
    After,
}

impl Which {
    /// The phase of the interval from `start` to `end` (seconds) in a run whose fault
    /// lasted from `window.0` to `window.1`: before when it ends by the fault, after when
    /// it starts at the repair or later, during otherwise.
    pub fn of(start: f64, end: f64, window: (f64, f64)) -> Which {
        if end <= window.0 {
            Which::Before
        } else if start >= window.1 {
            Which::After
        } else {
            Which::During
        }
    }
}

/// One phase of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    /// Requests due in it.
    pub requests: u64,
    /// Of which succeeded.
    pub ok: u64,
    /// `ok / requests` (none when no request was due).
    pub success_rate: Option<f64>,
    /// Median latency of its successful requests, ms, from the intended start.
    pub p50_ms: Option<f64>,
    /// Their p99, ms.
    pub p99_ms: Option<f64>,
}

/// A run's three phases.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    /// Before the fault.
    pub before: Phase,
    /// While it lasted.
    pub during: Phase,
    /// After the repair.
    pub after: Phase,
}

/// One interval as the report shows it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// When it starts, seconds into the measured window.
    pub t_s: f64,
    /// The share of its requests that succeeded.
    pub success_rate: Option<f64>,
    /// p99 of its successful requests, ms.
    pub p99_ms: Option<f64>,
    /// Whether it was healthy (see the module doc).
    pub healthy: bool,
}

/// One experiment: a run with a fault, against its control.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Experiment {
    /// Its name.
    pub name: String,
    /// What the fault did.
    pub fault: String,
    /// The control's name.
    pub control: String,
    /// When the fault began, seconds into the measured window.
    pub fault_start_s: f64,
    /// When it was repaired.
    pub fault_end_s: f64,
    /// The run's phases.
    pub phases: Phases,
    /// The control's, over the same windows.
    pub control_phases: Phases,
    /// From the fault to the end of the last unhealthy interval while it lasted, seconds:
    /// 0 when it never showed; none when the mesh did not route around it.
    pub detect_s: Option<f64>,
    /// From the repair to the end of the last unhealthy interval after it, seconds: 0
    /// when none was; none when the run ended unhealthy.
    pub recover_s: Option<f64>,
    /// Unhealthy intervals while the fault lasted.
    pub unhealthy_during: usize,
    /// Provider 1's share of the broker's calls, per phase, when known.
    pub share_of_faulty: Option<Shares>,
    /// Times the broker ejected provider 1, when known.
    pub ejections: Option<f64>,
    /// The run's timeline.
    pub timeline: Vec<Point>,
    /// The control's.
    pub control_timeline: Vec<Point>,
}

/// What made an interval unhealthy: the control's worst, and the bounds it gives.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Bounds {
    /// The largest share of failed requests an interval may have.
    pub max_failed_share: f64,
    /// The largest p99 an interval may have, ms.
    pub max_p99_ms: f64,
}

/// The fault lab's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultReport {
    /// How the lab was set up, as the script said.
    pub setup: serde_json::Value,
    /// [`UNHEALTHY_FAILED_POINTS`] and [`UNHEALTHY_P99_FACTOR`].
    pub unhealthy_failed_points: f64,
    /// See [`UNHEALTHY_P99_FACTOR`].
    pub unhealthy_p99_factor: f64,
    /// Each run with a fault, in the order run.
    pub experiments: Vec<Experiment>,
}

/// Why a report could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultReportError {
    /// A run names a control that is not among the runs.
    #[error("run {run}: its control {control} is not among the runs")]
    NoControl {
        /// The run.
        run: String,
        /// The control it names.
        control: String,
    },
    /// A run with a fault has no fault window.
    #[error("run {0}: a fault but no fault window")]
    NoWindow(String),
}

/// The bounds a run is held to: its control's worst interval, with the margins.
pub fn bounds(control: &[Interval]) -> Bounds {
    let worst_failed = control
        .iter()
        .filter_map(Interval::failed_share)
        .fold(0.0, f64::max);
    let worst_p99 = control
        .iter()
        .filter_map(|i| i.p99_ms)
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    Bounds {
        max_failed_share: worst_failed + UNHEALTHY_FAILED_POINTS / 100.0,
        max_p99_ms: worst_p99 * UNHEALTHY_P99_FACTOR,
    }
}

/// Whether `i` is healthy within `b`.
fn healthy(i: &Interval, b: &Bounds) -> bool {
    // Within rounding of the bound is within it.
    const EPSILON: f64 = 1e-9;
    let failed_ok = i
        .failed_share()
        .is_none_or(|f| f <= b.max_failed_share + EPSILON);
    let p99_ok = i.p99_ms.is_none_or(|p| p <= b.max_p99_ms + EPSILON);
    failed_ok && p99_ok
}

/// The intervals of `timeline` in phase `which` of a run whose fault lasted `window`.
fn in_phase(
    timeline: &[Interval],
    window: (f64, f64),
    which: Which,
) -> impl Iterator<Item = &Interval> {
    timeline
        .iter()
        .filter(move |i| Which::of(i.start_s, i.start_s + i.seconds, window) == which)
}

/// From `from` to the end of the last unhealthy interval of phase `which` (During: the
/// time to detect, from the fault; After: the time to recover, from the repair): 0 when
/// none is; none when the last of them is.
pub fn settle_time(
    timeline: &[Interval],
    b: &Bounds,
    window: (f64, f64),
    which: Which,
) -> Option<f64> {
    let from = match which {
        Which::After => window.1,
        Which::Before | Which::During => window.0,
    };
    let phase: Vec<&Interval> = in_phase(timeline, window, which).collect();
    match phase.iter().rposition(|i| !healthy(i, b)) {
        None => Some(0.0),
        Some(k) if k + 1 == phase.len() => None,
        Some(k) => Some((phase[k].start_s + phase[k].seconds - from).max(0.0)),
    }
}

/// Phase `which` of `timeline` (a run whose fault lasted `window`), its latency from
/// `latency`.
fn phase(
    timeline: &[Interval],
    window: (f64, f64),
    which: Which,
    latency: Option<WindowLatency>,
) -> Phase {
    let (mut requests, mut ok) = (0, 0);
    for i in in_phase(timeline, window, which) {
        requests += i.due;
        ok += i.ok;
    }
    let (p50_ms, p99_ms) = match latency {
        Some((p50, p99, n)) if n > 0 => (Some(p50), Some(p99)),
        _ => (None, None),
    };
    Phase {
        requests,
        ok,
        success_rate: (requests > 0).then(|| ok as f64 / requests as f64),
        p50_ms,
        p99_ms,
    }
}

/// The phases of `run` with the fault window `window`; `latency(run, window, which)`
/// merges the run's latency over a phase.
fn phases(
    run: &RunData,
    window: (f64, f64),
    latency: &impl Fn(&str, (f64, f64), Which) -> Option<WindowLatency>,
) -> Phases {
    let of = |which| {
        phase(
            &run.timeline,
            window,
            which,
            latency(&run.name, window, which),
        )
    };
    Phases {
        before: of(Which::Before),
        during: of(Which::During),
        after: of(Which::After),
    }
}

fn points(timeline: &[Interval], b: &Bounds) -> Vec<Point> {
    timeline
        .iter()
        .map(|i| Point {
            t_s: i.start_s,
            success_rate: i.failed_share().map(|f| 1.0 - f),
            p99_ms: i.p99_ms,
            healthy: healthy(i, b),
        })
        .collect()
}

/// The report of `runs` (controls and runs with a fault), set up as `setup` says;
/// `latency(run, window, which)` gives a run's latency over one phase of a fault window
/// (in seconds of its measured time), by [`Which::of`].
pub fn build(
    setup: serde_json::Value,
    runs: &[RunData],
    latency: impl Fn(&str, (f64, f64), Which) -> Option<WindowLatency>,
) -> Result<FaultReport, FaultReportError> {
    let mut experiments = Vec::new();
    for run in runs.iter().filter(|r| r.fault.is_some()) {
        let name = run.control.clone().unwrap_or_default();
        let control = runs
            .iter()
            .find(|r| r.name == name && r.fault.is_none())
            .ok_or_else(|| FaultReportError::NoControl {
                run: run.name.clone(),
                control: name.clone(),
            })?;
        let window = run
            .window
            .ok_or_else(|| FaultReportError::NoWindow(run.name.clone()))?;
        let b = bounds(&control.timeline);
        let timeline = points(&run.timeline, &b);
        experiments.push(Experiment {
            name: run.name.clone(),
            fault: run.fault.clone().unwrap_or_default(),
            control: control.name.clone(),
            fault_start_s: window.0,
            fault_end_s: window.1,
            phases: phases(run, window, &latency),
            control_phases: phases(control, window, &latency),
            detect_s: settle_time(&run.timeline, &b, window, Which::During),
            recover_s: settle_time(&run.timeline, &b, window, Which::After),
            unhealthy_during: in_phase(&run.timeline, window, Which::During)
                .filter(|i| !healthy(i, &b))
                .count(),
            share_of_faulty: run.shares,
            ejections: run.ejections,
            timeline,
            control_timeline: points(&control.timeline, &b),
        });
    }
    Ok(FaultReport {
        setup,
        unhealthy_failed_points: UNHEALTHY_FAILED_POINTS,
        unhealthy_p99_factor: UNHEALTHY_P99_FACTOR,
        experiments,
    })
}

/// A share as a percentage with two decimals, or `-`.
fn percent(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{:.2}", v * 100.0))
}

/// Milliseconds, or `-`.
fn millis(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), ms)
}

/// Seconds, or what none means for `what`.
fn seconds(v: Option<f64>, none: &str) -> String {
    v.map_or_else(|| none.into(), |s| format!("{} s", fixed(s, 1)))
}

impl FaultReport {
    /// The report as Markdown: a row per phase of each experiment, its control's figures
    /// beside its own.
    pub fn render_markdown(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "| experiment | phase | success % (control) | p50 ms (control) | p99 ms (control) | provider 1's share of calls | detect / recover |"
        );
        let _ = writeln!(o, "|---|---|---:|---:|---:|---:|---|");
        for e in &self.experiments {
            let rows = [
                ("before", &e.phases.before, &e.control_phases.before),
                ("during", &e.phases.during, &e.control_phases.during),
                ("after", &e.phases.after, &e.control_phases.after),
            ];
            for (k, (phase, p, c)) in rows.into_iter().enumerate() {
                let share = e.share_of_faulty.and_then(|s| match k {
                    0 => s.before,
                    1 => s.during,
                    _ => s.after,
                });
                let time = match k {
                    1 => format!("detect {}", seconds(e.detect_s, "not routed around")),
                    2 => format!("recover {}", seconds(e.recover_s, "not recovered")),
                    _ => String::new(),
                };
                let _ = writeln!(
                    o,
                    "| {} | {phase} | {} ({}) | {} ({}) | {} ({}) | {} | {time} |",
                    if k == 0 { e.name.as_str() } else { "" },
                    percent(p.success_rate),
                    percent(c.success_rate),
                    millis(p.p50_ms),
                    millis(c.p50_ms),
                    millis(p.p99_ms),
                    millis(c.p99_ms),
                    percent(share),
                );
            }
        }
        let _ = writeln!(o);
        for e in &self.experiments {
            let ejected = e
                .ejections
                .filter(|n| *n > 0.0)
                .map_or(String::new(), |n| format!("; provider 1's ejections: {n}"));
            let _ = writeln!(
                o,
                "- **{}**: {}, from {} s to {} s; unhealthy intervals while it lasted: {}{ejected}.",
                e.name,
                e.fault,
                fixed(e.fault_start_s, 1),
                fixed(e.fault_end_s, 1),
                e.unhealthy_during
            );
        }
        let _ = writeln!(
            o,
            "\nAn interval is unhealthy when over {} percentage point more of its requests failed than in the control's worst interval, or its p99 is over {} times the control's worst; detect: from the fault to the end of the last unhealthy interval while it lasted; recover: the same from the repair.",
            self.unhealthy_failed_points, self.unhealthy_p99_factor
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Half-second intervals of 100 requests: `bad` lists the (start, ok, p99) of those
    /// that differ from ok 100 at p99 1 ms.
    fn timeline(n: usize, bad: &[(f64, u64, f64)]) -> Vec<Interval> {
        (0..n)
            .map(|k| {
                let t = k as f64 * 0.5;
                let (ok, p99) = bad
                    .iter()
                    .find(|b| b.0 == t)
                    .map_or((100, 1.0), |b| (b.1, b.2));
                Interval {
                    start_s: t,
                    seconds: 0.5,
                    due: 100,
                    ok,
                    p99_ms: Some(p99),
                }
            })
            .collect()
    }

    #[test]
    fn an_interval_is_unhealthy_beyond_the_controls_worst_with_the_margins() {
        let control = timeline(10, &[(1.0, 99, 1.5)]);
        let b = bounds(&control);
        assert!((b.max_failed_share - 0.02).abs() < 1e-9);
        assert!((b.max_p99_ms - 3.0).abs() < 1e-9);
        let i = |ok, p99| Interval {
            start_s: 0.0,
            seconds: 0.5,
            due: 100,
            ok,
            p99_ms: Some(p99),
        };
        assert!(healthy(&i(98, 3.0), &b));
        assert!(!healthy(&i(97, 1.0), &b), "3 % failed");
        assert!(!healthy(&i(100, 3.1), &b), "p99 over twice the worst");
    }

    #[test]
    fn detection_ends_with_the_last_unhealthy_interval_of_the_fault() {
        let b = bounds(&timeline(20, &[]));
        let fault = (2.0, 6.0);
        // Fault from 2 s to 6 s: unhealthy at 2.0 and 2.5, healthy after.
        let run = timeline(20, &[(2.0, 50, 1.0), (2.5, 90, 1.0)]);
        assert_eq!(settle_time(&run, &b, fault, Which::During), Some(1.0));
        // Never unhealthy: it never showed.
        let fine = timeline(20, &[]);
        assert_eq!(settle_time(&fine, &b, fault, Which::During), Some(0.0));
        // Unhealthy to the end of the fault: not routed around.
        let stuck = timeline(20, &[(2.0, 50, 1.0), (5.5, 50, 1.0)]);
        assert_eq!(settle_time(&stuck, &b, fault, Which::During), None);
        // Recovery: after the repair at 6 s, one slow interval.
        let slow = timeline(20, &[(6.5, 100, 50.0)]);
        assert_eq!(settle_time(&slow, &b, fault, Which::After), Some(1.0));
        // A fault that begins inside an interval: that interval is the fault's.
        let late = (2.1, 6.0);
        assert_eq!(Which::of(2.0, 2.5, late), Which::During);
        assert_eq!(Which::of(1.5, 2.0, late), Which::Before);
        assert_eq!(Which::of(5.5, 6.0, late), Which::During);
        assert_eq!(Which::of(6.0, 6.5, late), Which::After);
        let d = settle_time(&run, &b, late, Which::During).unwrap();
        assert!((d - 0.9).abs() < 1e-9, "{d}");
    }

    #[test]
    fn experiments_are_judged_against_their_control_over_the_same_windows() {
        let control = RunData {
            name: "control".into(),
            fault: None,
            control: None,
            window: None,
            timeline: timeline(20, &[]),
            shares: None,
            ejections: None,
        };
        let run = RunData {
            name: "black-hole".into(),
            fault: Some("fails".into()),
            control: Some("control".into()),
            window: Some((2.0, 6.0)),
            timeline: timeline(20, &[(2.0, 90, 1.0)]),
            shares: Some(Shares {
                before: Some(0.5),
                during: Some(0.01),
                after: Some(0.4),
            }),
            ejections: Some(1.0),
        };
        let latency = |name: &str, _window: (f64, f64), which: Which| {
            Some(if name == "control" || which == Which::Before {
                (1.0, 2.0, 10)
            } else {
                (1.5, 9.0, 10)
            })
        };
        let r = build(serde_json::json!({}), &[control.clone(), run], latency).unwrap();
        let e = &r.experiments[0];
        assert_eq!((e.fault_start_s, e.fault_end_s), (2.0, 6.0));
        assert_eq!(e.phases.during.requests, 800);
        assert_eq!(e.phases.during.ok, 790);
        assert_eq!(e.phases.before.p99_ms, Some(2.0));
        assert_eq!(e.phases.during.p99_ms, Some(9.0));
        assert_eq!(e.control_phases.during.p99_ms, Some(2.0));
        assert_eq!(e.detect_s, Some(0.5));
        assert_eq!(e.recover_s, Some(0.0));
        assert_eq!(e.unhealthy_during, 1);
        assert_eq!(e.timeline.len(), 20);
        let md = r.render_markdown();
        assert!(
            md.contains("| black-hole | before | 100.00 (100.00) |"),
            "{md}"
        );
        assert!(md.contains("detect 0.5 s"), "{md}");
        let orphan = RunData {
            control: Some("nothing".into()),
            ..r_run()
        };
        assert!(matches!(
            build(serde_json::json!({}), &[control, orphan], |_, _, _| None),
            Err(FaultReportError::NoControl { .. })
        ));
    }

    fn r_run() -> RunData {
        RunData {
            name: "x".into(),
            fault: Some("f".into()),
            control: None,
            window: Some((1.0, 2.0)),
            timeline: Vec::new(),
            shares: None,
            ejections: None,
        }
    }
}
