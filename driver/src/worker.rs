//! One worker: a share of the run's users and the connections they call over, the load
//! generator's engine. The parts it runs live beside it: [`crate::users`] (the request
//! state machine), [`crate::pacer`] (the open-loop schedule), [`crate::connection`] (which
//! target to dial, and when), the slot table of calls in flight
//! (`rpcmesh_common::net::slots`), and [`crate::stats::Books`] (the figures); what the
//! run's workers share is [`crate::shared`]'s.
//!
//! One task per worker runs its users: a reply is matched to its call by request id in the
//! slot table, and the user's next call is encoded straight into the current connection's
//! write buffer in the same round. No task per user, no channel or allocation per call;
//! every call issued in a round leaves in one `write`. Every tick the worker times out
//! calls past the deadline and hands its interval's figures to the shared metrics and the
//! progress line.
//!
//! Rolling restarts cost no failed call while another target is healthy:
//!
//! - A reply flagged `NOT_RUN` (a draining broker or provider did not start the call) is
//!   not an outcome: the call is sent again on the worker's next connection, to the next
//!   target in turn, at most [`MAX_REROUTES`] times, still timed from its first intended
//!   start. The connection that said it is draining takes no more calls; it is kept, and
//!   read, until the calls written on it are answered (at most
//!   [`crate::links::MAX_DRAINING`] at once),
//!   and new calls go to a new connection.
//! - A refused connect or a lost connection moves the worker to the next target at once
//!   (each target keeps its own back-off). Calls lost with a connection after they were
//!   written count as `connection` (they may have run).
//! - A call that finds no connection (between one and the next) is parked, unwritten, and
//!   written as soon as a connection is up; one still parked after the call timeout counts
//!   as `no_connection`. In the open loop, requests due meanwhile wait in the backlog (as
//!   when every slot is busy) and are timed from their intended start, so the wait shows.
//!   When no target can be reached in time the worker gives up: what is parked fails, what
//!   is due is counted not sent.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpcmesh_common::metrics::families::InFlightShare;
use rpcmesh_common::metrics::families::Sampler;
use rpcmesh_common::metrics::{ErrorKind, Side};
use rpcmesh_common::net::connection::{CloseReason, FramedIo, IoEvent};
use rpcmesh_common::net::listener::AcceptObserver;
use rpcmesh_common::net::slots::SlotTable;
use rpcmesh_wire::Status;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::compress::DEFAULT_MAX_INFLATED_LEN;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{DEFAULT_MAX_BODY_LEN, Flags, Frame, MsgType};
use tokio::net::TcpStream;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::connection::Connector;
use crate::links::{Aside, Link, LinkEvent, Links, Patience, Reach};
use crate::metrics::{CALL, CONNECTION_WAIT, DECODE, ENCODE, REQUEST, ROUND_TRIP};
use crate::outcome::{CallOutcome, Loss};
use crate::pacer::{Backlog, Offered};
use crate::stats::{Books, Latency, Tally, Took};
use crate::users::{Finished, Next, Users};
// `lib.rs` names these through the worker.
pub(crate) use crate::shared::{FinishLine, RunShared};

/// How often a worker checks deadlines and hands its figures to the progress line.
const TICK: Duration = Duration::from_millis(100);
/// How many times a call refused unstarted (`NOT_RUN`) is sent again before the refusal
/// counts as its outcome (`unavailable`): one try per other broker of a two- or
/// three-broker deployment, and one more for a provider draining behind a broker. A call
/// refused more often than that finds nothing healthy, and says so.
pub const MAX_REROUTES: u8 = 3;

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

/// What a worker hands back.
#[derive(Debug, Default)]
pub(crate) struct WorkerFigures {
    /// The measured window's figures, by step of the schedule.
    pub steps: Vec<Tally>,
    /// Connection attempts that failed.
    pub connect_failures: u64,
    /// Times a worker went back to its own target after moving away.
    pub returned_home: u64,
    /// Replies that came after their call had timed out.
    pub late_replies: u64,
    /// When the last measured call finished.
    pub last_done: Option<Instant>,
    /// Open loop: how late measured requests that found a free slot started after their
    /// intended time, µs (the pacer's precision).
    pub lag: Latency,
}

