//! What the handles of one upstream connection and its task share: the count of calls in
//! flight, the closed mark, and, under one lock, the queue of calls written by sessions
//! and the in-flight table (upstream request id → caller).
//!
//! A session queues its call itself ([`ConnState::try_queue`]): under the lock the call
//! gets a fresh request id (slot index + generation) in the table, its header is written
//! under that id and its body copied once into the queue's buffer, and the task is woken
//! if it waits. The lock is held for the copy only (one uncontended lock per call, no
//! message per call). The task takes the queue once per round ([`Calls::take_queued`]).
//! Matching replies to slots is `replies`'; the task's loop is `task`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use bytes::BytesMut;

use rpcmesh_common::net::budget::{MemoryBudget, Reserved};
use rpcmesh_common::net::slots::{KEYED_SLOTS, SlotTable};
use rpcmesh_wire::PeerKind;
use rpcmesh_wire::ext::{deadline_micros, put_ext_request_with_deadline};
use rpcmesh_wire::frame::{Flags, Frame, Header, MsgType, put_frame, put_frame_with_trailer};
use rpcmesh_wire::neutral::neutral_id;

use super::Refused;
use super::kept::{self, Kept, Ring};
use crate::call::{Avoid, CallInfo, Forward, Reply, ReplyTx, Reroute, Verbatim};

#[cfg(doc)]
use super::REQUEST_RETAIN;

/// What the handles (the sessions routing calls here, the pool) and the task share.
#[derive(Debug, Default)]
pub(super) struct ConnState {
    /// Calls queued or in flight: the router's measure of the connection's load, and what
    /// the cap is checked against (without the lock).
    pub in_flight: AtomicUsize,
    /// Set once the connection failed, was retired, or its provider is going away: no
    /// new call is routed here.
    pub closed: AtomicBool,
    /// The provider takes its callers' identities (it said so in a heartbeat answer over
    /// TLS): calls are queued as extension requests carrying them (`rpcmesh_wire::ext`).
    pub takes_caller: AtomicBool,
    /// The provider takes the calls' deadlines (it said so in a heartbeat answer): calls
    /// are queued as extension requests carrying the time left to them.
    pub takes_deadline: AtomicBool,
    /// The provider applies the cap of the call timeout to every call on this connection
    /// (`rpcmesh_wire::ext::CAP_KEY`): a call queued in the round that read it, whose time
    /// left is the cap or its own field's, is queued as it came.
    pub takes_deadline_cap: AtomicBool,
    /// The calls, under the lock.
    calls: Mutex<Calls>,
}

