//! The broker's metric handles, registered once per instance on its own recorder (per
//! upstream for the pool metrics), from the catalogue's families
//! (`rpcmesh_common::metrics::catalogue`, where names and meanings are written down;
//! `docs/metrics.md` lists them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram};
use rpcmesh_common::metrics::catalogue::{
    ABANDONED_REPLIES_TOTAL, BUSY_POLL_IDLE_SECONDS, CALLS_IN_FLIGHT, CALLS_REROUTED_TOTAL,
    CELL_CALLS_TOTAL, CELL_MOVES_TOTAL, CELLS_OPEN, CONFIG_RELOADS_TOTAL,
    FORWARDING_ALLOCATIONS_TOTAL, POOL_CONNECTIONS, POOL_CONNECTIONS_CLOSED_TOTAL,
    POOL_GET_WAIT_SECONDS, POOL_GETS_TIMED_OUT_TOTAL, POOL_GETS_WAITED_TOTAL,
    POOL_HEALTHY_CONNECTIONS, POOL_IDLE_CONNECTIONS, RETRY_BUDGET_EXHAUSTED_TOTAL,
    UPSTREAM_CALLS_IN_FLIGHT, UPSTREAM_CALLS_TOTAL, UPSTREAM_CONNECT_FAILURES_TOTAL,
    UPSTREAM_EJECTIONS_TOTAL, UPSTREAM_LATENCY_ESTIMATE_SECONDS, UPSTREAM_PACE_SECONDS,
    UPSTREAM_QUICK_ACKS_TOTAL, UPSTREAMS_EJECTED,
};
use rpcmesh_common::metrics::families::{
    CallCounters, ConnCounters, ShedCounters, Stages, WireCounters,
};
use rpcmesh_common::metrics::recorder::Exposure;
use rpcmesh_common::metrics::{ErrorCounters, Role, Telemetry};
use rpcmesh_wire::Status;

use crate::call::Reroute;
use crate::resilience::outlier::EjectReason;

/// The `role` of every broker metric.
pub const ROLE: Role = Role::Broker;
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
    /// Errors by kind and side (upstream connections count into the same family).
    pub errors: ErrorCounters,
    /// `rpcmesh_busy_poll_idle_seconds`, registered whether or not the broker busy-polls,
    /// so that the series is there.
    pub busy_poll_idle: Histogram,
    /// Calls admitted and not yet answered.
    pub in_flight: Gauge,
    /// Client connections.
    pub conns: Arc<ConnCounters>,
    /// Bytes on client connections.
    pub wire: WireCounters,
    /// Per-stage latency.
    pub stages: Stages,
    /// Calls shed at once, by the cap they met.
    pub shed: ShedCounters,
    /// Calls handed back to be routed again, by [`Reroute`] (in its `ALL` order).
    pub(crate) rerouted: Arc<[Counter; Reroute::ALL.len()]>,
    /// Outcomes dropped because their caller had left.
    pub abandoned: Counter,
    /// Retries refused for want of budget, by [`Reroute`] (in its `ALL` order).
    pub(crate) budget_exhausted: Arc<[Counter; Reroute::ALL.len()]>,
    /// Providers ejected now.
    pub ejected: Gauge,
    /// Reads of the providers file after the start that were applied.
    pub reloads_ok: Counter,
    /// Reads of the providers file after the start that were kept out.
    pub reloads_error: Counter,
    /// Heap allocations made by sessions and upstream connections, when the program
    /// counts them (`rpcmesh_common::alloc`; else a no-op).
    pub allocations: Counter,
    calls: Arc<CallLabels>,
}

