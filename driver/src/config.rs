//! Driver configuration: the command line of every command (each flag of a load with an
//! environment fallback), the defaults and why they are what they are, and validation of
//! a run into [`DriverConfig`]. `driver capacity`'s flags flatten the load's and the
//! planner's own (`rpcmesh_capacity::PlanArgs`); the capacity module validates them, and
//! this module uses nothing of it.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use rpcmesh_capacity::{OutputArgs, PlanArgs};
use rpcmesh_common::cli::flags::{
    CompressionArgs, IdempotentArgs, RetryBudgetArgs, RuntimeArgs, StageArgs,
};
use rpcmesh_common::cli::values::parse_duration;
use rpcmesh_common::cli::{ConfigProblems, DurationArg, MetricsListen, OnOff};
use rpcmesh_common::metrics::families::DEFAULT_STAGE_SAMPLE;
use rpcmesh_common::retry::Idempotent;
use rpcmesh_wire::PeerKind;
use rpcmesh_wire::compress::{
    CompressionConfig, DEFAULT_COMPRESS_LEVEL, DEFAULT_COMPRESS_THRESHOLD,
};
use rpcmesh_wire::frame::DEFAULT_MAX_BODY_LEN;

use crate::connection::HOME_RETRY;
use crate::pacer::{Arrival, Pacing, RateArg, Schedule};

/// Users (closed-loop callers) unless told otherwise: the 200 of the reference report.
pub const DEFAULT_CONCURRENCY: usize = 200;
/// Calls per user request: the reference workload's 5 calls in a row.
pub const DEFAULT_FANOUT: u32 = 5;
/// Connections per run: enough to spread over a broker's threads, few enough that each
/// carries many calls per write (the batching that multiplexing is for).
pub const DEFAULT_CONNECTIONS: usize = 8;
/// Calls carry their deadline unless told not to: a broker or provider that takes it
/// drops a call the driver has given up on instead of running it, and one that does not
/// take it is sent plain calls anyway (`crate::connection`).
pub const DEFAULT_DEADLINE: bool = true;
/// Measured time of a run against given targets.
pub const DEFAULT_DURATION: Duration = Duration::from_secs(10);
/// Measured time of the embedded demo run (no target given): a few seconds, so that the
/// README's first command finishes quickly.
pub const DEFAULT_EMBEDDED_DURATION: Duration = Duration::from_secs(5);
/// Time run before measuring, so that connections, pools, caches and the CPU governor
/// settle; its calls are made but not counted.
pub const DEFAULT_WARMUP: Duration = Duration::from_secs(1);
/// How long a call may wait for its reply before it counts as timed out: above the
/// broker's own 5 s timeout, so a broker's "timeout" answer arrives first.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Echo message size: 32 bytes, the size of the published echo benchmarks.
pub const DEFAULT_ECHO_SIZE: usize = 32;
/// Where the driver serves `/metrics` unless told otherwise (`off` disables it): port
/// 9790, beside the broker's 9770 and the provider's 9780. A driver that cannot bind it
/// warns and runs without: the run matters more than its metrics.
pub const DEFAULT_METRICS_LISTEN: MetricsListen = MetricsListen(Some(SocketAddr::V4(
    SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 9790),
)));
/// The reference workload unless told otherwise: the platform query of the published
/// broker capacity report, the one its figures are for.
pub const DEFAULT_WORKLOAD: WorkloadKind = WorkloadKind::Platform;
/// Requests are not compressed unless asked: the reference report measured plain first,
/// and compression is the thing a capacity experiment turns on to compare.
pub const DEFAULT_COMPRESS: bool = false;
/// Progress unless told otherwise: a live line on a terminal, plain lines otherwise.
pub const DEFAULT_PROGRESS: ProgressMode = ProgressMode::Auto;
/// No lingering after the report unless asked: a run ends when it is measured.
pub const DEFAULT_LINGER: Duration = Duration::ZERO;
/// The largest echo message: what leaves room, within the 10 MiB frame body every RPCF v1
/// peer accepts, for the names, the envelope's tags and lengths (64 bytes is more than
/// they take).
pub const MAX_PAYLOAD_SIZE: usize = DEFAULT_MAX_BODY_LEN as usize - 64;
/// Open loop: requests that may wait for a free slot, in all, unless told otherwise. A
/// request due while every slot is busy waits here and is still timed from its intended
/// start; 100,000 holds a 1 s stall at 100,000 requests/s, or 50 s at 2,000/s, for 16
/// bytes each (1.6 MB). Beyond it a request is not sent, and counted.
pub const DEFAULT_BACKLOG: usize = 100_000;
/// How long each of `--steps` lasts unless told otherwise: 10 s gives a few seconds for a
/// queue to settle at the new rate and thousands of requests for its p99.
pub const DEFAULT_STEP_DURATION: Duration = Duration::from_secs(10);
/// Requests are evenly spaced unless told otherwise: the offered rate is then exactly the
/// one asked, every interval.
pub const DEFAULT_ARRIVAL: Arrival = Arrival::Uniform;
/// Open-loop pacing unless told otherwise: exact, so that the start lag printed in the
/// report is within tens of µs (see [`Pacing::Exact`] for what it costs).
pub const DEFAULT_PACING: Pacing = Pacing::Exact;
/// The seed of random gaps unless told otherwise: fixed, so that two runs offer the same
/// schedule.
pub const DEFAULT_SEED: u64 = 1;
/// Most users one connection may carry (bounds its in-flight table).
pub const MAX_USERS_PER_CONNECTION: usize = 65_536;
/// What separates several targets in one `--target` or `RPCMESH_TARGETS`: a comma, as in
/// every list of the driver's (`--steps`); no target contains one.
pub const TARGET_SEPARATOR: char = ',';

