//! Provider configuration: the command line (each flag with an environment fallback), the
//! defaults and why they are what they are, and validation into [`ProviderConfig`].

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use rpcmesh_common::cli::flags::{CompressionArgs, LimitArgs, RuntimeArgs, StageArgs};
use rpcmesh_common::cli::security::{AuthzArgs, ServerTlsArgs};
use rpcmesh_common::cli::values::{parse_bytes, parse_bytes_u32, parse_listen_addr};
use rpcmesh_common::cli::{ConfigProblems, ConfigWarnings, DurationArg, MetricsListen, OnOff};
use rpcmesh_common::metrics::families::DEFAULT_STAGE_SAMPLE;
use rpcmesh_common::net::budget::DEFAULT_MEMORY_BUDGET;
use rpcmesh_common::net::session::{DEFAULT_MAX_IN_FLIGHT_PER_LINK, Timeouts};
use rpcmesh_common::net::sources::SourceLimits;
use rpcmesh_common::net::tls::ServerTlsSettings;
use rpcmesh_wire::compress::{CompressionConfig, DEFAULT_MAX_INFLATED_LEN};
use rpcmesh_wire::envelope::{CallCodec, DEFAULT_MAX_METADATA_BYTES};
use rpcmesh_wire::frame::DEFAULT_MAX_BODY_LEN;
use std::path::PathBuf;

use crate::service::{ServiceMode, ServiceTime};

/// Where the provider listens unless told otherwise: every interface, port 7800 (the
/// broker's default upstream).
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7800));
/// Where the provider serves `/metrics` unless told otherwise (`off` disables it): port
/// 9780, beside the broker's 9770 and the driver's 9790, so all three fit on one host.
pub const DEFAULT_METRICS_LISTEN: MetricsListen = MetricsListen(Some(SocketAddr::V4(
    SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 9780),
)));
/// Replies are compressed for callers that accept it unless told otherwise: a caller asks
/// for it per request (`ACCEPT_COMPRESSED`), so the provider's side costs nothing to
/// others, and the reference report's WAN clients want it.
pub const DEFAULT_COMPRESS: bool = true;
/// No simulated service time unless asked: handlers answer at once.
pub const DEFAULT_SERVICE_TIME: ServiceTime = ServiceTime::Fixed(Duration::ZERO);
/// Open connections at once. Providers are mostly reached through a few pooled broker
/// connections; 4096 leaves room for many direct clients, and a flood beyond it gets
/// closed connections instead of an accept loop failing on "too many open files".
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Calls waiting on a handler per connection. The broker multiplexes hundreds of callers
/// onto one connection, and lets up to as many calls be in flight on it as the provider
/// takes (see the shared constant). Over it, calls are answered "overloaded".
pub const DEFAULT_MAX_IN_FLIGHT_PER_CONN: usize = DEFAULT_MAX_IN_FLIGHT_PER_LINK;
/// How long SIGTERM waits for calls in flight: longer than any sane handler, shorter than
/// the 30 s after which process supervisors usually send SIGKILL.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// The longest `--node-id`, in bytes: a host name (the default) is at most 253; a longer
/// id is a mistake (a file's content, say), and one past 65,535 bytes could not be sent in
/// a heartbeat at all, which would make every broker take the provider for dead.
pub const MAX_NODE_ID_BYTES: usize = 255;

