//! A call on its way through the broker: what a session hands to an upstream connection
//! ([`Forward`]) and how its outcome comes back to the session (its [`Inbox`]).
//!
//! The request travels as the frame the session read (its body a slice of the session's
//! read buffer); the upstream connection copies it once, into its write buffer, under its
//! own request id. A provider's reply is copied once by the upstream connection that read
//! it, straight into the [`Inbox`] of the caller's session under the caller's request id
//! ([`Inbox::answer`]); the session moves those bytes into its write buffer in one piece
//! each round, and counts the calls from a small record each. Every other outcome (the
//! broker's own answers, calls to route again, large replies that hold a memory
//! reservation) reaches the session whole, as a [`Reply`] ([`Inbox::send`]). The upstream
//! connection keeps the request frame until the reply (for a while at most), so that a
//! call a draining provider refused comes back whole ([`Reply::Retry`]).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use rpcmesh_common::net::budget::{Reserved, SMALL_BODY};
use rpcmesh_common::net::connection::SHRINK_ABOVE;
use rpcmesh_wire::frame::{
    Flags, Frame, Header, MsgType, put_forwarded_response, put_frame_with_trailer,
};
use rpcmesh_wire::{PeerKind, Status};

use crate::failure::Failure;

/// Where an upstream connection puts a call's outcome: the inbox of the session that
/// admitted it.
pub(crate) type ReplyTx = Arc<Inbox>;

/// The outcomes of one session's calls, put there by upstream connections and taken by
/// the session once per round. A mutex, not a channel: an upstream connection copies a
/// reply's bytes in and records the call in a few words, and the session takes everything
/// at once, so a call costs neither a message moved through a queue nor one taken out
/// (measured: docs/performance.md, "What each optimisation bought"). Upstream connections
/// hold the lock only to append; the session only to swap the contents out.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    state: Mutex<InboxState>,
    /// The extension block naming the session's caller (`rpcmesh_wire::ext`), put before
    /// each of its calls to providers that take it; empty: an anonymous caller.
    caller: bytes::Bytes,
    /// Counts the outcomes dropped once the session is gone.
    abandoned: Option<metrics::Counter>,
}

#[derive(Debug, Default)]
struct InboxState {
    /// Provider replies, under their callers' ids, ready to be written.
    replies: BytesMut,
    /// One record per reply in `replies`, in order.
    answered: Vec<Answered>,
    /// Every other outcome.
    other: Vec<Reply>,
    /// The session, when it waits for an outcome.
    waker: Option<Waker>,
    /// The session is gone: outcomes are dropped.
    closed: bool,
}

/// A call answered by its provider into the inbox's replies: what the session counts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Answered {
    /// The session's tag for the call.
    pub tag: u32,
    /// The status the provider answered.
    pub status: Status,
    /// When the session read the request, and when the reply was read from the provider
    /// (the calls whose stages are timed only).
    pub timed: Option<(Instant, Option<Instant>)>,
}

/// What a session takes from its inbox in one go ([`Inbox::take`]).
#[derive(Debug, Default)]
pub(crate) struct Taken {
    pub answered: Vec<Answered>,
    pub other: Vec<Reply>,
}

/// The extension block naming an anonymous caller: `u16` length 3, tag 1 (caller),
/// length 0.
pub(crate) const ANONYMOUS_CALLER: &[u8] = &[0, 3, rpcmesh_wire::ext::TAG_CALLER, 0, 0];

/// The extension block naming `caller` (`None`: anonymous); empty if it cannot be made.
pub(crate) fn caller_block_of(caller: Option<&str>) -> BytesMut {
    let mut block = BytesMut::new();
    // An identity is at most rpcmesh_common's MAX_IDENTITY_LEN, within the field's.
    if rpcmesh_wire::ext::put_caller_block(&mut block, caller).is_err() {
        block.clear();
    }
    block
}

impl Inbox {
    #[cfg(test)]
    pub fn new() -> Arc<Inbox> {
        Arc::new(Inbox::default())
    }

