//! The provider side of the loop engine: the connections to each provider (made at the
//! start, kept alive and checked with heartbeats, made again when lost, backing off),
//! the calls in flight on each by neutral id, the frames they are written as, their
//! replies, and their deadlines.

use std::io;
use std::mem;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::event::Event;
use mio::net::TcpStream;
use mio::{Interest, Token};
use rpcmesh_common::net::backoff::Backoff;
use rpcmesh_common::net::session::WRITE_BACKLOG_LIMIT;
use rpcmesh_common::net::slots::SlotTable;
use rpcmesh_common::net::thinned::Thinned;
use rpcmesh_wire::PeerKind;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::{body_in_place, skip_frame, trailer_in_place};
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{
    FRAME_OVERHEAD, Flags, FrameError, Header, MsgType, put_frame, put_frame_with_trailer,
};
use rpcmesh_wire::neutral::neutral_id;

use super::route::{Provider, Routes};
use super::session::SessionRef;
use super::socket::{Filled, Socket};
use super::{Engine, FIRST_UPSTREAM};
use crate::call::{CallInfo, MIN_REPLY_BODY, write_reply_to};
use crate::config::BrokerConfig;
use crate::failure::{ConnEnd, Failure};
use crate::upstream::connection::{SKIP_FACTOR, sweep_period};

/// The provider connections are looked after at most this often, whatever their times
/// say: a retry or a deadline due at once costs one look a millisecond, not one a round.
const KEEP_AT_MOST_EVERY: Duration = Duration::from_millis(1);

/// Log lines for lost provider connections and failed connects, thinned.
static LOST_LINES: Thinned = Thinned::new();

/// A call in flight on a provider connection.
#[derive(Debug)]
pub(super) struct Call {
    pub session: SessionRef,
    /// The caller's id, and its flags (which statuses it takes).
    pub caller_id: u64,
    pub flags: Flags,
    pub deadline: Instant,
    /// What the deadline allowed: the caller's budget or the call timeout.
    pub limit: Duration,
    /// Its (service, method) pair's tag in the counts (`super::metrics`).
    pub tag: u32,
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
    last_heartbeat: Instant,
    /// The provider said, answering a heartbeat, that it takes a call's deadline
    /// (`rpcmesh_wire::ext`), and that it caps every call's at the call timeout the
    /// broker gave it (`ext::CAP_KEY`).
    takes_deadline: bool,
    takes_cap: bool,
}

impl Upstream {
    pub fn is_up(&self) -> bool {
        matches!(self.state, State::Up(_))
    }

    /// Its calls in flight when it may take another: up, and its calls not yet written
    /// under the write backlog limit (a provider that does not read cannot make the
    /// broker buffer without end).
    pub fn load(&self) -> Option<usize> {
        match &self.state {
            State::Up(sock) if sock.out.len() < WRITE_BACKLOG_LIMIT => Some(self.calls.len()),
            _ => None,
        }
    }

    /// Writes what the socket takes of what this round gave it.
    pub fn flush(&mut self) -> io::Result<()> {
        match &mut self.state {
            State::Up(sock) => sock.flush(),
            _ => Ok(()),
        }
    }
}

/// The providers of `config`, each resolved, and `--pool-size` connections to each, to
/// be made by the loop's first round.
pub(super) fn providers(config: &BrokerConfig) -> (Routes, Vec<Upstream>) {
    let mut routes = Routes::default();
    let mut upstreams = Vec::new();
    let now = Instant::now();
    for spec in &config.upstreams {
        let p = routes.providers.len();
        let mut conns = Vec::new();
        for _ in 0..config.pool_size.max(1) {
            conns.push(upstreams.len());
            upstreams.push(Upstream {
                provider: p,
                state: State::Down { retry_at: now },
                calls: SlotTable::keyed(),
                backoff: Backoff::default(),
                heartbeat_sent: None,
                last_heartbeat: now,
                takes_deadline: false,
                takes_cap: false,
            });
        }
        let provider = Provider {
            label: spec.label().into(),
            host: spec.addr.clone(),
            addr: resolve(&spec.addr),
            kind: spec.kind,
            conns,
            outstanding: 0,
        };
        routes.add(provider, &spec.services);
    }
    (routes, upstreams)
}

/// The first address `host` resolves to. Blocking: done at the start, and at a connect
/// only while a provider's name has never resolved.
fn resolve(host: &str) -> Option<SocketAddr> {
    host.to_socket_addrs().ok().and_then(|mut a| a.next())
}

