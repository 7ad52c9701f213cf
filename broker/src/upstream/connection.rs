//! One pooled connection to a provider, carrying many calls at once.
//!
//! [`UpstreamConn`] is the handle sessions and the pool hold; behind it one task owns the
//! socket. A session that routes a call here queues it itself
//! ([`UpstreamConn::try_forward`]): under the connection's lock it gives the call a fresh
//! request id (slot index + generation) in the in-flight table (upstream request id →
//! caller), writes the header under that id and copies the body once into the queue's
//! buffer, and wakes the task if it waits. No message is passed per call, and the lock is
//! held for the copy only (one uncontended lock per call). The task:
//!
//! - moves what was queued to its write buffer once per round (the buffers trade places
//!   when its own is empty), after letting the other ready sessions queue theirs, so that
//!   everything queued in a round leaves in one `write`;
//! - matches each reply to its slot and copies it into the caller's session's inbox
//!   (`crate::call::Inbox`); a reply for no slot (its call timed out) is dropped and
//!   counted;
//! - keeps each call's request frame (a `Bytes` slice of the caller's read buffer, no
//!   copy) in its slot until the reply, for [`REQUEST_RETAIN`] at most: a provider that
//!   is draining answers the calls it did not start "unavailable" with `NOT_RUN`, and
//!   such a call goes back to its session with its frame to be routed to another
//!   provider, while the whole provider is marked draining ([`PoolLink`]);
//! - sweeps the table for calls past their deadline and answers them "timeout" (and,
//!   towards a plain v1 server, times a server that has fallen silent: `super::pace`);
//! - times how fast a plain v1 server answers, and takes an rpcmesh provider's own time
//!   per call from its heartbeat answers, for the router's packing (`super::pace`);
//! - when the socket fails, answers every call in flight at once with "unavailable" and
//!   the cause, and hands calls still queued (never moved to its write buffer) back to
//!   their sessions to be routed again;
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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::BytesMut;

use rpcmesh_common::metrics::{BadInputLog, ErrorKind, Side};
use rpcmesh_common::net::budget::{MemoryBudget, Reserved};
use rpcmesh_common::net::busy_poll::Activity;
use rpcmesh_common::net::connection::{CloseReason, FramedIo, IoEvent};
use rpcmesh_common::net::shutdown::{CancellationToken, Cancelled};
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

use crate::call::{CallInfo, Forward, Reply, ReplyTx, Reroute, copied_at_once};
use crate::failure::Failure;
use crate::metrics::{QUEUE, UPSTREAM, UpstreamMetrics};
use crate::upstream::pace::Backlog;
use crate::upstream::{PoolLink, UpstreamError};
use rpcmesh_common::net::pace::{HEARTBEAT_KEY, PerCall};

/// A health check's waiter: told when the heartbeat's answer comes.
type HeartbeatTx = oneshot::Sender<()>;

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
pub const REQUEST_RETAIN: Duration = Duration::from_secs(1);

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

/// What the handles (the sessions routing calls here, the pool) and the task share.
#[derive(Debug, Default)]
struct ConnState {
    /// Calls queued or in flight: the router's measure of the connection's load, and what
    /// the cap is checked against (without the lock).
    in_flight: AtomicUsize,
    /// Set once the connection failed, was retired, or its provider is going away: no
    /// new call is routed here.
    closed: AtomicBool,
    /// The calls, under the lock.
    calls: Mutex<Calls>,
}