impl WorkerFigures {
    /// Adds another worker's figures (the run's are the sum of its workers').
    pub fn add(&mut self, o: &WorkerFigures) {
        if self.steps.len() < o.steps.len() {
            self.steps.resize_with(o.steps.len(), Tally::default);
        }
        for (a, b) in self.steps.iter_mut().zip(&o.steps) {
            a.add(b);
        }
        self.connect_failures += o.connect_failures;
        self.returned_home += o.returned_home;
        self.late_replies += o.late_replies;
        self.last_done = self.last_done.max(o.last_done);
        self.lag.add(&o.lag);
    }
}

/// A call issued and waiting for its outcome (its request id is its key in the table):
/// written on a connection, or parked until there is one.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// When the call was meant to start: its request's intended start for the first call
    /// (every call with `--parallel`), its own start for the next ones. Latency runs from
    /// here, through every re-send.
    intended: Instant,
    /// When the call was issued (the round's time): the uncorrected latency and the call
    /// timeout run from here (a re-send does not move them).
    sent: Instant,
    user: u32,
    /// The measured step it belongs to (`None`: warm-up).
    step: Option<usize>,
    /// The connection it is written on (its serial); `None` while parked.
    link: Option<u32>,
    /// Times it was sent again after a `NOT_RUN` refusal.
    tries: u8,
    /// Stage stamps (stages on only): encoding began, encoding ended, write returned.
    encoding: Option<Instant>,
    encoded: Option<Instant>,
    written: Option<Instant>,
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
pub(crate) async fn run(mut plan: Plan, shared: Arc<RunShared>) -> WorkerFigures {
    let c = &shared.config;
    let mut flags = Flags::NONE;
    if c.ext {
        flags = flags | Flags::EXT_STATUS;
        if c.compression.is_some() {
            flags = flags | Flags::ACCEPT_COMPRESSED;
        }
    }
    let now = Instant::now();
    let open_loop = plan.dues.is_some();
    let targets = std::mem::take(&mut plan.targets);
    let mut w = Worker {
        codec: CallCodec::new(c.compression, DEFAULT_MAX_INFLATED_LEN)
            .timed(shared.metrics.compression.clone()),
        users: Users::new(plan.users, c.fanout, c.parallel, now),
        table: SlotTable::with_capacity(plan.users * c.fanout as usize),
        dues: None,
        open_loop,
        backlog: Backlog::new(plan.backlog),
        flags,
        in_flight_share: InFlightShare::new(shared.metrics.in_flight.clone()),
        round: Vec::new(),
        expired: Vec::new(),
        sampler: shared.metrics.stages.sampler(),
        request_sampler: shared.metrics.stages.sampler(),
        last_read: now,
        links: Links::new(
            Connector::new(targets, plan.first, plan.index),
            Patience {
                until: shared.until,
                after: c.call_timeout,
                stop: shared.stop.clone(),
            },
            now,
        ),
        parked: VecDeque::new(),
        inbox: Vec::new(),
        // The closed loop's users begin once connected; the open loop's requests come from
        // the pacer, connected or not.
        begun: open_loop,
        books: if c.hdr_log.is_some() {
            Books::default().logging()
        } else {
            Books::default()
        },
        late_replies: 0,
        last_done: None,
        lag: Latency::default(),
        shared: shared.clone(),
        plan,
    };
    w.run().await;
    WorkerFigures {
        steps: w.books.steps,
        connect_failures: w.links.connector().failures(),
        returned_home: w.links.connector().returns(),
        late_replies: w.late_replies,
        last_done: w.last_done,
        lag: w.lag,
    }
}

