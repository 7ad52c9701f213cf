//! One connection and the users that share it: the load generator's engine.
//!
//! Each user is a small state machine (closed loop: one request after another, each
//! request `fanout` calls in a row or at once) run by the connection's own task: a reply
//! is matched to its call by request id in a flat table, and the user's next call is
//! encoded straight into the connection's write buffer in the same round. No task per
//! user, no channel or allocation per call; every call issued in a round leaves in one
//! `write`. Statistics go into the worker's own [`Tally`], and every tick into the shared
//! per-second tally that the progress line reads.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rpcmesh_common::Status;
use rpcmesh_common::call::CallCodec;
use rpcmesh_common::codec::FrameCodec;
use rpcmesh_common::compress::DEFAULT_MAX_INFLATED_LEN;
use rpcmesh_common::frame::{DEFAULT_MAX_BODY_LEN, Flags, Frame, MsgType};
use rpcmesh_common::io::{FramedIo, IoEvent};
use rpcmesh_common::listener::AcceptObserver;
use rpcmesh_common::shutdown::CancellationToken;
use rpcmesh_common::telemetry::{ErrorKind, Sampler};
use tokio::net::TcpStream;

use crate::config::DriverConfig;
use crate::metrics::{CALL, CONNECTION_WAIT, DECODE, DriverMetrics, ENCODE, REQUEST, ROUND_TRIP};
use crate::stats::Tally;
use crate::workload::Workload;

/// How often a worker checks deadlines and hands its figures to the progress line.
const TICK: Duration = Duration::from_millis(100);
/// Timeout of one connection attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// First and longest pause between connection attempts.
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(1);

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
    /// Metric handles.
    pub metrics: DriverMetrics,
}

impl RunShared {
    /// Whether a new request may start now (claims one from the budget if so).
    fn may_start(&self, now: Instant) -> bool {
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

    fn give_up_by(&self) -> Option<Instant> {
        self.until
    }
}

/// What one worker does.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub index: usize,
    /// Open loop: start a request every this long (users are then slots, at most that
    /// many requests in flight). `None`: closed loop.
    pub every: Option<Duration>,
    pub target: String,
    pub users: usize,
}

/// What a worker hands back.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub tally: Tally,
    /// Connection attempts that failed.
    pub connect_failures: u64,
    /// Replies that came after their call had timed out.
    pub late_replies: u64,
    /// When the last measured call finished.
    pub last_done: Option<Instant>,
    /// Open loop: measured requests due that found every slot busy (not started).
    pub not_started: u64,
    /// Open loop: how late measured requests started after their intended time, µs.
    pub lag: crate::stats::Latency,
}

impl Outcome {
    /// Adds another worker's outcome (the run's is the sum of its workers').
    pub fn add(&mut self, o: &Outcome) {
        self.tally.add(&o.tally);
        self.connect_failures += o.connect_failures;
        self.late_replies += o.late_replies;
        self.last_done = self.last_done.max(o.last_done);
        self.not_started += o.not_started;
        self.lag.add(&o.lag);
    }
}

#[derive(Debug, Clone, Copy)]
struct User {
    started: Instant,
    next_call: u32,
    replies: u32,
    failed: bool,
    measured: bool,
    /// The request's stage is timed (a sample of requests is).
    timed: bool,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    id: u64,
    /// When the call was issued (the round's time): latency is measured from here.
    sent: Instant,
    user: u32,
    measured: bool,
    /// Stage stamps (stages on only): encoding began, encoding ended, write returned.
    encoding: Option<Instant>,
    encoded: Option<Instant>,
    written: Option<Instant>,
}