/// Which calls the users make.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// `PlatformService.doQuery` with the reference request: the "platform query" of the
    /// published broker capacity report.
    Platform,
    /// `EchoService.Echo` with a message of `--payload-size` bytes.
    Echo,
}

/// How progress is shown while running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProgressMode {
    /// A live line on a terminal, plain lines otherwise.
    Auto,
    /// One line per second.
    Plain,
    /// Nothing until the report.
    Off,
}

/// When a run stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// After this long of measuring.
    Duration(Duration),
    /// After this many measured requests.
    Requests(u64),
}

/// The driver's command line.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "driver",
    version = rpcmesh_common::build::VERSION_LINE,
    args_conflicts_with_subcommands = true,
    after_help = crate::verdict::EXIT_STATUSES,
    about = "rpcmesh driver: fan-out load against brokers or providers (closed or open loop), with HDR percentiles",
    long_about = "rpcmesh driver: fan-out load against brokers or providers (closed or open loop), with HDR percentiles.\n\n\
                  With no --target it starts a provider and a broker on 127.0.0.1 itself and runs the \
                  reference workload (200 users, 5 platform calls per request) for a few seconds."
)]
pub struct Args {
    /// Something else than a run.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// What is called, and how.
    #[command(flatten)]
    pub load: LoadArgs,
    /// Open loop: start this many requests per second in all, whatever the replies
    /// (`--concurrency` then caps the requests in flight), or FROM:TO with --ramp. Without
    /// it (or --steps): closed loop.
    #[arg(long, env = "RPCMESH_RATE", conflicts_with = "steps")]
    pub rate: Option<RateArg>,
    /// Open loop, with --rate FROM:TO: how long the rate takes to go from FROM to TO (the
    /// run's length unless --duration says otherwise).
    #[arg(long, env = "RPCMESH_RAMP")]
    pub ramp: Option<DurationArg>,
    /// Open loop: rates to offer one after another (e.g. 1000,2000,5000), each for
    /// --step-duration; a line and a JSON record per step.
    #[arg(long, env = "RPCMESH_STEPS", value_delimiter = ',')]
    pub steps: Vec<f64>,
    /// How long each of --steps lasts.
    #[arg(long, env = "RPCMESH_STEP_DURATION", default_value_t = DurationArg(DEFAULT_STEP_DURATION))]
    pub step_duration: DurationArg,
    /// How long to measure (e.g. 30s) [default: 10s, 5s without --target].
    #[arg(long, env = "RPCMESH_DURATION", value_parser = parse_duration, conflicts_with = "requests")]
    pub duration: Option<Duration>,
    /// Stop after this many measured requests instead of after a duration.
    #[arg(long, env = "RPCMESH_REQUESTS")]
    pub requests: Option<u64>,
    /// Time to run before measuring.
    #[arg(long, env = "RPCMESH_WARMUP", default_value_t = DurationArg(DEFAULT_WARMUP))]
    pub warmup: DurationArg,
    /// Write the report as JSON to this file.
    #[arg(long, env = "RPCMESH_JSON")]
    pub json: Option<PathBuf>,
    /// Write the measured latencies to this file as an HdrHistogram interval log (one
    /// interval a second); `driver merge` combines the logs of several drivers.
    #[arg(long, env = "RPCMESH_HDR_LOG")]
    pub hdr_log: Option<PathBuf>,
    /// Progress while running.
    #[arg(long, env = "RPCMESH_PROGRESS", value_enum, default_value_t = DEFAULT_PROGRESS)]
    pub progress: ProgressMode,
    /// After the report, keep serving `/metrics` this long, so that Prometheus scrapes the
    /// final figures (e.g. 15s).
    #[arg(long, env = "RPCMESH_LINGER", default_value_t = DurationArg(DEFAULT_LINGER))]
    pub linger: DurationArg,
    /// Open loop: exit 0 although requests due were not sent (every slot busy and the
    /// backlog full), instead of 3: for a run that looks for where that begins.
    #[arg(long, env = "RPCMESH_ALLOW_UNSENT")]
    pub allow_unsent: bool,
}