/// The provider's command line.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "provider",
    version = rpcmesh_common::build::VERSION_LINE,
    about = "rpcmesh provider: hosts services and answers RPCF v1 calls"
)]
pub struct Args {
    /// Address to listen on for calls: IP:PORT, or :PORT for every interface.
    #[arg(long, env = "RPCMESH_PROVIDER_LISTEN", default_value_t = DEFAULT_LISTEN, value_parser = parse_listen_addr)]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint (IP:PORT, or :PORT for every
    /// interface), or `off`.
    #[arg(long, env = "RPCMESH_METRICS_LISTEN", default_value_t = DEFAULT_METRICS_LISTEN)]
    pub metrics_listen: MetricsListen,
    /// Name of this node, sent in heartbeats (default: the host name).
    #[arg(long, env = "RPCMESH_NODE_ID")]
    pub node_id: Option<String>,
    /// The runtime.
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Compress replies to callers that accept it: on|off.
    #[arg(long, env = "RPCMESH_COMPRESS", default_value_t = OnOff(DEFAULT_COMPRESS))]
    pub compress: OnOff,
    /// How replies are compressed.
    #[command(flatten)]
    pub compression: CompressionArgs,
    /// Simulated service time of every call, for capacity experiments: a duration (5ms),
    /// or a distribution: uniform:MIN,MAX, exp:MEAN, lognormal:P50,P99.
    #[arg(long, env = "RPCMESH_SERVICE_TIME", default_value_t = DEFAULT_SERVICE_TIME)]
    pub service_time: ServiceTime,
    /// Spend the service time burning the CPU (a CPU-bound handler) instead of waiting.
    #[arg(long, env = "RPCMESH_SERVICE_WORK")]
    pub service_work: bool,
    /// Open connections at once; more are accepted and closed.
    #[arg(long, env = "RPCMESH_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Calls in flight per connection; more are answered "overloaded".
    #[arg(long, env = "RPCMESH_MAX_IN_FLIGHT_PER_CONN", default_value_t = DEFAULT_MAX_IN_FLIGHT_PER_CONN)]
    pub max_in_flight_per_conn: usize,
    /// Largest frame body accepted, in bytes (a number, or with KiB or MiB).
    #[arg(long, env = "RPCMESH_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_LEN, value_parser = parse_bytes_u32)]
    pub max_body_bytes: u32,
    /// Largest payload a compressed request may inflate to, in bytes (a number, or with
    /// KiB or MiB).
    #[arg(long, env = "RPCMESH_MAX_INFLATED_BYTES", default_value_t = DEFAULT_MAX_INFLATED_LEN, value_parser = parse_bytes)]
    pub max_inflated_bytes: usize,
    /// Most bytes of metadata a request may carry (as encoded); more is "bad request" (a
    /// number, or with KiB).
    #[arg(long, env = "RPCMESH_MAX_METADATA_BYTES", default_value_t = DEFAULT_MAX_METADATA_BYTES, value_parser = parse_bytes)]
    pub max_metadata_bytes: usize,
    /// Grace period for calls in flight on SIGTERM/SIGINT.
    #[arg(long, env = "RPCMESH_GRACE", default_value_t = DurationArg(DEFAULT_GRACE))]
    pub grace: DurationArg,
    /// Connection timeouts and the memory budget.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Per-stage latency timing.
    #[command(flatten)]
    pub stages: StageArgs,
    /// TLS on the main address, and a plain one beside it.
    #[command(flatten)]
    pub tls: ServerTlsArgs,
    /// Who may call what.
    #[command(flatten)]
    pub authz: AuthzArgs,
    /// Serve as a classic plain RPCF v1 server instead, the way the original framework's
    /// server does: TCP_NODELAY never set, one call at a time per connection in order, one
    /// write per reply, EchoService.Echo only (for testing and benchmarking the broker
    /// behind such servers).
    #[arg(long, env = "RPCMESH_CLASSIC", conflicts_with_all = ["service_time", "service_work"])]
    pub classic: bool,
    /// Fail every call at once with status 1 while answering heartbeats (a black hole,
    /// for fault experiments and the broker's outlier ejection; with --classic too).
    #[arg(long, env = "RPCMESH_FAIL_CALLS")]
    pub fail_calls: bool,
}

/// Validated provider settings, as `run` takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderConfig {
    /// Sent in heartbeats.
    pub node_id: String,
    /// Reply compression (`None` = never compress replies).
    pub compression: Option<CompressionConfig>,
    /// Simulated service time per call.
    pub service_time: ServiceTime,
    /// How the service time is spent.
    pub service_mode: ServiceMode,
    /// Open connections at once.
    pub max_connections: usize,
    /// Limits on each source of connections.
    pub sources: SourceLimits,
    /// Calls in flight per connection.
    pub max_in_flight_per_conn: usize,
    /// Largest frame body accepted.
    pub max_body_len: u32,
    /// Largest inflated payload.
    pub max_inflated: usize,
    /// Most bytes of request metadata.
    pub max_metadata: usize,
    /// Drain time on shutdown.
    pub grace: Duration,
    /// Idle, frame and write timeouts of every accepted connection.
    pub timeouts: Timeouts,
    /// Bytes the process may buffer.
    pub memory_budget: usize,
    /// Stages are timed on one call in this many; 0 = not at all.
    pub stage_sample: u32,
    /// Serve as the classic plain v1 server (`crate::classic`) instead of the provider.
    pub classic: bool,
    /// Fail every call (`--fail-calls`, `Registry::fail_every_call`).
    pub fail_calls: bool,
    /// Settings that do nothing as given, logged when the provider starts.
    pub warnings: ConfigWarnings,
    /// TLS on the main address (`None`: plain).
    pub tls: Option<ServerTlsSettings>,
    /// The authorization policy's file (`None`: every call is allowed).
    pub authz_policy: Option<PathBuf>,
}

