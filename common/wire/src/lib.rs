//! rpcmesh's wire layer: RPCF v1 as rpcmesh speaks it, with its extensions (compression,
//! extended statuses). Pure: byte slices in, typed values out, typed values appended to a
//! `BytesMut`. It depends on no runtime, no socket and no metrics (its `Cargo.toml` is the
//! rule), so every part of it is tested on made-up bytes.
//!
//! Modules, bottom up (each uses only those above it in this list):
//!
//! - [`frame`]: bytes ↔ frame. The 18-byte header, the CRC32 trailer, the extension flags,
//!   and [`frame::FrameWriter`], which writes a frame in place.
//! - [`neutral`]: request ids a forwarder writes over a frame's id without recomputing
//!   its CRC.
//! - [`body`]: the request, response and heartbeat bodies inside a frame.
//! - [`ext`]: the call extension a broker adds to calls it forwards (the caller's
//!   identity, fields to come), in a frame type of its own.
//! - [`codec`]: byte stream → frames, with the size limit and the bad-input rules.
//! - [`compress`]: zlib of payloads, threshold, bounded inflation.
//! - [`peer`]: the kind of peer (rpcmesh or plain v1), which decides what may be sent to it.
//! - [`status`]: call outcomes on the wire, and how extended ones degrade for v1 callers.
//! - [`proto`]: the generated protobuf messages.
//! - [`envelope`]: frame ↔ call. The `rpc.RpcRequest` / `rpc.RpcResponse` envelopes and the
//!   compression decision.
//!
//! Sockets, sessions and the accept loop are `rpcmesh_common::net`; metrics are
//! `rpcmesh_common::metrics`.

pub mod body;
pub mod codec;
pub mod compress;
pub mod envelope;
pub mod ext;
pub mod frame;
pub mod neutral;
pub mod peer;
pub mod proto;
pub mod status;

pub use frame::{Flags, Frame, FrameError, Header, MsgType};
pub use peer::PeerKind;
pub use status::Status;
