//! The kind of peer at the other end of a call: an rpcmesh peer or a plain RPCF v1 one.
//! The kind alone decides what may be sent to it: which extension bits, which statuses.
//!
//! A peer's kind is known from configuration (a broker's `--upstream` against
//! `--upstream-v1`, a driver's `--v1`) or, for a caller, from its request: a caller that
//! set [`Flags::EXT_STATUS`] takes what an rpcmesh peer takes. How a status degrades for a
//! plain v1 peer is [`Status::to_wire`]'s.

#[cfg(doc)]
use crate::Status;
use crate::frame::Flags;

/// Which RPCF dialect a peer speaks, and so what may be sent to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerKind {
    /// An rpcmesh peer. It may be sent every extension bit ([`Flags::ALL`]: compressed
    /// payloads, the asks for compressed replies and extended statuses, `NOT_RUN`) and
    /// every status, the extended ones (3 unavailable, 4 overloaded, 5 bad request)
    /// included.
    Rpcmesh,
    /// A plain RPCF v1 peer. It may be sent only frames with no extension bit set and the
    /// statuses v1 defines (0 success, 1 failed, 2 timeout): an extended status goes as 1,
    /// its name at the head of the message. A v1 peer would take a frame with a flag for
    /// an unknown type.
    V1,
}

impl PeerKind {
    /// The kind of caller a request with `flags` shows: one that asked for extended
    /// statuses ([`Flags::EXT_STATUS`]) is answered as an rpcmesh peer, any other as a
    /// plain v1 one. (A compressed reply is asked for on its own, with
    /// [`Flags::ACCEPT_COMPRESSED`].)
    pub const fn of_caller(request_flags: Flags) -> PeerKind {
        if request_flags.contains(Flags::EXT_STATUS) {
            PeerKind::Rpcmesh
        } else {
            PeerKind::V1
        }
    }

    /// True when a request with `flags` can go to a peer of this kind once the bits that
    /// only ask for something are cleared: a compressed payload cannot be made plain on
    /// the way, so it goes to an rpcmesh peer only.
    pub const fn takes_request(self, flags: Flags) -> bool {
        match self {
            PeerKind::Rpcmesh => true,
            PeerKind::V1 => !flags.contains(Flags::COMPRESSED),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_that_asks_for_extended_statuses_is_answered_as_an_rpcmesh_peer() {
        assert_eq!(PeerKind::of_caller(Flags::EXT_STATUS), PeerKind::Rpcmesh);
        assert_eq!(
            PeerKind::of_caller(Flags::EXT_STATUS | Flags::ACCEPT_COMPRESSED),
            PeerKind::Rpcmesh
        );
        assert_eq!(PeerKind::of_caller(Flags::ACCEPT_COMPRESSED), PeerKind::V1);
        assert_eq!(PeerKind::of_caller(Flags::NONE), PeerKind::V1);
    }

    #[test]
    fn only_an_rpcmesh_peer_takes_a_compressed_request() {
        let compressed = Flags::COMPRESSED | Flags::EXT_STATUS;
        assert!(PeerKind::Rpcmesh.takes_request(compressed));
        assert!(!PeerKind::V1.takes_request(compressed));
        assert!(PeerKind::V1.takes_request(Flags::EXT_STATUS | Flags::ACCEPT_COMPRESSED));
        assert!(PeerKind::V1.takes_request(Flags::NONE));
    }
}
