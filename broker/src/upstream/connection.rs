//! One pooled connection to a provider, carrying many calls at once.
//!
//! [`UpstreamConn`] is the handle sessions and the pool hold; behind it one task owns the
//! socket, the write buffer and the in-flight table (upstream request id → caller), so the
//! per-call path takes no lock. The task:
//!
//! - gives each call a fresh request id (slot index + generation), rewrites the header and
//!   copies the body once into its write buffer; everything queued in a round leaves in
//!   one `write`;
//! - matches each reply to its slot and sends it to the caller's session; a reply for no
//!   slot (its call timed out) is dropped and counted;
//! - keeps each call's request frame (a `Bytes` slice of the caller's read buffer, no
//!   copy) in its slot until the reply, for [`REQUEST_RETAIN`] at most: a provider that
//!   is draining answers the calls it did not start "unavailable" with `NOT_RUN`, and
//!   such a call goes back to its session with its frame to be routed to another
//!   provider, while the whole provider is marked draining ([`PoolLink`]);
//! - sweeps the table for calls past their deadline and answers them "timeout";
//! - when the socket fails, answers every call in flight at once with "unavailable" and
//!   the cause, and hands calls it never wrote back to their sessions to be routed again;
//! - when the broker's grace period ends, answers every call in flight "unavailable:
//!   shutting down", so that no caller is left without an answer;
//! - on a plain v1 server's connection, ACKs each read at once while calls are still in
//!   flight there (below).
//!
//! ## Quick ACKs towards plain v1 servers
//!
//! The broker puts several calls on one pooled connection. A plain RPCF v1 server such as
//! the original framework's (`provider --classic` stands for it) answers them one at a time,
//! one `write` per reply, and never sets `TCP_NODELAY`. Nagle's algorithm then holds each
//! reply written while the previous one is still unacknowledged until its ACK arrives. On
//! the broker's side Linux delays that ACK (up to 40 ms, `TCP_DELACK_MIN`) in the hope of
//! sending it with data of its own, and with every other call on the connection waiting
//! for its reply the broker has no data to send there: the server waits for the ACK, the
//! broker for the reply, and the call stalls about 40 ms. Through an L4 proxy each client
//! connection has a server connection of its own, and a client that makes one call at a
//! time never has a second reply queued behind the first, so the stall is the broker's
//! alone (issue 15: 0.75 % of the calls behind such a server).
//!
//! So after every read from a plain v1 server that leaves calls (or a heartbeat) in flight
//! on the connection, the task asks the kernel for an immediate ACK
//! ([`FramedIo::quick_ack`], `TCP_QUICKACK`). Linux does not keep that setting: it leaves
//! quick-ACK mode by itself once the connection looks interactive again, so it is asked
//! again after each such read. It costs one `setsockopt` per read and, at most, one pure
//! ACK segment per reply; a read that leaves nothing in flight needs none (the next
//! request carries the ACK). rpcmesh providers set `TCP_NODELAY` and are never asked:
//! their connections take no extra system call. Figures: docs/performance.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rpcmesh_common::metrics::{BadInputLog, ErrorKind, Side};
use rpcmesh_common::net::budget::{MemoryBudget, Reserved};
use rpcmesh_common::net::busy_poll::Activity;
use rpcmesh_common::net::connection::{CloseReason, FramedIo, IoEvent};
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_common::net::slots::SlotTable;
use rpcmesh_common::net::thinned::Thinned;
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::frame::{FRAME_OVERHEAD, Flags, Frame, FrameError, Header, MsgType, put_frame};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use rpcmesh_common::net::listener::AcceptObserver;

use crate::call::{CallInfo, Forward, Reply, ReplyTx, Reroute};
use crate::failure::Failure;
use crate::metrics::{QUEUE, UPSTREAM, UpstreamMetrics};
use crate::upstream::{PoolLink, UpstreamError};