/// Runs one connection's users until the run ends; returns their figures.
pub(crate) async fn run(plan: Plan, shared: Arc<RunShared>) -> Outcome {
    let c = &shared.config;
    let fanout = c.fanout as usize;
    let mut flags = Flags::NONE;
    if c.ext {
        flags = flags | Flags::EXT_STATUS;
        if c.compression.is_some() {
            flags = flags | Flags::ACCEPT_COMPRESSED;
        }
    }
    let now = Instant::now();
    let mut w = Worker {
        codec: CallCodec::new(c.compression, DEFAULT_MAX_INFLATED_LEN)
            .timed(shared.metrics.compression.clone()),
        users: vec![
            User {
                started: now,
                next_call: 0,
                replies: 0,
                failed: false,
                measured: false,
                timed: false,
            };
            plan.users
        ],
        slots: vec![None; plan.users * fanout],
        fanout,
        parallel: c.parallel,
        flags,
        generation: 0,
        in_flight: 0,
        in_flight_reported: 0,
        round: Vec::new(),
        sampler: shared.metrics.stages.sampler(),
        request_sampler: shared.metrics.stages.sampler(),
        active: 0,
        free: Vec::new(),
        next_due: None,
        last_read: now,
        replied_since_connect: false,
        reconnect_pause: RECONNECT_MIN,
        lost_connections: 0,
        out: Outcome::default(),
        interval: Tally::interval(),
        shared: shared.clone(),
        plan,
    };
    w.run().await;
    w.out
}

struct Worker {
    plan: Plan,
    shared: Arc<RunShared>,
    codec: CallCodec,
    users: Vec<User>,
    slots: Vec<Option<Slot>>,
    fanout: usize,
    parallel: bool,
    flags: Flags,
    generation: u32,
    in_flight: usize,
    in_flight_reported: usize,
    out: Outcome,
    /// Figures since the last tick: for the progress line and the shared metrics.
    interval: Tally,
    /// Ids of the timed calls encoded this round.
    round: Vec<u64>,
    /// Pick the calls and requests whose stages are timed.
    sampler: Sampler,
    request_sampler: Sampler,
    /// Users with a request under way.
    active: usize,
    /// Open loop: slots without a request, and when the next request is due (`None` once
    /// no more may start).
    free: Vec<usize>,
    next_due: Option<Instant>,
    /// When the last read returned (the clock of the byte counts).
    last_read: Instant,
    /// The current connection has brought a reply (else losing it counts as a failure).
    replied_since_connect: bool,
    /// Pause before the next reconnection when connections keep dying unanswered.
    reconnect_pause: Duration,
    /// Connections lost so far (for thinning the log).
    lost_connections: u64,
}

impl Worker {
    async fn run(&mut self) {
        let Some(mut io) = self.connect().await else {
            self.publish();
            return;
        };
        let now = Instant::now();
        match self.plan.every {
            None => {
                for u in 0..self.users.len() {
                    if self.shared.may_start(now) {
                        self.start_request(u, now, &mut io);
                    }
                }
            }
            Some(_) => {
                self.free = (0..self.users.len()).rev().collect();
                self.next_due = Some(now);
            }
        }
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let pace = tokio::time::sleep_until(now.into());
        tokio::pin!(pace);
        let mut armed = None;
        loop {
            if self.next_due.is_some() {
                self.start_due(Instant::now(), &mut io);
                // Re-arm the pacing timer only when the next due time moved.
                if self.next_due != armed {
                    if let Some(due) = self.next_due {
                        pace.as_mut().reset(due.into());
                    }
                    armed = self.next_due;
                }
            }
            if self.in_flight == 0 && self.active == 0 && self.next_due.is_none() {
                break;
            }
            let failed = tokio::select! {
                biased;
                ev = io.wait_io(true) => match ev {
                    Ok(IoEvent::Read) => self.take_frames(&mut io).err(),
                    Ok(IoEvent::Wrote) => None,
                    Err(e) => Some(format!("socket: {e}")),
                },
                () = &mut pace, if self.next_due.is_some() => None,
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
                self.shared.metrics.conns.closed();
                match self.reconnect(cause).await {
                    Some(new) => io = new,
                    None => {
                        self.publish();
                        return;
                    }
                }
            }
        }
        self.shared.metrics.conns.closed();
        self.publish();
    }

