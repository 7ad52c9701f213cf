//! The driver's metric handles, registered once per run on its own recorder, so that a
//! Prometheus server can watch a long run live (the report is the driver's own account).
//! Names and meanings are listed in `docs/metrics.md`.

use std::sync::Arc;

use metrics::{Counter, Gauge};
use rpcmesh_common::Status;
use rpcmesh_common::call::{CompressionTimers, PayloadSize};
use rpcmesh_common::telemetry::{
    ConnCounters, ErrorCounters, PayloadCounters, Stages, Telemetry, WireCounters,
};

use crate::stats::Tally;

/// Value of the `role` label on every driver metric.
pub const ROLE: &str = "driver";

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

/// Outcome labels of `rpcmesh_calls_total{role="driver"}` beyond the statuses: failures
/// the driver sees itself.
pub const DRIVER_OUTCOMES: [&str; 4] = ["timeout", "connection", "bad_reply", "encode"];

/// Handles the workers update.
#[derive(Debug, Clone)]
pub struct DriverMetrics {
    /// The recorder they live in.
    pub telemetry: Telemetry,
    calls: Vec<(&'static str, Counter)>,
    /// Calls written (offered load).
    sent: Counter,
    /// Requests finished with every call successful.
    requests_ok: Counter,
    /// Requests finished with a failed call.
    requests_failed: Counter,
    /// Calls written and not yet answered.
    pub in_flight: Gauge,
    /// Connections to the targets.
    pub conns: Arc<ConnCounters>,
    /// Bytes on the wire.
    pub wire: WireCounters,
    /// Payload bytes before and after compression.
    pub payload: PayloadCounters,
    /// Errors by kind.
    pub errors: ErrorCounters,
    /// Per-stage latency.
    pub stages: Stages,
    /// Time spent compressing and inflating.
    pub compression: CompressionTimers,
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
        rpcmesh_common::catalogue::describe_all(t);
        let call = |status: &str| {
            t.counter(
                "rpcmesh_calls_total",
                &[
                    ("role", ROLE),
                    ("service", service),
                    ("method", method),
                    ("status", status),
                ],
            )
        };
        let mut calls: Vec<(&'static str, Counter)> = Status::ALL
            .iter()
            .map(|s| (s.label(), call(s.label())))
            .collect();
        for o in DRIVER_OUTCOMES {
            if !calls.iter().any(|(l, _)| *l == o) {
                calls.push((o, call(o)));
            }
        }
        let requests = |status| {
            t.counter(
                "rpcmesh_requests_total",
                &[("role", ROLE), ("status", status)],
            )
        };
        DriverMetrics {
            calls,
            sent: t.counter("rpcmesh_calls_sent_total", &[("role", ROLE)]),
            requests_ok: requests("ok"),
            requests_failed: requests("failed"),
            in_flight: t.gauge("rpcmesh_calls_in_flight", &[("role", ROLE)]),
            conns: Arc::new(ConnCounters::new(t, ROLE, "outbound")),
            wire: WireCounters::new(t, ROLE, "outbound"),
            payload: PayloadCounters::new(t, ROLE),
            errors: ErrorCounters::new(t, ROLE),
            stages: Stages::new(t, ROLE, &STAGES, stage_sample),
            compression: CompressionTimers::new(t, ROLE),
            offered_rate: t.gauge("rpcmesh_driver_offered_calls_per_second", &[("role", ROLE)]),
            achieved_rate: t.gauge(
                "rpcmesh_driver_achieved_calls_per_second",
                &[("role", ROLE)],
            ),
            users: t.gauge("rpcmesh_driver_users", &[("role", ROLE)]),
            telemetry,
        }
    }

    /// Adds a worker's figures since its last tick to the shared counters: one atomic
    /// add per counter per tick instead of several per call.
    pub fn add(&self, t: &Tally) {
        self.sent.increment(t.sent);
        let outcomes = std::iter::once(("ok", &t.ok)).chain(t.errors.iter().map(|(k, n)| (*k, n)));
        for (outcome, &n) in outcomes {
            if let Some((_, c)) = self.calls.iter().find(|(l, _)| *l == outcome) {
                c.increment(n);
            }
        }
        self.requests_ok.increment(t.requests_ok);
        self.requests_failed.increment(t.requests_failed);
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