/// Commands taken from the queue per round before the socket is served again: enough to
/// batch a burst into one write, few enough that replies are not held back by a flood.
const COMMAND_BATCH: usize = 512;
/// Times the task lets the other ready tasks run before writing, while each turn brings
/// more calls: sessions woken by the same poll add theirs and one write carries them all
/// (measured: about half the upstream writes of writing at once, for one extra poll).
const GATHER_YIELDS: usize = 4;
/// How far past the frame limit a provider's reply may be and still be skipped (failing
/// its call alone); beyond that the length is taken for garbage and the connection ends.
const SKIP_FACTOR: u64 = 4;
/// Finest and coarsest interval of the deadline sweep (it runs at a twentieth of the call
/// timeout, within these bounds): timeouts fire at most this late.
const SWEEP_MIN: Duration = Duration::from_millis(1);
const SWEEP_MAX: Duration = Duration::from_millis(100);
/// How long a call's request frame is kept in its slot after the call was admitted, so
/// that a `NOT_RUN` refusal can be routed elsewhere. A draining provider refuses a call as
/// soon as it reads it, so the refusal comes one round trip after the write unless the
/// provider had stopped reading; a second covers any pause of a live provider. Bounded
/// because a small frame shares (and keeps alive) the 64 KiB read buffer it was read
/// into: a call held by a slow provider must not pin it for the whole call timeout. A
/// refusal that comes later is passed on to the caller (with `NOT_RUN` if it takes
/// extended statuses, so a driver may send it to another broker).
pub(crate) const REQUEST_RETAIN: Duration = Duration::from_secs(1);

/// The process's budget of lost-connection log lines (a provider that accepts and closes
/// at once loses a connection per reconnect).
static LOST_LINES: Thinned = Thinned::new();
/// The process's budget of "quick ACK refused" log lines (one per connection at most).
static QUICK_ACK_LINES: Thinned = Thinned::new();

/// Why a call could not be queued on this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The connection is at its in-flight cap.
    Full,
    /// The connection is closed or closing.
    Closed,
}

/// Settings of an upstream connection.
#[derive(Debug, Clone)]
pub(crate) struct ConnSettings {
    pub label: Arc<str>,
    pub ext: bool,
    /// ACK each read at once while calls are in flight (plain v1 servers: see the module
    /// doc).
    pub quick_ack: bool,
    pub max_body_len: u32,
    pub max_in_flight: usize,
    pub call_timeout: Duration,
    /// Reads are reported here when the broker busy-polls.
    pub activity: Option<Arc<Activity>>,
    /// Cancelled when the broker's grace period ends.
    pub grace_over: CancellationToken,
    /// The broker's budget of buffered bytes (this connection's buffers count in it).
    pub budget: Arc<MemoryBudget>,
}

/// State shared by the handle and the task.
#[derive(Debug, Default)]
struct ConnState {
    in_flight: AtomicUsize,
    closed: AtomicBool,
}

enum Command {
    Call(Forward),
    Heartbeat(oneshot::Sender<()>),
}

/// The handle of one upstream connection. Dropping the last handle lets the task finish
/// the calls in flight and close the socket.
#[derive(Debug)]
pub(crate) struct UpstreamConn {
    /// Unique per provider, in the order the connections were made.
    id: u64,
    tx: mpsc::UnboundedSender<Command>,
    state: Arc<ConnState>,
    cap: usize,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Call(c) => write!(f, "Call({})", c.info.client_id),
            Command::Heartbeat(_) => f.write_str("Heartbeat"),
        }
    }
}

impl UpstreamConn {
    /// Connects and starts the connection's task. The pool's `link` is notified when the
    /// connection fails or the provider says it is draining, so the pool acts at once.
    pub async fn connect(
        addr: &str,
        id: u64,
        settings: ConnSettings,
        metrics: UpstreamMetrics,
        link: Arc<PoolLink>,
        connect_timeout: Duration,
    ) -> Result<UpstreamConn, UpstreamError> {
        let stream = tokio::time::timeout(connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| UpstreamError::ConnectTimeout(connect_timeout))?
            .map_err(UpstreamError::Connect)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let state = Arc::new(ConnState::default());
        let span = tracing::debug_span!("upstream", provider = %settings.label, conn = id);
        let cap = settings.max_in_flight;
        let sweep = (settings.call_timeout / 20).clamp(SWEEP_MIN, SWEEP_MAX);
        let task = ConnTask {
            io: FramedIo::new(stream, FrameCodec::new(settings.max_body_len))
                .with_activity(settings.activity.clone())
                .with_budget(Some(settings.budget.clone())),
            rx,
            state: state.clone(),
            table: SlotTable::default(),
            heartbeats: Vec::new(),
            next_heartbeat_id: 1,
            quick_ack: settings.quick_ack,
            round: Vec::new(),
            written_now: 0,
            bad_input: BadInputLog::new(metrics.errors.clone(), Side::Provider),
            settings,
            metrics,
            link,
        };
        tracing::debug!(parent: &span, "connected");
        task.link.task_started();
        tokio::spawn(task.run(sweep).instrument(span));
        Ok(UpstreamConn { id, tx, state, cap })
    }

