//! One connection and the users that share it: the load generator's engine. The parts it
//! runs live beside it: [`crate::users`] (the request state machine), [`crate::pacer`] (the
//! open-loop schedule), [`crate::connection`] (dialling and reconnecting), the slot table
//! of calls in flight (`rpcmesh_common::net::slots`), and [`crate::stats::Books`] (the
//! figures).
//!
//! One task per connection runs its users: a reply is matched to its call by request id
//! in the slot table, and the user's next call is encoded straight into the connection's
//! write buffer in the same round. No task per user, no channel or allocation per call;
//! every call issued in a round leaves in one `write`. Every tick the worker times out
//! calls past the deadline and hands its interval's figures to the shared metrics and the
//! progress line.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rpcmesh_common::metrics::families::InFlightShare;
use rpcmesh_common::metrics::families::Sampler;
use rpcmesh_common::metrics::{ErrorKind, Side};
use rpcmesh_common::net::connection::{CloseReason, FramedIo, IoEvent};
use rpcmesh_common::net::listener::AcceptObserver;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_common::net::slots::SlotTable;
use rpcmesh_wire::Status;
use rpcmesh_wire::compress::DEFAULT_MAX_INFLATED_LEN;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{Flags, Frame, MsgType};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::DriverConfig;
use crate::connection::Connector;
use crate::metrics::{CALL, CONNECTION_WAIT, DECODE, DriverMetrics, ENCODE, REQUEST, ROUND_TRIP};
use crate::outcome::CallOutcome;
use crate::pacer::{Backlog, Offered};
use crate::stats::{Books, Latency, Tally, Took};
use crate::users::{Finished, Next, Users};
use crate::workload::Workload;

/// How often a worker checks deadlines and hands its figures to the progress line.
const TICK: Duration = Duration::from_millis(100);

/// What all workers of a run share.
#[derive(Debug)]
pub(crate) struct RunShared {
    pub config: DriverConfig,
    pub workload: Workload,
    /// Calls and requests started from here on are measured.
    pub measure_from: Instant,
    /// No request starts after this (duration mode).
    pub until: Option<Instant>,
    /// Measured requests left to start (count mode).
    pub budget: Option<AtomicU64>,
    /// Cancelled to stop starting requests (Ctrl-C).
    pub stop: CancellationToken,
    /// Each worker's figures since the progress line last took them.
    pub intervals: Vec<Mutex<Tally>>,
    /// With `--hdr-log`: each worker's measured figures since the log last took them.
    pub logs: Vec<Mutex<Tally>>,
    /// Metric handles.
    pub metrics: DriverMetrics,
}

impl RunShared {
    /// The measured step that a call or request meant to start at `intended` belongs to;
    /// `None` for the warm-up.
    fn step_of(&self, intended: Instant) -> Option<usize> {
        let since = intended.checked_duration_since(self.measure_from)?;
        Some(
            self.config
                .schedule
                .as_ref()
                .map_or(0, |s| s.step_of(since)),
        )
    }

    /// Whether a new request may start now (claims one from the budget if so).
    pub(crate) fn may_start(&self, now: Instant) -> bool {
        if self.stop.is_cancelled() || self.until.is_some_and(|u| now >= u) {
            return false;
        }
        match &self.budget {
            Some(b) if now >= self.measure_from => b
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok(),
            _ => true,
        }
    }
}

/// What one worker does.
#[derive(Debug)]
pub(crate) struct Plan {
    pub index: usize,
    /// Open loop: the intended starts of this connection's requests, from the run's pacer
    /// (users are then slots, at most that many requests in flight); closed when the
    /// schedule is over. `None`: closed loop.
    pub dues: Option<UnboundedReceiver<Instant>>,
    pub target: String,
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
        self.late_replies += o.late_replies;
        self.last_done = self.last_done.max(o.last_done);
        self.lag.add(&o.lag);
    }
}

/// A call written and waiting for its reply (its request id is its key in the table).
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// When the call was meant to start: its request's intended start for the first call
    /// (every call with `--parallel`), its own start for the next ones. Latency runs from
    /// here.
    intended: Instant,
    /// When the call was issued (the round's time): the uncorrected latency runs from here.
    sent: Instant,
    user: u32,
    /// The measured step it belongs to (`None`: warm-up).
    step: Option<usize>,
    /// Stage stamps (stages on only): encoding began, encoding ended, write returned.
    encoding: Option<Instant>,
    encoded: Option<Instant>,
    written: Option<Instant>,
}

