//! Broker configuration: the command line (each flag with an environment fallback), the
//! defaults and why they are what they are, and validation into [`BrokerConfig`]. The
//! upstream syntax is `upstream_spec`'s.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use rpcmesh_common::cli::OnOff;
use rpcmesh_common::cli::flags::{LimitArgs, RuntimeArgs, StageArgs};
use rpcmesh_common::cli::security::{AuthzArgs, ServerTlsArgs};
use rpcmesh_common::cli::values::{parse_bytes_u32, parse_duration_or_off, parse_listen_addr};
use rpcmesh_common::cli::{ConfigProblems, ConfigWarnings, DurationArg, MetricsListen};
use rpcmesh_common::metrics::families::DEFAULT_STAGE_SAMPLE;
use rpcmesh_common::net::budget::DEFAULT_MEMORY_BUDGET;
use rpcmesh_common::net::session::{DEFAULT_MAX_IN_FLIGHT_PER_LINK, Timeouts};
use rpcmesh_common::net::slots::KEYED_SLOTS;
use rpcmesh_common::net::sources::SourceLimits;
use rpcmesh_common::net::tls::{ClientTlsSettings, ServerTlsSettings};
use rpcmesh_wire::PeerKind;
use rpcmesh_wire::frame::DEFAULT_MAX_BODY_LEN;

use crate::upstream_spec::UpstreamSpec;

/// Where the broker listens unless told otherwise: every interface, port 7700.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7700));
/// Where the broker serves `/metrics` unless told otherwise (`off` disables it): port
/// 9770, beside the provider's 9780 and the driver's 9790, so all three fit on one host.
pub const DEFAULT_METRICS_LISTEN: MetricsListen = MetricsListen(Some(SocketAddr::V4(
    SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 9770),
)));
/// Balancing unless told otherwise: of two providers picked at random, the one whose
/// latency estimate × (calls in flight + 1) is lower (PeakEWMA, as linkerd balances): it
/// keeps load even without a shared view (each session picks on its own), as the least
/// loaded of two does, and also sends almost nothing to a provider that slowed down.
/// With a provider 20 ms slow beside a healthy one at 5,000 calls/s (open loop, release
/// build), the slow one got 0.1 % of the calls and p99 was 1.2 ms, against 1.7 % and
/// 20.3 ms by least loaded (docs/resilience.md, "Figures").
pub const DEFAULT_BALANCE: Balance = Balance::PeakEwma;
/// Client connections open at once. The reference workload runs 200 users per driver;
/// 10,000 leaves room for fifty such drivers. Beyond it, connections are accepted and
/// closed at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Calls in flight per client connection. A driver multiplexes many users on one
/// connection; 4096 is far above what one connection needs to fill a provider, and low
/// enough that one runaway client cannot take the whole broker.
pub const DEFAULT_MAX_IN_FLIGHT_PER_CONN: usize = 4096;
/// Calls in flight in the whole broker: bounds its memory (a call holds one request
/// frame) at a few tens of MB for small calls.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 65_536;
/// Calls in flight per upstream connection (waiting to be written or for the reply).
pub const DEFAULT_MAX_IN_FLIGHT_PER_UPSTREAM_CONN: usize = DEFAULT_MAX_IN_FLIGHT_PER_LINK;
/// Pooled connections per provider. The reference report recommends 2-4 per core; 4
/// gives a 2-4 core provider one busy connection per core with room to spare, and each
/// connection carries thousands of calls at once.
pub const DEFAULT_POOL_SIZE: u32 = 4;
/// How long a call may take, from the broker reading it to the provider's reply. Long
/// enough for queueing under heavy load, short enough that a stuck provider shows up fast.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting to a provider may take before the attempt counts as failed.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How often pooled connections are checked with a heartbeat round trip. Broken
/// connections are noticed at once anyway; this catches the silent ones.
pub const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(1);
/// How long a health-check heartbeat may take before the connection is replaced.
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(1);
/// How long SIGTERM waits for calls in flight: above the call timeout, so every call in
/// flight gets its answer or its timeout before the broker exits.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// How long a worker keeps polling for I/O after a read before it sleeps (`--busy-poll`,
/// `auto` with one worker thread). A call's next step (the provider's reply, the caller's
/// next request) arrives within tens of microseconds on a fast network; 50 µs covers that,
/// so a broker under steady traffic never sleeps and its peers never pay to wake it, and
/// an idle one stops spinning 50 µs after the last read. Any window from 10 to 200 µs
/// does as well within the noise (the runs: docs/log/performance-runs.md).
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(50);
/// Calls in flight up to which a provider's connections are filled one after the other
/// (`--pack-in-flight`); see `route::Router` for why.
pub const DEFAULT_PACK_IN_FLIGHT: usize = 64;
/// How long packing may make a call wait behind the calls ahead of it on one of a
/// provider's connections (`--pack-wait`; see `upstream::pace`): about one round trip
/// through the broker at a few calls in flight (the broker path's p50 at 8 × 1 on 2 vCPUs
/// is about 100 µs), so that a packed call waits at most as long again as it would
/// spread. It packs about fourteen calls behind a plain v1 server that takes 7 µs per echo
/// on one connection (the classic server here, wake-ups included), five behind an rpcmesh
/// provider whose handlers burn 20 µs of CPU a call, the whole `--pack-in-flight` behind
/// the echo provider (under 1 µs), and none behind one that takes 100 µs or more per call.
pub const DEFAULT_PACK_WAIT: Duration = Duration::from_micros(100);