    /// Queues a call. On refusal the call is handed back untouched.
    // A refused call is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    pub fn try_forward(&self, fwd: Forward) -> Result<(), (Forward, Refused)> {
        if self.state.closed.load(Ordering::Relaxed) {
            return Err((fwd, Refused::Closed));
        }
        if self.state.in_flight.fetch_add(1, Ordering::Relaxed) >= self.cap {
            self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err((fwd, Refused::Full));
        }
        self.tx.send(Command::Call(fwd)).map_err(|e| {
            self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
            match e.0 {
                Command::Call(fwd) => (fwd, Refused::Closed),
                Command::Heartbeat(_) => unreachable!("a call was sent"),
            }
        })
    }

    /// A heartbeat round trip, for the pool's health check.
    pub async fn heartbeat(&self, timeout: Duration) -> Result<(), UpstreamError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::Heartbeat(tx))
            .map_err(|_| UpstreamError::Closed)?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(UpstreamError::Closed),
            Err(_) => Err(UpstreamError::HeartbeatTimeout(timeout)),
        }
    }

    /// Takes the connection out of service: no new call is queued on it (those in flight
    /// finish or time out). For a connection that failed its health check. It sets the
    /// same `closed` flag a failure sets, so a later real failure of the retired
    /// connection no longer notifies the keeper, which has already let it go.
    pub fn retire(&self) {
        self.state.closed.store(true, Ordering::Relaxed);
    }

    /// True once the connection failed or was closed.
    pub fn is_closed(&self) -> bool {
        self.state.closed.load(Ordering::Relaxed)
    }

    /// The connection's number: unique per provider, in the order they were made.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Calls queued or in flight on this connection.
    pub fn load(&self) -> usize {
        self.state.in_flight.load(Ordering::Relaxed)
    }
}

/// A call written upstream and waiting for its reply (its request id is its key in the
/// connection's [`SlotTable`]).
struct Slot {
    info: CallInfo,
    reply_to: ReplyTx,
    deadline: Instant,
    /// When the write that carried it returned (stages on only).
    sent: Option<Instant>,
    /// A large call's bytes, counted against the memory budget until its reply is in the
    /// caller's write buffer (or it fails).
    reserved: Option<Reserved>,
    /// The caller's request frame, to route the call elsewhere if the provider refuses it
    /// `NOT_RUN` (rpcmesh providers only; dropped after [`REQUEST_RETAIN`]).
    request: Option<Frame>,
    /// Times the call was handed back and routed again before.
    retries: u8,
}

struct ConnTask {
    io: FramedIo,
    rx: mpsc::UnboundedReceiver<Command>,
    state: Arc<ConnState>,
    /// Calls written and waiting for their reply, by upstream request id.
    table: SlotTable<Slot>,
    heartbeats: Vec<(u64, oneshot::Sender<()>)>,
    next_heartbeat_id: u64,
    /// ACK reads at once while calls are in flight (see the module doc); turned off on
    /// this connection if the kernel refuses it.
    quick_ack: bool,
    /// Ids of the timed calls written this round.
    round: Vec<u64>,
    /// Calls put in the write buffer this round.
    written_now: usize,
    settings: ConnSettings,
    metrics: UpstreamMetrics,
    /// What this connection shares with its pool.
    link: Arc<PoolLink>,
    /// Bad frames from the provider: counted, and logged thinned.
    bad_input: BadInputLog,
}