/// Runs one connection's users until the run ends; returns their figures.
pub(crate) async fn run(plan: Plan, shared: Arc<RunShared>) -> WorkerFigures {
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
        connector: Connector::new(plan.target.clone(), plan.index),
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
        connect_failures: w.connector.failures(),
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
    /// Calls in flight on the connection.
    table: SlotTable<Slot>,
    /// Open loop: the intended starts of this connection's requests (`None` once the
    /// schedule is over, and in the closed loop).
    dues: Option<UnboundedReceiver<Instant>>,
    /// An open-loop run.
    open_loop: bool,
    /// Open loop: the requests that were due while every slot was busy.
    backlog: Backlog,
    /// This connection's share of the calls-in-flight gauge.
    in_flight_share: InFlightShare,
    /// Ids of the timed calls encoded this round.
    round: Vec<u64>,
    /// Calls past their deadline, taken out at a tick (kept for its memory).
    expired: Vec<(u64, Slot)>,
    /// Pick the calls and requests whose stages are timed.
    sampler: Sampler,
    request_sampler: Sampler,
    /// When the last read returned (the clock of the byte counts).
    last_read: Instant,
    connector: Connector,
    books: Books,
    late_replies: u64,
    last_done: Option<Instant>,
    lag: Latency,
}

impl Worker {
    async fn run(&mut self) {
        // Open loop: requests are handed over from now on, connected or not.
        self.dues = self.plan.dues.take();
        if self.open_loop {
            self.users.free_all();
        }
        let Some(mut io) = self.connect().await else {
            self.abandon();
            self.publish();
            return;
        };
        let now = Instant::now();
        if self.open_loop {
            self.start_waiting(now, &mut io);
        } else {
            for u in 0..self.users.len() {
                if self.shared.may_start(now) {
                    self.books.due(self.shared.step_of(now));
                    self.start_request(u, now, now, &mut io);
                }
            }
        }
        // The connections' ticks are spread over the period, not all at once: each holds
        // the thread for tens of µs, and eight together delayed the requests due then by a
        // few hundred (a tail in the pacer's start lag).
        let phase = TICK * self.plan.index as u32 / self.shared.config.connections.max(1) as u32;
        let mut tick = tokio::time::interval_at((now + phase).into(), TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.table.is_empty() && self.users.active() == 0 && self.dues.is_none() {
                break;
            }
            let failed = tokio::select! {
                biased;
                due = next_due(&mut self.dues) => {
                    match due {
                        Some(due) => self.on_due(due, &mut io),
                        // The schedule is over.
                        None => self.dues = None,
                    }
                    None
                }
                ev = io.wait_io(true) => match ev {
                    Ok(IoEvent::Read) => self.take_frames(&mut io).err(),
                    Ok(IoEvent::Wrote) => None,
                    Err(e) => Some(format!("socket: {e}")),
                },
                _ = tick.tick() => {
                    self.on_tick(&mut io);
                    None
                }
            };
            let failed = failed.or_else(|| io.try_flush().err().map(|e| format!("write: {e}")));
            self.record_written();
            self.count_bytes(&mut io);
            if let Some(cause) = failed {
                tracing::debug!(worker = self.plan.index, %cause, "connection lost");
                let reason = if io.is_eof() {
                    CloseReason::Peer
                } else {
                    CloseReason::Error
                };
                self.shared.metrics.conns.closed(reason);
                match self.reconnect(cause).await {
                    Some(new) => io = new,
                    None => {
                        self.publish();
                        return;
                    }
                }
            }
        }
        self.shared.metrics.conns.closed(CloseReason::Local);
        self.publish();
    }

    /// Open loop: starts the request due at `due` (and every other one already handed
    /// over) on a free slot. One due while every slot is busy waits in the backlog
    /// (bounded) and starts when a slot frees, still timed from its intended start; beyond
    /// the backlog it is not sent, and counted. How late a request that found a free slot
    /// started is the pacer's lag.
    fn on_due(&mut self, due: Instant, io: &mut FramedIo) {
        let now = Instant::now();
        let mut next = Some(due);
        while let Some(due) = next {
            let step = self.shared.step_of(due);
            self.books.due(step);
            match self.users.take_free() {
                Some(u) => {
                    if step.is_some() {
                        let lag = now.saturating_duration_since(due).as_micros() as u64;
                        self.lag.record_us(lag);
                    }
                    self.start_request(u, due, now, io);
                }
                None => wait_for_slot(&mut self.backlog, &mut self.books, due, step),
            }
            next = self.dues.as_mut().and_then(|d| d.try_recv().ok());
        }
    }

