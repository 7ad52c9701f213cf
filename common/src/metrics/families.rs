//! The handle groups every program registers the same way: per-stage latency
//! ([`Stages`], sampled by [`Sampler`]), connections ([`ConnCounters`]), bytes and syscalls
//! on the wire ([`WireCounters`]), payload bytes before and after compression
//! ([`PayloadCounters`]), calls by outcome ([`CallCounters`]), the time compression
//! takes ([`CompressionTimers`]), a connection's share of the calls in flight
//! ([`InFlightShare`]), and the build the process runs ([`publish_build_info`]). Each is registered once, from the catalogue's families,
//! and then only incremented.
//!
//! Owns how these groups are registered and fed. Names and meanings are the catalogue's;
//! errors are [`crate::metrics::errors`]'; each program's own families are in its
//! `metrics.rs`.

use metrics::{Counter, Gauge, Histogram};
use rpcmesh_wire::Status;
use rpcmesh_wire::envelope::{CompressionObserver, PayloadSize};

use crate::metrics::Telemetry;
use crate::metrics::catalogue::{
    BUFFERED_BYTES, BUILD_INFO, CALL_SECONDS, CALLS_TOTAL, COMPRESSION_SECONDS,
    CONNECTIONS_CLOSED_TOTAL, CONNECTIONS_OPEN, CONNECTIONS_OPENED_TOTAL,
    CONNECTIONS_REFUSED_TOTAL, MEMORY_BUDGET_BYTES, PAUSED_CONNECTIONS, PAYLOAD_BYTES_TOTAL, Role,
    SHED_TOTAL, STAGE_SECONDS, WIRE_BYTES_TOTAL, WIRE_SYSCALLS_TOTAL,
};
use crate::net::connection::{CloseReason, IoCounts};
use crate::net::listener::{AcceptObserver, Refusal};

/// One connection's share of `rpcmesh_calls_in_flight`: each connection adds the change
/// since it last reported, so the gauge sums every connection's calls without a lock; a
/// connection that ends takes its share back.
pub struct InFlightShare {
    gauge: Gauge,
    reported: usize,
}

impl std::fmt::Debug for InFlightShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlightShare")
            .field("reported", &self.reported)
            .finish()
    }
}

impl InFlightShare {
    /// A share of `gauge`, at zero.
    pub fn new(gauge: Gauge) -> Self {
        InFlightShare { gauge, reported: 0 }
    }

    /// This connection has `now` calls in flight.
    pub fn report(&mut self, now: usize) {
        if now != self.reported {
            self.gauge.increment(now as f64 - self.reported as f64);
            self.reported = now;
        }
    }
}

impl Drop for InFlightShare {
    fn drop(&mut self) {
        self.report(0);
    }
}

/// One call in this many has its stages timed unless configured otherwise: a timestamp
/// costs about 24 ns and a histogram sample about 26 ns, so timing every call of a
/// five-stage program costs ~0.25 µs, a fifth of a provider's whole per-call CPU at high
/// rates; one in 8 keeps that under 3 % while a busy connection still gives thousands of
/// samples a second, plenty for p99.9.
pub const DEFAULT_STAGE_SAMPLE: u32 = 8;

/// Per-stage latency histograms of one role, `rpcmesh_stage_seconds{role, stage}`: one
/// family across the three programs, with the same stage name wherever it means the same
/// thing (see `docs/metrics.md` for where each stage starts and ends).
///
/// Stages are timed on a sample of calls, one in `every` (each connection picks with its own
/// [`Sampler`]); the histograms' quantiles describe all calls, their `_count` is the number
/// of timed calls. With `every` = 0 (`--stage-metrics off`) every handle is a no-op and no
/// call is picked, so the hot path takes no timestamps at all.
#[derive(Clone)]
pub struct Stages {
    hists: Vec<Histogram>,
    every: u32,
}

impl std::fmt::Debug for Stages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stages")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

