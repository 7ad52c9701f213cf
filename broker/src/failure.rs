//! Why the broker answered a call itself instead of with a provider's reply: one error
//! type ([`Failure`]) for every broker-made answer, carrying the status the caller gets,
//! the error kind it counts as, the side it came from (the caller, the broker, or the
//! provider) and whether a retry is safe (the call never reached a provider, so sending it
//! again cannot run it twice).
//!
//! Owns the taxonomy and the wording of the answers, and how an upstream connection ended
//! ([`ConnEnd`]: the cause its lost calls are told, and its close reason). Where each
//! failure is detected is the session's (`session.rs`: bad requests, caps, routing), or
//! the upstream connection's (`upstream/connection/`: timeouts, lost connections,
//! unusable replies); writing the answer is the session's.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use rpcmesh_common::metrics::families::ShedCap;
use rpcmesh_common::metrics::{ErrorCounters, ErrorKind, Side};
use rpcmesh_common::net::connection::CloseReason;
use rpcmesh_wire::Status;
use rpcmesh_wire::frame::FrameError;

/// Which of the broker's in-flight caps a shed call met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cap {
    /// `--max-in-flight-per-conn`: calls in flight on the caller's connection.
    PerConnection(usize),
    /// `--max-in-flight`: calls in flight in the whole broker.
    Total(usize),
    /// `--memory-budget`: the bytes the broker buffers (a large call is refused past half
    /// of it).
    Memory(usize),
}

/// How an upstream connection ended: what its calls in flight are told (the `Display`), and
/// the [`CloseReason`] it is counted under ([`ConnEnd::close_reason`]).
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ConnEnd {
    /// Every handle was dropped and the calls in flight were done.
    #[error("closed")]
    Released,
    /// The provider closed its side.
    #[error("closed by provider")]
    ClosedByProvider,
    /// Waiting on the socket failed (a reset, ...).
    #[error("socket error: {0}")]
    Socket(Arc<io::Error>),
    /// A write failed.
    #[error("write failed: {0}")]
    Write(Arc<io::Error>),
    /// The provider sent bytes the stream cannot be resynchronised after.
    #[error("bad frames from provider: {0}")]
    BadFrames(FrameError),
    /// A heartbeat went unanswered for the health timeout (the loop engine's check).
    #[error("heartbeat not answered within {}", rpcmesh_common::cli::DurationArg(*.0))]
    Silent(Duration),
}

impl ConnEnd {
    /// The `reason` it is counted under in `rpcmesh_connections_closed_total`. A pooled
    /// connection is meant to last as long as the broker holds it, so every end the
    /// broker did not choose counts as `error`, the provider's own close included.
    pub fn close_reason(&self) -> CloseReason {
        match self {
            ConnEnd::Released => CloseReason::Local,
            ConnEnd::ClosedByProvider
            | ConnEnd::Silent(_)
            | ConnEnd::Socket(_)
            | ConnEnd::Write(_)
            | ConnEnd::BadFrames(_) => CloseReason::Error,
        }
    }
}

/// A call the broker answered itself.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// The request's body could not be read (names that overrun it or are not UTF-8, a
    /// payload length that does not add up), or its frame was refused (CRC mismatch).
    BadRequest(FrameError),
    /// No provider is configured for the service.
    UnknownService(String),
    /// The payload is compressed and only plain v1 servers serve the service.
    NeedsExtension(String),
    /// The authorization policy does not let the caller make the call (the answer).
    Denied(String),
    /// The broker is shutting down and takes no new calls.
    Draining,
    /// The broker's grace period ended with the call still in flight (written to a
    /// provider: it may have run).
    GraceOver,
    /// Shed at once: one of the broker's caps on calls in flight.
    Shed(Cap),
    /// Every open connection to the service's providers is at its cap.
    Full(String),
    /// The service's providers have no open connection.
    NoHealthy(String),
    /// The call was handed back unsent (its connection closed) too often.
    KeptClosing,
    /// Every provider of the service that could take the call is draining (one refused it
    /// with `NOT_RUN`, or all are marked so): it was not run, and the caller is told so
    /// (`NOT_RUN`), so that it may send it to another broker.
    ProvidersDraining(String),
    /// The call's deadline passed before it could be written to a provider.
    TimedOutQueued,
    /// The caller's own deadline (the extension's `deadline` field) had passed before the
    /// broker forwarded the call: it was not sent to any provider.
    DeadlineExceeded,
    /// No reply from the provider within the call timeout.
    Timeout {
        /// The provider, as configured.
        provider: Arc<str>,
        /// The call timeout.
        after: Duration,
    },
    /// The connection to the provider was lost with the call written on it.
    ConnectionLost {
        /// The provider, as configured.
        provider: Arc<str>,
        /// What ended the connection.
        cause: ConnEnd,
    },
    /// The provider's reply is too short to hold a status and a payload.
    MalformedReply,
    /// The provider's reply frame was refused (CRC mismatch, over the frame limit).
    ReplyRefused {
        /// The provider, as configured.
        provider: Arc<str>,
        /// Why.
        error: FrameError,
    },
}

