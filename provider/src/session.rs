//! One caller's connection to the provider (a broker's pooled connection, or a client's):
//! reads request frames, decodes the calls, runs their handlers and writes each reply as it
//! finishes, batched into as few writes as the socket allows. Answers heartbeats (with
//! the provider's time per call when a broker asks), sheds over the in-flight cap, and
//! turns bad input into error replies, counts and log lines.
//!
//! With TLS, the session begins with the handshake, and knows its caller by the identity
//! its certificate names. With a policy, every call is checked before it is decoded: the
//! connection's caller, or, on a call a broker forwarded with its caller's identity (an
//! extension request, `rpcmesh_wire::ext`), that caller, which is believed only when the
//! connection's own identity is a forwarder the policy names. A denied call is answered
//! "permission denied: IDENTITY may not call Service.Method".
//!
//! A call that carries its caller's deadline (the extension's `deadline` field: a budget
//! counted from the read that brought it) is not started once that has passed: it is
//! answered "timeout: deadline exceeded" and counted `deadline_exceeded`, so that work
//! nobody waits for any more is never begun (a call queued behind slow handlers of the
//! same read is the case). A broker's connection also gives a cap, its call timeout
//! (`ext::CAP_KEY`, in its heartbeats): every call read there then has at most that
//! budget, with a deadline field or without, which lets the broker forward calls as they
//! came.
//!
//! The provider's [`Protocol`] over the shared server-session skeleton
//! (`rpcmesh_common::net::session`: the loop, backlog limit, drain and final flush). One
//! task owns the socket, the calls waiting on handlers and the write buffer; nothing here
//! is shared with other connections but the read-only registry, the metric handles and
//! the time per call every session feeds (`Shared::pace`).

use std::collections::BinaryHeap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::stream::{FuturesUnordered, StreamExt};
use rpcmesh_common::authz::denial;
use rpcmesh_common::cli::security::Security;
use rpcmesh_common::metrics::families::InFlightShare;
use rpcmesh_common::metrics::families::ShedCap;
use rpcmesh_common::metrics::families::{Sampler, Stages};
use rpcmesh_common::metrics::{BadInputLog, ErrorKind, Side};
use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::connection::{CloseReason, FramedIo};
use rpcmesh_common::net::listener::Via;
use rpcmesh_common::net::pace::{self, PerCall};
use rpcmesh_common::net::session::{self, Protocol, Stop};
use rpcmesh_common::net::thinned::Thinned;
use rpcmesh_common::net::timer::{Aim, PreciseTimer};
use rpcmesh_common::net::tls::{Identity, Secured};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::{Heartbeat, request_names};
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::envelope::{CallCodec, put_error_response, put_not_run_response};
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{Flags, Frame, FrameError};
use rpcmesh_wire::frame::{Header, MsgType};
use tokio::net::TcpStream;
use tracing::Instrument;

use crate::ProviderConfig;
use crate::metrics::{DECODE, ENCODE, HANDLER, ProviderMetrics, QUEUE, TOTAL};
use crate::service::{HandlerFuture, Lookup, MethodId, Outcome, Registry, ServiceError};

/// What every session of one provider shares (read-only).
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: ProviderConfig,
    pub registry: Registry,
    pub metrics: ProviderMetrics,
    /// The process's budget of buffered bytes.
    pub budget: Arc<MemoryBudget>,
    /// How long a call takes on one connection (decoded, handled, encoded): every
    /// session's reads feed it, and heartbeats that ask for it are answered with it, so
    /// that a broker packs this provider's connections only as deep as that allows.
    pub pace: PerCall,
    /// TLS and the policy.
    pub security: Security,
}

/// The process's budget of denied-call log lines (a caller can cause them at will).
static DENIED_LINES: Thinned = Thinned::new();