impl Stages {
    /// Registers one histogram per stage name, in order (index = the caller's stage
    /// constant); one call in `every` is timed, none when `every` is 0.
    pub fn new(t: &Telemetry, role: Role, names: &[&'static str], every: u32) -> Self {
        Stages {
            hists: names
                .iter()
                .map(|s| {
                    if every > 0 {
                        t.histogram(&STAGE_SECONDS, &[("role", role.label()), ("stage", s)])
                    } else {
                        Histogram::noop()
                    }
                })
                .collect(),
            every,
        }
    }

    /// True when stages are recorded at all.
    pub fn on(&self) -> bool {
        self.every > 0
    }

    /// A sampler for one connection.
    pub fn sampler(&self) -> Sampler {
        Sampler {
            every: self.every,
            // Connections start at different points of the cycle.
            n: fastrand::u32(..self.every.max(1)),
        }
    }

    /// Records one stage's duration.
    pub fn record(&self, stage: usize, d: std::time::Duration) {
        if let Some(h) = self.hists.get(stage) {
            h.record(d.as_secs_f64());
        }
    }

    /// Records `to - from` (zero if `to` is earlier).
    pub fn record_span(&self, stage: usize, from: std::time::Instant, to: std::time::Instant) {
        self.record(stage, to.saturating_duration_since(from));
    }
}

/// Picks the calls whose stages are timed: one in `every`, in turn.
#[derive(Clone, Debug)]
pub struct Sampler {
    every: u32,
    n: u32,
}

impl Sampler {
    /// True when the next call is to be timed.
    #[inline]
    pub fn pick(&mut self) -> bool {
        if self.every == 0 {
            return false;
        }
        self.n += 1;
        if self.n >= self.every {
            self.n = 0;
            true
        } else {
            false
        }
    }

    /// `Instant::now()` when the next call is to be timed.
    #[inline]
    pub fn stamp(&mut self) -> Option<std::time::Instant> {
        self.pick().then(std::time::Instant::now)
    }
}

/// Connection counters of one side of a program: `rpcmesh_connections_opened_total`,
/// `_closed_total`, `_refused_total` and the `rpcmesh_connections_open` gauge, labelled
/// `role` and `side` (`inbound` = callers connecting to us, `upstream` = our connections to
/// providers, `outbound` = the driver's connections).
#[derive(Clone, Debug)]
pub struct ConnCounters {
    opened: Counter,
    /// By [`CloseReason::index`].
    closed: [Counter; CloseReason::ALL.len()],
    /// By [`Refusal::index`].
    refused: [Counter; Refusal::ALL.len()],
    open: Gauge,
}

impl ConnCounters {
    /// The counters of the connections callers make to a program of `role` (side
    /// `inbound`), refusals at the connection cap included.
    pub fn inbound(t: &Telemetry, role: Role) -> Self {
        let mut c = ConnCounters::outbound(t, role, "inbound");
        c.refused = Refusal::ALL.map(|r| {
            t.counter(
                &CONNECTIONS_REFUSED_TOTAL,
                &[
                    ("role", role.label()),
                    ("side", "inbound"),
                    ("reason", r.label()),
                ],
            )
        });
        c
    }

    /// The counters of the connections a program of `role` makes (`side`: `outbound` for
    /// the driver, `upstream` for the broker's to providers): nothing refuses them here.
    pub fn outbound(t: &Telemetry, role: Role, side: &'static str) -> Self {
        let l = [("role", role.label()), ("side", side)];
        ConnCounters {
            opened: t.counter(&CONNECTIONS_OPENED_TOTAL, &l),
            closed: CloseReason::ALL.map(|r| {
                t.counter(
                    &CONNECTIONS_CLOSED_TOTAL,
                    &[l[0], l[1], ("reason", r.label())],
                )
            }),
            refused: Refusal::ALL.map(|_| Counter::noop()),
            open: t.gauge(&CONNECTIONS_OPEN, &l),
        }
    }
}

impl AcceptObserver for ConnCounters {
    fn opened(&self) {
        self.opened.increment(1);
        self.open.increment(1.0);
    }
    fn closed(&self, reason: CloseReason) {
        self.closed[reason.index()].increment(1);
        self.open.decrement(1.0);
    }
    fn refused(&self, reason: Refusal) {
        self.refused[reason.index()].increment(1);
    }
}

/// Bytes on the wire, `rpcmesh_wire_bytes_total{role, side, direction="in"|"out"}`, and
/// the `read`/`write` calls that moved them, `rpcmesh_wire_syscalls_total{...}` (calls per
/// syscall is how well frames are batched).
#[derive(Clone, Debug)]
pub struct WireCounters {
    read: Counter,
    written: Counter,
    reads: Counter,
    writes: Counter,
}

impl WireCounters {
    /// Registers the counters.
    pub fn new(t: &Telemetry, role: Role, side: &'static str) -> Self {
        let l = |d| [("role", role.label()), ("side", side), ("direction", d)];
        WireCounters {
            read: t.counter(&WIRE_BYTES_TOTAL, &l("in")),
            written: t.counter(&WIRE_BYTES_TOTAL, &l("out")),
            reads: t.counter(&WIRE_SYSCALLS_TOTAL, &l("in")),
            writes: t.counter(&WIRE_SYSCALLS_TOTAL, &l("out")),
        }
    }

