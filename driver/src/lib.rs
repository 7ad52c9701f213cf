//! rpcmesh driver: the client and load generator. Users make fan-out requests (K calls
//! each, in a row or at once) over a few multiplexed connections to brokers or providers,
//! in a closed loop (each user's next request when its last ends) or an open one (requests
//! on a schedule, timed from their intended start); latencies go into HdrHistograms; a
//! line a second shows progress; the report comes as text and JSON, and an HdrHistogram
//! interval log on demand.
//!
//! - [`config`]: command line, defaults, validation.
//! - [`workload`]: the calls (platform query, echo).
//! - `dispatch`: the open loop's one timer task, handing each due request to a connection
//!   on the schedule of [`pacer`] (which also holds a connection's bounded backlog).
//! - `worker`: a share of the users, their connection and those it is draining: the
//!   engine (re-sending what a draining target refused unstarted), running
//!   - [`users`]: the users' request state machine,
//!   - `intake`: where requests come from (the users, or the pacer's schedule and a
//!     backlog),
//!   - `calls`: the calls issued and not yet ended, written or parked,
//!   - `links`: the connections' lifecycle (dialing, up, ending, given up; those
//!     draining),
//!   - [`connection`]: which target to dial next (fail-over in turn, a back-off per
//!     target) and the dialling;
//!
//!   and `shared`: what the run's workers share (the measured window, the figures they
//!   hand over, the finish line).
//! - [`outcome`]: how a call ended (typed: a reply's status, or the driver's own finding).
//! - [`failures`]: failed calls by outcome and by what their replies said, bounded.
//! - [`stats`]: histograms and counts, apart from I/O.
//! - [`metrics`]: the driver's Prometheus handles, fed from the workers' figures.
//! - `progress`: the per-second line, and a line per step of a schedule.
//! - [`report`]: the figures, as text and JSON.
//! - [`verdict`]: how the run ended for the shell: its exit status.
//! - [`hdr_log`]: the interval log, and `driver merge` of a fleet's logs.
//! - [`embedded`]: the local provider + broker of the default run.
//! - [`capacity`]: `driver capacity`, the capacity planner ([`rpcmesh_capacity`]) run on
//!   this load engine: its steps, the CPU probes, the local mesh of child processes.

mod calls;
pub mod capacity;
pub mod config;
pub mod connection;
mod dispatch;
pub mod embedded;
pub mod failures;
pub mod fault_report;
pub mod hdr_log;
mod intake;
mod links;
pub mod metrics;
pub mod outcome;
pub mod pacer;
mod progress;
pub mod report;
mod shared;
pub mod stats;
pub mod users;
pub mod verdict;
mod worker;
pub mod workload;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::metrics::system::Housekeeping;
use rpcmesh_common::net::shutdown::CancellationToken;

pub use config::{Args, DriverConfig, Stop, WorkloadKind};
pub use report::{Ending, Report};
pub use verdict::Verdict;
// Fixed limits that are not flags, public so that the docs quoting them are held to the
// code (`tests/docs_constants.rs`).
pub use links::MAX_DRAINING;
pub use worker::MAX_RETRIES;

use crate::stats::Tally;
use crate::worker::{Plan, RunShared};

/// Runs the load described by `config` and returns its report. With no target, starts an
/// embedded provider and broker first. `stop` ends the run early (what has been measured
/// is reported).
pub async fn run(config: DriverConfig, stop: CancellationToken) -> anyhow::Result<Report> {
    run_with(config, Telemetry::new(), stop).await
}

/// As [`run`], recording metrics into `telemetry` (served on `/metrics` by `main`).
pub async fn run_with(
    mut config: DriverConfig,
    telemetry: Telemetry,
    stop: CancellationToken,
) -> anyhow::Result<Report> {
    let embedded = if config.targets.is_empty() {
        let mesh = embedded::Embedded::start().await?;
        tracing::info!(broker = %mesh.broker, provider = %mesh.provider, "embedded provider and broker started");
        config.targets = vec![mesh.broker.to_string()];
        Some(mesh)
    } else {
        None
    };
    let housekeeping = Housekeeping::start(&telemetry, metrics::ROLE);
    let report = drive(config, telemetry, embedded.is_some(), stop).await;
    // One last reading, so that a scrape after the run sees the whole run's CPU time.
    housekeeping.finish().await;
    if let Some(mesh) = embedded {
        tokio::task::spawn_blocking(move || mesh.stop()).await?;
    }
    report
}