impl Engine {
    /// Writes `call` to provider connection `k`: `inner` is its v1 body, `as_sent` how
    /// its frame came. A provider that takes deadlines is given the call's, as it came
    /// when it may go on unchanged: the call is written in the round that read it, so the
    /// time left is its whole budget, or, for a provider that caps every call at the call
    /// timeout, what that cap leaves. The call back when the connection's table is full.
    pub(super) fn send(
        &mut self,
        k: usize,
        call: Call,
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
        let (caller_id, limit) = (call.caller_id, call.limit);
        if up.calls.len() >= rpcmesh_common::net::slots::KEYED_SLOTS {
            return Err(call);
        }
        let (id, _) = up
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
        // The time left to give the provider: none when it takes no deadline, or caps
        // every call at the call timeout itself (what the call has left, in the round
        // that read it).
        let left = (up.takes_deadline && !up.takes_cap).then_some(limit);
        let out = &mut sock.out;
        match as_sent {
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
        self.routes.providers[p].outstanding += 1;
        Ok(())
    }

    /// Handles a readiness event of provider connection `k`.
    pub(super) fn on_upstream_event(&mut self, k: usize, event: &Event) {
        let closed = event.is_read_closed() || event.is_error();
        let Some(up) = self.upstreams.get_mut(k) else {
            return;
        };
        if let State::Connecting { sock, .. } = &mut up.state {
            if !(event.is_writable() || closed) {
                return;
            }
            // Made once the socket has a peer; failed when it holds an error.
            match (sock.stream.take_error(), sock.stream.peer_addr()) {
                (Ok(None), Ok(_)) => self.made(k),
                (Ok(None), Err(e)) if e.kind() == io::ErrorKind::NotConnected => return,
                (Ok(Some(e)) | Err(e), _) | (Ok(None), Err(e)) => {
                    return self.upstream_lost(k, ConnEnd::Socket(Arc::new(e)));
                }
            }
        }
        if event.is_readable() || closed {
            self.read_upstream(k, closed);
        }
    }

    /// Connection `k` is made: it is asked which call fields its provider takes.
    fn made(&mut self, k: usize) {
        let up = &mut self.upstreams[k];
        let State::Connecting { sock, .. } =
            mem::replace(&mut up.state, State::Down { retry_at: self.now })
        else {
            return;
        };
        up.state = State::Up(sock);
        up.backoff.reset();
        self.send_heartbeat(k);
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
            (ext::HEARTBEAT_KEY, ""),
            (ext::CAP_KEY, self.cap_value.as_str()),
        ];
        let extra: &[(&str, &str)] = if rpcmesh { &ask } else { &[] };
        if Heartbeat::put_now_with(&mut sock.out, 0, "broker", "rpcmesh-broker", extra).is_ok() {
            up.heartbeat_sent = Some(self.now);
            up.last_heartbeat = self.now;
        }
    }

    /// A heartbeat answer on connection `k`: the provider is alive, and takes the call
    /// fields it names.
    fn on_heartbeat(&mut self, k: usize, body: &[u8]) {
        let up = &mut self.upstreams[k];
        up.heartbeat_sent = None;
        if let Ok(fields) = Heartbeat::extra_value_in(body, ext::HEARTBEAT_KEY) {
            let takes = |field| fields.is_some_and(|v| ext::takes(v, field));
            up.takes_deadline = takes(ext::DEADLINE_FIELD);
            up.takes_cap = takes(ext::DEADLINE_CAP_FIELD);
        }
    }

    /// Reads provider connection `k` until it is drained, each reply to its caller.
    fn read_upstream(&mut self, k: usize, to_the_end: bool) {
        loop {
            let State::Up(sock) = &mut self.upstreams[k].state else {
                return;
            };
            let filled = match sock.fill(&mut self.scratch, to_the_end) {
                Ok(f) => f,
                Err(e) => return self.upstream_lost(k, ConnEnd::Socket(Arc::new(e))),
            };
            if let Err(end) = self.take_replies(k) {
                return self.upstream_lost(k, end);
            }
            match filled {
                Filled::More => {}
                Filled::Drained => return,
                Filled::Closed => return self.upstream_lost(k, ConnEnd::ClosedByProvider),
            }
        }
    }

