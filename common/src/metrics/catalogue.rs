//! The catalogue: every metric family rpcmesh exports, written down once. Each family is a
//! typed constant ([`Family`]): its name, type, label names, the programs that export it and
//! its help text. Handles are registered through these constants only
//! ([`Telemetry::counter`](crate::metrics::Telemetry::counter) and its siblings take a
//! `&Family`, and check in debug builds that the type and the label names are the
//! catalogued ones), so a name is never spelled at a call site. The `# HELP` lines come
//! from here (every recorder is given them when it is made), and so does the table in
//! `docs/metrics.md`, which a test keeps in step.
//!
//! Owns names, types, labels and meanings. The handles are registered where they are used
//! ([`crate::metrics::families`] for the groups every program shares, each program's
//! `metrics.rs` for its own, [`crate::metrics::system`] for `/proc`). That every family a
//! program exports is catalogued, and that every family catalogued for a program is
//! exported by it, is checked against the running programs ([`mismatches`], called by
//! `system-tests/tests/prometheus.rs`).

use crate::metrics::Telemetry;

/// Prometheus type of a family.
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
    /// The word Prometheus's `# TYPE` line and `docs/metrics.md` use.
    pub fn word(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One of the three programs: the value of the `role` label on every metric it exports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// `provider`.
    Provider,
    /// `broker`.
    Broker,
    /// `driver`.
    Driver,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 3] = [Role::Provider, Role::Broker, Role::Driver];

    /// The `role` label value.
    pub fn label(self) -> &'static str {
        match self {
            Role::Provider => "provider",
            Role::Broker => "broker",
            Role::Driver => "driver",
        }
    }
}

/// One metric family of the catalogue.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    /// Full name.
    pub name: &'static str,
    /// Type.
    pub kind: Kind,
    /// Label names, in the order every registration gives them.
    pub labels: &'static [&'static str],
    /// Programs that export it.
    pub roles: &'static [Role],
    /// What it means (the `# HELP` text).
    pub help: &'static str,
}