/// Serves one connection until the caller leaves, the input is beyond repair, a timeout
/// passes, or shutdown drained it; returns why it closed.
pub(crate) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    via: Via,
    shared: Arc<Shared>,
    stop: Stop,
) -> CloseReason {
    let Ok(Secured { stream, identity }) = shared.security.accept(stream, peer, via).await else {
        return CloseReason::TlsHandshake;
    };
    let io = FramedIo::over(stream, FrameCodec::new(shared.config.max_body_len))
        .with_budget(Some(shared.budget.clone()));
    let span = tracing::debug_span!("conn", %peer);
    let timeouts = shared.config.timeouts;
    session::serve(io, Session::new(shared, identity), timeouts, stop)
        .instrument(span)
        .await
}

/// What [`Session::serve_call`] did with a request.
enum Served {
    /// Answered now; the method, when one was found.
    Now(Option<MethodId>),
    /// A handler works on it (held or pending).
    Later,
}

/// The answer to calls still in flight when the grace period ends.
const GRACE_OVER: &str = "provider shutting down: the grace period ended before the call did";
/// The answer to a call whose caller's deadline passed before it started (after the
/// status name, "timeout: ").
const DEADLINE_PASSED: &str = "deadline exceeded before the provider started the call";

struct Session {
    calls: CallCodec,
    shared: Arc<Shared>,
    pending: FuturesUnordered<Pending>,
    /// Answers held until their instant (simulated service times), earliest first.
    held: BinaryHeap<HeldAnswer>,
    /// Wakes the session for the earliest held answer.
    clock: PreciseTimer,
    scratch: BytesMut,
    /// This connection's share of the calls-in-flight gauge.
    in_flight_share: InFlightShare,
    bad_input: BadInputLog,
    /// When the current read returned (its calls' `queue` stage starts there), and the
    /// calls among its frames whose handlers ran within it: the work of a read, over those
    /// calls, is a sample of [`Shared::pace`].
    read_began: Instant,
    calls_in_read: usize,
    /// Read times of the timed calls answered this round (for the `total` stage), and
    /// their method when one was found.
    answered: Vec<(Instant, Option<MethodId>)>,
    /// Picks the calls whose stages are timed.
    sampler: Sampler,
    /// The registry index of the last call's method.
    last_method: Option<MethodId>,
    /// Whom the connection's certificate names (`None`: no certificate).
    identity: Option<Identity>,
    /// The longest budget of any call on this connection, from when it is read: the cap a
    /// broker gave in its heartbeats (`rpcmesh_wire::ext::CAP_KEY`, its own call timeout),
    /// so that it can forward a call as it came; `None` until one is given.
    deadline_cap: Option<Duration>,
    /// The broker asked to be told of the drain (`ext::DRAINING_KEY`).
    drain_notice: bool,
}

impl Protocol for Session {
    type Event = Event;

    async fn next_event(&mut self) -> Event {
        let due = self.held.peek().map(|h| h.until);
        tokio::select! {
            biased;
            Some(done) = self.pending.next(), if !self.pending.is_empty() => Event::Done(done),
            () = wait_until(&mut self.clock, due) => Event::Due,
        }
    }

    fn on_event(&mut self, event: Event, io: &mut FramedIo) {
        if let Event::Done(done) = event {
            self.finish(done, io);
        }
        // Every held answer whose time has come (within the timer's lead: it aims early by
        // its mean lateness), and every other handler that is done, go out in one write.
        let horizon = Instant::now() + self.clock.lead(Aim::Mean);
        while self.held.peek().is_some_and(|h| h.until <= horizon) {
            if let Some(h) = self.held.pop() {
                self.finish((h.meta, h.result), io);
            }
        }
        while let Some(Some(done)) = futures_util::FutureExt::now_or_never(self.pending.next()) {
            self.finish(done, io);
        }
    }

    fn on_read(&mut self) {
        // Two timestamps per read, around the work on its frames.
        self.read_began = Instant::now();
        self.calls_in_read = 0;
    }

    fn after_frames(&mut self) {
        if self.calls_in_read > 0 {
            let busy = self.read_began.elapsed();
            self.shared.pace.note(busy, self.calls_in_read);
        }
    }

