//! A call on its way through the broker: what a session hands to an upstream connection
//! ([`Forward`]) and what comes back to the session ([`Reply`]).
//!
//! The request travels as the frame the session read (its body a slice of the session's
//! read buffer); the upstream connection copies it once, into its write buffer, under its
//! own request id. The reply travels as the frame the upstream connection read; the
//! session copies it once, into its write buffer, under the caller's request id. The
//! upstream connection keeps the request frame until the reply (for a while at most), so
//! that a call a draining provider refused comes back whole ([`Reply::Retry`]).

use std::time::Instant;

use rpcmesh_common::net::budget::Reserved;
use rpcmesh_wire::frame::{Flags, Frame};
use tokio::sync::mpsc;

use crate::failure::Failure;

/// Where an upstream connection sends a call's outcome: the session that admitted it.
pub(crate) type ReplyTx = mpsc::UnboundedSender<Reply>;

/// What the session needs back to answer the caller.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallInfo {
    /// The caller's request id.
    pub client_id: u64,
    /// The caller's request flags (which statuses and encodings it takes).
    pub client_flags: Flags,
    /// The session's own tag for the call (its metric handles).
    pub tag: u32,
    /// When the session read the request.
    pub admitted: Instant,
    /// When the session handed it to routing (stages on only).
    pub routed: Option<Instant>,
    /// When its reply was read from the provider (stages on only).
    pub replied: Option<Instant>,
}

/// A call handed to an upstream connection.
#[derive(Debug)]
pub(crate) struct Forward {
    /// The caller's request frame, as read.
    pub frame: Frame,
    pub info: CallInfo,
    pub reply_to: ReplyTx,
    /// When the caller gets a timeout instead.
    pub deadline: Instant,
    /// Times this call was handed back (unsent, or refused by a draining provider) and
    /// routed again.
    pub retries: u8,
    /// A draining provider refused it (`NOT_RUN`) at least once: if no provider takes it
    /// now, the caller is told it was not run.
    pub refused_by_drain: bool,
    /// A large request's bytes, counted against the memory budget until its reply is in
    /// the caller's write buffer or the call fails (about as many bytes come back).
    pub reserved: Option<Reserved>,
}

/// A call's outcome, back at its session.
#[derive(Debug)]
pub(crate) enum Reply {
    /// Answered: by the provider (`Ok`, the provider's response frame) or by the broker.
    Done {
        info: CallInfo,
        outcome: Result<Frame, Failure>,
        /// The call's reservation, released once the reply is copied.
        reserved: Option<Reserved>,
    },
    /// Not run by any provider: safe to route again.
    Retry(Forward, Reroute),
}

/// Why a call came back to its session to be routed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reroute {
    /// Its connection closed before the call was written.
    Unsent,
    /// The provider is draining and refused it without running it (`NOT_RUN`).
    NotRun,
}

impl Reroute {
    /// Every reason, in the order of their metric handles.
    pub const ALL: [Reroute; 2] = [Reroute::Unsent, Reroute::NotRun];

    /// The `reason` label of `rpcmesh_calls_rerouted_total`.
    pub fn label(self) -> &'static str {
        match self {
            Reroute::Unsent => "unsent",
            Reroute::NotRun => "not_run",
        }
    }
}
