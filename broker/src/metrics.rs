//! The broker's metric handles, registered once per instance on its own recorder (per
//! upstream for the pool metrics). Names and meanings are listed in `docs/metrics.md`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram};
use rpcmesh_common::telemetry::{
    CallCounters, ConnCounters, ErrorCounters, Stages, Telemetry, WireCounters,
};

/// Value of the `role` label on every broker metric.
pub const ROLE: &str = "broker";
/// Distinct (service, method) label pairs before further names are counted as `_other`:
/// callers choose the names, so they must not be able to grow the series count at will.
pub const MAX_CALL_LABELS: usize = 256;

/// Stage: from the read that brought a request to handing it to routing (names read,
/// caps checked).
pub const ADMIT: usize = 0;
/// Stage: from routing to the write that sent it to the provider (the upstream
/// connection's queue and write buffer).
pub const QUEUE: usize = 1;
/// Stage: from that write to the read that brought the provider's reply.
pub const UPSTREAM: usize = 2;
/// Stage: from that read to the write that took the reply to the caller.
pub const WRITE_BACK: usize = 3;
/// Stage: from the read that brought the request to the write that took its reply.
pub const TOTAL: usize = 4;
/// Names of the stages, by index.
pub const STAGES: [&str; 5] = ["admit", "queue", "upstream", "write_back", "total"];

/// Handles the sessions update.
#[derive(Debug, Clone)]
pub struct BrokerMetrics {
    /// The recorder they live in.
    pub telemetry: Telemetry,
    /// Errors by kind (both sides; upstream connections count into the same family).
    pub errors: ErrorCounters,
    /// Calls admitted and not yet answered.
    pub in_flight: Gauge,
    /// Client connections.
    pub conns: Arc<ConnCounters>,
    /// Bytes on client connections.
    pub wire: WireCounters,
    /// Per-stage latency.
    pub stages: Stages,
    calls: Arc<CallLabels>,
}

impl BrokerMetrics {
    /// Registers the handles; stages are timed on one call in `stage_sample` (0: never).
    pub fn new(telemetry: Telemetry, stage_sample: u32) -> Self {
        let t = &telemetry;
        rpcmesh_common::catalogue::describe_all(t);
        BrokerMetrics {
            errors: ErrorCounters::new(t, ROLE),
            in_flight: t.gauge("rpcmesh_calls_in_flight", &[("role", ROLE)]),
            conns: Arc::new(ConnCounters::new(t, ROLE, "inbound")),
            wire: WireCounters::new(t, ROLE, "inbound"),
            stages: Stages::new(t, ROLE, &STAGES, stage_sample),
            calls: Arc::new(CallLabels {
                seen: Mutex::new(HashMap::new()),
                other: Arc::new(CallCounters::new(
                    t,
                    ROLE,
                    CallCounters::OTHER,
                    CallCounters::OTHER,
                )),
            }),
            telemetry,
        }
    }

    /// The call counters of a (service, method) pair, given as the request's names bytes
    /// ([`request_names`](rpcmesh_common::frame::request_names)), when the pair has its
    /// own labels already, or `_other` when no more pairs can get labels.
    pub fn known_calls(&self, names: &[u8]) -> Option<Arc<CallCounters>> {
        self.calls.known(&self.calls.lock(), names)
    }

    /// The call counters of the pair whose names bytes are `names` (the service name is
    /// its first `service_len` bytes), registering the pair (up to [`MAX_CALL_LABELS`];
    /// then `_other`). Sessions call it only once a call of that pair has succeeded, so
    /// callers cannot use up the labels with names nobody serves, and cache the result, so
    /// it runs once per name per connection.
    pub fn calls(&self, names: &[u8], service_len: usize) -> Arc<CallCounters> {
        let mut seen = self.calls.lock();
        if let Some(c) = self.calls.known(&seen, names) {
            return c;
        }
        // `names` = service, 2-byte length, method.
        let service = String::from_utf8_lossy(&names[..service_len]);
        let method = String::from_utf8_lossy(names.get(service_len + 2..).unwrap_or_default());
        let c = Arc::new(CallCounters::new(&self.telemetry, ROLE, &service, &method));
        seen.insert(names.into(), c.clone());
        c
    }

    /// The counters for calls whose names could not be read.
    pub fn calls_other(&self) -> Arc<CallCounters> {
        self.calls.other.clone()
    }