/// The flags of a load, shared by a run and `driver capacity`: what is called, over what,
/// and how.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// Broker or provider to call (HOST:PORT). Repeatable, or several separated by commas
    /// (as RPCMESH_TARGETS=A:7700,B:7700 takes them); connections are spread over them, and
    /// move to the next when theirs refuses, fails or drains. None = start a local provider
    /// and broker and call those.
    #[arg(long = "target", env = "RPCMESH_TARGETS", value_delimiter = TARGET_SEPARATOR)]
    pub targets: Vec<String>,
    /// The calls to make.
    #[arg(long, env = "RPCMESH_WORKLOAD", value_enum, default_value_t = DEFAULT_WORKLOAD)]
    pub workload: WorkloadKind,
    /// Echo message size in bytes.
    #[arg(long, env = "RPCMESH_PAYLOAD_SIZE", default_value_t = DEFAULT_ECHO_SIZE)]
    pub payload_size: usize,
    /// Calls per user request.
    #[arg(long, env = "RPCMESH_FANOUT", default_value_t = DEFAULT_FANOUT)]
    pub fanout: u32,
    /// Make a request's calls all at once instead of one after another.
    #[arg(long, env = "RPCMESH_PARALLEL")]
    pub parallel: bool,
    /// Users, each making one request after another (closed loop).
    #[arg(long, env = "RPCMESH_CONCURRENCY", default_value_t = DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
    /// Open loop: how requests are spaced: uniform (equal gaps) or poisson (exponential
    /// gaps: independent arrivals).
    #[arg(long, env = "RPCMESH_ARRIVAL", value_enum, default_value_t = DEFAULT_ARRIVAL)]
    pub arrival: Arrival,
    /// Seed of the random gaps (--arrival poisson): the same seed, the same schedule.
    #[arg(long, env = "RPCMESH_SEED", default_value_t = DEFAULT_SEED)]
    pub seed: u64,
    /// Open loop: how the pacer waits for each request: exact (spins through the last
    /// 2 ms before each: start lag within tens of µs, up to a core) or lean (sleeps:
    /// little CPU, a start lag of up to hundreds of µs on a VM) [default: exact; lean for
    /// `driver capacity`].
    #[arg(long, env = "RPCMESH_PACER", value_enum)]
    pub pacer: Option<Pacing>,
    /// Open loop: requests due while every slot is busy that wait for one (in all); beyond
    /// it they are not sent, and counted.
    #[arg(long, env = "RPCMESH_BACKLOG", default_value_t = DEFAULT_BACKLOG)]
    pub backlog: usize,
    /// TCP connections the users share; never more than the users (--concurrency), since
    /// a connection with no user would carry nothing: the report says how many were used.
    #[arg(long, env = "RPCMESH_CONNECTIONS", default_value_t = DEFAULT_CONNECTIONS)]
    pub connections: usize,
    /// Compress request payloads and accept compressed replies: on|off.
    #[arg(long, env = "RPCMESH_COMPRESS", default_value_t = OnOff(DEFAULT_COMPRESS))]
    pub compress: OnOff,
    /// How requests are compressed.
    #[command(flatten)]
    pub compression: CompressionArgs,
    /// Send plain RPCF v1 frames only (no extension flags), as an existing v1 client does.
    #[arg(long, env = "RPCMESH_V1")]
    pub v1: bool,
    /// Per-call timeout.
    #[arg(long, env = "RPCMESH_CALL_TIMEOUT", default_value_t = DurationArg(DEFAULT_CALL_TIMEOUT))]
    pub timeout: DurationArg,
    /// Send each call's deadline (the time left of --timeout) to targets that take it:
    /// on|off (ignored with --v1).
    #[arg(long, env = "RPCMESH_DEADLINE", default_value_t = OnOff(DEFAULT_DEADLINE))]
    pub deadline: OnOff,
    /// The retry budget of calls that did not run (or, idempotent, were lost).
    #[command(flatten)]
    pub retry: RetryBudgetArgs,
    /// The calls that may be retried when lost in flight.
    #[command(flatten)]
    pub idempotent: IdempotentArgs,
    /// The driver's runtime.
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Address of the Prometheus `/metrics` endpoint, or `off`.
    #[arg(long, env = "RPCMESH_METRICS_LISTEN", default_value_t = DEFAULT_METRICS_LISTEN)]
    pub metrics_listen: MetricsListen,
    /// Per-stage latency timing.
    #[command(flatten)]
    pub stages: StageArgs,
    /// TLS to the targets.
    #[command(flatten)]
    pub tls: rpcmesh_common::cli::security::ClientTlsArgs,
}

/// What the driver does instead of a run.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Merge the interval logs (--hdr-log) of several drivers into one report: their
    /// histograms are added, so the fleet's percentiles are exact.
    Merge(MergeArgs),
    /// Find the highest rate that meets an SLO (open-loop steps: grow, bisect, confirm),
    /// with per-step CPU and bytes per call, a closed-loop sweep fitted with the Universal
    /// Scalability Law, and compression off against on. With no --target it starts a
    /// provider and a broker as child processes. See docs/capacity.md.
    Capacity(Box<CapacityArgs>),
    /// The fault lab's report from its runs (scripts/faults writes them): each fault's
    /// success rate and latency before, during and after, against a run with no fault,
    /// and its time to detect and to recover. See docs/resilience.md.
    FaultReport(FaultReportArgs),
    /// Run as the provider or the broker (`driver serve provider --listen ...`): how
    /// `driver capacity` starts its local mesh.
    #[command(hide = true)]
    Serve(ServeArgs),
}

