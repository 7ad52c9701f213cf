//! The provider side of the loop engine: the connections to each provider (made at the
//! start, kept alive and checked with heartbeats, made again when lost, backing off),
//! the calls in flight on each by neutral id, the frames they are written as, their
//! replies, and their deadlines.

use std::io;
use std::mem;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::event::Event;
use mio::net::TcpStream;
use mio::{Interest, Token};
use rpcmesh_common::metrics::{ErrorKind, Side};
use rpcmesh_common::net::backoff::Backoff;
use rpcmesh_common::net::budget::{Held, MemoryBudget, Reserved};
use rpcmesh_common::net::listener::AcceptObserver;
use rpcmesh_common::net::session::WRITE_BACKLOG_LIMIT;
use rpcmesh_common::net::slots::SlotTable;
use rpcmesh_common::net::thinned::Thinned;
use rpcmesh_common::net::tls::Refusal;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::{body_in_place, skip_frame, trailer_in_place};
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{
    FRAME_OVERHEAD, Flags, FrameError, Header, MsgType, put_frame, put_frame_with_trailer,
};
use rpcmesh_wire::neutral::neutral_id;
use rpcmesh_wire::{PeerKind, Status};

use super::reroute::Retry;
use super::route::Down;
use super::session::SessionRef;
use super::socket::{Filled, Socket};
use super::{Engine, FIRST_UPSTREAM};
use crate::call::{CallInfo, MIN_REPLY_BODY, Reroute, status_of, write_reply_to};
use crate::failure::{ConnEnd, Failure};
use crate::resilience::outlier::Verdict;
use crate::upstream::connection::kept::{self, Kept, Ring};
use crate::upstream::connection::{SKIP_FACTOR, failure_verdict, sweep_period, verdict_of};
use crate::upstream::pace::Backlog;
use rpcmesh_common::net::pace::{HEARTBEAT_KEY as PACE_KEY, PerCall};

/// The provider connections are looked after at most this often, whatever their times
/// say: a retry or a deadline due at once costs one look a millisecond, not one a round.
const KEEP_AT_MOST_EVERY: Duration = Duration::from_millis(1);

/// Log lines for lost provider connections, thinned.
static LOST_LINES: Thinned = Thinned::new();
/// Log lines for failed connects to providers, thinned.
static CONNECT_LINES: Thinned = Thinned::new();
/// Log lines for refused TCP_QUICKACKs, thinned.
static QUICK_ACK_LINES: Thinned = Thinned::new();

/// A call in flight on a provider connection.
#[derive(Debug)]
pub(super) struct Call {
    pub session: SessionRef,
    /// The caller's id, and its flags (which statuses it takes).
    pub caller_id: u64,
    pub flags: Flags,
    /// When it was read, and how long it may take: the caller's budget or the call
    /// timeout. (Its deadline is not kept apart: a call moves by value, and a smaller
    /// one is moved without a `memcpy` call.)
    admitted: Instant,
    pub limit: Duration,
    /// A large request's bytes, counted in the memory budget until its outcome is
    /// written (about as many come back).
    pub reserved: Option<Reserved>,
    /// Its stamps' index, when its stages are timed (`super::stages`).
    pub timed: Option<u32>,
    /// Its (service, method) pair's tag in the counts (`super::metrics`).
    pub tag: u32,
    /// Where its frame starts in its connection's stream (the bytes ever queued on it
    /// before), and how long it is: written once the socket has taken it all.
    at: u64,
    len: u32,
    pub retry: Retry,
}

impl Call {
    /// A call from `session` under the caller's `caller_id` and `flags`, read at
    /// `admitted` and answered within `limit`, counted under `tag`.
    pub fn new(
        session: SessionRef,
        (caller_id, flags): (u64, Flags),
        (admitted, limit): (Instant, Duration),
        tag: u32,
        idempotent: bool,
    ) -> Call {
        Call {
            session,
            caller_id,
            flags,
            limit,
            admitted,
            reserved: None,
            timed: None,
            tag,
            at: 0,
            len: 0,
            retry: Retry {
                idempotent,
                ..Retry::default()
            },
        }
    }

    /// Whether it may be routed again: it has tries and time left.
    pub fn may_retry(&self, now: Instant) -> bool {
        self.retry.retries < crate::session::MAX_RETRIES && now < self.deadline()
    }

    /// When the caller gets a timeout instead.
    pub fn deadline(&self) -> Instant {
        self.admitted + self.limit
    }

    /// What [`kept::request`] needs of it: the caller's id and flags.
    fn info(&self) -> CallInfo {
        CallInfo {
            client_id: self.caller_id,
            client_flags: self.flags,
            tag: self.tag,
            admitted: self.admitted,
            routed: None,
            replied: None,
        }
    }
}

/// How a call's frame may go to its provider as it came, copied with only its id
/// rewritten to a neutral one, so that its CRC is kept (`rpcmesh_wire::neutral`).
#[derive(Debug, Clone, Copy)]
pub(super) enum AsSent<'a> {
    /// A plain request, and its CRC.
    Plain(u32),
    /// An extension request whose block holds its deadline alone: its whole body, the
    /// deadline as sent, and its CRC.
    Deadline {
        body: &'a [u8],
        budget_us: u32,
        trailer: u32,
    },
    /// Written afresh.
    No,
}

/// How a provider connection stands.
#[derive(Debug)]
enum State {
    /// Being made: lost if not made by `by` (`--connect-timeout`).
    Connecting {
        sock: Socket,
        by: Instant,
    },
    Up(Socket),
    /// Lost, or never made: made again at `retry_at`.
    Down {
        retry_at: Instant,
    },
    /// Its provider left (`super::members`): never made again.
    Gone,
}

