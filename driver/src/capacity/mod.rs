//! `driver capacity`: the highest rate that meets an SLO, with and without compression,
//! and how throughput scales with users.
//!
//! The experiment, in time order: the search ([`search`]) offers open-loop steps at
//! growing, then bisected, rates, each judged by the SLO ([`slo`]), and confirms the
//! highest passing one; with `--compare-compression` two searches (off and on) take turns
//! step by step, so that drift on a shared machine hits both alike, and then run once more
//! each at a common rate. Then a closed-loop sweep over users, fitted with the Universal
//! Scalability Law ([`usl`]). Every step ([`step`]) is a driver run whose measured window
//! is bracketed by readings of each program's CPU ([`probe`]); with no target, the
//! provider and broker run as child processes ([`mesh`]) so that each has its own.
//! The results are data ([`report`], JSON with a schema), text, Markdown and HTML
//! ([`html`]).

pub mod config;
pub mod html;
pub mod mesh;
pub mod probe;
pub mod report;
pub mod search;
pub mod slo;
pub mod step;
pub mod usl;

use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_wire::compress::CompressionConfig;

use self::config::CapacityConfig;
use self::report::{
    CapacityReport, CapacitySetup, Comparison, Phase, ProbeSetup, Search, Step, Sweep, SweepPoint,
};
use self::step::{Measured, Runner};
use crate::config::WorkloadKind;
use crate::progress::say;

/// A search's `ended_by` when the time budget cut it short.
const ENDED_BY_TIME: &str = "time";
/// A search's `ended_by` when Ctrl-C (or a failed step) cut it short.
const ENDED_BY_STOP: &str = "stopped";
/// How `stopped_early` begins when the time budget ended the experiment.
const TIME_LIMIT: &str = "time limit";

/// Runs the experiment. `exe` is the driver binary, run again as the local mesh's
/// provider and broker when `config` has no target. `stop` (Ctrl-C) ends it early; what
/// was measured is reported.
pub async fn run(
    mut config: CapacityConfig,
    exe: &Path,
    stop: CancellationToken,
) -> anyhow::Result<CapacityReport> {
    let started = Instant::now();
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let local = config.load.targets.is_empty();
    let mesh = if local {
        let exe = exe.to_path_buf();
        let flags = config.provider_flags.clone();
        let mesh =
            tokio::task::spawn_blocking(move || mesh::LocalMesh::start(&exe, &flags)).await??;
        config.load.targets = vec![mesh.broker.rpc.to_string()];
        config.probes = vec![
            ("broker".into(), mesh.broker.metrics),
            ("provider".into(), mesh.provider.metrics),
        ];
        say!(
            "capacity: local mesh: broker {} (metrics {}), provider {} (metrics {})",
            mesh.broker.rpc,
            mesh.broker.metrics,
            mesh.provider.rpc,
            mesh.provider.metrics
        );
        Some(mesh)
    } else {
        None
    };
    let mut x = Experiment {
        runner: Runner {
            load: config.load.clone(),
            step: config.step,
            warmup: config.warmup,
            probes: config.probes.clone(),
        },
        config: &config,
        started,
        stop: stop.clone(),
        stopped_early: None,
        steps_run: 0,
    };
    let searches = x.searches().await;
    let comparison = if config.compare {
        Some(x.compare(&searches).await)
    } else {
        None
    };
    let mut searches: Vec<Search> = searches.into_iter().map(|(s, _)| s).collect();
    if let (Some(c), true) = (&comparison, config.compare) {
        // The common-rate steps belong to their searches' tables too.
        for (s, step) in searches.iter_mut().zip([&c.1, &c.2]) {
            if let Some(step) = step {
                s.steps.push(step.clone());
            }
        }
    }
    let sweep = if config.sweep.is_empty() {
        None
    } else {
        Some(x.sweep().await)
    };
    let stopped_early = x.stopped_early.take();
    if let Some(mesh) = mesh {
        tokio::task::spawn_blocking(move || drop(mesh)).await?;
    }
    Ok(CapacityReport {
        version: env!("CARGO_PKG_VERSION").to_string(),
        started_unix,
        setup: setup(&config, local),
        slo: config.slo.clone(),
        searches,
        comparison: comparison.map(|c| c.0),
        sweep,
        elapsed_seconds: started.elapsed().as_secs_f64(),
        stopped_early,
    })
}

