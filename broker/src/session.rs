//! One client connection to the broker: reads request frames, reads only their service
//! and method names, sheds over the in-flight caps, routes each call to a provider
//! connection, and writes each reply back under the caller's request id as it comes,
//! batched into as few writes as the socket allows.
//!
//! The broker's [`Protocol`] over the shared server-session skeleton
//! (`rpcmesh_common::net::session`: the loop, backlog limit, drain and final flush). One
//! task owns the socket, the write buffer and the session's count of calls in flight.
//! Replies reach it through its [`Inbox`], where the upstream connections' tasks put them
//! already under the callers' ids.
//!
//! With TLS, the session begins with the handshake and knows its caller by the identity
//! its certificate names: the inbox carries it, so that upstream connections to providers
//! that take it forward it with each call (`rpcmesh_wire::ext`). With a policy, each call's
//! names are checked against it at admission, before any cap; a denied call is answered
//! "permission denied: IDENTITY may not call Service.Method".
//!
//! A caller that asks in a heartbeat (`rpcmesh_wire::ext`) is told the broker takes call
//! deadlines; its calls may then carry one. A call's deadline is the earlier of its
//! caller's and the broker's own call timeout; a call already past it is answered
//! "timeout: deadline exceeded" and counted `deadline_exceeded`, never forwarded. A caller
//! field from a client is ignored: a broker's callers are whom their certificates name.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use rpcmesh_common::authz::denial;
use rpcmesh_common::cli::security::Security;
use rpcmesh_common::metrics::families::InFlightShare;
use rpcmesh_common::metrics::families::{CallCounters, Sampler};
use rpcmesh_common::metrics::{BadInputLog, Side};
use rpcmesh_common::net::budget::{MemoryBudget, Reserved, SMALL_BODY};
use rpcmesh_common::net::busy_poll::Activity;
use rpcmesh_common::net::connection::{CloseReason, FramedIo};
use rpcmesh_common::net::listener::Via;
use rpcmesh_common::net::session::{self, Ended, Protocol, Resume, Stop};
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_common::net::thinned::Thinned;
use rpcmesh_common::net::tls::{Identity, Secured};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::{Heartbeat, request_names, request_service};
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{Flags, Frame, FrameError, Header, MsgType};
use tokio::net::TcpStream;
use tracing::Instrument;

use crate::BrokerConfig;
use crate::call::{CallInfo, Forward, Inbox, Reply, Reroute, Taken, Verbatim, write_reply_to};
use crate::failure::{Cap, Failure, put_answer};
use crate::in_flight::HandedOver;
use crate::metrics::{ADMIT, BrokerMetrics, StatusTally, TOTAL, WRITE_BACK};
use crate::route::{Picker, Router};

/// Times the session lets the other ready tasks run before writing, while each turn
/// brings more replies (replies from several upstream connections then share a write).
const GATHER_YIELDS: usize = 1;
/// A call whose caller left it less time than this is checked against a fresh reading of
/// the clock before it is forwarded: handling a read's earlier calls takes microseconds,
/// which only so short a budget can miss. Longer ones are judged at the read's instant.
const FRESH_CLOCK_BELOW: Duration = Duration::from_millis(1);
/// Tag bit of a call whose (service, method) has no labels yet.
const PENDING: u32 = 1 << 31;
/// How often a call handed back without having run (its connection closed before it was
/// written, or a draining provider refused it) is routed again. Each refusing provider is
/// out of the routing from then on, so a few tries find a healthy one if there is any, and
/// a call cannot bounce for ever between connections that keep closing.
pub const MAX_RETRIES: u8 = 3;

/// What every session of one broker shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: BrokerConfig,
    /// The providers and how to route to them, replaced whole when the providers change
    /// (read once per call, without a lock).
    pub router: ArcSwap<Router>,
    pub metrics: BrokerMetrics,
    /// This cell's lease on the broker-wide cap on calls in flight (`crate::in_flight`).
    pub in_flight: crate::in_flight::Lease,
    /// Reads are reported here when the broker busy-polls.
    pub activity: Option<Arc<Activity>>,
    /// The process's budget of buffered bytes.
    pub budget: Arc<MemoryBudget>,
    /// TLS and the policy.
    pub security: Security,
    /// Ejections and the retry budget (`crate::resilience`).
    pub guards: Arc<crate::resilience::Guards>,
    /// The calls this cell answered (`crate::cell`; a no-op with one cell).
    pub cell_calls: metrics::Counter,
    /// The same count, for the cells' placement (`crate::cell::placement`): written by
    /// this cell's thread only, once per round.
    pub answered: std::sync::atomic::AtomicU64,
    /// Time this cell's spinner polled without finding a read, in nanoseconds (written by
    /// the spinner, in chunks).
    pub spin_idle_ns: std::sync::atomic::AtomicU64,
}