impl Failure {
    /// Its status, error kind, side and retry safety: one row per failure.
    fn class(&self) -> (Status, ErrorKind, Side, bool) {
        use ErrorKind as K;
        use Side::{Broker, Client, Provider};
        use Status as S;
        match self {
            Failure::BadRequest(e) => (S::BadRequest, K::of_frame(e), Client, true),
            Failure::UnknownService(_) => (S::Failed, K::UnknownService, Client, true),
            Failure::NeedsExtension(_) => (S::BadRequest, K::BadBody, Client, true),
            Failure::Denied(_) => (S::PermissionDenied, K::PermissionDenied, Client, true),
            Failure::Draining => (S::Unavailable, K::Unavailable, Broker, true),
            Failure::GraceOver => (S::Unavailable, K::Unavailable, Broker, false),
            Failure::Shed(_) | Failure::Full(_) => (S::Overloaded, K::Overloaded, Broker, true),
            Failure::NoHealthy(_) | Failure::KeptClosing | Failure::ProvidersDraining(_) => {
                (S::Unavailable, K::Unavailable, Provider, true)
            }
            Failure::TimedOutQueued => (S::Timeout, K::Timeout, Provider, true),
            Failure::DeadlineExceeded => (S::Timeout, K::DeadlineExceeded, Client, true),
            // Written to the provider: it may have run.
            Failure::Timeout { .. } => (S::Timeout, K::Timeout, Provider, false),
            Failure::ConnectionLost { .. } => (S::Unavailable, K::Unavailable, Provider, false),
            Failure::MalformedReply => (S::Failed, K::BadBody, Provider, false),
            Failure::ReplyRefused { error, .. } => (S::Failed, K::of_frame(error), Provider, false),
        }
    }

    /// The status the caller gets (degraded to "failed" for callers without extended
    /// statuses when it is one of those).
    pub fn status(&self) -> Status {
        self.class().0
    }

    /// The kind it counts as in `rpcmesh_errors_total`.
    pub fn kind(&self) -> ErrorKind {
        self.class().1
    }

    /// Where it came from: the caller's request, the broker's own limits and decisions,
    /// or the provider (and the way to it).
    pub fn side(&self) -> Side {
        self.class().2
    }

    /// The cap it met, when it is a call shed at once (`rpcmesh_shed_total`).
    pub fn shed_cap(&self) -> Option<ShedCap> {
        match self {
            Failure::Shed(Cap::PerConnection(_)) => Some(ShedCap::PerConnection),
            Failure::Shed(Cap::Total(_)) => Some(ShedCap::Total),
            Failure::Shed(Cap::Memory(_)) => Some(ShedCap::Memory),
            Failure::Full(_) => Some(ShedCap::UpstreamFull),
            _ => None,
        }
    }

    /// Counts it in `rpcmesh_errors_total`, by its kind and side.
    pub fn count(&self, errors: &ErrorCounters) {
        errors.inc(self.kind(), self.side());
    }

    /// True when it is the provider's fault (outlier ejection counts it): the connection
    /// lost with the call on it, an unusable reply, no reply in time.
    pub fn provider_fault(&self) -> bool {
        matches!(
            self,
            Failure::Timeout { .. }
                | Failure::ConnectionLost { .. }
                | Failure::MalformedReply
                | Failure::ReplyRefused { .. }
        )
    }