/// The broker speaks plain RPCF v1 to its providers unless told otherwise
/// (`--upstream-tls`): each hop's TLS is its own choice.
pub const DEFAULT_UPSTREAM_TLS: bool = false;

/// Cells of a broker that the library runs (`BrokerConfig::with_upstreams`): one, the
/// runtime `run` is called on, which is what a test's runtime expects. The command line's
/// `--threads` sets it (one cell per thread).
pub const DEFAULT_CELLS: usize = 1;

/// What `--threads` means to the broker (the runtime flag every program takes).
const THREADS_HELP: &str = "Threads, each a cell serving its own client connections over its own share of each provider's pool (0 = one per CPU)";

/// Which engine serves the calls (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EngineKind {
    /// Tasks on Tokio runtimes (`crate::session`, `crate::upstream`, `crate::cell`): the
    /// engine the broker had first, kept for comparison and as a fallback.
    Tokio,
    /// Per thread one epoll loop owning its connections outright (`crate::engine`): the
    /// default, at about two thirds of the Tokio engine's instructions per call and
    /// under a third of its user time; where it differs from the Tokio engine is in its
    /// module doc.
    #[default]
    Loop,
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineKind::Tokio => "tokio",
            EngineKind::Loop => "loop",
        })
    }
}

/// Where a broker of several cells puts its client connections (`--cell-placement`;
/// `crate::cell::placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CellPlacement {
    /// On as few cells as keep up with them, more only when a trial shows another cell
    /// answers more calls: a broker given more threads than it has cores to itself is
    /// never slower than one cell.
    #[default]
    Gather,
    /// Over every cell from the start, and never moved: for cores known to be the
    /// broker's own.
    Spread,
}

impl fmt::Display for CellPlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CellPlacement::Gather => "gather",
            CellPlacement::Spread => "spread",
        })
    }
}

/// How a gathering broker judges its cells (`crate::cell::placement`); the defaults are
/// its named constants. Not on the command line: tests shorten the review and force
/// trials with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacementTuning {
    /// How often the placement looks.
    pub review: Duration,
    /// The per cent of a review an open cell must have been busy to try one more.
    pub spread_busy_pct: u32,
    /// The per cent of the calls before a trial that its review must beat to be kept.
    pub spread_gain_pct: u32,
    /// Reviews of a steady load a trial needs before it (0: none, any load will do).
    pub steady_reviews: usize,
    /// The per cent of a core per remaining cell under which the open cells' work is
    /// gathered onto one fewer without a trial.
    pub gather_below_pct: u32,
    /// Whether one fewer cell is tried when several are open and none is busy (a light
    /// load is gathered whatever this says).
    pub gather_trials: bool,
}

impl Default for PlacementTuning {
    fn default() -> Self {
        use crate::cell::placement;
        PlacementTuning {
            review: placement::REVIEW,
            spread_busy_pct: placement::SPREAD_BUSY_PCT,
            spread_gain_pct: placement::SPREAD_GAIN_PCT,
            steady_reviews: placement::STEADY_REVIEWS,
            gather_below_pct: placement::GATHER_BELOW_PCT,
            gather_trials: true,
        }
    }
}

/// Whether the broker busy-polls after reads (`--busy-poll`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusyPoll {
    /// [`DEFAULT_BUSY_POLL`] when each thread serving calls is a runtime of its own: one
    /// cell, or cells placed by [`CellPlacement::Gather`] (a cell without connections
    /// reads nothing and never spins); else off: cells spread from the start would keep a
    /// core per cell spinning while traffic flows, which on a machine the broker shares
    /// costs its peers more than the wake-ups it spares them (docs/performance.md,
    /// "Scaling with threads: cells"), and in a runtime of several workers a spinning
    /// worker cannot take the reactor from one blocked in `epoll_wait` (see
    /// `rpcmesh_common::net::busy_poll`).
    Auto,
    /// Sleep at once when there is nothing to do.
    Off,
    /// Poll this long after each read, whatever the thread count.
    Window(Duration),
}

impl BusyPoll {
    /// The window to use with `workers` threads serving calls (cells, or a runtime's worker
    /// threads); `None` = off.
    pub fn window(self, workers: usize) -> Option<Duration> {
        match self {
            BusyPoll::Auto => (workers == 1).then_some(DEFAULT_BUSY_POLL),
            BusyPoll::Off => None,
            BusyPoll::Window(w) => Some(w),
        }
    }
}