/// The process's budget of denied-call log lines (a caller can cause them at will), for
/// both engines.
pub(crate) static DENIED_LINES: Thinned = Thinned::new();

/// Serves one client connection until the caller leaves, the input is beyond repair, a
/// timeout passes, or shutdown drained it; returns why it closed.
pub(crate) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    via: Via,
    shared: Arc<Shared>,
    stop: Stop,
) -> CloseReason {
    let span = tracing::debug_span!("client", %peer);
    let timeouts = shared.config.timeouts;
    let Some((io, session)) = open(stream, peer, via, shared).await else {
        return CloseReason::TlsHandshake;
    };
    session::serve(io, session, timeouts, stop)
        .instrument(span)
        .await
}

/// A client connection's start: the TLS handshake if the broker takes TLS, then its
/// framed connection and its session on `shared`'s cell. `None`: the handshake failed.
pub(crate) async fn open(
    stream: TcpStream,
    peer: SocketAddr,
    via: Via,
    shared: Arc<Shared>,
) -> Option<(FramedIo, Session)> {
    let Ok(Secured { stream, identity }) = shared.security.accept(stream, peer, via).await else {
        return None;
    };
    let io = FramedIo::over(stream, FrameCodec::new(shared.config.max_body_len))
        .with_activity(shared.activity.clone())
        .with_budget(Some(shared.budget.clone()));
    Some((io, Session::new(shared, identity)))
}

/// Serves a client connection on its cell until it closes or, once `move_asked` is
/// cancelled, is ready to move to another cell (`crate::cell`).
pub(crate) async fn serve_on_cell(
    io: FramedIo,
    session: Session,
    peer: SocketAddr,
    stop: Stop,
    move_asked: &CancellationToken,
    resume: Resume,
) -> Ended<Session> {
    let span = tracing::debug_span!("client", %peer);
    let timeouts = session.shared.config.timeouts;
    session::serve_movable(io, session, timeouts, stop, Some(move_asked), resume)
        .instrument(span)
        .await
}

/// One client connection's state: what the skeleton's loop calls.
pub(crate) struct Session {
    shared: Arc<Shared>,
    /// Where the upstream connections put this session's outcomes.
    inbox: Arc<Inbox>,
    /// What the last take from the inbox brought (kept for its room).
    taken: Taken,
    picker: Picker,
    /// The router this round's calls are routed with: read once per round, not per call,
    /// and let go at its end (a session must not keep providers that left alive).
    router: Option<Arc<Router>>,
    in_flight: usize,
    /// This connection's share of the calls-in-flight gauge.
    in_flight_share: InFlightShare,
    bad_input: BadInputLog,
    /// When the current read returned.
    read_at: Instant,
    /// The message of the answer being written (reused: shedding happens under overload,
    /// when a per-call allocation costs most).
    message: String,
    /// (service, method) bytes → tag; tag → counters.
    tags: HashMap<Bytes, u32>,
    /// Each with the calls answered this round not yet added to it (once per round,
    /// `tell_cell`).
    counters: Vec<(Arc<CallCounters>, StatusTally)>,
    /// The indices of `counters` whose tallies hold counts.
    uncounted_at: Vec<usize>,
    /// The names and tag of the last labelled call.
    last_tag: Option<(Bytes, u32)>,
    /// Names of calls in flight whose (service, method) has no labels yet.
    unlabelled: Vec<Option<(Bytes, usize)>>,
    /// (read, reply read) times of the timed calls answered this round, for the stages,
    /// and the index of their method's counters.
    written: Vec<(Instant, Option<Instant>, usize)>,
    /// Picks the calls whose stages are timed.
    sampler: Sampler,
    /// Whom the connection's certificate names (`None`: no certificate).
    identity: Option<Identity>,
    /// Calls admitted this round: deposited in the retry budget once, at its end.
    admitted: usize,
    /// The CRC trailer of the request being admitted, as received.
    trailer: u32,
    /// Calls answered since the cell's count was last told.
    answered: u64,
    /// Every call this connection's session answered, on any cell, for the placement
    /// to split cells by load (`crate::cell`; none with one cell).
    calls: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// The caller asked to be told of the drain (`ext::DRAINING_KEY`).
    drain_notice: bool,
}