async fn drive(
    config: DriverConfig,
    telemetry: Telemetry,
    embedded: bool,
    stop: CancellationToken,
) -> anyhow::Result<Report> {
    let started = Instant::now();
    let started_system = SystemTime::now();
    let started_unix = started_system
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let measure_from = started + config.warmup;
    let log = match &config.hdr_log {
        Some(path) => Some(hdr_log::spawn_writer(
            path.clone(),
            started_system + config.warmup,
        )?),
        None => None,
    };
    let (until, budget) = match config.stop {
        Stop::Duration(d) => (Some(measure_from + d), None),
        Stop::Requests(n) => (None, Some(AtomicU64::new(n))),
    };
    let n = config.connections;
    let plans: Vec<Plan> = (0..n)
        .map(|i| Plan {
            index: i,
            // Open loop: the run's pacer hands out the due requests.
            dues: None,
            targets: config.targets.clone(),
            first: i % config.targets.len(),
            users: config.concurrency / n + usize::from(i < config.concurrency % n),
            backlog: config.backlog.div_ceil(n),
        })
        .collect();
    let workload = workload::Workload::new(config.workload, config.payload_size);
    let (service, method) = workload.target();
    let metrics = metrics::DriverMetrics::new(telemetry, service, method, config.stage_sample);
    metrics.users.set(config.concurrency as f64);
    let tls_counters = rpcmesh_common::metrics::security::TlsCounters::new(
        &metrics.telemetry,
        rpcmesh_common::metrics::Role::Driver,
        "outbound",
    );
    let tls = match &config.tls {
        Some(t) => Some(rpcmesh_common::net::tls::ClientTls::new(
            t.clone(),
            tls_counters,
        )?),
        None => None,
    };
    let (service, method) = workload.target();
    let shared = Arc::new(RunShared {
        tls,
        retry: config.retry.budget(),
        retry_lost: config.idempotent.covers(service, method),
        workload,
        metrics,
        finish: worker::FinishLine::new(n),
        measure_from,
        until,
        budget,
        stop,
        intervals: (0..n).map(|_| Mutex::new(Tally::interval())).collect(),
        logs: (0..n)
            .filter(|_| config.hdr_log.is_some())
            .map(|_| Mutex::new(Tally::default()))
            .collect(),
        config,
    });
    // When SIGINT or SIGTERM stopped the run, if it did: before its end, it is interrupted.
    let stopped_at = {
        let stop = shared.stop.clone();
        tokio::spawn(async move {
            stop.cancelled().await;
            Instant::now()
        })
    };
    let progress_done = CancellationToken::new();
    let progress = tokio::spawn(progress::show(
        shared.clone(),
        started,
        progress_done.clone(),
    ));
    // Open loop: one pacer for the run hands each due request to a connection in turn.
    let mut plans = plans;
    if let Some(schedule) = shared.config.schedule.clone() {
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..n)
            .map(|_| tokio::sync::mpsc::unbounded_channel::<Instant>())
            .unzip();
        for (p, rx) in plans.iter_mut().zip(receivers) {
            p.dues = Some(rx);
        }
        let c = &shared.config;
        let pacer = pacer::Pacer::new(schedule, c.arrival, measure_from, Instant::now(), c.seed);
        tokio::spawn(dispatch::run(pacer, shared.clone(), senders));
    }
    let logger = log.map(|(tx, thread)| {
        let task = tokio::spawn(hdr_log::record(
            shared.clone(),
            measure_from,
            tx,
            progress_done.clone(),
        ));
        (task, thread)
    });
    let workers: Vec<_> = plans
        .into_iter()
        .map(|p| tokio::spawn(worker::run(p, shared.clone())))
        .collect();
    let mut total = worker::WorkerFigures::default();
    for w in workers {
        match w.await {
            Ok(o) => total.add(&o),
            Err(e) => tracing::error!(error = %e, "a worker task failed"),
        }
    }
    let ended = Instant::now();
    progress_done.cancel();
    let _ = progress.await;
    let stopped_at = if shared.stop.is_cancelled() {
        stopped_at.await.ok()
    } else {
        stopped_at.abort();
        None
    };
    // Stopped before its end: before its duration's, or with measured requests left.
    let interrupted = stopped_at.is_some_and(|at| match (shared.until, &shared.budget) {
        (Some(u), _) => at < u,
        (None, Some(b)) => b.load(std::sync::atomic::Ordering::Relaxed) > 0,
        (None, None) => true,
    });
    let window_end = match shared.until {
        Some(u) if !interrupted => u,
        _ => total.last_done.unwrap_or(ended),
    };
    let secs = window_end
        .saturating_duration_since(measure_from)
        .as_secs_f64()
        .max(1e-9);
    if let Some((task, thread)) = logger {
        let tx = task.await?;
        let _ = tx.send(hdr_log::LogEntryOut::End(
            std::time::Duration::from_secs_f64(secs),
        ));
        drop(tx);
        tokio::task::spawn_blocking(move || thread.join())
            .await?
            .map_err(|_| anyhow::anyhow!("the interval log's writer panicked"))??;
    }

    let mut report = build_report(&shared.config, embedded, started_unix, secs, &total);
    if interrupted {
        report.ended = report::Ending::Interrupted;
    }
    Ok(report)
}