/// `driver capacity`'s arguments: the load of every step (as for a run), the planner's
/// own flags, and where the programs on the path are read. Its own flags fall back on
/// `RPCMESH_CAPACITY_<FLAG>`, as the planner's do (see `rpcmesh_capacity`'s args).
#[derive(Debug, Clone, clap::Args)]
pub struct CapacityArgs {
    /// What is called, and how (as for a run).
    #[command(flatten)]
    pub load: LoadArgs,
    /// The search, the SLO, the comparison and the sweep.
    #[command(flatten)]
    pub plan: PlanArgs,
    /// `/metrics` of a broker on the path (HOST:PORT), for its CPU. Repeatable. Found
    /// by itself for the local mesh.
    #[arg(
        long = "broker-metrics",
        env = "RPCMESH_CAPACITY_BROKER_METRICS",
        value_delimiter = ',',
        value_parser = parse_metrics_endpoint
    )]
    pub broker_metrics: Vec<SocketAddr>,
    /// `/metrics` of a provider on the path (HOST:PORT). Repeatable.
    #[arg(
        long = "provider-metrics",
        env = "RPCMESH_CAPACITY_PROVIDER_METRICS",
        value_delimiter = ',',
        value_parser = parse_metrics_endpoint
    )]
    pub provider_metrics: Vec<SocketAddr>,
    /// With --compare-tls and --target: where the same path is called without TLS
    /// (HOST:PORT, e.g. a broker's --listen-plain address). Repeatable.
    #[arg(
        long = "plain-target",
        env = "RPCMESH_CAPACITY_PLAIN_TARGETS",
        value_delimiter = ','
    )]
    pub plain_targets: Vec<String>,
    /// With --compare-tls: `/metrics` of the broker the plain targets reach, when it is not
    /// --broker-metrics' (a second broker for plaintext hops). Repeatable.
    #[arg(
        long = "plain-broker-metrics",
        env = "RPCMESH_CAPACITY_PLAIN_BROKER_METRICS",
        value_delimiter = ',',
        value_parser = parse_metrics_endpoint
    )]
    pub plain_broker_metrics: Vec<SocketAddr>,
    /// With --compare-tls: `/metrics` of the provider behind the plain targets, when it is
    /// not --provider-metrics'. Repeatable.
    #[arg(
        long = "plain-provider-metrics",
        env = "RPCMESH_CAPACITY_PLAIN_PROVIDER_METRICS",
        value_delimiter = ',',
        value_parser = parse_metrics_endpoint
    )]
    pub plain_provider_metrics: Vec<SocketAddr>,
    /// Local mesh: the provider's service time (as the provider's --service-time).
    #[arg(long, env = "RPCMESH_CAPACITY_SERVICE_TIME")]
    pub service_time: Option<String>,
    /// Local mesh: the provider burns its service time on the CPU instead of sleeping.
    #[arg(long, env = "RPCMESH_CAPACITY_SERVICE_WORK")]
    pub service_work: bool,
    /// Where the report is written.
    #[command(flatten)]
    pub outputs: OutputArgs,
}

/// A `/metrics` endpoint to probe: `HOST:PORT`, a host name resolved once, here (the
/// probes then scrape that address).
pub fn parse_metrics_endpoint(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let expected = "expected the HOST:PORT of a /metrics endpoint, e.g. 10.0.0.2:9770";
    if !is_host_port(s) {
        return Err(format!("{s}: {expected}"));
    }
    match s.to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| format!("{s}: the name has no address ({expected})")),
        Err(e) => Err(format!("{s}: {e} ({expected})")),
    }
}

/// Which program `driver serve` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServeRole {
    /// The provider, with the provider's own flags and `main`.
    Provider,
    /// The broker, with the broker's own flags and `main`.
    Broker,
}

impl ServeRole {
    /// Its name on the command line (and as the program's `argv[0]`).
    pub fn name(self) -> &'static str {
        match self {
            ServeRole::Provider => "provider",
            ServeRole::Broker => "broker",
        }
    }
}

impl std::fmt::Display for ServeRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `driver serve`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// The program to run.
    #[arg(value_enum)]
    pub role: ServeRole,
    /// That program's flags.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub flags: Vec<String>,
}

/// `driver merge`'s arguments; its flags fall back on `RPCMESH_MERGE_<FLAG>` (a run's
/// `RPCMESH_JSON` is the run's report).
#[derive(Debug, Clone, clap::Args)]
pub struct MergeArgs {
    /// The interval logs, one per driver.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Write the merged report as JSON to this file.
    #[arg(long, env = "RPCMESH_MERGE_JSON")]
    pub json: Option<PathBuf>,
}

/// `driver fault-report`'s arguments; its flags fall back on
/// `RPCMESH_FAULT_REPORT_<FLAG>`.
#[derive(Debug, Clone, clap::Args)]
pub struct FaultReportArgs {
    /// The fault lab's account of its runs (`runs.json`, written by scripts/faults).
    pub runs: PathBuf,
    /// Write the report as JSON to this file.
    #[arg(long, env = "RPCMESH_FAULT_REPORT_JSON")]
    pub json: Option<PathBuf>,
    /// Write the report as Markdown to this file.
    #[arg(long, env = "RPCMESH_FAULT_REPORT_MARKDOWN")]
    pub markdown: Option<PathBuf>,
    /// Write the report as an HTML page with charts to this file.
    #[arg(long, env = "RPCMESH_FAULT_REPORT_HTML")]
    pub html: Option<PathBuf>,
}