    fn on_request(&mut self, frame: Frame, io: &mut FramedIo, draining: bool) {
        if !draining && self.shared.security.authz.is_some() {
            let caller = self.identity.clone();
            if !self.authorized(&frame, caller.as_ref().map(|i| i.as_str()), io) {
                return;
            }
        }
        let deadline = self.deadline_cap.map(|cap| self.read_began + cap);
        self.serve_request(frame, io, draining, deadline);
    }

    /// A call a broker forwarded with its caller's identity: the caller is believed only
    /// when the policy names this connection's peer as a forwarder; the call is then
    /// authorized as the caller's, and served as the plain call inside.
    fn on_ext_request(&mut self, frame: Frame, io: &mut FramedIo, draining: bool) {
        let (id, flags) = (frame.header.req_id, frame.header.flags);
        let (caller, deadline, inner) = match ext::split(&frame.body) {
            Ok((fields, inner)) => {
                // The earlier of the call's own deadline and the connection's cap.
                let budget = match (fields.deadline, self.deadline_cap) {
                    (Some(d), Some(cap)) => Some(d.min(cap)),
                    (d, cap) => d.or(cap),
                };
                let deadline = budget.map(|budget| self.read_began + budget);
                (fields.caller.map(str::to_string), deadline, inner)
            }
            Err(e) => {
                // Counted as bad input; answered, since the request id is known.
                self.bad_input.record(&e);
                let msg = e.to_string();
                return self.reply_error(io, id, flags, None, Status::BadRequest, &msg);
            }
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
        if !draining && let Some(authz) = &self.shared.security.authz {
            let peer = self.identity.as_ref().map(|i| i.as_str());
            // Without a caller field the call is the peer's own (a deadline alone names
            // no one): authorized as a plain request is.
            if caller.is_some() && !authz.policy().may_forward(peer) {
                let who = peer.unwrap_or(rpcmesh_common::authz::ANONYMOUS);
                let msg = format!("permission denied: {who} may not forward callers' identities");
                return self.deny(io, &inner, &msg);
            }
            // An empty caller is an anonymous one; none at all, the forwarder's own call.
            let caller = match caller.as_deref() {
                Some("") => None,
                Some(c) => Some(c),
                None => peer,
            };
            let caller = caller.map(str::to_string);
            if !self.authorized(&inner, caller.as_deref(), io) {
                return;
            }
        }
        self.serve_request(inner, io, draining, deadline);
    }

    fn on_heartbeat(&mut self, frame: Frame, io: &mut FramedIo) {
        self.answer_heartbeat(frame, io);
    }

    fn on_unexpected(&mut self) {
        self.bad_input.unexpected();
    }

    fn on_drain(&mut self, io: &mut FramedIo) -> bool {
        if self.drain_notice {
            ext::put_drain_notice(io.wbuf(), "provider", &self.shared.config.node_id);
        }
        self.drain_notice
    }

    fn on_bad_frame(&mut self, e: &FrameError, io: &mut FramedIo) {
        if let Some((id, flags)) = self.bad_input.record(e) {
            self.reply_error(io, id, flags, None, Status::BadRequest, &e.to_string());
        }
    }

    fn after_write(&mut self, io: &mut FramedIo) {
        self.record_totals();
        self.shared.metrics.wire.add(io.take_counts());
        let now = self.in_flight();
        self.in_flight_share.report(now);
    }

    fn in_flight(&self) -> usize {
        self.pending.len() + self.held.len()
    }

    /// Handlers still at work and answers still held are answered "unavailable: shutting
    /// down" (the call may have run: its handler began).
    fn on_grace_over(&mut self, io: &mut FramedIo) {
        let metas: Vec<CallMeta> = self
            .pending
            .iter()
            .map(|p| p.meta)
            .chain(self.held.drain().map(|h| h.meta))
            .collect();
        self.pending.clear();
        for m in metas {
            self.reply_unavailable(io, m.req_id, m.flags, Some(m.method), GRACE_OVER);
        }
    }

    fn on_end(&mut self) {
        // Handlers still at work, and answers still held, have no one to answer.
        self.pending.clear();
        self.held.clear();
    }
}

impl Session {
    fn new(shared: Arc<Shared>, identity: Option<Identity>) -> Self {
        let c = &shared.config;
        Session {
            calls: c
                .call_codec(c.compression)
                .timed(shared.metrics.compression.clone()),
            pending: FuturesUnordered::new(),
            held: BinaryHeap::new(),
            clock: PreciseTimer::new(),
            scratch: BytesMut::with_capacity(1024),
            in_flight_share: InFlightShare::new(shared.metrics.in_flight.clone()),
            bad_input: BadInputLog::new(shared.metrics.errors.clone(), Side::Client),
            read_began: Instant::now(),
            deadline_cap: None,
            drain_notice: false,
            calls_in_read: 0,
            answered: Vec::new(),
            sampler: shared.metrics.stages.sampler(),
            last_method: None,
            identity,
            shared,
        }
    }