/// One connection to a provider, and the calls in flight on it.
#[derive(Debug)]
pub(super) struct Upstream {
    provider: usize,
    state: State,
    calls: SlotTable<Call>,
    /// The pauses between attempts while the provider cannot be reached.
    backoff: Backoff,
    /// When the heartbeat now unanswered was sent; when the last one was.
    heartbeat_sent: Option<Instant>,
    /// It answered a heartbeat since it was made: it takes calls from then on (a provider
    /// that takes connections and never answers is given none, as on Tokio, where a
    /// pool's connection is checked before it is used).
    answered: bool,
    last_heartbeat: Instant,
    /// The provider said, answering a heartbeat, that it takes a call's deadline
    /// (`rpcmesh_wire::ext`), and that it caps every call's at the call timeout the
    /// broker gave it (`ext::CAP_KEY`).
    takes_deadline: bool,
    takes_cap: bool,
    /// Its provider takes its callers' identities (said in a heartbeat's answer, over
    /// TLS).
    takes_caller: bool,
    /// Its reads are acknowledged at once (a plain v1 server's, until refused).
    quick_ack: bool,
    /// Its number among the connections the engine made (at its connect): those made
    /// before a provider said it drains are retired.
    serial: u64,
    /// Takes no new call, and is closed once its calls are answered: its provider
    /// answered "unavailable" (it is going away) or said it drains.
    retiring: bool,
    /// The requests written lately, kept while they may be handed back (`kept`'s module
    /// doc): the last bytes of the connection's stream, fed once a round, when `keeps`:
    /// an rpcmesh provider may refuse its calls `NOT_RUN` or shed them, and idempotent
    /// calls lost in flight may go again (with `--idempotent`). A byte's place in the
    /// ring is `ring_base` plus its place in the stream; the stream is fed up to `fed`,
    /// and `sent` calls were written since the last feed.
    ring: Ring,
    keeps: bool,
    ring_base: u64,
    fed: u64,
    sent: usize,
    /// The bytes of the large requests written since the last feed (not in `sent`).
    sent_large: usize,
    /// What its buffers hold, told to the memory budget (none once it is gone).
    held: Option<Held>,
    /// A plain v1 server's side of its pace's measure (`crate::upstream::pace`).
    backlog: Backlog,
}

impl Upstream {
    pub fn is_up(&self) -> bool {
        matches!(self.state, State::Up(_))
    }

    /// Up, and it answered a heartbeat: it takes calls.
    pub fn is_healthy(&self) -> bool {
        self.answered && self.is_up()
    }

    /// Its calls in flight when it may take another: up, and its calls not yet written
    /// under the write backlog limit (a provider that does not read cannot make the
    /// broker buffer without end).
    pub fn load(&self) -> Option<usize> {
        match &self.state {
            State::Up(sock)
                if self.answered && sock.out.len() < WRITE_BACKLOG_LIMIT && !self.retiring =>
            {
                Some(self.calls.len())
            }
            _ => None,
        }
    }

    /// Its calls in flight.
    pub fn calls(&self) -> usize {
        self.calls.len()
    }

    /// Writes what the socket takes of what this round gave it, fed to the ring first
    /// when it keeps requests (sized for the calls in flight, at this round's length of
    /// a call, in `budget`).
    pub fn flush(&mut self, budget: &Arc<MemoryBudget>) -> io::Result<()> {
        let State::Up(sock) = &mut self.state else {
            return Ok(());
        };
        if self.keeps {
            let new = &sock.out[(self.fed - sock.written) as usize..];
            if !new.is_empty() {
                // Sized by the small requests: a large one (a memory reservation's) fits
                // no ring worth keeping, and a flood of them would hold every ring at its
                // most long after (as the Tokio engine keeps them whole instead).
                let small = new.len().saturating_sub(self.sent_large);
                let live = small / self.sent.max(1) * self.calls.len().max(1);
                if self.sent > 0 && live.saturating_mul(2) > self.ring.room() {
                    self.ring.fit(live, budget);
                }
                self.ring.feed(new);
                self.fed += new.len() as u64;
                (self.sent, self.sent_large) = (0, 0);
            }
        }
        let flushed = sock.flush();
        sock.shrink_emptied(budget);
        if let Some(held) = &mut self.held {
            held.set(sock.room());
        }
        flushed
    }

    /// Whether `call`'s request is still held: not yet written, or in the ring.
    fn holds(&self, call: &Call) -> bool {
        match &self.state {
            State::Up(sock) if call.at >= sock.written => true,
            _ => self.keeps && self.ring.holds(self.ring_base + call.at, call.len as usize),
        }
    }
}

impl Upstream {
    /// A connection of provider `p`, to be made by the next look after the connections;
    /// its buffers counted in `budget`. Whether it keeps its requests is decided when it
    /// is made (`Engine::made`).
    pub fn new(p: usize, budget: &Arc<MemoryBudget>, now: Instant) -> Upstream {
        Upstream {
            provider: p,
            state: State::Down { retry_at: now },
            calls: SlotTable::keyed(),
            backoff: Backoff::default(),
            heartbeat_sent: None,
            answered: false,
            last_heartbeat: now,
            takes_deadline: false,
            takes_cap: false,
            takes_caller: false,
            quick_ack: false,
            serial: 0,
            retiring: false,
            ring: Ring::default(),
            keeps: false,
            ring_base: 0,
            fed: 0,
            sent: 0,
            sent_large: 0,
            held: Some(Held::new(budget.clone())),
            backlog: Backlog::default(),
        }
    }

    /// Takes no new call, and is closed once its calls are answered.
    pub fn retire(&mut self) {
        self.retiring = true;
    }

    /// Whether it is gone for good (its provider left).
    pub fn is_gone(&self) -> bool {
        matches!(self.state, State::Gone)
    }
}

