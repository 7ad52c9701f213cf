//! How a call ended, as the driver saw it ([`CallOutcome`]): a reply (a success, or an
//! error status the server sent, whichever of the broker and the provider made it), or one
//! of the driver's own findings (no reply in time, the connection lost, no connection to
//! send it on, a reply that is not the service's answer, a request that could not be
//! encoded). Every call sent has exactly one. A reply flagged `NOT_RUN` (a draining target
//! did not start the call) is not an outcome: the worker sends the call again elsewhere.
//!
//! How one of the worker's connections was lost ([`Loss`]): the cause the log gives, the
//! close reason the connection metrics count, and the outcome of the calls that were
//! written on it, each decided here once.
//!
//! Owns the outcome labels (the `status` of `rpcmesh_calls_total{role="driver"}`, the keys
//! of the report's error counts) and how each maps to an error kind and side.

use std::{fmt, io};

use rpcmesh_common::metrics::{ErrorKind, Side};
use rpcmesh_common::net::connection::CloseReason;
use rpcmesh_wire::Status;
use rpcmesh_wire::frame::FrameError;

/// How one call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallOutcome {
    /// Answered with success, and the reply is what the service answers.
    Ok,
    /// Answered by the server with this error status (never [`Status::Success`]): the
    /// broker's own answer (shed, no provider, its timeout) or a provider's.
    Replied(Status),
    /// No reply within the driver's own timeout (`--timeout`).
    NoReply,
    /// The connection was lost with the call written on it: it may have run.
    Connection,
    /// No connection to any target took the call within the driver's timeout (every target
    /// refused, or was draining), or its connection was lost before it was written and it
    /// was not sent again: it was never written, so it did not run.
    NoConnection,
    /// A successful reply that does not decode, or is not what the service answers.
    BadReply,
    /// The request could not be encoded (too large for a frame).
    Encode,
}

impl CallOutcome {
    /// How many outcomes there are: the size of a table indexed by [`CallOutcome::index`].
    pub const COUNT: usize = 12;

    /// Every outcome, in index order.
    pub const ALL: [CallOutcome; Self::COUNT] = [
        CallOutcome::Ok,
        CallOutcome::Replied(Status::Failed),
        CallOutcome::Replied(Status::Timeout),
        CallOutcome::Replied(Status::Unavailable),
        CallOutcome::Replied(Status::Overloaded),
        CallOutcome::Replied(Status::BadRequest),
        CallOutcome::NoReply,
        CallOutcome::Connection,
        CallOutcome::NoConnection,
        CallOutcome::BadReply,
        CallOutcome::Encode,
        CallOutcome::Replied(Status::PermissionDenied),
    ];

    /// The outcome of a reply with `status` whose content, when it is a success, checked
    /// out (`content_ok`).
    pub fn of_reply(status: Status, content_ok: bool) -> CallOutcome {
        match status {
            Status::Success if content_ok => CallOutcome::Ok,
            Status::Success => CallOutcome::BadReply,
            s => CallOutcome::Replied(s),
        }
    }

    /// True for a successful call.
    pub fn is_ok(self) -> bool {
        self == CallOutcome::Ok
    }

    /// Its position in [`CallOutcome::ALL`].
    pub fn index(self) -> usize {
        match self {
            CallOutcome::Ok => 0,
            // `Success` cannot be here (see `of_reply`); it would share `failed`'s place.
            CallOutcome::Replied(Status::Success | Status::Failed) => 1,
            CallOutcome::Replied(Status::Timeout) => 2,
            CallOutcome::Replied(Status::Unavailable) => 3,
            CallOutcome::Replied(Status::Overloaded) => 4,
            CallOutcome::Replied(Status::BadRequest) => 5,
            CallOutcome::NoReply => 6,
            CallOutcome::Connection => 7,
            CallOutcome::NoConnection => 8,
            CallOutcome::BadReply => 9,
            CallOutcome::Encode => 10,
            CallOutcome::Replied(Status::PermissionDenied) => 11,
        }
    }

