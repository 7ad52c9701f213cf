//! The error taxonomy and where bad input is counted: every kind of error rpcmesh counts
//! ([`ErrorKind`], the `kind` label of `rpcmesh_errors_total`), the side it came from
//! ([`Side`], the `side` label), their handles ([`ErrorCounters`]), and the per-connection
//! record of bad input that counts each event and thins its log lines ([`BadInputLog`]).
//!
//! Owns the labels and how a wire-layer error maps to them. Deciding what went wrong is
//! the caller's: each program's session or connection builds the error and counts it here.

use metrics::Counter;
use rpcmesh_wire::envelope::CallError;
use rpcmesh_wire::frame::{Flags, FrameError};

use crate::metrics::Telemetry;
use crate::metrics::catalogue::{ERRORS_TOTAL, Role};
use crate::net::thinned::Thinned;

/// Every kind of error rpcmesh counts, the `kind` label of `rpcmesh_errors_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Bytes that are not an RPCF stream (junk skipped, or connection closed).
    BadMagic,
    /// A protocol version other than 1.
    BadVersion,
    /// `body_len` over the limit, or a request's metadata over its limit.
    TooLarge,
    /// CRC trailer mismatch.
    Crc,
    /// Unknown message type or reserved bits.
    UnknownType,
    /// Connection closed in the middle of a frame.
    Truncated,
    /// Body lengths that do not add up, or names that are not UTF-8.
    BadBody,
    /// A payload flagged compressed that does not inflate, or inflates past the limit.
    Inflate,
    /// A payload that is not the expected protobuf message.
    Decode,
    /// A call to a service nobody serves.
    UnknownService,
    /// A call to a method the service does not have.
    UnknownMethod,
    /// No reply within the deadline.
    Timeout,
    /// A call dropped unstarted because its caller's deadline had passed: not forwarded
    /// (broker) or not run (provider); counted by the program that dropped it, from the
    /// side `client` (the deadline is the caller's).
    DeadlineExceeded,
    /// A reply that came after its call had timed out (dropped).
    LateReply,
    /// No healthy provider / connection lost with the call on it.
    Unavailable,
    /// Shed by a limit on calls in flight.
    Overloaded,
    /// A call answered "failed": a handler error (provider), or, as the driver sees it,
    /// any reply with that status.
    Failed,
    /// A call answered "bad request", as the driver sees it (the server found the request
    /// malformed).
    BadRequest,
    /// A call the authorization policy denied.
    PermissionDenied,
    /// A frame of a type that makes no sense in that direction (dropped).
    Unexpected,
    /// A socket error.
    Io,
}

impl ErrorKind {
    /// Every kind, in label order.
    pub const ALL: [ErrorKind; 21] = [
        ErrorKind::BadMagic,
        ErrorKind::BadVersion,
        ErrorKind::TooLarge,
        ErrorKind::Crc,
        ErrorKind::UnknownType,
        ErrorKind::Truncated,
        ErrorKind::BadBody,
        ErrorKind::Inflate,
        ErrorKind::Decode,
        ErrorKind::UnknownService,
        ErrorKind::UnknownMethod,
        ErrorKind::Timeout,
        ErrorKind::DeadlineExceeded,
        ErrorKind::LateReply,
        ErrorKind::Unavailable,
        ErrorKind::Overloaded,
        ErrorKind::Failed,
        ErrorKind::BadRequest,
        ErrorKind::PermissionDenied,
        ErrorKind::Unexpected,
        ErrorKind::Io,
    ];

