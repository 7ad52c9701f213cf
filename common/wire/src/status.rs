//! Call outcomes: the response status byte, with rpcmesh's extended statuses and how they
//! degrade for plain v1 callers.
//!
//! RPCF v1 defines 0 = success, 1 = failed, 2 = timeout. rpcmesh adds 3 = unavailable,
//! 4 = overloaded, 5 = bad request, 6 = permission denied, sent only to rpcmesh peers ([`PeerKind`]: a caller
//! whose request carried [`Flags::EXT_STATUS`](crate::frame::Flags::EXT_STATUS)); everyone
//! else gets status 1 with an `error_msg` that starts with the status name
//! (`"overloaded: ..."`).

use crate::peer::PeerKind;

/// The outcome of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Status {
    /// The handler answered.
    Success = 0,
    /// The call failed (handler error, unknown service or method, bad payload...).
    Failed = 1,
    /// No answer within the deadline.
    Timeout = 2,
    /// No healthy provider, or the provider connection was lost with the call on it.
    Unavailable = 3,
    /// Shed at once because a limit on calls in flight was reached.
    Overloaded = 4,
    /// The request was malformed (bad body, CRC mismatch, payload that does not decode).
    BadRequest = 5,
    /// The authorization policy does not let the caller call this method.
    PermissionDenied = 6,
}

impl Status {
    /// Every status, in wire order.
    pub const ALL: [Status; 7] = [
        Status::Success,
        Status::Failed,
        Status::Timeout,
        Status::Unavailable,
        Status::Overloaded,
        Status::BadRequest,
        Status::PermissionDenied,
    ];

    /// Reads a status byte; `None` for a value no version defines.
    pub fn from_wire(b: u8) -> Option<Status> {
        Status::ALL.get(usize::from(b)).copied()
    }

    /// The byte to send to a peer of kind `to`: the status itself to an rpcmesh peer,
    /// else its v1 equivalent.
    pub fn to_wire(self, to: PeerKind) -> u8 {
        match (self, to) {
            (Status::Success | Status::Failed | Status::Timeout, _) | (_, PeerKind::Rpcmesh) => {
                self as u8
            }
            (_, PeerKind::V1) => Status::Failed as u8,
        }
    }

    /// Lower-case name, used as metric label and as the `error_msg` prefix.
    pub fn label(self) -> &'static str {
        match self {
            Status::Success => "ok",
            Status::Failed => "failed",
            Status::Timeout => "timeout",
            Status::Unavailable => "unavailable",
            Status::Overloaded => "overloaded",
            Status::BadRequest => "bad_request",
            Status::PermissionDenied => "permission_denied",
        }
    }

    /// Prefix of the `error_msg` for this status (so a v1 caller, who sees status 1, can
    /// still tell `overloaded` from other failures).
    pub fn message_prefix(self) -> &'static str {
        match self {
            // Failures keep their message as it is: v1 callers match on
            // "service not found: ..." verbatim.
            Status::Success | Status::Failed => "",
            Status::Timeout => "timeout",
            Status::Unavailable => "unavailable",
            Status::Overloaded => "overloaded",
            Status::BadRequest => "bad request",
            Status::PermissionDenied => "permission denied",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_statuses_degrade_to_failed_for_v1_callers() {
        assert_eq!(Status::Overloaded.to_wire(PeerKind::V1), 1);
        assert_eq!(Status::Overloaded.to_wire(PeerKind::Rpcmesh), 4);
        assert_eq!(Status::Timeout.to_wire(PeerKind::V1), 2);
        for s in Status::ALL {
            assert_eq!(Status::from_wire(s.to_wire(PeerKind::Rpcmesh)), Some(s));
        }
        assert_eq!(Status::PermissionDenied.to_wire(PeerKind::V1), 1);
        assert_eq!(Status::from_wire(7), None);
    }
}