impl Family {
    /// True when `role` exports this family.
    pub fn exported_by(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// The roles as `docs/metrics.md` writes them: `all`, or a comma-separated list.
    pub fn roles_text(&self) -> String {
        if Role::ALL.iter().all(|r| self.roles.contains(r)) {
            "all".to_string()
        } else {
            let names: Vec<&str> = self.roles.iter().map(|r| r.label()).collect();
            names.join(", ")
        }
    }

    /// The unit Prometheus is told, from the name's suffix.
    pub fn unit(&self) -> Option<metrics::Unit> {
        let base = self.name.trim_end_matches("_total");
        if base.ends_with("_seconds") {
            Some(metrics::Unit::Seconds)
        } else if base.ends_with("_bytes") {
            Some(metrics::Unit::Bytes)
        } else {
            None
        }
    }

    /// Checks (debug builds only) that a registration as `kind` with these labels is what
    /// the catalogue says.
    pub(crate) fn check(&self, kind: Kind, labels: &[(&'static str, &str)]) {
        debug_assert_eq!(self.kind, kind, "{} is a {}", self.name, self.kind.word());
        debug_assert!(
            labels.len() == self.labels.len()
                && labels.iter().zip(self.labels).all(|((k, _), l)| k == l),
            "{} takes the labels {:?}, in that order; registered with {:?}",
            self.name,
            self.labels,
            labels.iter().map(|(k, _)| *k).collect::<Vec<_>>()
        );
    }
}

const ALL: &[Role] = &Role::ALL;
const PROVIDER_DRIVER: &[Role] = &[Role::Provider, Role::Driver];
const PROVIDER_BROKER: &[Role] = &[Role::Provider, Role::Broker];
const BROKER: &[Role] = &[Role::Broker];
const BROKER_DRIVER: &[Role] = &[Role::Broker, Role::Driver];
const DRIVER: &[Role] = &[Role::Driver];

const ROLE: &[&str] = &["role"];
const ROLE_SIDE: &[&str] = &["role", "side"];
const ROLE_SIDE_DIRECTION: &[&str] = &["role", "side", "direction"];
const ROLE_UPSTREAM: &[&str] = &["role", "upstream"];

use Kind::{Counter, Gauge, Histogram};

// ---- calls

/// `rpcmesh_calls_total{role, service, method, status}`.
pub const CALLS_TOTAL: Family = Family {
    name: "rpcmesh_calls_total",
    kind: Counter,
    labels: &["role", "service", "method", "status"],
    roles: ALL,
    help: "Calls finished, by outcome: ok or the status of the reply (failed, timeout, unavailable, overloaded, bad_request); the driver adds what it saw itself: no_reply (no reply within its timeout), connection (lost with the connection after it was written: it may have run), no_connection (no target took it within the timeout: never written), bad_reply, encode.",
};
/// `rpcmesh_call_seconds{role, service, method}`.
pub const CALL_SECONDS: Family = Family {
    name: "rpcmesh_call_seconds",
    kind: Histogram,
    labels: &["role", "service", "method"],
    roles: PROVIDER_BROKER,
    help: "Time a call of this service and method spent in this program, from its read to its reply handed to the socket (the total stage, by method), on the calls whose stages are timed.",
};
/// `rpcmesh_shed_total{role, cap}`.
pub const SHED_TOTAL: Family = Family {
    name: "rpcmesh_shed_total",
    kind: Counter,
    labels: &["role", "cap"],
    roles: PROVIDER_BROKER,
    help: "Calls answered overloaded at once, by the limit they met: per_connection (calls in flight on the caller's connection), total (in the whole broker), memory (the memory budget spent), upstream_full (every connection to the service's providers at its cap).",
};
/// `rpcmesh_calls_in_flight{role}`.
pub const CALLS_IN_FLIGHT: Family = Family {
    name: "rpcmesh_calls_in_flight",
    kind: Gauge,
    labels: ROLE,
    roles: ALL,
    help: "Calls received (or sent, for the driver) and not yet answered.",
};
/// `rpcmesh_calls_sent_total{role}`.
pub const CALLS_SENT_TOTAL: Family = Family {
    name: "rpcmesh_calls_sent_total",
    kind: Counter,
    labels: ROLE,
    roles: DRIVER,
    help: "Calls the driver issued, the offered load: each ends once in rpcmesh_calls_total (one that cannot be encoded as status encode).",
};
/// `rpcmesh_requests_total{role, status}`.
pub const REQUESTS_TOTAL: Family = Family {
    name: "rpcmesh_requests_total",
    kind: Counter,
    labels: &["role", "status"],
    roles: DRIVER,
    help: "User requests (fan-out of calls) finished, ok or failed (at least one call failed); in the open loop also not_sent (due while every slot was busy and the backlog full).",
};
/// `rpcmesh_errors_total{role, kind, side}`.
pub const ERRORS_TOTAL: Family = Family {
    name: "rpcmesh_errors_total",
    kind: Counter,
    labels: &["role", "kind", "side"],
    roles: ALL,
    help: "Errors by kind (bad_magic, bad_version, too_large, crc, unknown_type, truncated, bad_body, inflate, decode, unknown_service, unknown_method, timeout, deadline_exceeded (a call dropped unstarted, its caller's deadline past: counted where it was dropped), late_reply, unavailable, overloaded, failed, bad_request, permission_denied, unexpected, io) and by the side it came from: client (the caller's bytes or request), broker (a broker limit or decision), provider (the provider or the path to it), server (for the driver: the broker or provider it called).",
};
/// `rpcmesh_stage_seconds{role, stage}`.
pub const STAGE_SECONDS: Family = Family {
    name: "rpcmesh_stage_seconds",
    kind: Histogram,
    labels: &["role", "stage"],
    roles: ALL,
    help: "Latency of each stage of a call (see the stage table).",
};
/// `rpcmesh_compression_seconds{role, op}`.
pub const COMPRESSION_SECONDS: Family = Family {
    name: "rpcmesh_compression_seconds",
    kind: Histogram,
    labels: &["role", "op"],
    roles: PROVIDER_DRIVER,
    help: "Time to compress (op=compress) or inflate (op=inflate) one payload; _sum is the CPU time compression costs.",
};

// ---- connections and bytes

/// `rpcmesh_connections_open{role, side}`.
pub const CONNECTIONS_OPEN: Family = Family {
    name: "rpcmesh_connections_open",
    kind: Gauge,
    labels: ROLE_SIDE,
    roles: ALL,
    help: "Connections open (side: inbound = callers to us, outbound = the driver's, upstream = the broker's to providers).",
};
/// `rpcmesh_connections_opened_total{role, side}`.
pub const CONNECTIONS_OPENED_TOTAL: Family = Family {
    name: "rpcmesh_connections_opened_total",
    kind: Counter,
    labels: ROLE_SIDE,
    roles: ALL,
    help: "Connections opened.",
};
/// `rpcmesh_connections_closed_total{role, side, reason}`.
pub const CONNECTIONS_CLOSED_TOTAL: Family = Family {
    name: "rpcmesh_connections_closed_total",
    kind: Counter,
    labels: &["role", "side", "reason"],
    roles: ALL,
    help: "Connections closed, by reason: peer (it closed), idle_timeout, frame_timeout, write_timeout, bad_input, error (socket failed), shutdown (drained), local (closed by this side), tls_handshake (its TLS handshake was refused), memory_budget (paused for the memory budget, one of the connections holding it, its frame unfinished after the frame timeout; or holding the most of a budget past half for 10 s).",
};
/// `rpcmesh_connections_refused_total{role, side, reason}`.
pub const CONNECTIONS_REFUSED_TOTAL: Family = Family {
    name: "rpcmesh_connections_refused_total",
    kind: Counter,
    labels: &["role", "side", "reason"],
    roles: PROVIDER_BROKER,
    help: "Connections accepted and closed at once, by reason: connection_cap (the connection cap was reached), source_connections (its source had --max-connections-per-source open), source_rate (its source opened connections faster than --accept-rate-per-source).",
};
/// `rpcmesh_wire_bytes_total{role, side, direction}`.
pub const WIRE_BYTES_TOTAL: Family = Family {
    name: "rpcmesh_wire_bytes_total",
    kind: Counter,
    labels: ROLE_SIDE_DIRECTION,
    roles: ALL,
    help: "Bytes read (direction=in) and written (out) on the wire.",
};
/// `rpcmesh_wire_syscalls_total{role, side, direction}`.
pub const WIRE_SYSCALLS_TOTAL: Family = Family {
    name: "rpcmesh_wire_syscalls_total",
    kind: Counter,
    labels: ROLE_SIDE_DIRECTION,
    roles: ALL,
    help: "read (in) and write (out) calls that moved bytes; calls per syscall is how well frames are batched.",
};
/// `rpcmesh_payload_bytes_total{role, direction, form}`.
pub const PAYLOAD_BYTES_TOTAL: Family = Family {
    name: "rpcmesh_payload_bytes_total",
    kind: Counter,
    labels: &["role", "direction", "form"],
    roles: PROVIDER_DRIVER,
    help: "Payload bytes received (in) and sent (out), before compression (form=plain) and as on the wire (form=wire).",
};

// ---- broker upstreams and pools

/// `rpcmesh_upstream_connect_failures_total{role, upstream}`.
pub const UPSTREAM_CONNECT_FAILURES_TOTAL: Family = Family {
    name: "rpcmesh_upstream_connect_failures_total",
    kind: Counter,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "Connection attempts to a provider that failed.",
};
/// `rpcmesh_upstream_calls_in_flight{role, upstream, conn}`.
pub const UPSTREAM_CALLS_IN_FLIGHT: Family = Family {
    name: "rpcmesh_upstream_calls_in_flight",
    kind: Gauge,
    labels: &["role", "upstream", "conn"],
    roles: BROKER,
    help: "Calls queued or in flight on each pooled connection to a provider (conn = position in the pool).",
};
/// `rpcmesh_upstream_calls_total{role, upstream, status}`.
pub const UPSTREAM_CALLS_TOTAL: Family = Family {
    name: "rpcmesh_upstream_calls_total",
    kind: Counter,
    labels: &["role", "upstream", "status"],
    roles: BROKER,
    help: "Calls the broker routed to this provider, by outcome: the status of the provider's reply, or the broker's own answer (timeout, unavailable when the connection was lost or the grace period ended, failed for an unusable reply). A call a draining provider refused (NOT_RUN) counts there as unavailable, and again at the provider it was routed to next.",
};
/// `rpcmesh_upstream_quick_acks_total{role, upstream}`.
pub const UPSTREAM_QUICK_ACKS_TOTAL: Family = Family {
    name: "rpcmesh_upstream_quick_acks_total",
    kind: Counter,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "Reads from a plain v1 server (--upstream-v1) after which the broker sent its ACK at once (TCP_QUICKACK, one setsockopt each) because calls were still in flight there: a server with Nagle's algorithm on holds its next reply until that ACK, which the kernel would delay up to 40 ms.",
};
/// `rpcmesh_upstream_pace_seconds{role, upstream}`.
pub const UPSTREAM_PACE_SECONDS: Family = Family {
    name: "rpcmesh_upstream_pace_seconds",
    kind: Gauge,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "A provider's time per call on one pooled connection: for a plain v1 server (--upstream-v1) as the broker measures it between reads while calls wait there, for an rpcmesh provider as the provider reports it in its heartbeat answers (its own work per call: decoded, handled, encoded). A v1 server's is the lower envelope of the broker's samples (a round trip or a wait for a CPU between two reads mostly adds to one), a provider's a moving average; 0 until known. The broker packs calls onto one of its connections only as deep as keeps a call's wait behind the others under --pack-wait.",
};
/// `rpcmesh_pool_connections{role, upstream}`.
pub const POOL_CONNECTIONS: Family = Family {
    name: "rpcmesh_pool_connections",
    kind: Gauge,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "Connections in the provider's bb8 pool.",
};
/// `rpcmesh_pool_idle_connections{role, upstream}`.
pub const POOL_IDLE_CONNECTIONS: Family = Family {
    name: "rpcmesh_pool_idle_connections",
    kind: Gauge,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "Connections bb8 holds idle (between health checks, all of them: calls never check connections out).",
};
/// `rpcmesh_pool_healthy_connections{role, upstream}`.
pub const POOL_HEALTHY_CONNECTIONS: Family = Family {
    name: "rpcmesh_pool_healthy_connections",
    kind: Gauge,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "Connections that passed the last health check and take calls.",
};
/// `rpcmesh_pool_gets_waited_total{role, upstream}`.
pub const POOL_GETS_WAITED_TOTAL: Family = Family {
    name: "rpcmesh_pool_gets_waited_total",
    kind: Counter,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "Pool checkouts that had to wait for a connection (bb8).",
};
/// `rpcmesh_pool_gets_timed_out_total{role, upstream}`.
pub const POOL_GETS_TIMED_OUT_TOTAL: Family = Family {
    name: "rpcmesh_pool_gets_timed_out_total",
    kind: Counter,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "Pool checkouts that timed out: the provider could not be reached in time (bb8).",
};
/// `rpcmesh_pool_get_wait_seconds{role, upstream}`.
pub const POOL_GET_WAIT_SECONDS: Family = Family {
    name: "rpcmesh_pool_get_wait_seconds",
    kind: Histogram,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "Time pool checkouts waited, per health-check cycle (bb8); _sum is the total wait.",
};
/// `rpcmesh_busy_poll_idle_seconds{role}`.
pub const BUSY_POLL_IDLE_SECONDS: Family = Family {
    name: "rpcmesh_busy_poll_idle_seconds",
    kind: Histogram,
    labels: ROLE,
    roles: BROKER,
    help: "Time busy polling (--busy-poll) found nothing to read, recorded in chunks of about 10 ms; _sum is roughly the CPU time polling cost beyond the work (empty when the broker does not busy-poll).",
};
/// `rpcmesh_forwarding_allocations_total{role}`.
pub const FORWARDING_ALLOCATIONS_TOTAL: Family = Family {
    name: "rpcmesh_forwarding_allocations_total",
    kind: Counter,
    labels: ROLE,
    roles: BROKER,
    help: "Heap allocations and reallocations made while the broker's sessions and upstream connections ran (counted per thread by its allocator): a call forwarded in steady state makes none.",
};
/// `rpcmesh_pool_connections_closed_total{role, upstream, reason}`.
pub const POOL_CONNECTIONS_CLOSED_TOTAL: Family = Family {
    name: "rpcmesh_pool_connections_closed_total",
    kind: Counter,
    labels: &["role", "upstream", "reason"],
    roles: BROKER,
    help: "Pooled connections closed: reason=broken (the connection failed) or invalid (its heartbeat failed).",
};
/// `rpcmesh_calls_rerouted_total{role, reason}`.
pub const CALLS_REROUTED_TOTAL: Family = Family {
    name: "rpcmesh_calls_rerouted_total",
    kind: Counter,
    labels: &["role", "reason"],
    roles: BROKER_DRIVER,
    help: "Calls sent again, by the broker to another provider or by the driver to another target: reason=not_run (a draining server refused it), unsent (its connection closed before it was written), overloaded (the server shed it), lost (its connection was lost after it was written; idempotent calls only). Each retry is drawn from the retry budget (docs/resilience.md); each call still ends once in rpcmesh_calls_total.",
};
/// `rpcmesh_retry_budget_exhausted_total{role, reason}`.
pub const RETRY_BUDGET_EXHAUSTED_TOTAL: Family = Family {
    name: "rpcmesh_retry_budget_exhausted_total",
    kind: Counter,
    labels: &["role", "reason"],
    roles: BROKER_DRIVER,
    help: "Calls safe to retry that were not retried because the retry budget (--retry-budget-percent of the calls of the last 10 s, plus --retry-budget-min-per-second) was spent, by the reason they would have been retried for (not_run, unsent, overloaded, lost): the caller got the answer as it came.",
};
/// `rpcmesh_upstream_ejections_total{role, upstream, reason}`.
pub const UPSTREAM_EJECTIONS_TOTAL: Family = Family {
    name: "rpcmesh_upstream_ejections_total",
    kind: Counter,
    labels: &["role", "upstream", "reason"],
    roles: BROKER,
    help: "Times a provider was ejected from the routing for failing its calls (outlier ejection, docs/resilience.md): reason=consecutive_failures (--eject-consecutive-failures of its own faults in a row), success_rate (under --eject-success-rate over --eject-window), probe_failed (its probe call after an ejection failed).",
};
/// `rpcmesh_upstreams_ejected{role}`.
pub const UPSTREAMS_EJECTED: Family = Family {
    name: "rpcmesh_upstreams_ejected",
    kind: Gauge,
    labels: ROLE,
    roles: BROKER,
    help: "Providers ejected now (or on probation, with one probe call at a time), at most --max-ejection-percent of them.",
};
/// `rpcmesh_upstream_latency_estimate_seconds{role, upstream}`.
pub const UPSTREAM_LATENCY_ESTIMATE_SECONDS: Family = Family {
    name: "rpcmesh_upstream_latency_estimate_seconds",
    kind: Gauge,
    labels: ROLE_UPSTREAM,
    roles: BROKER,
    help: "A provider's latency as the balancer sees it (PeakEWMA: a slower reply replaces it at once, faster ones bring it down over --ewma-decay, and it decays while the provider gets no call); --balance peak-ewma multiplies it by the calls in flight. Taken at each health check.",
};
/// `rpcmesh_abandoned_replies_total{role}`.
pub const ABANDONED_REPLIES_TOTAL: Family = Family {
    name: "rpcmesh_abandoned_replies_total",
    kind: Counter,
    labels: ROLE,
    roles: BROKER,
    help: "Outcomes of calls whose caller had left (its connection closed with the call in flight): dropped when they came, neither buffered nor routed again.",
};
/// `rpcmesh_cell_calls_total{role, cell}`.
pub const CELL_CALLS_TOTAL: Family = Family {
    name: "rpcmesh_cell_calls_total",
    kind: Counter,
    labels: &["role", "cell"],
    roles: BROKER,
    help: "Calls answered by each cell of a broker run with --threads above 1 (a thread serving its own client connections over its own provider connections; cell 0 also runs the control plane): how evenly the load is dealt. They add up to rpcmesh_calls_total; absent with one thread.",
};
/// `rpcmesh_cell_moves_total{role}`.
pub const CELL_MOVES_TOTAL: Family = Family {
    name: "rpcmesh_cell_moves_total",
    kind: Counter,
    labels: ROLE,
    roles: BROKER,
    help: "Client connections a broker run with --threads above 1 moved from one cell to another (--cell-placement gather: spread over one more cell when one could not keep up, gathered back when that did not pay or the load fell), calls in flight and all. Absent with one thread.",
};
/// `rpcmesh_cells_open{role}`.
pub const CELLS_OPEN: Family = Family {
    name: "rpcmesh_cells_open",
    kind: Gauge,
    labels: ROLE,
    roles: BROKER,
    help: "Cells of a broker run with --threads above 1 that new client connections are dealt to: with --cell-placement gather, as few as keep up (1 on a machine with no core to spare); with spread, all. Absent with one thread.",
};
/// `rpcmesh_config_reloads_total{role, result}`.
pub const CONFIG_RELOADS_TOTAL: Family = Family {
    name: "rpcmesh_config_reloads_total",
    kind: Counter,
    labels: &["role", "result"],
    roles: BROKER,
    help: "Reads of the providers file after the start (on SIGHUP, or when the file changed): result=ok (the providers now served are the file's), error (the file could not be read or did not parse; the previous providers are kept).",
};

// ---- TLS and authorization

/// `rpcmesh_tls_handshakes_total{role, side}`.
pub const TLS_HANDSHAKES_TOTAL: Family = Family {
    name: "rpcmesh_tls_handshakes_total",
    kind: Counter,
    labels: ROLE_SIDE,
    roles: ALL,
    help: "TLS handshakes that made a connection: side=inbound (callers to this server), upstream (the broker's to providers), outbound (the driver's).",
};
/// `rpcmesh_tls_handshake_failures_total{role, side, reason}`.
pub const TLS_HANDSHAKE_FAILURES_TOTAL: Family = Family {
    name: "rpcmesh_tls_handshake_failures_total",
    kind: Counter,
    labels: &["role", "side", "reason"],
    roles: ALL,
    help: "TLS handshakes refused, by reason: timeout, busy (too many in progress), not_tls (plaintext to a TLS port), no_certificate, unknown_ca, expired, no_identity, bad_certificate, peer_alert (the peer refused us), incompatible, eof (the peer left mid-handshake), other.",
};
/// `rpcmesh_tls_cert_expiry_timestamp_seconds{role, cert}`.
pub const TLS_CERT_EXPIRY_TIMESTAMP_SECONDS: Family = Family {
    name: "rpcmesh_tls_cert_expiry_timestamp_seconds",
    kind: Gauge,
    labels: &["role", "cert"],
    roles: ALL,
    help: "When the TLS certificates in use expire, seconds since the Unix epoch: cert=own (the program's certificate), ca (the earliest of its CA file's). Exported only by a program with TLS; updated when the files are read again.",
};
/// `rpcmesh_authz_denied_total{role, service, method}`.
pub const AUTHZ_DENIED_TOTAL: Family = Family {
    name: "rpcmesh_authz_denied_total",
    kind: Counter,
    labels: &["role", "service", "method"],
    roles: PROVIDER_BROKER,
    help: "Calls the authorization policy denied (answered \"permission denied\"), by the call's service and method when they are known (a provider's registered methods; the pairs the broker has labels for), else _other.",
};
/// `rpcmesh_file_reloads_total{role, file, result}`.
pub const FILE_RELOADS_TOTAL: Family = Family {
    name: "rpcmesh_file_reloads_total",
    kind: Counter,
    labels: &["role", "file", "result"],
    roles: PROVIDER_BROKER,
    help: "Reads of the TLS files (file=tls) and of the authorization policy (file=policy) after the start, on SIGHUP or when they changed: result=ok (in force now), error (kept out; what was in force stays).",
};

/// Families a program exports only when it is configured to use what they count (TLS;
/// a broker's cells, with `--threads` above 1).
pub const CONDITIONAL: &[&Family] = &[
    &TLS_CERT_EXPIRY_TIMESTAMP_SECONDS,
    &CELL_CALLS_TOTAL,
    &CELL_MOVES_TOTAL,
    &CELLS_OPEN,
];

// ---- driver

/// `rpcmesh_driver_offered_calls_per_second{role}`.
pub const DRIVER_OFFERED_CALLS_PER_SECOND: Family = Family {
    name: "rpcmesh_driver_offered_calls_per_second",
    kind: Gauge,
    labels: ROLE,
    roles: DRIVER,
    help: "Calls the driver wrote per second, over the last second.",
};
/// `rpcmesh_driver_achieved_calls_per_second{role}`.
pub const DRIVER_ACHIEVED_CALLS_PER_SECOND: Family = Family {
    name: "rpcmesh_driver_achieved_calls_per_second",
    kind: Gauge,
    labels: ROLE,
    roles: DRIVER,
    help: "Calls answered successfully per second, over the last second.",
};
/// `rpcmesh_driver_latency_seconds{role, of, from}`.
pub const DRIVER_LATENCY_SECONDS: Family = Family {
    name: "rpcmesh_driver_latency_seconds",
    kind: Histogram,
    labels: &["role", "of", "from"],
    roles: DRIVER,
    help: "Latency of what the driver finished successfully: of=call (successful calls) or request (successful requests); from=intended (from the start the schedule meant: corrected for coordinated omission, the figure to read) or sent (from the actual start; open loop only, for comparison).",
};
/// `rpcmesh_driver_users{role}`.
pub const DRIVER_USERS: Family = Family {
    name: "rpcmesh_driver_users",
    kind: Gauge,
    labels: ROLE,
    roles: DRIVER,
    help: "Users (closed-loop callers) of the run.",
};

// ---- system

/// `rpcmesh_softirqs_total{role, cpu, vector}`.
pub const SOFTIRQS_TOTAL: Family = Family {
    name: "rpcmesh_softirqs_total",
    kind: Counter,
    labels: &["role", "cpu", "vector"],
    roles: ALL,
    help: "Softirqs handled by each CPU since boot, by vector (/proc/softirqs).",
};
/// `rpcmesh_cpu_seconds_total{role, cpu, mode}`.
pub const CPU_SECONDS_TOTAL: Family = Family {
    name: "rpcmesh_cpu_seconds_total",
    kind: Counter,
    labels: &["role", "cpu", "mode"],
    roles: ALL,
    help: "Time each CPU spent in each mode since boot, whole seconds (/proc/stat).",
};
/// `rpcmesh_host_cpu_seconds{role, mode}`.
pub const HOST_CPU_SECONDS: Family = Family {
    name: "rpcmesh_host_cpu_seconds",
    kind: Histogram,
    labels: &["role", "mode"],
    roles: ALL,
    help: "Time all CPUs of the host spent in each mode per collection (/proc/stat); _sum is the host's time in that mode in fractional seconds.",
};
/// `rpcmesh_process_cpu_seconds_total{role}`.
pub const PROCESS_CPU_SECONDS_TOTAL: Family = Family {
    name: "rpcmesh_process_cpu_seconds_total",
    kind: Counter,
    labels: ROLE,
    roles: ALL,
    help: "User and system CPU time of this process, whole seconds.",
};
/// `rpcmesh_process_cpu_seconds{role}`.
pub const PROCESS_CPU_SECONDS: Family = Family {
    name: "rpcmesh_process_cpu_seconds",
    kind: Histogram,
    labels: ROLE,
    roles: ALL,
    help: "CPU time this process used per collection interval; _sum is its CPU time in fractional seconds.",
};
/// `rpcmesh_process_resident_memory_bytes{role}`.
pub const PROCESS_RESIDENT_MEMORY_BYTES: Family = Family {
    name: "rpcmesh_process_resident_memory_bytes",
    kind: Gauge,
    labels: ROLE,
    roles: ALL,
    help: "Resident memory of this process.",
};
/// `rpcmesh_process_context_switches_total{role, kind}`.
pub const PROCESS_CONTEXT_SWITCHES_TOTAL: Family = Family {
    name: "rpcmesh_process_context_switches_total",
    kind: Counter,
    labels: &["role", "kind"],
    roles: ALL,
    help: "Context switches of this process's threads: kind=voluntary (it waited: for I/O, a lock, a timer) or involuntary (the scheduler took the CPU away).",
};
/// `rpcmesh_buffered_bytes{role}`.
pub const BUFFERED_BYTES: Family = Family {
    name: "rpcmesh_buffered_bytes",
    kind: Gauge,
    labels: ROLE,
    roles: PROVIDER_BROKER,
    help: "Bytes buffered (partial frames, write backlogs, large requests queued toward providers), as the memory budget counts them.",
};
/// `rpcmesh_memory_budget_bytes{role}`.
pub const MEMORY_BUDGET_BYTES: Family = Family {
    name: "rpcmesh_memory_budget_bytes",
    kind: Gauge,
    labels: ROLE,
    roles: PROVIDER_BROKER,
    help: "The memory budget (--memory-budget): past half of it large calls are answered overloaded, past three quarters the largest holders stop reading.",
};
/// `rpcmesh_paused_connections{role}`.
pub const PAUSED_CONNECTIONS: Family = Family {
    name: "rpcmesh_paused_connections",
    kind: Gauge,
    labels: ROLE,
    roles: PROVIDER_BROKER,
    help: "Connections whose reads the memory budget pauses now (past three quarters of it, those holding 256 KiB or more).",
};
/// `rpcmesh_process_virtual_memory_bytes{role}`.
pub const PROCESS_VIRTUAL_MEMORY_BYTES: Family = Family {
    name: "rpcmesh_process_virtual_memory_bytes",
    kind: Gauge,
    labels: ROLE,
    roles: ALL,
    help: "Virtual memory of this process.",
};
/// `rpcmesh_process_virtual_memory_max_bytes{role}`.
pub const PROCESS_VIRTUAL_MEMORY_MAX_BYTES: Family = Family {
    name: "rpcmesh_process_virtual_memory_max_bytes",
    kind: Gauge,
    labels: ROLE,
    roles: ALL,
    help: "Virtual memory limit of this process (0 = unlimited).",
};
/// `rpcmesh_process_open_fds{role}`.
pub const PROCESS_OPEN_FDS: Family = Family {
    name: "rpcmesh_process_open_fds",
    kind: Gauge,
    labels: ROLE,
    roles: ALL,
    help: "File descriptors this process has open.",
};
/// `rpcmesh_process_max_fds{role}`.
pub const PROCESS_MAX_FDS: Family = Family {
    name: "rpcmesh_process_max_fds",
    kind: Gauge,
    labels: ROLE,
    roles: ALL,
    help: "File descriptor limit of this process (0 = unlimited).",
};
/// `rpcmesh_process_threads{role}`.
pub const PROCESS_THREADS: Family = Family {
    name: "rpcmesh_process_threads",
    kind: Gauge,
    labels: ROLE,
    roles: ALL,
    help: "Threads of this process.",
};
/// `rpcmesh_process_start_time_seconds{role}`.
pub const PROCESS_START_TIME_SECONDS: Family = Family {
    name: "rpcmesh_process_start_time_seconds",
    kind: Gauge,
    labels: ROLE,
    roles: ALL,
    help: "Start time of this process, seconds since the Unix epoch.",
};
/// `rpcmesh_log_lines_dropped_total{role}`.
pub const LOG_LINES_DROPPED_TOTAL: Family = Family {
    name: "rpcmesh_log_lines_dropped_total",
    kind: Counter,
    labels: ROLE,
    roles: ALL,
    help: "Log lines this process dropped instead of waiting on stderr: its queue was full (stderr took nothing) or the write failed (stderr closed). The process serves on either way.",
};
/// `rpcmesh_scrape_connections_closed_total{role, reason}`.
pub const SCRAPE_CONNECTIONS_CLOSED_TOTAL: Family = Family {
    name: "rpcmesh_scrape_connections_closed_total",
    kind: Counter,
    labels: &["role", "reason"],
    roles: ALL,
    help: "Connections to this process's /metrics closed, by reason: done (the client closed it, or its response asked to), evicted (idle longest when the 16-connection cap was reached, closed to make room for a new one), timeout (no request headers within 5 s, or idle that long between requests), lifetime (open 120 s), error.",
};
/// `rpcmesh_build_info{role, version, commit}`.
pub const BUILD_INFO: Family = Family {
    name: "rpcmesh_build_info",
    kind: Gauge,
    labels: &["role", "version", "commit"],
    roles: ALL,
    help: "Always 1: the build this process runs, by its version and git commit (what --version prints; unknown for a build without git history).",
};

/// Every family, grouped as `docs/metrics.md` groups them.
pub const CATALOGUE: &[&Family] = &[
    &CALLS_TOTAL,
    &CALL_SECONDS,
    &SHED_TOTAL,
    &CALLS_IN_FLIGHT,
    &CALLS_SENT_TOTAL,
    &REQUESTS_TOTAL,
    &ERRORS_TOTAL,
    &STAGE_SECONDS,
    &COMPRESSION_SECONDS,
    &CONNECTIONS_OPEN,
    &CONNECTIONS_OPENED_TOTAL,
    &CONNECTIONS_CLOSED_TOTAL,
    &CONNECTIONS_REFUSED_TOTAL,
    &WIRE_BYTES_TOTAL,
    &WIRE_SYSCALLS_TOTAL,
    &PAYLOAD_BYTES_TOTAL,
    &UPSTREAM_CONNECT_FAILURES_TOTAL,
    &UPSTREAM_CALLS_IN_FLIGHT,
    &UPSTREAM_CALLS_TOTAL,
    &UPSTREAM_QUICK_ACKS_TOTAL,
    &UPSTREAM_PACE_SECONDS,
    &POOL_CONNECTIONS,
    &POOL_IDLE_CONNECTIONS,
    &POOL_HEALTHY_CONNECTIONS,
    &POOL_GETS_WAITED_TOTAL,
    &POOL_GETS_TIMED_OUT_TOTAL,
    &POOL_GET_WAIT_SECONDS,
    &BUSY_POLL_IDLE_SECONDS,
    &FORWARDING_ALLOCATIONS_TOTAL,
    &POOL_CONNECTIONS_CLOSED_TOTAL,
    &CALLS_REROUTED_TOTAL,
    &ABANDONED_REPLIES_TOTAL,
    &CELL_CALLS_TOTAL,
    &CELL_MOVES_TOTAL,
    &CELLS_OPEN,
    &RETRY_BUDGET_EXHAUSTED_TOTAL,
    &UPSTREAM_EJECTIONS_TOTAL,
    &UPSTREAMS_EJECTED,
    &UPSTREAM_LATENCY_ESTIMATE_SECONDS,
    &CONFIG_RELOADS_TOTAL,
    &TLS_HANDSHAKES_TOTAL,
    &TLS_HANDSHAKE_FAILURES_TOTAL,
    &TLS_CERT_EXPIRY_TIMESTAMP_SECONDS,
    &AUTHZ_DENIED_TOTAL,
    &FILE_RELOADS_TOTAL,
    &DRIVER_OFFERED_CALLS_PER_SECOND,
    &DRIVER_ACHIEVED_CALLS_PER_SECOND,
    &DRIVER_LATENCY_SECONDS,
    &DRIVER_USERS,
    &SOFTIRQS_TOTAL,
    &CPU_SECONDS_TOTAL,
    &HOST_CPU_SECONDS,
    &PROCESS_CPU_SECONDS_TOTAL,
    &PROCESS_CPU_SECONDS,
    &PROCESS_RESIDENT_MEMORY_BYTES,
    &BUFFERED_BYTES,
    &MEMORY_BUDGET_BYTES,
    &PAUSED_CONNECTIONS,
    &PROCESS_CONTEXT_SWITCHES_TOTAL,
    &PROCESS_VIRTUAL_MEMORY_BYTES,
    &PROCESS_VIRTUAL_MEMORY_MAX_BYTES,
    &PROCESS_OPEN_FDS,
    &PROCESS_MAX_FDS,
    &PROCESS_THREADS,
    &PROCESS_START_TIME_SECONDS,
    &LOG_LINES_DROPPED_TOTAL,
    &SCRAPE_CONNECTIONS_CLOSED_TOTAL,
    &BUILD_INFO,
];

/// Puts the help text of every catalogued family on `telemetry`'s recorder (every recorder
/// gets it when it is made).
pub(crate) fn describe_all(telemetry: &Telemetry) {
    for f in CATALOGUE {
        telemetry.describe(f);
    }
}

/// Finds a catalogued family by name.
pub fn find(name: &str) -> Option<&'static Family> {
    CATALOGUE.iter().copied().find(|f| f.name == name)
}

/// The families in a Prometheus text exposition, with their types, from its `# TYPE`
/// lines (for the tests that compare what a program exports with the catalogue).
pub fn exported_families(exposition: &str) -> Vec<(String, String)> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_string(), kind.trim().to_string()))
        .collect()
}