impl Protocol for Session {
    /// Outcomes wait in the inbox.
    type Event = ();

    async fn next_event(&mut self) {
        let inbox = &self.inbox;
        std::future::poll_fn(|cx| inbox.poll_ready(cx)).await;
    }

    fn on_event(&mut self, (): (), io: &mut FramedIo) {
        self.take_replies(io);
    }

    fn on_read(&mut self) {
        self.read_at = Instant::now();
        self.picker.now = self.read_at;
    }

    fn on_trailer(&mut self, trailer: u32) {
        self.trailer = trailer;
    }

    fn on_request(&mut self, frame: Frame, io: &mut FramedIo, draining: bool) {
        let verbatim = Verbatim::Plain {
            trailer: self.trailer,
        };
        self.admit(frame, io, draining, None, verbatim);
    }

    /// A call carrying its caller's deadline: admitted as the plain call inside, within
    /// the time its caller has left.
    fn on_ext_request(&mut self, frame: Frame, io: &mut FramedIo, draining: bool) {
        let (id, flags) = (frame.header.req_id, frame.header.flags);
        let (budget, inner) = match ext::split(&frame.body) {
            Ok((fields, inner)) => (fields.deadline, inner),
            Err(e) => return self.refuse(io, id, flags, 0, Failure::BadRequest(e)),
        };
        // A block holding the deadline alone may go on as it came: when the deadline is
        // not past the broker's own call timeout (which would take its place), or to a
        // provider that caps every call at that timeout (`ext::CAP_KEY`: the earlier of
        // the two is the call's); a caller field from a client is never passed on (a
        // broker's callers are whom their certificates name).
        let verbatim = match frame.body.get(..ext::DEADLINE_BLOCK_LEN) {
            Some(b) if b[..5] == ext::DEADLINE_ONLY => Verbatim::Deadline {
                budget_us: u32::from_be_bytes([b[5], b[6], b[7], b[8]]),
                body: frame.body.clone(),
                trailer: self.trailer,
            },
            _ => Verbatim::No,
        };
        let inner = Frame {
            header: Header {
                msg_type: MsgType::Request,
                flags,
                body_len: inner.len() as u32,
                req_id: id,
            },
            body: inner,
        };
        self.admit(inner, io, draining, budget, verbatim);
    }

    /// A caller that only sends heartbeats is idle: it cannot hold a connection slot for
    /// a heartbeat per idle period.
    fn heartbeats_are_activity(&self) -> bool {
        false
    }

    /// Answers a heartbeat; one that asks which call fields the broker takes is told
    /// (the deadline).
    fn on_heartbeat(&mut self, frame: Frame, io: &mut FramedIo) {
        self.drain_notice |= ext::asks_drain_notice(&frame.body);
        put_heartbeat_answer(io.wbuf(), frame.header.req_id, &frame.body);
    }

    fn on_drain(&mut self, io: &mut FramedIo) -> bool {
        if self.drain_notice {
            put_drain_notice(io.wbuf());
        }
        self.drain_notice
    }

    fn on_unexpected(&mut self) {
        self.bad_input.unexpected();
    }

    fn on_bad_frame(&mut self, e: &FrameError, io: &mut FramedIo) {
        if let Some((id, flags)) = self.bad_input.record(e) {
            self.answer(io, id, flags, 0, &Failure::BadRequest(e.clone()));
        }
    }

    /// Replies that came meanwhile leave in the same write; when more replies are due on
    /// this connection, the other ready tasks run once first, so that upstream
    /// connections woken by the same poll add theirs.
    async fn before_write(&mut self, io: &mut FramedIo) {
        self.take_replies(io);
        if io.pending_write() > 0 && self.in_flight > 0 {
            for _ in 0..GATHER_YIELDS {
                tokio::task::yield_now().await;
                if self.take_replies(io) == 0 {
                    break;
                }
            }
        }
        // The round's calls are routed: its router and its batch's connection are let go
        // (the next read's calls make a batch of their own).
        self.router = None;
        if self.admitted > 0 {
            self.shared
                .guards
                .budget
                .deposit(self.admitted, self.read_at);
            self.admitted = 0;
        }
        self.picker.new_batch();
        // Before the answers leave: a caller that has one sees it counted.
        self.tell_cell();
    }

