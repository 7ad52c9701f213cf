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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use bytes::BytesMut;

use rpcmesh_common::net::budget::Reserved;
use rpcmesh_common::net::slots::SlotTable;
use rpcmesh_wire::PeerKind;
use rpcmesh_wire::ext::put_ext_request_with_deadline;
use rpcmesh_wire::frame::{Flags, Frame, Header, MsgType, put_frame};

use super::Refused;
use crate::call::{Avoid, CallInfo, Forward, Reply, ReplyTx, Reroute};

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
    /// flags a provider of kind `to` takes, and the task is woken if it waits. Refused
    /// at the connection's cap (`cap` calls in flight) or once it is closed; the call is
    /// then handed back untouched.
    // A refused call is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    pub fn try_queue(
        &self,
        fwd: Forward,
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
        let body_len = fwd.frame.header.body_len;
        let Calls {
            wbuf,
            queued,
            table,
            waker,
            ..
        } = &mut *calls;
        // The frame stays with the call until the task takes it (so that a call still
        // queued when the connection fails can be routed again), and for an rpcmesh
        // provider until the reply or REQUEST_RETAIN (see `Slot::request`).
        let (id, slot) = table.insert_mut(Slot {
            info: fwd.info,
            reply_to: fwd.reply_to,
            deadline: fwd.deadline,
            sent: None,
            reserved: fwd.reserved,
            request: Some(fwd.frame),
            retries: fwd.retries,
            refused_by_drain: fwd.refused_by_drain,
            idempotent: fwd.idempotent,
        });
        let header = Header {
            msg_type: MsgType::Request,
            flags,
            body_len,
            req_id: id,
        };
        if let Some(frame) = &slot.request {
            let caller = self.takes_caller.load(Ordering::Relaxed);
            // The time left to the call (the broker's own time spent on it taken off): a
            // provider does not start it once that has passed.
            let left = self
                .takes_deadline
                .load(Ordering::Relaxed)
                .then(|| slot.deadline.saturating_duration_since(Instant::now()));
            if caller || left.is_some() {
                // The caller's identity before the body the broker never opens.
                let block = if caller {
                    slot.reply_to.caller_block()
                } else {
                    &[]
                };
                put_ext_request_with_deadline(wbuf, flags, id, block, left, &frame.body);
            } else {
                put_frame(wbuf, &header, &frame.body);
            }
        }
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
#[derive(Debug, Default)]
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
}

impl Calls {
    /// Moves the calls queued since the last look to the task's write buffer `out`;
    /// returns how many. `keep_request`: the calls keep their request frames once written
    /// (an rpcmesh provider's, which may refuse them `NOT_RUN`). The ids of the timed
    /// calls (stages on) are added to `round`.
    pub fn take_queued(
        &mut self,
        out: &mut BytesMut,
        keep_request: bool,
        round: &mut Vec<u64>,
    ) -> usize {
        let Calls {
            wbuf,
            queued,
            table,
            ..
        } = self;
        let n = queued.len();
        if n == 0 {
            return 0;
        }
        if out.is_empty() {
            // The buffers trade places: no copy, and each keeps its room.
            std::mem::swap(out, wbuf);
        } else {
            out.extend_from_slice(wbuf);
            wbuf.clear();
        }
        for id in queued.drain(..) {
            if let Some(slot) = table.get_mut(id) {
                // A plain v1 server's calls keep nothing of the caller's read buffer once
                // written (only an rpcmesh provider refuses with NOT_RUN), but idempotent
                // ones, which go again if lost in flight.
                if !keep_request && !slot.idempotent {
                    slot.request = None;
                }
                if slot.info.routed.is_some() {
                    round.push(id);
                }
            }
        }
        n
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
    /// The caller's request frame: while the call is queued, to route it elsewhere should
    /// the connection fail first; then, for an rpcmesh provider, to route it elsewhere if
    /// the provider refuses it `NOT_RUN` (dropped after [`REQUEST_RETAIN`]). A plain v1
    /// server's calls let go of it once written.
    pub request: Option<Frame>,
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

    #[tokio::test]
    async fn a_call_is_queued_under_a_fresh_id_and_the_cap_refuses_the_fifth() {
        let (conn, mut task, _server) = connection(PeerKind::Rpcmesh).await;
        let inbox = Inbox::new();
        for id in 1..=4 {
            conn.try_forward(call(id, &inbox)).unwrap();
        }
        assert_eq!(conn.load(), 4);
        let (back, why) = conn.try_forward(call(5, &inbox)).unwrap_err();
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