impl ProviderConfig {
    /// A connection's call codec with this provider's limits on what a request may carry
    /// (body, inflated payload, metadata), compressing replies per `compression`: both
    /// servers take their limits from here, so a new limit cannot be left out of one.
    pub(crate) fn call_codec(&self, compression: Option<CompressionConfig>) -> CallCodec {
        CallCodec::new(compression, self.max_inflated)
            .with_max_body(self.max_body_len)
            .with_max_metadata(self.max_metadata)
    }
}

impl Default for ProviderConfig {
    fn default() -> Self {
        ProviderConfig {
            node_id: default_node_id(),
            compression: DEFAULT_COMPRESS.then(CompressionConfig::default),
            service_time: DEFAULT_SERVICE_TIME,
            service_mode: ServiceMode::Sleep,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            sources: SourceLimits::default(),
            max_in_flight_per_conn: DEFAULT_MAX_IN_FLIGHT_PER_CONN,
            max_body_len: DEFAULT_MAX_BODY_LEN,
            max_inflated: DEFAULT_MAX_INFLATED_LEN,
            max_metadata: DEFAULT_MAX_METADATA_BYTES,
            grace: DEFAULT_GRACE,
            timeouts: Timeouts::default(),
            memory_budget: DEFAULT_MEMORY_BUDGET,
            stage_sample: DEFAULT_STAGE_SAMPLE,
            classic: false,
            fail_calls: false,
            warnings: ConfigWarnings::default(),
            tls: None,
            authz_policy: None,
        }
    }
}

impl Args {
    /// Checks every setting and lists all problems at once.
    pub fn config(&self) -> Result<ProviderConfig, ConfigProblems> {
        let mut p = ConfigProblems::default();
        let compression = self.compression.config(self.compress.0, &mut p);
        let timeouts = self.limits.timeouts(&mut p);
        let memory_budget = self.limits.memory_budget(&mut p);
        p.check(self.max_connections == 0, || {
            "--max-connections must be at least 1".into()
        });
        p.check(self.max_in_flight_per_conn == 0, || {
            "--max-in-flight-per-conn must be at least 1".into()
        });
        p.check(self.max_body_bytes < 64, || {
            format!(
                "--max-body-bytes {} is too small for any call (at least 64)",
                self.max_body_bytes
            )
        });
        p.check(self.max_inflated_bytes == 0, || {
            "--max-inflated-bytes must be at least 1".into()
        });
        p.check(self.service_work && self.service_time.is_zero(), || {
            "--service-work burns the CPU for the --service-time, which is 0: give one (e.g. --service-time 20us)".into()
        });
        if let Some(id) = &self.node_id {
            p.check(id.trim().is_empty(), || {
                "--node-id is empty: give a name, or leave it out for the host name".into()
            });
            p.check(id.len() > MAX_NODE_ID_BYTES, || {
                format!(
                    "--node-id is {} bytes, more than the {MAX_NODE_ID_BYTES} a node id may have",
                    id.len()
                )
            });
        }
        let mut w = ConfigWarnings::default();
        let sources = self.limits.sources(&mut p, &mut w);
        if self.classic {
            let tuned: Vec<&str> = [
                (
                    "--compress-threshold",
                    self.compression.compress_threshold
                        != rpcmesh_wire::compress::DEFAULT_COMPRESS_THRESHOLD,
                ),
                (
                    "--compress-level",
                    self.compression.compress_level
                        != rpcmesh_wire::compress::DEFAULT_COMPRESS_LEVEL,
                ),
                (
                    "--max-in-flight-per-conn",
                    self.max_in_flight_per_conn != DEFAULT_MAX_IN_FLIGHT_PER_CONN,
                ),
                (
                    "--max-inflated-bytes",
                    self.max_inflated_bytes != DEFAULT_MAX_INFLATED_LEN,
                ),
                (
                    "--stage-sample",
                    self.stages.stage_sample != DEFAULT_STAGE_SAMPLE,
                ),
            ]
            .into_iter()
            .filter_map(|(flag, set)| set.then_some(flag))
            .collect();
            w.check(!tuned.is_empty(), || {
                format!(
                    "{} do nothing with --classic (a plain v1 server: no compression, no stages, one call at a time per connection)",
                    tuned.join(", ")
                )
            });
        } else {
            self.compression.warnings(self.compress.0, &mut w);
            self.stages.warnings(self.metrics_listen, &mut w);
        }
        let tls = self.tls.server(&mut p);
        p.check(self.classic && tls.is_some(), || {
            "--classic serves plain RPCF v1 only: no --tls-cert".into()
        });
        if let Some(path) = &self.authz.authz_policy {
            if let Err(e) = rpcmesh_common::authz::Policy::read(path) {
                p.0.push(e.to_string());
            }
        }
        p.into_result(ProviderConfig {
            node_id: self.node_id.clone().unwrap_or_else(default_node_id),
            compression,
            service_time: self.service_time,
            service_mode: if self.service_work {
                ServiceMode::Work
            } else {
                ServiceMode::Sleep
            },
            max_connections: self.max_connections,
            sources,
            max_in_flight_per_conn: self.max_in_flight_per_conn,
            max_body_len: self.max_body_bytes,
            max_inflated: self.max_inflated_bytes,
            max_metadata: self.max_metadata_bytes,
            grace: self.grace.0,
            timeouts,
            memory_budget,
            stage_sample: if self.classic {
                0
            } else {
                self.stages.every(self.metrics_listen)
            },
            classic: self.classic,
            fail_calls: self.fail_calls,
            warnings: w,
            tls,
            authz_policy: self.authz.authz_policy.clone(),
        })
    }
}

