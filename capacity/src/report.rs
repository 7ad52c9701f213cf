//! The capacity report as data: what the searches, the comparison and the sweep measured,
//! as it is written in JSON, and the JSON Schema of that (docs/capacity.schema.json, kept
//! current by a test). Shown to people by [`crate::text`] and [`crate::html`].

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::slo::Slo;
use crate::step::{Compared, Setting};
use crate::usl::UslFit;

/// Everything `driver capacity` measured.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct CapacityReport {
    /// rpcmesh version that produced it.
    pub version: String,
    /// Unix time the experiment started, seconds.
    pub started_unix: u64,
    /// What was run.
    pub setup: CapacitySetup,
    /// The service-level objective every step was judged by.
    pub slo: Slo,
    /// One search for the highest rate under the SLO; two with `--compare-compression` or
    /// `--compare-tls` (the setting off first, then on).
    pub searches: Vec<Search>,
    /// With `--compare-compression` or `--compare-tls`: the two searches side by side.
    pub comparison: Option<Comparison>,
    /// The closed-loop concurrency sweep and its Universal Scalability Law fit (absent
    /// with `--sweep off`).
    pub sweep: Option<Sweep>,
    /// Wall-clock time of the whole experiment, seconds.
    pub elapsed_seconds: f64,
    /// Why the experiment ended before it was complete (time limit, Ctrl-C), if it did.
    pub stopped_early: Option<String>,
}

/// How the experiment was set up.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct CapacitySetup {
    /// `platform` or `echo`.
    pub workload: String,
    /// Echo message size (echo only).
    pub payload_size: usize,
    /// Calls per request.
    pub fanout: u32,
    /// Calls of a request made at once.
    pub parallel: bool,
    /// Open-loop steps: most requests in flight at once.
    pub concurrency: usize,
    /// Connections the driver spreads its requests over.
    pub connections: usize,
    /// Targets called.
    pub targets: Vec<String>,
    /// True when the driver started its own provider and broker (as child processes).
    pub local_mesh: bool,
    /// The local provider's service time (`--service-work`), if any.
    pub service_work: Option<String>,
    /// Measured length of each step, seconds.
    pub step_seconds: f64,
    /// Unmeasured lead-in of each step, seconds.
    pub warmup_seconds: f64,
    /// First offered rate of a search, requests per second.
    pub start_rate: f64,
    /// Highest rate a search offers, requests per second.
    pub max_rate: f64,
    /// Factor between growing steps.
    pub growth: f64,
    /// A search ends when its failing rate is within this fraction above its passing one.
    pub precision: f64,
    /// The experiment's time budget, seconds.
    pub time_limit_seconds: f64,
    /// The `/metrics` endpoints read for CPU and softirq figures.
    pub probes: Vec<ProbeSetup>,
}

/// A `/metrics` endpoint of a program on the path.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct ProbeSetup {
    /// `broker` or `provider`.
    pub role: String,
    /// Where its `/metrics` was read (HOST:PORT).
    pub address: String,
}

/// Why a step was run.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Growing geometrically until the SLO fails.
    Grow,
    /// Halving the gap between the highest passing and the lowest failing rate.
    Bisect,
    /// A second run at the highest passing rate, which it must pass again.
    Confirm,
    /// With a comparison: both settings at one common rate, for p99 at it.
    Common,
}

/// One open-loop step at one offered rate.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Step {
    /// Why it was run.
    pub phase: Phase,
    /// Offered rate, requests per second.
    pub offered: f64,
    /// Requests completed with every call successful, per second.
    pub achieved: f64,
    /// Successful calls per second.
    pub calls_per_second: f64,
    /// Requests due on the schedule in the measured window.
    pub due: u64,
    /// Requests completed with every call successful.
    pub ok: u64,
    /// Requests that completed with at least one failed call.
    pub failed: u64,
    /// Requests never sent (every slot busy and the backlog full).
    pub not_sent: u64,
    /// Request latency from the intended start (corrected for coordinated omission), ms.
    pub latency: LatencySummary,
    /// Request latency from the actual start (uncorrected), ms: for comparison only.
    pub latency_uncorrected: LatencySummary,
    /// Failed calls by outcome (`timeout`, `overloaded`, `no_reply`, ...).
    pub errors: BTreeMap<String, u64>,
    /// Requests due that did not complete successfully (failed or not sent), ÷ due.
    pub error_ratio: f64,
    /// Bytes the driver wrote per call (frames, as on the wire).
    pub bytes_out_per_call: f64,
    /// Bytes the driver read per call.
    pub bytes_in_per_call: f64,
    /// CPU time per successful call of each process on the path, µs, by role (`driver`,
    /// `broker`, `provider`).
    pub cpu_us_per_call: BTreeMap<String, f64>,
    /// Of `cpu_us_per_call`, the µs a busy-polling program (the broker with one worker
    /// thread) spent polling with nothing to read: CPU it takes only because it is idle,
    /// which shrinks as the rate grows. By role, only for roles that poll.
    #[serde(default)]
    pub idle_poll_us_per_call: BTreeMap<String, f64>,
    /// CPU used by each process on the path, cores, by role.
    pub cpu_cores: BTreeMap<String, f64>,
    /// Share of the host's CPU time spent in softirq, by the role whose host it was read
    /// from (0 to 1).
    pub softirq_share: BTreeMap<String, f64>,
    /// True when the step met the SLO.
    pub pass: bool,
    /// What broke the SLO (empty when it passed).
    pub broken: Vec<String>,
}