    /// Handles for one upstream with `pool_size` pooled connections.
    pub fn upstream(&self, label: &str, pool_size: u32) -> UpstreamMetrics {
        let t = &self.telemetry;
        let l = [("role", ROLE), ("upstream", label)];
        UpstreamMetrics {
            stages: self.stages.clone(),
            errors: self.errors.clone(),
            wire: WireCounters::new(t, ROLE, "upstream"),
            conns: Arc::new(ConnCounters::new(t, ROLE, "upstream")),
            connect_failures: t.counter("rpcmesh_upstream_connect_failures_total", &l),
            pool_connections: t.gauge("rpcmesh_pool_connections", &l),
            pool_idle: t.gauge("rpcmesh_pool_idle_connections", &l),
            pool_healthy: t.gauge("rpcmesh_pool_healthy_connections", &l),
            pool_gets_waited: t.counter("rpcmesh_pool_gets_waited_total", &l),
            pool_gets_timed_out: t.counter("rpcmesh_pool_gets_timed_out_total", &l),
            pool_wait_seconds: t.histogram("rpcmesh_pool_get_wait_seconds", &l),
            conn_in_flight: (0..pool_size)
                .map(|i| {
                    let conn = i.to_string();
                    t.gauge(
                        "rpcmesh_upstream_calls_in_flight",
                        &[("role", ROLE), ("upstream", label), ("conn", &conn)],
                    )
                })
                .collect(),
            pool_closed_broken: t.counter(
                "rpcmesh_pool_connections_closed_total",
                &[("role", ROLE), ("upstream", label), ("reason", "broken")],
            ),
            pool_closed_invalid: t.counter(
                "rpcmesh_pool_connections_closed_total",
                &[("role", ROLE), ("upstream", label), ("reason", "invalid")],
            ),
        }
    }
}

#[derive(Debug)]
struct CallLabels {
    /// By the request's names bytes (service and method, as on the wire).
    seen: Mutex<LabelTable>,
    other: Arc<CallCounters>,
}

type LabelTable = HashMap<Box<[u8]>, Arc<CallCounters>>;

impl CallLabels {
    fn lock(&self) -> std::sync::MutexGuard<'_, LabelTable> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The pair's counters if it has labels, `_other` once no more pairs can get them.
    fn known(&self, seen: &LabelTable, names: &[u8]) -> Option<Arc<CallCounters>> {
        seen.get(names)
            .cloned()
            .or_else(|| (seen.len() >= MAX_CALL_LABELS).then(|| self.other.clone()))
    }
}

/// Handles of one upstream (provider) and its pool.
#[derive(Debug, Clone)]
pub struct UpstreamMetrics {
    /// Per-stage latency (the `queue` and `upstream` stages are recorded here).
    pub stages: Stages,
    /// Errors by kind.
    pub errors: ErrorCounters,
    /// Bytes on the upstream connections.
    pub wire: WireCounters,
    /// Connections to providers (all upstreams share the series).
    pub conns: Arc<ConnCounters>,
    /// Connection attempts that failed.
    pub connect_failures: Counter,
    pool_connections: Gauge,
    pool_idle: Gauge,
    pool_healthy: Gauge,
    pool_gets_waited: Counter,
    pool_gets_timed_out: Counter,
    pool_wait_seconds: Histogram,
    conn_in_flight: Vec<Gauge>,
    pool_closed_broken: Counter,
    pool_closed_invalid: Counter,
}

impl UpstreamMetrics {
    /// Sets the calls in flight of each pooled connection, by position.
    pub(crate) fn publish_conn_loads(&self, loads: impl Iterator<Item = usize>) {
        let mut loads = loads;
        for g in &self.conn_in_flight {
            g.set(loads.next().unwrap_or(0) as f64);
        }
    }

    /// Copies bb8's view of the pool into the gauges and counters. `waited_before` is
    /// bb8's total wait time at the last call (its statistics are cumulative); the keeper
    /// that calls this every health interval owns it.
    pub(crate) fn publish_pool(
        &self,
        state: &bb8::State,
        healthy: usize,
        waited_before: &mut std::time::Duration,
    ) {
        let before = waited_before;
        let s = &state.statistics;
        self.pool_connections.set(f64::from(state.connections));
        self.pool_idle.set(f64::from(state.idle_connections));
        self.pool_healthy.set(healthy as f64);
        self.pool_gets_waited.absolute(s.get_waited);
        self.pool_gets_timed_out.absolute(s.get_timed_out);
        if s.get_wait_time > *before {
            self.pool_wait_seconds
                .record((s.get_wait_time - *before).as_secs_f64());
            *before = s.get_wait_time;
        }
        self.pool_closed_broken
            .absolute(s.connections_closed_broken);
        self.pool_closed_invalid
            .absolute(s.connections_closed_invalid);
    }
}