impl ConnState {
    fn lock(&self) -> MutexGuard<'_, Calls> {
        // Nothing under the lock can panic half-way through an update that matters.
        self.calls.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ready when calls were queued since the task last took them; else the task is woken
    /// by the next one.
    fn poll_queued(&self, cx: &mut Context<'_>) -> Poll<()> {
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
}

/// A connection's calls: queued by sessions, written and matched to replies by its task.
#[derive(Debug, Default)]
struct Calls {
    /// The frames of the calls queued since the task last took them, under this
    /// connection's request ids, ready to be written.
    wbuf: BytesMut,
    /// The ids of the calls in `wbuf`, in order.
    queued: Vec<u64>,
    /// Calls queued or written and waiting for their reply, by upstream request id.
    table: SlotTable<Slot>,
    /// The task, when it waits for calls.
    waker: Option<Waker>,
    /// The task has ended: nothing more is queued (set under the lock, so a call is
    /// either queued before, and answered by the task's close, or refused).
    ended: bool,
}

/// The handle of one upstream connection. Dropping the last handle lets the task finish
/// the calls in flight and close the socket.
#[derive(Debug)]
pub(crate) struct UpstreamConn {
    /// Unique per provider, in the order the connections were made.
    id: u64,
    /// Health checks to the task; closed when the last handle is dropped.
    heartbeats: mpsc::UnboundedSender<HeartbeatTx>,
    state: Arc<ConnState>,
    cap: usize,
    /// The provider speaks rpcmesh's extensions (calls ask for extended statuses).
    ext: bool,
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
        let span = tracing::debug_span!("upstream", provider = %settings.label, conn = id);
        let sweep = (settings.call_timeout / 20).clamp(SWEEP_MIN, SWEEP_MAX);
        let (conn, task) = UpstreamConn::pair(stream, id, settings, metrics, link);
        tracing::debug!(parent: &span, "connected");
        task.link.task_started();
        tokio::spawn(task.run(sweep).instrument(span));
        Ok(conn)
    }

    /// The handle and the task of a connected socket (the task not started yet).
    fn pair(
        stream: TcpStream,
        id: u64,
        settings: ConnSettings,
        metrics: UpstreamMetrics,
        link: Arc<PoolLink>,
    ) -> (UpstreamConn, ConnTask) {
        let (heartbeats, heartbeat_rx) = mpsc::unbounded_channel();
        let state = Arc::new(ConnState::default());
        let cap = settings.max_in_flight;
        let ext = settings.ext;
        let task = ConnTask {
            io: FramedIo::new(stream, FrameCodec::new(settings.max_body_len))
                .with_activity(settings.activity.clone())
                .with_budget(Some(settings.budget.clone())),
            heartbeat_rx,
            state: state.clone(),
            heartbeats: Vec::new(),
            next_heartbeat_id: 1,
            quick_ack: settings.quick_ack,
            round: Vec::new(),
            bad_input: BadInputLog::new(metrics.errors.clone(), Side::Provider),
            settings,
            metrics,
            link,
            backlog: Backlog::default(),
        };
        let conn = UpstreamConn {
            id,
            heartbeats,
            state,
            cap,
            ext,
        };
        (conn, task)
    }