    fn after_write(&mut self, io: &mut FramedIo) {
        self.record_stages();
        self.shared.metrics.wire.add(io.take_counts());
        self.in_flight_share.report(self.in_flight);
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Calls still in flight when the caller left: their replies find no one; count them
    /// out of the global cap as they would have been.
    fn on_end(&mut self) {
        self.tell_cell();
        self.inbox.close();
        if self.in_flight > 0 {
            tracing::debug!(calls = self.in_flight, "client left with calls in flight");
            self.shared.in_flight.release(self.in_flight);
            self.in_flight = 0;
        }
    }
}

impl Session {
    fn new(shared: Arc<Shared>, identity: Option<Identity>) -> Self {
        Session {
            inbox: Inbox::for_caller(
                identity.as_ref().map(|i| i.as_str()),
                shared.metrics.abandoned.clone(),
            ),
            identity,
            taken: Taken::default(),
            picker: Picker::new(),
            router: None,
            in_flight: 0,
            in_flight_share: InFlightShare::new(shared.metrics.in_flight.clone()),
            bad_input: BadInputLog::new(shared.metrics.errors.clone(), Side::Client),
            read_at: Instant::now(),
            message: String::new(),
            tags: HashMap::new(),
            counters: vec![(shared.metrics.calls_other(), StatusTally::default())],
            uncounted_at: Vec::new(),
            written: Vec::new(),
            unlabelled: Vec::new(),
            last_tag: None,
            sampler: shared.metrics.stages.sampler(),
            admitted: 0,
            trailer: 0,
            answered: 0,
            calls: None,
            drain_notice: false,
            shared,
        }
    }

    /// Adds the calls it answers to `calls` from now on (once per round).
    pub(crate) fn count_calls_in(&mut self, calls: Arc<std::sync::atomic::AtomicU64>) {
        self.calls = Some(calls);
    }

    /// The session leaves its cell (on that cell's thread, its loop ended to move): what
    /// it answered is counted in this cell, and its calls in flight leave this cell's
    /// lease of the cap. Their replies still come, through the inbox, wherever the
    /// session runs next.
    pub(crate) fn leave_cell(&mut self) -> HandedOver {
        self.tell_cell();
        self.router = None;
        self.picker.new_batch();
        self.shared.in_flight.hand_over(self.in_flight)
    }

    /// The session arrives on the cell `shared` belongs to (on that cell's thread): its
    /// calls in flight join that cell's lease, and its next calls are routed over that
    /// cell's pools.
    pub(crate) fn join_cell(&mut self, shared: Arc<Shared>, calls: HandedOver) {
        shared.in_flight.take_over(calls);
        self.shared = shared;
    }

    /// Takes every outcome arrived so far: the providers' replies go to the write buffer
    /// in one piece and are counted; the rest is handled one by one. Returns how many.
    fn take_replies(&mut self, io: &mut FramedIo) -> usize {
        let n = self.inbox.take(io.wbuf(), &mut self.taken);
        if n == 0 {
            return 0;
        }
        let mut answered = std::mem::take(&mut self.taken.answered);
        if !answered.is_empty() {
            self.in_flight -= answered.len();
            self.shared.in_flight.release(answered.len());
            for a in answered.drain(..) {
                let counters = self.counted(a.tag, a.status);
                if let Some((admitted, replied)) = a.timed {
                    self.written.push((admitted, replied, counters));
                }
            }
        }
        self.taken.answered = answered;
        let mut other = std::mem::take(&mut self.taken.other);
        for reply in other.drain(..) {
            self.on_reply(reply, io);
        }
        self.taken.other = other;
        n
    }