/// Validated driver settings, as `run` takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct DriverConfig {
    /// Targets; empty = start an embedded provider and broker.
    pub targets: Vec<String>,
    /// The calls to make.
    pub workload: WorkloadKind,
    /// Echo message size.
    pub payload_size: usize,
    /// Calls per request.
    pub fanout: u32,
    /// Calls of a request at once.
    pub parallel: bool,
    /// Users (closed loop), or most requests in flight (open loop).
    pub concurrency: usize,
    /// Open loop: the offered rate over the measured window; `None` = closed loop.
    pub schedule: Option<Schedule>,
    /// Open loop: how requests are spaced.
    pub arrival: Arrival,
    /// Seed of the random gaps.
    pub seed: u64,
    /// Open loop: how the pacer waits.
    pub pacing: Pacing,
    /// Open loop: requests that may wait for a free slot, in all.
    pub backlog: usize,
    /// Connections.
    pub connections: usize,
    /// When to stop.
    pub stop: Stop,
    /// Unmeasured lead-in.
    pub warmup: Duration,
    /// Request compression (`None` = plain).
    pub compression: Option<CompressionConfig>,
    /// What the targets are sent: extension flags (rpcmesh) or plain v1 frames.
    pub kind: PeerKind,
    /// Per-call timeout.
    pub call_timeout: Duration,
    /// Send each call's deadline to targets that take it (rpcmesh targets only).
    pub deadline: bool,
    /// The retry budget's share of the calls and floor.
    pub retry: RetryBudgetArgs,
    /// The calls marked idempotent (retried when lost in flight).
    pub idempotent: Idempotent,
    /// Where to write the JSON report.
    pub json: Option<PathBuf>,
    /// Where to write the HdrHistogram interval log.
    pub hdr_log: Option<PathBuf>,
    /// Progress display.
    pub progress: ProgressMode,
    /// Stages are timed on one call in this many; 0 = not at all.
    pub stage_sample: u32,
    /// How often a worker away from its own target tries to go back to it
    /// ([`HOME_RETRY`]; no flag). A test that must show a worker stays away sets it
    /// beyond the run.
    pub home_retry: Duration,
    /// TLS to the targets (`None`: plain).
    pub tls: Option<rpcmesh_common::net::tls::ClientTlsSettings>,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            targets: Vec::new(),
            workload: DEFAULT_WORKLOAD,
            payload_size: DEFAULT_ECHO_SIZE,
            fanout: DEFAULT_FANOUT,
            parallel: false,
            concurrency: DEFAULT_CONCURRENCY,
            schedule: None,
            arrival: DEFAULT_ARRIVAL,
            seed: DEFAULT_SEED,
            pacing: DEFAULT_PACING,
            backlog: DEFAULT_BACKLOG,
            connections: DEFAULT_CONNECTIONS,
            stop: Stop::Duration(DEFAULT_EMBEDDED_DURATION),
            warmup: DEFAULT_WARMUP,
            compression: DEFAULT_COMPRESS.then(CompressionConfig::default),
            kind: PeerKind::Rpcmesh,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            deadline: DEFAULT_DEADLINE,
            retry: RetryBudgetArgs::default(),
            idempotent: Idempotent::default(),
            json: None,
            hdr_log: None,
            progress: DEFAULT_PROGRESS,
            stage_sample: DEFAULT_STAGE_SAMPLE,
            home_retry: HOME_RETRY,
            tls: None,
        }
    }
}

impl Args {
    /// The open-loop schedule the flags describe (`None`: closed loop); problems go to `p`.
    fn schedule(&self, p: &mut ConfigProblems) -> Option<Schedule> {
        let positive = |r: f64| r.is_finite() && r > 0.0;
        match (self.rate, self.steps.as_slice()) {
            (Some(RateArg { from, to: None }), _) => {
                p.check(self.ramp.is_some(), || {
                    format!("--ramp is how long a rate ramp takes: give --rate FROM:TO (e.g. --rate {from}:{} --ramp 60s), or drop --ramp", from * 2.0)
                });
                p.check(!positive(from), || {
                    format!("--rate {from} must be above zero")
                });
                Some(Schedule::Constant(from))
            }
            (Some(RateArg { from, to: Some(to) }), _) => {
                p.check(!positive(from) || !positive(to), || {
                    format!("--rate {from}:{to}: both rates must be above zero")
                });
                let over = self.ramp.map(|d| d.0);
                p.check(over.is_none_or(|d| d.is_zero()), || {
                    "--rate FROM:TO needs --ramp DURATION (above zero)".into()
                });
                Some(Schedule::Ramp {
                    from,
                    to,
                    over: over.unwrap_or(Duration::from_secs(1)),
                })
            }
            (None, []) => {
                p.check(self.ramp.is_some(), || {
                    "--ramp is how long a rate ramp takes: give --rate FROM:TO with it (e.g. --rate 1000:20000 --ramp 60s), or drop --ramp".into()
                });
                p.check(self.step_duration.0 != DEFAULT_STEP_DURATION, || {
                    "--step-duration is how long each of --steps lasts: give --steps with it (e.g. --steps 1000,2000,5000), or drop --step-duration".into()
                });
                None
            }
            (None, rates) => {
                p.check(self.ramp.is_some(), || {
                    "--ramp takes a rate ramp (--rate FROM:TO), not --steps: drop --ramp, or give --rate FROM:TO instead of --steps".into()
                });
                p.check(rates.iter().any(|r| !positive(*r)), || {
                    "--steps: every rate must be above zero".into()
                });
                p.check(self.step_duration.0.is_zero(), || {
                    "--step-duration must be above zero".into()
                });
                Some(Schedule::Steps {
                    rates: rates.to_vec(),
                    each: self.step_duration.0,
                })
            }
        }
    }

    /// Checks every setting and lists all problems at once.
    pub fn config(&self) -> Result<DriverConfig, ConfigProblems> {
        let mut p = ConfigProblems::default();
        let mut c = self.load.config(DEFAULT_PACING, &mut p);
        let schedule = self.schedule(&mut p);
        match &schedule {
            Some(s) => {
                check_rate(s.lowest(), &mut p);
                check_rate(s.peak(), &mut p);
            }
            None => {
                self.load.check_closed_loop(&mut p);
                p.check(self.allow_unsent, || {
                    "--allow-unsent applies to the open loop only (a closed loop sends every request): add --rate RATE or --steps RATES, or drop --allow-unsent".into()
                });
            }
        }
        self.load
            .check_compression_tuning(self.load.compress.0, "--compress on", &mut p);
        p.check(
            !self.linger.0.is_zero() && self.load.metrics_listen.is_off(),
            || "--linger keeps /metrics served after the report, and --metrics-listen off serves none: drop one of them".into(),
        );
        p.check(self.duration.is_some_and(|d| d.is_zero()), || {
            "--duration must be above zero".into()
        });
        p.check(self.requests == Some(0), || {
            "--requests must be at least 1".into()
        });
        c.stop = match (self.requests, self.duration) {
            (Some(n), _) => Stop::Requests(n),
            (None, Some(d)) => Stop::Duration(d),
            (None, None) if schedule.as_ref().and_then(Schedule::length).is_some() => {
                Stop::Duration(
                    schedule
                        .as_ref()
                        .and_then(Schedule::length)
                        .unwrap_or_default(),
                )
            }
            (None, None) if c.targets.is_empty() => Stop::Duration(DEFAULT_EMBEDDED_DURATION),
            (None, None) => Stop::Duration(DEFAULT_DURATION),
        };
        c.schedule = schedule;
        c.warmup = self.warmup.0;
        c.json = self.json.clone();
        c.hdr_log = self.hdr_log.clone();
        c.progress = self.progress;
        p.into_result(c)
    }
}