impl ConnTask {
    async fn run(mut self, sweep: Duration) {
        let mut sweeper = tokio::time::interval(sweep);
        sweeper.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut queue_open = true;
        let mut expired = Vec::new();
        let grace = self.settings.grace_over.clone();
        let grace_over = grace.cancelled();
        tokio::pin!(grace_over);
        let mut cut = false;
        let cause: Option<Arc<str>> = loop {
            tokio::select! {
                biased;
                ev = self.io.wait_io(true) => match ev {
                    Ok(IoEvent::Read) => {
                        if let Err(cause) = self.take_frames() {
                            break Some(cause.into());
                        }
                        self.ack_at_once();
                    }
                    Ok(IoEvent::Wrote) => {}
                    Err(e) => break Some(format!("socket error: {e}").into()),
                },
                cmd = self.rx.recv(), if queue_open => match cmd {
                    Some(cmd) => self.on_command(cmd, Instant::now()),
                    // Every handle is gone: finish what is in flight, then close.
                    None => queue_open = false,
                },
                _ = sweeper.tick(), if !self.table.is_empty() || !self.heartbeats.is_empty() => {
                    self.answer_timed_out(&mut expired);
                }
                () = &mut grace_over, if !cut => {
                    cut = true;
                    self.answer_grace_over();
                }
            }
            // Calls queued meanwhile leave in the same write. Before writing, when other
            // calls are in flight on this connection (traffic is concurrent), let every
            // other ready task run: sessions woken by the same poll add their calls, and
            // one write carries them all. A lone call goes out at once.
            self.take_commands();
            let concurrent = self.state.in_flight.load(Ordering::Relaxed) > self.written_now;
            if self.io.pending_write() > 0 && concurrent {
                for _ in 0..GATHER_YIELDS {
                    tokio::task::yield_now().await;
                    if self.take_commands() == 0 {
                        break;
                    }
                }
            }
            if let Err(e) = self.io.try_flush() {
                break Some(format!("write failed: {e}").into());
            }
            self.io.account();
            self.written_now = 0;
            self.record_sent();
            self.metrics.wire.add(self.io.take_counts());
            if !queue_open && self.table.is_empty() {
                break None;
            }
        };
        self.close(cause);
    }

    /// After a read from a plain v1 server: if calls (or a heartbeat) are still in flight
    /// on the connection, the ACK of what was read goes out now instead of up to 40 ms
    /// later, so that a server with Nagle's algorithm on sends its next reply at once (see
    /// the module doc). Counted; a refusal (not expected on Linux) is logged, thinned, and
    /// turns it off for this connection.
    fn ack_at_once(&mut self) {
        if !self.quick_ack || (self.table.is_empty() && self.heartbeats.is_empty()) {
            return;
        }
        match self.io.quick_ack() {
            Ok(()) => self.metrics.quick_acks.increment(1),
            Err(e) => {
                self.quick_ack = false;
                if let Some(a) = QUICK_ACK_LINES.admit() {
                    tracing::warn!(error = %e, refused = a.seen, left_out = a.left_out, "TCP_QUICKACK refused; replies of this plain v1 server may wait for delayed ACKs");
                }
            }
        }
    }

    /// The deadline sweep: every call past its deadline is taken off the table and its
    /// caller answered "timeout" (a reply that comes later finds no slot and is dropped,
    /// counted `late_reply`). Health checks whose waiter gave up are forgotten.
    fn answer_timed_out(&mut self, expired: &mut Vec<(u64, Slot)>) {
        self.heartbeats.retain(|(_, tx)| !tx.is_closed());
        let now = Instant::now();
        self.table.take_where(|s| s.deadline <= now, expired);
        // Requests admitted longer ago than REQUEST_RETAIN are let go.
        if self.settings.ext {
            for s in self.table.values_mut() {
                if s.request.is_some() && now.duration_since(s.info.admitted) > REQUEST_RETAIN {
                    s.request = None;
                }
            }
        }
        for (_, slot) in expired.drain(..) {
            let failure = Failure::Timeout {
                provider: self.settings.label.clone(),
                after: self.settings.call_timeout,
            };
            fail(
                &self.state,
                &self.metrics,
                &slot.reply_to,
                slot.info,
                failure,
            );
        }
    }

    /// The broker's grace period is over: every call in flight here is answered
    /// "unavailable: shutting down" at once, so that its session can answer its caller and
    /// close (a reply that comes later finds no slot and is dropped).
    fn answer_grace_over(&mut self) {
        for (_, slot) in self.table.drain() {
            let failure = Failure::GraceOver;
            fail(
                &self.state,
                &self.metrics,
                &slot.reply_to,
                slot.info,
                failure,
            );
        }
    }

