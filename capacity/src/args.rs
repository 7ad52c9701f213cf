//! The planner's flags (the SLO, the search's bounds, step lengths, the time budget, the
//! comparison, the sweep, and where the report goes), their defaults and why, and
//! validation into a [`Plan`]. Each has an environment fallback named
//! `RPCMESH_CAPACITY_<FLAG>`: the prefix keeps them apart from a run's flags of the same
//! name (`--json`, `--warmup`, `--step-duration` mean other things there), since one
//! environment serves every command. The load each step offers (targets, workload, connections,
//! the pacer) is the command's own: it flattens these beside its load's flags, and checks
//! what only it knows (which rates its pacer can keep).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use rpcmesh_common::cli::{ConfigProblems, DurationArg};

use crate::search::Bounds;
use crate::slo::{DEFAULT_SLO, Slo};
use crate::step::Compared;

/// Measured length of each step unless told otherwise: 10 s, as a driver's `--steps` (a
/// queue settles in a few seconds, and thousands of requests give a steady p99).
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
/// The finest `--precision` worth asking for: below it the bisection's steps differ by
/// less than the noise of a rate, and the midpoint of two near rates can round to one of
/// them. (Advice: validation takes any precision above zero.)
pub const MIN_PRECISION: f64 = 1e-3;
/// The whole experiment's time budget: a search, a comparison and a sweep at the default
/// step length fit well within it; a step that would end beyond it is not started.
pub const DEFAULT_TIME_LIMIT: Duration = Duration::from_secs(30 * 60);
/// The closed-loop sweep's users unless told otherwise: doubling from 1 to 256, enough
/// points around a typical peak for the USL's three parameters.
pub const DEFAULT_SWEEP: &str = "1,2,4,8,16,32,64,128,256";

/// The planner's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// What a step must meet: latency percentiles of requests (from their intended start)
    /// and errors (failed or unsent requests, a share of those due), e.g.
    /// 'p99<=20ms,p99.9<=50ms,errors<=0.1%'.
    #[arg(long, env = "RPCMESH_CAPACITY_SLO", default_value = DEFAULT_SLO)]
    pub slo: Slo,
    /// Measured length of each step.
    #[arg(long, env = "RPCMESH_CAPACITY_STEP_DURATION", default_value_t = DurationArg(DEFAULT_STEP))]
    pub step_duration: DurationArg,
    /// Unmeasured lead-in of each step.
    #[arg(long, env = "RPCMESH_CAPACITY_WARMUP", default_value_t = DurationArg(DEFAULT_STEP_WARMUP))]
    pub warmup: DurationArg,
    /// First rate offered, requests per second.
    #[arg(long, env = "RPCMESH_CAPACITY_START_RATE", default_value_t = DEFAULT_START_RATE)]
    pub start_rate: f64,
    /// Lowest rate tried when the start rate fails.
    #[arg(long, env = "RPCMESH_CAPACITY_MIN_RATE", default_value_t = DEFAULT_MIN_RATE)]
    pub min_rate: f64,
    /// Highest rate offered.
    #[arg(long, env = "RPCMESH_CAPACITY_MAX_RATE", default_value_t = DEFAULT_MAX_RATE)]
    pub max_rate: f64,
    /// Factor between growing steps.
    #[arg(long, env = "RPCMESH_CAPACITY_GROWTH", default_value_t = DEFAULT_GROWTH)]
    pub growth: f64,
    /// Stop bisecting when the failing rate is within this fraction of the passing one.
    #[arg(long, env = "RPCMESH_CAPACITY_PRECISION", default_value_t = DEFAULT_PRECISION)]
    pub precision: f64,
    /// Time budget of the whole experiment; no step starts that would end after it.
    #[arg(long, env = "RPCMESH_CAPACITY_TIME_LIMIT", default_value_t = DurationArg(DEFAULT_TIME_LIMIT))]
    pub time_limit: DurationArg,
    /// Search with compression off and on, interleaving their steps, and compare.
    #[arg(
        long,
        env = "RPCMESH_CAPACITY_COMPARE_COMPRESSION",
        conflicts_with = "compare_tls"
    )]
    pub compare_compression: bool,
    /// Search with TLS off and on, interleaving their steps, and compare (what the load
    /// needs for each is the command's: see its TLS flags).
    #[arg(long, env = "RPCMESH_CAPACITY_COMPARE_TLS")]
    pub compare_tls: bool,
    /// Closed-loop users of the scalability sweep (fitted with the USL), or `off`.
    #[arg(long, env = "RPCMESH_CAPACITY_SWEEP", default_value = DEFAULT_SWEEP)]
    pub sweep: SweepArg,
}