    /// The inbox of a session whose caller is `caller` (`None`: anonymous).
    pub fn for_caller(caller: Option<&str>, abandoned: metrics::Counter) -> Arc<Inbox> {
        let block = caller_block_of(caller);
        Arc::new(Inbox {
            caller: block.freeze(),
            abandoned: Some(abandoned),
            ..Inbox::default()
        })
    }

    /// The extension block naming the caller (the anonymous one when none was made).
    pub fn caller_block(&self) -> &[u8] {
        if self.caller.is_empty() {
            ANONYMOUS_CALLER
        } else {
            &self.caller
        }
    }

    fn lock(&self) -> MutexGuard<'_, InboxState> {
        // Nothing under the lock can panic half-way through an update that matters.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Passes a provider's reply to the caller: its bytes under the caller's id, or, for a
    /// reply that holds a memory reservation or is itself large, the whole frame (see
    /// [`Reply::Done`]). Returns the status the provider answered.
    pub fn answer(&self, frame: Frame, info: CallInfo, reserved: Option<Reserved>) -> Status {
        if !copied_at_once(frame.body.len(), reserved.is_some()) {
            // Large: it goes on with its reservation (or, a large reply to a small call,
            // as the frame in the provider connection's read buffer, which the budget
            // counts there) until the session copied it.
            let status = status_of(&frame.body);
            self.send(Reply::Done {
                info,
                outcome: Ok(frame),
                reserved,
            });
            return status;
        }
        self.answer_small(frame.header.flags, &frame.body, None, info)
    }

    /// Passes a provider's small reply (flags and body, wherever they lie: the provider
    /// connection reads them in place) to the caller, as its bytes under the caller's id.
    /// The caller of this has checked [`copied_at_once`]. Returns the status the provider
    /// answered.
    pub fn answer_small(
        &self,
        flags: Flags,
        body: &[u8],
        trailer: Option<u32>,
        info: CallInfo,
    ) -> Status {
        let mut st = self.lock();
        let status = if st.closed {
            self.count_abandoned();
            status_of(body)
        } else {
            let status = write_reply_to(&mut st.replies, flags, body, trailer, info);
            st.answered.push(Answered {
                tag: info.tag,
                status,
                timed: info.routed.map(|_| (info.admitted, info.replied)),
            });
            status
        };
        let waker = st.waker.take();
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
        status
    }

    /// Hands the session an outcome it acts on itself. Dropped when the session is gone
    /// (nobody is left to answer).
    pub fn send(&self, reply: Reply) {
        let mut st = self.lock();
        if st.closed {
            drop(st);
            self.count_abandoned();
            return;
        }
        st.other.push(reply);
        let waker = st.waker.take();
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn count_abandoned(&self) {
        if let Some(c) = &self.abandoned {
            c.increment(1);
        }
    }

    /// Ready when outcomes wait; else the session is woken by the next one.
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut st = self.lock();
        if !st.answered.is_empty() || !st.other.is_empty() {
            return Poll::Ready(());
        }
        match &st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => st.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Moves the replies' bytes to the end of `wbuf` and the records into `into` (which
    /// must be empty); returns how many outcomes were taken.
    pub fn take(&self, wbuf: &mut BytesMut, into: &mut Taken) -> usize {
        let mut st = self.lock();
        let n = st.answered.len() + st.other.len();
        if !st.replies.is_empty() {
            if wbuf.is_empty() {
                // The buffers trade places: no copy, and each keeps its room.
                std::mem::swap(wbuf, &mut st.replies);
            } else {
                wbuf.extend_from_slice(&st.replies);
                st.replies.clear();
            }
            // A burst of replies must not cost the session its room for the rest of its
            // life (the bound a connection's own buffers keep).
            if st.replies.capacity() > SHRINK_ABOVE {
                st.replies = BytesMut::new();
            }
        }
        std::mem::swap(&mut into.answered, &mut st.answered);
        std::mem::swap(&mut into.other, &mut st.other);
        n
    }

    /// The room of the reply buffer (for tests).
    #[cfg(test)]
    fn room(&self) -> usize {
        self.lock().replies.capacity()
    }

    /// The session is gone: later outcomes are dropped, and what waits is let go.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.replies = BytesMut::new();
        st.answered = Vec::new();
        st.other = Vec::new();
        st.waker = None;
    }
}