fn setup(c: &CapacityConfig, local: bool) -> CapacitySetup {
    CapacitySetup {
        workload: match c.load.workload {
            WorkloadKind::Platform => "platform".into(),
            WorkloadKind::Echo => "echo".into(),
        },
        payload_size: c.load.payload_size,
        fanout: c.load.fanout,
        parallel: c.load.parallel,
        concurrency: c.load.concurrency,
        connections: c.load.connections,
        targets: c.load.targets.clone(),
        local_mesh: local,
        service_work: (!c.provider_flags.is_empty()).then(|| c.provider_flags.join(" ")),
        step_seconds: c.step.as_secs_f64(),
        warmup_seconds: c.warmup.as_secs_f64(),
        start_rate: c.bounds.start,
        max_rate: c.bounds.max,
        growth: c.bounds.growth,
        precision: c.bounds.precision,
        time_limit_seconds: c.time_limit.as_secs_f64(),
        probes: c
            .probes
            .iter()
            .map(|(role, a)| ProbeSetup {
                role: role.clone(),
                address: a.to_string(),
            })
            .collect(),
    }
}

struct Experiment<'a> {
    config: &'a CapacityConfig,
    runner: Runner,
    started: Instant,
    stop: CancellationToken,
    stopped_early: Option<String>,
    steps_run: usize,
}

fn label(compression: &Option<CompressionConfig>) -> &'static str {
    if compression.is_some() { "on" } else { "off" }
}

