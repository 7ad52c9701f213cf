//! One worker: a share of the run's users, their calls, and the connections they call
//! over; the load generator's engine. What it runs lives beside it: [`crate::users`] (the
//! request state machine), [`crate::intake`] (where requests come from: the users, or the
//! pacer's schedule and a backlog), [`crate::calls`] (the calls written or parked),
//! [`crate::links`] (the connections' lifecycle; [`crate::connection`] chooses the
//! targets) and [`crate::stats::Books`] (the figures); what the run's workers share is
//! [`crate::shared`]'s.
//!
//! One task per worker runs its users: a reply is matched to its call by request id, and
//! the user's next call is encoded straight into the current connection's write buffer in
//! the same round. No task per user, no channel or allocation per call; every call issued
//! in a round leaves in one `write`. Every tick the worker times out calls past the
//! deadline and hands its interval's figures to the shared metrics and the progress line.
//!
//! Every call sent has exactly one outcome, and rolling restarts cost no failed call while
//! another target is healthy:
//!
//! - A call that did not run is sent again, within the run's retry budget
//!   (`rpcmesh_common::retry`: a share of the calls plus a floor a second), at most
//!   [`MAX_RETRIES`] times and never past its timeout, still timed from its first intended
//!   start and carrying the time left to it: a reply flagged `NOT_RUN` (a draining broker
//!   or provider did not start it: the connection takes no more calls and drains, and the
//!   call goes on the next connection, to the next target in turn); a call lost with its
//!   connection before it was written (it was still in the write buffer: it goes on the
//!   next connection); an "overloaded" answer, when the run has another target and the
//!   worker has been on this one for [`SHED_MOVE_SPACING`] (the worker leaves the target
//!   that shed it, as from a draining one). With `--idempotent` naming the calls, one lost
//!   with its connection after it was written is sent again too. A retry the budget
//!   refuses is counted, and the call ends as it came.
//! - A refused connect or a lost connection moves the worker to the next target at once
//!   (each target keeps its own back-off). Calls lost with a connection after they were
//!   written count as `connection` (they may have run) unless sent again.
//! - On a connection whose target takes the deadline (`crate::connection`), each call is
//!   written with the time left to it (from its issue, the call timeout, less any time
//!   parked or re-sent): a broker or provider then drops it unstarted once its caller has
//!   given up on it, instead of running it for nobody.
//! - A call that finds no connection (between one and the next) is parked, unwritten, and
//!   written as soon as a connection is up; one still parked after the call timeout counts
//!   as `no_connection`. In the open loop, requests due meanwhile wait in the backlog (as
//!   when every slot is busy) and are timed from their intended start, so the wait shows.
//!   When no target can be reached in time the worker gives up: what is parked fails, what
//!   is due is counted not sent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rpcmesh_common::metrics::families::{InFlightShare, Sampler};
use rpcmesh_common::metrics::{ErrorKind, Side};
use rpcmesh_common::net::connection::{CloseReason, FramedIo, IoEvent};
use rpcmesh_common::net::listener::AcceptObserver;
use rpcmesh_common::retry::RetryReason;
use rpcmesh_wire::compress::DEFAULT_MAX_INFLATED_LEN;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{Flags, Frame, MsgType};
use rpcmesh_wire::{PeerKind, Status};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::calls::{Calls, Place, Slot};
#[cfg(doc)]
use crate::connection::SHED_MOVE_SPACING;
use crate::connection::{CallFields, Connected, Connector, Reach};
use crate::failures::MAX_TEXT_BYTES;
use crate::intake::Intake;
use crate::links::{Aside, Link, LinkEvent, Links, Move, Patience};
use crate::metrics::{CALL, CONNECTION_WAIT, DECODE, ENCODE, REQUEST, ROUND_TRIP};
use crate::outcome::{CallOutcome, Loss};
use crate::stats::{Books, Took};
use crate::users::{Finished, Next, Users};
// `lib.rs` names these through the worker.
pub(crate) use crate::shared::{FinishLine, RunShared};
pub(crate) use crate::stats::WorkerFigures;