    /// Stamps the calls written this round and records their `queue` stage.
    fn record_sent(&mut self) {
        if self.round.is_empty() {
            return;
        }
        let now = Instant::now();
        for id in self.round.drain(..) {
            if let Some(slot) = self.table.get_mut(id) {
                slot.sent = Some(now);
                if let Some(routed) = slot.info.routed {
                    self.metrics.stages.record_span(QUEUE, routed, now);
                }
            }
        }
    }

    /// Handles the calls queued so far (up to a batch).
    fn take_commands(&mut self) -> usize {
        // One clock read for the batch: deadlines are checked against it.
        let mut now = None;
        for n in 0..COMMAND_BATCH {
            match self.rx.try_recv() {
                Ok(cmd) => {
                    let t = *now.get_or_insert_with(Instant::now);
                    self.on_command(cmd, t);
                }
                Err(_) => return n,
            }
        }
        COMMAND_BATCH
    }

    /// Handles every whole frame read so far.
    fn take_frames(&mut self) -> Result<(), String> {
        let read_at = self.metrics.stages.on().then(Instant::now);
        loop {
            match self.io.next_frame() {
                Ok(Some(frame)) => self.on_frame(frame, read_at),
                Ok(None) => break,
                Err(e) => self.on_bad_frame(e)?,
            }
        }
        if self.io.is_eof() {
            return Err("closed by provider".into());
        }
        Ok(())
    }

    fn on_command(&mut self, cmd: Command, now: Instant) {
        match cmd {
            Command::Call(fwd) => self.write_call(fwd, now),
            Command::Heartbeat(tx) => {
                // Heartbeat ids count down from the top so they never meet call ids.
                let id = u64::MAX - self.next_heartbeat_id;
                self.next_heartbeat_id += 1;
                if Heartbeat::put_now(self.io.wbuf(), id, "broker", "rpcmesh-broker").is_ok() {
                    self.heartbeats.push((id, tx));
                }
            }
        }
    }

    fn write_call(&mut self, fwd: Forward, now: Instant) {
        if now >= fwd.deadline {
            let failure = Failure::TimedOutQueued;
            return fail(&self.state, &self.metrics, &fwd.reply_to, fwd.info, failure);
        }
        let flags = if self.settings.ext {
            // Ask for extended statuses always: the session degrades them for v1 callers,
            // and an "unavailable" from the provider tells the pool it is draining.
            fwd.frame.header.flags | Flags::EXT_STATUS
        } else {
            Flags::NONE
        };
        let frame = fwd.frame;
        let id = self.table.insert(Slot {
            info: fwd.info,
            reply_to: fwd.reply_to,
            deadline: fwd.deadline,
            sent: None,
            reserved: fwd.reserved,
            request: None,
            retries: fwd.retries,
        });
        if fwd.info.routed.is_some() {
            self.round.push(id);
        }
        let header = Header {
            msg_type: MsgType::Request,
            flags,
            body_len: frame.header.body_len,
            req_id: id,
        };
        put_frame(self.io.wbuf(), &header, &frame.body);
        // Only an rpcmesh provider refuses with NOT_RUN: a v1 server's calls keep nothing
        // of the caller's read buffer once written.
        if self.settings.ext {
            if let Some(slot) = self.table.get_mut(id) {
                slot.request = Some(frame);
            }
        }
        self.written_now += 1;
    }

