//! The experiment in time order: the searches (one, or a setting off and on taking turns
//! step by step, the order alternating each round, so that whatever drifts on a shared
//! machine drifts for both), then both settings once more at a common rate (the lower
//! capacity) for figures taken at one rate, then the closed-loop sweep and its USL fit.
//!
//! Every step is the [`StepRunner`]'s; this module decides whether it may start (not
//! stopped, and it would end within the time budget), hands its figures to the search and
//! to the report, and says what happens on the runner's progress lines. An experiment cut
//! short (Ctrl-C, the time budget, a step that failed) still reports every step it
//! completed, and why it ended ([`StopReason`]).

use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rpcmesh_common::format::{ms, thousands};

use crate::args::Plan;
use crate::report::{
    CapacityReport, CapacitySetup, Comparison, Phase, ProbeSetup, Search, Step, Sweep, SweepPoint,
};
use crate::search::{self, Ended};
use crate::step::{Compared, Measured, Setting, StepRunner};
use crate::usl;

/// The load every step offers, as the report describes it (the runner's own settings).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSetup {
    /// `platform` or `echo`.
    pub workload: String,
    /// Echo message size.
    pub payload_size: usize,
    /// Calls per request.
    pub fanout: u32,
    /// Calls of a request made at once.
    pub parallel: bool,
    /// Most requests in flight at once (open loop).
    pub concurrency: usize,
    /// Connections.
    pub connections: usize,
    /// Targets called.
    pub targets: Vec<String>,
    /// True when the runner started its own provider and broker.
    pub local_mesh: bool,
    /// The local provider's service-time flags, if any.
    pub service_work: Option<String>,
    /// The `/metrics` endpoints read for CPU.
    pub probes: Vec<ProbeSetup>,
    /// The load's own settings: the one search's (without a comparison), the sweep's,
    /// and the comparison's for what it does not compare.
    pub setting: Setting,
}

/// Why the experiment ended before it was complete.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    /// The runner was stopped (Ctrl-C) between steps.
    Interrupted,
    /// The runner was stopped during a step, which is left out: its figures cover part of
    /// a step and must not be judged.
    CutShort,
    /// The next step would have ended after the time budget.
    TimeLimit(Duration),
    /// The runner could not run a step.
    StepFailed {
        /// The step's number, from 1.
        step: usize,
        /// What the runner said.
        error: String,
    },
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::Interrupted => f.write_str("stopped (Ctrl-C)"),
            StopReason::CutShort => {
                f.write_str("stopped (Ctrl-C); the step it cut short is left out")
            }
            StopReason::TimeLimit(limit) => write!(
                f,
                "time limit: the next step would end after --time-limit {limit:?}"
            ),
            StopReason::StepFailed { step, error } => write!(f, "step {step} failed: {error}"),
        }
    }
}

/// How one search ended: by itself, or with the experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EndedBy {
    /// The search machine's own end.
    Search(Ended),
    /// The time budget.
    Time,
    /// Ctrl-C, or a step that failed.
    Stopped,
}

impl EndedBy {
    /// Its name in the report's `ended_by`.
    fn label(self) -> &'static str {
        match self {
            EndedBy::Search(e) => e.label(),
            EndedBy::Time => "time",
            EndedBy::Stopped => "stopped",
        }
    }

    /// True when the search did not end by itself: it has no capacity to compare.
    fn cut_short(self) -> bool {
        matches!(self, EndedBy::Time | EndedBy::Stopped)
    }
}

impl From<&StopReason> for EndedBy {
    fn from(why: &StopReason) -> Self {
        match why {
            StopReason::TimeLimit(_) => EndedBy::Time,
            StopReason::Interrupted | StopReason::CutShort | StopReason::StepFailed { .. } => {
                EndedBy::Stopped
            }
        }
    }
}

/// A search under way: its report, its machine, its setting and how it ended.
#[derive(Debug)]
struct Running {
    report: Search,
    machine: search::Search,
    setting: Setting,
    ended: Option<EndedBy>,
}

