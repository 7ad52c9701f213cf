//! The driver's metric handles, registered once per run on its own recorder, so that a
//! Prometheus server can watch a long run live (the report is the driver's own account).
//! Registered from the catalogue's families (`rpcmesh_common::metrics::catalogue`, where
//! names and meanings are written down; `docs/metrics.md` lists them).

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram};
use rpcmesh_common::metrics::catalogue::{
    CALLS_IN_FLIGHT, CALLS_REROUTED_TOTAL, CALLS_SENT_TOTAL, CALLS_TOTAL,
    DRIVER_ACHIEVED_CALLS_PER_SECOND, DRIVER_LATENCY_SECONDS, DRIVER_OFFERED_CALLS_PER_SECOND,
    DRIVER_USERS, REQUESTS_TOTAL, RETRY_BUDGET_EXHAUSTED_TOTAL,
};
use rpcmesh_common::metrics::families::{
    CompressionTimers, ConnCounters, PayloadCounters, Stages, WireCounters,
};
use rpcmesh_common::metrics::{ErrorCounters, Role, Telemetry};
use rpcmesh_common::retry::RetryReason;
use rpcmesh_wire::envelope::PayloadSize;

use crate::outcome::CallOutcome;
use crate::stats::Tally;

/// The `role` of every driver metric.
pub const ROLE: Role = Role::Driver;

/// Stage: encoding a call into the write buffer (compression included).
pub const ENCODE: usize = 0;
/// Stage: "waiting for a connection": from the encoded call to the write that sent it.
pub const CONNECTION_WAIT: usize = 1;
/// Stage: from that write to the read that brought the reply.
pub const ROUND_TRIP: usize = 2;
/// Stage: decoding and checking the reply (inflation included).
pub const DECODE: usize = 3;
/// Stage: the whole call, from the start of its encoding to its decoded reply.
pub const CALL: usize = 4;
/// Stage: the whole user request (its `fanout` calls).
pub const REQUEST: usize = 5;
/// Names of the stages, by index.
pub const STAGES: [&str; 6] = [
    "encode",
    "connection_wait",
    "round_trip",
    "decode",
    "call",
    "request",
];

/// Handles the workers update.
#[derive(Debug, Clone)]
pub struct DriverMetrics {
    /// The recorder they live in.
    pub telemetry: Telemetry,
    /// `rpcmesh_calls_total` by outcome, indexed by [`CallOutcome::index`].
    calls: Vec<Counter>,
    /// Calls written (offered load).
    sent: Counter,
    /// `rpcmesh_calls_rerouted_total` by reason, indexed by [`RetryReason`].
    retries: [Counter; RetryReason::COUNT],
    /// `rpcmesh_retry_budget_exhausted_total` by reason, indexed by [`RetryReason`].
    retries_refused: [Counter; RetryReason::COUNT],
    /// Requests finished with every call successful.
    requests_ok: Counter,
    /// Requests finished with a failed call.
    requests_failed: Counter,
    /// Open loop: requests never sent (backlog full).
    requests_not_sent: Counter,
    /// `rpcmesh_driver_latency_seconds`, in the order of `Tally::latencies`.
    latency: [Histogram; 4],
    /// Calls written and not yet answered.
    pub in_flight: Gauge,
    /// Connections to the targets.
    pub conns: Arc<ConnCounters>,
    /// Bytes on the wire.
    pub wire: WireCounters,
    /// Payload bytes before and after compression.
    pub payload: PayloadCounters,
    /// Errors by kind and side: the server's (what came back, or did not) or the driver's
    /// own (`client`).
    pub errors: ErrorCounters,
    /// Per-stage latency.
    pub stages: Stages,
    /// Time spent compressing and inflating.
    pub compression: Arc<CompressionTimers>,
    /// Calls sent per second over the last second (what the driver offered).
    pub offered_rate: Gauge,
    /// Calls answered successfully per second over the last second.
    pub achieved_rate: Gauge,
    /// Users (closed-loop callers) of the run.
    pub users: Gauge,
}