struct Worker {
    plan: Plan,
    shared: Arc<RunShared>,
    codec: CallCodec,
    flags: Flags,
    users: Users,
    /// Calls issued and without an outcome yet, on every connection, and parked.
    table: SlotTable<Slot>,
    /// Open loop: the intended starts of this worker's requests (`None` once the schedule
    /// is over, and in the closed loop).
    dues: Option<UnboundedReceiver<Instant>>,
    /// An open-loop run.
    open_loop: bool,
    /// Open loop: the requests that were due while every slot was busy, or while there was
    /// no connection.
    backlog: Backlog,
    /// This worker's share of the calls-in-flight gauge.
    in_flight_share: InFlightShare,
    /// Ids of the timed calls encoded this round.
    round: Vec<u64>,
    /// Calls past their deadline or lost with a connection, taken out of the table (kept
    /// for its memory).
    expired: Vec<(u64, Slot)>,
    /// Pick the calls and requests whose stages are timed.
    sampler: Sampler,
    request_sampler: Sampler,
    /// When the last read returned (the clock of the byte counts).
    last_read: Instant,
    /// The connections, and the attempt to make one.
    links: Links<FramedIo>,
    /// Ids of calls waiting for a connection, oldest first (bounded by the table: each is
    /// a user's call).
    parked: VecDeque<u64>,
    /// The frames of one read, handled after it (kept for its memory).
    inbox: Vec<Frame>,
    /// Users make requests (closed loop: since the first connection).
    begun: bool,
    books: Books,
    late_replies: u64,
    last_done: Option<Instant>,
    lag: Latency,
}