/// Whether a provider's reply of `body_len` bytes is copied into its caller's inbox at
/// once: a small one whose call holds no memory reservation. Any other goes on whole,
/// with its reservation, until the session copies it.
pub(crate) fn copied_at_once(body_len: usize, reserved: bool) -> bool {
    !reserved && body_len < SMALL_BODY
}

/// The shortest reply body a provider may send: a status byte and a payload length.
/// Shorter is a malformed reply.
pub(crate) const MIN_REPLY_BODY: usize = 5;

/// The status a provider's reply body carries ("failed" for one the broker does not
/// know). The body is at least a status byte and a payload length long (checked).
pub(crate) fn status_of(body: &[u8]) -> Status {
    Status::from_wire(body[0]).unwrap_or(Status::Failed)
}

/// Copies the provider's reply (its flags and body) to `dst` under the caller's id,
/// degrading an extended status to "failed" for a caller that did not ask for them. A
/// caller without extended statuses gets no `NOT_RUN` either (a v1 peer would take the
/// frame for an unknown type): it is only ever set with status 3, which such a caller gets
/// as 1.
///
/// `trailer`: the reply's CRC trailer as the provider sent it, when known. The call's
/// upstream id is neutral to the caller's (`rpcmesh_wire::neutral`), so a reply that goes
/// back unchanged but for its id keeps that trailer and is copied without a CRC pass.
pub(crate) fn write_reply_to(
    dst: &mut BytesMut,
    flags: Flags,
    body: &[u8],
    trailer: Option<u32>,
    info: CallInfo,
) -> Status {
    let status = status_of(body);
    let caller = PeerKind::of_caller(info.client_flags);
    let wire = status.to_wire(caller);
    let out = match caller {
        PeerKind::Rpcmesh => flags,
        PeerKind::V1 => flags.without(Flags::NOT_RUN),
    };
    match trailer {
        Some(t) if out == flags && wire == body[0] => {
            let h = Header {
                msg_type: MsgType::Response,
                flags,
                body_len: 0,
                req_id: info.client_id,
            };
            put_frame_with_trailer(dst, &h, body, t);
        }
        _ => put_forwarded_response(dst, info.client_id, out, body, wire),
    }
    status
}

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

/// How a call's frame may go to a provider as its caller sent it: copied with only its id
/// rewritten, to a neutral one (`rpcmesh_wire::neutral`), so its CRC trailer is kept and
/// nothing of it is summed again. The upstream connection copies it when the frame it
/// would write is that frame: the same type, flags and fields.
#[derive(Debug, Clone, Default)]
pub(crate) enum Verbatim {
    /// Written afresh (a call routed again, or a frame whose fields the broker changes).
    #[default]
    No,
    /// A plain request: [`Forward::frame`] itself, with this trailer.
    Plain { trailer: u32 },
    /// An extension request carrying only its deadline: its whole body (the block before
    /// the v1 body), the deadline in it as sent, in microseconds, and its trailer.
    Deadline {
        body: Bytes,
        budget_us: u32,
        trailer: u32,
    },
}

/// A call handed to an upstream connection.
#[derive(Debug)]
pub(crate) struct Forward {
    /// The caller's request frame, as read (an extension request's v1 frame inside).
    pub frame: Frame,
    /// Whether the frame as it came may be copied to the provider.
    pub verbatim: Verbatim,
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
    /// The provider a retry is to avoid (`PoolLink::id`; 0: none): the one that shed it
    /// or refused it. One whose connection closed before the write may still take it
    /// when no other does.
    pub avoid: Avoid,
    /// Its service and method are marked idempotent (`--idempotent`, the providers
    /// file): lost in flight, it may be sent again.
    pub idempotent: bool,
}

/// Which provider a call routed again keeps away from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Avoid {
    /// None: a first try.
    #[default]
    None,
    /// Another provider first; this one (by `PoolLink::id`) if no other takes it.
    Prefer(u64),
    /// Never this one.
    Never(u64),
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
    /// Not run by any provider, or idempotent and lost in flight: to route again (the
    /// retry drawn from the budget already when the connection handed it back for
    /// [`Reroute::Overloaded`] or [`Reroute::Lost`]).
    Retry(Forward, Reroute),
}