/// `--busy-poll`: `auto`, `off`, or a duration (`0` = off).
impl FromStr for BusyPoll {
    type Err = String;
    fn from_str(s: &str) -> Result<BusyPoll, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(BusyPoll::Auto);
        }
        match parse_duration_or_off(s)? {
            Some(d) if !d.is_zero() => Ok(BusyPoll::Window(d)),
            _ => Ok(BusyPoll::Off),
        }
    }
}

impl fmt::Display for BusyPoll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BusyPoll::Auto => f.write_str("auto"),
            BusyPoll::Off => f.write_str("off"),
            BusyPoll::Window(w) => write!(f, "{}", DurationArg(*w)),
        }
    }
}

/// How calls are spread over the providers of a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Balance {
    /// Of two providers picked at random, the lower latency estimate × (calls in flight
    /// + 1) (PeakEWMA, `resilience::ewma`).
    PeakEwma,
    /// Least outstanding calls of two providers picked at random ("power of two choices").
    P2c,
    /// Each provider in turn.
    RoundRobin,
}

/// As the flag writes it: `p2c`, `round-robin`.
impl fmt::Display for Balance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use clap::ValueEnum;
        match self.to_possible_value() {
            Some(v) => f.write_str(v.get_name()),
            None => write!(f, "{self:?}"),
        }
    }
}