    /// Reads a request's names, sheds it over the caps, or hands it to routing.
    /// `budget`: the time its caller has left, when the call said.
    fn admit(
        &mut self,
        frame: Frame,
        io: &mut FramedIo,
        draining: bool,
        budget: Option<Duration>,
        verbatim: Verbatim,
    ) {
        let (id, flags) = (frame.header.req_id, frame.header.flags);
        let (service, method, _) = match request_names(&frame.body) {
            Ok(r) => r,
            Err(e) => return self.refuse(io, id, flags, 0, Failure::BadRequest(e)),
        };
        let names = service.start..method.end;
        let tag = self.tag(&frame.body, names.clone(), service.len());
        if draining {
            return self.refuse(io, id, flags, tag, Failure::Draining);
        }
        if budget.is_some_and(|b| b.is_zero()) {
            return self.refuse(io, id, flags, tag, Failure::DeadlineExceeded);
        }
        if let Some(authz) = &self.shared.security.authz {
            let caller = self.identity.as_ref().map(|i| i.as_str());
            let pair = (
                std::str::from_utf8(&frame.body[service.clone()]),
                std::str::from_utf8(&frame.body[method.clone()]),
            );
            let allowed = match pair {
                (Ok(s), Ok(m)) => authz
                    .policy()
                    .allows(caller, s, m)
                    .then_some(())
                    .ok_or((s, m)),
                // Names that are not UTF-8 name nothing a policy allows.
                _ => Err(("?", "?")),
            };
            if let Err((s, m)) = allowed {
                let message = denial(caller, s, m);
                // Labelled only with a pair that has labels already (one that succeeded).
                let known = self
                    .shared
                    .metrics
                    .known_calls(&frame.body[names])
                    .is_some();
                self.shared.security.denied.deny(known.then_some((s, m)));
                if let Some(a) = DENIED_LINES.admit() {
                    tracing::warn!(denied = a.seen, left_out = a.left_out, "{message}");
                }
                return self.refuse(io, id, flags, tag, Failure::Denied(message));
            }
        }
        let cfg = &self.shared.config;
        let len = frame.body.len();
        if self.shared.budget.refuses(len) {
            let cap = Cap::Memory(self.shared.budget.limit());
            return self.refuse(io, id, flags, tag, Failure::Shed(cap));
        }
        if self.in_flight >= cfg.max_in_flight_per_conn {
            let cap = Cap::PerConnection(cfg.max_in_flight_per_conn);
            return self.refuse(io, id, flags, tag, Failure::Shed(cap));
        }
        if !self.shared.in_flight.admit() {
            let cap = Cap::Total(cfg.max_in_flight);
            return self.refuse(io, id, flags, tag, Failure::Shed(cap));
        }
        self.in_flight += 1;
        self.admitted += 1;
        let now = self.read_at;
        let idempotent = {
            let router = self
                .router
                .get_or_insert_with(|| self.shared.router.load_full());
            router.idempotent(&frame.body[service], &frame.body[method])
        };
        let fwd = Forward {
            frame,
            verbatim,
            info: CallInfo {
                client_id: id,
                client_flags: flags,
                tag,
                admitted: now,
                // Set on the sample of calls whose stages are timed.
                routed: self.sampler.stamp(),
                replied: None,
            },
            reply_to: self.inbox.clone(),
            deadline: now + budget.map_or(cfg.call_timeout, |b| b.min(cfg.call_timeout)),
            retries: 0,
            refused_by_drain: false,
            avoid: crate::call::Avoid::None,
            reserved: (len >= SMALL_BODY).then(|| Reserved::new(&self.shared.budget, len)),
            idempotent,
        };
        // A call its caller bounded tightly may have run out of time while the read's
        // earlier calls were handled: never forwarded then. (A longer budget cannot run
        // out within a read: the clock is read once per round, not per call.)
        if budget.is_some_and(|b| b < FRESH_CLOCK_BELOW) && Instant::now() >= fwd.deadline {
            Failure::DeadlineExceeded.count(&self.shared.metrics.errors);
            return self.finish(fwd.info, Err(Failure::DeadlineExceeded), io);
        }
        self.route(fwd, io);
    }

    fn route(&mut self, fwd: Forward, io: &mut FramedIo) {
        if let Some(routed) = fwd.info.routed {
            self.shared
                .metrics
                .stages
                .record_span(ADMIT, fwd.info.admitted, routed);
        }
        let router = self
            .router
            .get_or_insert_with(|| self.shared.router.load_full());
        let routed = router.forward(fwd, &mut self.picker);
        if let Err((fwd, why)) = routed {
            let name = String::from_utf8_lossy(request_service(&fwd.frame.body)).into_owned();
            // A draining provider refused it and no other takes it: not run, and the caller
            // may try another broker.
            let failure = if fwd.refused_by_drain {
                Failure::ProvidersDraining(name)
            } else {
                why.failure(name)
            };
            failure.count(&self.shared.metrics.errors);
            if let Some(cap) = failure.shed_cap() {
                self.shared.metrics.shed.inc(cap);
            }
            self.finish(fwd.info, Err(failure), io);
        }
    }

