//! The capacity report: what a search, a sweep and a comparison measured, as data (JSON,
//! with a schema) and as text and Markdown for people. The HTML report with charts is
//! [`super::html`]'s.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::slo::Slo;
use super::usl::UslFit;
use crate::stats::LatencySummary;

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
    /// One search for the highest rate under the SLO; two with `--compare-compression`
    /// (compression off first, then on).
    pub searches: Vec<Search>,
    /// With `--compare-compression`: the two searches side by side.
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
    /// With `--compare-compression`: both settings at one common rate, for p99 at it.
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

/// The search for the highest rate under the SLO with one compression setting.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Search {
    /// Request compression on.
    pub compression: bool,
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

/// Compression off against on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Comparison {
    /// Capacity without compression, requests per second.
    pub capacity_off: Option<f64>,
    /// Capacity with compression, requests per second.
    pub capacity_on: Option<f64>,
    /// (on − off) ÷ off, percent.
    pub capacity_change_percent: Option<f64>,
    /// The rate both were run at for the figures below (the lower capacity).
    pub common_rate: Option<f64>,
    /// Request p99 at the common rate, ms, off and on.
    pub p99_ms_off: Option<f64>,
    /// As `p99_ms_off`, with compression.
    pub p99_ms_on: Option<f64>,
    /// Wire bytes per call at the common rate (both ways), off.
    pub bytes_per_call_off: Option<f64>,
    /// Wire bytes per call at the common rate (both ways), on.
    pub bytes_per_call_on: Option<f64>,
    /// CPU µs per call at the common rate, by role, off.
    pub cpu_us_per_call_off: BTreeMap<String, f64>,
    /// CPU µs per call at the common rate, by role, on.
    pub cpu_us_per_call_on: BTreeMap<String, f64>,
    /// One line: what compression does to capacity on this path.
    pub verdict: String,
}

/// The closed-loop concurrency sweep.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Sweep {
    /// Request compression on.
    pub compression: bool,
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

/// A table, rendered aligned for a terminal or as Markdown.
struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(headers: &[&str]) -> Self {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn text(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::from(" ");
            for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
                let pad = w - c.chars().count();
                // The first column (a label) to the left, figures to the right.
                if i == 0 {
                    s.push_str(c);
                    s.push_str(&" ".repeat(pad));
                } else {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                }
                s.push_str("  ");
            }
            s.trim_end().to_string() + "\n"
        };
        let mut out = line(&self.headers);
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }

    fn markdown(&self) -> String {
        let mut out = format!("| {} |\n", self.headers.join(" | "));
        out.push('|');
        for i in 0..self.headers.len() {
            out.push_str(if i == 0 { "---|" } else { "---:|" });
        }
        out.push('\n');
        for r in &self.rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        out
    }
}

/// The roles whose CPU the report shows, in path order.
pub const ROLES: [&str; 3] = ["driver", "broker", "provider"];

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

fn rate(v: f64) -> String {
    crate::report::thousands(v)
}