    /// Queues a call: its frame goes into the connection's queue under a fresh request id,
    /// and the task is woken if it waits. On refusal the call is handed back untouched.
    // A refused call is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    pub fn try_forward(&self, fwd: Forward) -> Result<(), (Forward, Refused)> {
        let state = &*self.state;
        if state.closed.load(Ordering::Relaxed) {
            return Err((fwd, Refused::Closed));
        }
        if state.in_flight.fetch_add(1, Ordering::Relaxed) >= self.cap {
            state.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err((fwd, Refused::Full));
        }
        let mut calls = state.lock();
        if calls.ended {
            drop(calls);
            state.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err((fwd, Refused::Closed));
        }
        let flags = if self.ext {
            // Ask for extended statuses always: the session degrades them for v1 callers,
            // and an "unavailable" from the provider tells the pool it is draining.
            fwd.frame.header.flags | Flags::EXT_STATUS
        } else {
            Flags::NONE
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
        });
        let header = Header {
            msg_type: MsgType::Request,
            flags,
            body_len,
            req_id: id,
        };
        if let Some(frame) = &slot.request {
            put_frame(wbuf, &header, &frame.body);
        }
        queued.push(id);
        let waker = waker.take();
        drop(calls);
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// A heartbeat round trip, for the pool's health check.
    pub async fn heartbeat(&self, timeout: Duration) -> Result<(), UpstreamError> {
        let (tx, rx) = oneshot::channel();
        self.heartbeats
            .send(tx)
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

/// A call queued or written upstream and waiting for its reply (its request id is its key
/// in the connection's [`SlotTable`]).
#[derive(Debug)]
struct Slot {
    info: CallInfo,
    reply_to: ReplyTx,
    deadline: Instant,
    /// When the write that carried it returned (stages on only).
    sent: Option<Instant>,
    /// A large call's bytes, counted against the memory budget until its reply is in the
    /// caller's write buffer (or it fails).
    reserved: Option<Reserved>,
    /// The caller's request frame: while the call is queued, to route it elsewhere should
    /// the connection fail first; then, for an rpcmesh provider, to route it elsewhere if
    /// the provider refuses it `NOT_RUN` (dropped after [`REQUEST_RETAIN`]). A plain v1
    /// server's calls let go of it once written.
    request: Option<Frame>,
    /// Times the call was handed back and routed again before.
    retries: u8,
    /// A draining provider refused it before (see [`Forward::refused_by_drain`]).
    refused_by_drain: bool,
}

impl Slot {
    /// Gives the call back to its session with its request frame, to be routed again.
    /// Dropped when the session is gone (nobody is left to answer).
    fn hand_back(self, request: Frame, why: Reroute) {
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
        };
        to.send(Reply::Retry(fwd, why));
    }
}

struct ConnTask {
    io: FramedIo,
    /// Health checks from the pool; `None` once every handle is gone.
    heartbeat_rx: mpsc::UnboundedReceiver<HeartbeatTx>,
    state: Arc<ConnState>,
    heartbeats: Vec<(u64, HeartbeatTx)>,
    next_heartbeat_id: u64,
    /// ACK reads at once while calls are in flight (see the module doc); turned off on
    /// this connection if the kernel refuses it.
    quick_ack: bool,
    /// Ids of the timed calls written this round.
    round: Vec<u64>,
    settings: ConnSettings,
    metrics: UpstreamMetrics,
    /// What this connection shares with its pool.
    link: Arc<PoolLink>,
    /// Bad frames from the provider: counted, and logged thinned.
    bad_input: BadInputLog,
    /// A plain v1 server's calls waiting at its last read, to time how fast it answers
    /// (`super::pace`); unused towards rpcmesh providers.
    backlog: Backlog,
}