/// How often a worker checks deadlines and hands its figures to the progress line.
const TICK: Duration = Duration::from_millis(100);
/// How many times a call is sent again (retried) before its last answer counts as its
/// outcome: one try per other broker of a two- or three-broker deployment, and one more for
/// a provider draining behind a broker. A call refused more often than that finds nothing
/// healthy, and says so. The broker's bound is the same (`broker::MAX_RETRIES`).
pub const MAX_RETRIES: u8 = 3;

/// What one worker does.
#[derive(Debug)]
pub(crate) struct Plan {
    pub index: usize,
    /// Open loop: the intended starts of this worker's requests, from the run's pacer
    /// (users are then slots, at most that many requests in flight); closed when the
    /// schedule is over. `None`: closed loop.
    pub dues: Option<UnboundedReceiver<Instant>>,
    /// Every target of the run (`HOST:PORT`), in the order given.
    pub targets: Vec<String>,
    /// The target it dials first (workers are spread over the targets).
    pub first: usize,
    pub users: usize,
    /// Open loop: how many requests due while every slot is busy wait for one.
    pub backlog: usize,
}

/// Which calls and requests have their stages timed, and the timed calls encoded this
/// round (stamped when the round's write has returned).
#[derive(Debug)]
struct Timing {
    calls: Sampler,
    requests: Sampler,
    round: Vec<u64>,
}

/// What woke the worker.
enum Event {
    /// The pacer handed over a request (`None`: the schedule is over).
    Due(Option<Instant>),
    /// One of the connections did something.
    Link(LinkEvent),
    /// The tick.
    Tick,
}

/// Runs one worker's users until the run ends; returns their figures.
pub(crate) async fn run(plan: Plan, shared: Arc<RunShared>) -> WorkerFigures {
    let c = &shared.config;
    let mut flags = Flags::NONE;
    if c.kind == PeerKind::Rpcmesh {
        flags = flags | Flags::EXT_STATUS;
        if c.compression.is_some() {
            flags = flags | Flags::ACCEPT_COMPRESSED;
        }
    }
    let now = Instant::now();
    let mut users = Users::new(plan.users, c.fanout, c.parallel, now);
    let intake = match plan.dues {
        // Open loop: requests are handed over from now on, connected or not; the users
        // are the slots they take.
        Some(dues) => {
            users.free_all();
            Intake::open(dues, plan.backlog)
        }
        None => Intake::Waiting,
    };
    let patience = Patience {
        until: shared.until,
        after: c.call_timeout,
        stop: shared.stop.clone(),
    };
    let mut w = Worker {
        index: plan.index,
        codec: CallCodec::new(c.compression, DEFAULT_MAX_INFLATED_LEN)
            .timed(shared.metrics.compression.clone()),
        flags,
        fields: CallFields::Plain,
        calls: Calls::with_capacity(plan.users * c.fanout as usize),
        users,
        intake,
        links: Links::new(
            Connector::new(plan.targets, plan.first, plan.index)
                .home_retry(c.home_retry)
                .with_tls(shared.tls.clone())
                .asking(c.kind == PeerKind::Rpcmesh && c.deadline),
            patience,
            now,
        ),
        timing: Timing {
            calls: shared.metrics.stages.sampler(),
            requests: shared.metrics.stages.sampler(),
            round: Vec::new(),
        },
        in_flight_share: InFlightShare::new(shared.metrics.in_flight.clone()),
        last_read: now,
        inbox: Vec::new(),
        reply_text: Vec::new(),
        ended: Vec::new(),
        books: if c.hdr_log.is_some() {
            Books::default().logging()
        } else {
            Books::default()
        },
        figures: WorkerFigures::default(),
        issued: 0,
        shared: shared.clone(),
    };
    w.run().await;
    WorkerFigures {
        steps: w.books.steps,
        connect_failures: w.links.connector().failures(),
        returned_home: w.links.connector().returns(),
        ..w.figures
    }
}