/// The host name, or `provider` when it cannot be read.
pub fn default_node_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "provider".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn every_problem_is_listed_at_once() {
        let args = Args::parse_from([
            "provider",
            "--compress-level",
            "12",
            "--max-connections",
            "0",
        ]);
        let e = args.config().unwrap_err();
        assert_eq!(e.0.len(), 2, "{e}");
    }

    #[test]
    fn no_flags_give_the_default_config() {
        let c = Args::parse_from(["provider"]).config().unwrap();
        assert_eq!(c, ProviderConfig::default());
        assert!(c.compression.is_some());
        assert_eq!(c.max_body_len, DEFAULT_MAX_BODY_LEN);
    }

    #[test]
    fn the_classic_server_takes_no_service_time() {
        let c = Args::parse_from(["provider", "--classic"])
            .config()
            .unwrap();
        assert!(c.classic);
        let e = Args::try_parse_from(["provider", "--classic", "--service-time", "1ms"])
            .expect_err("a classic server has no simulated service time");
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
    }

    #[test]
    fn flags_that_only_matter_with_another_are_refused_or_warned_of() {
        let e = Args::parse_from(["provider", "--service-work"])
            .config()
            .unwrap_err();
        assert!(e.0[0].starts_with("--service-work burns the CPU"), "{e}");
        let warnings = |argv: &[&str]| Args::parse_from(argv).config().unwrap().warnings.0;
        assert!(warnings(&["provider"]).is_empty());
        let w = warnings(&["provider", "--compress", "off", "--compress-level", "9"]);
        assert!(w[0].ends_with("do nothing with --compress off"), "{w:?}");
        let w = warnings(&["provider", "--classic", "--compress-level", "9"]);
        assert!(
            w[0].starts_with("--compress-level do nothing with --classic"),
            "{w:?}"
        );
        let w = warnings(&["provider", "--metrics-listen", "off", "--stage-sample", "2"]);
        assert!(w[0].starts_with("--stage-sample 2 does nothing"), "{w:?}");
    }

    #[test]
    fn a_node_id_is_a_name() {
        let e = Args::parse_from(["provider", "--node-id", " "])
            .config()
            .unwrap_err();
        assert!(e.0[0].starts_with("--node-id is empty"), "{e}");
        let long = "n".repeat(MAX_NODE_ID_BYTES + 1);
        let e = Args::parse_from(["provider", "--node-id", &long])
            .config()
            .unwrap_err();
        assert!(e.0[0].contains("more than the 255"), "{e}");
    }

    #[test]
    fn sizes_take_a_unit_or_a_count_of_bytes() {
        let c = Args::parse_from([
            "provider",
            "--max-body-bytes",
            "1MiB",
            "--max-inflated-bytes",
            "2MiB",
            "--max-metadata-bytes",
            "4096",
        ])
        .config()
        .unwrap();
        assert_eq!(
            (c.max_body_len, c.max_inflated, c.max_metadata),
            (1 << 20, 2 << 20, 4096)
        );
    }

    #[test]
    fn without_a_metrics_endpoint_no_stage_is_timed() {
        let c = Args::parse_from(["provider", "--metrics-listen", "off"])
            .config()
            .unwrap();
        assert_eq!(c.stage_sample, 0);
    }
}
