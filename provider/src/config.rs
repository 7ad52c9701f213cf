//! Provider configuration: the command line (each flag with an environment fallback), the
//! defaults and why they are what they are, and validation into [`ProviderConfig`].

use std::net::SocketAddr;
use std::time::Duration;

use rpcmesh_common::compress::{
    CompressionConfig, DEFAULT_COMPRESS_LEVEL, DEFAULT_COMPRESS_THRESHOLD, DEFAULT_MAX_INFLATED_LEN,
};
use rpcmesh_common::frame::DEFAULT_MAX_BODY_LEN;
use rpcmesh_common::runtime::{ConfigProblems, parse_duration, parse_on_off};

/// Where the provider listens unless told otherwise: every interface, port 7800 (the
/// broker's default upstream).
pub const DEFAULT_LISTEN: &str = "0.0.0.0:7800";
/// Where the provider serves `/metrics` unless told otherwise (`off` disables it).
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:9780";
/// Open connections at once. Providers are mostly reached through a few pooled broker
/// connections; 4096 leaves room for many direct clients, and a flood beyond it gets
/// closed connections instead of an accept loop failing on "too many open files".
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Calls waiting on a handler per connection. The broker multiplexes hundreds of callers
/// onto one connection, and lets up to as many calls be in flight on it as the provider
/// takes (see the shared constant). Over it, calls are answered "overloaded".
pub const DEFAULT_MAX_IN_FLIGHT_PER_CONN: usize =
    rpcmesh_common::call::DEFAULT_MAX_IN_FLIGHT_PER_LINK;
/// How long SIGTERM waits for calls in flight: longer than any sane handler, shorter than
/// the 30 s after which process supervisors usually send SIGKILL.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// The provider's command line.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "provider",
    version,
    about = "rpcmesh provider: hosts services and answers RPCF v1 calls"
)]
pub struct Args {
    /// Address to listen on for calls.
    #[arg(long, env = "RPCMESH_PROVIDER_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint, or `off`.
    #[arg(long, env = "RPCMESH_METRICS_LISTEN", default_value = DEFAULT_METRICS_LISTEN)]
    pub metrics_listen: rpcmesh_common::telemetry::MetricsListen,
    /// Name of this node, sent in heartbeats (default: the host name).
    #[arg(long, env = "RPCMESH_NODE_ID")]
    pub node_id: Option<String>,
    /// Tokio worker threads (0 = one per CPU).
    #[arg(long, env = "RPCMESH_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Compress replies to callers that accept it: on|off.
    #[arg(long, env = "RPCMESH_COMPRESS", default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub compress: bool,
    /// Replies with a payload shorter than this many bytes are sent plain.
    #[arg(long, env = "RPCMESH_COMPRESS_THRESHOLD", default_value_t = DEFAULT_COMPRESS_THRESHOLD)]
    pub compress_threshold: usize,
    /// zlib level, 0-9.
    #[arg(long, env = "RPCMESH_COMPRESS_LEVEL", default_value_t = DEFAULT_COMPRESS_LEVEL)]
    pub compress_level: u32,
    /// Simulated service time added to every call (e.g. 5ms), for capacity experiments.
    #[arg(long, env = "RPCMESH_SERVICE_TIME", default_value = "0s", value_parser = parse_duration)]
    pub service_time: Duration,
    /// Open connections at once; more are accepted and closed.
    #[arg(long, env = "RPCMESH_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Calls in flight per connection; more are answered "overloaded".
    #[arg(long, env = "RPCMESH_MAX_IN_FLIGHT_PER_CONN", default_value_t = DEFAULT_MAX_IN_FLIGHT_PER_CONN)]
    pub max_in_flight_per_conn: usize,
    /// Largest frame body accepted, in bytes.
    #[arg(long, env = "RPCMESH_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_LEN)]
    pub max_body_bytes: u32,
    /// Largest payload a compressed request may inflate to, in bytes.
    #[arg(long, env = "RPCMESH_MAX_INFLATED_BYTES", default_value_t = DEFAULT_MAX_INFLATED_LEN)]
    pub max_inflated_bytes: usize,
    /// Grace period for calls in flight on SIGTERM/SIGINT.
    #[arg(long, env = "RPCMESH_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub grace: Duration,
    /// Per-stage latency timing.
    #[command(flatten)]
    pub stages: rpcmesh_common::telemetry::StageArgs,
}

/// Validated provider settings, as `run` takes them.
#[derive(Debug, Clone)]
pub struct ProviderConfig {
    /// Sent in heartbeats.
    pub node_id: String,
    /// Reply compression (`None` = never compress replies).
    pub compression: Option<CompressionConfig>,
    /// Simulated service time per call.
    pub service_time: Duration,
    /// Open connections at once.
    pub max_connections: usize,
    /// Calls in flight per connection.
    pub max_in_flight_per_conn: usize,
    /// Largest frame body accepted.
    pub max_body_len: u32,
    /// Largest inflated payload.
    pub max_inflated: usize,
    /// Drain time on shutdown.
    pub grace: Duration,
    /// Stages are timed on one call in this many; 0 = not at all.
    pub stage_sample: u32,
}

impl Default for ProviderConfig {
    fn default() -> Self {
        ProviderConfig {
            node_id: default_node_id(),
            compression: Some(CompressionConfig::default()),
            service_time: Duration::ZERO,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_in_flight_per_conn: DEFAULT_MAX_IN_FLIGHT_PER_CONN,
            max_body_len: DEFAULT_MAX_BODY_LEN,
            max_inflated: DEFAULT_MAX_INFLATED_LEN,
            grace: DEFAULT_GRACE,
            stage_sample: rpcmesh_common::telemetry::DEFAULT_STAGE_SAMPLE,
        }
    }
}

impl Args {
    /// Checks every setting and lists all problems at once.
    pub fn config(&self) -> Result<ProviderConfig, ConfigProblems> {
        let mut p = ConfigProblems::default();
        p.check(self.compress_level > 9, || {
            format!(
                "--compress-level {} is not a zlib level (0-9)",
                self.compress_level
            )
        });
        p.check(self.max_connections == 0, || {
            "--max-connections must be at least 1".into()
        });
        p.check(self.max_in_flight_per_conn == 0, || {
            "--max-in-flight-per-conn must be at least 1".into()
        });
        p.check(self.max_body_bytes < 64, || {
            format!(
                "--max-body-bytes {} is too small for any call",
                self.max_body_bytes
            )
        });
        p.check(self.max_inflated_bytes == 0, || {
            "--max-inflated-bytes must be at least 1".into()
        });
        p.into_result(ProviderConfig {
            node_id: self.node_id.clone().unwrap_or_else(default_node_id),
            compression: self.compress.then_some(CompressionConfig {
                threshold: self.compress_threshold,
                level: self.compress_level,
            }),
            service_time: self.service_time,
            max_connections: self.max_connections,
            max_in_flight_per_conn: self.max_in_flight_per_conn,
            max_body_len: self.max_body_bytes,
            max_inflated: self.max_inflated_bytes,
            grace: self.grace,
            stage_sample: self.stages.every(),
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
    fn defaults_validate() {
        let c = Args::parse_from(["provider"]).config().unwrap();
        assert!(c.compression.is_some());
        assert_eq!(c.max_body_len, DEFAULT_MAX_BODY_LEN);
    }
}