fn setting(compression: bool) -> &'static str {
    if compression {
        "compression on"
    } else {
        "compression off"
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

impl Search {
    fn table(&self) -> Table {
        let mut t = Table::new(&[
            "step",
            "offered/s",
            "achieved/s",
            "calls/s",
            "p50 ms",
            "p99 ms",
            "p99.9 ms",
            "errors",
            "B out/call",
            "B in/call",
            "µs/call driver",
            "broker",
            "(polling)",
            "provider",
            "softirq",
            "SLO",
        ]);
        for s in &self.steps {
            let cpu = |r: &str| opt(s.cpu_us_per_call.get(r).copied(), |v| format!("{v:.1}"));
            let softirq = s
                .softirq_share
                .values()
                .copied()
                .reduce(f64::max)
                .map_or("-".into(), |v| format!("{:.1}%", v * 100.0));
            t.row(vec![
                s.phase.name().to_string(),
                rate(s.offered),
                rate(s.achieved),
                rate(s.calls_per_second),
                crate::report::ms(s.latency.p50_ms),
                crate::report::ms(s.latency.p99_ms),
                crate::report::ms(s.latency.p999_ms),
                format!("{:.3}%", s.error_ratio * 100.0),
                format!("{:.0}", s.bytes_out_per_call),
                format!("{:.0}", s.bytes_in_per_call),
                cpu("driver"),
                cpu("broker"),
                opt(s.idle_poll_us_per_call.get("broker").copied(), |v| {
                    format!("{v:.1}")
                }),
                cpu("provider"),
                softirq,
                if s.pass {
                    "pass".into()
                } else {
                    format!("FAIL: {}", s.broken.join("; "))
                },
            ]);
        }
        t
    }

    /// One line: the capacity found and how the search ended.
    pub fn summary(&self) -> String {
        let cap = match self.capacity {
            Some(c) => format!("{} requests/s", rate(c)),
            None => "none found".into(),
        };
        let fail = opt(self.lowest_failing, |f| format!("{} requests/s", rate(f)));
        format!(
            "{}: capacity {cap} (lowest failing {fail}; ended by {})",
            setting(self.compression),
            self.ended_by
        )
    }
}

impl Sweep {
    fn table(&self) -> Table {
        let mut t = Table::new(&[
            "users",
            "requests/s",
            "calls/s",
            "p50 ms",
            "p99 ms",
            "errors",
            "USL fit/s",
            "cores driver",
            "broker",
            "provider",
        ]);
        for p in &self.points {
            let cores = |r: &str| opt(p.cpu_cores.get(r).copied(), |v| format!("{v:.2}"));
            t.row(vec![
                p.users.to_string(),
                rate(p.throughput),
                rate(p.calls_per_second),
                crate::report::ms(p.latency.p50_ms),
                crate::report::ms(p.latency.p99_ms),
                format!("{:.3}%", p.error_ratio * 100.0),
                opt(self.fit.map(|f| f.throughput(p.users as f64)), rate),
                cores("driver"),
                cores("broker"),
                cores("provider"),
            ]);
        }
        t
    }

    /// The fit in one line.
    pub fn fit_line(&self) -> String {
        match (&self.fit, &self.fit_error) {
            (Some(f), _) => {
                let peak = match (f.peak_users, f.peak_throughput) {
                    (Some(n), Some(x)) => {
                        format!("peak {} requests/s at {n:.0} users", rate(x))
                    }
                    _ => "no peak (κ ≤ 0: throughput levels off instead of falling)".into(),
                };
                let bound = if f.constrained {
                    " (held at the σ ≥ 0, κ ≥ 0 bound: the unconstrained fit was unphysical)"
                } else {
                    ""
                };
                format!(
                    "USL fit: σ {:.4} (contention), κ {:.6} (coherency), X(1) {} requests/s, R² {:.4}{bound}; {peak}",
                    f.sigma,
                    f.kappa,
                    rate(f.x1),
                    f.r_squared
                )
            }
            (None, Some(e)) => format!("no USL fit: {e}"),
            (None, None) => "no USL fit".into(),
        }
    }
}

impl Comparison {
    fn table(&self) -> Table {
        let mut t = Table::new(&["", "compression off", "compression on"]);
        t.row(vec![
            "capacity, requests/s".into(),
            opt(self.capacity_off, rate),
            opt(self.capacity_on, rate),
        ]);
        let at = opt(self.common_rate, rate);
        t.row(vec![
            format!("p99 ms at {at}/s"),
            opt(self.p99_ms_off, crate::report::ms),
            opt(self.p99_ms_on, crate::report::ms),
        ]);
        t.row(vec![
            "wire bytes per call".into(),
            opt(self.bytes_per_call_off, |v| format!("{v:.0}")),
            opt(self.bytes_per_call_on, |v| format!("{v:.0}")),
        ]);
        for role in ROLES {
            t.row(vec![
                format!("{role} CPU µs per call"),
                opt(self.cpu_us_per_call_off.get(role).copied(), |v| {
                    format!("{v:.1}")
                }),
                opt(self.cpu_us_per_call_on.get(role).copied(), |v| {
                    format!("{v:.1}")
                }),
            ]);
        }
        t
    }
}

impl CapacityReport {
    fn header(&self) -> String {
        let s = &self.setup;
        let target = if s.local_mesh {
            "a local broker and provider (child processes)".to_string()
        } else {
            s.targets.join(", ")
        };
        format!(
            "{} workload, {} calls per request{}, at most {} requests in flight over {} connections, against {target}; steps of {:.0} s after {:.0} s warm-up; SLO {}",
            s.workload,
            s.fanout,
            if s.parallel { " at once" } else { " in a row" },
            s.concurrency,
            s.connections,
            s.step_seconds,
            s.warmup_seconds,
            self.slo
        )
    }

    /// The report for a terminal.
    pub fn render_text(&self) -> String {
        self.render(false)
    }

    /// The report as Markdown.
    pub fn render_markdown(&self) -> String {
        self.render(true)
    }

    /// Text and Markdown differ only in how headings, tables and notes look.
    fn render(&self, md: bool) -> String {
        let mut out = if md {
            format!(
                "# rpcmesh capacity {}\n\n{}.\n",
                self.version,
                self.header()
            )
        } else {
            format!("rpcmesh capacity {}\n{}\n", self.version, self.header())
        };
        let mut section = |title: String, table: Option<Table>, note: &str| {
            if md {
                out.push_str(&format!("\n## {title}\n\n"));
            } else {
                out.push_str(&format!("\n{title}\n"));
            }
            if let Some(t) = table {
                out.push_str(&if md { t.markdown() } else { t.text() });
            }
            if md {
                out.push_str(&format!("\n{note}.\n"));
            } else {
                out.push_str(&format!(" {note}\n"));
            }
        };
        for s in &self.searches {
            section(
                format!("Search, {}", setting(s.compression)),
                Some(s.table()),
                &s.summary(),
            );
        }
        if let Some(c) = &self.comparison {
            section(
                "Compression off against on".into(),
                Some(c.table()),
                &c.verdict,
            );
        }
        if let Some(w) = &self.sweep {
            let title = format!("Closed-loop sweep, {}", setting(w.compression));
            section(title, Some(w.table()), &w.fit_line());
        }
        if let Some(why) = &self.stopped_early {
            section("Ended early".into(), None, why);
        }
        if !md {
            out.push_str(&format!("\n{:.0} s in all\n", self.elapsed_seconds));
        }
        out
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
    /// (`RPCMESH_WRITE_SCHEMA=1 cargo test -p rpcmesh-driver capacity_schema` rewrites it).
    #[test]
    fn the_capacity_schema_doc_is_current() {
        let schema = CapacityReport::schema();
        if std::env::var_os("RPCMESH_WRITE_SCHEMA").is_some() {
            std::fs::write(SCHEMA_DOC, &schema).unwrap();
        }
        let doc = std::fs::read_to_string(SCHEMA_DOC).unwrap_or_default();
        assert!(
            doc == schema,
            "docs/capacity.schema.json is stale: run RPCMESH_WRITE_SCHEMA=1 cargo test -p rpcmesh-driver capacity_schema"
        );
    }

    #[test]
    fn tables_align_and_render_as_markdown() {
        let mut t = Table::new(&["a", "bb"]);
        t.row(vec!["x".into(), "1,000".into()]);
        assert_eq!(t.text(), " a     bb\n x  1,000\n");
        assert_eq!(t.markdown(), "| a | bb |\n|---|---:|\n| x | 1,000 |\n");
    }
}
