//! Where a call's request is kept while it may still be handed back to be routed again:
//! in the queue's buffer while it is queued (the connection may fail before writing it),
//! then, for an rpcmesh provider (which may refuse it `NOT_RUN` or shed it), in a ring of
//! the connection's recent requests.
//!
//! The request is never kept as the frame the session read: that frame is a slice of the
//! session's read buffer, and a slice still alive when the session reads again makes the
//! buffer allocate afresh (a call in flight at every read, one allocation every few dozen
//! calls). The bytes written upstream are copied instead, once more, into a ring whose
//! room follows the calls in flight ([`Ring::fit`]), so that forwarding a call allocates
//! nothing in steady state. A request the ring has overwritten is no longer kept: its
//! refusal then goes to the caller as it came, as one past [`REQUEST_RETAIN`] does.
//! A large request (one that holds a memory reservation) is kept whole instead: the
//! ring's room is for the many small ones.
//!
//! A request kept as written is given back as the caller sent it: the caller's id and
//! flags (from the call's record), the extension block the connection added taken off.

use std::sync::Arc;

use bytes::Bytes;
use rpcmesh_common::net::budget::{MemoryBudget, Reserved};
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{Frame, Header, MsgType};

use crate::call::CallInfo;

#[cfg(doc)]
use super::REQUEST_RETAIN;

/// The ring's least room, taken when the connection first writes a call: a few dozen
/// small calls, a trifle for a connection that carries calls at all.
pub const RING_MIN: usize = 4 * 1024;
/// The ring's most room: twice the requests of 1,000 calls of 128 bytes in flight on one
/// connection. Calls beyond that are still forwarded; the oldest lose the chance of a
/// hand-back.
pub const RING_MAX: usize = 256 * 1024;

/// Where one call's request is kept (its slot's field).
#[derive(Debug, Default)]
pub(crate) enum Kept {
    /// Not kept (written to a plain v1 server, past its time, or overwritten).
    #[default]
    Nowhere,
    /// Queued, at `at` in the queue's buffer, `len` bytes as written.
    Queued { at: usize, len: usize },
    /// Written, at absolute position `pos` of the connection's ring.
    Ring { pos: u64, len: usize },
    /// A large request, kept whole.
    Whole(Frame),
}

impl Kept {
    /// Whether anything is kept.
    pub fn is_some(&self) -> bool {
        !matches!(self, Kept::Nowhere)
    }
}

/// The connection's recent requests, as written, in a buffer reused round after round.
#[derive(Debug, Default)]
pub(crate) struct Ring {
    buf: Vec<u8>,
    /// Bytes ever appended (the absolute position of the next one).
    head: u64,
    /// The oldest position a growth kept: what came before is gone.
    oldest: u64,
    /// The ring's room, counted in the memory budget.
    reserved: Option<Reserved>,
}

impl Ring {
    /// Makes room for `live` bytes of requests in flight twice over (within
    /// [`RING_MIN`]..[`RING_MAX`]); what is in the ring stays. Grows only: a connection
    /// that once carried that many calls is likely to again.
    pub fn fit(&mut self, live: usize, budget: &Arc<MemoryBudget>) {
        let want = live
            .saturating_mul(2)
            .clamp(RING_MIN, RING_MAX)
            .next_power_of_two()
            .min(RING_MAX);
        if want <= self.buf.len() {
            return;
        }
        let mut grown = vec![0u8; want];
        let kept = (self.buf.len() as u64).min(self.head);
        for p in self.head - kept..self.head {
            grown[(p % want as u64) as usize] = self.buf[(p % self.buf.len() as u64) as usize];
        }
        self.buf = grown;
        self.oldest = self.head - kept;
        self.reserved = Some(Reserved::new(budget, want));
    }

    /// Appends `bytes`; returns their position, or `None` when they do not fit at all.
    pub fn push(&mut self, bytes: &[u8]) -> Option<u64> {
        let cap = self.buf.len();
        if bytes.len() > cap {
            return None;
        }
        let pos = self.head;
        let at = (pos % cap as u64) as usize;
        let first = bytes.len().min(cap - at);
        self.buf[at..at + first].copy_from_slice(&bytes[..first]);
        self.buf[..bytes.len() - first].copy_from_slice(&bytes[first..]);
        self.head += bytes.len() as u64;
        Some(pos)
    }

    /// Appends the next `bytes` of a stream the ring follows whole (the loop engine's
    /// connections: a byte's position is its place in the stream, offset by where the
    /// stream began in the ring): what does not fit is passed over, and only the last of
    /// `bytes` are kept.
    pub fn feed(&mut self, bytes: &[u8]) {
        let cap = self.buf.len();
        let keep = bytes.len().min(cap);
        if keep < bytes.len() {
            self.head += (bytes.len() - keep) as u64;
            self.oldest = self.head;
        }
        if keep > 0 {
            self.push(&bytes[bytes.len() - keep..]);
        }
    }

