//! The metrics layer: what rpcmesh measures about itself, and how it is exported.
//!
//! - [`catalogue`]: every metric family, written down once (name, type, labels, programs,
//!   help). Handles are registered through it only.
//! - [`recorder`]: the per-instance Prometheus recorder ([`Telemetry`]), its buckets and
//!   rendering; [`buckets`]: its histograms, fixed buckets of atomics (no allocation per
//!   sample).
//! - [`exposition`]: reading the text it renders: a series' value by exact name and labels.
//! - [`endpoint`]: the bounded `/metrics` HTTP endpoint, refreshing `/proc` figures at
//!   each scrape.
//! - [`families`]: the handle groups every program registers alike (stages, connections,
//!   wire bytes, payload bytes, calls, compression time).
//! - [`security`]: TLS handshakes and certificates' expiry, calls the policy denied,
//!   files read again.
//! - [`errors`]: the error taxonomy (kind and side) and where bad input is counted.
//! - [`system`]: softirqs, CPU time and the process's own figures, read from `/proc`.
//!
//! Above the wire and net layers (it counts their events: `WireCounters` takes a
//! connection's byte counts, `ConnCounters` observes the accept loop); below the command
//! line. Nothing in `net` or in `rpcmesh-wire` uses it.

pub mod buckets;
pub mod catalogue;
pub mod endpoint;
pub mod errors;
pub mod exposition;
pub mod families;
pub mod recorder;
pub mod security;
pub mod system;

pub use catalogue::{Family, Role};
pub use errors::{BadInputLog, ErrorCounters, ErrorKind, Side};
pub use recorder::Telemetry;