/// Why a call came back to its session to be routed again: the reasons every program
/// that retries shares (`rpcmesh_common::retry`), with their labels.
pub(crate) use rpcmesh_common::retry::RetryReason as Reroute;

#[cfg(test)]
mod tests {
    use super::*;
    use rpcmesh_wire::envelope::put_not_run_response;

    fn info(client_flags: Flags) -> CallInfo {
        CallInfo {
            client_id: 7,
            client_flags,
            tag: 0,
            admitted: Instant::now(),
            routed: None,
            replied: None,
        }
    }

    /// A provider's NOT_RUN refusal, as the broker reads it (it always asks rpcmesh
    /// providers for extended statuses).
    fn not_run_reply() -> Frame {
        let mut b = BytesMut::new();
        put_not_run_response(&mut b, 99, Flags::EXT_STATUS, "provider shutting down");
        Frame::from_bytes(b.freeze()).unwrap()
    }

    #[test]
    fn a_reply_that_goes_back_unchanged_keeps_the_trailer_it_came_with() {
        let reply = not_run_reply();
        let (flags, body) = (reply.header.flags, &reply.body[..]);
        let mut out = BytesMut::new();
        // To a caller that takes extended statuses: as it came (the trailer given is the
        // one written), the caller's id in it.
        write_reply_to(
            &mut out,
            flags,
            body,
            Some(0xdead_beef),
            info(Flags::EXT_STATUS),
        );
        let n = out.len();
        assert_eq!(out[n - 4..], 0xdead_beef_u32.to_be_bytes());
        assert_eq!(out[10..18], 7u64.to_be_bytes());
        // To a v1 caller the status and flags change: written afresh, its CRC right.
        let mut out = BytesMut::new();
        write_reply_to(&mut out, flags, body, Some(0xdead_beef), info(Flags::NONE));
        let v1 = Frame::from_bytes(out.freeze()).unwrap();
        assert_eq!(v1.body[0], Status::Failed as u8);
    }

    #[test]
    fn not_run_is_passed_on_only_to_callers_that_take_extended_statuses() {
        let reply = not_run_reply();
        assert!(reply.header.flags.contains(Flags::NOT_RUN));
        let mut out = BytesMut::new();
        let (flags, body) = (reply.header.flags, &reply.body[..]);
        let status = write_reply_to(&mut out, flags, body, None, info(Flags::NONE));
        assert_eq!(status, Status::Unavailable);
        let v1 = Frame::from_bytes(out.split().freeze()).unwrap();
        assert_eq!(v1.header.req_id, 7);
        assert_eq!(
            v1.header.flags,
            Flags::NONE,
            "a v1 caller gets a plain frame"
        );
        assert_eq!(v1.body[0], Status::Failed as u8, "and status 1");
        write_reply_to(&mut out, flags, body, None, info(Flags::EXT_STATUS));
        let ext = Frame::from_bytes(out.split().freeze()).unwrap();
        assert_eq!(ext.header.flags, Flags::NOT_RUN);
        assert_eq!(ext.body[0], Status::Unavailable as u8);
    }

    /// A provider's reply with status `status` and a body of `extra` more bytes of message.
    fn reply(id: u64, status: Status, extra: usize) -> Frame {
        let mut b = BytesMut::new();
        let message = "x".repeat(extra);
        rpcmesh_wire::envelope::put_error_response(&mut b, id, Flags::EXT_STATUS, status, &message);
        Frame::from_bytes(b.freeze()).unwrap()
    }