    /// Adds a connection's counts since the last call.
    pub fn add(&self, c: IoCounts) {
        if c.bytes_read > 0 {
            self.read.increment(c.bytes_read);
        }
        if c.bytes_written > 0 {
            self.written.increment(c.bytes_written);
        }
        if c.reads > 0 {
            self.reads.increment(c.reads);
        }
        if c.writes > 0 {
            self.writes.increment(c.writes);
        }
    }
}

/// Payload bytes before and after compression:
/// `rpcmesh_payload_bytes_total{role, direction, form="plain"|"wire"}`. The compression
/// ratio is `wire / plain`.
#[derive(Clone, Debug)]
pub struct PayloadCounters {
    in_plain: Counter,
    in_wire: Counter,
    out_plain: Counter,
    out_wire: Counter,
}

impl PayloadCounters {
    /// Registers the counters.
    pub fn new(t: &Telemetry, role: Role) -> Self {
        let c = |d, f| {
            t.counter(
                &PAYLOAD_BYTES_TOTAL,
                &[("role", role.label()), ("direction", d), ("form", f)],
            )
        };
        PayloadCounters {
            in_plain: c("in", "plain"),
            in_wire: c("in", "wire"),
            out_plain: c("out", "plain"),
            out_wire: c("out", "wire"),
        }
    }

    /// Counts a payload received.
    pub fn received(&self, s: PayloadSize) {
        self.in_plain.increment(s.plain as u64);
        self.in_wire.increment(s.wire as u64);
    }

    /// Counts a payload sent.
    pub fn sent(&self, s: PayloadSize) {
        self.out_plain.increment(s.plain as u64);
        self.out_wire.increment(s.wire as u64);
    }
}

/// `rpcmesh_calls_total{role, service, method, status}` of one method, one handle per
/// status, and (provider and broker) its `rpcmesh_call_seconds` histogram.
#[derive(Clone)]
pub struct CallCounters(Vec<Counter>, Option<Histogram>);

impl std::fmt::Debug for CallCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallCounters")
    }
}

impl CallCounters {
    /// Label used for service and method names that are not configured, so that callers
    /// cannot create label values at will.
    pub const OTHER: &'static str = "_other";

    /// Registers the counters of `service.method`.
    pub fn new(t: &Telemetry, role: Role, service: &str, method: &str) -> Self {
        let labels = [
            ("role", role.label()),
            ("service", service),
            ("method", method),
        ];
        let duration = (role != Role::Driver).then(|| t.histogram(&CALL_SECONDS, &labels));
        CallCounters(
            Status::ALL
                .iter()
                .map(|s| {
                    t.counter(
                        &CALLS_TOTAL,
                        &[
                            ("role", role.label()),
                            ("service", service),
                            ("method", method),
                            ("status", s.label()),
                        ],
                    )
                })
                .collect(),
            duration,
        )
    }

    /// Counts one finished call.
    pub fn inc(&self, status: Status) {
        self.add(status, 1);
    }

    /// Counts `n` finished calls of one status (a session's round of them at once).
    pub fn add(&self, status: Status, n: u64) {
        self.0[status as usize].increment(n);
    }

