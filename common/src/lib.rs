//! rpcmesh's shared library: the RPCF v1 wire protocol with rpcmesh's extensions, and the
//! plumbing the provider, broker and driver share.
//!
//! Layers, bottom up (each uses only the one below it):
//!
//! - [`frame`]: bytes ↔ frame. Header, bodies, CRC, extension flags. Pure.
//! - [`codec`]: byte stream → frames, with the size limit and the bad-input rules. Pure.
//! - [`compress`]: zlib of payloads, threshold, bounded inflation. Pure.
//! - [`call`]: frame ↔ call. The `rpc.RpcRequest` / `rpc.RpcResponse` envelopes, statuses
//!   ([`status`]) and the compression decision.
//! - [`io`]: one TCP connection carrying frames, with batched writes.
//! - [`client`]: a small multiplexed client for tests and tools.
//! - [`listener`]: the accept loop, with its connection cap and drain on shutdown.
//!
//! Beside them: [`proto`], the generated protobuf types; [`shutdown`], the signal handling;
//! [`runtime`], what every `main` sets up (logging, the Tokio runtime, duration parsing);
//! [`telemetry`], the per-instance Prometheus recorder and the shared metric handles;
//! [`sysmetrics`], the softirq, CPU-time and process metrics read from /proc; and
//! [`catalogue`], the name and meaning of every metric.

pub mod busy_poll;
pub mod call;
pub mod catalogue;
pub mod client;
pub mod codec;
pub mod compress;
pub mod frame;
pub mod io;
pub mod listener;
pub mod proto;
pub mod runtime;
pub mod shutdown;
pub mod status;
pub mod sysmetrics;
pub mod telemetry;
#[cfg(feature = "test-support")]
pub mod testkit;

pub use frame::{Flags, Frame, FrameError, Header, MsgType};
pub use status::Status;