/// Whether `t` is one HOST:PORT: a host name or IPv4 address (letters, digits, `-`, `.`,
/// `_`), or an IPv6 address in brackets, then a port. What is refused is what a name
/// lookup would only refuse later, or take for something else: two targets run together
/// (`a:1 b:2`), a missing port, an IPv6 address without brackets.
pub fn is_host_port(t: &str) -> bool {
    let Some((host, port)) = t.rsplit_once(':') else {
        return false;
    };
    let port_ok = !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p > 0);
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        }
    };
    port_ok && host_ok
}

/// The run's one pacer starts a request every `1 / rate`: keeps that between 1 µs and an
/// hour.
pub fn check_rate(rate: f64, p: &mut ConfigProblems) {
    let every = 1.0 / rate;
    p.check(!(every.is_finite() && (1e-6..=3600.0).contains(&every)), || {
        format!(
            "rate {rate} is out of range: the pacer would start a request every {every:.3e} s (1 µs to 1 h)"
        )
    });
}

impl LoadArgs {
    /// A closed loop has no schedule: the flags that shape one are refused when given
    /// (`--pacer`) or set to anything but their default. A default is let through: it
    /// changes nothing, and an environment file (the deployment's `driver.env`) writes
    /// every setting, for runs of every kind.
    pub fn check_closed_loop(&self, p: &mut ConfigProblems) {
        let open_only = [
            ("--pacer", self.pacer.is_some()),
            ("--arrival", self.arrival != DEFAULT_ARRIVAL),
            ("--backlog", self.backlog != DEFAULT_BACKLOG),
        ];
        for (flag, given) in open_only {
            p.check(given, || {
                format!("{flag} applies to the open loop only: add --rate RATE or --steps RATES, or drop {flag}")
            });
        }
    }

    /// `--compress-threshold` and `--compress-level` shape compressed requests: set to
    /// anything but their defaults while nothing is compressed (`on` false), they are
    /// refused, naming `needs` (what would compress).
    pub fn check_compression_tuning(&self, on: bool, needs: &str, p: &mut ConfigProblems) {
        let c = &self.compression;
        let tuned = [
            (
                "--compress-threshold",
                c.compress_threshold != DEFAULT_COMPRESS_THRESHOLD,
            ),
            (
                "--compress-level",
                c.compress_level != DEFAULT_COMPRESS_LEVEL,
            ),
        ];
        for (flag, given) in tuned {
            p.check(given && !on, || {
                format!("{flag} shapes compressed requests, and none is compressed: add {needs}, or drop {flag}")
            });
        }
    }