    /// The `kind` label.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::BadMagic => "bad_magic",
            ErrorKind::BadVersion => "bad_version",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::Crc => "crc",
            ErrorKind::UnknownType => "unknown_type",
            ErrorKind::Truncated => "truncated",
            ErrorKind::BadBody => "bad_body",
            ErrorKind::Inflate => "inflate",
            ErrorKind::Decode => "decode",
            ErrorKind::UnknownService => "unknown_service",
            ErrorKind::UnknownMethod => "unknown_method",
            ErrorKind::Timeout => "timeout",
            ErrorKind::DeadlineExceeded => "deadline_exceeded",
            ErrorKind::LateReply => "late_reply",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::Failed => "failed",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::Unexpected => "unexpected",
            ErrorKind::Io => "io",
        }
    }

    /// The kind of a wire-layer error.
    pub fn of_frame(e: &FrameError) -> ErrorKind {
        use FrameError as F;
        match e {
            F::BadMagic { .. } | F::Resynced { .. } => ErrorKind::BadMagic,
            F::BadVersion { .. } => ErrorKind::BadVersion,
            F::TooLarge { .. } => ErrorKind::TooLarge,
            F::Crc { .. } => ErrorKind::Crc,
            F::UnknownType { .. } => ErrorKind::UnknownType,
            F::Truncated { .. } => ErrorKind::Truncated,
            F::BadBody { .. } | F::Unencodable { .. } => ErrorKind::BadBody,
        }
    }

    /// The kind of a call-layer error.
    pub fn of_call(e: &CallError) -> ErrorKind {
        use CallError as C;
        match e {
            C::Frame(f) => ErrorKind::of_frame(f),
            C::Inflate(_) => ErrorKind::Inflate,
            C::Decode(_) | C::UnknownStatus(_) => ErrorKind::Decode,
            C::MetadataTooLarge { .. } => ErrorKind::TooLarge,
            C::WrongType { .. } => ErrorKind::Unexpected,
        }
    }
}

/// Where an error came from, the `side` label of `rpcmesh_errors_total`: the part of the
/// mesh at fault, as the program that counts it can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The caller: bytes that are not a frame, a malformed request, a service or method
    /// nobody serves. The caller must fix its request; retrying it unchanged fails again.
    Client,
    /// The broker itself: one of its limits, its drain, no connection of its own free.
    Broker,
    /// The provider, or the way to it: no reply in time, a connection lost, a reply that
    /// cannot be used, a handler that failed, the provider's own limits.
    Provider,
    /// For the driver: the server it called (a broker or a provider; the driver cannot
    /// tell which of them made a reply).
    Server,
}

impl Side {
    /// Every side, in label order.
    pub const ALL: [Side; 4] = [Side::Client, Side::Broker, Side::Provider, Side::Server];

    /// The `side` label.
    pub fn label(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Broker => "broker",
            Side::Provider => "provider",
            Side::Server => "server",
        }
    }

    /// The sides a program of `role` can tell apart (its series are registered up front).
    pub fn seen_by(role: Role) -> &'static [Side] {
        match role {
            Role::Provider => &[Side::Client, Side::Provider],
            Role::Broker => &[Side::Client, Side::Broker, Side::Provider],
            Role::Driver => &[Side::Client, Side::Server],
        }
    }
}

/// `rpcmesh_errors_total{role, kind, side}`, one handle per kind and side the role can
/// see, registered up front (so every series exists from the start, at zero). Shared, not
/// copied, by the connections that count into it (a clone is one reference count).
#[derive(Clone)]
pub struct ErrorCounters(std::sync::Arc<[Counter]>);

impl std::fmt::Debug for ErrorCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ErrorCounters")
    }
}

impl ErrorCounters {
    /// Registers the counters of `role`.
    pub fn new(t: &Telemetry, role: Role) -> Self {
        let seen = Side::seen_by(role);
        let mut counters = Vec::with_capacity(ErrorKind::ALL.len() * Side::ALL.len());
        for kind in ErrorKind::ALL {
            for side in Side::ALL {
                counters.push(if seen.contains(&side) {
                    t.counter(
                        &ERRORS_TOTAL,
                        &[
                            ("role", role.label()),
                            ("kind", kind.label()),
                            ("side", side.label()),
                        ],
                    )
                } else {
                    Counter::noop()
                });
            }
        }
        ErrorCounters(counters.into())
    }

    /// Counts one error of `kind` that came from `side`.
    pub fn inc(&self, kind: ErrorKind, side: Side) {
        self.add(kind, side, 1);
    }

    /// Counts `n` errors of `kind` that came from `side`.
    pub fn add(&self, kind: ErrorKind, side: Side, n: u64) {
        self.0[kind as usize * Side::ALL.len() + side as usize].increment(n);
    }
}

/// The process's budget of bad-input log lines.
static BAD_INPUT_LINES: Thinned = Thinned::new();