struct Worker {
    /// Its number in the run.
    index: usize,
    shared: Arc<RunShared>,
    codec: CallCodec,
    /// The flags of every request.
    flags: Flags,
    /// What the calls on the current connection carry besides the request.
    fields: CallFields,
    users: Users,
    calls: Calls,
    intake: Intake,
    /// The connections, and the attempt to make one.
    links: Links<FramedIo>,
    timing: Timing,
    /// This worker's share of the calls-in-flight gauge.
    in_flight_share: InFlightShare,
    /// When the last read returned (the clock of the byte counts).
    last_read: Instant,
    /// The frames of one read, handled after it (kept for its memory).
    inbox: Vec<Frame>,
    /// The status text of the error reply being handled (its first bytes, enough for
    /// [`MAX_TEXT_BYTES`] once cleaned; kept for its memory).
    reply_text: Vec<u8>,
    /// Calls past their deadline or lost with a connection, taken out at once and then
    /// given their outcomes (kept for its memory).
    ended: Vec<(u64, Slot)>,
    books: Books,
    /// The figures the books do not keep: late replies, the last measured call's end, the
    /// open loop's start lag.
    figures: WorkerFigures,
    /// Calls issued since the last deposit in the run's retry budget.
    issued: usize,
}

impl Worker {
    async fn run(&mut self) {
        // On the finish line from the start, so that it counts this worker done however
        // the worker ends.
        let shared = self.shared.clone();
        let runner = shared.finish.runner();
        // The measured window's figures are made before it starts when the warm-up is
        // shorter than the preparation's lead, else on a tick during the warm-up.
        let now = Instant::now();
        self.books.prepare(self.shared.step_of(now));
        self.books.prepare(self.shared.step_ahead(now));
        // The workers' ticks are spread over the period, not all at once: each holds the
        // thread for tens of µs, and all together would delay the requests due then (a
        // tail in the pacer's start lag).
        let phase = TICK * self.index as u32 / self.shared.config.connections.max(1) as u32;
        let mut tick = tokio::time::interval_at((Instant::now() + phase).into(), TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.finished() {
            let event = tokio::select! {
                biased;
                due = self.intake.next_due() => Event::Due(due),
                ev = self.links.next_event() => Event::Link(ev),
                _ = tick.tick() => Event::Tick,
            };
            match event {
                Event::Due(Some(due)) => self.on_due(due),
                Event::Due(None) => self.intake.schedule_over(),
                Event::Link(LinkEvent::Io(serial, Ok(IoEvent::Read))) => self.on_read(serial),
                Event::Link(LinkEvent::Io(_, Ok(IoEvent::Wrote))) => {}
                Event::Link(LinkEvent::Io(serial, Err(e))) => self.lose(serial, Loss::Socket(e)),
                Event::Link(LinkEvent::Dialed(target, Ok(connected))) => {
                    self.connected(target, *connected);
                }
                Event::Link(LinkEvent::Dialed(target, Err(e))) => {
                    let now = Instant::now();
                    let moved = self
                        .links
                        .dial_failed(target, &e, &self.shared.metrics, now);
                    self.moved(moved);
                }
                Event::Tick => self.on_tick(),
            }
            self.flush();
            self.record_written();
            self.count_bytes();
            self.reap();
            if self.issued > 0 {
                self.shared.retry.deposit(self.issued, Instant::now());
                self.issued = 0;
            }
        }
        // Nothing in flight here any more; the others may still have calls out.
        runner.cross().await;
        for l in self.links.close_all() {
            self.retire(l, CloseReason::Local);
        }
        self.publish();
    }

    /// The worker is done: nothing in flight or parked, no request under way or waiting,
    /// and none to come.
    fn finished(&self) -> bool {
        self.intake.is_over(self.links.reach()) && self.calls.is_empty() && self.users.active() == 0
    }

    /// Open loop: starts the request due at `due` (and every other one already handed
    /// over) on a free slot. One due while every slot is busy, or while there is no
    /// connection, waits in the backlog (bounded) and starts when a slot frees or a
    /// connection is up, still timed from its intended start; beyond the backlog it is not
    /// sent, and counted. How late a request that found a free slot started is the pacer's
    /// lag.
    fn on_due(&mut self, due: Instant) {
        let now = Instant::now();
        let mut next = Some(due);
        while let Some(due) = next {
            let step = self.shared.step_of(due);
            self.books.due(step);
            let free = if self.links.is_writable() {
                self.users.take_free()
            } else {
                None
            };
            match free {
                Some(u) => {
                    if step.is_some() {
                        let lag = now.saturating_duration_since(due).as_micros() as u64;
                        self.figures.lag.record_us(lag);
                    }
                    self.start_request(u, due, now);
                }
                None => self.intake.wait_for_slot(due, step, &mut self.books),
            }
            next = self.intake.try_due();
        }
    }

    /// Open loop, a slot is free: the oldest backlogged request starts on it (once there
    /// is a connection), else it waits for the pacer.
    fn start_backlogged(&mut self, u: usize, now: Instant) {
        let waiting = if self.links.is_writable() {
            self.intake.take_backlogged()
        } else {
            None
        };
        match waiting {
            Some(due) => {
                self.books.backlogged(self.shared.step_of(due));
                self.start_request(u, due, now);
            }
            None => self.users.release(u),
        }
    }

    /// Just connected: the users go on. Open loop: the requests that waited meanwhile
    /// start on the free slots, oldest first. Closed loop: the users begin, on the first
    /// connection.
    fn start_waiting(&mut self, now: Instant) {
        if self.intake.is_open() {
            while self.intake.has_backlog() && self.links.is_writable() {
                let Some(u) = self.users.take_free() else {
                    return;
                };
                self.start_backlogged(u, now);
            }
        } else if self.intake.begin() {
            for u in 0..self.users.len() {
                if self.shared.may_start(now) {
                    self.books.due(self.shared.step_of(now));
                    self.start_request(u, now, now);
                }
            }
        }
    }

    /// After a transition of the connections: when it gave up, so does the worker.
    fn moved(&mut self, moved: Move) {
        if moved == Move::GaveUp {
            self.give_up();
        }
    }

    /// No target could be reached in time: the parked calls fail, unwritten; requests
    /// waiting for a slot, or yet to be handed over, can no longer be sent (the pacer hands
    /// no more to this worker); the users start nothing more.
    fn give_up(&mut self) {
        tracing::warn!(
            worker = self.index,
            parked = self.calls.parked(),
            "no target reachable in time; this worker stops"
        );
        let now = Instant::now();
        while let Some(id) = self.calls.unpark() {
            if let Some(slot) = self.calls.take(id) {
                self.call_done(slot, CallOutcome::NoConnection, now);
            }
        }
        let shared = &self.shared;
        self.intake
            .abandon(&mut self.books, |due| shared.step_of(due));
    }

    /// A connection to `target` is up: it becomes the current one (a current one to
    /// another target, when this was the way back to the worker's own, is set aside until
    /// its calls are answered), the parked calls are written on it, and the users go on.
    fn connected(&mut self, target: usize, connected: Connected) {
        self.shared.metrics.conns.opened();
        self.fields = connected.fields;
        let now = Instant::now();
        let aside = self.links.connected(target, connected.io, now);
        self.set_aside(aside);
        for _ in 0..self.calls.parked() {
            match self.calls.unpark() {
                Some(id) => self.send(id),
                None => break,
            }
        }
        self.start_waiting(now);
    }

    /// The connection `serial` is gone (`loss`): every call written on it fails (it may
    /// have run); when it was the current one, the worker dials the next target, and the
    /// users' next calls wait for that connection.
    fn lose(&mut self, serial: u32, loss: Loss) {
        if let Some((link, moved)) = self.links.lose(serial, &loss, Instant::now()) {
            self.moved(moved);
            self.lost(link, loss);
        }
    }

    /// `link` was lost (`loss`): it closes. Its calls still in the write buffer never left
    /// the worker: they are sent again on the next connection (or, refused a retry, end
    /// `no_connection`: they did not run). Those written fail (they may have run), unless
    /// the calls are idempotent and a retry is granted.
    fn lost(&mut self, link: Link<FramedIo>, loss: Loss) {
        let mut lost = std::mem::take(&mut self.ended);
        self.calls.take_on(link.serial(), &mut lost);
        let written = link.written();
        self.retire(link, loss.close_reason());
        let now = Instant::now();
        for (_, s) in lost.drain(..) {
            let (why, outcome) = if s.at >= written {
                (Some(RetryReason::Unsent), CallOutcome::NoConnection)
            } else {
                let why = self.shared.retry_lost.then_some(RetryReason::Lost);
                (why, Loss::OUTCOME)
            };
            match why {
                Some(why) if self.may_retry(&s, why, now) => self.retry(s, why),
                _ => self.call_done(s, outcome, now),
            }
        }
        self.ended = lost;
    }

    /// Whether `slot`'s call, safe to send again for `why`, is: it has tries and time left,
    /// and the run's retry budget grants one (taken now; a refusal is counted).
    fn may_retry(&mut self, slot: &Slot, why: RetryReason, now: Instant) -> bool {
        let timeout = self.shared.config.call_timeout;
        if slot.tries >= MAX_RETRIES || now.saturating_duration_since(slot.sent) >= timeout {
            return false;
        }
        if self.shared.retry.withdraw(now) {
            return true;
        }
        self.books.retry_refused(slot.step, why);
        false
    }

    /// The connection `serial` refused a call unstarted: its target is draining. If it is
    /// the current one, it takes no more calls (it is kept until its calls are answered)
    /// and the worker dials the next target.
    fn drained(&mut self, serial: u32) {
        if let Some((aside, moved)) = self.links.drained(serial, Instant::now()) {
            self.moved(moved);
            self.set_aside(aside);
        }
    }

    /// Closes a connection that takes no more calls, if it is to close now.
    fn set_aside(&mut self, aside: Aside<FramedIo>) {
        match aside {
            Aside::Kept => {}
            Aside::Close(link) => self.retire(link, CloseReason::Local),
            Aside::Evict(link) => self.lost(link, Loss::TooManyDraining),
        }
    }

    /// Closes `link`, counting its last bytes and why it closed.
    fn retire(&mut self, mut link: Link<FramedIo>, reason: CloseReason) {
        let c = link.io.take_counts();
        self.shared.metrics.wire.add(c);
        let step = self.shared.step_of(self.last_read);
        self.books.wire(step, c.bytes_written, c.bytes_read);
        self.shared.metrics.conns.closed(reason);
    }

    /// Closes the draining connections whose calls are all answered.
    fn reap(&mut self) {
        while let Some(link) = self.links.take_answered() {
            let reason = if link.io.is_eof() {
                CloseReason::Peer
            } else {
                CloseReason::Local
            };
            self.retire(link, reason);
        }
    }

    /// Writes what every connection has to write; loses those whose write fails.
    fn flush(&mut self) {
        let mut from = 0;
        while let Err((at, serial, e)) = self.links.flush(from) {
            self.lose(serial, Loss::Write(e));
            from = at;
        }
    }

    /// Handles every whole frame read so far on the connection `serial`, then its end if
    /// the peer closed it.
    fn on_read(&mut self, serial: u32) {
        let now = Instant::now();
        self.last_read = now;
        let Some(link) = self.links.find(serial) else {
            return;
        };
        let mut fatal = None;
        loop {
            match link.io.next_frame() {
                Ok(Some(frame)) => self.inbox.push(frame),
                Ok(None) => break,
                Err(e) if !e.is_fatal() => tracing::warn!(error = %e, "bad frame skipped"),
                Err(e) => {
                    fatal = Some(e);
                    break;
                }
            }
        }
        let eof = link.io.is_eof();
        // A connection the peer closed takes no call, not even one its last replies would
        // make: it would only be lost with it.
        if eof || fatal.is_some() {
            self.links.ending(serial);
        }
        let mut inbox = std::mem::take(&mut self.inbox);
        if inbox.iter().any(rpcmesh_wire::ext::is_drain_notice) {
            // The target drains: as after a call it refused unstarted, the connection
            // takes no more calls (not even those of the users its replies in this same
            // read free) and closes once its calls are answered.
            self.drained(serial);
        }
        for frame in inbox.drain(..) {
            self.on_frame(frame, serial, now);
        }
        self.inbox = inbox;
        if let Some(e) = fatal {
            self.lose(serial, Loss::BadFrames(e));
        } else if eof {
            self.lose(serial, Loss::ClosedByPeer);
        }
    }

    fn on_frame(&mut self, frame: Frame, serial: u32, now: Instant) {
        if frame.header.msg_type != MsgType::Response {
            return;
        }
        self.links.heard(serial);
        let Some(slot) = self.calls.take_answered(frame.header.req_id, serial) else {
            self.figures.late_replies += 1;
            self.shared
                .metrics
                .errors
                .inc(ErrorKind::LateReply, Side::Server);
            return;
        };
        self.links.settle(serial);
        let decoding = slot.written.map(|_| Instant::now());
        self.reply_text.clear();
        let outcome = match self.codec.view_response(&frame) {
            Ok(r) => {
                self.books.payload_in(slot.step, r.size);
                match r.status {
                    Status::Success => {
                        let content_ok = self.shared.workload.check(r.payload).is_ok();
                        CallOutcome::of_reply(Status::Success, content_ok)
                    }
                    s => {
                        let bound = r.error_msg.len().min(MAX_TEXT_BYTES * 4);
                        self.reply_text.extend_from_slice(&r.error_msg[..bound]);
                        CallOutcome::of_reply(s, false)
                    }
                }
            }
            Err(_) => CallOutcome::BadReply,
        };
        let not_run = frame.header.flags.contains(Flags::NOT_RUN);
        if not_run && outcome == CallOutcome::Replied(Status::Unavailable) {
            // Not an outcome: the call did not start there. The connection takes no more.
            self.drained(serial);
            if self.may_retry(&slot, RetryReason::NotRun, now) {
                return self.retry(slot, RetryReason::NotRun);
            }
        } else if outcome == CallOutcome::Replied(Status::Overloaded)
            && self.links.would_leave_shedding(serial, now)
            && self.may_retry(&slot, RetryReason::Overloaded, now)
        {
            // Shed unstarted: the worker leaves the target that shed it, and the call goes
            // to the next one.
            if let Some((aside, moved)) = self.links.leave_shedding(serial, now) {
                self.moved(moved);
                self.set_aside(aside);
            }
            return self.retry(slot, RetryReason::Overloaded);
        }
        if let (Some(decoding), Some(written)) = (decoding, slot.written) {
            let decoded = Instant::now();
            let st = &self.shared.metrics.stages;
            st.record_span(ROUND_TRIP, written, now);
            st.record_span(DECODE, decoding, decoded);
            if let Some(e) = slot.encoding {
                st.record_span(CALL, e, decoded);
            }
        }
        if !self.reply_text.is_empty() {
            self.books
                .failure_text(slot.step, outcome, &self.reply_text);
        }
        self.call_done(slot, outcome, now);
    }

    /// Sends `slot`'s call again (for `why`, a retry granted), keeping its intended start
    /// and its deadline: on the current connection, or parked for the next.
    fn retry(&mut self, slot: Slot, why: RetryReason) {
        self.books.retried(slot.step, why);
        let id = self.calls.issue(slot.retry());
        self.send(id);
    }

    /// Stamps the calls written this round and records their `connection_wait` stage.
    fn record_written(&mut self) {
        if self.timing.round.is_empty() {
            return;
        }
        let now = Instant::now();
        let stages = &self.shared.metrics.stages;
        // Drained, not taken: the round's buffer is kept for the next round.
        for id in self.timing.round.drain(..) {
            if let Some(slot) = self.calls.get_mut(id) {
                slot.written = Some(now);
                if let Some(e) = slot.encoded {
                    stages.record_span(CONNECTION_WAIT, e, now);
                }
            }
        }
    }

    /// Times out the calls past the deadline (written: `no_reply`; parked: `no_connection`),
    /// then hands the interval's figures on.
    fn on_tick(&mut self) {
        let now = Instant::now();
        self.books.prepare(self.shared.step_ahead(now));
        let timeout = self.shared.config.call_timeout;
        let mut expired = std::mem::take(&mut self.ended);
        self.calls.take_expired(now, timeout, &mut expired);
        for (_, s) in expired.drain(..) {
            let outcome = match s.place {
                Place::On(serial) => {
                    self.links.settle(serial);
                    CallOutcome::NoReply
                }
                Place::Parked => CallOutcome::NoConnection,
            };
            self.call_done(s, outcome, now);
        }
        self.ended = expired;
        self.links.return_home(now);
        self.publish();
    }

    /// Hands the figures since the last tick to the shared metrics and the progress line.
    fn publish(&mut self) {
        if let Some(m) = self.shared.logs.get(self.index) {
            let mut shared = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.books.take_log(&mut shared);
        }
        self.shared.metrics.add(&self.books.interval);
        match self.shared.intervals.get(self.index) {
            Some(m) => {
                let mut shared = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                self.books.take_interval(&mut shared);
            }
            None => self.books.interval.clear(),
        }
    }

    /// Moves every connection's byte counts to the metrics and the figures.
    fn count_bytes(&mut self) {
        let step = self.shared.step_of(self.last_read);
        for l in self.links.iter_mut() {
            let c = l.io.take_counts();
            self.shared.metrics.wire.add(c);
            self.books.wire(step, c.bytes_written, c.bytes_read);
        }
        self.in_flight_share.report(self.calls.written());
    }

    /// User `u` starts, at `now`, a request meant to start at `intended` (the same instant
    /// in the closed loop); it is measured when that instant is in the measured window.
    fn start_request(&mut self, u: usize, intended: Instant, now: Instant) {
        let step = self.shared.step_of(intended);
        let timed = self.timing.requests.pick();
        let calls = self.users.start(u, intended, now, step, timed);
        for _ in 0..calls {
            self.issue_call(u, intended, step, now);
        }
    }

    /// Issues a call of user `u`'s request, which belongs to `step` (the request's).
    fn issue_call(&mut self, u: usize, intended: Instant, step: Option<usize>, now: Instant) {
        let id = self.calls.issue(Slot::new(u, intended, step, now));
        // Sent, whether or not it encodes or finds a connection: every call sent gets
        // exactly one outcome.
        self.books.sent(step);
        self.issued += 1;
        self.send(id);
    }

    /// Writes call `id` on the current connection, or parks it until there is one.
    fn send(&mut self, id: u64) {
        let Some(link) = self.links.writable() else {
            self.calls.park(id);
            return;
        };
        let Some(slot) = self.calls.get_mut(id) else {
            return;
        };
        let encoding = self.timing.calls.stamp();
        let block = match self.fields {
            CallFields::Plain => None,
            CallFields::Deadline => {
                let end = slot.sent + self.shared.config.call_timeout;
                Some(ext::deadline_block(
                    end.saturating_duration_since(Instant::now()),
                ))
            }
        };
        let block = block.as_ref().map_or(&[][..], |b| &b[..]);
        let before = link.io.wbuf().len();
        let encoded =
            self.shared
                .workload
                .encode(&mut self.codec, link.io.wbuf(), id, self.flags, block);
        match encoded {
            Ok(size) => {
                let len = link.io.wbuf().len() - before;
                slot.at = link.carry(len);
                slot.place = Place::On(link.serial());
                slot.encoding = encoding;
                if let Some(a) = encoding {
                    let b = Instant::now();
                    self.shared.metrics.stages.record_span(ENCODE, a, b);
                    slot.encoded = Some(b);
                    self.timing.round.push(id);
                }
                self.books.payload_out(slot.step, size);
            }
            Err(e) => {
                tracing::error!(error = %e, "request not encodable");
                if let Some(slot) = self.calls.take(id) {
                    self.call_done(slot, CallOutcome::Encode, Instant::now());
                }
            }
        }
    }

    /// A call has its outcome: count it, and move its user on.
    fn call_done(&mut self, slot: Slot, outcome: CallOutcome, now: Instant) {
        // The progress line shows the warm-up too; the report only what is measured.
        let took = Took::between(slot.intended, slot.sent, now, self.intake.is_open());
        self.books.call(slot.step, outcome, took);
        if slot.step.is_some() {
            self.figures.last_done = Some(now);
        }
        let u = slot.user as usize;
        match self.users.call_done(u, outcome.is_ok(), self.links.reach()) {
            // The request's next call is meant to start now: its predecessor ended.
            Next::Call => self.issue_call(u, now, slot.step, now),
            Next::Wait => {}
            Next::Done(request) => self.request_done(u, request, now),
        }
    }

    fn request_done(&mut self, u: usize, request: Finished, now: Instant) {
        let open_loop = self.intake.is_open();
        let took = Took::between(request.intended, request.started, now, open_loop);
        if request.timed {
            let stages = &self.shared.metrics.stages;
            stages.record_span(REQUEST, request.started, now);
        }
        self.books.request(request.step, request.failed, took);
        if open_loop {
            // The slot takes the oldest backlogged request, or waits for the pacer.
            self.start_backlogged(u, now);
        } else if self.links.reach() == Reach::Reachable && self.shared.may_start(now) {
            self.books.due(self.shared.step_of(now));
            self.start_request(u, now, now);
        }
    }
}