    fn on_reply(&mut self, reply: Reply, io: &mut FramedIo) {
        match reply {
            // The reservation is released once the reply is in the write buffer (where the
            // buffer's own count takes over).
            Reply::Done {
                info,
                outcome,
                reserved,
            } => {
                self.finish(info, outcome, io);
                drop(reserved);
            }
            Reply::Retry(mut fwd, why) => {
                let now = Instant::now();
                self.picker.now = now;
                let live = fwd.retries < MAX_RETRIES && now < fwd.deadline;
                // A call shed or lost had its retry drawn by its connection already.
                let drawn = matches!(why, Reroute::Overloaded | Reroute::Lost);
                let granted = live && (drawn || self.shared.guards.budget.withdraw(now));
                if live && !granted {
                    self.shared.metrics.budget_exhausted[why as usize].increment(1);
                }
                if !granted {
                    let service =
                        || String::from_utf8_lossy(request_service(&fwd.frame.body)).into_owned();
                    let failure = if fwd.refused_by_drain {
                        Failure::ProvidersDraining(service())
                    } else if why == Reroute::Overloaded {
                        Failure::Full(service())
                    } else if why == Reroute::Lost {
                        Failure::TimedOutQueued
                    } else {
                        Failure::KeptClosing
                    };
                    failure.count(&self.shared.metrics.errors);
                    return self.finish(fwd.info, Err(failure), io);
                }
                self.shared.metrics.rerouted[why as usize].increment(1);
                fwd.retries += 1;
                self.route(fwd, io);
            }
        }
    }

    /// Writes the outcome of an admitted call to the caller and counts it out.
    fn finish(&mut self, info: CallInfo, outcome: Result<Frame, Failure>, io: &mut FramedIo) {
        self.in_flight -= 1;
        self.shared.in_flight.release(1);
        let counters = match outcome {
            Ok(frame) => {
                let status = write_reply_to(io.wbuf(), frame.header.flags, &frame.body, None, info);
                self.counted(info.tag, status)
            }
            Err(failure) => self.answer(io, info.client_id, info.client_flags, info.tag, &failure),
        };
        if info.routed.is_some() {
            self.written.push((info.admitted, info.replied, counters));
        }
    }

    /// Answers a call the broker refuses before admitting it, and counts the refusal.
    fn refuse(&mut self, io: &mut FramedIo, id: u64, flags: Flags, tag: u32, failure: Failure) {
        failure.count(&self.shared.metrics.errors);
        if let Some(cap) = failure.shed_cap() {
            self.shared.metrics.shed.inc(cap);
        }
        self.answer(io, id, flags, tag, &failure);
    }

    /// Writes the broker's own answer to a call and counts the call's outcome; returns the
    /// index of the counters it counted in.
    fn answer(
        &mut self,
        io: &mut FramedIo,
        id: u64,
        flags: Flags,
        tag: u32,
        failure: &Failure,
    ) -> usize {
        put_answer(io.wbuf(), &mut self.message, id, flags, failure);
        let status = failure.status();
        if failure.retry_safe() {
            tracing::trace!(req_id = id, %failure, "answered; the call never reached a provider");
        }
        self.counted(tag, status)
    }

    /// Counts an answered call's outcome; returns the index of the counters it counted in.
    fn counted(&mut self, tag: u32, status: Status) -> usize {
        let i = self.counters_index(tag, status);
        let tally = &mut self.counters[i].1;
        if tally.is_empty() {
            self.uncounted_at.push(i);
        }
        tally.add(status);
        self.answered += 1;
        i
    }

    /// Adds the calls answered since the last time to their methods' counters and to the
    /// cell's count.
    fn tell_cell(&mut self) {
        for i in self.uncounted_at.drain(..) {
            let (counters, tally) = &mut self.counters[i];
            tally.drain(|status, n| counters.add(status, n));
        }
        if self.answered > 0 {
            self.shared.cell_calls.increment(self.answered);
            self.shared
                .answered
                .fetch_add(self.answered, std::sync::atomic::Ordering::Relaxed);
            if let Some(calls) = &self.calls {
                calls.fetch_add(self.answered, std::sync::atomic::Ordering::Relaxed);
            }
            self.answered = 0;
        }
    }