/// The search for the highest rate under the SLO with one setting.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Search {
    /// Request compression on.
    pub compression: bool,
    /// The load spoke TLS.
    #[serde(default)]
    pub tls: bool,
    /// Its steps in the order they ran (confirmation and common-rate steps included).
    pub steps: Vec<Step>,
    /// The highest rate that met the SLO and met it again when confirmed, requests per
    /// second; `None` when nothing passed down to the minimum rate, or the search was cut
    /// short before a confirmation.
    pub capacity: Option<f64>,
    /// The lowest rate that broke the SLO; `None` when none did up to `max_rate`.
    pub lowest_failing: Option<f64>,
    /// How the search ended: `slo` (bracketed within the precision and confirmed),
    /// `max_rate` (every rate passed, the maximum confirmed), `nothing_passed` (down to the
    /// minimum rate), `time` (the time budget) or `stopped` (Ctrl-C, or a step failed).
    pub ended_by: String,
}

/// A setting (compression or TLS) off against on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Comparison {
    /// What was turned off and on.
    #[serde(default)]
    pub compared: Compared,
    /// Capacity with the setting off, requests per second.
    pub capacity_off: Option<f64>,
    /// Capacity with the setting on, requests per second.
    pub capacity_on: Option<f64>,
    /// (on − off) ÷ off, percent.
    pub capacity_change_percent: Option<f64>,
    /// The rate both were run at for the figures below (the lower capacity).
    pub common_rate: Option<f64>,
    /// Request p99 at the common rate, ms, off and on.
    pub p99_ms_off: Option<f64>,
    /// As `p99_ms_off`, with the setting on.
    pub p99_ms_on: Option<f64>,
    /// Wire bytes per call at the common rate (both ways), off.
    pub bytes_per_call_off: Option<f64>,
    /// Wire bytes per call at the common rate (both ways), on.
    pub bytes_per_call_on: Option<f64>,
    /// CPU µs per call at the common rate, by role, off.
    pub cpu_us_per_call_off: BTreeMap<String, f64>,
    /// CPU µs per call at the common rate, by role, on.
    pub cpu_us_per_call_on: BTreeMap<String, f64>,
    /// One line: what the setting does to capacity on this path.
    pub verdict: String,
}

/// The closed-loop concurrency sweep.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Sweep {
    /// Request compression on.
    pub compression: bool,
    /// The load spoke TLS.
    #[serde(default)]
    pub tls: bool,
    /// One point per number of users, in the order run.
    pub points: Vec<SweepPoint>,
    /// The Universal Scalability Law fitted to the points' throughput.
    pub fit: Option<UslFit>,
    /// Why there is no fit, when there is none.
    pub fit_error: Option<String>,
}

/// One closed-loop run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct SweepPoint {
    /// Users (closed-loop callers).
    pub users: usize,
    /// Requests completed successfully per second.
    pub throughput: f64,
    /// Successful calls per second.
    pub calls_per_second: f64,
    /// Request latency, ms.
    pub latency: LatencySummary,
    /// Requests that failed ÷ completed.
    pub error_ratio: f64,
    /// CPU used by each process on the path, cores, by role.
    pub cpu_cores: BTreeMap<String, f64>,
}

/// Percentiles of a latency histogram, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// 99.99th percentile.
    pub p9999_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl Search {
    /// Its settings.
    pub fn setting(&self) -> Setting {
        Setting {
            compression: self.compression,
            tls: self.tls,
        }
    }
}

impl Sweep {
    /// Its settings.
    pub fn setting(&self) -> Setting {
        Setting {
            compression: self.compression,
            tls: self.tls,
        }
    }
}

impl Phase {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Grow => "grow",
            Phase::Bisect => "bisect",
            Phase::Confirm => "confirm",
            Phase::Common => "common",
        }
    }
}

impl CapacityReport {
    /// What the comparison turned off and on (compression when there is none).
    pub fn compared(&self) -> Compared {
        self.comparison
            .as_ref()
            .map_or(Compared::default(), |c| c.compared)
    }

    /// The search with the compared setting `on` (or off), if the report has it.
    pub fn search(&self, on: bool) -> Option<&Search> {
        let what = self.compared();
        self.searches.iter().find(|s| s.setting().is_on(what) == on)
    }

    /// The JSON Schema of the report (written to docs/capacity.schema.json).
    pub fn schema() -> String {
        let schema = schemars::schema_for!(CapacityReport);
        serde_json::to_string_pretty(&schema).unwrap_or_default() + "\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEMA_DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/capacity.schema.json");

    /// docs/capacity.schema.json is the schema of the report as the code has it
    /// (`RPCMESH_WRITE_SCHEMA=1 cargo test -p rpcmesh-capacity capacity_schema` rewrites it).
    #[test]
    fn the_capacity_schema_doc_is_current() {
        let schema = CapacityReport::schema();
        if std::env::var_os("RPCMESH_WRITE_SCHEMA").is_some() {
            std::fs::write(SCHEMA_DOC, &schema).unwrap();
        }
        let doc = std::fs::read_to_string(SCHEMA_DOC).unwrap_or_default();
        assert!(
            doc == schema,
            "docs/capacity.schema.json is stale: run RPCMESH_WRITE_SCHEMA=1 cargo test -p rpcmesh-capacity capacity_schema"
        );
    }
}