    /// True when the caller is told, with `NOT_RUN`, that the call was not run because
    /// this broker or the providers are draining (it may then go to another broker).
    pub fn not_run(&self) -> bool {
        matches!(self, Failure::Draining | Failure::ProvidersDraining(_))
    }

    /// True when the call never reached a provider, so that sending it again (here or to
    /// another broker) cannot make a provider run it twice. A caller's bad request is not
    /// worth retrying unchanged, but retrying it is safe.
    pub fn retry_safe(&self) -> bool {
        self.class().3
    }
}

/// The `error_msg` of the answer (the session prefixes the status name where v1 callers
/// need it, see `put_error_response`).
impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::BadRequest(e) => write!(f, "{e}"),
            Failure::UnknownService(s) => {
                f.write_str(&rpcmesh_wire::envelope::service_not_found(s))
            }
            Failure::NeedsExtension(s) => {
                write!(f, "no provider of {s} accepts compressed payloads")
            }
            // "permission denied: IDENTITY may not call Service.Method".
            Failure::Denied(m) => f.write_str(m),
            Failure::Draining => f.write_str("broker shutting down"),
            Failure::GraceOver => {
                f.write_str("broker shutting down: the grace period ended before the call did")
            }
            Failure::Shed(Cap::PerConnection(n)) => {
                write!(f, "broker has {n} calls in flight on this connection")
            }
            Failure::Shed(Cap::Total(n)) => write!(f, "broker has {n} calls in flight"),
            Failure::Shed(Cap::Memory(n)) => {
                write!(f, "broker memory budget of {} MiB spent", n >> 20)
            }
            Failure::Full(s) => {
                write!(f, "every connection to the providers of {s} is full")
            }
            Failure::NoHealthy(s) => write!(f, "no healthy provider for {s}"),
            Failure::KeptClosing => {
                f.write_str("provider connections kept closing before the call could be sent")
            }
            Failure::ProvidersDraining(s) => {
                write!(
                    f,
                    "the providers of {s} are shutting down; the call was not run"
                )
            }
            Failure::TimedOutQueued => {
                f.write_str("call timed out waiting for a provider connection")
            }
            Failure::DeadlineExceeded => {
                f.write_str("deadline exceeded before the broker forwarded the call")
            }
            Failure::Timeout { provider, after } => {
                write!(f, "no reply from provider {provider} within {after:?}")
            }
            Failure::ConnectionLost { provider, cause } => write!(
                f,
                "connection to provider {provider} lost with the call in flight: {cause}"
            ),
            Failure::MalformedReply => f.write_str("malformed reply from provider"),
            Failure::ReplyRefused { provider, error } => {
                write!(f, "reply from provider {provider} refused: {error}")
            }
        }
    }
}

