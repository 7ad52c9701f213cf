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

    /// An empty batch of this run's per-call counts.
    pub fn batch(&self) -> CountBatch {
        CountBatch {
            calls: vec![0; self.calls.len()],
            ..CountBatch::default()
        }
    }

    /// Adds `batch` to the shared counters and empties it.
    pub fn flush(&self, batch: &mut CountBatch) {
        let b = std::mem::replace(batch, self.batch());
        for ((_, c), n) in self.calls.iter().zip(b.calls) {
            if n > 0 {
                c.increment(n);
            }
        }
        self.sent.increment(b.sent);
        self.requests_ok.increment(b.requests_ok);
        self.requests_failed.increment(b.requests_failed);
        self.payload.sent(b.payload_out);
        self.payload.received(b.payload_in);
    }
}

/// Per-call counts a worker adds up between flushes (every progress tick and when it
/// stops), so that the counters shared by all workers take one atomic add per tick
/// instead of several per call.
#[derive(Debug, Default)]
pub struct CountBatch {
    /// Finished calls, by outcome, in the order of [`DriverMetrics`]'s call counters.
    calls: Vec<u64>,
    sent: u64,
    requests_ok: u64,
    requests_failed: u64,
    payload_out: PayloadSize,
    payload_in: PayloadSize,
}

impl CountBatch {
    /// One call finished with `outcome` (`ok`, a status, or a driver-side failure).
    pub fn call_done(&mut self, metrics: &DriverMetrics, outcome: &str) {
        if let Some(i) = metrics.calls.iter().position(|(l, _)| *l == outcome) {
            self.calls[i] += 1;
        }
    }

    /// One call written, its payload `size`.
    pub fn sent(&mut self, size: PayloadSize) {
        self.sent += 1;
        self.payload_out.plain += size.plain;
        self.payload_out.wire += size.wire;
    }

    /// A reply's payload received.
    pub fn received(&mut self, size: PayloadSize) {
        self.payload_in.plain += size.plain;
        self.payload_in.wire += size.wire;
    }

    /// One request finished.
    pub fn request_done(&mut self, failed: bool) {
        if failed {
            self.requests_failed += 1;
        } else {
            self.requests_ok += 1;
        }
    }
}