    /// Counts the wake-ups of the task that polled.
    struct CountWakes(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn replies_reach_the_session_as_bytes_under_the_callers_ids_with_one_record_each() {
        let inbox = Inbox::new();
        let wakes = Arc::new(CountWakes(0.into()));
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(inbox.poll_ready(&mut cx).is_pending(), "nothing yet");
        let mut a = info(Flags::EXT_STATUS);
        a.tag = 3;
        let mut b = info(Flags::NONE);
        b.client_id = 8;
        b.routed = Some(Instant::now());
        assert_eq!(
            inbox.answer(reply(1, Status::Success, 0), a, None),
            Status::Success
        );
        assert_eq!(
            inbox.answer(reply(2, Status::Unavailable, 0), b, None),
            Status::Unavailable
        );
        assert_eq!(
            wakes.0.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "woken once"
        );
        assert!(inbox.poll_ready(&mut cx).is_ready());

        // Taken after bytes already in the write buffer: appended, in order.
        let mut wbuf = BytesMut::from(&b"earlier"[..]);
        let mut taken = Taken::default();
        assert_eq!(inbox.take(&mut wbuf, &mut taken), 2);
        assert_eq!(&wbuf[..7], b"earlier");
        let mut rest = wbuf.split_off(7);
        let codec = rpcmesh_wire::codec::FrameCodec::new(1 << 20);
        let first = codec.decode_frame(&mut rest).unwrap().unwrap();
        let second = codec.decode_frame(&mut rest).unwrap().unwrap();
        assert!(rest.is_empty());
        assert_eq!(
            (first.header.req_id, first.body[0]),
            (7, Status::Success as u8)
        );
        assert_eq!(
            (second.header.req_id, second.body[0]),
            (8, Status::Failed as u8),
            "a v1 caller gets an extended status as failed"
        );
        let records: Vec<_> = taken.answered.iter().map(|r| (r.tag, r.status)).collect();
        assert_eq!(records, [(3, Status::Success), (0, Status::Unavailable)]);
        assert!(taken.answered[0].timed.is_none(), "untimed call");
        assert!(
            taken.answered[1].timed.is_some(),
            "timed call keeps its times"
        );
        assert!(taken.other.is_empty());
        assert!(inbox.poll_ready(&mut cx).is_pending(), "empty again");
    }

    #[test]
    fn a_large_reply_and_a_reserved_call_go_whole_and_a_closed_inbox_drops_everything() {
        let inbox = Inbox::new();
        let budget = rpcmesh_common::net::budget::MemoryBudget::new(1 << 20);
        inbox.answer(
            reply(1, Status::Success, SMALL_BODY),
            info(Flags::NONE),
            None,
        );
        let reserved = Reserved::new(&budget, 10_000);
        inbox.answer(
            reply(2, Status::Success, 0),
            info(Flags::NONE),
            Some(reserved),
        );
        let mut wbuf = BytesMut::new();
        let mut taken = Taken::default();
        assert_eq!(inbox.take(&mut wbuf, &mut taken), 2);
        assert!(wbuf.is_empty() && taken.answered.is_empty());
        assert!(matches!(
            &taken.other[..],
            [
                Reply::Done {
                    outcome: Ok(_),
                    reserved: None,
                    ..
                },
                Reply::Done {
                    outcome: Ok(_),
                    reserved: Some(_),
                    ..
                }
            ]
        ));
        assert!(
            budget.used() > 0,
            "the reservation is held until the session copied the reply"
        );
        taken.other.clear();
        assert_eq!(budget.used(), 0);

        inbox.close();
        inbox.answer(reply(3, Status::Success, 0), info(Flags::NONE), None);
        inbox.send(Reply::Done {
            info: info(Flags::NONE),
            outcome: Err(Failure::KeptClosing),
            reserved: None,
        });
        let mut taken = Taken::default();
        assert_eq!(
            inbox.take(&mut wbuf, &mut taken),
            0,
            "dropped: the session is gone"
        );
        assert!(wbuf.is_empty());
    }

    #[test]
    fn a_burst_of_replies_does_not_keep_its_room() {
        let inbox = Inbox::new();
        for id in 0..400 {
            inbox.answer(reply(id, Status::Success, 1000), info(Flags::NONE), None);
        }
        assert!(inbox.room() > SHRINK_ABOVE);
        // Taken behind bytes already waiting: copied, and the inbox's buffer given back.
        let mut wbuf = BytesMut::from(&b"waiting"[..]);
        let mut taken = Taken::default();
        assert_eq!(inbox.take(&mut wbuf, &mut taken), 400);
        assert!(wbuf.len() > SHRINK_ABOVE);
        assert_eq!(inbox.room(), 0);
    }
}