    /// Hands each whole reply provider connection `k` has read to its caller. A reply
    /// whose call has gone (timed out, its connection lost before) is dropped.
    fn take_replies(&mut self, k: usize) -> Result<(), ConnEnd> {
        let State::Up(sock) = &mut self.upstreams[k].state else {
            return Ok(());
        };
        let mut rbuf = mem::take(&mut sock.rbuf);
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
                        MsgType::Request | MsgType::ExtRequest => {}
                    }
                    skip_frame(&mut rbuf, &h);
                }
                Ok(None) => break Ok(()),
                Err(e) => match self.on_bad_reply(k, &mut rbuf, e) {
                    Ok(left) => skip = left,
                    Err(end) => break Err(end),
                },
            }
        };
        if let State::Up(sock) = &mut self.upstreams[k].state {
            sock.rbuf = rbuf;
            if skip > 0 {
                sock.skip(skip);
            }
        }
        result
    }

    /// A reply: to its caller, under the caller's id.
    fn on_reply(&mut self, k: usize, h: &Header, body: &[u8], trailer: u32) {
        let Some(call) = self.upstreams[k].calls.take(h.req_id) else {
            return;
        };
        let p = self.upstreams[k].provider;
        self.routes.providers[p].outstanding -= 1;
        if body.len() < MIN_REPLY_BODY {
            return self.answer_call(&call, &Failure::MalformedReply);
        }
        let info = CallInfo {
            client_id: call.caller_id,
            client_flags: call.flags,
            tag: 0,
            admitted: self.now,
            routed: None,
            replied: None,
        };
        let flags = h.flags;
        if self.deliver(&call, |out| {
            write_reply_to(out, flags, body, Some(trailer), info)
        }) {
            self.summary.replied += 1;
        }
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
            self.answer_call(&call, &Failure::ReplyRefused { provider, error: e });
        }
        Ok(left)
    }

    /// Provider connection `k` is lost: its calls are answered, and it is made again
    /// after a pause that grows while the provider cannot be reached.
    pub(super) fn upstream_lost(&mut self, k: usize, cause: ConnEnd) {
        let up = &mut self.upstreams[k];
        let retry_at = self.now + up.backoff.pause();
        let old = mem::replace(&mut up.state, State::Down { retry_at });
        if let State::Up(mut sock) | State::Connecting { mut sock, .. } = old {
            let _ = self.poll.registry().deregister(&mut sock.stream);
        }
        (up.takes_deadline, up.takes_cap, up.heartbeat_sent) = (false, false, None);
        let p = up.provider;
        let provider = self.routes.providers[p].label.clone();
        let calls: Vec<(u64, Call)> = up.calls.drain().collect();
        if let Some(a) = LOST_LINES.admit() {
            tracing::warn!(%provider, %cause, calls = calls.len(), seen = a.seen, left_out = a.left_out, "provider connection lost; made again after a pause");
        }
        self.next_keep = self.next_keep.min(retry_at);
        for (_, call) in calls {
            self.routes.providers[p].outstanding -= 1;
            let failure = Failure::ConnectionLost {
                provider: provider.clone(),
                cause: cause.clone(),
            };
            self.answer_call(&call, &failure);
        }
    }

    /// Looks after the provider connections when one of their times has come: makes
    /// those due again, gives up connects that take longer than `--connect-timeout`,
    /// sends heartbeats every `--health-interval`, and takes a connection whose heartbeat
    /// goes unanswered for `--health-timeout` for lost. Finds the next such time.
    pub(super) fn keep_upstreams(&mut self) {
        if self.now < self.next_keep {
            return;
        }
        let now = self.now;
        let mut next = now + self.config.health_interval;
        for k in 0..self.upstreams.len() {
            let up = &self.upstreams[k];
            match &up.state {
                State::Down { retry_at } if now >= *retry_at => self.connect(k),
                State::Down { retry_at } => next = next.min(*retry_at),
                State::Connecting { by, .. } if now >= *by => {
                    let timed_out = io::Error::new(io::ErrorKind::TimedOut, "connect timed out");
                    self.upstream_lost(k, ConnEnd::Socket(Arc::new(timed_out)));
                }
                State::Connecting { by, .. } => next = next.min(*by),
                State::Up(_) => match up.heartbeat_sent {
                    Some(sent) if now >= sent + self.config.health_timeout => {
                        let silent = io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no heartbeat answer within the health timeout",
                        );
                        self.upstream_lost(k, ConnEnd::Socket(Arc::new(silent)));
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
        self.next_keep = next.max(now + KEEP_AT_MOST_EVERY);
    }

    /// Starts connection `k` to its provider; down again after a pause when it cannot
    /// start (the name does not resolve, no socket).
    fn connect(&mut self, k: usize) {
        let p = self.upstreams[k].provider;
        let provider = &mut self.routes.providers[p];
        if provider.addr.is_none() {
            provider.addr = resolve(&provider.host);
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
                self.upstreams[k].state = State::Connecting { sock, by };
            }
            Err(e) => self.upstream_lost(k, ConnEnd::Socket(Arc::new(e))),
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
            up.calls.take_where(|c| c.deadline <= now, &mut expired);
            for c in up.calls.values_mut() {
                next = Some(next.map_or(c.deadline, |t| t.min(c.deadline)));
            }
            let p = up.provider;
            for (_, call) in expired.drain(..) {
                self.routes.providers[p].outstanding -= 1;
                let failure = Failure::Timeout {
                    provider: self.routes.providers[p].label.clone(),
                    after: call.limit,
                };
                self.answer_call(&call, &failure);
            }
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
                self.answer_call(&call, failure);
            }
        }
    }
}