/// Runs the experiment `plan` describes on `runner`, whose load `load` describes; what was
/// measured is reported, however it ended.
pub fn run<R: StepRunner>(plan: &Plan, load: LoadSetup, runner: &mut R) -> CapacityReport {
    let started = Instant::now();
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut x = Experiment {
        plan,
        runner,
        started,
        stopped_early: None,
        steps_run: 0,
    };
    let mut searches = x.searches(load.setting);
    let comparison = plan.compare.map(|what| x.compare(what, &mut searches));
    let sweep = (!plan.sweep.is_empty()).then(|| x.sweep(load.setting));
    CapacityReport {
        version: env!("CARGO_PKG_VERSION").to_string(),
        started_unix,
        setup: setup(plan, load),
        slo: plan.slo.clone(),
        searches: searches.into_iter().map(|s| s.report).collect(),
        comparison,
        sweep,
        elapsed_seconds: started.elapsed().as_secs_f64(),
        stopped_early: x.stopped_early.map(|why| why.to_string()),
    }
}

fn setup(plan: &Plan, load: LoadSetup) -> CapacitySetup {
    CapacitySetup {
        workload: load.workload,
        payload_size: load.payload_size,
        fanout: load.fanout,
        parallel: load.parallel,
        concurrency: load.concurrency,
        connections: load.connections,
        targets: load.targets,
        local_mesh: load.local_mesh,
        service_work: load.service_work,
        step_seconds: plan.step.as_secs_f64(),
        warmup_seconds: plan.warmup.as_secs_f64(),
        start_rate: plan.bounds.start,
        max_rate: plan.bounds.max,
        growth: plan.bounds.growth,
        precision: plan.bounds.precision,
        time_limit_seconds: plan.time_limit.as_secs_f64(),
        probes: load.probes,
    }
}

struct Experiment<'a, R> {
    plan: &'a Plan,
    runner: &'a mut R,
    started: Instant,
    stopped_early: Option<StopReason>,
    steps_run: usize,
}