    /// The session's tag for a (service, method) pair: an index into its counters, or,
    /// for a pair that has no labels yet, [`PENDING`] plus the index of its names among
    /// the calls waiting to show that the pair exists (see [`Session::counters_index`]).
    /// `names` is the pair's range of `body`, which is sliced (a reference to the read
    /// buffer) only when the pair has no labels yet: a labelled call takes no reference.
    fn tag(&mut self, body: &Bytes, names: std::ops::Range<usize>, service_len: usize) -> u32 {
        let (range, names) = (names.clone(), &body[names]);
        // Most connections call one method over and over: try the last one first.
        if let Some((last, t)) = &self.last_tag {
            if last.as_ref() == names {
                return *t;
            }
        }
        if let Some((key, &t)) = self.tags.get_key_value(names) {
            // The map's key is an owned copy (a slice of `names` would pin the read buffer
            // it came from): sharing it costs no allocation.
            self.last_tag = Some((key.clone(), t));
            return t;
        }
        if let Some(c) = self.shared.metrics.known_calls(names) {
            return self.cache_tag(names, c);
        }
        let slot = match self.unlabelled.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.unlabelled.push(None);
                self.unlabelled.len() - 1
            }
        };
        self.unlabelled[slot] = Some((body.slice(range), service_len));
        PENDING | slot as u32
    }

    fn cache_tag(&mut self, names: &[u8], counters: Arc<CallCounters>) -> u32 {
        // As many names per session as label pairs overall; beyond, they count as other.
        if self.tags.len() >= crate::metrics::MAX_CALL_LABELS {
            return 0;
        }
        let tag = self.counters.len() as u32;
        self.counters.push((counters, StatusTally::default()));
        self.tags.insert(Bytes::copy_from_slice(names), tag);
        tag
    }

    /// The index of the counters a finished call counts in. A call of a pair without
    /// labels gives it labels if it succeeded (the pair exists), else counts as `_other`.
    fn counters_index(&mut self, tag: u32, status: Status) -> usize {
        let mut tag = tag;
        if tag & PENDING != 0 {
            let names = self
                .unlabelled
                .get_mut((tag & !PENDING) as usize)
                .and_then(Option::take);
            tag = match names {
                Some((names, service_len)) if status == Status::Success => {
                    match self.tags.get(&names) {
                        Some(t) => *t,
                        None => {
                            let c = self.shared.metrics.calls(&names, service_len);
                            self.cache_tag(&names, c)
                        }
                    }
                }
                _ => 0,
            };
        }
        tag as usize
    }

    /// Records `write_back` and `total` of every call answered this round, once the
    /// replies have been handed to the socket.
    fn record_stages(&mut self) {
        if self.written.is_empty() {
            return;
        }
        let now = Instant::now();
        let stages = &self.shared.metrics.stages;
        for (admitted, replied, counters) in self.written.drain(..) {
            if let Some(r) = replied {
                stages.record_span(WRITE_BACK, r, now);
            }
            stages.record_span(TOTAL, admitted, now);
            self.counters[counters].0.time(admitted, now);
        }
    }
}

/// Tells a client that asked that the broker drains: its connection takes no more calls
/// (`ext::DRAINING_KEY`).
pub(crate) fn put_drain_notice(out: &mut bytes::BytesMut) {
    ext::put_drain_notice(out, "broker", "rpcmesh-broker");
}

/// Writes the broker's answer to a caller's heartbeat `id` with `body` to `out`: one of its
/// own under the same id, saying which call fields it takes (the deadline) when asked.
/// Both engines answer so.
pub(crate) fn put_heartbeat_answer(out: &mut bytes::BytesMut, id: u64, body: &[u8]) {
    let asked = Heartbeat::extra_value_in(body, ext::HEARTBEAT_KEY).is_ok_and(|v| v.is_some());
    let extra: &[(&str, &str)] = if asked {
        &[(ext::HEARTBEAT_KEY, ext::BROKER_FIELDS)]
    } else {
        &[]
    };
    let _ = Heartbeat::put_now_with(out, id, "broker", "rpcmesh-broker", extra);
}