    /// Serves a request the policy (if any) let through: timed on a sample, answered now
    /// or when its handler is done. `deadline`: the caller's, when the call carried one.
    fn serve_request(
        &mut self,
        frame: Frame,
        io: &mut FramedIo,
        draining: bool,
        deadline: Option<Instant>,
    ) {
        // Only a sample of the calls is timed.
        let timed = self.shared.metrics.stages.on() && self.sampler.pick();
        let read_at = timed.then_some(self.read_began);
        if let Served::Now(method) = self.serve_call(frame, read_at, io, draining, deadline) {
            self.answered.extend(read_at.map(|t| (t, method)));
        }
    }

    /// Answers a heartbeat: with the time per call and the call extension's fields when
    /// a broker asks (`rpcmesh_common::net::pace`, `rpcmesh_wire::ext`); anyone else gets
    /// the plain answer.
    fn answer_heartbeat(&mut self, frame: Frame, io: &mut FramedIo) {
        let (asked, ext_asked) = match Heartbeat::parse(&frame.body) {
            Ok(hb) => {
                if let Some(cap) = hb.extra_value(ext::CAP_KEY).and_then(ext::parse_cap) {
                    self.deadline_cap = Some(cap);
                }
                let fields = hb.extra_value(ext::HEARTBEAT_KEY);
                self.drain_notice |= fields.is_some_and(|v| ext::takes(v, ext::DRAIN_NOTICE_FIELD));
                (
                    hb.extra_value(pace::HEARTBEAT_KEY).is_some(),
                    fields.is_some(),
                )
            }
            Err(e) => {
                self.on_bad_frame(&e, io);
                (false, false)
            }
        };
        let node_id = &self.shared.config.node_id;
        let value = asked.then(|| self.shared.pace.to_heartbeat_value());
        let mut pairs: Vec<(&str, &str)> = Vec::with_capacity(2);
        if let Some(v) = &value {
            pairs.push((pace::HEARTBEAT_KEY, v.as_str()));
        }
        if ext_asked {
            let fields = match self.deadline_cap {
                Some(_) => ext::PROVIDER_FIELDS_CAPPED,
                None => ext::PROVIDER_FIELDS,
            };
            pairs.push((ext::HEARTBEAT_KEY, fields));
        }
        let extra = &pairs[..];
        let id = frame.header.req_id;
        if let Err(e) = Heartbeat::put_now_with(io.wbuf(), id, "provider", node_id, extra) {
            tracing::warn!(error = %e, "heartbeat reply not encodable (node id too long?)");
        }
    }

    /// Whether the policy lets `caller` (`None`: anonymous) make the call in `frame`;
    /// when not, the call is answered "permission denied" and counted. A request whose
    /// names cannot be read is let through, to be answered "bad request" as always.
    fn authorized(&mut self, frame: &Frame, caller: Option<&str>, io: &mut FramedIo) -> bool {
        let Some(authz) = &self.shared.security.authz else {
            return true;
        };
        let Ok((s, m, _)) = request_names(&frame.body) else {
            return true;
        };
        let (Ok(service), Ok(method)) = (
            std::str::from_utf8(&frame.body[s]),
            std::str::from_utf8(&frame.body[m]),
        ) else {
            return true;
        };
        if authz.policy().allows(caller, service, method) {
            return true;
        }
        let msg = denial(caller, service, method);
        self.deny(io, frame, &msg);
        false
    }