impl DriverMetrics {
    /// Registers every handle for the workload's `service.method`.
    pub fn new(telemetry: Telemetry, service: &str, method: &str, stage_sample: u32) -> Self {
        let t = &telemetry;
        let role = [("role", ROLE.label())];
        let calls = CallOutcome::ALL
            .iter()
            .map(|o| {
                t.counter(
                    &CALLS_TOTAL,
                    &[
                        ("role", ROLE.label()),
                        ("service", service),
                        ("method", method),
                        ("status", o.label()),
                    ],
                )
            })
            .collect();
        let requests = |status| {
            t.counter(
                &REQUESTS_TOTAL,
                &[("role", ROLE.label()), ("status", status)],
            )
        };
        DriverMetrics {
            calls,
            sent: t.counter(&CALLS_SENT_TOTAL, &role),
            retries: RetryReason::ALL.map(|r| {
                t.counter(
                    &CALLS_REROUTED_TOTAL,
                    &[("role", ROLE.label()), ("reason", r.label())],
                )
            }),
            retries_refused: RetryReason::ALL.map(|r| {
                t.counter(
                    &RETRY_BUDGET_EXHAUSTED_TOTAL,
                    &[("role", ROLE.label()), ("reason", r.label())],
                )
            }),
            requests_ok: requests("ok"),
            requests_failed: requests("failed"),
            requests_not_sent: requests("not_sent"),
            // In the order of `Tally::latencies`.
            latency: [
                ("request", "intended"),
                ("call", "intended"),
                ("request", "sent"),
                ("call", "sent"),
            ]
            .map(|(of, from)| {
                t.histogram(
                    &DRIVER_LATENCY_SECONDS,
                    &[("role", ROLE.label()), ("of", of), ("from", from)],
                )
            }),
            in_flight: t.gauge(&CALLS_IN_FLIGHT, &role),
            conns: Arc::new(ConnCounters::outbound(t, ROLE, "outbound")),
            wire: WireCounters::new(t, ROLE, "outbound"),
            payload: PayloadCounters::new(t, ROLE),
            errors: ErrorCounters::new(t, ROLE),
            stages: Stages::new(t, ROLE, &STAGES, stage_sample),
            compression: CompressionTimers::new(t, ROLE),
            offered_rate: t.gauge(&DRIVER_OFFERED_CALLS_PER_SECOND, &role),
            achieved_rate: t.gauge(&DRIVER_ACHIEVED_CALLS_PER_SECOND, &role),
            users: t.gauge(&DRIVER_USERS, &role),
            telemetry,
        }
    }

    /// Adds a worker's figures since its last tick to the shared counters: one atomic
    /// add per counter per tick instead of several per call.
    pub fn add(&self, t: &Tally) {
        self.sent.increment(t.sent);
        for (c, &n) in self.retries.iter().zip(&t.retries) {
            c.increment(n);
        }
        for (c, &n) in self.retries_refused.iter().zip(&t.retries_refused) {
            c.increment(n);
        }
        for (o, &n) in CallOutcome::ALL.iter().zip(&t.outcomes) {
            if n == 0 {
                continue;
            }
            self.calls[o.index()].increment(n);
            if let Some((kind, side)) = o.error() {
                self.errors.add(kind, side, n);
            }
        }
        self.requests_ok.increment(t.requests_ok);
        self.requests_failed.increment(t.requests_failed);
        self.requests_not_sent.increment(t.requests_not_sent);
        for (h, l) in self.latency.iter().zip(t.latencies()) {
            // Each distinct value once, with its count (the recorder still takes each
            // sample: it has no weighted record).
            l.each(|us, n| h.record_many(us as f64 / 1e6, n as usize));
        }
        self.payload.sent(PayloadSize {
            plain: t.payload_out_plain as usize,
            wire: t.payload_out_wire as usize,
        });
        self.payload.received(PayloadSize {
            plain: t.payload_in_plain as usize,
            wire: t.payload_in_wire as usize,
        });
    }
}
