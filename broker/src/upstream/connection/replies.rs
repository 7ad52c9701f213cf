//! What one upstream connection's task does with what it reads, and how each call taken
//! off its in-flight table gets its outcome.
//!
//! - Each reply is matched to its slot and copied into the caller's session's inbox
//!   (`crate::call::Inbox`), straight from the read buffer when it is small and ordinary
//!   ([`ConnTask::answer_in_place`]); a reply for no slot (its call timed out) is dropped
//!   and counted `late_reply`.
//! - A draining rpcmesh provider answers the calls it did not start "unavailable" with
//!   `NOT_RUN`: such a call goes back to its session with its request frame (kept in its
//!   slot for [`REQUEST_RETAIN`] at most) to be routed to another provider, and the whole
//!   provider is marked draining ([`PoolLink`]).
//! - A plain v1 server is timed between reads, an rpcmesh provider's own time per call is
//!   taken from its heartbeat answers, for the router's packing (`crate::upstream::pace`).
//! - A frame that cannot be used fails its own call when its header could be read; the
//!   connection ends only on input it cannot get past.
//!
//! Queueing is `queue`'s; the loop, the sweep and the connection's end are `task`'s.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rpcmesh_common::metrics::{ErrorKind, Side};
use rpcmesh_common::net::budget::Reserved;
use rpcmesh_common::net::pace::{HEARTBEAT_KEY, PerCall};
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::frame::{FRAME_OVERHEAD, Flags, Frame, FrameError, Header, MsgType};
use rpcmesh_wire::{PeerKind, Status};

use super::queue::{Calls, ConnState, Slot};
use super::task::ConnTask;
use crate::call::{CallInfo, MIN_REPLY_BODY, Reply, ReplyTx, Reroute, copied_at_once, status_of};
use crate::failure::{ConnEnd, Failure};
use crate::metrics::{UPSTREAM, UpstreamMetrics};
use crate::resilience::outlier::Verdict;

#[cfg(doc)]
use {super::REQUEST_RETAIN, crate::upstream::PoolLink};

/// How far past the frame limit a provider's reply may be and still be skipped (failing
/// its call alone); beyond that the length is taken for garbage and the connection ends.
pub(crate) const SKIP_FACTOR: u64 = 4;