impl BrokerMetrics {
    /// Registers the handles; stages are timed on one call in `stage_sample` (0: never).
    pub fn new(telemetry: Telemetry, stage_sample: u32) -> Self {
        let t = &telemetry;
        let role = [("role", ROLE.label())];
        BrokerMetrics {
            errors: ErrorCounters::new(t, ROLE),
            busy_poll_idle: t.histogram(&BUSY_POLL_IDLE_SECONDS, &role),
            in_flight: t.gauge(&CALLS_IN_FLIGHT, &role),
            conns: Arc::new(ConnCounters::inbound(t, ROLE)),
            wire: WireCounters::new(t, ROLE, "inbound"),
            stages: Stages::new(t, ROLE, &STAGES, stage_sample),
            shed: ShedCounters::new(t, ROLE),
            rerouted: Arc::new(Reroute::ALL.map(|r| {
                t.counter(
                    &CALLS_REROUTED_TOTAL,
                    &[("role", ROLE.label()), ("reason", r.label())],
                )
            })),
            abandoned: t.counter(&ABANDONED_REPLIES_TOTAL, &role),
            budget_exhausted: Arc::new(Reroute::ALL.map(|r| {
                t.counter(
                    &RETRY_BUDGET_EXHAUSTED_TOTAL,
                    &[("role", ROLE.label()), ("reason", r.label())],
                )
            })),
            ejected: t.gauge(&UPSTREAMS_EJECTED, &role),
            reloads_ok: t.counter(
                &CONFIG_RELOADS_TOTAL,
                &[("role", ROLE.label()), ("result", "ok")],
            ),
            reloads_error: t.counter(
                &CONFIG_RELOADS_TOTAL,
                &[("role", ROLE.label()), ("result", "error")],
            ),
            allocations: if rpcmesh_common::alloc::counting() {
                t.counter(&FORWARDING_ALLOCATIONS_TOTAL, &role)
            } else {
                Counter::noop()
            },
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
    /// ([`request_names`](rpcmesh_wire::body::request_names)), when the pair has its
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

    /// The count of calls answered by cell `cell` of `cells` (`crate::cell`); none with
    /// one cell, whose count is the broker's.
    pub fn cell_calls(&self, cell: usize, cells: usize) -> Counter {
        if cells <= 1 {
            return Counter::noop();
        }
        let cell = cell.to_string();
        self.telemetry.counter(
            &CELL_CALLS_TOTAL,
            &[("role", ROLE.label()), ("cell", &cell)],
        )
    }

    /// `rpcmesh_cells_open` and `rpcmesh_cell_moves_total` of a broker of `cells` cells
    /// (`crate::cell::placement`); none with one cell.
    pub fn placement(&self, cells: usize) -> (Gauge, Counter) {
        if cells <= 1 {
            return (Gauge::noop(), Counter::noop());
        }
        let role = [("role", ROLE.label())];
        (
            self.telemetry.gauge(&CELLS_OPEN, &role),
            self.telemetry.counter(&CELL_MOVES_TOTAL, &role),
        )
    }

    /// The counters for calls whose names could not be read.
    pub fn calls_other(&self) -> Arc<CallCounters> {
        self.calls.other.clone()
    }

    /// Handles for one upstream with `pool_size` pooled connections, over `cells` cells
    /// (`crate::cell`): these are the first cell's, [`UpstreamMetrics::in_cell`] gives the
    /// others'. The pool's gauges and counters are summed over the cells.
    pub fn upstream(&self, label: &str, pool_size: u32, cells: usize) -> UpstreamMetrics {
        let t = &self.telemetry;
        let l = [("role", ROLE.label()), ("upstream", label)];
        UpstreamMetrics {
            allocations: self.allocations.clone(),
            stages: self.stages.clone(),
            errors: self.errors.clone(),
            wire: WireCounters::new(t, ROLE, "upstream"),
            conns: Arc::new(ConnCounters::outbound(t, ROLE, "upstream")),
            connect_failures: t.counter(&UPSTREAM_CONNECT_FAILURES_TOTAL, &l),
            quick_acks: t.counter(&UPSTREAM_QUICK_ACKS_TOTAL, &l),
            pace: t.gauge(&UPSTREAM_PACE_SECONDS, &l),
            latency_estimate: t.gauge(&UPSTREAM_LATENCY_ESTIMATE_SECONDS, &l),
            budget_exhausted: self.budget_exhausted.clone(),
            ejections: EjectReason::ALL.map(|r| {
                t.counter(
                    &UPSTREAM_EJECTIONS_TOTAL,
                    &[l[0], l[1], ("reason", r.label())],
                )
            }),
            calls: Arc::new(
                Status::ALL.map(|s| {
                    t.counter(&UPSTREAM_CALLS_TOTAL, &[l[0], l[1], ("status", s.label())])
                }),
            ),
            pool_connections: t.gauge(&POOL_CONNECTIONS, &l),
            pool_idle: t.gauge(&POOL_IDLE_CONNECTIONS, &l),
            pool_healthy: t.gauge(&POOL_HEALTHY_CONNECTIONS, &l),
            pool_gets_waited: t.counter(&POOL_GETS_WAITED_TOTAL, &l),
            pool_gets_timed_out: t.counter(&POOL_GETS_TIMED_OUT_TOTAL, &l),
            pool_wait_seconds: t.histogram(&POOL_GET_WAIT_SECONDS, &l),
            conn_in_flight: (0..pool_size)
                .map(|i| {
                    let conn = i.to_string();
                    t.gauge(
                        &UPSTREAM_CALLS_IN_FLIGHT,
                        &[("role", ROLE.label()), ("upstream", label), ("conn", &conn)],
                    )
                })
                .collect(),
            pool_closed_broken: t.counter(
                &POOL_CONNECTIONS_CLOSED_TOTAL,
                &[
                    ("role", ROLE.label()),
                    ("upstream", label),
                    ("reason", "broken"),
                ],
            ),
            pool_closed_invalid: t.counter(
                &POOL_CONNECTIONS_CLOSED_TOTAL,
                &[
                    ("role", ROLE.label()),
                    ("upstream", label),
                    ("reason", "invalid"),
                ],
            ),
            exposed: Some(Arc::new(t.exposure("upstream", label))),
            cell: 0,
            conn_offset: 0,
            sums: Arc::new(PoolSums {
                cells: Mutex::new(vec![[0; POOL_FIGURES]; cells.max(1)]),
            }),
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
    /// Heap allocations of the connection tasks (the broker's counter).
    pub allocations: Counter,
    /// Per-stage latency (the `queue` and `upstream` stages are recorded here).
    pub stages: Stages,
    /// Errors by kind and side.
    pub errors: ErrorCounters,
    /// Bytes on the upstream connections.
    pub wire: WireCounters,
    /// Connections to providers (all upstreams share the series).
    pub conns: Arc<ConnCounters>,
    /// Connection attempts that failed.
    pub connect_failures: Counter,
    /// ACKs sent at once after reads from a plain v1 server with calls in flight.
    pub quick_acks: Counter,
    /// The provider's time per call on one connection (`upstream::pace`).
    pace: Gauge,
    /// The balancer's latency estimate (`resilience::ewma`).
    latency_estimate: Gauge,
    /// Retries refused for want of budget (the broker's counters).
    pub(crate) budget_exhausted: Arc<[Counter; Reroute::ALL.len()]>,
    /// Ejections, by [`EjectReason`] (in its `ALL` order).
    pub(crate) ejections: [Counter; EjectReason::ALL.len()],
    /// Calls written to this provider, by outcome.
    calls: Arc<[Counter; Status::ALL.len()]>,
    pool_connections: Gauge,
    pool_idle: Gauge,
    pool_healthy: Gauge,
    pool_gets_waited: Counter,
    pool_gets_timed_out: Counter,
    pool_wait_seconds: Histogram,
    conn_in_flight: Vec<Gauge>,
    pool_closed_broken: Counter,
    pool_closed_invalid: Counter,
    /// Keeps this provider's series exported: the pool, its keeper and its connection
    /// tasks hold clones, so they go once the provider left and its last connection
    /// closed (before that, a leaving provider shows its draining connections).
    /// (The loop engine, which holds one set of handles per provider, lets go of it
    /// itself: [`UpstreamMetrics::unexpose`].)
    exposed: Option<Arc<Exposure>>,
    /// The cell whose pool these are, and the number of its first connection among the
    /// provider's (the `conn` label).
    cell: usize,
    conn_offset: usize,
    /// The pool figures of every cell.
    sums: Arc<PoolSums>,
}

/// How many pool figures a cell publishes: connections, idle, healthy, gets waited, gets
/// timed out, closed broken, closed invalid.
const POOL_FIGURES: usize = 7;

/// A provider's pool figures in each cell, whose sums its series show. Written once per
/// health interval by each cell's keeper, under the lock, so that the series always show
/// a sum of the latest figures.
#[derive(Debug)]
struct PoolSums {
    cells: Mutex<Vec<[u64; POOL_FIGURES]>>,
}

impl UpstreamMetrics {
    /// The handles of the same provider's pool in cell `cell`, whose connections are
    /// numbered from `conn_offset`.
    pub(crate) fn in_cell(&self, cell: usize, conn_offset: usize) -> UpstreamMetrics {
        UpstreamMetrics {
            cell,
            conn_offset,
            ..self.clone()
        }
    }

    /// Changes this cell's pool figures with `change` and publishes their sums over the
    /// cells.
    fn publish_sums(&self, change: impl FnOnce(&mut [u64; POOL_FIGURES])) {
        let mut cells = self
            .sums
            .cells
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(row) = cells.get_mut(self.cell) {
            change(row);
        }
        let mut sum = [0u64; POOL_FIGURES];
        for row in cells.iter() {
            for (s, v) in sum.iter_mut().zip(row) {
                *s += v;
            }
        }
        let [
            connections,
            idle,
            healthy,
            waited,
            timed_out,
            broken,
            invalid,
        ] = sum;
        self.pool_connections.set(connections as f64);
        self.pool_idle.set(idle as f64);
        self.pool_healthy.set(healthy as f64);
        self.pool_gets_waited.absolute(waited);
        self.pool_gets_timed_out.absolute(timed_out);
        self.pool_closed_broken.absolute(broken);
        self.pool_closed_invalid.absolute(invalid);
    }

    /// This cell's connection gauges.
    fn own_conns(&self, count: usize) -> &[Gauge] {
        let start = self.conn_offset.min(self.conn_in_flight.len());
        let end = (self.conn_offset + count).min(self.conn_in_flight.len());
        &self.conn_in_flight[start..end]
    }

    /// Counts the outcome of one call written to this provider.
    pub(crate) fn outcome(&self, status: Status) {
        self.outcomes(status, 1);
    }

    /// Counts `n` calls of one status (a read's worth, [`StatusTally`]).
    pub(crate) fn outcomes(&self, status: Status, n: u64) {
        self.calls[status as usize].increment(n);
    }

    /// Sets the calls in flight of each of this cell's `size` pooled connections, by
    /// position.
    pub(crate) fn publish_conn_loads(&self, size: usize, loads: impl Iterator<Item = usize>) {
        let mut loads = loads;
        for g in self.own_conns(size) {
            g.set(loads.next().unwrap_or(0) as f64);
        }
    }

    /// Sets the provider's time per call, measured or reported (`None`: not known).
    pub(crate) fn publish_pace(&self, per_call: Option<std::time::Duration>) {
        self.pace.set(per_call.map_or(0.0, |d| d.as_secs_f64()));
    }

    /// Sets the balancer's latency estimate of the provider.
    pub(crate) fn publish_latency_estimate(&self, estimate: std::time::Duration) {
        self.latency_estimate.set(estimate.as_secs_f64());
    }

    /// Sets the pool's connections to `up`, every one idle and healthy: the loop
    /// engine's pool, whose connections are up or being made again.
    pub(crate) fn publish_conns(&self, up: usize) {
        let up = up as u64;
        self.publish_sums(|row| row[..3].copy_from_slice(&[up, up, up]));
    }

    /// These handles no longer keep the provider's series exported (the loop engine's
    /// provider that left, once its connections are closed).
    pub(crate) fn unexpose(&mut self) {
        self.exposed = None;
    }

    /// The pool stopped (its provider left, or the broker is stopping): its gauges go to
    /// zero, so that a provider that left does not look as if it still had connections.
    pub(crate) fn publish_gone(&self, size: usize) {
        for g in self.own_conns(size) {
            g.set(0.0);
        }
        self.pace.set(0.0);
        self.latency_estimate.set(0.0);
        self.publish_sums(|row| row[..3].fill(0));
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
        self.publish_sums(|row| {
            *row = [
                u64::from(state.connections),
                u64::from(state.idle_connections),
                healthy as u64,
                s.get_waited,
                s.get_timed_out,
                s.connections_closed_broken,
                s.connections_closed_invalid,
            ];
        });
        if s.get_wait_time > *before {
            self.pool_wait_seconds
                .record((s.get_wait_time - *before).as_secs_f64());
            *before = s.get_wait_time;
        }
    }
}

/// Calls counted by status where they end, to be added to a counter family in one go: a
/// session's round of answers, an upstream connection's read of replies. The counters are
/// shared by the cells calling the same method or provider; the tally is the cell's own,
/// so an answer costs no atomic another core writes.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct StatusTally([u32; Status::ALL.len()]);

impl StatusTally {
    /// One call more of `status`.
    pub fn add(&mut self, status: Status) {
        self.0[status as usize] += 1;
    }

    /// Whether nothing was counted since the last drain.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&n| n == 0)
    }

    /// Hands each status's count, if any, to `to`, and starts again from none.
    pub fn drain(&mut self, mut to: impl FnMut(Status, u64)) {
        for (status, n) in Status::ALL.into_iter().zip(std::mem::take(&mut self.0)) {
            if n > 0 {
                to(status, u64::from(n));
            }
        }
    }
}