    /// The settings of the load these flags describe, checked (problems go to `p`); a
    /// closed loop of [`DEFAULT_DURATION`] until the caller says otherwise. `pacing` is
    /// the pacer unless `--pacer` says.
    pub fn config(&self, pacing: Pacing, p: &mut ConfigProblems) -> DriverConfig {
        let targets: Vec<String> = self
            .targets
            .iter()
            .filter(|t| !t.trim().is_empty())
            .cloned()
            .collect();
        for t in &targets {
            p.check(!is_host_port(t), || {
                format!(
                    "--target {t:?}: expected HOST:PORT (e.g. 10.0.0.2:7700 or [::1]:7700); \
                     give several as --target A --target B, or separated by commas \
                     (RPCMESH_TARGETS=A,B)"
                )
            });
        }
        p.check(self.fanout == 0 || self.fanout > 255, || {
            format!("--fanout {} must be 1-255", self.fanout)
        });
        p.check(self.concurrency == 0, || {
            "--concurrency must be at least 1".into()
        });
        // Connections beyond the users are never opened.
        let connections = self.connections.min(self.concurrency.max(1));
        p.check(self.connections == 0, || {
            "--connections must be at least 1".into()
        });
        p.check(self.concurrency > connections * MAX_USERS_PER_CONNECTION, || {
            format!("--concurrency {} needs more connections (at most {MAX_USERS_PER_CONNECTION} users each)", self.concurrency)
        });
        p.check(self.timeout.0.is_zero(), || {
            "--timeout must be above zero".into()
        });
        let compression = self.compression.config(self.compress.0, p);
        p.check(self.compress.0 && self.v1, || {
            "--compress on needs the extension flags: drop --v1".into()
        });
        p.check(
            self.payload_size != DEFAULT_ECHO_SIZE && self.workload != WorkloadKind::Echo,
            || "--payload-size is the echo message's size, and the platform workload sends its reference request: add --workload echo, or drop --payload-size".into(),
        );
        p.check(self.parallel && self.fanout == 1, || {
            "--parallel makes a request's calls at once, and with --fanout 1 a request has one: raise --fanout, or drop --parallel".into()
        });
        p.check(
            self.seed != DEFAULT_SEED && self.arrival != Arrival::Poisson,
            || "--seed draws the random gaps of --arrival poisson, and uniform gaps are not random: add --arrival poisson, or drop --seed".into(),
        );
        p.check(
            self.stages.stage_sample != DEFAULT_STAGE_SAMPLE
                && (!self.stages.stage_metrics.0 || self.metrics_listen.is_off()),
            || "--stage-sample says how many calls the stage histograms sample, and with --stage-metrics off or --metrics-listen off there are none: drop --stage-sample".into(),
        );
        p.check(self.payload_size > MAX_PAYLOAD_SIZE, || {
            format!(
                "--payload-size {} is above the {MAX_PAYLOAD_SIZE} bytes a frame (10 MiB body) can carry with its envelope",
                self.payload_size
            )
        });
        DriverConfig {
            targets,
            workload: self.workload,
            payload_size: self.payload_size,
            fanout: self.fanout,
            parallel: self.parallel,
            concurrency: self.concurrency,
            schedule: None,
            arrival: self.arrival,
            seed: self.seed,
            pacing: self.pacer.unwrap_or(pacing),
            backlog: self.backlog,
            connections,
            stop: Stop::Duration(DEFAULT_DURATION),
            warmup: DEFAULT_WARMUP,
            compression,
            kind: if self.v1 {
                PeerKind::V1
            } else {
                PeerKind::Rpcmesh
            },
            call_timeout: self.timeout.0,
            deadline: self.deadline.0,
            retry: self.retry,
            idempotent: self.idempotent.calls(p),
            json: None,
            hdr_log: None,
            progress: DEFAULT_PROGRESS,
            stage_sample: self.stages.every(self.metrics_listen),
            home_retry: HOME_RETRY,
            tls: self.tls.client(p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn no_flags_give_the_default_config() {
        assert_eq!(
            Args::parse_from(["driver"]).config().unwrap(),
            DriverConfig::default()
        );
    }

    #[test]
    fn a_payload_that_fits_a_frame_is_taken_and_one_that_does_not_is_refused() {
        let size = |n: usize| {
            Args::parse_from([
                "driver",
                "--workload",
                "echo",
                "--payload-size",
                &n.to_string(),
            ])
            .config()
            .map(|c| c.payload_size)
        };
        assert_eq!(size(MAX_PAYLOAD_SIZE), Ok(MAX_PAYLOAD_SIZE));
        assert!(size(MAX_PAYLOAD_SIZE + 1).is_err());
    }

    #[test]
    fn no_target_means_the_embedded_demo_with_the_reference_shape() {
        let c = Args::parse_from(["driver"]).config().unwrap();
        assert!(c.targets.is_empty());
        assert_eq!(c.concurrency, 200);
        assert_eq!(c.fanout, 5);
        assert_eq!(c.workload, WorkloadKind::Platform);
        assert_eq!(c.stop, Stop::Duration(DEFAULT_EMBEDDED_DURATION));
    }

    #[test]
    fn the_cli_contract_parses() {
        let c = Args::parse_from([
            "driver",
            "--target",
            "10.0.0.1:7700",
            "--target",
            "10.0.0.2:7700",
            "--workload",
            "echo",
            "--fanout",
            "3",
            "--concurrency",
            "64",
            "--duration",
            "30s",
            "--compress",
            "on",
            "--json",
            "out.json",
        ])
        .config()
        .unwrap();
        assert_eq!(c.targets.len(), 2);
        assert_eq!(c.stop, Stop::Duration(Duration::from_secs(30)));
        assert!(c.compression.is_some());
        assert_eq!(c.json.as_deref(), Some(std::path::Path::new("out.json")));
    }

    #[test]
    fn problems_are_listed_together() {
        let e = Args::parse_from([
            "driver",
            "--target",
            "nope",
            "--fanout",
            "0",
            "--concurrency",
            "0",
        ])
        .config()
        .unwrap_err();
        assert_eq!(e.0.len(), 3, "{e}");
    }

    #[test]
    fn rates_that_cannot_be_paced_are_refused() {
        for bad in ["1e10", "1e-300", "0", "inf", "NaN"] {
            assert!(
                Args::parse_from(["driver", "--rate", bad])
                    .config()
                    .is_err(),
                "{bad}"
            );
        }
        assert!(
            Args::parse_from(["driver", "--rate", "5000"])
                .config()
                .is_ok()
        );
        // One pacer for the run, whatever the connections: a request every 0.2 µs cannot
        // be paced.
        assert!(
            Args::parse_from([
                "driver",
                "--rate",
                "5e6",
                "--concurrency",
                "2",
                "--connections",
                "8"
            ])
            .config()
            .is_err()
        );
    }

    #[test]
    fn ramps_and_steps_set_the_schedule_and_the_runs_length() {
        let c = Args::parse_from(["driver", "--rate", "1000:20000", "--ramp", "60s"])
            .config()
            .unwrap();
        assert_eq!(
            c.schedule,
            Some(Schedule::Ramp {
                from: 1000.0,
                to: 20000.0,
                over: Duration::from_secs(60)
            })
        );
        assert_eq!(c.stop, Stop::Duration(Duration::from_secs(60)));
        let c = Args::parse_from([
            "driver",
            "--steps",
            "1000,2000,5000",
            "--step-duration",
            "10s",
            "--arrival",
            "poisson",
            "--pacer",
            "lean",
        ])
        .config()
        .unwrap();
        assert_eq!(c.stop, Stop::Duration(Duration::from_secs(30)));
        assert_eq!(c.arrival, Arrival::Poisson);
        assert_eq!(c.pacing, Pacing::Lean);
        assert!(
            Args::parse_from(["driver", "--rate", "1000:2000"])
                .config()
                .is_err(),
            "a ramp needs its length"
        );
        assert!(Args::try_parse_from(["driver", "--rate", "5", "--steps", "1,2"]).is_err());
    }

    #[test]
    fn serve_takes_a_role_by_its_name_and_nothing_else() {
        for role in [ServeRole::Provider, ServeRole::Broker] {
            let args = Args::parse_from(["driver", "serve", role.name(), "--threads", "1"]);
            let Some(Command::Serve(s)) = args.command else {
                panic!("not driver serve")
            };
            assert_eq!(s.role, role);
            assert_eq!(s.flags, ["--threads", "1"]);
        }
        assert!(Args::try_parse_from(["driver", "serve", "gateway"]).is_err());
    }

    #[test]
    fn targets_are_host_and_port_and_several_are_separated_by_commas() {
        for good in [
            "10.0.0.2:7700",
            "broker-1.lan:7700",
            "[::1]:7700",
            "localhost:1",
        ] {
            assert!(is_host_port(good), "{good}");
        }
        for bad in [
            "a:1 b:2",
            "10.0.0.2",
            "10.0.0.2:",
            ":7700",
            "::1:7700",
            "h:70000",
            "h:0",
            "h:+80",
            "a:1;b:2",
        ] {
            assert!(!is_host_port(bad), "{bad}");
        }
        let c = Args::parse_from(["driver", "--target", "a:1,b:2", "--target", "c:3"])
            .config()
            .unwrap();
        assert_eq!(c.targets, ["a:1", "b:2", "c:3"]);
        let e = Args::parse_from(["driver", "--target", "a:1 b:2"])
            .config()
            .unwrap_err();
        assert!(e.to_string().contains("separated by commas"), "{e}");
    }

    /// The problems of a run with `flags`, or none.
    fn problems(flags: &[&str]) -> Vec<String> {
        let argv = std::iter::once("driver").chain(flags.iter().copied());
        match Args::try_parse_from(argv).map(|a| a.config()) {
            Ok(Ok(_)) => Vec::new(),
            Ok(Err(e)) => e.0,
            Err(e) => vec![e.to_string()],
        }
    }

    #[test]
    fn flags_a_run_would_ignore_are_refused_saying_what_to_do() {
        for (flags, says) in [
            (&["--ramp", "10s"][..], "give --rate FROM:TO"),
            (&["--rate", "1000", "--ramp", "10s"], "give --rate FROM:TO"),
            (&["--steps", "1000,2000", "--ramp", "10s"], "drop --ramp"),
            (&["--step-duration", "5s"], "give --steps"),
            (&["--pacer", "lean"], "add --rate RATE or --steps RATES"),
            (
                &["--arrival", "poisson"],
                "add --rate RATE or --steps RATES",
            ),
            (&["--backlog", "10"], "add --rate RATE or --steps RATES"),
            (&["--allow-unsent"], "add --rate RATE or --steps RATES"),
            (&["--seed", "7"], "add --arrival poisson"),
            (&["--rate", "1000", "--seed", "7"], "add --arrival poisson"),
            (&["--payload-size", "1024"], "add --workload echo"),
            (&["--compress-level", "1"], "add --compress on"),
            (&["--compress-threshold", "1"], "add --compress on"),
            (
                &["--linger", "15s", "--metrics-listen", "off"],
                "drop one of them",
            ),
            (
                &["--stage-sample", "1", "--stage-metrics", "off"],
                "drop --stage-sample",
            ),
            (&["--parallel", "--fanout", "1"], "raise --fanout"),
        ] {
            let p = problems(flags);
            assert!(
                p.len() == 1 && p[0].contains(says),
                "{flags:?}: {p:?} should say {says:?}"
            );
        }
    }

    #[test]
    fn flags_that_go_together_are_taken_together_and_defaults_anywhere() {
        for flags in [
            &["--rate", "1000:2000", "--ramp", "10s"][..],
            &["--steps", "1000,2000", "--step-duration", "5s"],
            &["--rate", "1000", "--pacer", "lean", "--backlog", "10"],
            &["--rate", "1000", "--arrival", "poisson", "--seed", "7"],
            &["--workload", "echo", "--payload-size", "1024"],
            &["--compress", "on", "--compress-level", "1"],
            &["--linger", "15s"],
            // What an environment file writing every default would give a closed loop.
            &[
                "--arrival",
                "uniform",
                "--seed",
                "1",
                "--backlog",
                "100000",
                "--step-duration",
                "10s",
                "--payload-size",
                "32",
                "--compress-level",
                "6",
                "--compress-threshold",
                "64",
                "--stage-sample",
                "8",
            ],
        ] {
            assert_eq!(problems(flags), Vec::<String>::new(), "{flags:?}");
        }
    }

    #[test]
    fn metrics_endpoints_take_a_host_and_a_port_and_say_so_otherwise() {
        assert_eq!(
            parse_metrics_endpoint("127.0.0.1:9770"),
            Ok("127.0.0.1:9770".parse().unwrap())
        );
        assert!(parse_metrics_endpoint("localhost:9770").is_ok());
        for bad in ["9770", ":9770", "10.0.0.2"] {
            let e = parse_metrics_endpoint(bad).unwrap_err();
            assert!(e.contains("e.g. 10.0.0.2:9770"), "{e}");
        }
    }

    #[test]
    fn connections_never_exceed_users() {
        let c = Args::parse_from(["driver", "--concurrency", "2", "--connections", "8"])
            .config()
            .unwrap();
        assert_eq!(c.connections, 2);
    }
}
