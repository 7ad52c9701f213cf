//! The provider's metric handles, registered once per instance on its own recorder, from
//! the catalogue's families (`rpcmesh_common::metrics::catalogue`, where names and meanings
//! are written down; `docs/metrics.md` lists them).

use std::sync::Arc;

use metrics::Gauge;
use rpcmesh_common::metrics::catalogue::CALLS_IN_FLIGHT;
use rpcmesh_common::metrics::families::{
    CallCounters, CompressionTimers, ConnCounters, PayloadCounters, ShedCounters, Stages,
    WireCounters,
};
use rpcmesh_common::metrics::{ErrorCounters, Role, Telemetry};

use crate::service::{MethodId, Registry};

/// The `role` of every provider metric.
pub const ROLE: Role = Role::Provider;

/// Stage: from the read that brought a request to the start of its decoding (waiting
/// behind the other requests of the same read).
pub const QUEUE: usize = 0;
/// Stage: decoding the call (inflation and the envelope).
pub const DECODE: usize = 1;
/// Stage: the handler, from the decoded call to its answer (service time included).
pub const HANDLER: usize = 2;
/// Stage: encoding the reply into the write buffer (compression included).
pub const ENCODE: usize = 3;
/// Stage: from the read that brought the request to the write that took its reply.
pub const TOTAL: usize = 4;
/// Names of the stages, by index.
pub const STAGES: [&str; 5] = ["queue", "decode", "handler", "encode", "total"];

/// Handles the sessions update.
#[derive(Debug, Clone)]
pub struct ProviderMetrics {
    /// The recorder they live in.
    pub telemetry: Telemetry,
    calls: Vec<CallCounters>,
    calls_other: CallCounters,
    /// Errors by kind and side: the caller's ([`Side::Client`]) or the provider's own
    /// ([`Side::Provider`]).
    ///
    /// [`Side::Client`]: rpcmesh_common::metrics::Side::Client
    /// [`Side::Provider`]: rpcmesh_common::metrics::Side::Provider
    pub errors: ErrorCounters,
    /// Calls decoded and not yet answered.
    pub in_flight: Gauge,
    /// Inbound connections.
    pub conns: Arc<ConnCounters>,
    /// Bytes on the wire.
    pub wire: WireCounters,
    /// Payload bytes before and after compression.
    pub payload: PayloadCounters,
    /// Per-stage latency.
    pub stages: Stages,
    /// Time spent compressing and inflating.
    pub compression: Arc<CompressionTimers>,
    /// Calls shed at once, by the cap they met.
    pub shed: ShedCounters,
}

impl ProviderMetrics {
    /// Registers every handle for the methods in `registry`; stages are timed on one call
    /// in `stage_sample` (0: never, and the histograms are no-ops).
    pub fn new(telemetry: Telemetry, registry: &Registry, stage_sample: u32) -> Self {
        let t = &telemetry;
        ProviderMetrics {
            calls: registry
                .methods()
                .iter()
                .map(|(s, m)| CallCounters::new(t, ROLE, s, m))
                .collect(),
            calls_other: CallCounters::new(t, ROLE, CallCounters::OTHER, CallCounters::OTHER),
            errors: ErrorCounters::new(t, ROLE),
            in_flight: t.gauge(&CALLS_IN_FLIGHT, &[("role", ROLE.label())]),
            conns: Arc::new(ConnCounters::inbound(t, ROLE)),
            wire: WireCounters::new(t, ROLE, "inbound"),
            payload: PayloadCounters::new(t, ROLE),
            stages: Stages::new(t, ROLE, &STAGES, stage_sample),
            compression: CompressionTimers::new(t, ROLE),
            shed: ShedCounters::new(t, ROLE),
            telemetry,
        }
    }

    /// The call counters of a method (or of unknown names).
    pub fn calls(&self, method: Option<MethodId>) -> &CallCounters {
        method
            .and_then(|m| self.calls.get(m))
            .unwrap_or(&self.calls_other)
    }
}
