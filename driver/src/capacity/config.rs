//! `driver capacity`'s command line, its defaults and why, and validation into
//! [`CapacityConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use rpcmesh_common::cli::{ConfigProblems, DurationArg};
use rpcmesh_wire::compress::CompressionConfig;

use super::search::Bounds;
use super::slo::{DEFAULT_SLO, Slo};
use crate::config::{DriverConfig, LoadArgs, check_rate};
use crate::pacer::Pacing;

/// Measured length of each step unless told otherwise: 10 s, as `--steps`' (a queue
/// settles in a few seconds, and thousands of requests give a steady p99).
pub const DEFAULT_STEP: Duration = Duration::from_secs(10);
/// Unmeasured lead-in of each step: every step opens fresh connections, and the broker's
/// pool and the provider's queues reach the new rate within it.
pub const DEFAULT_STEP_WARMUP: Duration = Duration::from_secs(2);
/// First rate a search offers: a rate every deployment holds, so the first step passes
/// and growth starts from a measurement.
pub const DEFAULT_START_RATE: f64 = 500.0;
/// Lowest rate a search shrinks to when its start rate fails.
pub const DEFAULT_MIN_RATE: f64 = 10.0;
/// Highest rate a search offers: beyond what one driver paces (a request every 2 µs).
pub const DEFAULT_MAX_RATE: f64 = 500_000.0;
/// Factor between growing steps: doubling finds the order of magnitude in a few steps,
/// and bisection the rest.
pub const DEFAULT_GROWTH: f64 = 2.0;
/// A search ends when its lowest failing rate is within 5 % of its highest passing one:
/// about the step-to-step noise of a rate on a shared VM.
pub const DEFAULT_PRECISION: f64 = 0.05;
/// The finest `--precision` taken: below it the bisection's steps differ by less than
/// the noise of a rate, and the midpoint of two near rates can round to one of them.
pub const MIN_PRECISION: f64 = 1e-3;
/// The whole experiment's time budget: a search, a comparison and a sweep at the default
/// step length fit well within it; a step that would end beyond it is not started.
pub const DEFAULT_TIME_LIMIT: Duration = Duration::from_secs(30 * 60);
/// The closed-loop sweep's users unless told otherwise: doubling from 1 to 256, enough
/// points around a typical peak for the USL's three parameters.
pub const DEFAULT_SWEEP: &str = "1,2,4,8,16,32,64,128,256";
/// The pacer of a capacity step unless told otherwise: lean. The exact pacer spins up to
/// a core, which on a machine shared with the system under test is taken from it; a lean
/// pacer's lateness (tens to hundreds of µs) is far below any SLO worth searching for,
/// and is reported per step as the start lag.
pub const DEFAULT_CAPACITY_PACING: Pacing = Pacing::Lean;

/// `driver capacity`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct CapacityArgs {
    /// What is called, and how (as for a run).
    #[command(flatten)]
    pub load: LoadArgs,
    /// What a step must meet: latency percentiles of requests (from their intended start)
    /// and errors (failed or unsent requests, a share of those due), e.g.
    /// 'p99<=20ms,p99.9<=50ms,errors<=0.1%'.
    #[arg(long, default_value = DEFAULT_SLO)]
    pub slo: Slo,
    /// Measured length of each step.
    #[arg(long, default_value_t = DurationArg(DEFAULT_STEP))]
    pub step_duration: DurationArg,
    /// Unmeasured lead-in of each step.
    #[arg(long, default_value_t = DurationArg(DEFAULT_STEP_WARMUP))]
    pub warmup: DurationArg,
    /// First rate offered, requests per second.
    #[arg(long, default_value_t = DEFAULT_START_RATE)]
    pub start_rate: f64,
    /// Lowest rate tried when the start rate fails.
    #[arg(long, default_value_t = DEFAULT_MIN_RATE)]
    pub min_rate: f64,
    /// Highest rate offered.
    #[arg(long, default_value_t = DEFAULT_MAX_RATE)]
    pub max_rate: f64,
    /// Factor between growing steps.
    #[arg(long, default_value_t = DEFAULT_GROWTH)]
    pub growth: f64,
    /// Stop bisecting when the failing rate is within this fraction of the passing one.
    #[arg(long, default_value_t = DEFAULT_PRECISION)]
    pub precision: f64,
    /// Time budget of the whole experiment; no step starts that would end after it.
    #[arg(long, default_value_t = DurationArg(DEFAULT_TIME_LIMIT))]
    pub time_limit: DurationArg,
    /// Search with compression off and on, interleaving their steps, and compare.
    #[arg(long)]
    pub compare_compression: bool,
    /// Closed-loop users of the scalability sweep (fitted with the USL), or `off`.
    #[arg(long, default_value = DEFAULT_SWEEP)]
    pub sweep: SweepArg,
    /// `/metrics` of a broker on the path (HOST:PORT), for its CPU. Repeatable. Found
    /// by itself for the local mesh.
    #[arg(long = "broker-metrics")]
    pub broker_metrics: Vec<SocketAddr>,
    /// `/metrics` of a provider on the path (HOST:PORT). Repeatable.
    #[arg(long = "provider-metrics")]
    pub provider_metrics: Vec<SocketAddr>,
    /// Local mesh: the provider's service time (as the provider's --service-time).
    #[arg(long)]
    pub service_time: Option<String>,
    /// Local mesh: the provider burns its service time on the CPU instead of sleeping.
    #[arg(long)]
    pub service_work: bool,
    /// Write the report as JSON (schema: docs/capacity.schema.json).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the report as Markdown.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Write the report as HTML, with charts.
    #[arg(long)]
    pub html: Option<PathBuf>,
}