impl Experiment<'_> {
    /// Whether another step may start: not stopped, and it would end within the budget.
    fn may_start(&mut self) -> bool {
        if self.stopped_early.is_some() {
            return false;
        }
        if self.stop.is_cancelled() {
            self.stopped_early = Some("stopped (Ctrl-C)".into());
            return false;
        }
        // A step's last replies may take up to the call timeout after its window (when it
        // is beyond capacity), and its two readings up to a scrape timeout each.
        let tail = self.config.load.call_timeout + 2 * probe::SCRAPE_TIMEOUT;
        let would_end = self.started.elapsed() + self.config.warmup + self.config.step + tail;
        if would_end > self.config.time_limit {
            self.stopped_early = Some(format!(
                "{TIME_LIMIT}: the next step would end after --time-limit {:?}",
                self.config.time_limit
            ));
            return false;
        }
        true
    }

    async fn open_step(
        &mut self,
        phase: Phase,
        rate: f64,
        compression: &Option<CompressionConfig>,
    ) -> Option<Step> {
        self.steps_run += 1;
        say!(
            "capacity: step {} ({}, compression {}): offering {} requests/s for {:.0} s",
            self.steps_run,
            phase.name(),
            label(compression),
            crate::report::thousands(rate),
            self.config.step.as_secs_f64()
        );
        let m = self.runner.open(rate, *compression, &self.stop).await;
        let m = self.finished(m)?;
        let s = Step::of(phase, rate, &m, &self.config.slo);
        say!(
            "capacity:   achieved {} requests/s ({} calls/s), p99 {} ms, errors {:.3}%, CPU µs/call {}: {}",
            crate::report::thousands(s.achieved),
            crate::report::thousands(s.calls_per_second),
            crate::report::ms(s.latency.p99_ms),
            s.error_ratio * 100.0,
            cpu_text(&s.cpu_us_per_call),
            if s.pass {
                "pass".to_string()
            } else {
                format!("FAIL ({})", s.broken.join(", "))
            }
        );
        Some(s)
    }

    /// A step's measurements, unless it was cut short (Ctrl-C: its figures cover part of
    /// a step and must not be judged) or failed; then the experiment ends, and says why.
    fn finished(&mut self, m: anyhow::Result<Measured>) -> Option<Measured> {
        match m {
            Ok(_) if self.stop.is_cancelled() => {
                self.stopped_early =
                    Some("stopped (Ctrl-C); the step it cut short is left out".into());
                None
            }
            Ok(m) => Some(m),
            Err(e) => {
                say!("capacity: step {} failed: {e:#}", self.steps_run);
                self.stopped_early = Some(format!("step {} failed: {e:#}", self.steps_run));
                None
            }
        }
    }

    /// The searches (one, or off and on taking turns), each with its machine's state.
    async fn searches(&mut self) -> Vec<(Search, search::Search)> {
        let settings: Vec<Option<CompressionConfig>> = if self.config.compare {
            vec![None, Some(self.config.compression_on)]
        } else {
            vec![self.config.load.compression]
        };
        let mut all: Vec<(Search, search::Search, Option<CompressionConfig>)> = settings
            .into_iter()
            .map(|c| {
                (
                    Search {
                        compression: c.is_some(),
                        steps: Vec::new(),
                        capacity: None,
                        lowest_failing: None,
                        ended_by: String::new(),
                    },
                    search::Search::new(self.config.bounds),
                    c,
                )
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
                let (report, machine, compression) = &mut all[i];
                match machine.next() {
                    Ok((phase, rate)) => {
                        if !self.may_start() {
                            break;
                        }
                        let compression = *compression;
                        let Some(step) = self.open_step(phase, rate, &compression).await else {
                            break;
                        };
                        let (report, machine, _) = &mut all[i];
                        machine.record(phase, rate, step.pass);
                        report.steps.push(step);
                        ran = true;
                    }
                    Err(ended) => report.ended_by = ended.label().to_string(),
                }
            }
            if !ran || self.stopped_early.is_some() {
                break;
            }
            round += 1;
        }
        for (report, machine, _) in &mut all {
            report.capacity = machine.capacity();
            report.lowest_failing = machine.lowest_failing();
            if report.ended_by.is_empty() {
                report.ended_by = if self.stop.is_cancelled() {
                    "stopped"
                } else {
                    "time"
                }
                .into();
            }
        }
        all.into_iter().map(|(r, m, _)| (r, m)).collect()
    }

    /// Both settings once more at the lower capacity, and the comparison.
    async fn compare(
        &mut self,
        searches: &[(Search, search::Search)],
    ) -> (Comparison, Option<Step>, Option<Step>) {
        let off = searches.first().and_then(|s| s.0.capacity);
        let on = searches.get(1).and_then(|s| s.0.capacity);
        let common = match (off, on) {
            (Some(a), Some(b)) => Some(a.min(b)),
            _ => None,
        };
        let mut steps = (None, None);
        if let Some(rate) = common {
            if self.may_start() {
                steps.0 = self.open_step(Phase::Common, rate, &None).await;
            }
            if self.may_start() {
                let on = Some(self.config.compression_on);
                steps.1 = self.open_step(Phase::Common, rate, &on).await;
            }
        }
        let mut c = comparison(
            off,
            on,
            common,
            steps.0.as_ref(),
            steps.1.as_ref(),
            self.config.bounds.precision,
        );
        let ended = |label: &str| searches.iter().any(|s| s.0.ended_by == label);
        let cut_short = searches
            .iter()
            .any(|s| s.0.ended_by == ENDED_BY_TIME || s.0.ended_by == ENDED_BY_STOP);
        if cut_short {
            c.verdict = "the comparison is incomplete: a search was cut short before it found its capacity (see the searches' ended_by)".into();
        } else if searches.len() == 2 && !ended("slo") && !ended("nothing_passed") {
            c.verdict = format!(
                "both settings met the SLO up to --max-rate {}: raise it to find where compression matters",
                crate::report::thousands(self.config.bounds.max)
            );
        }
        say!("capacity: {}", c.verdict);
        (c, steps.0, steps.1)
    }

    async fn sweep(&mut self) -> Sweep {
        let compression = self.config.load.compression;
        let mut points = Vec::new();
        for &users in &self.config.sweep {
            if !self.may_start() {
                break;
            }
            self.steps_run += 1;
            say!(
                "capacity: step {} (sweep, compression {}): {users} users, closed loop, for {:.0} s",
                self.steps_run,
                label(&compression),
                self.config.step.as_secs_f64()
            );
            let m = self.runner.closed(users, compression, &self.stop).await;
            let Some(m) = self.finished(m) else { break };
            let p = SweepPoint::of(users, &m);
            say!(
                "capacity:   {} requests/s, p99 {} ms",
                crate::report::thousands(p.throughput),
                crate::report::ms(p.latency.p99_ms)
            );
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
            compression: compression.is_some(),
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
    let mut verdict = match (change, off, on) {
        (Some(c), _, _) if c.abs() <= precision * 100.0 => format!(
            "on this path compression does not change capacity measurably ({c:+.1} %, within the search's ±{:.0} % precision)",
            precision * 100.0
        ),
        (Some(c), _, _) if c > 0.0 => {
            format!("on this path compression raises capacity by {c:.0} %")
        }
        (Some(c), _, _) => format!("on this path compression lowers capacity by {:.0} %", -c),
        (None, Some(_), None) => {
            "with compression nothing met the SLO; without it, something did".into()
        }
        (None, None, Some(_)) => {
            "without compression nothing met the SLO; with it, something did".into()
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
