//! One capacity step: a driver run (open loop at one rate, or closed loop with N users),
//! with every program on the path read at the start and at the end of its measured window
//! (CPU time of each process, the host's softirq time), turned into the step's figures.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::net::shutdown::CancellationToken;

use super::probe::{self, Reading};
use super::report::{Phase, Step, SweepPoint};
use super::slo::Slo;
use crate::config::{DriverConfig, ProgressMode, Stop};
use crate::pacer::Schedule;
use crate::report::Report;

/// The role the driver's own readings are filed under.
pub const DRIVER: &str = "driver";

/// A run and the CPU of each role from the start of its measured window until its last
/// reply: all the work its measured requests caused, even those still queued when the
/// window closed (as they are when the step is beyond capacity).
#[derive(Debug)]
pub struct Measured {
    /// The driver's report of the run.
    pub report: Report,
    /// CPU seconds used, by role (summed over a role's endpoints).
    pub cpu_seconds: BTreeMap<String, f64>,
    /// Of those, seconds spent busy polling with nothing to read, by role (only roles that
    /// did).
    pub idle_polling: BTreeMap<String, f64>,
    /// Cores used on average over that time, by role.
    pub cores: BTreeMap<String, f64>,
    /// Host softirq share, by role (of its first endpoint).
    pub softirq: BTreeMap<String, f64>,
}

/// How a step is run.
#[derive(Debug, Clone)]
pub struct Runner {
    /// The load (targets, workload, connections, ...).
    pub load: DriverConfig,
    /// Measured length.
    pub step: Duration,
    /// Lead-in.
    pub warmup: Duration,
    /// `/metrics` endpoints by role.
    pub probes: Vec<(String, SocketAddr)>,
}

async fn read_all(probes: &[(String, SocketAddr)]) -> Vec<(String, Option<Reading>)> {
    // /proc reads (the fd listing among them) are file I/O: off the runtime's threads.
    let own = tokio::task::spawn_blocking(probe::own).await.ok();
    let mut out = vec![(DRIVER.to_string(), own)];
    for (role, addr) in probes {
        match probe::scrape(*addr).await {
            Ok(r) => out.push((role.clone(), Some(r))),
            Err(e) => {
                tracing::warn!(role = %role, error = %e, "a /metrics endpoint could not be read; its CPU is missing from this step");
                out.push((role.clone(), None));
            }
        }
    }
    out
}

impl Runner {
    /// Runs `config` (whose schedule or concurrency the caller set) for one step.
    pub async fn run(
        &self,
        mut config: DriverConfig,
        stop: &CancellationToken,
    ) -> anyhow::Result<Measured> {
        config.stop = Stop::Duration(self.step);
        config.warmup = self.warmup;
        config.progress = ProgressMode::Off;
        config.json = None;
        config.hdr_log = None;
        // Nothing serves the step's own metrics: do not time stages into a void.
        config.stage_sample = 0;
        // A reading when the measured window opens, taken while the run goes on; another
        // when the run has its last reply.
        let probes = self.probes.clone();
        let warmup = self.warmup;
        let first = tokio::spawn(async move {
            tokio::time::sleep(warmup).await;
            read_all(&probes).await
        });
        let report = crate::run_with(config, Telemetry::discard(), stop.clone()).await?;
        let last = read_all(&self.probes).await;
        let first = first.await?;
        let mut cpu_seconds = BTreeMap::new();
        let mut idle_polling = BTreeMap::new();
        let mut cores = BTreeMap::new();
        let mut softirq = BTreeMap::new();
        for ((role, a), (_, b)) in first.iter().zip(&last) {
            let (Some(a), Some(b)) = (a, b) else { continue };
            *cpu_seconds.entry(role.clone()).or_insert(0.0) += a.cpu_seconds(b);
            let idle = a.idle_polling(b);
            if idle > 0.0 {
                *idle_polling.entry(role.clone()).or_insert(0.0) += idle;
            }
            *cores.entry(role.clone()).or_insert(0.0) += a.cores(b);
            if let Some(s) = a.softirq_share(b) {
                softirq.entry(role.clone()).or_insert(s);
            }
        }
        Ok(Measured {
            report,
            cpu_seconds,
            idle_polling,
            cores,
            softirq,
        })
    }

    /// An open-loop step at `rate` requests per second.
    pub async fn open(
        &self,
        rate: f64,
        compression: Option<rpcmesh_wire::compress::CompressionConfig>,
        stop: &CancellationToken,
    ) -> anyhow::Result<Measured> {
        let mut c = self.load.clone();
        c.schedule = Some(Schedule::Constant(rate));
        c.compression = compression;
        self.run(c, stop).await
    }

    /// A closed-loop run with `users`.
    pub async fn closed(
        &self,
        users: usize,
        compression: Option<rpcmesh_wire::compress::CompressionConfig>,
        stop: &CancellationToken,
    ) -> anyhow::Result<Measured> {
        let mut c = self.load.clone();
        c.schedule = None;
        c.concurrency = users;
        c.connections = c.connections.min(users);
        c.compression = compression;
        self.run(c, stop).await
    }
}

/// CPU µs per successful call of each role.
fn per_call(cpu_seconds: &BTreeMap<String, f64>, calls: u64) -> BTreeMap<String, f64> {
    cpu_seconds
        .iter()
        .filter(|_| calls > 0)
        .map(|(k, v)| (k.clone(), v / calls as f64 * 1e6))
        .collect()
}

impl Step {
    /// The figures of an open-loop step, judged by `slo`.
    pub fn of(phase: Phase, offered: f64, m: &Measured, slo: &Slo) -> Step {
        let r = &m.report;
        let secs = r.measured_seconds.max(1e-9);
        let due = r
            .requests
            .due
            .max(r.requests.completed + r.requests.not_sent);
        let error_ratio = if due == 0 {
            1.0
        } else {
            due.saturating_sub(r.requests.ok) as f64 / due as f64
        };
        let calls_per_second = r.calls.ok_per_second;
        let sent = r.calls.sent.max(1) as f64;
        let latency = r.requests.latency;
        let mut broken = slo.broken(&latency, error_ratio);
        if r.requests.ok == 0 {
            broken.push("no request succeeded".into());
        }
        Step {
            phase,
            offered,
            achieved: r.requests.ok as f64 / secs,
            calls_per_second,
            due,
            ok: r.requests.ok,
            failed: r.requests.failed,
            not_sent: r.requests.not_sent,
            latency,
            latency_uncorrected: r.requests.latency_uncorrected.unwrap_or(latency),
            errors: r.calls.errors.clone(),
            error_ratio,
            bytes_out_per_call: r.bytes.wire_out as f64 / sent,
            bytes_in_per_call: r.bytes.wire_in as f64 / sent,
            cpu_us_per_call: per_call(&m.cpu_seconds, r.calls.ok),
            idle_poll_us_per_call: per_call(&m.idle_polling, r.calls.ok),
            cpu_cores: m.cores.clone(),
            softirq_share: m.softirq.clone(),
            pass: broken.is_empty(),
            broken,
        }
    }
}

impl SweepPoint {
    /// The figures of a closed-loop run with `users`.
    pub fn of(users: usize, m: &Measured) -> SweepPoint {
        let r = &m.report;
        let secs = r.measured_seconds.max(1e-9);
        let completed = r.requests.completed.max(1) as f64;
        SweepPoint {
            users,
            throughput: r.requests.ok as f64 / secs,
            calls_per_second: r.calls.ok_per_second,
            latency: r.requests.latency,
            error_ratio: r.requests.failed as f64 / completed,
            cpu_cores: m.cores.clone(),
        }
    }
}