/// Writes the broker's own answer to call `id` (with the caller's `flags`) to `out`, its
/// text formatted in `message` (kept by the caller to spare an allocation per answer): a
/// "not run" answer when the caller may send the call elsewhere, else an error with the
/// failure's status. Both engines answer so.
pub(crate) fn put_answer(
    out: &mut bytes::BytesMut,
    message: &mut String,
    id: u64,
    flags: rpcmesh_wire::frame::Flags,
    failure: &Failure,
) {
    use std::fmt::Write as _;
    message.clear();
    let _ = write!(message, "{failure}");
    if failure.not_run() {
        rpcmesh_wire::envelope::put_not_run_response(out, id, flags, message);
    } else {
        rpcmesh_wire::envelope::put_error_response(out, id, flags, failure.status(), message);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Failure> {
        let p: Arc<str> = Arc::from("10.0.0.3:7800");
        let crc = FrameError::Crc {
            req_id: 1,
            raw_type: 0,
            expected: 1,
            actual: 2,
        };
        vec![
            Failure::BadRequest(crc.clone()),
            Failure::UnknownService("Nope".into()),
            Failure::NeedsExtension("Old".into()),
            Failure::Draining,
            Failure::Shed(Cap::PerConnection(4096)),
            Failure::Shed(Cap::Total(65536)),
            Failure::Full("S".into()),
            Failure::NoHealthy("S".into()),
            Failure::KeptClosing,
            Failure::ProvidersDraining("S".into()),
            Failure::TimedOutQueued,
            Failure::DeadlineExceeded,
            Failure::Timeout {
                provider: p.clone(),
                after: Duration::from_secs(5),
            },
            Failure::ConnectionLost {
                provider: p.clone(),
                cause: ConnEnd::ClosedByProvider,
            },
            Failure::MalformedReply,
            Failure::ReplyRefused {
                provider: p,
                error: crc,
            },
        ]
    }

    #[test]
    fn only_a_connection_the_broker_released_counts_as_closed_locally() {
        let reset = || Arc::new(io::Error::from(io::ErrorKind::ConnectionReset));
        let crc = FrameError::Crc {
            req_id: 1,
            raw_type: 1,
            expected: 1,
            actual: 2,
        };
        let ends = [
            (ConnEnd::Released, CloseReason::Local, "closed".to_string()),
            (
                ConnEnd::ClosedByProvider,
                CloseReason::Error,
                "closed by provider".to_string(),
            ),
            (
                ConnEnd::Socket(reset()),
                CloseReason::Error,
                format!("socket error: {}", reset()),
            ),
            (
                ConnEnd::Write(reset()),
                CloseReason::Error,
                format!("write failed: {}", reset()),
            ),
            (
                ConnEnd::BadFrames(crc.clone()),
                CloseReason::Error,
                format!("bad frames from provider: {crc}"),
            ),
        ];
        for (end, reason, text) in ends {
            assert_eq!(end.close_reason(), reason, "{end:?}");
            assert_eq!(end.to_string(), text);
        }
    }

    #[test]
    fn only_a_call_that_reached_a_provider_is_unsafe_to_retry() {
        for f in all() {
            let reached = matches!(
                f,
                Failure::Timeout { .. }
                    | Failure::ConnectionLost { .. }
                    | Failure::MalformedReply
                    | Failure::ReplyRefused { .. }
            );
            assert_eq!(f.retry_safe(), !reached, "{f:?}");
            if reached {
                assert_eq!(f.side(), Side::Provider, "{f:?}");
            }
        }
    }

    #[test]
    fn each_failure_has_its_side_status_and_kind() {
        let sides: Vec<(Side, Status, ErrorKind)> = all()
            .iter()
            .map(|f| (f.side(), f.status(), f.kind()))
            .collect();
        use ErrorKind as K;
        use Side::{Broker, Client, Provider};
        use Status as S;
        assert_eq!(
            sides,
            [
                (Client, S::BadRequest, K::Crc),
                (Client, S::Failed, K::UnknownService),
                (Client, S::BadRequest, K::BadBody),
                (Broker, S::Unavailable, K::Unavailable),
                (Broker, S::Overloaded, K::Overloaded),
                (Broker, S::Overloaded, K::Overloaded),
                (Broker, S::Overloaded, K::Overloaded),
                (Provider, S::Unavailable, K::Unavailable),
                (Provider, S::Unavailable, K::Unavailable),
                (Provider, S::Unavailable, K::Unavailable),
                (Provider, S::Timeout, K::Timeout),
                (Client, S::Timeout, K::DeadlineExceeded),
                (Provider, S::Timeout, K::Timeout),
                (Provider, S::Unavailable, K::Unavailable),
                (Provider, S::Failed, K::BadBody),
                (Provider, S::Failed, K::Crc),
            ]
        );
    }

    #[test]
    fn messages_say_what_v1_callers_match_on() {
        let m: Vec<String> = all().iter().map(|f| f.to_string()).collect();
        assert_eq!(m[1], "service not found: Nope");
        assert_eq!(m[4], "broker has 4096 calls in flight on this connection");
        assert_eq!(m[5], "broker has 65536 calls in flight");
        assert_eq!(
            m[9],
            "the providers of S are shutting down; the call was not run"
        );
        assert_eq!(
            m[11],
            "deadline exceeded before the broker forwarded the call"
        );
        assert_eq!(m[12], "no reply from provider 10.0.0.3:7800 within 5s");
        assert!(m[13].starts_with("connection to provider 10.0.0.3:7800 lost"));
    }
}