impl ConnTask {
    /// Handles every whole frame read so far.
    pub fn take_frames(&mut self, state: &ConnState) -> Result<(), ConnEnd> {
        // One clock read per read: the replies' latencies for the balancer, the instant
        // their outcomes are judged at.
        self.now = Instant::now();
        self.oldest = None;
        let read_at = self.metrics.stages.on().then_some(self.now);
        let mut calls = state.lock();
        let before = calls.table.len();
        let taken = loop {
            match self.io.peek_frame() {
                Ok(Some(header)) => {
                    if !self.answer_in_place(&mut calls, &header, read_at) {
                        let frame = self.io.take_peeked(header);
                        self.on_frame(&mut calls, frame, read_at);
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => {
                    if let Err(end) = self.on_bad_frame(&mut calls, e) {
                        break Err(end);
                    }
                }
            }
        };
        self.tell_successes();
        self.tell_outcomes();
        taken?;
        if self.settings.kind == PeerKind::V1 {
            // Sessions queue under this lock, so the table changed by the replies alone.
            let answered = before.saturating_sub(calls.table.len());
            // (A queued call that timed out leaves its id in the queue until taken.)
            let waiting = calls.table.len().saturating_sub(calls.queued.len());
            let now = read_at.unwrap_or_else(Instant::now);
            self.backlog
                .on_read(now, answered, waiting, &self.link.pace);
        }
        drop(calls);
        // The slowest reply of the read (see `crate::resilience::ewma`): that of its call
        // admitted first, all being read at one instant.
        let peak = self
            .oldest
            .map_or(Duration::ZERO, |o| self.now.saturating_duration_since(o));
        if !peak.is_zero() {
            self.link.ewma.observe(peak, self.now);
        }
        if self.io.is_eof() {
            return Err(ConnEnd::ClosedByProvider);
        }
        Ok(())
    }

    /// A reply to a call admitted at `admitted` was read: its latency joins the read's
    /// (kept as the earliest admission, an instant compared, not a duration computed, per
    /// reply).
    fn took(&mut self, admitted: Instant) {
        if self.oldest.is_none_or(|o| admitted < o) {
            self.oldest = Some(admitted);
        }
    }

    /// Records what an outcome says of the provider (`crate::resilience::outlier`): a
    /// success is counted here and told with the read's others, a fault at once (after
    /// the successes before it).
    pub fn judge(&mut self, verdict: Verdict) {
        match verdict {
            Verdict::Neutral => {}
            Verdict::Success => self.successes += 1,
            Verdict::Fault => {
                self.tell_successes();
                self.link.outlier.record(Verdict::Fault, self.now);
            }
        }
    }

    /// Tells the outlier detector the successes counted since it was last told.
    fn tell_successes(&mut self) {
        if self.successes > 0 {
            self.link.outlier.succeeded(self.successes, self.now);
            self.successes = 0;
        }
    }

    /// Adds the read's replies answered in place to the provider's outcome counters.
    fn tell_outcomes(&mut self) {
        let metrics = &self.metrics;
        self.outcomes.drain(|status, n| metrics.outcomes(status, n));
    }

    /// Takes an rpcmesh provider's time per call from its heartbeat answer, for the
    /// router's packing (`crate::upstream::pace`). An answer without it (an older provider) leaves
    /// what the pool knows; one that cannot be read is not this check's business (the
    /// round trip is what it checks).
    fn take_reported_pace(&self, body: &[u8]) {
        if let Ok(Some(value)) = Heartbeat::extra_value_in(body, HEARTBEAT_KEY) {
            self.link
                .pace
                .reported(PerCall::parse_heartbeat_value(value));
        }
    }

    /// The call fields a heartbeat answer says the provider takes (`rpcmesh_wire::ext`):
    /// from then on calls on this connection carry their callers' identities (over TLS
    /// only: only a provider that authenticated the broker can believe them) and their
    /// deadlines.
    fn take_call_fields(&self, body: &[u8]) {
        use rpcmesh_wire::ext;
        if let Ok(fields) = Heartbeat::extra_value_in(body, ext::HEARTBEAT_KEY) {
            let takes = |field| fields.is_some_and(|v| ext::takes(v, field));
            let caller = self.settings.tls.is_some() && takes(ext::CALLER_FIELD);
            let relaxed = std::sync::atomic::Ordering::Relaxed;
            self.state.takes_caller.store(caller, relaxed);
            self.state
                .takes_deadline
                .store(takes(ext::DEADLINE_FIELD), relaxed);
            self.state
                .takes_deadline_cap
                .store(takes(ext::DEADLINE_CAP_FIELD), relaxed);
        }
    }

    /// Passes a provider's small, ordinary reply to its caller straight from the read
    /// buffer (the common case: no frame of its own is made) and drops it; true when done.
    /// Anything else (a heartbeat, a late or malformed reply, "unavailable", a large reply
    /// or one whose call holds a memory reservation) is left to [`ConnTask::on_frame`].
    fn answer_in_place(
        &mut self,
        calls: &mut Calls,
        header: &Header,
        read_at: Option<Instant>,
    ) -> bool {
        if header.msg_type != MsgType::Response {
            return false;
        }
        let body = self.io.peeked_body(header);
        if body.len() < MIN_REPLY_BODY
            || body[0] == Status::Unavailable as u8
            || body[0] == Status::Overloaded as u8
        {
            return false;
        }
        // Not a late reply, nor one the session must copy with its call's reservation.
        let Some(mut slot) = calls.table.take_if(header.req_id, |s| {
            copied_at_once(body.len(), s.reserved.is_some())
        }) else {
            return false;
        };
        self.reply_read(&mut slot, read_at);
        let admitted = slot.info.admitted;
        let trailer = Some(self.io.peeked_trailer(header));
        let status = slot
            .reply_to
            .answer_small(header.flags, body, trailer, slot.info);
        let verdict = verdict_of(status, header.flags, body);
        // `settled`, its count told with the read's others.
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.outcomes.add(status);
        self.io.skip_peeked(header);
        self.took(admitted);
        self.judge(verdict);
        true
    }

    /// A timed call's reply was read (`read_at`, stages on): its `upstream` stage is
    /// recorded and the time kept for its `write_back`.
    fn reply_read(&self, slot: &mut Slot, read_at: Option<Instant>) {
        if let (Some(sent), Some(read)) = (slot.sent, read_at) {
            self.metrics.stages.record_span(UPSTREAM, sent, read);
        }
        slot.info.replied = read_at.filter(|_| slot.info.routed.is_some());
    }

    fn on_frame(&mut self, calls: &mut Calls, frame: Frame, read_at: Option<Instant>) {
        match frame.header.msg_type {
            MsgType::Response => {
                let Some(mut slot) = calls.table.take(frame.header.req_id) else {
                    self.metrics
                        .errors
                        .inc(ErrorKind::LateReply, Side::Provider);
                    tracing::debug!(
                        req_id = frame.header.req_id,
                        "reply for no call in flight (late) dropped"
                    );
                    return;
                };
                self.reply_read(&mut slot, read_at);
                self.took(slot.info.admitted);
                let outcome = if frame.body.len() < MIN_REPLY_BODY {
                    let failure = Failure::MalformedReply;
                    failure.count(&self.metrics.errors);
                    self.judge(Verdict::Fault);
                    Err(failure)
                } else {
                    self.judge(verdict_of(
                        status_of(&frame.body),
                        frame.header.flags,
                        &frame.body,
                    ));
                    if frame.body[0] == Status::Overloaded as u8
                        && self.settings.kind == PeerKind::Rpcmesh
                        && slot.kept.is_some()
                    {
                        // Shed by the provider without running it: safe to send to
                        // another, if the budget allows.
                        if self.link.guards.budget.withdraw(self.now) {
                            if let Some(request) = calls.take_request(&mut slot) {
                                return self.hand_back(slot, request, Reroute::Overloaded);
                            }
                        } else {
                            self.metrics.budget_exhausted[Reroute::Overloaded as usize]
                                .increment(1);
                        }
                    }
                    if frame.body[0] == Status::Unavailable as u8 {
                        // The provider is going away: send no more calls here.
                        self.mark_closed();
                        if self.settings.kind == PeerKind::Rpcmesh
                            && frame.header.flags.contains(Flags::NOT_RUN)
                        {
                            // It is draining and did not run the call: none of its
                            // connections takes new calls, and the call goes elsewhere.
                            self.provider_draining();
                            if let Some(request) = calls.take_request(&mut slot) {
                                return self.hand_back(slot, request, Reroute::NotRun);
                            }
                        }
                    }
                    Ok(frame)
                };
                // The reply goes on with the call's reservation: about as large as the
                // request, it stays counted until the session has copied it.
                settle(
                    &self.state,
                    &self.metrics,
                    &slot.reply_to,
                    slot.info,
                    outcome,
                    slot.reserved,
                );
            }
            MsgType::Heartbeat
                if self.settings.kind == PeerKind::Rpcmesh
                    && rpcmesh_wire::ext::is_drain_notice(&frame) =>
            {
                // The provider drains: as after a call it refused `NOT_RUN`, this
                // connection takes no new call and closes once its calls are answered,
                // before the provider closes it.
                self.mark_closed();
                self.provider_draining();
                self.drain_told = true;
            }
            MsgType::Heartbeat => {
                if let Some(i) = self
                    .heartbeats
                    .iter()
                    .position(|(id, _)| *id == frame.header.req_id)
                {
                    // The report first: the check's waiter may publish the connection.
                    if self.settings.kind == PeerKind::Rpcmesh {
                        self.take_reported_pace(&frame.body);
                        self.take_call_fields(&frame.body);
                    }
                    let (_, tx) = self.heartbeats.swap_remove(i);
                    let _ = tx.send(());
                }
            }
            MsgType::Request | MsgType::ExtRequest => {
                self.metrics
                    .errors
                    .inc(ErrorKind::Unexpected, Side::Provider);
                tracing::debug!("request frame from a provider dropped");
            }
        }
    }

    /// Counts and logs (thinned) a frame from the provider that cannot be used. A reply
    /// whose header could be read fails its own call only and the others on this
    /// connection go on; the connection ends on input it cannot get past.
    fn on_bad_frame(&mut self, calls: &mut Calls, e: FrameError) -> Result<(), ConnEnd> {
        self.bad_input.record(&e);
        let Some((id, Some(MsgType::Response))) = e.frame_id() else {
            if e.is_fatal() {
                return Err(ConnEnd::BadFrames(e));
            }
            return Ok(());
        };
        if let FrameError::TooLarge { body_len, max, .. } = e {
            if u64::from(body_len) > u64::from(max) * SKIP_FACTOR {
                return Err(ConnEnd::BadFrames(e));
            }
            self.io.skip(FRAME_OVERHEAD + body_len as usize);
        }
        // Counted above, as the frame error it is.
        if let Some(slot) = calls.table.take(id) {
            let failure = Failure::ReplyRefused {
                provider: self.settings.label.clone(),
                error: e,
            };
            self.judge(Verdict::Fault);
            settle(
                &self.state,
                &self.metrics,
                &slot.reply_to,
                slot.info,
                Err(failure),
                None,
            );
        }
        Ok(())
    }

    /// The provider refused a call with `NOT_RUN`: the whole pool is out of the routing
    /// until a connection made after this proves healthy (the provider restarted).
    fn provider_draining(&self) {
        if self.link.mark_draining() {
            tracing::warn!(provider = %self.settings.label, "provider draining: no new calls until it is back; the calls it refused go to other providers");
        }
    }

    /// Hands a call the provider did not run back to its session with its request frame,
    /// to be routed again. The provider's refusal counts as its answer (`unavailable`) in
    /// this provider's outcomes; the call's own outcome is still to come.
    fn hand_back(&mut self, slot: Slot, request: Frame, why: Reroute) {
        let status = match why {
            Reroute::Overloaded => Status::Overloaded,
            Reroute::NotRun | Reroute::Unsent | Reroute::Lost => Status::Unavailable,
        };
        settled(&self.state, &self.metrics, status);
        slot.hand_back(request, why, self.link.id);
    }

    /// A call written on this connection was lost with it (`failure`): when it is marked
    /// idempotent, its request is still held (`request`, taken from where it was kept),
    /// it has tries and time left and the retry budget grants one, it goes back to its
    /// session to be sent to another provider (the loss still counts against this
    /// provider); else it is answered with the failure.
    pub fn lose_slot(&self, slot: Slot, request: Option<Frame>, failure: Failure) {
        let now = Instant::now();
        let retry = slot.idempotent
            && request.is_some()
            && slot.retries < crate::session::MAX_RETRIES
            && now < slot.deadline;
        if retry {
            if self.link.guards.budget.withdraw(now) {
                if let Some(request) = request {
                    self.link.outlier.record(Verdict::Fault, now);
                    settled(&self.state, &self.metrics, failure.status());
                    slot.hand_back(request, Reroute::Lost, self.link.id);
                    return;
                }
            } else {
                self.metrics.budget_exhausted[Reroute::Lost as usize].increment(1);
            }
        }
        self.fail_slot(slot, failure);
    }

    /// Answers a call taken off the table with a failure of the broker's own making, and
    /// judges the provider by it: a lost connection is its fault, and so is a timeout at
    /// the broker's own call timeout (one at a deadline the caller set shorter is not);
    /// a timed-out call's wait counts as a slow reply for the balancer.
    pub fn fail_slot(&self, slot: Slot, failure: Failure) {
        let now = Instant::now();
        if let Failure::Timeout { after, .. } = &failure {
            self.link.ewma.observe(*after, now);
        }
        let verdict = failure_verdict(&failure, self.settings.call_timeout);
        self.link.outlier.record(verdict, now);
        fail(
            &self.state,
            &self.metrics,
            &slot.reply_to,
            slot.info,
            failure,
        );
    }
}

/// What a failure of the broker's own making says of the call's provider, with
/// `call_timeout` the broker's own: a lost connection is its fault, and so is a timeout
/// at that call timeout; one at a deadline the caller set shorter is the caller's choice.
pub(crate) fn failure_verdict(failure: &Failure, call_timeout: Duration) -> Verdict {
    match failure {
        // `after` is the deadline the call had.
        Failure::Timeout { after, .. } if *after < call_timeout => Verdict::Neutral,
        f if f.provider_fault() => Verdict::Fault,
        _ => Verdict::Neutral,
    }
}

/// What a provider's answer with `status` says of the provider: "failed" is its fault
/// unless it says the service or method is unknown (the caller's call), "unavailable" is
/// unless it did not run the call (`NOT_RUN`: it drains, and the pool is marked so); the
/// other errors are about the call (bad request, permission denied, a deadline) or a
/// refusal by design (overloaded).
pub(crate) fn verdict_of(status: Status, flags: Flags, body: &[u8]) -> Verdict {
    match status {
        Status::Success => Verdict::Success,
        Status::Failed if names_unknown(body) => Verdict::Neutral,
        Status::Failed => Verdict::Fault,
        Status::Unavailable if flags.contains(Flags::NOT_RUN) => Verdict::Neutral,
        Status::Unavailable => Verdict::Fault,
        Status::Timeout | Status::Overloaded | Status::BadRequest | Status::PermissionDenied => {
            Verdict::Neutral
        }
    }
}

/// Longest error reply searched for the words of an unknown service or method (theirs
/// are short; a longer reply is the handler's own).
const NAMES_UNKNOWN_SEARCH: usize = 1024;

/// True when a "failed" reply says the service or method is unknown, as providers and v1
/// servers word it (`service not found: `, `method not found: `): the caller's mistake.
/// The words are looked for in the body's bytes, which hold the message as it is (an
/// error reply is too small to be compressed).
fn names_unknown(body: &[u8]) -> bool {
    if body.len() > NAMES_UNKNOWN_SEARCH {
        return false;
    }
    let has = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    has(b"service not found: ") || has(b"method not found: ")
}

/// Gives a call taken off this connection its outcome: it is counted by status for this
/// provider, no longer counts against the connection's load, and its session gets the
/// answer (with the call's memory reservation, released once the reply is copied).
fn settle(
    state: &ConnState,
    metrics: &UpstreamMetrics,
    to: &ReplyTx,
    info: CallInfo,
    outcome: Result<Frame, Failure>,
    reserved: Option<Reserved>,
) {
    // The status the caller is given: the provider's, or the broker's own.
    let status = match outcome {
        Ok(frame) => to.answer(frame, info, reserved),
        Err(failure) => {
            let status = failure.status();
            to.send(Reply::Done {
                info,
                outcome: Err(failure),
                reserved,
            });
            status
        }
    };
    settled(state, metrics, status);
}

/// A call has its outcome (`status`, as its caller is given it): it leaves the
/// connection's count of calls in flight and is counted.
fn settled(state: &ConnState, metrics: &UpstreamMetrics, status: Status) {
    state.in_flight.fetch_sub(1, Ordering::Relaxed);
    metrics.outcome(status);
}

/// Settles a call with a failure of the broker's own making, counted in
/// `rpcmesh_errors_total` first.
fn fail(
    state: &ConnState,
    metrics: &UpstreamMetrics,
    to: &ReplyTx,
    info: CallInfo,
    failure: Failure,
) {
    failure.count(&metrics.errors);
    settle(state, metrics, to, info, Err(failure), None);
}