/// The broker's command line.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "broker",
    version = rpcmesh_common::build::VERSION_LINE,
    about = "rpcmesh broker: a stateless RPCF v1 proxy that pools and balances calls to providers",
    mut_arg("threads", |a| a.help(THREADS_HELP))
)]
pub struct Args {
    /// Address to listen on for client connections: IP:PORT, or :PORT for every interface.
    #[arg(long, env = "RPCMESH_BROKER_LISTEN", default_value_t = DEFAULT_LISTEN, value_parser = parse_listen_addr)]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint (IP:PORT, or :PORT for every
    /// interface), or `off`.
    #[arg(long, env = "RPCMESH_METRICS_LISTEN", default_value_t = DEFAULT_METRICS_LISTEN)]
    pub metrics_listen: MetricsListen,
    /// An rpcmesh provider: HOST:PORT (any service) or SERVICE[,SERVICE]=HOST:PORT, the
    /// services named as their protobuf definitions name them (EchoService,
    /// platform.PlatformService) with no blank after the commas. Repeatable.
    #[arg(long = "upstream", env = "RPCMESH_UPSTREAMS", value_delimiter = ' ')]
    pub upstreams: Vec<String>,
    /// A plain RPCF v1 server, same syntax: it is sent only plain v1 frames. Repeatable.
    #[arg(
        long = "upstream-v1",
        env = "RPCMESH_UPSTREAMS_V1",
        value_delimiter = ' '
    )]
    pub upstreams_v1: Vec<String>,
    /// A file of more providers, one a line in the --upstream syntax (`v1 ` before a
    /// plain v1 server, `#` comments). Read again on SIGHUP and when it changes:
    /// providers join and leave (draining) without a restart.
    #[arg(long, env = "RPCMESH_PROVIDERS_FILE")]
    pub providers_file: Option<PathBuf>,
    /// Let the providers file list no provider: without it, a file that lists none (left
    /// empty, or cut short by a failed write) is refused as a bad one is, and the
    /// providers stay as they were.
    #[arg(long, env = "RPCMESH_ALLOW_EMPTY_PROVIDERS")]
    pub allow_empty_providers: bool,
    /// How calls are spread over the providers of a service.
    #[arg(long, env = "RPCMESH_BALANCE", value_enum, default_value_t = DEFAULT_BALANCE)]
    pub balance: Balance,
    /// The runtime.
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Pooled connections per provider (with several --threads, divided among them,
    /// rounded up: at least one per thread).
    #[arg(long, env = "RPCMESH_POOL_SIZE", default_value_t = DEFAULT_POOL_SIZE)]
    pub pool_size: u32,
    /// Per-call timeout (e.g. 5s, 500ms).
    #[arg(long, env = "RPCMESH_CALL_TIMEOUT", default_value_t = DurationArg(DEFAULT_CALL_TIMEOUT))]
    pub call_timeout: DurationArg,
    /// Timeout for connecting to a provider.
    #[arg(long, env = "RPCMESH_CONNECT_TIMEOUT", default_value_t = DurationArg(DEFAULT_CONNECT_TIMEOUT))]
    pub connect_timeout: DurationArg,
    /// Interval of the heartbeat check on pooled connections.
    #[arg(long, env = "RPCMESH_HEALTH_INTERVAL", default_value_t = DurationArg(DEFAULT_HEALTH_INTERVAL))]
    pub health_interval: DurationArg,
    /// Timeout of one health-check heartbeat.
    #[arg(long, env = "RPCMESH_HEALTH_TIMEOUT", default_value_t = DurationArg(DEFAULT_HEALTH_TIMEOUT))]
    pub health_timeout: DurationArg,
    /// Client connections open at once.
    #[arg(long, env = "RPCMESH_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Calls in flight per client connection; over it, calls are answered "overloaded".
    #[arg(long, env = "RPCMESH_MAX_IN_FLIGHT_PER_CONN", default_value_t = DEFAULT_MAX_IN_FLIGHT_PER_CONN)]
    pub max_in_flight_per_conn: usize,
    /// Calls in flight in the whole broker; over it, calls are answered "overloaded".
    /// With several threads each leases it in blocks, so one may be refused a little
    /// below it while the others hold part of it unused.
    #[arg(long, env = "RPCMESH_MAX_IN_FLIGHT", default_value_t = DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// Calls in flight per upstream connection (at most 65,536).
    #[arg(long, env = "RPCMESH_MAX_IN_FLIGHT_PER_UPSTREAM_CONN", default_value_t = DEFAULT_MAX_IN_FLIGHT_PER_UPSTREAM_CONN)]
    pub max_in_flight_per_upstream_conn: usize,
    /// Largest frame body accepted, in bytes (a number, or with KiB or MiB).
    #[arg(long, env = "RPCMESH_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_LEN, value_parser = parse_bytes_u32)]
    pub max_body_bytes: u32,
    /// Grace period for calls in flight on SIGTERM/SIGINT.
    #[arg(long, env = "RPCMESH_GRACE", default_value_t = DurationArg(DEFAULT_GRACE))]
    pub grace: DurationArg,
    /// Connection timeouts and the memory budget.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Keep polling for I/O this long after each read instead of sleeping (e.g. 50us),
    /// `off`, or `auto`: 50us when the broker runs one thread (`--threads 1`) or gathers
    /// its cells (`--cell-placement gather`), else off. Spares peers the cost of waking the broker and cuts its latency, at the price
    /// of one busy core while traffic flows (yielded to any thread that waits for it).
    #[arg(long, env = "RPCMESH_BUSY_POLL", default_value_t = BusyPoll::Auto)]
    pub busy_poll: BusyPoll,
    /// With several threads (cells): `gather` keeps the client connections on as few
    /// cells as keep up and spreads them only when a trial shows more calls answered, so
    /// that threads without cores of their own cost nothing; `spread` deals them over
    /// every cell from the start.
    #[arg(long, env = "RPCMESH_CELL_PLACEMENT", value_enum, default_value_t = CellPlacement::Gather)]
    pub cell_placement: CellPlacement,
    /// Which engine serves the calls: `loop`, an epoll loop per thread that owns its
    /// connections (the default: about two thirds of the instructions per call, and it
    /// leaves the CPU to the providers and callers beside it); or `tokio`, tasks on Tokio
    /// runtimes, the engine the broker had first (docs/performance.md, "The loop
    /// engine").
    #[arg(long, env = "RPCMESH_BROKER_ENGINE", value_enum, default_value_t = EngineKind::Loop)]
    pub engine: EngineKind,
    /// The most calls in flight to which a provider's connections are filled one after
    /// the other (fewer, larger batches); 0 = always the less loaded of two. A provider
    /// that takes longer per call is packed less deep, as `--pack-wait` says.
    #[arg(long, env = "RPCMESH_PACK_IN_FLIGHT", default_value_t = DEFAULT_PACK_IN_FLIGHT)]
    pub pack_in_flight: usize,
    /// How long a call may wait behind the calls ahead of it on one of a provider's
    /// connections, which it works through one after another: the broker knows how long
    /// the provider takes per call (a plain v1 server's it measures, an rpcmesh provider
    /// reports its own) and packs a connection only as deep as that allows (0 = never
    /// pack).
    #[arg(long, env = "RPCMESH_PACK_WAIT", default_value_t = DurationArg(DEFAULT_PACK_WAIT))]
    pub pack_wait: DurationArg,
    /// Per-stage latency timing.
    #[command(flatten)]
    pub stages: StageArgs,
    /// TLS on the main address, and a plain one beside it.
    #[command(flatten)]
    pub tls: ServerTlsArgs,
    /// Speak TLS to the providers (on|off), verifying them against --tls-ca and presenting
    /// --tls-cert, which identifies the broker to them; calls then carry their callers'
    /// identities to the providers that take them.
    #[arg(long, env = "RPCMESH_UPSTREAM_TLS", default_value_t = OnOff(DEFAULT_UPSTREAM_TLS))]
    pub upstream_tls: OnOff,
    /// Who may call what.
    #[command(flatten)]
    pub authz: AuthzArgs,
    /// Outlier ejection, the latency estimate, the retry budget.
    #[command(flatten)]
    pub resilience: crate::resilience::ResilienceArgs,
}