impl Worker {
    async fn run(&mut self) {
        // On the finish line from the start, so that it counts this worker done however
        // the worker ends.
        let shared = self.shared.clone();
        let runner = shared.finish.runner();
        // Open loop: requests are handed over from now on, connected or not.
        self.dues = self.plan.dues.take();
        if self.open_loop {
            self.users.free_all();
        }
        // The measured window's figures are made before it starts when the warm-up is
        // shorter than PREPARE_AHEAD, else on a tick during the warm-up.
        let now = Instant::now();
        self.books.prepare(self.shared.step_of(now));
        self.books.prepare(self.shared.step_ahead(now));
        // The workers' ticks are spread over the period, not all at once: each holds the
        // thread for tens of µs, and eight together delayed the requests due then by a few
        // hundred (a tail in the pacer's start lag).
        let phase = TICK * self.plan.index as u32 / self.shared.config.connections.max(1) as u32;
        let mut tick = tokio::time::interval_at((Instant::now() + phase).into(), TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.finished() {
            let event = tokio::select! {
                biased;
                due = next_due(&mut self.dues) => Event::Due(due),
                ev = self.links.next_event() => Event::Link(ev),
                _ = tick.tick() => Event::Tick,
            };
            match event {
                Event::Due(Some(due)) => self.on_due(due),
                // The schedule is over.
                Event::Due(None) => self.dues = None,
                Event::Link(LinkEvent::Io(serial, Ok(IoEvent::Read))) => self.on_read(serial),
                Event::Link(LinkEvent::Io(_, Ok(IoEvent::Wrote))) => {}
                Event::Link(LinkEvent::Io(serial, Err(e))) => self.lose(serial, Loss::Socket(e)),
                Event::Link(LinkEvent::Dialed(target, Ok(stream))) => {
                    self.connected(target, stream);
                }
                Event::Link(LinkEvent::Dialed(target, Err(e))) => {
                    let now = Instant::now();
                    let reach = self
                        .links
                        .dial_failed(target, &e, &self.shared.metrics, now);
                    self.reach(reach);
                }
                Event::Tick => self.on_tick(),
            }
            self.flush();
            self.record_written();
            self.count_bytes();
            self.reap();
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
        (self.begun || self.links.gave_up())
            && self.table.is_empty()
            && self.users.active() == 0
            && self.dues.is_none()
            && self.backlog.is_empty()
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
            let free = if self.writable() {
                self.users.take_free()
            } else {
                None
            };
            match free {
                Some(u) => {
                    if step.is_some() {
                        let lag = now.saturating_duration_since(due).as_micros() as u64;
                        self.lag.record_us(lag);
                    }
                    self.start_request(u, due, now);
                }
                None => wait_for_slot(&mut self.backlog, &mut self.books, due, step),
            }
            next = self.dues.as_mut().and_then(|d| d.try_recv().ok());
        }
    }

    /// Open loop, a slot is free: the oldest backlogged request starts on it (once there
    /// is a connection), else it waits for the pacer.
    fn start_backlogged(&mut self, u: usize, now: Instant) {
        let waiting = if self.writable() {
            self.backlog.take()
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

    /// Open loop, just connected: the requests that waited meanwhile start on the free
    /// slots, oldest first.
    fn start_waiting(&mut self, now: Instant) {
        while !self.backlog.is_empty() && self.writable() {
            let Some(u) = self.users.take_free() else {
                return;
            };
            self.start_backlogged(u, now);
        }
    }

    /// No target can be reached in time: requests waiting for a slot, or yet to be handed
    /// over, can no longer be sent; the pacer hands no more to this worker.
    fn abandon(&mut self) {
        for due in self.backlog.drain() {
            self.books.not_sent(self.shared.step_of(due));
        }
        if let Some(mut dues) = self.dues.take() {
            dues.close();
            while let Ok(due) = dues.try_recv() {
                let step = self.shared.step_of(due);
                self.books.due(step);
                self.books.not_sent(step);
            }
        }
    }

    /// What a transition of the connections did to the worker's reach: when it gave up,
    /// so does the worker.
    fn reach(&mut self, reach: Reach) {
        if reach == Reach::GaveUp {
            self.give_up();
        }
    }

    /// No target could be reached in time: the parked calls fail, unwritten; what is due
    /// is not sent; the users start nothing more.
    fn give_up(&mut self) {
        tracing::warn!(
            worker = self.plan.index,
            parked = self.parked.len(),
            "no target reachable in time; this worker stops"
        );
        let now = Instant::now();
        while let Some(id) = self.parked.pop_front() {
            if let Some(slot) = self.table.take(id) {
                self.call_done(slot, CallOutcome::NoConnection, now);
            }
        }
        self.abandon();
    }

    /// A connection to `target` is up: it becomes the current one (a current one to
    /// another target, when this was the way back to the worker's own, is set aside until
    /// its calls are answered), the parked calls are written on it, and the users go on.
    fn connected(&mut self, target: usize, stream: TcpStream) {
        self.shared.metrics.conns.opened();
        let io = FramedIo::new(stream, FrameCodec::new(DEFAULT_MAX_BODY_LEN));
        let aside = self.links.connected(target, io);
        self.set_aside(aside);
        let now = Instant::now();
        for _ in 0..self.parked.len() {
            match self.parked.pop_front() {
                Some(id) => self.send(id),
                None => break,
            }
        }
        if self.open_loop {
            self.start_waiting(now);
        } else if !self.begun {
            self.begun = true;
            for u in 0..self.users.len() {
                if self.shared.may_start(now) {
                    self.books.due(self.shared.step_of(now));
                    self.start_request(u, now, now);
                }
            }
        }
    }

    /// The connection `serial` is gone (`loss`): every call written on it fails (it may
    /// have run); when it was the current one, the worker dials the next target, and the
    /// users' next calls wait for that connection.
    fn lose(&mut self, serial: u32, loss: Loss) {
        if let Some((link, reach)) = self.links.lose(serial, &loss, Instant::now()) {
            self.reach(reach);
            self.lost(link, loss);
        }
    }

    /// `link` was lost (`loss`): it closes, and every call written on it fails.
    fn lost(&mut self, link: Link<FramedIo>, loss: Loss) {
        let serial = link.serial();
        let mut lost = std::mem::take(&mut self.expired);
        self.table.take_where(|s| s.link == Some(serial), &mut lost);
        self.retire(link, loss.close_reason());
        let now = Instant::now();
        for (_, s) in lost.drain(..) {
            self.call_done(s, Loss::OUTCOME, now);
        }
        self.expired = lost;
    }

    /// The connection `serial` refused a call unstarted: it is draining. If it is the
    /// current one, it takes no more calls (it is kept until its calls are answered) and
    /// the worker dials the next target.
    fn draining_link(&mut self, serial: u32) {
        if let Some((aside, reach)) = self.links.drained(serial, Instant::now()) {
            self.reach(reach);
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
        self.count_link(&mut link.io);
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
        let id = frame.header.req_id;
        let ours = self
            .table
            .get_mut(id)
            .is_some_and(|s| s.link == Some(serial));
        let Some(slot) = ours.then(|| self.table.take(id)).flatten() else {
            self.late_replies += 1;
            self.shared
                .metrics
                .errors
                .inc(ErrorKind::LateReply, Side::Server);
            return;
        };
        self.links.settle(serial);
        let decoding = slot.written.map(|_| Instant::now());
        let outcome = match self.codec.view_response(&frame) {
            Ok(r) => {
                self.books.payload_in(slot.step, r.size);
                match r.status {
                    Status::Success => {
                        let content_ok = self.shared.workload.check(r.payload).is_ok();
                        CallOutcome::of_reply(Status::Success, content_ok)
                    }
                    s => CallOutcome::of_reply(s, false),
                }
            }
            Err(_) => CallOutcome::BadReply,
        };
        let not_run = frame.header.flags.contains(Flags::NOT_RUN);
        if not_run && outcome == CallOutcome::Replied(Status::Unavailable) {
            // Not an outcome: the call did not start there. The connection takes no more.
            self.draining_link(serial);
            if slot.tries < MAX_REROUTES {
                self.reroute(slot);
                return;
            }
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
        self.call_done(slot, outcome, now);
    }

    /// Sends `slot`'s call again (it was refused unstarted), keeping its intended start.
    fn reroute(&mut self, slot: Slot) {
        self.books.rerouted(slot.step);
        let id = self.table.insert(Slot {
            link: None,
            tries: slot.tries + 1,
            encoding: None,
            encoded: None,
            written: None,
            ..slot
        });
        self.send(id);
    }

    /// Stamps the calls written this round and records their `connection_wait` stage.
    fn record_written(&mut self) {
        if self.round.is_empty() {
            return;
        }
        let now = Instant::now();
        let stages = &self.shared.metrics.stages;
        // Drained, not taken: the round's buffer is kept for the next round.
        for id in self.round.drain(..) {
            if let Some(slot) = self.table.get_mut(id) {
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
        let mut expired = std::mem::take(&mut self.expired);
        self.table
            .take_where(|s| now.duration_since(s.sent) >= timeout, &mut expired);
        let mut unparked = false;
        for (_, s) in expired.drain(..) {
            let outcome = match s.link {
                Some(serial) => {
                    self.links.settle(serial);
                    CallOutcome::NoReply
                }
                None => {
                    unparked = true;
                    CallOutcome::NoConnection
                }
            };
            self.call_done(s, outcome, now);
        }
        self.expired = expired;
        if unparked {
            let table = &mut self.table;
            self.parked.retain(|&id| table.get_mut(id).is_some());
        }
        self.links.return_home(now);
        self.publish();
    }

    /// Hands the figures since the last tick to the shared metrics and the progress line.
    fn publish(&mut self) {
        if let Some(m) = self.shared.logs.get(self.plan.index) {
            let mut shared = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.books.take_log(&mut shared);
        }
        self.shared.metrics.add(&self.books.interval);
        match self.shared.intervals.get(self.plan.index) {
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
        let written = self.table.len().saturating_sub(self.parked.len());
        self.in_flight_share.report(written);
    }

    /// Moves one connection's byte counts (one about to close).
    fn count_link(&mut self, io: &mut FramedIo) {
        let c = io.take_counts();
        self.shared.metrics.wire.add(c);
        let step = self.shared.step_of(self.last_read);
        self.books.wire(step, c.bytes_written, c.bytes_read);
    }

    /// User `u` starts, at `now`, a request meant to start at `intended` (the same instant
    /// in the closed loop); it is measured when that instant is in the measured window.
    fn start_request(&mut self, u: usize, intended: Instant, now: Instant) {
        let step = self.shared.step_of(intended);
        let timed = self.request_sampler.pick();
        let calls = self.users.start(u, intended, now, step, timed);
        for _ in 0..calls {
            self.issue_call(u, intended, step, now);
        }
    }

    /// Issues a call of user `u`'s request, which belongs to `step` (the request's).
    fn issue_call(&mut self, u: usize, intended: Instant, step: Option<usize>, now: Instant) {
        let id = self.table.insert(Slot {
            intended,
            sent: now,
            user: u as u32,
            step,
            link: None,
            tries: 0,
            encoding: None,
            encoded: None,
            written: None,
        });
        // Sent, whether or not it encodes or finds a connection: every call sent gets
        // exactly one outcome.
        self.books.sent(step);
        self.send(id);
    }

    /// Whether new calls can be written now (there is a current connection, and it is not
    /// ending).
    fn writable(&self) -> bool {
        self.links.is_writable()
    }

    /// Writes call `id` on the current connection, or parks it until there is one.
    fn send(&mut self, id: u64) {
        let Some(link) = self.links.writable() else {
            self.parked.push_back(id);
            return;
        };
        let Some(slot) = self.table.get_mut(id) else {
            return;
        };
        let encoding = self.sampler.stamp();
        let encoded = self
            .shared
            .workload
            .encode(&mut self.codec, link.io.wbuf(), id, self.flags);
        match encoded {
            Ok(size) => {
                link.carry();
                slot.link = Some(link.serial());
                slot.encoding = encoding;
                if let Some(a) = encoding {
                    let b = Instant::now();
                    self.shared.metrics.stages.record_span(ENCODE, a, b);
                    slot.encoded = Some(b);
                    self.round.push(id);
                }
                self.books.payload_out(slot.step, size);
            }
            Err(e) => {
                tracing::error!(error = %e, "request not encodable");
                if let Some(slot) = self.table.take(id) {
                    self.call_done(slot, CallOutcome::Encode, Instant::now());
                }
            }
        }
    }

    /// A call has its outcome: count it, and move its user on.
    fn call_done(&mut self, slot: Slot, outcome: CallOutcome, now: Instant) {
        // The progress line shows the warm-up too; the report only what is measured.
        let took = Took::between(slot.intended, slot.sent, now, self.open_loop);
        self.books.call(slot.step, outcome, took);
        if slot.step.is_some() {
            self.last_done = Some(now);
        }
        let u = slot.user as usize;
        match self
            .users
            .call_done(u, outcome.is_ok(), !self.links.gave_up())
        {
            // The request's next call is meant to start now: its predecessor ended.
            Next::Call => self.issue_call(u, now, slot.step, now),
            Next::Wait => {}
            Next::Done(request) => self.request_done(u, request, now),
        }
    }

    fn request_done(&mut self, u: usize, request: Finished, now: Instant) {
        let open_loop = self.open_loop;
        let took = Took::between(request.intended, request.started, now, open_loop);
        if request.timed {
            let stages = &self.shared.metrics.stages;
            stages.record_span(REQUEST, request.started, now);
        }
        self.books.request(request.step, request.failed, took);
        if open_loop {
            // The slot takes the oldest backlogged request, or waits for the pacer.
            self.start_backlogged(u, now);
        } else if !self.links.gave_up() && self.shared.may_start(now) {
            self.books.due(self.shared.step_of(now));
            self.start_request(u, now, now);
        }
    }
}

/// Open loop: a request due while no slot can take it waits in the backlog, or, beyond
/// its bound, is not sent.
fn wait_for_slot(backlog: &mut Backlog, books: &mut Books, due: Instant, step: Option<usize>) {
    if backlog.offer(due) == Offered::NotSent {
        books.not_sent(step);
    }
}

/// The next intended start handed to this worker (pending for ever in the closed loop,
/// `None` once the schedule is over).
async fn next_due(dues: &mut Option<UnboundedReceiver<Instant>>) -> Option<Instant> {
    match dues {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
