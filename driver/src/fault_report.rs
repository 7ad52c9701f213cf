//! `driver fault-report`: the fault lab's report (`scripts/faults`) from its runs. The
//! script writes what it did (`runs.json`: each run's driver report and interval log,
//! when its fault began and was repaired, wall-clock, and the broker's counts); this reads
//! each run's timeline from its report's steps, its phases' latency from its interval log
//! (the histograms of the seconds in a phase, added: exact percentiles), places the fault
//! in the measured window by the log's base time, and hands them to the report's maker
//! (`rpcmesh_capacity::faults`), which judges them against the runs' controls.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use rpcmesh_capacity::faults::{
    self, FaultReport, Interval, RunData, Shares, Which, WindowLatency,
};

use crate::hdr_log::{self, HdrLogError, Log};
use crate::report::Report;
use crate::stats::Latency;

/// The tag of the interval log's histograms that the phases' latency is read from: the
/// successful requests, from their intended start (the steps' figures are the same).
const LATENCY_TAG: &str = "requests";

/// What went wrong making the report.
#[derive(Debug, thiserror::Error)]
pub enum FaultReportError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A file is not what it should be.
    #[error("{path}: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An interval log could not be read.
    #[error(transparent)]
    Log(#[from] HdrLogError),
    /// The runs do not make a report.
    #[error(transparent)]
    Runs(#[from] faults::FaultReportError),
}

/// The script's account of its runs (`runs.json`).
#[derive(Debug, Deserialize)]
struct Runs {
    setup: serde_json::Value,
    runs: Vec<RawRun>,
}

/// One run, as the script made it.
#[derive(Debug, Deserialize)]
struct RawRun {
    name: String,
    /// The driver's JSON report.
    report: PathBuf,
    /// Its interval log.
    hdr_log: PathBuf,
    fault: Option<String>,
    control: Option<String>,
    /// When the fault began and was repaired, seconds since the Unix epoch.
    fault_start_unix: Option<f64>,
    fault_end_unix: Option<f64>,
    shares: Option<Shares>,
    ejections: Option<f64>,
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, FaultReportError> {
    let text = std::fs::read_to_string(path).map_err(|source| FaultReportError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| FaultReportError::Parse {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// A run's timeline: its report's steps.
fn timeline(r: &Report) -> Vec<Interval> {
    r.steps
        .iter()
        .map(|s| Interval {
            start_s: s.start_seconds,
            seconds: s.seconds,
            due: s.requests.due,
            ok: s.requests.ok,
            p99_ms: (s.requests.ok > 0).then_some(s.requests.latency.p99_ms),
        })
        .collect()
}

/// The latency of the successful requests logged in the seconds of `log` in phase
/// `which` of the fault `window` ([`Which::of`]).
fn window_latency(log: &Log, window: (f64, f64), which: Which) -> Option<WindowLatency> {
    let mut sum = Latency::default();
    let seconds = log.intervals.iter().filter(|i| {
        i.tag == LATENCY_TAG && Which::of(i.start, i.start + i.length, window) == which
    });
    for i in seconds {
        sum.add_histogram(&i.histogram).ok()?;
    }
    let s = sum.summary();
    Some((s.p50_ms, s.p99_ms, s.count))
}

/// The report of the runs `runs.json` at `path` lists.
pub fn make(path: &Path) -> Result<FaultReport, FaultReportError> {
    let raw: Runs = read_json(path)?;
    let mut runs = Vec::new();
    let mut logs = Vec::new();
    for r in &raw.runs {
        let report: Report = read_json(&r.report)?;
        let log = hdr_log::read(&r.hdr_log)?;
        let window = match (r.fault_start_unix, r.fault_end_unix) {
            (Some(a), Some(b)) => Some((a - log.base_unix, b - log.base_unix)),
            _ => None,
        };
        runs.push(RunData {
            name: r.name.clone(),
            fault: r.fault.clone(),
            control: r.control.clone(),
            window,
            timeline: timeline(&report),
            shares: r.shares,
            ejections: r.ejections,
        });
        logs.push((r.name.clone(), log));
    }
    let latency = |name: &str, window: (f64, f64), which: Which| {
        logs.iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, log)| window_latency(log, window, which))
    };
    Ok(faults::build(raw.setup, &runs, latency)?)
}