/// Validated broker settings, as `run` takes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Providers of the flags (always served).
    pub upstreams: Vec<UpstreamSpec>,
    /// The providers file, whose providers are served too (read at the start, on
    /// SIGHUP and when it changes; see `providers_file`).
    pub providers_file: Option<PathBuf>,
    /// The providers file may list no provider (`--allow-empty-providers`).
    pub allow_empty_providers: bool,
    /// Balancing across the providers of a service.
    pub balance: Balance,
    /// Pooled connections per provider.
    pub pool_size: u32,
    /// Per-call timeout.
    pub call_timeout: Duration,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Health-check interval.
    pub health_interval: Duration,
    /// Health-check timeout.
    pub health_timeout: Duration,
    /// Client connections open at once.
    pub max_connections: usize,
    /// Limits on each source of client connections.
    pub sources: SourceLimits,
    /// Calls in flight per client connection.
    pub max_in_flight_per_conn: usize,
    /// Calls in flight in total.
    pub max_in_flight: usize,
    /// Calls in flight per upstream connection.
    pub max_in_flight_per_upstream_conn: usize,
    /// Largest frame body.
    pub max_body_len: u32,
    /// Drain time on shutdown.
    pub grace: Duration,
    /// Idle, frame and write timeouts of every accepted connection.
    pub timeouts: Timeouts,
    /// Bytes the process may buffer.
    pub memory_budget: usize,
    /// Busy polling after reads.
    pub busy_poll: BusyPoll,
    /// Calls in flight up to which a provider's connections are filled in order; 0 = off.
    pub pack_in_flight: usize,
    /// How long packing may make a call wait behind others on one of a provider's
    /// connections; 0 = never pack.
    pub pack_wait: Duration,
    /// Stages are timed on one call in this many; 0 = not at all.
    pub stage_sample: u32,
    /// Settings that do nothing as given, logged when the broker starts.
    pub warnings: ConfigWarnings,
    /// TLS on the main address (`None`: plain).
    pub tls: Option<ServerTlsSettings>,
    /// TLS towards the providers (`None`: plain).
    pub upstream_tls: Option<ClientTlsSettings>,
    /// The authorization policy's file (`None`: every call is allowed).
    pub authz_policy: Option<PathBuf>,
    /// Outlier ejection, the latency estimate, the retry budget.
    pub resilience: crate::resilience::ResilienceConfig,
    /// The calls the flags mark idempotent (`--idempotent`; the providers file may mark
    /// more): lost in flight, they are sent again.
    pub idempotent: rpcmesh_common::retry::Idempotent,
    /// Cells: threads that each serve their own client connections over their own
    /// provider connections (`--threads`; `crate::cell`). 1: the runtime `run` is called
    /// on serves everything itself.
    pub cells: usize,
    /// Where the cells' client connections go.
    pub cell_placement: CellPlacement,
    /// How the placement judges the cells when it gathers.
    pub placement_tuning: PlacementTuning,
    /// The engine that serves the calls (`--engine`).
    pub engine: EngineKind,
}

impl BrokerConfig {
    /// The longest one pooled connection may take to be made and pass its first heartbeat
    /// (`--connect-timeout` + `--health-timeout`): bb8's wait for a connection, and so the
    /// longest a pool's round of checks takes.
    pub fn checkout_timeout(&self) -> Duration {
        self.connect_timeout + self.health_timeout
    }

    /// Whether the providers file may list no provider.
    pub fn if_empty(&self) -> crate::providers_file::IfEmpty {
        crate::providers_file::IfEmpty::allowed(self.allow_empty_providers)
    }

    /// Defaults with the given providers (each serving any service).
    pub fn with_upstreams<S: Into<String>>(addrs: impl IntoIterator<Item = S>) -> Self {
        BrokerConfig {
            upstreams: addrs
                .into_iter()
                .map(|a| UpstreamSpec {
                    addr: a.into(),
                    services: Vec::new(),
                    kind: PeerKind::Rpcmesh,
                })
                .collect(),
            providers_file: None,
            allow_empty_providers: false,
            balance: DEFAULT_BALANCE,
            pool_size: DEFAULT_POOL_SIZE,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            health_interval: DEFAULT_HEALTH_INTERVAL,
            health_timeout: DEFAULT_HEALTH_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            sources: SourceLimits::default(),
            max_in_flight_per_conn: DEFAULT_MAX_IN_FLIGHT_PER_CONN,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_in_flight_per_upstream_conn: DEFAULT_MAX_IN_FLIGHT_PER_UPSTREAM_CONN,
            max_body_len: DEFAULT_MAX_BODY_LEN,
            grace: DEFAULT_GRACE,
            timeouts: Timeouts::default(),
            memory_budget: DEFAULT_MEMORY_BUDGET,
            busy_poll: BusyPoll::Auto,
            pack_in_flight: DEFAULT_PACK_IN_FLIGHT,
            pack_wait: DEFAULT_PACK_WAIT,
            stage_sample: DEFAULT_STAGE_SAMPLE,
            warnings: ConfigWarnings::default(),
            tls: None,
            upstream_tls: None,
            authz_policy: None,
            resilience: crate::resilience::ResilienceConfig::default(),
            idempotent: rpcmesh_common::retry::Idempotent::default(),
            cells: DEFAULT_CELLS,
            cell_placement: CellPlacement::Gather,
            engine: EngineKind::Loop,
            placement_tuning: PlacementTuning::default(),
        }
    }
}

