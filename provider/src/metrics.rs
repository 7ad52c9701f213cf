//! The provider's metric handles, registered once per instance on its own recorder.
//! Names and meanings are listed in `docs/metrics.md`.

use std::sync::Arc;

use metrics::Gauge;
use rpcmesh_common::telemetry::{
    CallCounters, ConnCounters, ErrorCounters, PayloadCounters, Telemetry, WireCounters,
};

use crate::service::{MethodId, Registry};

/// Value of the `role` label on every provider metric.
pub const ROLE: &str = "provider";

/// Handles the sessions update.
#[derive(Debug, Clone)]
pub struct ProviderMetrics {
    /// The recorder they live in.
    pub telemetry: Telemetry,
    calls: Vec<CallCounters>,
    calls_other: CallCounters,
    /// Errors by kind.
    pub errors: ErrorCounters,
    /// Calls decoded and not yet answered.
    pub in_flight: Gauge,
    /// Inbound connections.
    pub conns: Arc<ConnCounters>,
    /// Bytes on the wire.
    pub wire: WireCounters,
    /// Payload bytes before and after compression.
    pub payload: PayloadCounters,
}

impl ProviderMetrics {
    /// Registers every handle for the methods in `registry`.
    pub fn new(telemetry: Telemetry, registry: &Registry) -> Self {
        let t = &telemetry;
        ProviderMetrics {
            calls: registry
                .methods()
                .iter()
                .map(|(s, m)| CallCounters::new(t, ROLE, s, m))
                .collect(),
            calls_other: CallCounters::new(t, ROLE, CallCounters::OTHER, CallCounters::OTHER),
            errors: ErrorCounters::new(t, ROLE),
            in_flight: t.gauge("rpcmesh_calls_in_flight", &[("role", ROLE)]),
            conns: Arc::new(ConnCounters::new(t, ROLE, "inbound")),
            wire: WireCounters::new(t, ROLE, "inbound"),
            payload: PayloadCounters::new(t, ROLE),
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