impl ConnState {
    pub fn lock(&self) -> MutexGuard<'_, Calls> {
        // Nothing under the lock can panic half-way through an update that matters.
        self.calls.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ready when calls were queued since the task last took them; else the task is woken
    /// by the next one.
    pub fn poll_queued(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut calls = self.lock();
        if !calls.queued.is_empty() {
            return Poll::Ready(());
        }
        match &calls.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => calls.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Queues a call: its frame goes into the queue under a fresh request id, with the
    /// flags a provider of kind `to` takes, and the task is woken if it waits. `now` is
    /// the session's clock (read once per round, not per call), from which the time left
    /// to the call is told to a provider that takes it. Refused at the connection's cap
    /// (`cap` calls in flight) or once it is closed; the call is then handed back
    /// untouched.
    // A refused call is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    pub fn try_queue(
        &self,
        fwd: Forward,
        now: Instant,
        cap: usize,
        to: PeerKind,
    ) -> Result<(), (Forward, Refused)> {
        if self.closed.load(Ordering::Relaxed) {
            return Err((fwd, Refused::Closed));
        }
        if self.in_flight.fetch_add(1, Ordering::Relaxed) >= cap {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err((fwd, Refused::Full));
        }
        let mut calls = self.lock();
        if calls.ended {
            drop(calls);
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err((fwd, Refused::Closed));
        }
        let flags = match to {
            // Ask for extended statuses always: the session degrades them for v1 callers,
            // and an "unavailable" from the provider tells the pool it is draining.
            PeerKind::Rpcmesh => fwd.frame.header.flags | Flags::EXT_STATUS,
            PeerKind::V1 => Flags::NONE,
        };
        if calls.table.len() >= KEYED_SLOTS {
            // As many calls as the table has keys (the cap is held below it: the flags).
            drop(calls);
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err((fwd, Refused::Full));
        }
        let Calls {
            wbuf,
            queued,
            table,
            waker,
            ..
        } = &mut *calls;
        let at = wbuf.len();
        let large = fwd.reserved.is_some();
        let client_id = fwd.info.client_id;
        // A neutral id (`rpcmesh_wire::neutral`): the request and its reply keep their CRCs
        // across the rewrite, both ways.
        let (id, slot) = table
            .insert_keyed(
                Slot {
                    info: fwd.info,
                    reply_to: fwd.reply_to,
                    deadline: fwd.deadline,
                    sent: None,
                    reserved: fwd.reserved,
                    kept: Kept::Nowhere,
                    retries: fwd.retries,
                    refused_by_drain: fwd.refused_by_drain,
                    idempotent: fwd.idempotent,
                },
                |key| neutral_id(client_id, key),
            )
            .expect("a key is free: the table holds fewer calls than it has keys (checked)");
        let caller = self.takes_caller.load(Ordering::Relaxed);
        let takes_deadline = self.takes_deadline.load(Ordering::Relaxed);
        // Queued in the round that read it (the clock is read once a round), a call has
        // the whole of its budget left: the earlier of its caller's deadline and the call
        // timeout, which is what a provider applying the cap gives it anyway.
        let capped = takes_deadline
            && now == fwd.info.admitted
            && self.takes_deadline_cap.load(Ordering::Relaxed);
        // Else the time left to the call (the broker's own time spent on it taken off): a
        // provider does not start it once that has passed.
        let left =
            (takes_deadline && !capped).then(|| slot.deadline.saturating_duration_since(now));
        let same_flags = flags == fwd.frame.header.flags;
        match (&fwd.verbatim, caller, left) {
            // The frame as it came is the frame to write: copied, id rewritten, CRC kept.
            (Verbatim::Plain { trailer }, false, None) if same_flags => {
                let h = Header {
                    msg_type: MsgType::Request,
                    flags,
                    body_len: 0,
                    req_id: id,
                };
                put_frame_with_trailer(wbuf, &h, &fwd.frame.body, *trailer);
            }
            (
                Verbatim::Deadline {
                    body,
                    budget_us,
                    trailer,
                },
                false,
                left,
            ) if same_flags
                && takes_deadline
                && left.is_none_or(|left| deadline_micros(left) == *budget_us) =>
            {
                let h = Header {
                    msg_type: MsgType::ExtRequest,
                    flags,
                    body_len: 0,
                    req_id: id,
                };
                put_frame_with_trailer(wbuf, &h, body, *trailer);
            }
            (_, true, _) | (_, _, Some(_)) => {
                // The caller's identity before the body the broker never opens.
                let block = if caller {
                    slot.reply_to.caller_block()
                } else {
                    &[]
                };
                put_ext_request_with_deadline(wbuf, flags, id, block, left, &fwd.frame.body);
            }
            _ => {
                let header = Header {
                    msg_type: MsgType::Request,
                    flags,
                    body_len: fwd.frame.header.body_len,
                    req_id: id,
                };
                put_frame(wbuf, &header, &fwd.frame.body);
            }
        }
        // Kept until the task takes it (a call still queued when the connection fails is
        // routed again), and for an rpcmesh provider until the reply (`kept`).
        slot.kept = if large {
            Kept::Whole(fwd.frame)
        } else {
            Kept::Queued {
                at,
                len: wbuf.len() - at,
            }
        };
        queued.push(id);
        let waker = waker.take();
        drop(calls);
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }
}

/// A connection's calls: queued by sessions, written and matched to replies by its task.
#[derive(Debug)]
pub(super) struct Calls {
    /// The frames of the calls queued since the task last took them, under this
    /// connection's request ids, ready to be written.
    pub wbuf: BytesMut,
    /// The ids of the calls in `wbuf`, in order.
    pub queued: Vec<u64>,
    /// Calls queued or written and waiting for their reply, by upstream request id.
    pub table: SlotTable<Slot>,
    /// The task, when it waits for calls.
    pub waker: Option<Waker>,
    /// The task has ended: nothing more is queued (set under the lock, so a call is
    /// either queued before, and answered by the task's close, or refused).
    pub ended: bool,
    /// The requests written to an rpcmesh provider, kept for a hand-back (`kept`).
    pub ring: Ring,
}