    /// Open loop: starts every request whose time has come, each on a free slot; one due
    /// while every slot is busy is not started (and counted). Latency is measured from
    /// the actual start; how late that was after the intended time is kept as the lag.
    fn start_due(&mut self, now: Instant, io: &mut FramedIo) {
        let (Some(every), Some(mut due)) = (self.plan.every, self.next_due) else {
            return;
        };
        while due <= now {
            if !self.shared.may_start(due) {
                self.next_due = None;
                return;
            }
            let measured = due >= self.shared.measure_from;
            match self.free.pop() {
                Some(u) => {
                    if measured {
                        let lag = now.saturating_duration_since(due).as_micros() as u64;
                        self.out.lag.record_us(lag);
                    }
                    self.start_request(u, now, io);
                }
                None if measured => self.out.not_started += 1,
                None => {}
            }
            due += every;
        }
        self.next_due = Some(due);
    }

    /// Connects, retrying until the run would end anyway.
    async fn connect(&mut self) -> Option<FramedIo> {
        let mut pause = RECONNECT_MIN;
        let give_up = self.give_up_by();
        loop {
            let error =
                match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.plan.target))
                    .await
                {
                    Ok(Ok(s)) => {
                        self.shared.metrics.conns.opened();
                        self.replied_since_connect = false;
                        return Some(FramedIo::new(s, FrameCodec::new(DEFAULT_MAX_BODY_LEN)));
                    }
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("timed out after {CONNECT_TIMEOUT:?}"),
                };
            self.out.connect_failures += 1;
            self.shared.metrics.errors.inc(ErrorKind::Io);
            // One line per worker and outage; the count goes in the report.
            if self.out.connect_failures == 1 {
                tracing::warn!(worker = self.plan.index, target = %self.plan.target, %error, "connect failed; retrying");
            } else {
                tracing::debug!(worker = self.plan.index, target = %self.plan.target, %error, "connect failed");
            }
            if !self.wait_to_retry(pause, give_up).await {
                return None;
            }
            pause = (pause * 2).min(RECONNECT_MAX);
        }
    }

    /// When to stop trying to connect: the run's end, or one call timeout from now.
    fn give_up_by(&self) -> Instant {
        self.shared
            .give_up_by()
            .unwrap_or_else(|| Instant::now() + self.shared.config.call_timeout)
    }

    /// Sleeps `pause` before another attempt; false, at once, when that would pass
    /// `give_up` or the run is stopping.
    async fn wait_to_retry(&self, pause: Duration, give_up: Instant) -> bool {
        if Instant::now() + pause >= give_up || self.shared.stop.is_cancelled() {
            return false;
        }
        tokio::time::sleep(pause).await;
        true
    }

    /// The connection failed: every call on it fails, then the users carry on over a new
    /// connection (or stop, if none can be made in time).
    ///
    /// A connection that died before bringing any reply counts as a failed attempt, and
    /// the next one waits (doubling up to a second): a server that accepts and closes at
    /// once (a broker at its connection cap does) is not hammered.
    async fn reconnect(&mut self, cause: String) -> Option<FramedIo> {
        let lost: Vec<Slot> = self.slots.iter_mut().filter_map(Option::take).collect();
        self.in_flight = 0;
        self.lost_connections += 1;
        if self.lost_connections <= 3 {
            tracing::warn!(worker = self.plan.index, calls = lost.len(), %cause, "connection lost; reconnecting");
        } else {
            tracing::debug!(worker = self.plan.index, calls = lost.len(), %cause, "connection lost; reconnecting");
        }
        let may_retry = if self.replied_since_connect {
            self.reconnect_pause = RECONNECT_MIN;
            true
        } else {
            self.out.connect_failures += 1;
            let pause = self.reconnect_pause;
            self.reconnect_pause = (pause * 2).min(RECONNECT_MAX);
            self.wait_to_retry(pause, self.give_up_by()).await
        };
        let io = if may_retry {
            self.connect().await
        } else {
            None
        };
        let now = Instant::now();
        match io {
            Some(mut io) => {
                for s in lost {
                    self.call_done(s, Err("connection"), now, Some(&mut io));
                }
                Some(io)
            }
            None => {
                for s in lost {
                    self.call_done(s, Err("connection"), now, None);
                }
                self.active = 0;
                self.next_due = None;
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
        self.replied_since_connect = true;
        let Some(slot) = self.take_slot(frame.header.req_id) else {
            self.out.late_replies += 1;
            self.shared.metrics.errors.inc(ErrorKind::LateReply);
            return;
        };
        let decoding = slot.written.map(|_| Instant::now());
        let outcome = match self.codec.view_response(&frame) {
            Ok(r) => {
                self.interval.payload_in_plain += r.size.plain as u64;
                self.interval.payload_in_wire += r.size.wire as u64;
                if slot.measured {
                    self.out.tally.payload_in_plain += r.size.plain as u64;
                    self.out.tally.payload_in_wire += r.size.wire as u64;
                }
                match r.status {
                    Status::Success => self
                        .shared
                        .workload
                        .check(r.payload)
                        .map_err(|_| "bad_reply"),
                    s => Err(s.label()),
                }
            }
            Err(_) => Err("bad_reply"),
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
            let idx = (id & 0xffff_ffff) as usize;
            if let Some(Some(slot)) = self.slots.get_mut(idx) {
                if slot.id == id {
                    slot.written = Some(now);
                    if let Some(e) = slot.encoded {
                        stages.record_span(CONNECTION_WAIT, e, now);
                    }
                }
            }
        }
    }

    fn take_slot(&mut self, id: u64) -> Option<Slot> {
        let idx = (id & 0xffff_ffff) as usize;
        let entry = self.slots.get_mut(idx)?;
        if entry.is_some_and(|s| s.id == id) {
            self.in_flight -= 1;
            entry.take()
        } else {
            None
        }
    }

    fn on_tick(&mut self, io: &mut FramedIo) {
        let now = Instant::now();
        let timeout = self.shared.config.call_timeout;
        for i in 0..self.slots.len() {
            if let Some(s) = self.slots[i] {
                if now.duration_since(s.sent) >= timeout {
                    self.slots[i] = None;
                    self.in_flight -= 1;
                    self.call_done(s, Err("timeout"), now, Some(io));
                }
            }
        }
        self.publish();
    }

    /// Hands the figures since the last tick to the shared metrics and the progress line.
    fn publish(&mut self) {
        self.shared.metrics.add(&self.interval);
        if let Some(m) = self.shared.intervals.get(self.plan.index) {
            let mut shared = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            shared.add(&self.interval);
        }
        self.interval.clear();
    }

    fn count_bytes(&mut self, io: &mut FramedIo) {
        let c = io.take_counts();
        self.shared.metrics.wire.add(c);
        if self.in_flight != self.in_flight_reported {
            let delta = self.in_flight as f64 - self.in_flight_reported as f64;
            self.shared.metrics.in_flight.increment(delta);
            self.in_flight_reported = self.in_flight;
        }
        if self.last_read >= self.shared.measure_from {
            self.out.tally.wire_out += c.bytes_written;
            self.out.tally.wire_in += c.bytes_read;
        }
    }

    fn start_request(&mut self, u: usize, now: Instant, io: &mut FramedIo) {
        self.active += 1;
        self.users[u] = User {
            started: now,
            next_call: 0,
            replies: 0,
            failed: false,
            measured: now >= self.shared.measure_from,
            timed: self.request_sampler.pick(),
        };
        let calls = if self.parallel { self.fanout } else { 1 };
        for _ in 0..calls {
            self.issue_call(u, now, io);
        }
    }

    fn issue_call(&mut self, u: usize, now: Instant, io: &mut FramedIo) {
        let call = self.users[u].next_call as usize;
        self.users[u].next_call += 1;
        let idx = u * self.fanout + call;
        self.generation = self.generation.wrapping_add(1);
        let id = (u64::from(self.generation) << 32) | idx as u64;
        let measured = now >= self.shared.measure_from;
        let encoding = self.sampler.stamp();
        let m = &self.shared.metrics;
        let encoded = self
            .shared
            .workload
            .encode(&mut self.codec, io.wbuf(), id, self.flags);
        // Sent, whether or not it encodes: every call sent gets exactly one outcome.
        self.interval.sent += 1;
        if measured {
            self.out.tally.sent += 1;
        }
        match encoded {
            Ok(size) => {
                let encoded = encoding.map(|_| Instant::now());
                if let (Some(a), Some(b)) = (encoding, encoded) {
                    m.stages.record_span(ENCODE, a, b);
                    self.round.push(id);
                }
                self.slots[idx] = Some(Slot {
                    id,
                    sent: now,
                    user: u as u32,
                    measured,
                    encoding,
                    encoded,
                    written: None,
                });
                self.in_flight += 1;
                self.interval.payload_out_plain += size.plain as u64;
                self.interval.payload_out_wire += size.wire as u64;
                if measured {
                    self.out.tally.payload_out_plain += size.plain as u64;
                    self.out.tally.payload_out_wire += size.wire as u64;
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "request not encodable");
                let slot = Slot {
                    id,
                    sent: now,
                    user: u as u32,
                    measured,
                    encoding: None,
                    encoded: None,
                    written: None,
                };
                self.call_done(slot, Err("encode"), now, Some(io));
            }
        }
    }

    /// A call has its outcome: count it, and move its user on.
    fn call_done(
        &mut self,
        slot: Slot,
        outcome: Result<(), &'static str>,
        now: Instant,
        io: Option<&mut FramedIo>,
    ) {
        let m = &self.shared.metrics;
        match outcome {
            Err("timeout") => m.errors.inc(ErrorKind::Timeout),
            Err("bad_reply") => m.errors.inc(ErrorKind::Decode),
            Err("connection") => m.errors.inc(ErrorKind::Io),
            _ => {}
        }
        // The progress line shows the warm-up too; the report only what is measured.
        let us = now.saturating_duration_since(slot.sent).as_micros() as u64;
        match outcome {
            Ok(()) => {
                self.interval.ok += 1;
                self.interval.calls.record_us(us);
            }
            Err(kind) => self.interval.error(kind),
        }
        if slot.measured {
            match outcome {
                Ok(()) => {
                    self.out.tally.ok += 1;
                    self.out.tally.calls.record_us(us);
                }
                Err(kind) => self.out.tally.error(kind),
            }
            self.out.last_done = Some(now);
        }
        let u = slot.user as usize;
        let user = &mut self.users[u];
        user.replies += 1;
        user.failed |= outcome.is_err();
        let finished = user.replies as usize == self.fanout;
        let Some(io) = io else {
            // No connection to make the rest of the request's calls on: the request ends
            // here, failed; its unsent calls are not counted as sent.
            if finished || !self.parallel {
                self.users[u].failed = true;
                self.request_done(u, now, None);
            }
            return;
        };
        if finished {
            self.request_done(u, now, Some(io));
        } else if !self.parallel {
            self.issue_call(u, now, io);
        }
    }

    fn request_done(&mut self, u: usize, now: Instant, io: Option<&mut FramedIo>) {
        let user = self.users[u];
        let us = now.saturating_duration_since(user.started).as_micros() as u64;
        let m = &self.shared.metrics;
        if user.timed {
            m.stages.record_span(REQUEST, user.started, now);
        }
        self.interval.requests.record_us(us);
        if user.failed {
            self.interval.requests_failed += 1;
        } else {
            self.interval.requests_ok += 1;
        }
        if user.measured {
            self.out.tally.requests.record_us(us);
            if user.failed {
                self.out.tally.requests_failed += 1;
            } else {
                self.out.tally.requests_ok += 1;
            }
        }
        self.active -= 1;
        if self.plan.every.is_some() {
            // Open loop: the slot waits for the pacer.
            self.free.push(u);
            return;
        }
        if let Some(io) = io {
            if self.shared.may_start(now) {
                self.start_request(u, now, io);
            }
        }
    }
}