impl Args {
    /// Checks every setting and lists all problems at once.
    pub fn config(&self) -> Result<BrokerConfig, ConfigProblems> {
        let mut p = ConfigProblems::default();
        let timeouts = self.limits.timeouts(&mut p);
        let memory_budget = self.limits.memory_budget(&mut p);
        let mut upstreams = Vec::new();
        let lists = [
            ("--upstream", &self.upstreams, PeerKind::Rpcmesh),
            ("--upstream-v1", &self.upstreams_v1, PeerKind::V1),
        ];
        for (flag, list, kind) in lists {
            for s in list.iter().filter(|s| !s.trim().is_empty()) {
                match UpstreamSpec::parse(s, kind) {
                    Ok(u) if upstreams.iter().any(|o: &UpstreamSpec| o.addr == u.addr) => {
                        p.0.push(format!(
                            "{flag} {s:?}: provider {} is given twice; an address names one provider (its pool and its metrics): list its services once, SERVICE,SERVICE=HOST:PORT",
                            u.addr
                        ));
                    }
                    Ok(u) => upstreams.push(u),
                    Err(e) => p.0.push(format!("{flag} {e}")),
                }
            }
        }
        // A providers file is read now, so that a broker does not start on a file that
        // is missing or wrong; it may list no provider yet (they are added later) only
        // with --allow-empty-providers.
        let if_empty = crate::providers_file::IfEmpty::allowed(self.allow_empty_providers);
        if let Some(path) = &self.providers_file {
            if let Err(e) = crate::providers_file::read(path, &upstreams, if_empty) {
                p.0.push(e.to_string());
            }
        }
        // Only when none is given: a bad one is named above.
        let none_given = self
            .upstreams
            .iter()
            .chain(&self.upstreams_v1)
            .all(|s| s.trim().is_empty());
        p.check(none_given && self.providers_file.is_none(), || {
            "no provider: give at least one --upstream HOST:PORT or a --providers-file".into()
        });
        p.check(self.pool_size == 0, || {
            "--pool-size must be at least 1".into()
        });
        p.check(self.call_timeout.0.is_zero(), || {
            "--call-timeout must be above zero".into()
        });
        p.check(self.connect_timeout.0.is_zero(), || {
            "--connect-timeout must be above zero".into()
        });
        p.check(self.health_interval.0.is_zero(), || {
            "--health-interval must be above zero".into()
        });
        p.check(self.health_timeout.0.is_zero(), || {
            "--health-timeout must be above zero".into()
        });
        p.check(self.max_connections == 0, || {
            "--max-connections must be at least 1".into()
        });
        p.check(self.max_in_flight_per_conn == 0, || {
            "--max-in-flight-per-conn must be at least 1".into()
        });
        p.check(self.max_in_flight == 0, || {
            "--max-in-flight must be at least 1".into()
        });
        p.check(self.max_in_flight_per_upstream_conn == 0, || {
            "--max-in-flight-per-upstream-conn must be at least 1".into()
        });
        p.check(self.max_in_flight_per_upstream_conn > KEYED_SLOTS, || {
            format!(
                "--max-in-flight-per-upstream-conn {} is over {KEYED_SLOTS}: a connection's calls are told apart by a 16-bit slot in their ids (their other bits keep each frame's CRC as it came)",
                self.max_in_flight_per_upstream_conn
            )
        });
        p.check(self.max_body_bytes < 64, || {
            format!(
                "--max-body-bytes {} is too small for any call (at least 64)",
                self.max_body_bytes
            )
        });
        let mut w = ConfigWarnings::default();
        w.check(
            self.allow_empty_providers && self.providers_file.is_none(),
            || "--allow-empty-providers does nothing without --providers-file".into(),
        );
        let sources = self.limits.sources(&mut p, &mut w);
        w.check(self.grace.0 < self.call_timeout.0, || {
            format!(
                "--grace {} is below --call-timeout {}: at SIGTERM, calls still in flight after {} are answered \"unavailable\" rather than waited for",
                self.grace, self.call_timeout, self.grace
            )
        });
        w.check(
            self.pack_wait.0.is_zero() && self.pack_in_flight != DEFAULT_PACK_IN_FLIGHT,
            || {
                format!(
                    "--pack-in-flight {} does nothing with --pack-wait 0 (connections are never packed)",
                    self.pack_in_flight
                )
            },
        );
        w.check(
            self.pack_in_flight == 0 && self.pack_wait.0 != DEFAULT_PACK_WAIT,
            || {
                format!(
                    "--pack-wait {} does nothing with --pack-in-flight 0 (connections are never packed)",
                    self.pack_wait
                )
            },
        );
        self.stages.warnings(self.metrics_listen, &mut w);
        let resilience = self.resilience.config(&mut p);
        let idempotent = self.resilience.idempotent.calls(&mut p);
        let tls = self.tls.server(&mut p);
        let upstream_tls = if self.upstream_tls.0 {
            self.tls.client(&mut p)
        } else {
            None
        };
        if let Some(path) = &self.authz.authz_policy {
            if let Err(e) = rpcmesh_common::authz::Policy::read(path) {
                p.0.push(e.to_string());
            }
        }
        p.into_result(BrokerConfig {
            upstreams,
            providers_file: self.providers_file.clone(),
            allow_empty_providers: self.allow_empty_providers,
            balance: self.balance,
            pool_size: self.pool_size,
            call_timeout: self.call_timeout.0,
            connect_timeout: self.connect_timeout.0,
            health_interval: self.health_interval.0,
            health_timeout: self.health_timeout.0,
            max_connections: self.max_connections,
            sources,
            max_in_flight_per_conn: self.max_in_flight_per_conn,
            max_in_flight: self.max_in_flight,
            max_in_flight_per_upstream_conn: self.max_in_flight_per_upstream_conn,
            max_body_len: self.max_body_bytes,
            grace: self.grace.0,
            timeouts,
            memory_budget,
            busy_poll: self.busy_poll,
            pack_in_flight: self.pack_in_flight,
            pack_wait: self.pack_wait.0,
            stage_sample: self.stages.every(self.metrics_listen),
            warnings: w,
            tls,
            upstream_tls,
            authz_policy: self.authz.authz_policy.clone(),
            resilience,
            idempotent,
            cells: match self.runtime.threads {
                0 => rpcmesh_common::cli::startup::default_threads(),
                n => n,
            },
            cell_placement: self.cell_placement,
            placement_tuning: PlacementTuning::default(),
            engine: self.engine,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn busy_polling_is_auto_by_default_and_can_be_set_or_turned_off() {
        let config = |extra: &[&str]| {
            let mut argv = vec!["broker", "--upstream", "127.0.0.1:7800"];
            argv.extend_from_slice(extra);
            Args::parse_from(argv).config().unwrap().busy_poll
        };
        assert_eq!(config(&[]), BusyPoll::Auto);
        assert_eq!(BusyPoll::Auto.window(1), Some(DEFAULT_BUSY_POLL));
        assert_eq!(BusyPoll::Auto.window(2), None);
        let set = config(&["--busy-poll", "200us"]);
        assert_eq!(set, BusyPoll::Window(Duration::from_micros(200)));
        assert_eq!(set.window(4), Some(Duration::from_micros(200)));
        assert_eq!(config(&["--busy-poll", "off"]), BusyPoll::Off);
        assert_eq!(config(&["--busy-poll", "0"]), BusyPoll::Off);
        assert_eq!(BusyPoll::Off.window(1), None);
        assert_eq!(
            BrokerConfig::with_upstreams(["x:1"]).busy_poll,
            BusyPoll::Auto
        );
        assert!(Args::try_parse_from(["broker", "--busy-poll", "soon"]).is_err());
    }

    #[test]
    fn an_upstream_and_no_other_flag_give_the_default_config() {
        let c = Args::parse_from(["broker", "--upstream", "127.0.0.1:7800"])
            .config()
            .unwrap();
        // The command line's cells are one per CPU (`--threads 0`), the library's one.
        let cells = rpcmesh_common::cli::startup::default_threads();
        let defaults = BrokerConfig {
            cells,
            ..BrokerConfig::with_upstreams(["127.0.0.1:7800"])
        };
        assert_eq!(c, defaults);
        // No flag at all is refused: a broker needs a provider.
        let e = Args::parse_from(["broker"]).config().unwrap_err();
        assert_eq!(
            e.0,
            ["no provider: give at least one --upstream HOST:PORT or a --providers-file"]
        );
    }

    #[test]
    fn a_providers_file_must_be_there_and_valid_at_the_start_and_may_list_none_if_allowed() {
        let dir = std::env::temp_dir().join(format!("rpcmesh-bcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("providers");
        let with_file = |extra: &[&str]| {
            let mut argv = vec!["broker", "--providers-file", path.to_str().unwrap()];
            argv.extend_from_slice(extra);
            Args::parse_from(argv).config()
        };
        let e = with_file(&[]).unwrap_err();
        assert!(e.0[0].starts_with("providers file "), "{e}");
        std::fs::write(
            &path,
            "# none yet
",
        )
        .unwrap();
        let e = with_file(&[]).unwrap_err();
        assert!(e.0[0].contains("lists no provider"), "{e}");
        let c = with_file(&["--allow-empty-providers"]).unwrap();
        assert_eq!(c.providers_file.as_deref(), Some(path.as_path()));
        assert!(c.upstreams.is_empty());
        std::fs::write(
            &path, "a:1
bad
",
        )
        .unwrap();
        let e = with_file(&["--upstream", "a:1"]).unwrap_err();
        assert_eq!(e.0.len(), 1, "{e}");
        assert!(
            e.0[0].contains("line 1: provider a:1 is given by a flag already; line 2: \"bad\""),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn busy_poll_values_read_back_what_they_print() {
        for b in [
            BusyPoll::Auto,
            BusyPoll::Off,
            BusyPoll::Window(DEFAULT_BUSY_POLL),
        ] {
            assert_eq!(b.to_string().parse::<BusyPoll>(), Ok(b), "{b}");
        }
    }

    #[test]
    fn an_upstream_that_cannot_be_meant_is_refused_saying_what_is_wrong() {
        let e = Args::parse_from([
            "broker",
            "--upstream",
            "EchoService;PlatformService=p1:7800",
            "--upstream-v1",
            "p2",
        ])
        .config()
        .unwrap_err();
        assert_eq!(
            e.0,
            [
                "--upstream \"EchoService;PlatformService=p1:7800\": service name \"EchoService;PlatformService\" has ';', which a service name cannot have: separate services with \",\"; the form is HOST:PORT (any service) or SERVICE[,SERVICE]=HOST:PORT",
                "--upstream-v1 \"p2\": \"p2\" has no port: write HOST:PORT; the form is HOST:PORT (any service) or SERVICE[,SERVICE]=HOST:PORT",
            ]
        );
        // A blank after a comma splits the value in two (blanks separate providers).
        let e = Args::parse_from([
            "broker",
            "--upstream",
            "EchoService, PlatformService=p1:7800",
        ])
        .config()
        .unwrap_err();
        assert!(e.0[0].contains("ends with \",\""), "{e}");
    }

    #[test]
    fn a_provider_given_twice_is_refused() {
        let e = Args::parse_from([
            "broker",
            "--upstream",
            "EchoService=p:1",
            "--upstream",
            "PlatformService=p:1",
            "--upstream-v1",
            "p:1",
        ])
        .config()
        .unwrap_err();
        assert_eq!(e.0.len(), 2, "{e}");
        assert!(
            e.0[0].starts_with("--upstream \"PlatformService=p:1\": provider p:1 is given twice"),
            "{e}"
        );
        assert!(e.0[1].starts_with("--upstream-v1 \"p:1\""), "{e}");
    }

    #[test]
    fn flags_that_do_nothing_as_given_are_warned_of() {
        let warnings = |extra: &[&str]| {
            let mut argv = vec!["broker", "--upstream", "p:1"];
            argv.extend_from_slice(extra);
            Args::parse_from(argv).config().unwrap().warnings.0
        };
        assert!(warnings(&[]).is_empty());
        let w = warnings(&["--grace", "2s"]);
        assert!(
            w[0].starts_with("--grace 2s is below --call-timeout 5s"),
            "{w:?}"
        );
        let w = warnings(&["--pack-wait", "0", "--pack-in-flight", "8"]);
        assert!(w[0].starts_with("--pack-in-flight 8 does nothing"), "{w:?}");
        let w = warnings(&["--pack-in-flight", "0", "--pack-wait", "1ms"]);
        assert!(w[0].starts_with("--pack-wait 1ms does nothing"), "{w:?}");
        let w = warnings(&["--metrics-listen", "off", "--stage-sample", "2"]);
        assert!(w[0].starts_with("--stage-sample 2 does nothing"), "{w:?}");
        assert!(Args::try_parse_from(["broker", "--stage-sample", "0"]).is_err());
    }

    #[test]
    fn a_body_limit_takes_a_unit_or_a_count_of_bytes() {
        let limit = |v: &str| {
            Args::parse_from(["broker", "--upstream", "p:1", "--max-body-bytes", v])
                .config()
                .unwrap()
                .max_body_len
        };
        assert_eq!(limit("1MiB"), 1 << 20);
        assert_eq!(limit("4096"), 4096);
        let e = Args::try_parse_from(["broker", "--max-body-bytes", "10MB"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("B, KiB, MiB or GiB"), "{e}");
    }

    #[test]
    fn every_problem_is_listed_at_once() {
        let a = Args::parse_from([
            "broker",
            "--pool-size",
            "0",
            "--upstream",
            "bad",
            "--call-timeout",
            "0s",
        ]);
        let e = a.config().unwrap_err();
        assert_eq!(e.0.len(), 3, "{e}");
    }

    #[test]
    fn repeated_upstreams_are_kept_in_order() {
        let a = Args::parse_from([
            "broker",
            "--upstream",
            "a:1",
            "--upstream",
            "b:2",
            "--upstream-v1",
            "c:3",
        ]);
        let c = a.config().unwrap();
        let addrs: Vec<_> = c
            .upstreams
            .iter()
            .map(|u| (u.addr.as_str(), u.kind))
            .collect();
        assert_eq!(
            addrs,
            [
                ("a:1", PeerKind::Rpcmesh),
                ("b:2", PeerKind::Rpcmesh),
                ("c:3", PeerKind::V1)
            ]
        );
    }
}