impl Calls {
    /// Moves the calls queued since the last look to the task's write buffer `out`;
    /// returns how many. `keep_request`: the calls' requests are kept once written (an
    /// rpcmesh provider's, which may refuse them `NOT_RUN`), in the ring sized with
    /// `budget`'s count. The ids of the timed calls (stages on) are added to `round`.
    pub fn take_queued(
        &mut self,
        out: &mut BytesMut,
        keep_request: bool,
        budget: &Arc<MemoryBudget>,
        round: &mut Vec<u64>,
    ) -> usize {
        let Calls {
            wbuf,
            queued,
            table,
            ring,
            ..
        } = self;
        let n = queued.len();
        if n == 0 {
            return 0;
        }
        // The requests go into the ring in one copy: each is at its place in the batch.
        let base = if keep_request {
            // Room for the requests of every call in flight here, at this batch's size.
            ring.fit(wbuf.len() / n * table.len(), budget);
            ring.push(wbuf)
        } else {
            None
        };
        let in_flight = table.len();
        for id in queued.drain(..) {
            if let Some(slot) = table.get_mut(id) {
                // An rpcmesh provider's calls keep their requests (it may refuse them
                // NOT_RUN), and so do idempotent calls, which go again if lost in flight; a
                // plain v1 server's others keep nothing once written.
                let keep = keep_request || slot.idempotent;
                match slot.kept {
                    Kept::Queued { at, len } => {
                        // A batch too large for the ring (a large request in it), or a
                        // plain v1 server's idempotent call, goes in on its own.
                        let pos = match base {
                            Some(base) => Some(base + at as u64),
                            None if keep => {
                                ring.fit(len * in_flight, budget);
                                wbuf.get(at..at + len).and_then(|b| ring.push(b))
                            }
                            None => None,
                        };
                        slot.kept = pos.map_or(Kept::Nowhere, |pos| Kept::Ring { pos, len });
                    }
                    _ if !keep => slot.kept = Kept::Nowhere,
                    _ => {}
                }
                if slot.info.routed.is_some() {
                    round.push(id);
                }
            }
        }
        if out.is_empty() {
            // The buffers trade places: no copy, and each keeps its room.
            std::mem::swap(out, wbuf);
        } else {
            out.extend_from_slice(wbuf);
            wbuf.clear();
        }
        n
    }

    /// Takes the request kept for `slot`'s call, as its caller sent it, if it is kept
    /// still (`kept`).
    pub fn take_request(&mut self, slot: &mut Slot) -> Option<Frame> {
        let kept = std::mem::take(&mut slot.kept);
        kept::request(kept, &slot.info, &self.wbuf, &self.ring)
    }
}

impl Default for Calls {
    fn default() -> Self {
        Calls {
            wbuf: BytesMut::new(),
            queued: Vec::new(),
            // Keyed: the ids are neutral ones (`rpcmesh_wire::neutral`).
            table: SlotTable::keyed(),
            waker: None,
            ended: false,
            ring: Ring::default(),
        }
    }
}

/// A call queued or written upstream and waiting for its reply (its request id is its key
/// in the connection's [`SlotTable`]).
#[derive(Debug)]
pub(super) struct Slot {
    pub info: CallInfo,
    pub reply_to: ReplyTx,
    pub deadline: Instant,
    /// When the write that carried it returned (stages on only).
    pub sent: Option<Instant>,
    /// A large call's bytes, counted against the memory budget until its reply is in the
    /// caller's write buffer (or it fails).
    pub reserved: Option<Reserved>,
    /// Where the caller's request is kept: while the call is queued, to route it elsewhere
    /// should the connection fail first; then, for an rpcmesh provider, to route it
    /// elsewhere if the provider refuses it `NOT_RUN` (let go after [`REQUEST_RETAIN`]). A
    /// plain v1 server's calls let go of it once written.
    pub kept: Kept,
    /// Times the call was handed back and routed again before.
    pub retries: u8,
    /// A draining provider refused it before (see [`Forward::refused_by_drain`]).
    pub refused_by_drain: bool,
    /// Marked idempotent (see [`Forward::idempotent`]).
    pub idempotent: bool,
}