    /// Answers a call "permission denied" with `msg`, counts it (by its method when the
    /// registry has it) and logs it, thinned.
    fn deny(&mut self, io: &mut FramedIo, frame: &Frame, msg: &str) {
        let (id, flags) = (frame.header.req_id, frame.header.flags);
        let names = request_names(&frame.body).ok();
        let method = names.as_ref().and_then(|(s, m, _)| {
            match self
                .shared
                .registry
                .lookup(&frame.body[s.clone()], &frame.body[m.clone()])
            {
                Lookup::Found(_, id) => Some(id),
                _ => None,
            }
        });
        let known = method.and_then(|id| self.shared.registry.names_of(id));
        self.shared.security.denied.deny(known);
        if let Some(a) = DENIED_LINES.admit() {
            tracing::warn!(denied = a.seen, left_out = a.left_out, "{msg}");
        }
        self.reply_error(io, id, flags, method, Status::PermissionDenied, msg);
    }

    /// Serves one request: answered now (with the method, when one was found), or later (a
    /// handler works on it).
    /// `read_at` is set when this call's stages are timed; `deadline` when the caller sent
    /// one.
    fn serve_call(
        &mut self,
        frame: Frame,
        read_at: Option<Instant>,
        io: &mut FramedIo,
        draining: bool,
        deadline: Option<Instant>,
    ) -> Served {
        let stamp = || read_at.map(|_| Instant::now());
        let (id, flags) = (frame.header.req_id, frame.header.flags);
        if draining {
            // Not started: the caller (a broker) may send it to another provider.
            self.shared
                .metrics
                .errors
                .inc(ErrorKind::Unavailable, Side::Provider);
            put_not_run_response(io.wbuf(), id, flags, "provider shutting down");
            self.shared.metrics.calls(None).inc(Status::Unavailable);
            return Served::Now(None);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            // Its caller has given up: the work is not begun.
            self.shared
                .metrics
                .errors
                .inc(ErrorKind::DeadlineExceeded, Side::Client);
            self.reply_error(io, id, flags, None, Status::Timeout, DEADLINE_PASSED);
            return Served::Now(None);
        }
        if self.shared.budget.refuses(frame.body.len()) {
            self.shared.metrics.shed.inc(ShedCap::Memory);
            self.shared
                .metrics
                .errors
                .inc(ErrorKind::Overloaded, Side::Provider);
            let msg = format!(
                "provider memory budget of {} MiB spent",
                self.shared.budget.limit() >> 20
            );
            self.reply_error(io, id, flags, None, Status::Overloaded, &msg);
            return Served::Now(None);
        }
        let cap = self.shared.config.max_in_flight_per_conn;
        if self.in_flight() >= cap {
            self.shared.metrics.shed.inc(ShedCap::PerConnection);
            self.shared
                .metrics
                .errors
                .inc(ErrorKind::Overloaded, Side::Provider);
            let msg = format!("provider has {cap} calls in flight on this connection");
            self.reply_error(io, id, flags, None, Status::Overloaded, &msg);
            return Served::Now(None);
        }
        let started = stamp();
        let call = match self.calls.decode_request(&frame) {
            Ok(c) => c,
            Err(e) => {
                self.shared
                    .metrics
                    .errors
                    .inc(ErrorKind::of_call(&e), Side::Client);
                self.reply_error(io, id, flags, None, Status::BadRequest, &e.to_string());
                return Served::Now(None);
            }
        };
        let decoded = stamp();
        let stages = &self.shared.metrics.stages;
        stage(stages, QUEUE, read_at, started);
        stage(stages, DECODE, started, decoded);
        let shared = &*self.shared;
        shared.metrics.payload.received(call.size);
        // Most connections call one method over and over: try the last one first (its
        // names are the registry's, so nothing is copied or kept from the read buffer).
        let registry = &shared.registry;
        let lookup = match self.last_method {
            Some(id) if registry.is_method(id, &call.request.service, &call.request.method) => {
                Lookup::Found(registry.handler(id), id)
            }
            _ => registry.lookup(&call.request.service, &call.request.method),
        };
        let (handler, method) = match lookup {
            Lookup::Found(h, m) => {
                self.last_method = Some(m);
                (h, m)
            }
            miss => {
                let (service, method) = (call.request.service_name(), call.request.method_name());
                if let Some((kind, msg)) = miss.not_found(service, method) {
                    shared.metrics.errors.inc(kind, Side::Client);
                    self.reply_error(io, id, flags, None, Status::Failed, &msg);
                }
                return Served::Now(None);
            }
        };
        self.scratch.clear();
        let outcome = handler.call(call.rpc, &mut self.scratch);
        // A handler that answered (or whose answer waits for its instant without the CPU)
        // did its work within the read: a call of the read's sample (`Shared::pace`). One
        // whose answer is a future works when the session polls it, outside the sample.
        // Refusals and error replies before this point cost little and are not calls the
        // sample is about: their time is spread over the handled calls, which errs towards
        // packing less.
        if !matches!(outcome, Outcome::Later(_)) {
            self.calls_in_read += 1;
        }
        let meta = CallMeta {
            req_id: id,
            flags,
            method,
            read_at,
            decoded,
        };
        match outcome {
            Outcome::Ready(Ok(())) => {
                let handled = stamp();
                let answer = std::mem::take(&mut self.scratch);
                self.reply_ok(io, id, flags, method, &answer);
                self.scratch = answer;
                let stages = &self.shared.metrics.stages;
                stage(stages, HANDLER, decoded, handled);
                stage(stages, ENCODE, handled, stamp());
            }
            Outcome::Ready(Err(e)) => self.reply_service_error(io, id, flags, method, &e),
            Outcome::At(until, result) => {
                let result = result.map(|()| self.scratch.split().freeze());
                self.held.push(HeldAnswer {
                    until,
                    meta,
                    result,
                });
                return Served::Later;
            }
            Outcome::Later(fut) => {
                self.pending.push(Pending { fut, meta });
                return Served::Later;
            }
        }
        Served::Now(Some(method))
    }