/// Where the report is written, beside the text on stdout.
#[derive(Debug, Clone, clap::Args)]
pub struct OutputArgs {
    /// Write the report as JSON (schema: docs/capacity.schema.json).
    #[arg(long, env = "RPCMESH_CAPACITY_JSON")]
    pub json: Option<PathBuf>,
    /// Write the report as Markdown.
    #[arg(long, env = "RPCMESH_CAPACITY_MARKDOWN")]
    pub markdown: Option<PathBuf>,
    /// Write the report as HTML, with charts.
    #[arg(long, env = "RPCMESH_CAPACITY_HTML")]
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

/// The experiment, validated: what is searched for and how, apart from the load itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
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
    /// What to search with off and on, and compare (none: one search).
    pub compare: Option<Compared>,
    /// The sweep's users (empty: no sweep).
    pub sweep: Vec<usize>,
}

impl PlanArgs {
    /// The three rates of the search (`--start-rate`, `--min-rate`, `--max-rate`) with
    /// their flags' names: each must also be one the runner can offer.
    pub fn rates(&self) -> [(&'static str, f64); 3] {
        [
            ("--start-rate", self.start_rate),
            ("--min-rate", self.min_rate),
            ("--max-rate", self.max_rate),
        ]
    }

    /// The plan these flags describe; every problem goes to `p`.
    pub fn plan(&self, p: &mut ConfigProblems) -> Plan {
        for (name, r) in self.rates() {
            p.check(!(r.is_finite() && r > 0.0), || {
                format!("{name} must be above zero")
            });
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
        Plan {
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
            compare: if self.compare_tls {
                Some(Compared::Tls)
            } else if self.compare_compression {
                Some(Compared::Compression)
            } else {
                None
            },
            sweep: self.sweep.0.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    fn plan(args: &[&str]) -> Result<Plan, ConfigProblems> {
        let cli = Cli::parse_from(std::iter::once("capacity").chain(args.iter().copied()));
        let mut p = ConfigProblems::default();
        let plan = cli.plan.plan(&mut p);
        p.into_result(plan)
    }

    #[test]
    fn no_flags_give_the_documented_defaults() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.slo, Slo::default());
        assert_eq!(p.step, DEFAULT_STEP);
        assert_eq!(p.warmup, DEFAULT_STEP_WARMUP);
        assert_eq!(p.time_limit, DEFAULT_TIME_LIMIT);
        assert_eq!(p.bounds.start, DEFAULT_START_RATE);
        assert_eq!(p.sweep, [1, 2, 4, 8, 16, 32, 64, 128, 256]);
        assert_eq!(p.compare, None);
        assert_eq!(
            plan(&["--compare-tls"]).unwrap().compare,
            Some(Compared::Tls)
        );
    }

    #[test]
    fn problems_are_listed_together() {
        let e = plan(&[
            "--start-rate",
            "0",
            "--min-rate",
            "10",
            "--max-rate",
            "5",
            "--growth",
            "1",
            "--step-duration",
            "0s",
        ])
        .unwrap_err();
        assert_eq!(e.0.len(), 4, "{e}");
    }

    #[test]
    fn the_sweep_takes_users_or_off() {
        assert_eq!("off".parse::<SweepArg>(), Ok(SweepArg(Vec::new())));
        assert_eq!("1, 4".parse::<SweepArg>(), Ok(SweepArg(vec![1, 4])));
        assert!("0,2".parse::<SweepArg>().is_err());
        assert!("x".parse::<SweepArg>().is_err());
    }
}