impl ConnTask {
    async fn run(mut self, sweep: Duration) {
        let mut sweeper = tokio::time::interval(sweep);
        sweeper.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut handles_left = true;
        let mut expired = Vec::new();
        let mut grace_over = Cancelled::new(&self.settings.grace_over);
        let mut cut = false;
        let state = self.state.clone();
        let cause: Option<Arc<str>> = loop {
            let busy = state.in_flight.load(Ordering::Relaxed) > 0 || !self.heartbeats.is_empty();
            tokio::select! {
                biased;
                ev = self.io.wait_io(true) => match ev {
                    Ok(IoEvent::Read) => {
                        if let Err(cause) = self.take_frames(&state) {
                            break Some(cause.into());
                        }
                        self.ack_at_once();
                    }
                    Ok(IoEvent::Wrote) => {}
                    Err(e) => break Some(format!("socket error: {e}").into()),
                },
                () = std::future::poll_fn(|cx| state.poll_queued(cx)) => {}
                tx = self.heartbeat_rx.recv(), if handles_left => match tx {
                    Some(tx) => self.send_heartbeat(tx),
                    // Every handle is gone: finish what is in flight, then close.
                    None => handles_left = false,
                },
                _ = sweeper.tick(), if busy => {
                    self.answer_timed_out(&mut expired);
                }
                () = &mut grace_over, if !cut => {
                    cut = true;
                    self.answer_grace_over();
                }
            }
            // Calls queued meanwhile leave in the same write. Before writing, when other
            // calls are in flight on this connection (traffic is concurrent), let every
            // other ready task run: sessions woken by the same poll queue their calls, and
            // one write carries them all. A lone call goes out at once.
            let mut taken = self.take_queued();
            let concurrent = state.in_flight.load(Ordering::Relaxed) > taken;
            if self.io.pending_write() > 0 && concurrent {
                for _ in 0..GATHER_YIELDS {
                    tokio::task::yield_now().await;
                    let more = self.take_queued();
                    if more == 0 {
                        break;
                    }
                    taken += more;
                }
            }
            if let Err(e) = self.io.try_flush() {
                break Some(format!("write failed: {e}").into());
            }
            self.io.account();
            self.record_sent();
            self.metrics.wire.add(self.io.take_counts());
            if !handles_left && state.in_flight.load(Ordering::Relaxed) == 0 {
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
        if !self.quick_ack
            || (self.state.in_flight.load(Ordering::Relaxed) == 0 && self.heartbeats.is_empty())
        {
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
    /// counted `late_reply`); one still queued, never written, is answered that it timed
    /// out waiting. Health checks whose waiter gave up are forgotten.
    fn answer_timed_out(&mut self, expired: &mut Vec<(u64, Slot)>) {
        self.heartbeats.retain(|(_, tx)| !tx.is_closed());
        let now = Instant::now();
        if !self.settings.ext {
            self.backlog.on_sweep(now, &self.link.pace);
        }
        let mut calls = self.state.lock();
        calls.table.take_where(|s| s.deadline <= now, expired);
        // Requests admitted longer ago than REQUEST_RETAIN are let go. Calls still queued
        // keep theirs until written: when some are, this waits for the next sweep.
        if self.settings.ext && calls.queued.is_empty() {
            for s in calls.table.values_mut() {
                if s.request.is_some() && now.duration_since(s.info.admitted) > REQUEST_RETAIN {
                    s.request = None;
                }
            }
        }
        for (id, slot) in expired.drain(..) {
            let failure = if calls.queued.contains(&id) {
                Failure::TimedOutQueued
            } else {
                Failure::Timeout {
                    provider: self.settings.label.clone(),
                    after: self.settings.call_timeout,
                }
            };
            self.fail_slot(slot, failure);
        }
    }

    /// The broker's grace period is over: every call in flight here is answered
    /// "unavailable: shutting down" at once, so that its session can answer its caller and
    /// close (a reply that comes later finds no slot and is dropped).
    fn answer_grace_over(&mut self) {
        let mut calls = self.state.lock();
        calls.queued.clear();
        calls.wbuf.clear();
        for (_, slot) in calls.table.drain() {
            let failure = Failure::GraceOver;
            self.fail_slot(slot, failure);
        }
    }

    /// Stamps the calls written this round and records their `queue` stage.
    fn record_sent(&mut self) {
        if self.round.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut calls = self.state.lock();
        for id in self.round.drain(..) {
            if let Some(slot) = calls.table.get_mut(id) {
                slot.sent = Some(now);
                if let Some(routed) = slot.info.routed {
                    self.metrics.stages.record_span(QUEUE, routed, now);
                }
            }
        }
    }

    /// Moves the calls queued since the last look to the write buffer; returns how many.
    fn take_queued(&mut self) -> usize {
        let mut calls = self.state.lock();
        let Calls {
            wbuf,
            queued,
            table,
            ..
        } = &mut *calls;
        let n = queued.len();
        if n == 0 {
            return 0;
        }
        let out = self.io.wbuf();
        if out.is_empty() {
            // The buffers trade places: no copy, and each keeps its room.
            std::mem::swap(out, wbuf);
        } else {
            out.extend_from_slice(wbuf);
            wbuf.clear();
        }
        let keep_request = self.settings.ext;
        for id in queued.drain(..) {
            if let Some(slot) = table.get_mut(id) {
                // A plain v1 server's calls keep nothing of the caller's read buffer once
                // written (only an rpcmesh provider refuses with NOT_RUN).
                if !keep_request {
                    slot.request = None;
                }
                if slot.info.routed.is_some() {
                    self.round.push(id);
                }
            }
        }
        n
    }

    /// Handles every whole frame read so far.
    fn take_frames(&mut self, state: &ConnState) -> Result<(), String> {
        let read_at = self.metrics.stages.on().then(Instant::now);
        let mut calls = state.lock();
        let before = calls.table.len();
        loop {
            match self.io.peek_frame() {
                Ok(Some(header)) => {
                    if !self.answer_in_place(&mut calls, &header, read_at) {
                        let frame = self.io.take_peeked(header);
                        self.on_frame(&mut calls, frame, read_at);
                    }
                }
                Ok(None) => break,
                Err(e) => self.on_bad_frame(&mut calls, e)?,
            }
        }
        if !self.settings.ext {
            // Sessions queue under this lock, so the table changed by the replies alone.
            let answered = before.saturating_sub(calls.table.len());
            // (A queued call that timed out leaves its id in the queue until taken.)
            let waiting = calls.table.len().saturating_sub(calls.queued.len());
            let now = read_at.unwrap_or_else(Instant::now);
            self.backlog
                .on_read(now, answered, waiting, &self.link.pace);
        }
        if self.io.is_eof() {
            return Err("closed by provider".into());
        }
        Ok(())
    }

    /// Takes an rpcmesh provider's time per call from its heartbeat answer, for the
    /// router's packing (`super::pace`). An answer without it (an older provider) leaves
    /// what the pool knows; one that cannot be read is not this check's business (the
    /// round trip is what it checks).
    fn take_reported_pace(&self, body: &[u8]) {
        if let Ok(hb) = Heartbeat::parse(body) {
            if let Some(value) = hb.extra_value(HEARTBEAT_KEY) {
                self.link
                    .pace
                    .reported(PerCall::parse_heartbeat_value(value));
            }
        }
    }

    /// Writes a health check's heartbeat; its answer is matched by id.
    fn send_heartbeat(&mut self, tx: HeartbeatTx) {
        // Heartbeat ids count down from the top so they never meet call ids.
        let id = u64::MAX - self.next_heartbeat_id;
        self.next_heartbeat_id += 1;
        // An rpcmesh provider is asked for its time per call (`super::pace`); a plain v1
        // server gets the plain heartbeat.
        let extra: &[(&str, &str)] = if self.settings.ext {
            &[(HEARTBEAT_KEY, "")]
        } else {
            &[]
        };
        if Heartbeat::put_now_with(self.io.wbuf(), id, "broker", "rpcmesh-broker", extra).is_ok() {
            self.heartbeats.push((id, tx));
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
        if body.len() < 5 || body[0] == Status::Unavailable as u8 {
            return false;
        }
        // Not a late reply, nor one the session must copy with its call's reservation.
        let Some(mut slot) = calls.table.take_if(header.req_id, |s| {
            copied_at_once(body.len(), s.reserved.is_some())
        }) else {
            return false;
        };
        self.reply_read(&mut slot, read_at);
        let status = slot.reply_to.answer_small(header.flags, body, slot.info);
        settled(&self.state, &self.metrics, status);
        self.io.skip_peeked(header);
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
                    // The report first: the check's waiter may publish the connection.
                    if self.settings.ext {
                        self.take_reported_pace(&frame.body);
                    }
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
    fn on_bad_frame(&mut self, calls: &mut Calls, e: FrameError) -> Result<(), String> {
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
        if let Some(slot) = calls.table.take(id) {
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
        settled(&self.state, &self.metrics, Status::Unavailable);
        slot.hand_back(request, Reroute::NotRun);
    }

    /// Answers a call taken off the table with a failure of the broker's own making.
    fn fail_slot(&self, slot: Slot, failure: Failure) {
        fail(
            &self.state,
            &self.metrics,
            &slot.reply_to,
            slot.info,
            failure,
        );
    }

    /// Ends the connection (`cause`: why, or `None` when every handle was dropped and the
    /// calls were done): every call written is answered with the cause, every call still
    /// queued goes back to its session to be routed again.
    fn close(mut self, cause: Option<Arc<str>>) {
        self.mark_closed();
        let reason = match cause {
            None => CloseReason::Local,
            Some(_) => CloseReason::Error,
        };
        self.metrics.conns.closed(reason);
        self.heartbeat_rx.close();
        let (slots, queued) = {
            let mut calls = self.state.lock();
            calls.ended = true;
            calls.waker = None;
            calls.wbuf = BytesMut::new();
            let queued = std::mem::take(&mut calls.queued);
            (calls.table.drain().collect::<Vec<_>>(), queued)
        };
        let why: Arc<str> = cause.clone().unwrap_or_else(|| Arc::from("closed"));
        let queued: std::collections::HashSet<u64> = queued.into_iter().collect();
        let (mut failed, mut requeued) = (0, 0);
        for (id, mut slot) in slots {
            match slot.request.take().filter(|_| queued.contains(&id)) {
                Some(request) => {
                    self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
                    requeued += 1;
                    slot.hand_back(request, Reroute::Unsent);
                }
                None => {
                    failed += 1;
                    let failure = Failure::ConnectionLost {
                        provider: self.settings.label.clone(),
                        cause: why.clone(),
                    };
                    self.fail_slot(slot, failure);
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::{Inbox, Taken};
    use crate::upstream::pace;
    use bytes::{Bytes, BytesMut};
    use rpcmesh_common::metrics::Telemetry;
    use rpcmesh_wire::body::Request;
    use tokio::net::TcpListener;

    /// A connection to a listener of the test's (which accepts and reads nothing), with
    /// its task not started: the test drives the task's steps itself.
    async fn connection(ext: bool) -> (UpstreamConn, ConnTask, TcpStream) {
        let link = PoolLink::new(Duration::ZERO, pace::Source::of(ext));
        connection_with(ext, Arc::new(link)).await
    }

    /// The same, sharing `link` with the test.
    async fn connection_with(
        ext: bool,
        link: Arc<PoolLink>,
    ) -> (UpstreamConn, ConnTask, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let settings = ConnSettings {
            label: Arc::from("test"),
            ext,
            quick_ack: !ext,
            max_body_len: 1 << 20,
            max_in_flight: 4,
            call_timeout: Duration::from_secs(5),
            activity: None,
            grace_over: CancellationToken::new(),
            budget: MemoryBudget::new(1 << 30),
        };
        let metrics = crate::metrics::BrokerMetrics::new(Telemetry::new(), 8).upstream("test", 1);
        let (conn, task) = UpstreamConn::pair(stream, 1, settings, metrics, link);
        (conn, task, server)
    }

    /// A call from a session with inbox `inbox`, with the caller's id `id`.
    fn call(id: u64, inbox: &Arc<Inbox>) -> Forward {
        let mut b = BytesMut::new();
        Request {
            service: Bytes::from_static(b"EchoService"),
            method: Bytes::from_static(b"Echo"),
            payload: Bytes::from_static(b"x"),
        }
        .put(&mut b, Flags::EXT_STATUS, id)
        .unwrap();
        let now = Instant::now();
        Forward {
            frame: Frame::from_bytes(b.freeze()).unwrap(),
            info: CallInfo {
                client_id: id,
                client_flags: Flags::EXT_STATUS,
                tag: 0,
                admitted: now,
                routed: None,
                replied: None,
            },
            reply_to: inbox.clone(),
            deadline: now + Duration::from_secs(5),
            retries: 0,
            refused_by_drain: false,
            reserved: None,
        }
    }

    /// A plain v1 server that answers the first of two calls and then nothing is timed at
    /// the deadline sweep, before any further reply: its pace rises above the wait and its
    /// connections are no longer packed.
    #[tokio::test]
    async fn a_plain_v1_server_that_falls_silent_stops_being_packed_at_the_sweep() {
        use rpcmesh_wire::envelope::CallCodec;
        let link = Arc::new(PoolLink::new(
            Duration::from_millis(1),
            pace::Source::Measured,
        ));
        let (conn, mut task, mut server) = connection_with(false, link.clone()).await;
        let inbox = Inbox::new();
        conn.try_forward(call(1, &inbox)).unwrap();
        conn.try_forward(call(2, &inbox)).unwrap();
        assert_eq!(task.take_queued(), 2);
        task.io.try_flush().unwrap();
        // The server reads both and answers the first.
        let mut buf = BytesMut::new();
        let requests = rpcmesh_common::testkit::read_frames(&mut server, &mut buf, 2)
            .await
            .unwrap();
        let mut reply = BytesMut::new();
        CallCodec::new(None, 1 << 20)
            .put_ok_response(&mut reply, requests[0].header.req_id, Flags::NONE, b"")
            .unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut server, &reply)
            .await
            .unwrap();
        let state = task.state.clone();
        loop {
            assert!(matches!(task.io.wait_io(true).await, Ok(IoEvent::Read)));
            task.take_frames(&state).unwrap();
            if conn.load() == 1 {
                break;
            }
        }
        // One reply, read with the second call waiting: no sample yet.
        assert_eq!(link.pace.per_call(), None);
        tokio::time::sleep(Duration::from_millis(5)).await;
        task.answer_timed_out(&mut Vec::new());
        let pace = link.pace.per_call().expect("timed at the sweep");
        assert!(pace >= Duration::from_millis(5), "{pace:?}");
        assert_eq!(link.pace.depth(64), 0, "not packed");
        assert_eq!(conn.load(), 1, "the sweep answered nothing");
    }

    #[tokio::test]
    async fn a_call_is_queued_under_a_fresh_id_and_the_cap_refuses_the_fifth() {
        let (conn, mut task, _server) = connection(true).await;
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

    #[tokio::test]
    async fn when_the_connection_ends_calls_still_queued_go_back_to_be_routed_and_written_ones_fail()
     {
        let (conn, mut task, _server) = connection(false).await;
        let inbox = Inbox::new();
        conn.try_forward(call(1, &inbox)).unwrap();
        assert_eq!(
            task.take_queued(),
            1,
            "call 1 is in the task's write buffer"
        );
        conn.try_forward(call(2, &inbox)).unwrap();
        task.close(Some(Arc::from("closed by provider")));
        assert!(conn.is_closed());
        assert_eq!(conn.load(), 0);
        let (back, why) = conn.try_forward(call(3, &inbox)).unwrap_err();
        assert_eq!((back.info.client_id, why), (3, Refused::Closed));

        let mut wbuf = BytesMut::new();
        let mut taken = Taken::default();
        assert_eq!(inbox.take(&mut wbuf, &mut taken), 2);
        let mut lost = None;
        let mut rerouted = None;
        for reply in taken.other.drain(..) {
            match reply {
                Reply::Done {
                    info,
                    outcome: Err(f),
                    ..
                } => lost = Some((info.client_id, f)),
                Reply::Retry(fwd, why) => rerouted = Some((fwd.info.client_id, why, fwd.frame)),
                other => panic!("unexpected {other:?}"),
            }
        }
        let (id, failure) = lost.expect("the written call is answered");
        assert_eq!(id, 1);
        assert!(
            matches!(failure, Failure::ConnectionLost { .. }),
            "{failure:?}"
        );
        let (id, why, frame) = rerouted.expect("the queued call goes back");
        assert_eq!((id, why), (2, Reroute::Unsent));
        assert_eq!(frame.header.req_id, 2, "with the caller's own frame");
    }
}