    fn finish(
        &mut self,
        (done, result): (CallMeta, Result<Bytes, ServiceError>),
        io: &mut FramedIo,
    ) {
        let stamp = || done.read_at.map(|_| Instant::now());
        let handled = stamp();
        stage(&self.shared.metrics.stages, HANDLER, done.decoded, handled);
        match result {
            Ok(answer) => {
                self.reply_ok(io, done.req_id, done.flags, done.method, &answer);
                stage(&self.shared.metrics.stages, ENCODE, handled, stamp());
            }
            Err(e) => self.reply_service_error(io, done.req_id, done.flags, done.method, &e),
        }
        self.answered
            .extend(done.read_at.map(|t| (t, Some(done.method))));
    }

    /// Records the total time of every timed call answered this round, once its reply
    /// has been handed to the socket.
    fn record_totals(&mut self) {
        if self.answered.is_empty() {
            return;
        }
        let now = Instant::now();
        let m = &self.shared.metrics;
        for (read_at, method) in self.answered.drain(..) {
            m.stages.record_span(TOTAL, read_at, now);
            if method.is_some() {
                m.calls(method).time(read_at, now);
            }
        }
    }

    fn reply_ok(
        &mut self,
        io: &mut FramedIo,
        id: u64,
        flags: Flags,
        method: MethodId,
        answer: &[u8],
    ) {
        let m = &self.shared.metrics;
        match self.calls.put_ok_response(io.wbuf(), id, flags, answer) {
            Ok(size) => {
                m.payload.sent(size);
                m.calls(Some(method)).inc(Status::Success);
            }
            // A reply over the frame limit would be refused by the caller (a broker would
            // lose it): the codec has left it unwritten; answer "failed".
            Err(FrameError::TooLarge { body_len, max, .. }) => {
                m.errors.inc(ErrorKind::TooLarge, Side::Provider);
                let msg = format!("reply of {body_len} bytes exceeds the frame limit of {max}");
                self.reply_error(io, id, flags, Some(method), Status::Failed, &msg);
            }
            Err(e) => {
                tracing::warn!(error = %e, "reply not encodable");
                self.reply_error(
                    io,
                    id,
                    flags,
                    Some(method),
                    Status::Failed,
                    &format!("reply not encodable: {e}"),
                );
            }
        }
    }