/// The sweep's users, or none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepArg(pub Vec<usize>);

impl FromStr for SweepArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("off") {
            return Ok(SweepArg(Vec::new()));
        }
        s.split(',')
            .map(|u| match u.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("{u:?}: users must be whole numbers above zero")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(SweepArg)
    }
}

/// Validated capacity settings.
#[derive(Debug, Clone)]
pub struct CapacityConfig {
    /// The load of every step (its schedule, stop and warm-up are set per step).
    pub load: DriverConfig,
    /// Compression when on (for `--compress on` or the comparison's second search).
    pub compression_on: CompressionConfig,
    /// Search with compression off and on.
    pub compare: bool,
    /// What a step must meet.
    pub slo: Slo,
    /// The search's bounds.
    pub bounds: Bounds,
    /// Measured length of a step.
    pub step: Duration,
    /// Lead-in of a step.
    pub warmup: Duration,
    /// Time budget.
    pub time_limit: Duration,
    /// The sweep's users (empty: no sweep).
    pub sweep: Vec<usize>,
    /// `/metrics` endpoints on the path, by role.
    pub probes: Vec<(String, SocketAddr)>,
    /// Flags of the local mesh's provider.
    pub provider_flags: Vec<String>,
    /// Outputs.
    pub json: Option<PathBuf>,
    /// Markdown output.
    pub markdown: Option<PathBuf>,
    /// HTML output.
    pub html: Option<PathBuf>,
}

impl CapacityArgs {
    /// Checks every setting and lists all problems at once.
    pub fn config(&self) -> Result<CapacityConfig, ConfigProblems> {
        let mut p = ConfigProblems::default();
        let load = self.load.config(DEFAULT_CAPACITY_PACING, &mut p);
        let compression_on = match &load.compression {
            Some(c) => *c,
            None => self
                .load
                .compression
                .config(true, &mut p)
                .unwrap_or_default(),
        };
        p.check(self.compare_compression && self.load.v1, || {
            "--compare-compression needs the extension flags: drop --v1".into()
        });
        for (name, r) in [
            ("--start-rate", self.start_rate),
            ("--min-rate", self.min_rate),
            ("--max-rate", self.max_rate),
        ] {
            p.check(!(r.is_finite() && r > 0.0), || {
                format!("{name} must be above zero")
            });
            check_rate(r, &mut p);
        }
        p.check(self.min_rate > self.max_rate, || {
            "--min-rate is above --max-rate".into()
        });
        p.check(!(self.growth.is_finite() && self.growth > 1.0), || {
            "--growth must be above 1".into()
        });
        p.check(
            !(self.precision.is_finite() && self.precision > 0.0),
            || "--precision must be above zero".into(),
        );
        p.check(self.step_duration.0.is_zero(), || {
            "--step-duration must be above zero".into()
        });
        p.check(self.time_limit.0.is_zero(), || {
            "--time-limit must be above zero".into()
        });
        let local = load.targets.is_empty();
        p.check(
            !local && (self.service_time.is_some() || self.service_work),
            || "--service-time and --service-work shape the local mesh's provider: drop --target, or set them on your provider".into(),
        );
        let mut provider_flags = Vec::new();
        if let Some(t) = &self.service_time {
            provider_flags.extend(["--service-time".to_string(), t.clone()]);
        }
        if self.service_work {
            provider_flags.push("--service-work".into());
        }
        let probes = self
            .broker_metrics
            .iter()
            .map(|a| ("broker".to_string(), *a))
            .chain(
                self.provider_metrics
                    .iter()
                    .map(|a| ("provider".to_string(), *a)),
            )
            .collect();
        p.into_result(CapacityConfig {
            load,
            compression_on,
            compare: self.compare_compression,
            slo: self.slo.clone(),
            bounds: Bounds {
                start: self.start_rate,
                min: self.min_rate,
                max: self.max_rate,
                growth: self.growth,
                precision: self.precision,
            },
            step: self.step_duration.0,
            warmup: self.warmup.0,
            time_limit: self.time_limit.0,
            sweep: self.sweep.0.clone(),
            probes,
            provider_flags,
            json: self.json.clone(),
            markdown: self.markdown.clone(),
            html: self.html.clone(),
        })
    }
}