    /// The label: `ok`, the status of the reply (`failed`, `timeout`, `unavailable`,
    /// `overloaded`, `bad_request`, `permission_denied`), or the driver's own finding (`no_reply`, `connection`,
    /// `no_connection`, `bad_reply`, `encode`).
    pub fn label(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::Replied(s) => s.label(),
            CallOutcome::NoReply => "no_reply",
            CallOutcome::Connection => "connection",
            CallOutcome::NoConnection => "no_connection",
            CallOutcome::BadReply => "bad_reply",
            CallOutcome::Encode => "encode",
        }
    }

    /// The error it counts as in `rpcmesh_errors_total{role="driver"}`, with its side:
    /// the server's for what came back or did not, the driver's own (the client's) for a
    /// request it could not encode. `None` for success.
    pub fn error(self) -> Option<(ErrorKind, Side)> {
        let kind = match self {
            CallOutcome::Ok => return None,
            CallOutcome::Encode => return Some((ErrorKind::TooLarge, Side::Client)),
            CallOutcome::Replied(Status::Success | Status::Failed) => ErrorKind::Failed,
            CallOutcome::Replied(Status::Timeout) | CallOutcome::NoReply => ErrorKind::Timeout,
            CallOutcome::Replied(Status::Unavailable) => ErrorKind::Unavailable,
            CallOutcome::Replied(Status::Overloaded) => ErrorKind::Overloaded,
            CallOutcome::Replied(Status::BadRequest) => ErrorKind::BadRequest,
            CallOutcome::Replied(Status::PermissionDenied) => ErrorKind::PermissionDenied,
            CallOutcome::Connection => ErrorKind::Io,
            CallOutcome::NoConnection => ErrorKind::Unavailable,
            CallOutcome::BadReply => ErrorKind::Decode,
        };
        Some((kind, Side::Server))
    }
}

/// Why one of the worker's connections was lost. Every call written on it and not yet
/// answered ends as [`Loss::OUTCOME`]; its `Display` is the `cause` of the log line.
#[derive(Debug)]
pub enum Loss {
    /// The socket failed while the worker waited on it.
    Socket(io::Error),
    /// A write failed.
    Write(io::Error),
    /// The peer sent bytes the stream cannot be split into frames after.
    BadFrames(FrameError),
    /// The peer closed it.
    ClosedByPeer,
    /// It was the oldest of more draining connections than a worker keeps.
    TooManyDraining,
}

impl Loss {
    /// The outcome of every call lost with a connection: it was written, so it may have run.
    pub const OUTCOME: CallOutcome = CallOutcome::Connection;

    /// The reason the connection metrics count its close under.
    pub fn close_reason(&self) -> CloseReason {
        match self {
            Loss::Socket(_) | Loss::Write(_) | Loss::BadFrames(_) => CloseReason::Error,
            Loss::ClosedByPeer => CloseReason::Peer,
            Loss::TooManyDraining => CloseReason::Local,
        }
    }
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loss::Socket(e) => write!(f, "socket: {e}"),
            Loss::Write(e) => write!(f, "write: {e}"),
            Loss::BadFrames(e) => write!(f, "bad frames: {e}"),
            Loss::ClosedByPeer => f.write_str("closed by peer"),
            Loss::TooManyDraining => f.write_str("more connections draining than a worker keeps"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loss_logs_its_cause_and_counts_its_close_by_who_ended_it() {
        let reset = || io::Error::from(io::ErrorKind::ConnectionReset);
        let cases = [
            (Loss::Socket(reset()), "socket: ", CloseReason::Error),
            (Loss::Write(reset()), "write: ", CloseReason::Error),
            (Loss::ClosedByPeer, "closed by peer", CloseReason::Peer),
            (
                Loss::TooManyDraining,
                "more connections draining than a worker keeps",
                CloseReason::Local,
            ),
        ];
        for (loss, text, reason) in cases {
            assert!(loss.to_string().starts_with(text), "{loss}");
            assert_eq!(loss.close_reason(), reason, "{loss}");
        }
        assert_eq!(Loss::OUTCOME.label(), "connection");
    }

    #[test]
    fn indexes_and_labels_are_one_to_one() {
        for (i, o) in CallOutcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i, "{o:?}");
        }
        let mut labels: Vec<&str> = CallOutcome::ALL.iter().map(|o| o.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), CallOutcome::COUNT);
    }

    #[test]
    fn a_timeout_the_server_sent_is_not_the_drivers_own() {
        let theirs = CallOutcome::of_reply(Status::Timeout, true);
        assert_eq!(theirs, CallOutcome::Replied(Status::Timeout));
        assert_ne!(theirs.label(), CallOutcome::NoReply.label());
        assert_eq!(theirs.label(), "timeout");
        assert_eq!(CallOutcome::NoReply.label(), "no_reply");
    }

    #[test]
    fn every_failure_counts_as_an_error_and_success_does_not() {
        assert_eq!(CallOutcome::Ok.error(), None);
        for o in &CallOutcome::ALL[1..] {
            assert!(o.error().is_some(), "{o:?}");
        }
        assert_eq!(
            CallOutcome::of_reply(Status::Overloaded, true).error(),
            Some((ErrorKind::Overloaded, Side::Server))
        );
        assert_eq!(
            CallOutcome::Encode.error(),
            Some((ErrorKind::TooLarge, Side::Client))
        );
    }

    #[test]
    fn a_success_whose_content_is_wrong_is_a_bad_reply() {
        assert_eq!(
            CallOutcome::of_reply(Status::Success, false),
            CallOutcome::BadReply
        );
        assert!(CallOutcome::of_reply(Status::Success, true).is_ok());
    }
}