    fn reply_service_error(
        &mut self,
        io: &mut FramedIo,
        id: u64,
        flags: Flags,
        method: MethodId,
        e: &ServiceError,
    ) {
        let (kind, side) = match e {
            ServiceError::BadPayload { .. } => (ErrorKind::Decode, Side::Client),
            ServiceError::Failed(_) => (ErrorKind::Failed, Side::Provider),
        };
        self.shared.metrics.errors.inc(kind, side);
        self.reply_error(io, id, flags, Some(method), e.status(), &e.to_string());
    }

    /// Answers "unavailable" (the provider is going away) and counts it.
    fn reply_unavailable(
        &mut self,
        io: &mut FramedIo,
        id: u64,
        flags: Flags,
        method: Option<MethodId>,
        msg: &str,
    ) {
        self.shared
            .metrics
            .errors
            .inc(ErrorKind::Unavailable, Side::Provider);
        self.reply_error(io, id, flags, method, Status::Unavailable, msg);
    }

    fn reply_error(
        &mut self,
        io: &mut FramedIo,
        id: u64,
        flags: Flags,
        method: Option<MethodId>,
        status: Status,
        msg: &str,
    ) {
        put_error_response(io.wbuf(), id, flags, status, msg);
        self.shared.metrics.calls(method).inc(status);
    }
}

/// Records a stage when both ends were stamped.
fn stage(stages: &Stages, which: usize, from: Option<Instant>, to: Option<Instant>) {
    if let (Some(f), Some(t)) = (from, to) {
        stages.record_span(which, f, t);
    }
}

/// What the reply to a call needs besides the handler's answer.
#[derive(Clone, Copy)]
struct CallMeta {
    req_id: u64,
    flags: Flags,
    method: MethodId,
    read_at: Option<Instant>,
    decoded: Option<Instant>,
}

/// What the session waits for besides its socket.
enum Event {
    /// A handler's future resolved.
    Done((CallMeta, Result<Bytes, ServiceError>)),
    /// The earliest held answer is due.
    Due,
}

/// An answer held until its instant (ordered by it alone: answers due together go out
/// in one write).
struct HeldAnswer {
    until: Instant,
    meta: CallMeta,
    result: Result<Bytes, ServiceError>,
}

impl PartialEq for HeldAnswer {
    fn eq(&self, other: &Self) -> bool {
        self.until == other.until
    }
}
impl Eq for HeldAnswer {}
impl PartialOrd for HeldAnswer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for HeldAnswer {
    /// Reversed, so that the heap's top is the earliest.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.until.cmp(&self.until)
    }
}

/// Waits until `due` on `clock`, aimed at it on average (for ever when `None`).
async fn wait_until(clock: &mut PreciseTimer, due: Option<Instant>) {
    match due {
        Some(due) => clock.wait_until(due, Aim::Mean).await,
        None => std::future::pending().await,
    }
}

/// A call whose handler answers later.
struct Pending {
    fut: HandlerFuture,
    meta: CallMeta,
}

impl Future for Pending {
    type Output = (CallMeta, Result<Bytes, ServiceError>);
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let result = std::task::ready!(self.fut.as_mut().poll(cx));
        Poll::Ready((self.meta, result))
    }
}
