//! The catalogue of every metric rpcmesh exports: name, type, labels, which programs
//! export it, and its help text. It is the one source of the `# HELP` lines (each program
//! calls [`describe_all`] on its recorder) and of the table in `docs/metrics.md`, which a
//! test keeps in step with it.
//!
//! Owns names and descriptions only; the handles are registered where they are used
//! (`metrics.rs` of each program, [`crate::telemetry`], [`crate::sysmetrics`]).

use crate::telemetry::Telemetry;

/// Prometheus type of a metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (`rate()` it).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Buckets, `_sum` and `_count`.
    Histogram,
}

impl Kind {
    /// The word `docs/metrics.md` uses.
    pub fn word(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric of the catalogue.
#[derive(Clone, Copy, Debug)]
pub struct MetricDoc {
    /// Full name.
    pub name: &'static str,
    /// Type.
    pub kind: Kind,
    /// Labels, comma-separated.
    pub labels: &'static str,
    /// Programs that export it (`provider`, `broker`, `driver`, or `all`).
    pub roles: &'static str,
    /// What it means (the `# HELP` text).
    pub help: &'static str,
}

const fn m(
    name: &'static str,
    kind: Kind,
    labels: &'static str,
    roles: &'static str,
    help: &'static str,
) -> MetricDoc {
    MetricDoc {
        name,
        kind,
        labels,
        roles,
        help,
    }
}

use Kind::{Counter, Gauge, Histogram};

/// Every metric, grouped as `docs/metrics.md` groups them.
pub const CATALOGUE: &[MetricDoc] = &[
    // calls
    m(
        "rpcmesh_calls_total",
        Counter,
        "role, service, method, status",
        "all",
        "Calls finished, by outcome: ok or a status (failed, timeout, unavailable, overloaded, bad_request); the driver adds connection, bad_reply, encode.",
    ),
    m(
        "rpcmesh_calls_in_flight",
        Gauge,
        "role",
        "all",
        "Calls received (or sent, for the driver) and not yet answered.",
    ),
    m(
        "rpcmesh_calls_sent_total",
        Counter,
        "role",
        "driver",
        "Calls the driver issued, the offered load: each ends once in rpcmesh_calls_total (one that cannot be encoded as status encode).",
    ),
    m(
        "rpcmesh_requests_total",
        Counter,
        "role, status",
        "driver",
        "User requests (fan-out of calls) finished, ok or failed (at least one call failed).",
    ),
    m(
        "rpcmesh_errors_total",
        Counter,
        "role, kind",
        "all",
        "Errors by kind: bad_magic, bad_version, too_large, crc, unknown_type, truncated, bad_body, inflate, decode, unknown_service, unknown_method, timeout, late_reply, unavailable, overloaded, unexpected, io.",
    ),
    m(
        "rpcmesh_stage_seconds",
        Histogram,
        "role, stage",
        "all",
        "Latency of each stage of a call (see the stage table).",
    ),
    m(
        "rpcmesh_compression_seconds",
        Histogram,
        "role, op",
        "provider, driver",
        "Time to compress (op=compress) or inflate (op=inflate) one payload; _sum is the CPU time compression costs.",
    ),
    // connections and bytes
    m(
        "rpcmesh_connections_open",
        Gauge,
        "role, side",
        "all",
        "Connections open (side: inbound = callers to us, outbound = the driver's, upstream = the broker's to providers).",
    ),
    m(
        "rpcmesh_connections_opened_total",
        Counter,
        "role, side",
        "all",
        "Connections opened.",
    ),
    m(
        "rpcmesh_connections_closed_total",
        Counter,
        "role, side",
        "all",
        "Connections closed.",
    ),
    m(
        "rpcmesh_connections_refused_total",
        Counter,
        "role, side",
        "provider, broker",
        "Connections accepted and closed at once because the connection cap was reached.",
    ),
    m(
        "rpcmesh_wire_bytes_total",
        Counter,
        "role, side, direction",
        "all",
        "Bytes read (direction=in) and written (out) on the wire.",
    ),
    m(
        "rpcmesh_wire_syscalls_total",
        Counter,
        "role, side, direction",
        "all",
        "read (in) and write (out) calls that moved bytes; calls per syscall is how well frames are batched.",
    ),
    m(
        "rpcmesh_payload_bytes_total",
        Counter,
        "role, direction, form",
        "provider, driver",
        "Payload bytes received (in) and sent (out), before compression (form=plain) and as on the wire (form=wire).",
    ),
    // broker upstreams and pools
    m(
        "rpcmesh_upstream_connect_failures_total",
        Counter,
        "role, upstream",
        "broker",
        "Connection attempts to a provider that failed.",
    ),
    m(
        "rpcmesh_upstream_calls_in_flight",
        Gauge,
        "role, upstream, conn",
        "broker",
        "Calls queued or in flight on each pooled connection to a provider (conn = position in the pool).",
    ),
    m(
        "rpcmesh_pool_connections",
        Gauge,
        "role, upstream",
        "broker",
        "Connections in the provider's bb8 pool.",
    ),
    m(
        "rpcmesh_pool_idle_connections",
        Gauge,
        "role, upstream",
        "broker",
        "Connections bb8 holds idle (between health checks, all of them: calls never check connections out).",
    ),
    m(
        "rpcmesh_pool_healthy_connections",
        Gauge,
        "role, upstream",
        "broker",
        "Connections that passed the last health check and take calls.",
    ),
    m(
        "rpcmesh_pool_gets_waited_total",
        Counter,
        "role, upstream",
        "broker",
        "Pool checkouts that had to wait for a connection (bb8).",
    ),
    m(
        "rpcmesh_pool_gets_timed_out_total",
        Counter,
        "role, upstream",
        "broker",
        "Pool checkouts that timed out: the provider could not be reached in time (bb8).",
    ),
    m(
        "rpcmesh_pool_get_wait_seconds",
        Histogram,
        "role, upstream",
        "broker",
        "Time pool checkouts waited, per health-check cycle (bb8); _sum is the total wait.",
    ),
    m(
        "rpcmesh_busy_poll_idle_seconds",
        Histogram,
        "role",
        "broker",
        "Time busy polling (--busy-poll) found nothing to read, recorded in chunks of about 10 ms; _sum is roughly the CPU time polling cost beyond the work (empty when the broker does not busy-poll).",
    ),
    m(
        "rpcmesh_pool_connections_closed_total",
        Counter,
        "role, upstream, reason",
        "broker",
        "Pooled connections closed: reason=broken (the connection failed) or invalid (its heartbeat failed).",
    ),
    // driver
    m(
        "rpcmesh_driver_offered_calls_per_second",
        Gauge,
        "role",
        "driver",
        "Calls the driver wrote per second, over the last second.",
    ),
    m(
        "rpcmesh_driver_achieved_calls_per_second",
        Gauge,
        "role",
        "driver",
        "Calls answered successfully per second, over the last second.",
    ),
    m(
        "rpcmesh_driver_users",
        Gauge,
        "role",
        "driver",
        "Users (closed-loop callers) of the run.",
    ),
    // system
    m(
        "rpcmesh_softirqs_total",
        Counter,
        "role, cpu, vector",
        "all",
        "Softirqs handled by each CPU since boot, by vector (/proc/softirqs).",
    ),
    m(
        "rpcmesh_cpu_seconds_total",
        Counter,
        "role, cpu, mode",
        "all",
        "Time each CPU spent in each mode since boot, whole seconds (/proc/stat).",
    ),
    m(
        "rpcmesh_process_cpu_seconds_total",
        Counter,
        "role",
        "all",
        "User and system CPU time of this process, whole seconds.",
    ),
    m(
        "rpcmesh_process_cpu_seconds",
        Histogram,
        "role",
        "all",
        "CPU time this process used per collection interval; _sum is its CPU time in fractional seconds.",
    ),
    m(
        "rpcmesh_process_resident_memory_bytes",
        Gauge,
        "role",
        "all",
        "Resident memory of this process.",
    ),
    m(
        "rpcmesh_process_virtual_memory_bytes",
        Gauge,
        "role",
        "all",
        "Virtual memory of this process.",
    ),
    m(
        "rpcmesh_process_virtual_memory_max_bytes",
        Gauge,
        "role",
        "all",
        "Virtual memory limit of this process (0 = unlimited).",
    ),
    m(
        "rpcmesh_process_open_fds",
        Gauge,
        "role",
        "all",
        "File descriptors this process has open.",
    ),
    m(
        "rpcmesh_process_max_fds",
        Gauge,
        "role",
        "all",
        "File descriptor limit of this process.",
    ),
    m(
        "rpcmesh_process_threads",
        Gauge,
        "role",
        "all",
        "Threads of this process.",
    ),
    m(
        "rpcmesh_process_start_time_seconds",
        Gauge,
        "role",
        "all",
        "Start time of this process, seconds since the Unix epoch.",
    ),
];

/// Puts the help text of every catalogued metric on `telemetry`'s recorder.
pub fn describe_all(telemetry: &Telemetry) {
    for d in CATALOGUE {
        let unit = unit_of(d.name);
        match d.kind {
            Kind::Histogram => telemetry.describe_histogram(d.name, unit, d.help),
            Kind::Counter | Kind::Gauge => telemetry.describe(d.name, unit, d.help),
        }
    }
}

fn unit_of(name: &str) -> Option<metrics::Unit> {
    let base = name.trim_end_matches("_total");
    if base.ends_with("_seconds") {
        Some(metrics::Unit::Seconds)
    } else if base.ends_with("_bytes") {
        Some(metrics::Unit::Bytes)
    } else {
        None
    }
}

/// Finds a catalogued metric.
pub fn find(name: &str) -> Option<&'static MetricDoc> {
    CATALOGUE.iter().find(|d| d.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_conventions() {
        let mut seen = std::collections::HashSet::new();
        for d in CATALOGUE {
            assert!(seen.insert(d.name), "{} listed twice", d.name);
            assert!(d.name.starts_with("rpcmesh_"), "{}", d.name);
            assert_eq!(
                d.kind == Kind::Counter,
                d.name.ends_with("_total"),
                "{}: counters and only counters end in _total",
                d.name
            );
            assert!(
                !d.labels.contains("instance") && !d.labels.contains("job"),
                "{}",
                d.name
            );
            assert!(!d.help.is_empty());
        }
    }

    /// docs/metrics.md lists exactly the catalogue, with the same types and labels.
    #[test]
    fn the_metrics_doc_matches_the_catalogue() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
                .expect("docs/metrics.md");
        let mut documented = Vec::new();
        for line in doc.lines().filter(|l| l.starts_with("| `rpcmesh_")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`');
            let d = find(name)
                .unwrap_or_else(|| panic!("{name} is in docs/metrics.md but not in the catalogue"));
            assert_eq!(cells[2], d.kind.word(), "{name}: type");
            assert_eq!(cells[3].replace('`', ""), d.labels, "{name}: labels");
            documented.push(name.to_string());
        }
        for d in CATALOGUE {
            assert!(
                documented.iter().any(|n| n == d.name),
                "{} is not in docs/metrics.md",
                d.name
            );
        }
    }
}