    fn on_frame(&mut self, frame: Frame, read_at: Option<Instant>) {
        match frame.header.msg_type {
            MsgType::Response => {
                let Some(mut slot) = self.table.take(frame.header.req_id) else {
                    self.metrics
                        .errors
                        .inc(ErrorKind::LateReply, Side::Provider);
                    tracing::debug!(
                        req_id = frame.header.req_id,
                        "reply for no call in flight (late) dropped"
                    );
                    return;
                };
                if let (Some(sent), Some(read)) = (slot.sent, read_at) {
                    self.metrics.stages.record_span(UPSTREAM, sent, read);
                }
                slot.info.replied = read_at.filter(|_| slot.info.routed.is_some());
                let outcome = if frame.body.len() < 5 {
                    let failure = Failure::MalformedReply;
                    failure.count(&self.metrics.errors);
                    Err(failure)
                } else {
                    if frame.body[0] == Status::Unavailable as u8 {
                        // The provider is going away: send no more calls here.
                        self.mark_closed();
                        if self.settings.ext && frame.header.flags.contains(Flags::NOT_RUN) {
                            // It is draining and did not run the call: none of its
                            // connections takes new calls, and the call goes elsewhere.
                            self.provider_draining();
                            if let Some(request) = slot.request.take() {
                                return self.hand_back(slot, request);
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
            MsgType::Heartbeat => {
                if let Some(i) = self
                    .heartbeats
                    .iter()
                    .position(|(id, _)| *id == frame.header.req_id)
                {
                    let (_, tx) = self.heartbeats.swap_remove(i);
                    let _ = tx.send(());
                }
            }
            MsgType::Request => {
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
    fn on_bad_frame(&mut self, e: FrameError) -> Result<(), String> {
        self.bad_input.record(&e);
        let Some((id, Some(MsgType::Response))) = e.frame_id() else {
            if e.is_fatal() {
                return Err(format!("bad frames from provider: {e}"));
            }
            return Ok(());
        };
        if let FrameError::TooLarge { body_len, max, .. } = e {
            if u64::from(body_len) > u64::from(max) * SKIP_FACTOR {
                return Err(format!("bad frames from provider: {e}"));
            }
            self.io.skip(FRAME_OVERHEAD + body_len as usize);
        }
        // Counted above, as the frame error it is.
        if let Some(slot) = self.table.take(id) {
            let failure = Failure::ReplyRefused {
                provider: self.settings.label.clone(),
                error: e,
            };
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

    fn mark_closed(&self) {
        if !self.state.closed.swap(true, Ordering::Relaxed) {
            self.link.wake_keeper();
        }
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
    fn hand_back(&mut self, slot: Slot, request: Frame) {
        self.metrics.outcome(Status::Unavailable);
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        let to = slot.reply_to.clone();
        let fwd = Forward {
            frame: request,
            info: CallInfo {
                replied: None,
                ..slot.info
            },
            reply_to: slot.reply_to,
            deadline: slot.deadline,
            retries: slot.retries,
            reserved: slot.reserved,
            refused_by_drain: true,
        };
        // A send fails only when the caller's session is gone; nobody is left to answer.
        let _ = to.send(Reply::Retry(fwd, Reroute::NotRun));
    }

    /// Ends the connection (`cause`: why, or `None` when every handle was dropped and the
    /// calls were done): every call in flight is answered with the cause, every call still
    /// queued goes back to its session to be routed again.
    fn close(mut self, cause: Option<Arc<str>>) {
        self.mark_closed();
        let reason = match cause {
            None => CloseReason::Local,
            Some(_) => CloseReason::Error,
        };
        self.metrics.conns.closed(reason);
        self.rx.close();
        let failed = self.table.len();
        let why: Arc<str> = cause.clone().unwrap_or_else(|| Arc::from("closed"));
        for (_, slot) in self.table.drain() {
            let failure = Failure::ConnectionLost {
                provider: self.settings.label.clone(),
                cause: why.clone(),
            };
            fail(
                &self.state,
                &self.metrics,
                &slot.reply_to,
                slot.info,
                failure,
            );
        }
        let mut requeued = 0;
        while let Ok(cmd) = self.rx.try_recv() {
            if let Command::Call(fwd) = cmd {
                self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
                requeued += 1;
                let to = fwd.reply_to.clone();
                let _ = to.send(Reply::Retry(fwd, Reroute::Unsent));
            }
        }
        self.link.task_ended();
        match cause {
            None => tracing::debug!("closed"),
            Some(cause) => match LOST_LINES.admit() {
                Some(a) => {
                    tracing::warn!(%cause, failed, requeued, lost = a.seen, left_out = a.left_out, "provider connection lost")
                }
                None => tracing::debug!(%cause, failed, requeued, "provider connection lost"),
            },
        }
    }
}

/// The status a call's outcome gives its caller: the provider's, or the broker's own.
fn status_of(outcome: &Result<Frame, Failure>) -> Status {
    match outcome {
        Ok(frame) => Status::from_wire(frame.body[0]).unwrap_or(Status::Failed),
        Err(f) => f.status(),
    }
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
    metrics.outcome(status_of(&outcome));
    state.in_flight.fetch_sub(1, Ordering::Relaxed);
    // A send fails only when the caller's session is gone; nobody is left to answer.
    let _ = to.send(Reply::Done {
        info,
        outcome,
        reserved,
    });
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