impl Engine {
    /// Writes `call` to provider connection `k`: `inner` is its v1 body, `as_sent` how
    /// its frame came. A provider that takes deadlines is given the time the call has
    /// left, its frame as it came when it may go on unchanged: in the round that read it
    /// the time left is its whole budget, or, for a provider that caps every call at the
    /// call timeout, what that cap leaves. The request is kept in the connection's ring
    /// when it may be handed back. The call back when the connection's table is full.
    // A call not taken is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    pub(super) fn send(
        &mut self,
        k: usize,
        mut call: Call,
        flags: Flags,
        inner: &[u8],
        as_sent: AsSent<'_>,
    ) -> Result<(), Call> {
        let p = self.upstreams[k].provider;
        let to = self.routes.providers[p].kind;
        let up = &mut self.upstreams[k];
        let State::Up(sock) = &mut up.state else {
            return Err(call);
        };
        // Ask for extended statuses always from a provider that has them: they are
        // degraded for a v1 caller on the way back.
        let out_flags = match to {
            PeerKind::Rpcmesh => flags | Flags::EXT_STATUS,
            PeerKind::V1 => Flags::NONE,
        };
        if up.calls.len() >= rpcmesh_common::net::slots::KEYED_SLOTS {
            return Err(call);
        }
        // A call routed again has less time left than its limit; any other is written in
        // the round that read it.
        let left = match (up.takes_deadline, call.retry.retries) {
            (false, _) => None,
            // A provider that caps every call at the call timeout applies the cap itself.
            (true, 0) => (!up.takes_cap).then_some(call.limit),
            (true, _) => Some(call.deadline().saturating_duration_since(self.now)),
        };
        // The caller's identity for a provider that takes it (over TLS only).
        let caller: &[u8] = match up.takes_caller {
            true => self
                .sessions
                .caller_block(call.session)
                .unwrap_or(crate::call::ANONYMOUS_CALLER),
            false => &[],
        };
        let start = sock.out.len();
        call.at = sock.written + start as u64;
        let caller_id = call.caller_id;
        let timed = call.timed;
        let (id, stored) = up
            .calls
            .insert_keyed(call, |key| neutral_id(caller_id, key))
            .expect("a key is free: the table holds fewer calls than it has keys (checked)");
        let header = |msg_type| Header {
            msg_type,
            flags: out_flags,
            body_len: 0,
            req_id: id,
        };
        let same = out_flags == flags;
        let out = &mut sock.out;
        match as_sent {
            _ if !caller.is_empty() => {
                ext::put_ext_request_with_deadline(out, out_flags, id, caller, left, inner)
            }
            AsSent::Plain(trailer) if same && left.is_none() => {
                put_frame_with_trailer(out, &header(MsgType::Request), inner, trailer)
            }
            AsSent::Deadline {
                body,
                budget_us,
                trailer,
            } if same
                && up.takes_deadline
                && left.is_none_or(|l| ext::deadline_micros(l) == budget_us) =>
            {
                put_frame_with_trailer(out, &header(MsgType::ExtRequest), body, trailer)
            }
            _ if left.is_some() => {
                ext::put_ext_request_with_deadline(out, out_flags, id, &[], left, inner)
            }
            _ => {
                let h = Header {
                    body_len: inner.len() as u32,
                    ..header(MsgType::Request)
                };
                put_frame(out, &h, inner)
            }
        }
        stored.len = (out.len() - start) as u32;
        if stored.reserved.is_some() {
            // A large request: too large for the ring to be worth sizing by.
            up.sent_large += stored.len as usize;
        } else {
            up.sent += 1;
        }
        self.routes.providers[p].outstanding += 1;
        if let Some(t) = timed {
            self.timing.resent(t);
        }
        Ok(())
    }

    /// Handles a readiness event of provider connection `k`.
    pub(super) fn on_upstream_event(&mut self, k: usize, event: &Event) {
        let closed = event.is_read_closed() || event.is_error();
        let Some(up) = self.upstreams.get_mut(k) else {
            return;
        };
        if let State::Connecting { sock, .. } = &mut up.state {
            if sock.tls.is_some() {
                // Its TLS handshake: made once it is done.
                if !self.upstream_handshake_goes_on(k, closed) {
                    return;
                }
            } else {
                if !(event.is_writable() || closed) {
                    return;
                }
                // Connected once the socket has a peer; failed when it holds an error.
                match (sock.stream.take_error(), sock.stream.peer_addr()) {
                    (Ok(None), Ok(_)) => {
                        if !self.connected(k) {
                            return;
                        }
                    }
                    (Ok(None), Err(e)) if e.kind() == io::ErrorKind::NotConnected => return,
                    (Ok(Some(e)) | Err(e), _) | (Ok(None), Err(e)) => {
                        return self.connect_failed(k, e);
                    }
                }
            }
        }
        if event.is_readable() || closed {
            self.read_upstream(k, closed);
        }
    }

    /// Connection `k`'s socket is connected: made at once, or with TLS to the providers
    /// (`--upstream-tls`) its handshake begun, to be done by the later of its connect
    /// deadline and the handshake timeout. True when it is made.
    fn connected(&mut self, k: usize) -> bool {
        let Some(tls) = self.shared.security.upstream.clone() else {
            self.made(k);
            return true;
        };
        let p = self.upstreams[k].provider;
        let began = tls.begin(&self.routes.providers[p].host);
        let State::Connecting { sock, by } = &mut self.upstreams[k].state else {
            return false;
        };
        match began {
            Ok(conn) => {
                sock.tls = Some(Box::new(rustls::Connection::Client(conn)));
                *by = (*by).max(self.now + tls.handshake_timeout());
                self.upstream_handshake_goes_on(k, false)
            }
            Err(e) => {
                tls.failed(e.reason);
                self.connect_failed(k, e.error);
                false
            }
        }
    }

    /// Drives connection `k`'s TLS handshake (`closed`: its peer has gone): writes what
    /// it has to send, reads what came. True once it is done and the connection made;
    /// a refusal (a certificate that does not prove the provider, a peer that is not
    /// TLS) is counted and the connection made again after the pause.
    fn upstream_handshake_goes_on(&mut self, k: usize, closed: bool) -> bool {
        let Some(tls) = self.shared.security.upstream.clone() else {
            return false;
        };
        let State::Connecting { sock, .. } = &mut self.upstreams[k].state else {
            return false;
        };
        let mut read = sock.fill(&mut self.scratch, closed);
        if let Ok(Filled::Closed) = read {
            read = Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        let done = read.and_then(|_| sock.flush());
        sock.take_counts(&mut self.counts.outbound);
        match done {
            Err(e) => {
                tls.failed(Refusal::of(&e));
                self.connect_failed(k, e);
                false
            }
            Ok(()) if sock.handshaking() => false,
            Ok(()) => {
                tls.done();
                self.made(k);
                true
            }
        }
    }

    /// Connection `k` is made: it is asked which call fields its provider takes, and
    /// counts as healthy once it answers.
    fn made(&mut self, k: usize) {
        let up = &mut self.upstreams[k];
        let State::Connecting { sock, .. } =
            mem::replace(&mut up.state, State::Down { retry_at: self.now })
        else {
            return;
        };
        // The new stream starts at the ring's head; it keeps requests as the calls marked
        // idempotent now say, and takes no call field until its provider says so.
        (up.ring_base, up.fed, up.sent, up.sent_large) = (up.ring.head(), 0, 0, 0);
        (up.takes_deadline, up.takes_cap, up.takes_caller) = (false, false, false);
        up.state = State::Up(sock);
        up.answered = false;
        self.up_conns.push(k);
        self.routes.providers[up.provider].failing_until = None;
        up.quick_ack = self.routes.providers[up.provider].kind == PeerKind::V1;
        let p = up.provider;
        up.keeps =
            self.routes.providers[p].kind == PeerKind::Rpcmesh || !self.idempotent.is_empty();
        self.routes.providers[p].metrics.conns.opened();
        self.send_heartbeat(k);
        self.publish_pool(p);
    }

    /// Sends a heartbeat on connection `k`: the provider's answer shows it alive, and an
    /// rpcmesh provider's says which call fields it takes, given the cap of every call's
    /// deadline here (the call timeout). Until it first answers, its calls go as plain v1
    /// calls (the broker keeps their deadlines).
    fn send_heartbeat(&mut self, k: usize) {
        let p = self.upstreams[k].provider;
        let rpcmesh = self.routes.providers[p].kind == PeerKind::Rpcmesh;
        let up = &mut self.upstreams[k];
        let State::Up(sock) = &mut up.state else {
            return;
        };
        let ask = [
            (ext::HEARTBEAT_KEY, ext::DRAIN_NOTICE_FIELD),
            (ext::CAP_KEY, self.cap_value.as_str()),
        ];
        let extra: &[(&str, &str)] = if rpcmesh { &ask } else { &[] };
        if Heartbeat::put_now_with(&mut sock.out, 0, "broker", "rpcmesh-broker", extra).is_ok() {
            up.heartbeat_sent = Some(self.now);
            up.last_heartbeat = self.now;
        }
    }

    /// A heartbeat answer on connection `k`: the provider is alive, and takes the call
    /// fields it names. A connection made after its provider said it drains brings the
    /// provider back, measured afresh (it is another process now).
    fn on_heartbeat(&mut self, k: usize, body: &[u8]) {
        let p = self.upstreams[k].provider;
        if self.routes.providers[p].kind == PeerKind::Rpcmesh && ext::tells_drain(body) {
            // Told of the provider's drain (`ext::DRAINING_KEY`, asked for in every
            // heartbeat): as after a call it refused `NOT_RUN`, its connections take no
            // new call and close once their calls are answered, before it closes them.
            self.provider_draining(p);
            return;
        }
        let up = &mut self.upstreams[k];
        up.heartbeat_sent = None;
        let first = !up.answered;
        if first {
            // In service from now on; the pause before a reconnect starts afresh (one
            // that never answers backs off as a refused connect does).
            up.answered = true;
            up.backoff.reset();
        }
        let serial = up.serial;
        let provider = &mut self.routes.providers[p];
        provider.settled = true;
        if provider.kind == PeerKind::Rpcmesh {
            if let Ok(fields) = Heartbeat::extra_value_in(body, ext::HEARTBEAT_KEY) {
                let takes = |field| fields.is_some_and(|v| ext::takes(v, field));
                up.takes_deadline = takes(ext::DEADLINE_FIELD);
                up.takes_cap = takes(ext::DEADLINE_CAP_FIELD);
                // Its callers' identities, over TLS only: a provider believes a broker's
                // word for them only when its certificate proves it one.
                up.takes_caller =
                    self.shared.security.upstream.is_some() && takes(ext::CALLER_FIELD);
            }
            // Its own time per call, for the packing; an answer without one (an older
            // provider) leaves what is known.
            if let Ok(Some(value)) = Heartbeat::extra_value_in(body, PACE_KEY) {
                provider
                    .pace
                    .reported(PerCall::parse_heartbeat_value(value));
            }
        }
        if provider.draining_below.is_some_and(|mark| serial >= mark) {
            provider.draining_below = None;
            provider
                .ewma
                .forget(self.config.resilience.ewma_default_rtt, self.now);
            provider.estimate_changed();
            tracing::info!(provider = %provider.label, "provider back after its drain");
        }
        if first {
            self.publish_pool(p);
        }
    }

    /// Reads provider connection `k` until it is drained, each reply to its caller.
    fn read_upstream(&mut self, k: usize, to_the_end: bool) {
        loop {
            let State::Up(sock) = &mut self.upstreams[k].state else {
                return;
            };
            let filled = sock.fill(&mut self.scratch, to_the_end);
            sock.take_counts(&mut self.counts.outbound);
            let filled = match filled {
                Ok(f) => f,
                Err(e) => return self.upstream_lost(k, ConnEnd::Socket(Arc::new(e))),
            };
            if let Err(end) = self.take_replies(k) {
                return self.upstream_lost(k, end);
            }
            if !self.upstreams[k].is_up() {
                return;
            }
            match filled {
                Filled::More => {}
                Filled::Drained => return self.ack_at_once(k),
                Filled::Closed => return self.upstream_lost(k, ConnEnd::ClosedByProvider),
            }
        }
    }

    /// After reading a plain v1 server's connection `k` dry: if calls (or a heartbeat)
    /// are still in flight on it, the ACK of what was read goes out now instead of up to
    /// 40 ms later, so that a server with Nagle's algorithm on sends its next reply at
    /// once (`TCP_QUICKACK`, asked again after every such read, as the Tokio engine does:
    /// docs/performance.md, "Behind a plain v1 server with Nagle on"). Counted; a refusal
    /// is logged (thinned) and turns it off for the connection.
    fn ack_at_once(&mut self, k: usize) {
        let up = &mut self.upstreams[k];
        let State::Up(sock) = &up.state else {
            return;
        };
        if !up.quick_ack || (up.calls.is_empty() && up.heartbeat_sent.is_none()) {
            return;
        }
        let p = up.provider;
        match socket2::SockRef::from(&sock.stream).set_tcp_quickack(true) {
            Ok(()) => self.routes.providers[p].metrics.quick_acks.increment(1),
            Err(e) => {
                up.quick_ack = false;
                if let Some(a) = QUICK_ACK_LINES.admit() {
                    tracing::warn!(error = %e, refused = a.seen, left_out = a.left_out, "TCP_QUICKACK refused; replies of this plain v1 server may wait for delayed ACKs");
                }
            }
        }
    }

    /// Hands each whole reply provider connection `k` has read to its caller. A reply
    /// whose call has gone (timed out, its connection lost before) is dropped. What the
    /// read says of the provider is told once it is handled: its successes to the outlier
    /// detector, its slowest reply to the latency estimate.
    fn take_replies(&mut self, k: usize) -> Result<(), ConnEnd> {
        let State::Up(sock) = &mut self.upstreams[k].state else {
            return Ok(());
        };
        let mut rbuf = mem::take(&mut sock.rbuf);
        let before = self.upstreams[k].calls.len();
        // Bytes of a frame refused on its header, still to come and to be dropped.
        let mut skip = 0;
        let result = loop {
            match self.codec.peek_frame(&mut rbuf) {
                Ok(Some(h)) => {
                    match h.msg_type {
                        MsgType::Heartbeat => self.on_heartbeat(k, body_in_place(&rbuf, &h)),
                        MsgType::Response => {
                            let trailer = trailer_in_place(&rbuf, &h);
                            self.on_reply(k, &h, body_in_place(&rbuf, &h), trailer);
                        }
                        // Requests make no sense from a provider: dropped.
                        MsgType::Request | MsgType::ExtRequest => {
                            self.counts.unexpected(Side::Provider);
                        }
                    }
                    skip_frame(&mut rbuf, &h);
                    if !self.upstreams[k].is_up() {
                        // Closed by what the frame did: the rest is for no one.
                        break Ok(());
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => match self.on_bad_reply(k, &mut rbuf, e) {
                    Ok(left) => skip = left,
                    Err(end) => break Err(end),
                },
            }
        };
        let p = self.upstreams[k].provider;
        self.tell_read(p);
        let provider = &self.routes.providers[p];
        if provider.kind == PeerKind::V1 {
            // A plain v1 server is timed between the reads that bring replies.
            let up = &mut self.upstreams[k];
            let waiting = up.calls.len();
            let answered = before.saturating_sub(waiting);
            up.backlog
                .on_read(self.now, answered, waiting, &provider.pace);
        }
        if let State::Up(sock) = &mut self.upstreams[k].state {
            sock.rbuf = rbuf;
            if skip > 0 {
                sock.skip(skip);
            }
        }
        self.retire_if_done(k);
        result
    }

    /// A reply: to its caller, under the caller's id; or, refused by the provider without
    /// being run, back to be routed again (`super::reroute`).
    fn on_reply(&mut self, k: usize, h: &Header, body: &[u8], trailer: u32) {
        let Some(call) = self.upstreams[k].calls.take(h.req_id) else {
            let errors = &self.counts.metrics.errors;
            errors.inc(ErrorKind::LateReply, Side::Provider);
            return;
        };
        let p = self.upstreams[k].provider;
        let provider = &mut self.routes.providers[p];
        provider.outstanding -= 1;
        let admitted = call.admitted;
        if provider.oldest.is_none_or(|o| admitted < o) {
            provider.oldest = Some(admitted);
        }
        if body.len() < MIN_REPLY_BODY {
            return self.fail_call(p, call, Failure::MalformedReply);
        }
        let status = status_of(body);
        let flags = h.flags;
        self.judge(p, verdict_of(status, flags, body));
        // The provider's answer, even one that sends the call elsewhere.
        self.outcome(p, status);
        let rpcmesh = self.routes.providers[p].kind == PeerKind::Rpcmesh;
        if status == Status::Overloaded && rpcmesh && self.upstreams[k].holds(&call) {
            // Shed without being run: safe to send to another, if the budget allows.
            if self.guards.budget.withdraw(self.now) {
                if let Some(request) = self.kept_request(k, &call) {
                    return self.hand_back(p, call, request, Reroute::Overloaded);
                }
            } else {
                self.counts.metrics.budget_exhausted[Reroute::Overloaded as usize].increment(1);
            }
        }
        if status == Status::Unavailable {
            // The provider is going away: no more calls on this connection.
            self.upstreams[k].retiring = true;
            if rpcmesh && flags.contains(Flags::NOT_RUN) {
                // It drains and did not run the call: none of its connections takes new
                // calls, and the call goes elsewhere.
                self.provider_draining(p);
                if let Some(request) = self.kept_request(k, &call) {
                    return self.hand_back(p, call, request, Reroute::NotRun);
                }
            }
        }
        if let Some(t) = call.timed {
            self.timing.replied(t, self.now);
        }
        let info = call.info();
        if self.deliver(&call, |out| {
            write_reply_to(out, flags, body, Some(trailer), info)
        }) {
            self.summary.replied += 1;
        }
    }

    /// The request of `call`, taken off connection `k`, as its caller sent it, if it is
    /// kept still (in the ring; or, not yet written, in the socket's output).
    fn kept_request(&self, k: usize, call: &Call) -> Option<rpcmesh_wire::frame::Frame> {
        let up = &self.upstreams[k];
        let len = call.len as usize;
        let kept = match &up.state {
            State::Up(sock) if call.at >= sock.written => Kept::Queued {
                at: (call.at - sock.written) as usize,
                len,
            },
            _ if up.keeps => Kept::Ring {
                pos: up.ring_base + call.at,
                len,
            },
            _ => return None,
        };
        let queued = match &up.state {
            State::Up(sock) => &sock.out[..],
            _ => &[],
        };
        kept::request(kept, &call.info(), queued, &up.ring)
    }

    /// Records what an outcome says of provider `p` (`crate::resilience::outlier`): a
    /// success is counted and told with the read's others, a fault at once (after the
    /// successes before it).
    fn judge(&mut self, p: usize, verdict: Verdict) {
        match verdict {
            Verdict::Neutral => {}
            Verdict::Success => self.routes.providers[p].successes += 1,
            Verdict::Fault => {
                self.tell_successes(p);
                self.routes.providers[p]
                    .outlier
                    .record(Verdict::Fault, self.now);
            }
        }
    }

    fn tell_successes(&mut self, p: usize) {
        let provider = &mut self.routes.providers[p];
        if provider.successes > 0 {
            provider.outlier.succeeded(provider.successes, self.now);
            provider.successes = 0;
        }
    }

    /// A read of provider `p`'s replies is handled: its successes are told, and its
    /// slowest reply (that of the call read first) to the latency estimate.
    fn tell_read(&mut self, p: usize) {
        self.tell_successes(p);
        let provider = &mut self.routes.providers[p];
        if let Some(oldest) = provider.oldest.take() {
            let peak = self.now.saturating_duration_since(oldest);
            if !peak.is_zero() {
                provider.ewma.observe(peak, self.now);
                provider.estimate_changed();
            }
        }
    }

    /// Answers a call taken off a connection of provider `p` with the broker's own
    /// `failure`, and judges the provider by it (`failure_verdict`); a timed-out call's
    /// wait counts as a slow reply for the balancer.
    pub(super) fn fail_call(&mut self, p: usize, call: Call, failure: Failure) {
        if let Failure::Timeout { after, .. } = &failure {
            let provider = &self.routes.providers[p];
            provider.ewma.observe(*after, self.now);
            provider.estimate_changed();
        }
        self.judge(p, failure_verdict(&failure, self.config.call_timeout));
        self.outcome(p, failure.status());
        self.answer_call(&call, &failure);
    }

    /// A frame from provider connection `k` that cannot be used: a reply's refusal fails
    /// its call alone (one too large is skipped, up to [`SKIP_FACTOR`] times the limit:
    /// what is in `rbuf` now, and the number of its bytes still to come is returned);
    /// input the stream cannot be followed past ends the connection.
    fn on_bad_reply(
        &mut self,
        k: usize,
        rbuf: &mut bytes::BytesMut,
        e: FrameError,
    ) -> Result<usize, ConnEnd> {
        self.counts.bad_input(&e, Side::Provider);
        let Some((id, Some(MsgType::Response))) = e.frame_id() else {
            return if e.is_fatal() {
                Err(ConnEnd::BadFrames(e))
            } else {
                Ok(0)
            };
        };
        let mut left = 0;
        if let FrameError::TooLarge { body_len, max, .. } = e {
            if u64::from(body_len) > u64::from(max) * SKIP_FACTOR {
                return Err(ConnEnd::BadFrames(e));
            }
            let len = FRAME_OVERHEAD + body_len as usize;
            let here = len.min(rbuf.len());
            bytes::Buf::advance(rbuf, here);
            left = len - here;
        }
        if let Some(call) = self.upstreams[k].calls.take(id) {
            let p = self.upstreams[k].provider;
            self.routes.providers[p].outstanding -= 1;
            let provider = self.routes.providers[p].label.clone();
            self.fail_call(p, call, Failure::ReplyRefused { provider, error: e });
        }
        Ok(left)
    }

    /// Provider connection `k` is lost: its calls not yet written go back to be routed
    /// again, those written and idempotent too while the retry budget allows (they may
    /// have run), the others are answered; it is made again after a pause that grows
    /// while the provider cannot be reached.
    pub(super) fn upstream_lost(&mut self, k: usize, cause: ConnEnd) {
        let p = self.upstreams[k].provider;
        let provider = self.routes.providers[p].label.clone();
        let calls: Vec<(u64, Call)> = self.upstreams[k].calls.drain().collect();
        // A connection that served is news; one that never answered, or a connect that
        // failed (`connect_failed`), is its provider's (`publish_pool`).
        let up = &self.upstreams[k];
        if up.answered {
            if let Some(a) = LOST_LINES.admit() {
                tracing::warn!(%provider, %cause, calls = calls.len(), seen = a.seen, left_out = a.left_out, "provider connection lost; made again after a pause");
            }
            self.routes.providers[p].down = Some(Down::Lost(cause.to_string()));
        } else if up.is_up() {
            self.routes.providers[p].down = Some(Down::Silent(cause.to_string()));
        }
        // Each call's request is taken while the socket's output still holds it.
        for (_, call) in calls {
            self.routes.providers[p].outstanding -= 1;
            let unsent = match &self.upstreams[k].state {
                State::Up(sock) => call.at + u64::from(call.len) > sock.written,
                _ => true,
            };
            let failure = Failure::ConnectionLost {
                provider: provider.clone(),
                cause: cause.clone(),
            };
            if unsent {
                if let Some(request) = self.kept_request(k, &call) {
                    self.hand_back(p, call, request, Reroute::Unsent);
                    continue;
                }
            } else if call.retry.idempotent
                && self.upstreams[k].holds(&call)
                && call.may_retry(self.now)
            {
                if self.guards.budget.withdraw(self.now) {
                    if let Some(request) = self.kept_request(k, &call) {
                        self.judge(p, Verdict::Fault);
                        self.outcome(p, failure.status());
                        self.hand_back(p, call, request, Reroute::Lost);
                        continue;
                    }
                } else {
                    self.counts.metrics.budget_exhausted[Reroute::Lost as usize].increment(1);
                }
            }
            self.fail_call(p, call, failure);
        }
        self.close_upstream(k, &cause);
    }

    /// Closes connection `k` (its calls are gone) and sets it to be made again after a
    /// pause that grows while the provider cannot be reached; gone for good when its
    /// provider left.
    pub(super) fn close_upstream(&mut self, k: usize, cause: &ConnEnd) {
        let up = &mut self.upstreams[k];
        let left = self.routes.providers[up.provider].left;
        let retry_at = self.now + up.backoff.pause();
        let next = if left {
            State::Gone
        } else {
            State::Down { retry_at }
        };
        let old = mem::replace(&mut up.state, next);
        let was_up = matches!(old, State::Up(_));
        if was_up {
            if let Some(at) = self.up_conns.iter().position(|&c| c == k) {
                self.up_conns.swap_remove(at);
            }
        }
        if let State::Up(mut sock) | State::Connecting { mut sock, .. } = old {
            sock.take_counts(&mut self.counts.outbound);
            let _ = self.poll.registry().deregister(&mut sock.stream);
        }
        (up.takes_deadline, up.takes_cap, up.heartbeat_sent) = (false, false, None);
        (up.retiring, up.answered) = (false, false);
        // Its buffers are gone; gone for good, so are its ring and its place in the budget.
        if left {
            (up.ring, up.held) = (Ring::default(), None);
        } else if let Some(held) = &mut up.held {
            held.set(0);
        }
        let p = up.provider;
        if was_up {
            let conns = &self.routes.providers[p].metrics.conns;
            conns.closed(cause.close_reason());
        }
        self.next_keep = self.next_keep.min(retry_at);
        self.publish_pool(p);
        if left {
            self.gone_if_closed(p);
        }
    }

    /// Closes connection `k` once it is retiring and its last call is answered; it is
    /// made again at once (a provider that went away refuses it, and the pause grows).
    pub(super) fn retire_if_done(&mut self, k: usize) {
        let up = &mut self.upstreams[k];
        if up.retiring && up.calls.is_empty() && up.is_up() {
            self.close_upstream(k, &ConnEnd::Released);
            let up = &mut self.upstreams[k];
            if up.is_gone() {
                return;
            }
            up.backoff.reset();
            up.state = State::Down { retry_at: self.now };
            self.next_keep = self.now;
        }
    }

    /// Provider `p` said it drains (a call refused `NOT_RUN`, or a drain notice): it takes no new call, and
    /// its connections made so far are retired, until a connection made after this
    /// answers a heartbeat (the provider is back, typically restarted on its address).
    fn provider_draining(&mut self, p: usize) {
        // The serial of the next connection made: every one made so far is below it.
        let mark = self.serials + 1;
        let provider = &mut self.routes.providers[p];
        if provider.draining_below.is_none() {
            tracing::warn!(provider = %provider.label, "provider draining: no new calls until it is back; the calls it refused go to other providers");
        }
        provider.draining_below = Some(mark);
        for &k in &provider.conns {
            let up = &mut self.upstreams[k];
            if matches!(up.state, State::Up(_) | State::Connecting { .. }) && up.serial < mark {
                up.retiring = true;
            }
        }
        // Those with no call left close at the next look after the connections (not here:
        // one of them may be the connection whose replies are being read).
        self.next_keep = self.now;
    }

    /// Publishes provider `p`'s connections and healthy ones (those up); a provider
    /// healthy again after it had none is measured afresh.
    /// Its health is said as the Tokio engine's pools say it: when it first has a healthy
    /// connection again, and once when it has none, with why.
    fn publish_pool(&mut self, p: usize) {
        let provider = &mut self.routes.providers[p];
        let up = provider
            .conns
            .iter()
            .filter(|&&k| self.upstreams[k].is_healthy())
            .count();
        let healthy = up > 0;
        if healthy && !provider.was_healthy {
            provider
                .ewma
                .forget(self.config.resilience.ewma_default_rtt, self.now);
            provider.estimate_changed();
            tracing::info!(provider = %provider.label, connections = up, "provider connections ready");
            (provider.down, provider.down_told) = (None, false);
        }
        if !healthy && !provider.down_told && !provider.left {
            let label = &provider.label;
            match &provider.down {
                Some(Down::Silent(e)) => {
                    tracing::warn!(provider = %label, error = %e, "provider not answering: it takes connections and does not answer their heartbeats");
                }
                Some(Down::Unreachable(e)) => {
                    tracing::warn!(provider = %label, error = %e, "provider unreachable");
                }
                Some(Down::Lost(e)) => {
                    tracing::warn!(provider = %label, error = %e, "provider has no healthy connection");
                }
                None => {}
            }
            provider.down_told = provider.down.is_some();
        }
        let changed = provider.was_healthy != healthy;
        provider.was_healthy = healthy;
        provider.metrics.publish_conns(up);
        if changed {
            self.routes.keep_healthy();
        }
    }

    /// Looks after the provider connections when one of their times has come: makes
    /// those due again, gives up connects that take longer than `--connect-timeout`,
    /// sends heartbeats every `--health-interval`, and takes a connection whose heartbeat
    /// goes unanswered for `--health-timeout` for lost; publishes each provider's gauges
    /// once a health interval. Finds the next such time.
    pub(super) fn keep_upstreams(&mut self) {
        if self.now < self.next_keep {
            return;
        }
        let now = self.now;
        let mut next = now + self.config.health_interval;
        for k in 0..self.upstreams.len() {
            self.retire_if_done(k);
            let up = &self.upstreams[k];
            match &up.state {
                State::Down { retry_at } if now >= *retry_at => self.connect_due(k),
                State::Down { retry_at } => next = next.min(*retry_at),
                State::Connecting { by, sock } if now >= *by => {
                    if sock.tls.is_some() {
                        if let Some(tls) = &self.shared.security.upstream {
                            tls.failed(Refusal::Timeout);
                        }
                    }
                    let timed_out = io::Error::new(io::ErrorKind::TimedOut, "connect timed out");
                    self.connect_failed(k, timed_out);
                }
                State::Connecting { by, .. } => next = next.min(*by),
                State::Gone => {}
                State::Up(_) => match up.heartbeat_sent {
                    Some(sent) if now >= sent + self.config.health_timeout => {
                        self.upstream_lost(k, ConnEnd::Silent(self.config.health_timeout));
                    }
                    Some(sent) => next = next.min(sent + self.config.health_timeout),
                    None if now >= up.last_heartbeat + self.config.health_interval => {
                        self.send_heartbeat(k);
                    }
                    None => next = next.min(up.last_heartbeat + self.config.health_interval),
                },
            }
            // What the steps above set comes at the next look.
            if let State::Down { retry_at } = self.upstreams[k].state {
                next = next.min(retry_at);
            }
            if let State::Connecting { by, .. } = self.upstreams[k].state {
                next = next.min(by);
            }
        }
        if now >= self.next_publish {
            self.next_publish = now + self.config.health_interval;
            for provider in &self.routes.providers {
                let loads = provider.conns.iter().map(|&k| self.upstreams[k].calls());
                let m = &provider.metrics;
                m.publish_conn_loads(provider.conns.len(), loads);
                m.publish_latency_estimate(provider.ewma.estimate(now));
                m.publish_pace(provider.pace.per_call());
            }
            next = next.min(self.next_publish);
        }
        self.next_keep = next.max(now + KEEP_AT_MOST_EVERY);
    }

    /// Counts an outcome of provider `p`'s, told to its series at the round's end
    /// (`Engine::tell_providers`, which looks only at the providers given one).
    fn outcome(&mut self, p: usize, status: Status) {
        let provider = &mut self.routes.providers[p];
        if provider.outcomes.is_empty() {
            self.told.push(p);
        }
        provider.outcomes.add(status);
    }

    /// Connection `k`'s time to be made has come: it is made now, unless its provider's
    /// connects fail (`Provider::failing_until`): then one attempt at a time is made, and
    /// the others wait for its end.
    fn connect_due(&mut self, k: usize) {
        let p = self.upstreams[k].provider;
        match self.routes.providers[p].failing_until {
            Some(t) if self.now < t => self.upstreams[k].state = State::Down { retry_at: t },
            failing => {
                if failing.is_some() {
                    // Until this attempt ends (it fails, or the connect is made).
                    let by = self.now + self.config.connect_timeout;
                    self.routes.providers[p].failing_until = Some(by);
                }
                self.connect(k);
            }
        }
    }

    /// A connect of connection `k` failed (or could not start): counted, and made again
    /// after the pause.
    fn connect_failed(&mut self, k: usize, e: io::Error) {
        let p = self.upstreams[k].provider;
        let provider = &mut self.routes.providers[p];
        provider.settled = true;
        provider.metrics.connect_failures.increment(1);
        if let Some(a) = CONNECT_LINES.admit() {
            tracing::warn!(provider = %provider.label, error = %e, failures = a.seen, left_out = a.left_out, "connect failed");
        }
        provider.down = Some(Down::Unreachable(format!("connect failed: {e}")));
        self.upstream_lost(k, ConnEnd::Socket(Arc::new(e)));
        // Its next attempt, by whichever connection, after this one's pause.
        if let State::Down { retry_at } = self.upstreams[k].state {
            self.routes.providers[p].failing_until = Some(retry_at);
        }
    }

    /// Starts connection `k` to its provider; down again after a pause when it cannot
    /// start (the name does not resolve, no socket).
    fn connect(&mut self, k: usize) {
        let p = self.upstreams[k].provider;
        let provider = &mut self.routes.providers[p];
        if provider.addr.is_none() {
            provider.addr = super::route::resolve(&provider.host);
        }
        let started = provider.addr.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "the provider's name does not resolve",
            )
        });
        let started = started.and_then(TcpStream::connect).and_then(|stream| {
            let mut sock = Socket::new(stream);
            self.poll.registry().register(
                &mut sock.stream,
                Token(FIRST_UPSTREAM + k),
                Interest::READABLE | Interest::WRITABLE,
            )?;
            Ok(sock)
        });
        match started {
            Ok(sock) => {
                let by = self.now + self.config.connect_timeout;
                self.serials += 1;
                let up = &mut self.upstreams[k];
                up.serial = self.serials;
                up.retiring = false;
                up.state = State::Connecting { sock, by };
            }
            Err(e) => self.connect_failed(k, e),
        }
    }

    /// Answers the calls past their deadline, and finds when to look next: at the next
    /// deadline, but not sooner than a sweep's period.
    pub(super) fn expire_calls(&mut self) {
        let now = self.now;
        let mut expired = Vec::new();
        let mut next: Option<Instant> = None;
        for k in 0..self.upstreams.len() {
            let up = &mut self.upstreams[k];
            up.calls.take_where(|c| c.deadline() <= now, &mut expired);
            for c in up.calls.values_mut() {
                let deadline = c.deadline();
                next = Some(next.map_or(deadline, |t| t.min(deadline)));
            }
            let p = up.provider;
            if !up.calls.is_empty() {
                // A plain v1 server silent on its calls stops being packed.
                up.backlog.on_sweep(now, &self.routes.providers[p].pace);
            }
            for (_, call) in expired.drain(..) {
                self.routes.providers[p].outstanding -= 1;
                let failure = Failure::Timeout {
                    provider: self.routes.providers[p].label.clone(),
                    after: call.limit,
                };
                self.fail_call(p, call, failure);
            }
            self.retire_if_done(k);
        }
        // Not sooner than the sweep's period: a provider that stalls makes deadlines pass
        // all the time, and a sweep each round would walk every slot in every round.
        let sweep = sweep_period(self.config.call_timeout);
        self.next_expiry = next.map(|t| t.max(now + sweep));
    }

    /// Answers every call in flight with `failure` (the drain's grace is over).
    pub(super) fn answer_all_in_flight(&mut self, failure: &Failure) {
        for k in 0..self.upstreams.len() {
            let p = self.upstreams[k].provider;
            let calls: Vec<(u64, Call)> = self.upstreams[k].calls.drain().collect();
            for (_, call) in calls {
                self.routes.providers[p].outstanding -= 1;
                self.outcome(p, failure.status());
                self.answer_call(&call, failure);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call moves by value from its read to its connection's table and out again: at
    /// 128 bytes or less the compiler moves it with a few vector stores, above with a
    /// `memcpy` call each time (measured: four calls of 29 instructions each per
    /// forwarded call at 136 bytes).
    #[test]
    fn a_call_moves_without_a_memcpy_call() {
        let size = std::mem::size_of::<Call>();
        assert!(size <= 128, "a call is {size} bytes");
    }
}