/// What differs between the families `role` exports (an exposition of it) and the
/// catalogue: families exported but not catalogued for `role` (or of another type), and
/// families catalogued for `role` but not exported (but for the [`CONDITIONAL`] ones).
/// Empty when they agree.
pub fn mismatches(role: Role, exposition: &str) -> Vec<String> {
    let exported = exported_families(exposition);
    let mut problems = Vec::new();
    for (name, kind) in &exported {
        match find(name) {
            None => problems.push(format!(
                "{} exports {name}, which is not catalogued",
                role.label()
            )),
            Some(f) if !f.exported_by(role) => problems.push(format!(
                "{} exports {name}, catalogued for {} only",
                role.label(),
                f.roles_text()
            )),
            Some(f) if f.kind.word() != kind => problems.push(format!(
                "{} exports {name} as a {kind}, catalogued as a {}",
                role.label(),
                f.kind.word()
            )),
            Some(_) => {}
        }
    }
    let conditional = |f: &Family| CONDITIONAL.iter().any(|c| c.name == f.name);
    for f in CATALOGUE
        .iter()
        .filter(|f| f.exported_by(role) && !conditional(f))
    {
        if !exported.iter().any(|(n, _)| n == f.name) {
            problems.push(format!(
                "{} is catalogued for {} but {} does not export it",
                f.name,
                f.roles_text(),
                role.label()
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_conventions() {
        let mut seen = std::collections::HashSet::new();
        for f in CATALOGUE {
            assert!(seen.insert(f.name), "{} listed twice", f.name);
            assert!(f.name.starts_with("rpcmesh_"), "{}", f.name);
            assert_eq!(
                f.kind == Kind::Counter,
                f.name.ends_with("_total"),
                "{}: counters and only counters end in _total",
                f.name
            );
            assert_eq!(
                f.labels.first(),
                Some(&"role"),
                "{}: role comes first",
                f.name
            );
            assert!(
                !f.labels.contains(&"instance") && !f.labels.contains(&"job"),
                "{}",
                f.name
            );
            assert!(!f.help.is_empty() && !f.roles.is_empty(), "{}", f.name);
        }
    }

    /// docs/metrics.md lists exactly the catalogue, with the same types, labels and roles.
    #[test]
    fn the_metrics_doc_matches_the_catalogue() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
                .expect("docs/metrics.md");
        let mut documented = Vec::new();
        for line in doc.lines().filter(|l| l.starts_with("| `rpcmesh_")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`');
            let f = find(name)
                .unwrap_or_else(|| panic!("{name} is in docs/metrics.md but not in the catalogue"));
            assert_eq!(cells[2], f.kind.word(), "{name}: type");
            assert_eq!(
                cells[3].replace('`', ""),
                f.labels.join(", "),
                "{name}: labels"
            );
            assert_eq!(cells[4], f.roles_text(), "{name}: programs");
            documented.push(name.to_string());
        }
        for f in CATALOGUE {
            assert!(
                documented.iter().any(|n| n == f.name),
                "{} is not in docs/metrics.md",
                f.name
            );
        }
    }

    #[test]
    fn mismatches_name_what_is_missing_extra_or_of_another_type() {
        let text = "# TYPE rpcmesh_calls_total counter\n# TYPE rpcmesh_pool_connections gauge\n# TYPE rpcmesh_nope_total counter\n# TYPE rpcmesh_calls_in_flight counter\n";
        let p = mismatches(Role::Provider, text);
        let has = |s: &str| p.iter().any(|m| m.contains(s));
        assert!(has("rpcmesh_nope_total, which is not catalogued"), "{p:?}");
        assert!(
            has("rpcmesh_pool_connections, catalogued for broker only"),
            "{p:?}"
        );
        assert!(has("rpcmesh_calls_in_flight as a counter"), "{p:?}");
        assert!(has("rpcmesh_stage_seconds is catalogued"), "{p:?}");
        assert!(!has("rpcmesh_calls_total"), "{p:?}");
    }
}