    /// Records the time one (timed) call of this method took here.
    pub fn time(&self, from: std::time::Instant, to: std::time::Instant) {
        if let Some(h) = &self.1 {
            h.record(to.saturating_duration_since(from).as_secs_f64());
        }
    }
}

/// Histograms of the time spent compressing and inflating payloads
/// (`rpcmesh_compression_seconds{role, op}`): their `_sum` is the CPU time compression
/// costs. A call codec is told of every compression through [`CompressionObserver`].
#[derive(Debug, Clone)]
pub struct CompressionTimers {
    compress: Histogram,
    inflate: Histogram,
}

impl CompressionTimers {
    /// Registers the two histograms for `role`.
    pub fn new(t: &Telemetry, role: Role) -> std::sync::Arc<Self> {
        let h = |op| t.histogram(&COMPRESSION_SECONDS, &[("role", role.label()), ("op", op)]);
        std::sync::Arc::new(CompressionTimers {
            compress: h("compress"),
            inflate: h("inflate"),
        })
    }
}

impl CompressionObserver for CompressionTimers {
    fn compressed(&self, took: std::time::Duration) {
        self.compress.record(took.as_secs_f64());
    }
    fn inflated(&self, took: std::time::Duration) {
        self.inflate.record(took.as_secs_f64());
    }
}

/// Publishes `budget` as `rpcmesh_buffered_bytes`, `rpcmesh_paused_connections` and
/// `rpcmesh_memory_budget_bytes` of `role`, read at every scrape.
pub fn publish_budget(
    t: &Telemetry,
    role: Role,
    budget: &std::sync::Arc<crate::net::budget::MemoryBudget>,
) {
    let l = [("role", role.label())];
    let used = t.gauge(&BUFFERED_BYTES, &l);
    let paused = t.gauge(&PAUSED_CONNECTIONS, &l);
    t.gauge(&MEMORY_BUDGET_BYTES, &l).set(budget.limit() as f64);
    let b = budget.clone();
    t.on_scrape(std::sync::Arc::new(move || {
        used.set(b.used() as f64);
        paused.set(b.paused_holders() as f64);
    }));
}

/// `rpcmesh_build_info` at 1 with this build's version and commit ([`crate::build`]), so
/// that a scrape says which build the process runs (a deployment compares it with the
/// build it installed).
pub fn publish_build_info(t: &Telemetry, role: Role) {
    t.gauge(
        &BUILD_INFO,
        &[
            ("role", role.label()),
            ("version", crate::build::VERSION),
            ("commit", crate::build::COMMIT),
        ],
    )
    .set(1.0);
}

/// Which limit a call shed at once met: the `cap` label of `rpcmesh_shed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShedCap {
    /// Calls in flight on the caller's connection.
    PerConnection,
    /// Calls in flight in the whole broker.
    Total,
    /// The memory budget is past its high mark.
    Memory,
    /// Every connection to the service's providers is at its cap.
    UpstreamFull,
}

impl ShedCap {
    /// Every cap, in label order.
    pub const ALL: [ShedCap; 4] = [
        ShedCap::PerConnection,
        ShedCap::Total,
        ShedCap::Memory,
        ShedCap::UpstreamFull,
    ];

    /// The `cap` label.
    pub fn label(self) -> &'static str {
        match self {
            ShedCap::PerConnection => "per_connection",
            ShedCap::Total => "total",
            ShedCap::Memory => "memory",
            ShedCap::UpstreamFull => "upstream_full",
        }
    }
}

/// `rpcmesh_shed_total{role, cap}`, one handle per cap.
#[derive(Clone, Debug)]
pub struct ShedCounters([Counter; ShedCap::ALL.len()]);

impl ShedCounters {
    /// The counters of a program of `role`.
    pub fn new(t: &Telemetry, role: Role) -> Self {
        ShedCounters(
            ShedCap::ALL
                .map(|c| t.counter(&SHED_TOTAL, &[("role", role.label()), ("cap", c.label())])),
        )
    }

    /// Counts one call shed at `cap`.
    pub fn inc(&self, cap: ShedCap) {
        self.0[cap as usize].increment(1);
    }
}