/// Bad input seen on one connection, from one side: each event is counted and logged
/// (thinned for the whole process, see [`Thinned`], so peers cannot flood the log however
/// many connections they open), and the request an error reply is due to is returned.
pub struct BadInputLog {
    errors: ErrorCounters,
    side: Side,
    seen: u64,
}

impl std::fmt::Debug for BadInputLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BadInputLog")
            .field("side", &self.side)
            .field("seen", &self.seen)
            .finish()
    }
}

impl BadInputLog {
    /// The record of one connection's bad input from `side` (the caller, or the provider a
    /// broker reads from), counted in `errors`.
    pub fn new(errors: ErrorCounters, side: Side) -> Self {
        BadInputLog {
            errors,
            side,
            seen: 0,
        }
    }

    /// Counts and logs `e`; returns the id and flags of the request to answer with an
    /// error, when there is one.
    pub fn record(&mut self, e: &FrameError) -> Option<(u64, Flags)> {
        self.errors.inc(ErrorKind::of_frame(e), self.side);
        self.seen += 1;
        let n = self.seen;
        if let Some(a) = BAD_INPUT_LINES.admit() {
            tracing::warn!(error = %e, fatal = e.is_fatal(), on_connection = n, in_process = a.seen, left_out = a.left_out, peer = self.side.label(), "bad input");
        }
        e.request_id().map(|id| (id, e.flags()))
    }

    /// Counts a frame of a type the peer should not send (a response sent to a server).
    pub fn unexpected(&self) {
        self.errors.inc(ErrorKind::Unexpected, self.side);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::recorder::sample;
    use bytes::{Bytes, BytesMut};
    use rpcmesh_wire::body::Request;
    use rpcmesh_wire::envelope::CallCodec;
    use rpcmesh_wire::frame::Frame;

    fn request(flags: Flags, payload: &'static [u8]) -> BytesMut {
        let mut b = BytesMut::new();
        Request {
            service: Bytes::from_static(b"S"),
            method: Bytes::from_static(b"M"),
            payload: Bytes::from_static(payload),
        }
        .put(&mut b, flags, 42)
        .unwrap();
        b
    }

    #[test]
    fn a_crc_mismatch_counts_as_crc() {
        let mut b = request(Flags::NONE, b"x");
        let n = b.len();
        b[n - 1] ^= 0xff;
        let e = Frame::from_bytes(b.freeze()).unwrap_err();
        assert_eq!(ErrorKind::of_frame(&e), ErrorKind::Crc);
    }

    #[test]
    fn a_payload_that_does_not_inflate_counts_as_inflate() {
        let b = request(Flags::COMPRESSED, b"definitely not zlib");
        let f = Frame::from_bytes(b.freeze()).unwrap();
        let e = CallCodec::new(None, 1 << 20)
            .decode_request(&f)
            .unwrap_err();
        assert_eq!(ErrorKind::of_call(&e), ErrorKind::Inflate);
    }

    #[test]
    fn labels_are_distinct_and_in_order() {
        let labels: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.label()).collect();
        let mut sorted = labels.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(labels.len(), sorted.len());
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
        }
        for (i, s) in Side::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i, "{s:?}");
        }
    }

    #[test]
    fn each_role_registers_the_sides_it_can_tell_apart_and_counts_by_side() {
        let t = Telemetry::new();
        let e = ErrorCounters::new(&t, Role::Broker);
        e.inc(ErrorKind::Overloaded, Side::Broker);
        e.inc(ErrorKind::Overloaded, Side::Broker);
        e.inc(ErrorKind::Overloaded, Side::Provider);
        let text = t.render();
        let at = |side| {
            sample(
                &text,
                ERRORS_TOTAL.name,
                &[("kind", "overloaded"), ("side", side)],
            )
        };
        assert_eq!(at("broker"), Some(2.0));
        assert_eq!(at("provider"), Some(1.0));
        assert_eq!(at("client"), Some(0.0));
        assert_eq!(at("server"), None, "a broker has no server side");
        let series = text
            .lines()
            .filter(|l| l.starts_with("rpcmesh_errors_total{"))
            .count();
        assert_eq!(series, ErrorKind::ALL.len() * 3);
    }
}