    /// Open loop, a slot is free: the oldest backlogged request starts on it, else it waits
    /// for the pacer.
    fn start_backlogged(&mut self, u: usize, now: Instant, io: &mut FramedIo) {
        match self.backlog.take() {
            Some(due) => {
                self.books.backlogged(self.shared.step_of(due));
                self.start_request(u, due, now, io);
            }
            None => self.users.release(u),
        }
    }

    /// Open loop, just connected: the requests that waited meanwhile start on the free
    /// slots, oldest first.
    fn start_waiting(&mut self, now: Instant, io: &mut FramedIo) {
        while !self.backlog.is_empty() {
            let Some(u) = self.users.take_free() else {
                return;
            };
            self.start_backlogged(u, now, io);
        }
    }

    /// The connection is gone for good: requests waiting for a slot, or yet to be handed
    /// over, can no longer be sent; the pacer hands no more to this connection.
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

    /// When to stop trying to connect: the run's end, or one call timeout from now.
    fn give_up_by(&self) -> Instant {
        self.shared
            .until
            .unwrap_or_else(|| Instant::now() + self.shared.config.call_timeout)
    }

    /// Connects; requests due meanwhile wait in the backlog, as when every slot is busy.
    async fn connect(&mut self) -> Option<FramedIo> {
        let give_up = self.give_up_by();
        let connecting = self
            .connector
            .connect(give_up, &self.shared.stop, &self.shared.metrics);
        while_down(
            connecting,
            &mut self.dues,
            &mut self.backlog,
            &mut self.books,
            &self.shared,
        )
        .await
    }

    /// The connection failed: every call on it fails, then the users carry on over a new
    /// connection (or stop, if none can be made in time).
    async fn reconnect(&mut self, cause: String) -> Option<FramedIo> {
        let lost: Vec<Slot> = self.table.drain().map(|(_, s)| s).collect();
        let give_up = self.give_up_by();
        let reconnecting = self.connector.reconnect(
            lost.len(),
            &cause,
            give_up,
            &self.shared.stop,
            &self.shared.metrics,
        );
        let io = while_down(
            reconnecting,
            &mut self.dues,
            &mut self.backlog,
            &mut self.books,
            &self.shared,
        )
        .await;
        let now = Instant::now();
        match io {
            Some(mut io) => {
                for s in lost {
                    self.call_done(s, CallOutcome::Connection, now, Some(&mut io));
                }
                if self.open_loop {
                    self.start_waiting(now, &mut io);
                }
                Some(io)
            }
            None => {
                for s in lost {
                    self.call_done(s, CallOutcome::Connection, now, None);
                }
                self.abandon();
                None
            }
        }
    }

    /// Handles every whole frame read so far.
    fn take_frames(&mut self, io: &mut FramedIo) -> Result<(), String> {
        let now = Instant::now();
        self.last_read = now;
        loop {
            match io.next_frame() {
                Ok(Some(frame)) => self.on_frame(frame, now, io),
                Ok(None) => break,
                Err(e) if !e.is_fatal() => tracing::warn!(error = %e, "bad frame skipped"),
                Err(e) => return Err(format!("bad frames: {e}")),
            }
        }
        if io.is_eof() {
            return Err("closed by peer".into());
        }
        Ok(())
    }