impl Slot {
    /// Gives the call back to its session with its request frame, to be routed again,
    /// away from `provider` (its `PoolLink::id`): strictly when the provider refused,
    /// shed or lost it, by preference when only the connection failed before the write. Dropped when the session is
    /// gone (nobody is left to answer).
    pub fn hand_back(self, request: Frame, why: Reroute, provider: u64) {
        let to = self.reply_to.clone();
        let fwd = Forward {
            frame: request,
            verbatim: Verbatim::No,
            info: CallInfo {
                replied: None,
                ..self.info
            },
            reply_to: self.reply_to,
            deadline: self.deadline,
            retries: self.retries,
            reserved: self.reserved,
            refused_by_drain: self.refused_by_drain || why == Reroute::NotRun,
            avoid: match why {
                Reroute::Unsent => Avoid::Prefer(provider),
                Reroute::NotRun | Reroute::Overloaded | Reroute::Lost => Avoid::Never(provider),
            },
            idempotent: self.idempotent,
        };
        to.send(Reply::Retry(fwd, why));
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{call, connection};
    use super::*;
    use crate::call::Inbox;
    use rpcmesh_wire::codec::FrameCodec;

    /// The frame of `call(id)` as its caller sent it, and its trailer.
    fn sent(id: u64) -> (Vec<u8>, u32) {
        let inbox = Inbox::new();
        let frame = call(id, &inbox).frame;
        let mut b = BytesMut::new();
        frame.put(&mut b);
        let n = b.len();
        let trailer = u32::from_be_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]]);
        (b.to_vec(), trailer)
    }

    #[tokio::test]
    async fn a_call_that_may_go_as_it_came_is_copied_its_id_alone_rewritten_and_its_crc_kept() {
        let (conn, mut task, _server) = connection(PeerKind::Rpcmesh).await;
        let inbox = Inbox::new();
        let (original, trailer) = sent(41);
        for given in [trailer, trailer ^ 1] {
            let mut fwd = call(41, &inbox);
            fwd.verbatim = Verbatim::Plain { trailer: given };
            conn.try_forward(fwd, Instant::now()).unwrap();
            assert_eq!(task.take_queued(), 1);
            let written = task.io.wbuf().split();
            assert_eq!(written.len(), original.len());
            // Everything but the 8 id bytes is the caller's, the trailer the one given:
            // nothing was summed again.
            assert_eq!(written[..10], original[..10]);
            assert_eq!(
                written[18..written.len() - 4],
                original[18..original.len() - 4]
            );
            assert_eq!(written[written.len() - 4..], given.to_be_bytes());
            let id = u64::from_be_bytes(written[10..18].try_into().unwrap());
            assert_ne!(id, 41);
            if given == trailer {
                // The id is neutral: the copied trailer is right.
                let frame = Frame::from_bytes(written.freeze()).unwrap();
                assert_eq!(frame.header.req_id, id);
            }
        }
    }

    #[tokio::test]
    async fn a_call_with_fields_to_change_is_written_afresh_with_a_right_crc() {
        // A plain v1 server takes no flags: the frame cannot go as it came.
        let (conn, mut task, _server) = connection(PeerKind::V1).await;
        let inbox = Inbox::new();
        let (_, trailer) = sent(42);
        let mut fwd = call(42, &inbox);
        fwd.verbatim = Verbatim::Plain { trailer };
        conn.try_forward(fwd, Instant::now()).unwrap();
        assert_eq!(task.take_queued(), 1);
        let frame = Frame::from_bytes(task.io.wbuf().split().freeze()).unwrap();
        assert_eq!(frame.header.flags, Flags::NONE);
    }

    #[tokio::test]
    async fn a_call_is_queued_under_a_fresh_id_and_the_cap_refuses_the_fifth() {
        let (conn, mut task, _server) = connection(PeerKind::Rpcmesh).await;
        let inbox = Inbox::new();
        for id in 1..=4 {
            conn.try_forward(call(id, &inbox), Instant::now()).unwrap();
        }
        assert_eq!(conn.load(), 4);
        let (back, why) = conn
            .try_forward(call(5, &inbox), Instant::now())
            .unwrap_err();
        assert_eq!((back.info.client_id, why), (5, Refused::Full));
        assert_eq!(conn.load(), 4, "a refused call is not counted");
        assert_eq!(task.take_queued(), 4);
        // The task's write buffer holds the four frames under the connection's own ids,
        // asking an rpcmesh provider for extended statuses.
        let mut written = task.io.wbuf().split();
        let codec = FrameCodec::new(1 << 20);
        let mut ids = Vec::new();
        while let Some(f) = codec.decode_frame(&mut written).unwrap() {
            assert!(f.header.flags.contains(Flags::EXT_STATUS));
            ids.push(f.header.req_id);
        }
        assert_eq!(ids.len(), 4);
        assert!(
            ids.iter().all(|id| !(1..=4).contains(id)),
            "remapped: {ids:?}"
        );
    }
}