impl<R: StepRunner> Experiment<'_, R> {
    /// Whether another step may start: not stopped, and it would end within the budget.
    fn may_start(&mut self) -> bool {
        if self.stopped_early.is_some() {
            return false;
        }
        if self.runner.stopped() {
            self.stopped_early = Some(StopReason::Interrupted);
            return false;
        }
        let would_end =
            self.started.elapsed() + self.plan.warmup + self.plan.step + self.runner.overrun();
        if would_end > self.plan.time_limit {
            self.stopped_early = Some(StopReason::TimeLimit(self.plan.time_limit));
            return false;
        }
        true
    }

    fn open_step(&mut self, phase: Phase, rate: f64, setting: Setting) -> Option<Step> {
        self.steps_run += 1;
        self.runner.say(format_args!(
            "capacity: step {} ({}, {}): offering {} requests/s for {:.0} s",
            self.steps_run,
            phase.name(),
            setting.label(self.plan.compare),
            thousands(rate),
            self.plan.step.as_secs_f64()
        ));
        let m = self.runner.open(rate, setting);
        let m = self.finished(m)?;
        let s = Step::of(phase, rate, &m, &self.plan.slo);
        self.runner.say(format_args!(
            "capacity:   achieved {} requests/s ({} calls/s), p99 {} ms, errors {:.3}%, CPU µs/call {}: {}",
            thousands(s.achieved),
            thousands(s.calls_per_second),
            ms(s.latency.p99_ms),
            s.error_ratio * 100.0,
            cpu_text(&s.cpu_us_per_call),
            if s.pass {
                "pass".to_string()
            } else {
                format!("FAIL ({})", s.broken.join(", "))
            }
        ));
        Some(s)
    }

    /// A step's measurements, unless it was cut short or failed; then the experiment
    /// ends, and says why.
    fn finished(&mut self, m: Result<Measured, R::Error>) -> Option<Measured> {
        match m {
            Ok(_) if self.runner.stopped() => {
                self.stopped_early = Some(StopReason::CutShort);
                None
            }
            Ok(m) => Some(m),
            Err(e) => {
                let error = format!("{e:#}");
                self.runner.say(format_args!(
                    "capacity: step {} failed: {error}",
                    self.steps_run
                ));
                self.stopped_early = Some(StopReason::StepFailed {
                    step: self.steps_run,
                    error,
                });
                None
            }
        }
    }

    /// The searches (one, or off and on taking turns), each with its machine's state.
    fn searches(&mut self, own: Setting) -> Vec<Running> {
        let settings = match self.plan.compare {
            Some(what) => vec![own.with(what, false), own.with(what, true)],
            None => vec![own],
        };
        let mut all: Vec<Running> = settings
            .into_iter()
            .map(|setting| Running {
                report: Search {
                    compression: setting.compression,
                    tls: setting.tls,
                    steps: Vec::new(),
                    capacity: None,
                    lowest_failing: None,
                    ended_by: String::new(),
                },
                machine: search::Search::new(self.plan.bounds),
                setting,
                ended: None,
            })
            .collect();
        let mut round = 0usize;
        loop {
            let mut order: Vec<usize> = (0..all.len()).collect();
            // Alternate who goes first, so that neither always runs on a warmer machine.
            if round % 2 == 1 {
                order.reverse();
            }
            let mut ran = false;
            for i in order {
                match all[i].machine.next() {
                    Ok((phase, rate)) => {
                        if !self.may_start() {
                            break;
                        }
                        let Some(step) = self.open_step(phase, rate, all[i].setting) else {
                            break;
                        };
                        let s = &mut all[i];
                        s.machine.record(phase, rate, step.pass);
                        s.report.steps.push(step);
                        ran = true;
                    }
                    Err(ended) => all[i].ended = Some(EndedBy::Search(ended)),
                }
            }
            if !ran || self.stopped_early.is_some() {
                break;
            }
            round += 1;
        }
        for s in &mut all {
            s.report.capacity = s.machine.capacity();
            s.report.lowest_failing = s.machine.lowest_failing();
            let ended = s.ended.unwrap_or_else(|| {
                self.stopped_early
                    .as_ref()
                    .map_or(EndedBy::Stopped, EndedBy::from)
            });
            s.ended = Some(ended);
            s.report.ended_by = ended.label().to_string();
        }
        all
    }

    /// Both settings once more at the lower capacity, and the comparison; the common-rate
    /// steps join their searches' tables.
    fn compare(&mut self, what: Compared, searches: &mut [Running]) -> Comparison {
        let off = searches.first().and_then(|s| s.report.capacity);
        let on = searches.get(1).and_then(|s| s.report.capacity);
        let common = match (off, on) {
            (Some(a), Some(b)) => Some(a.min(b)),
            _ => None,
        };
        let mut steps = (None, None);
        if let Some(rate) = common {
            let setting = |i: usize| searches.get(i).map(|s: &Running| s.setting);
            if let (Some(off), Some(on)) = (setting(0), setting(1)) {
                if self.may_start() {
                    steps.0 = self.open_step(Phase::Common, rate, off);
                }
                if self.may_start() {
                    steps.1 = self.open_step(Phase::Common, rate, on);
                }
            }
        }
        let mut c = comparison(
            what,
            off,
            on,
            common,
            steps.0.as_ref(),
            steps.1.as_ref(),
            self.plan.bounds.precision,
        );
        let ended = |e: Ended| searches.iter().any(|s| s.ended == Some(EndedBy::Search(e)));
        let cut_short = searches
            .iter()
            .any(|s| s.ended.is_some_and(EndedBy::cut_short));
        if cut_short {
            c.verdict = "the comparison is incomplete: a search was cut short before it found its capacity (see the searches' ended_by)".into();
        } else if searches.len() == 2 && !ended(Ended::Slo) && !ended(Ended::Nothing) {
            c.verdict = format!(
                "both settings met the SLO up to --max-rate {}: raise it to find where {} matters",
                thousands(self.plan.bounds.max),
                what.name()
            );
        }
        self.runner.say(format_args!("capacity: {}", c.verdict));
        for (s, step) in searches.iter_mut().zip([steps.0, steps.1]) {
            if let Some(step) = step {
                s.report.steps.push(step);
            }
        }
        c
    }

    fn sweep(&mut self, setting: Setting) -> Sweep {
        let mut points = Vec::new();
        for &users in &self.plan.sweep {
            if !self.may_start() {
                break;
            }
            self.steps_run += 1;
            self.runner.say(format_args!(
                "capacity: step {} (sweep, {}): {users} users, closed loop, for {:.0} s",
                self.steps_run,
                setting.label(self.plan.compare),
                self.plan.step.as_secs_f64()
            ));
            let m = self.runner.closed(users, setting);
            let Some(m) = self.finished(m) else { break };
            let p = SweepPoint::of(users, &m);
            self.runner.say(format_args!(
                "capacity:   {} requests/s, p99 {} ms",
                thousands(p.throughput),
                ms(p.latency.p99_ms)
            ));
            points.push(p);
        }
        // A point where nothing succeeded says nothing about scaling (the path failed): it
        // stays in the table, out of the fit.
        let xy: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.throughput > 0.0)
            .map(|p| (p.users as f64, p.throughput))
            .collect();
        let left_out = points.len() - xy.len();
        let (fit, fit_error) = match usl::fit(&xy) {
            Ok(f) => (Some(f), None),
            Err(e) if left_out > 0 => (
                None,
                Some(format!(
                    "{e} ({left_out} point(s) with no successful request left out)"
                )),
            ),
            Err(e) => (None, Some(e.to_string())),
        };
        Sweep {
            compression: setting.compression,
            tls: setting.tls,
            points,
            fit,
            fit_error,
        }
    }
}