    /// The absolute position of the next byte appended.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Whether the `len` bytes at `pos` are still held.
    pub fn holds(&self, pos: u64, len: usize) -> bool {
        let cap = self.buf.len() as u64;
        pos >= self.oldest && self.head.saturating_sub(pos) <= cap && len as u64 <= cap
    }

    /// The ring's room.
    pub fn room(&self) -> usize {
        self.buf.len()
    }

    /// The `len` bytes at `pos`, if the ring still holds them.
    fn get(&self, pos: u64, len: usize) -> Option<Vec<u8>> {
        let cap = self.buf.len();
        let gone = pos < self.oldest || self.head.saturating_sub(pos) > cap as u64;
        if cap == 0 || gone || len > cap {
            return None;
        }
        let at = (pos % cap as u64) as usize;
        let first = len.min(cap - at);
        let mut out = Vec::with_capacity(len);
        out.extend_from_slice(&self.buf[at..at + first]);
        out.extend_from_slice(&self.buf[..len - first]);
        Some(out)
    }
}

/// The request `kept`, as the caller sent it (`info`: its id and flags), from the queue's
/// buffer `queued` or the ring; `None` when it is no longer kept.
pub(crate) fn request(kept: Kept, info: &CallInfo, queued: &[u8], ring: &Ring) -> Option<Frame> {
    let written = match kept {
        Kept::Nowhere => return None,
        Kept::Whole(frame) => return Some(frame),
        Kept::Queued { at, len } => queued.get(at..at + len)?.to_vec(),
        Kept::Ring { pos, len } => ring.get(pos, len)?,
    };
    // Written by this connection: whole, and its CRC right.
    let frame = Frame::from_bytes(Bytes::from(written)).ok()?;
    let body = match frame.header.msg_type {
        MsgType::ExtRequest => ext::split(&frame.body).ok()?.1,
        _ => frame.body,
    };
    Some(Frame {
        header: Header {
            msg_type: MsgType::Request,
            flags: info.client_flags,
            body_len: body.len() as u32,
            req_id: info.client_id,
        },
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_gives_back_what_it_still_holds_across_its_end() {
        let budget = MemoryBudget::new(1 << 30);
        let mut ring = Ring::default();
        ring.fit(0, &budget);
        assert_eq!(ring.buf.len(), RING_MIN);
        let a = ring.push(&[1; 3000]).unwrap();
        let b = ring.push(&[2; 3000]).unwrap();
        // `b` wrapped round the end; `a` was partly overwritten by it.
        assert_eq!(ring.get(b, 3000), Some(vec![2; 3000]));
        assert_eq!(ring.get(a, 3000), None);
        assert_eq!(ring.push(&[0; RING_MIN + 1]), None);
    }

    #[test]
    fn a_stream_fed_whole_keeps_its_last_bytes_at_their_places() {
        let budget = MemoryBudget::new(1 << 30);
        let mut ring = Ring::default();
        ring.fit(0, &budget);
        ring.feed(&[1; 1000]);
        ring.feed(&[2; 1000]);
        assert_eq!(ring.get(1000, 1000), Some(vec![2; 1000]));
        assert!(ring.holds(0, 1000));
        // More than the ring's room at once: only its end is kept, every place still
        // where the stream had it.
        let mut big = vec![3; RING_MIN + 500];
        big[RING_MIN + 499] = 4;
        ring.feed(&big);
        assert_eq!(ring.head(), (2000 + RING_MIN + 500) as u64);
        assert!(!ring.holds(1000, 1000), "passed over");
        assert_eq!(ring.get(ring.head() - 1, 1), Some(vec![4]));
        assert_eq!(ring.get(2000, 10), None);
    }

    #[test]
    fn growing_keeps_what_the_ring_held() {
        let budget = MemoryBudget::new(1 << 30);
        let mut ring = Ring::default();
        ring.fit(0, &budget);
        let a = ring.push(&[7; 1000]).unwrap();
        let b = ring.push(&[8; 3500]).unwrap();
        ring.fit(RING_MIN * 2, &budget);
        assert_eq!(ring.buf.len(), RING_MIN * 4);
        assert_eq!(ring.get(b, 3500), Some(vec![8; 3500]));
        assert_eq!(ring.get(a, 1000), None, "overwritten before the growth");
        ring.fit(RING_MAX * 8, &budget);
        assert_eq!(ring.buf.len(), RING_MAX);
        assert_eq!(ring.get(b, 3500), Some(vec![8; 3500]));
    }
}
