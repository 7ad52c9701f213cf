//! The driver's side of a capacity step: a driver run (open loop at one rate, or closed
//! loop with N users) with every program on the path read at the start and at the end of
//! its measured window (CPU time of each process, the host's softirq time), handed to the
//! planner as its [`Measured`] figures. [`Runner`] is the planner's [`StepRunner`]: each
//! step blocks on the driver's runtime until its last reply.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use rpcmesh_capacity::step::{Calls, CpuUse, Requests};
use rpcmesh_capacity::{Measured, Setting, StepRunner};
use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_wire::compress::CompressionConfig;

use super::config::PlainPath;
use super::probe::{self, Reading};
use crate::config::{DriverConfig, ProgressMode, Stop};
use crate::pacer::Schedule;
use crate::progress::say;
use crate::report::Report;
use crate::stats::LatencySummary;

/// The role the driver's own readings are filed under.
pub const DRIVER: &str = "driver";

/// How the driver runs a capacity step.
#[derive(Debug)]
pub struct Runner<'a> {
    /// The runtime every step runs on.
    pub rt: &'a tokio::runtime::Runtime,
    /// The load (targets, workload, connections, ...).
    pub load: DriverConfig,
    /// Compression when on.
    pub compression_on: CompressionConfig,
    /// Measured length.
    pub step: Duration,
    /// Lead-in.
    pub warmup: Duration,
    /// `/metrics` endpoints by role.
    pub probes: Vec<(String, SocketAddr)>,
    /// With `--compare-tls`: the plaintext path, taken by steps with TLS off (the load's
    /// own targets and probes are then the TLS path).
    pub plain: Option<PlainPath>,
    /// Ctrl-C: ends the step under way, and the experiment.
    pub stop: CancellationToken,
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

impl Runner<'_> {
    /// Runs `config` (whose schedule or concurrency the caller set) for one step.
    async fn run(
        &self,
        mut config: DriverConfig,
        probes: &[(String, SocketAddr)],
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
        let probes_now = probes.to_vec();
        let warmup = self.warmup;
        let first = tokio::spawn(async move {
            tokio::time::sleep(warmup).await;
            read_all(&probes_now).await
        });
        let report = crate::run_with(config, Telemetry::discard(), self.stop.clone()).await?;
        let last = read_all(probes).await;
        let first = first.await?;
        let mut cpu = CpuUse::default();
        for ((role, a), (_, b)) in first.iter().zip(&last) {
            let (Some(a), Some(b)) = (a, b) else { continue };
            *cpu.seconds.entry(role.clone()).or_insert(0.0) += a.cpu_seconds(b);
            let idle = a.idle_polling(b);
            if idle > 0.0 {
                *cpu.idle_polling.entry(role.clone()).or_insert(0.0) += idle;
            }
            *cpu.cores.entry(role.clone()).or_insert(0.0) += a.cores(b);
            if let Some(s) = a.softirq_share(b) {
                cpu.softirq.entry(role.clone()).or_insert(s);
            }
        }
        Ok(Measured {
            cpu,
            ..Measured::from(&report)
        })
    }

    /// The load of a step with `setting`, and the programs to read: compression on or
    /// off, and with TLS off under `--compare-tls` the plaintext path.
    fn load(&self, setting: Setting) -> (DriverConfig, &[(String, SocketAddr)]) {
        let mut c = self.load.clone();
        c.compression = setting.compression.then_some(self.compression_on);
        match &self.plain {
            Some(plain) if !setting.tls => {
                c.targets = plain.targets.clone();
                c.tls = None;
                (c, &plain.probes)
            }
            _ => (c, &self.probes),
        }
    }
}

impl StepRunner for Runner<'_> {
    type Error = anyhow::Error;

    fn open(&mut self, rate: f64, setting: Setting) -> anyhow::Result<Measured> {
        let (mut c, probes) = self.load(setting);
        c.schedule = Some(Schedule::Constant(rate));
        self.rt.block_on(self.run(c, probes))
    }

    fn closed(&mut self, users: usize, setting: Setting) -> anyhow::Result<Measured> {
        let (mut c, probes) = self.load(setting);
        c.schedule = None;
        c.concurrency = users;
        c.connections = c.connections.min(users);
        self.rt.block_on(self.run(c, probes))
    }

    fn stopped(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// A step's last replies may take up to the call timeout after its window (when it is
    /// beyond capacity), and its two readings up to a scrape timeout each.
    fn overrun(&self) -> Duration {
        self.load.call_timeout + 2 * probe::SCRAPE_TIMEOUT
    }

    fn say(&mut self, line: fmt::Arguments<'_>) {
        say!("{line}");
    }
}

impl From<LatencySummary> for rpcmesh_capacity::report::LatencySummary {
    fn from(l: LatencySummary) -> Self {
        rpcmesh_capacity::report::LatencySummary {
            count: l.count,
            mean_ms: l.mean_ms,
            p50_ms: l.p50_ms,
            p90_ms: l.p90_ms,
            p99_ms: l.p99_ms,
            p999_ms: l.p999_ms,
            p9999_ms: l.p9999_ms,
            max_ms: l.max_ms,
        }
    }
}

/// A run's figures as a step's, without the CPU (the probes' part).
impl From<&Report> for Measured {
    fn from(r: &Report) -> Self {
        Measured {
            seconds: r.measured_seconds,
            requests: Requests {
                due: r.requests.due,
                completed: r.requests.completed,
                ok: r.requests.ok,
                failed: r.requests.failed,
                not_sent: r.requests.not_sent,
                latency: r.requests.latency.into(),
                latency_uncorrected: r.requests.latency_uncorrected.map(Into::into),
            },
            calls: Calls {
                sent: r.calls.sent,
                ok: r.calls.ok,
                ok_per_second: r.calls.ok_per_second,
                errors: r.calls.errors.clone(),
            },
            wire_out: r.bytes.wire_out,
            wire_in: r.bytes.wire_in,
            cpu: CpuUse::default(),
        }
    }
}