fn cpu_text(m: &std::collections::BTreeMap<String, f64>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The comparison of the two searches and their common-rate steps.
fn comparison(
    what: Compared,
    off: Option<f64>,
    on: Option<f64>,
    common: Option<f64>,
    off_step: Option<&Step>,
    on_step: Option<&Step>,
    precision: f64,
) -> Comparison {
    let change = match (off, on) {
        (Some(a), Some(b)) if a > 0.0 => Some((b - a) / a * 100.0),
        _ => None,
    };
    let bytes = |s: Option<&Step>| s.map(|s| s.bytes_out_per_call + s.bytes_in_per_call);
    let (bytes_off, bytes_on) = (bytes(off_step), bytes(on_step));
    let name = what.name();
    let mut verdict = match (change, off, on) {
        (Some(c), _, _) if c.abs() <= precision * 100.0 => format!(
            "on this path {name} does not change capacity measurably ({c:+.1} %, within the search's ±{:.0} % precision)",
            precision * 100.0
        ),
        (Some(c), _, _) if c > 0.0 => {
            format!("on this path {name} raises capacity by {c:.0} %")
        }
        (Some(c), _, _) => format!("on this path {name} lowers capacity by {:.0} %", -c),
        (None, Some(_), None) => {
            format!("with {name} nothing met the SLO; without it, something did")
        }
        (None, None, Some(_)) => {
            format!("without {name} nothing met the SLO; with it, something did")
        }
        _ => "neither setting met the SLO at any rate tried".into(),
    };
    if let (Some(a), Some(b)) = (bytes_off, bytes_on) {
        if a > 0.0 {
            verdict.push_str(&format!(
                " (wire bytes per call {:+.0} %",
                (b - a) / a * 100.0
            ));
            let cpu =
                |s: Option<&Step>, role: &str| s.and_then(|s| s.cpu_us_per_call.get(role).copied());
            for role in ["provider", "broker", "driver"] {
                if let (Some(x), Some(y)) = (cpu(off_step, role), cpu(on_step, role)) {
                    verdict.push_str(&format!(", {role} CPU per call {:+.1} µs", y - x));
                }
            }
            verdict.push(')');
        }
    }
    Comparison {
        compared: what,
        capacity_off: off,
        capacity_on: on,
        capacity_change_percent: change,
        common_rate: common,
        p99_ms_off: off_step.map(|s| s.latency.p99_ms),
        p99_ms_on: on_step.map(|s| s.latency.p99_ms),
        bytes_per_call_off: bytes_off,
        bytes_per_call_on: bytes_on,
        cpu_us_per_call_off: off_step
            .map(|s| s.cpu_us_per_call.clone())
            .unwrap_or_default(),
        cpu_us_per_call_on: on_step
            .map(|s| s.cpu_us_per_call.clone())
            .unwrap_or_default(),
        verdict,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::report::LatencySummary;
    use crate::search::Bounds;
    use crate::step::{Calls, CpuUse, Requests};

    /// A made-up path: every request succeeds; p99 is 5 ms up to `knee` requests/s (80 %
    /// of it with compression on) and 500 ms beyond; closed-loop throughput follows the
    /// USL with σ 0.05 and κ 0.001 from 1,000 requests/s.
    struct MadeUp {
        knee: f64,
        /// The steps asked for, in order.
        asked: Vec<(f64, Setting)>,
        /// Stopped (as by Ctrl-C) during this step, from 1.
        stop_during: Option<usize>,
        /// This step (from 1) fails.
        fail: Option<usize>,
        overrun: Duration,
        lines: Vec<String>,
    }

    impl MadeUp {
        fn new(knee: f64) -> Self {
            MadeUp {
                knee,
                asked: Vec::new(),
                stop_during: None,
                fail: None,
                overrun: Duration::ZERO,
                lines: Vec::new(),
            }
        }

        fn step(&mut self, rate: f64, p99: f64, c: Setting) -> Result<Measured, String> {
            self.asked.push((rate, c));
            if self.fail == Some(self.asked.len()) {
                return Err("the target refused".into());
            }
            let seconds = 10.0;
            let ok = (rate * seconds) as u64;
            let bytes = if c.compression { 100 } else { 120 };
            Ok(Measured {
                seconds,
                requests: Requests {
                    due: ok,
                    completed: ok,
                    ok,
                    latency: LatencySummary {
                        count: ok,
                        p99_ms: p99,
                        ..LatencySummary::default()
                    },
                    ..Requests::default()
                },
                calls: Calls {
                    sent: ok,
                    ok,
                    ok_per_second: rate,
                    errors: BTreeMap::new(),
                },
                wire_out: ok * bytes,
                wire_in: ok * bytes,
                cpu: CpuUse {
                    seconds: BTreeMap::from([("broker".to_string(), ok as f64 * 1e-5)]),
                    ..CpuUse::default()
                },
            })
        }
    }

    impl StepRunner for MadeUp {
        type Error = String;

        fn open(&mut self, rate: f64, c: Setting) -> Result<Measured, String> {
            let knee = if c.compression || c.tls {
                self.knee * 0.8
            } else {
                self.knee
            };
            self.step(rate, if rate <= knee { 5.0 } else { 500.0 }, c)
        }

        fn closed(&mut self, users: usize, c: Setting) -> Result<Measured, String> {
            let n = users as f64;
            let x = 1000.0 * n / (1.0 + 0.05 * (n - 1.0) + 0.001 * n * (n - 1.0));
            self.step(x, 5.0, c)
        }

        fn stopped(&self) -> bool {
            self.stop_during.is_some_and(|n| self.asked.len() >= n)
        }

        fn overrun(&self) -> Duration {
            self.overrun
        }

        fn say(&mut self, line: fmt::Arguments<'_>) {
            self.lines.push(line.to_string());
        }
    }

    fn plan(compare: Option<Compared>, sweep: &[usize]) -> Plan {
        Plan {
            slo: "p99<=20ms,errors<=0.1%".parse().expect("an SLO"),
            bounds: Bounds {
                start: 100.0,
                min: 10.0,
                max: 1_000_000.0,
                growth: 2.0,
                precision: 0.05,
            },
            step: Duration::from_secs(1),
            warmup: Duration::from_millis(100),
            time_limit: Duration::from_secs(3600),
            compare,
            sweep: sweep.to_vec(),
        }
    }

    fn load() -> LoadSetup {
        LoadSetup {
            workload: "platform".into(),
            payload_size: 32,
            fanout: 5,
            parallel: false,
            concurrency: 200,
            connections: 8,
            targets: vec!["127.0.0.1:7700".into()],
            local_mesh: false,
            service_work: None,
            probes: Vec::new(),
            setting: Setting::default(),
        }
    }

    #[test]
    fn a_search_on_made_up_steps_brackets_the_knee_and_says_each_step() {
        let mut path = MadeUp::new(5_000.0);
        let r = run(&plan(None, &[]), load(), &mut path);
        assert_eq!(r.stopped_early, None);
        assert_eq!(r.searches.len(), 1);
        let s = &r.searches[0];
        assert_eq!(s.ended_by, "slo");
        let (cap, fail) = (s.capacity.unwrap(), s.lowest_failing.unwrap());
        assert!(
            cap <= 5_000.0 && fail > 5_000.0 && fail <= cap * 1.05,
            "{cap} {fail}"
        );
        assert_eq!(s.steps.last().map(|t| t.phase), Some(Phase::Confirm));
        assert!(s.steps.iter().all(|t| t.pass == (t.offered <= 5_000.0)));
        // Two lines a step: what it offers, and what it measured.
        assert_eq!(path.lines.len(), 2 * s.steps.len());
        assert!(
            path.lines[0]
                .starts_with("capacity: step 1 (grow, compression off): offering 100 requests/s")
        );
        assert!(r.comparison.is_none() && r.sweep.is_none());
    }

    #[test]
    fn off_and_on_take_turns_then_meet_at_the_common_rate() {
        let mut path = MadeUp::new(5_000.0);
        let r = run(&plan(Some(Compared::Compression), &[]), load(), &mut path);
        let settings: Vec<bool> = path.asked.iter().map(|a| a.1.compression).collect();
        let (off, on) = (false, true);
        // Round 0 off first, round 1 on first, ...
        assert_eq!(settings[..6], [off, on, on, off, off, on]);
        let c = r.comparison.expect("a comparison");
        let (off, on) = (c.capacity_off.unwrap(), c.capacity_on.unwrap());
        assert!(on < off, "{on} {off}");
        assert_eq!(c.common_rate, Some(on));
        assert!(
            c.verdict
                .starts_with("on this path compression lowers capacity by"),
            "{}",
            c.verdict
        );
        assert!(
            c.verdict.contains("wire bytes per call -17 %"),
            "{}",
            c.verdict
        );
        for s in &r.searches {
            let last = s.steps.last().expect("steps");
            assert_eq!((last.phase, last.offered), (Phase::Common, on));
        }
    }

    #[test]
    fn tls_off_and_on_are_compared_with_the_loads_own_compression() {
        let mut path = MadeUp::new(5_000.0);
        let r = run(&plan(Some(Compared::Tls), &[]), load(), &mut path);
        let tls: Vec<bool> = path.asked.iter().map(|a| a.1.tls).collect();
        assert_eq!(tls[..4], [false, true, true, false]);
        assert!(path.asked.iter().all(|a| !a.1.compression));
        assert!(
            path.lines[0].starts_with("capacity: step 1 (grow, TLS off): offering"),
            "{}",
            path.lines[0]
        );
        let c = r.comparison.as_ref().expect("a comparison");
        assert_eq!(c.compared, Compared::Tls);
        assert!(
            c.verdict.starts_with("on this path TLS lowers capacity by"),
            "{}",
            c.verdict
        );
        assert_eq!(r.search(true).map(|s| s.tls), Some(true));
        assert_eq!(r.search(false).map(|s| s.tls), Some(false));
    }

    #[test]
    fn the_sweep_is_fitted_with_the_usl() {
        let mut path = MadeUp::new(5_000.0);
        let r = run(&plan(None, &[1, 2, 4, 8, 16, 32, 64]), load(), &mut path);
        let sweep = r.sweep.expect("a sweep");
        assert_eq!(sweep.points.len(), 7);
        let fit = sweep.fit.expect("a fit");
        assert!((fit.sigma - 0.05).abs() < 1e-3, "{fit:?}");
        assert!((fit.kappa - 0.001).abs() < 1e-4, "{fit:?}");
    }

    #[test]
    fn ctrl_c_during_a_step_leaves_it_out_and_ends_every_search() {
        let mut path = MadeUp::new(5_000.0);
        path.stop_during = Some(3);
        let r = run(
            &plan(Some(Compared::Compression), &[1, 2, 4]),
            load(),
            &mut path,
        );
        assert_eq!(
            r.stopped_early.as_deref(),
            Some("stopped (Ctrl-C); the step it cut short is left out")
        );
        assert_eq!(path.asked.len(), 3, "nothing starts after it");
        let steps: usize = r.searches.iter().map(|s| s.steps.len()).sum();
        assert_eq!(steps, 2);
        for s in &r.searches {
            assert_eq!((s.ended_by.as_str(), s.capacity), ("stopped", None));
        }
        let c = r.comparison.expect("a comparison");
        assert!(
            c.verdict.starts_with("the comparison is incomplete"),
            "{}",
            c.verdict
        );
        assert!(r.sweep.expect("a sweep").points.is_empty());
    }

    #[test]
    fn a_step_that_would_end_after_the_time_limit_is_not_started() {
        let mut path = MadeUp::new(5_000.0);
        path.overrun = Duration::from_secs(3600);
        let r = run(&plan(None, &[]), load(), &mut path);
        assert!(path.asked.is_empty());
        assert_eq!(
            r.stopped_early.as_deref(),
            Some("time limit: the next step would end after --time-limit 3600s")
        );
        assert_eq!(r.searches[0].ended_by, "time");
    }

    #[test]
    fn a_failed_step_ends_the_experiment_and_says_why() {
        let mut path = MadeUp::new(5_000.0);
        path.fail = Some(2);
        let r = run(&plan(None, &[]), load(), &mut path);
        assert_eq!(
            r.stopped_early.as_deref(),
            Some("step 2 failed: the target refused")
        );
        assert_eq!(r.searches[0].ended_by, "stopped");
        assert_eq!(r.searches[0].steps.len(), 1);
        assert!(
            path.lines
                .iter()
                .any(|l| l == "capacity: step 2 failed: the target refused")
        );
    }
}