fn build_report(
    c: &DriverConfig,
    embedded: bool,
    started_unix: u64,
    secs: f64,
    end: &worker::WorkerFigures,
) -> Report {
    use report::*;
    let t = stats::total(&end.steps);
    let open_loop = c.schedule.is_some();
    let window = std::time::Duration::from_secs_f64(secs);
    let steps = match &c.schedule {
        Some(s) => s
            .steps(window)
            .into_iter()
            .enumerate()
            .map(|(i, step)| {
                let empty = Tally::default();
                let t = end.steps.get(i).unwrap_or(&empty);
                let secs = step.length.as_secs_f64().max(1e-9);
                StepFigures {
                    start_seconds: step.start.as_secs_f64(),
                    seconds: secs,
                    rate_from: step.rate_from,
                    rate_to: step.rate_to,
                    requests: RequestFigures::of(t, secs, open_loop, None),
                    calls: CallFigures::of(t, secs, open_loop, 0, 0),
                }
            })
            .collect(),
        None => Vec::new(),
    };
    Report {
        version: env!("CARGO_PKG_VERSION").to_string(),
        started_unix,
        setup: Setup {
            workload: match c.workload {
                WorkloadKind::Platform => "platform".into(),
                WorkloadKind::Echo => "echo".into(),
            },
            payload_size: c.payload_size,
            targets: c.targets.clone(),
            embedded,
            concurrency: c.concurrency,
            connections: c.connections,
            fanout: c.fanout,
            parallel: c.parallel,
            compression: c.compression.is_some(),
            plain_v1: c.kind == rpcmesh_wire::PeerKind::V1,
            warmup_seconds: c.warmup.as_secs_f64(),
            rate: match &c.schedule {
                Some(pacer::Schedule::Constant(r)) => Some(*r),
                _ => None,
            },
            schedule: c.schedule.clone(),
            arrival: c.schedule.as_ref().map(|_| c.arrival),
            pacing: c.schedule.as_ref().map(|_| c.pacing),
        },
        measured_seconds: secs,
        ended: Ending::Completed,
        requests: RequestFigures::of(&t, secs, open_loop, Some(&end.lag)),
        calls: CallFigures {
            returned_home: end.returned_home,
            ..CallFigures::of(&t, secs, open_loop, end.late_replies, end.connect_failures)
        },
        bytes: ByteFigures::of(&t),
        steps,
    }
}