    fn on_frame(&mut self, frame: Frame, now: Instant, io: &mut FramedIo) {
        if frame.header.msg_type != MsgType::Response {
            return;
        }
        self.connector.replied();
        let Some(slot) = self.table.take(frame.header.req_id) else {
            self.late_replies += 1;
            self.shared
                .metrics
                .errors
                .inc(ErrorKind::LateReply, Side::Server);
            return;
        };
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
        if let (Some(decoding), Some(written)) = (decoding, slot.written) {
            let decoded = Instant::now();
            let st = &self.shared.metrics.stages;
            st.record_span(ROUND_TRIP, written, now);
            st.record_span(DECODE, decoding, decoded);
            if let Some(e) = slot.encoding {
                st.record_span(CALL, e, decoded);
            }
        }
        self.call_done(slot, outcome, now, Some(io));
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

    /// Times out the calls past the deadline, then hands the interval's figures on.
    fn on_tick(&mut self, io: &mut FramedIo) {
        let now = Instant::now();
        let timeout = self.shared.config.call_timeout;
        let mut expired = std::mem::take(&mut self.expired);
        self.table
            .take_where(|s| now.duration_since(s.sent) >= timeout, &mut expired);
        for (_, s) in expired.drain(..) {
            self.call_done(s, CallOutcome::NoReply, now, Some(io));
        }
        self.expired = expired;
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

    fn count_bytes(&mut self, io: &mut FramedIo) {
        let c = io.take_counts();
        self.shared.metrics.wire.add(c);
        self.in_flight_share.report(self.table.len());
        let step = self.shared.step_of(self.last_read);
        self.books.wire(step, c.bytes_written, c.bytes_read);
    }

    /// User `u` starts, at `now`, a request meant to start at `intended` (the same instant
    /// in the closed loop); it is measured when that instant is in the measured window.
    fn start_request(&mut self, u: usize, intended: Instant, now: Instant, io: &mut FramedIo) {
        let step = self.shared.step_of(intended);
        let timed = self.request_sampler.pick();
        let calls = self.users.start(u, intended, now, step, timed);
        for _ in 0..calls {
            self.issue_call(u, intended, step, now, io);
        }
    }

    /// Sends a call of user `u`'s request, which belongs to `step` (the request's).
    fn issue_call(
        &mut self,
        u: usize,
        intended: Instant,
        step: Option<usize>,
        now: Instant,
        io: &mut FramedIo,
    ) {
        let encoding = self.sampler.stamp();
        let id = self.table.insert(Slot {
            intended,
            sent: now,
            user: u as u32,
            step,
            encoding,
            encoded: None,
            written: None,
        });
        let encoded = self
            .shared
            .workload
            .encode(&mut self.codec, io.wbuf(), id, self.flags);
        // Sent, whether or not it encodes: every call sent gets exactly one outcome.
        self.books.sent(step);
        match encoded {
            Ok(size) => {
                if let Some(a) = encoding {
                    let b = Instant::now();
                    self.shared.metrics.stages.record_span(ENCODE, a, b);
                    if let Some(slot) = self.table.get_mut(id) {
                        slot.encoded = Some(b);
                    }
                    self.round.push(id);
                }
                self.books.payload_out(step, size);
            }
            Err(e) => {
                tracing::error!(error = %e, "request not encodable");
                if let Some(slot) = self.table.take(id) {
                    self.call_done(slot, CallOutcome::Encode, now, Some(io));
                }
            }
        }
    }

    /// A call has its outcome: count it, and move its user on.
    fn call_done(
        &mut self,
        slot: Slot,
        outcome: CallOutcome,
        now: Instant,
        io: Option<&mut FramedIo>,
    ) {
        // The progress line shows the warm-up too; the report only what is measured.
        let took = Took::between(slot.intended, slot.sent, now, self.open_loop);
        self.books.call(slot.step, outcome, took);
        if slot.step.is_some() {
            self.last_done = Some(now);
        }
        let u = slot.user as usize;
        match self.users.call_done(u, outcome.is_ok(), io.is_some()) {
            Next::Call => {
                if let Some(io) = io {
                    // The request's next call is meant to start now: its predecessor ended.
                    self.issue_call(u, now, slot.step, now, io);
                }
            }
            Next::Wait => {}
            Next::Done(request) => self.request_done(u, request, now, io),
        }
    }

    fn request_done(
        &mut self,
        u: usize,
        request: Finished,
        now: Instant,
        io: Option<&mut FramedIo>,
    ) {
        let open_loop = self.open_loop;
        let took = Took::between(request.intended, request.started, now, open_loop);
        if request.timed {
            let stages = &self.shared.metrics.stages;
            stages.record_span(REQUEST, request.started, now);
        }
        self.books.request(request.step, request.failed, took);
        match io {
            // Open loop: the slot takes the oldest backlogged request, or waits for the
            // pacer.
            Some(io) if open_loop => self.start_backlogged(u, now, io),
            None if open_loop => self.users.release(u),
            Some(io) if self.shared.may_start(now) => {
                self.books.due(self.shared.step_of(now));
                self.start_request(u, now, now, io);
            }
            Some(_) | None => {}
        }
    }
}

/// Waits for `connecting` (a connection being made); requests handed over meanwhile wait
/// in the backlog (bounded) as if every slot were busy, and are counted due.
async fn while_down(
    connecting: impl std::future::Future<Output = Option<FramedIo>>,
    dues: &mut Option<UnboundedReceiver<Instant>>,
    backlog: &mut Backlog,
    books: &mut Books,
    shared: &RunShared,
) -> Option<FramedIo> {
    tokio::pin!(connecting);
    loop {
        tokio::select! {
            io = &mut connecting => return io,
            due = next_due(dues) => match due {
                Some(due) => {
                    let step = shared.step_of(due);
                    books.due(step);
                    wait_for_slot(backlog, books, due, step);
                }
                None => *dues = None,
            },
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

/// The next intended start handed to this connection (pending for ever in the closed loop,
/// `None` once the schedule is over).
async fn next_due(dues: &mut Option<UnboundedReceiver<Instant>>) -> Option<Instant> {
    match dues {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
