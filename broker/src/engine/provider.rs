//! The provider side of the loop engine: the providers and their connections (made at
//! the start, made again when lost), which of them takes a call (routing and balancing),
//! the calls in flight on each by neutral id, their replies, and their deadlines.

use std::collections::HashMap;
use std::io;
use std::mem;
use std::net::ToSocketAddrs;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::event::Event;
use mio::net::TcpStream;
use mio::{Interest, Poll, Token};
use rpcmesh_common::net::slots::SlotTable;
use rpcmesh_wire::PeerKind;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::{body_in_place, skip_frame};
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{
    FRAME_OVERHEAD, Flags, Header, MsgType, put_frame, put_frame_with_trailer,
};
use rpcmesh_wire::neutral::neutral_id;

use super::session::SessionRef;
use super::socket::{Filled, Socket};
use super::{Engine, FIRST_UPSTREAM, RECONNECT_AFTER};
use crate::call::{CallInfo, write_reply_to};
use crate::config::BrokerConfig;
use crate::failure::{ConnEnd, Failure};

/// The shortest reply body: a status byte and a payload length.
const MIN_REPLY_BODY: usize = 5;

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

/// A provider, as configured.
#[derive(Debug)]
struct Provider {
    label: Arc<str>,
    addr: String,
    kind: PeerKind,
    /// Its connections, as indices of [`Engine::upstreams`], oldest first.
    conns: Vec<usize>,
    /// Its calls in flight, for the balancing.
    outstanding: usize,
}

/// Which providers serve which service.
#[derive(Debug)]
pub(super) struct Routes {
    providers: Vec<Provider>,
    /// The providers named for a service.
    named: HashMap<Box<[u8]>, Vec<usize>>,
    /// The providers given for any service.
    any: Vec<usize>,
}

/// Why no provider took a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoRoute {
    UnknownService,
    NoHealthy,
    NeedsExtension,
    Full,
}

impl NoRoute {
    pub fn failure(self, service: String) -> Failure {
        match self {
            NoRoute::UnknownService => Failure::UnknownService(service),
            NoRoute::NoHealthy => Failure::NoHealthy(service),
            NoRoute::NeedsExtension => Failure::NeedsExtension(service),
            NoRoute::Full => Failure::Full(service),
        }
    }
}

/// How a provider connection stands.
#[derive(Debug)]
enum State {
    /// Being made (a connect that has not completed).
    Connecting(Socket),
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
    /// The provider said, answering the heartbeat sent when the connection was made, that
    /// it takes a call's deadline (`rpcmesh_wire::ext`), and that it caps every call's
    /// at the call timeout the broker gave it (`ext::CAP_KEY`).
    takes_deadline: bool,
    takes_cap: bool,
}

impl Upstream {
    pub fn is_down(&self) -> bool {
        matches!(self.state, State::Down { .. })
    }

    fn load(&self) -> Option<usize> {
        matches!(self.state, State::Up(_)).then(|| self.calls.len())
    }

    /// Writes what the socket takes of what this round gave it.
    pub fn flush(&mut self) -> io::Result<()> {
        match &mut self.state {
            State::Up(sock) => sock.flush(),
            _ => Ok(()),
        }
    }
}

/// The providers of `config` and `--pool-size` connections to each, being made.
pub(super) fn connect_all(
    config: &BrokerConfig,
    poll: &Poll,
) -> io::Result<(Routes, Vec<Upstream>)> {
    let mut routes = Routes {
        providers: Vec::new(),
        named: HashMap::new(),
        any: Vec::new(),
    };
    let mut upstreams = Vec::new();
    for (p, spec) in config.upstreams.iter().enumerate() {
        let mut conns = Vec::new();
        for _ in 0..config.pool_size.max(1) {
            let k = upstreams.len();
            let mut up = Upstream {
                provider: p,
                state: State::Down {
                    retry_at: Instant::now(),
                },
                calls: SlotTable::keyed(),
                takes_deadline: false,
                takes_cap: false,
            };
            up.state = connect(&spec.addr, poll, k);
            upstreams.push(up);
            conns.push(k);
        }
        if spec.services.is_empty() {
            routes.any.push(p);
        }
        for service in &spec.services {
            routes
                .named
                .entry(service.as_bytes().into())
                .or_default()
                .push(p);
        }
        routes.providers.push(Provider {
            label: spec.label().into(),
            addr: spec.addr.clone(),
            kind: spec.kind,
            conns,
            outstanding: 0,
        });
    }
    Ok((routes, upstreams))
}

/// Starts a connection to `addr` as provider connection `k`; down when it cannot start.
fn connect(addr: &str, poll: &Poll, k: usize) -> State {
    let down = State::Down {
        retry_at: Instant::now() + RECONNECT_AFTER,
    };
    let Some(to) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return down;
    };
    let Ok(stream) = TcpStream::connect(to) else {
        return down;
    };
    let mut sock = Socket::new(stream);
    match poll.registry().register(
        &mut sock.stream,
        Token(FIRST_UPSTREAM + k),
        Interest::READABLE | Interest::WRITABLE,
    ) {
        Ok(()) => State::Connecting(sock),
        Err(_) => down,
    }
}

/// What the balancing reads: the providers, their connections' loads, the caps.
struct Pick<'a> {
    routes: &'a Routes,
    upstreams: &'a [Upstream],
    config: &'a BrokerConfig,
}

impl Pick<'_> {
    /// Among `list`, the less loaded of two chosen at random, or the other, or any that
    /// takes the call.
    fn among(&self, list: &[usize], flags: Flags, rng: &mut fastrand::Rng) -> Option<usize> {
        match list.len() {
            0 => None,
            1 => self.take_on(list[0], flags),
            n => {
                let a = rng.usize(..n);
                let mut b = rng.usize(..n - 1);
                if b >= a {
                    b += 1;
                }
                let out = |i: usize| self.routes.providers[list[i]].outstanding;
                let (first, second) = if out(b) < out(a) { (b, a) } else { (a, b) };
                self.take_on(list[first], flags)
                    .or_else(|| self.take_on(list[second], flags))
                    .or_else(|| list.iter().find_map(|&p| self.take_on(p, flags)))
            }
        }
    }

    /// Which connection of provider `p` takes a call with `flags`: the oldest with fewer
    /// than `--pack-in-flight` calls, else the least loaded under its cap.
    fn take_on(&self, p: usize, flags: Flags) -> Option<usize> {
        let provider = &self.routes.providers[p];
        if !provider.kind.takes_request(flags) {
            return None;
        }
        let cap = self.config.max_in_flight_per_upstream_conn;
        let mut least: Option<(usize, usize)> = None;
        for &k in &provider.conns {
            let Some(load) = self.upstreams[k].load() else {
                continue;
            };
            if load < self.config.pack_in_flight.min(cap) {
                return Some(k);
            }
            if load < cap && least.is_none_or(|(l, _)| load < l) {
                least = Some((load, k));
            }
        }
        least.map(|(_, k)| k)
    }
}

impl Engine {
    /// Which provider connection takes a call for `service` with `flags`: the providers
    /// named for it, then those for any service.
    pub(super) fn route(&mut self, service: &[u8], flags: Flags) -> Result<usize, NoRoute> {
        let Engine {
            routes,
            upstreams,
            config,
            rng,
            ..
        } = self;
        let pick = Pick {
            routes,
            upstreams,
            config,
        };
        let named = routes
            .named
            .get(service)
            .map(|v| &v[..])
            .unwrap_or_default();
        for list in [named, &routes.any[..]] {
            if let Some(k) = pick.among(list, flags, rng) {
                return Ok(k);
            }
        }
        let candidates = named.iter().chain(&routes.any);
        let up = |p: usize| {
            routes.providers[p]
                .conns
                .iter()
                .any(|&k| upstreams[k].load().is_some())
        };
        Err(if named.is_empty() && routes.any.is_empty() {
            NoRoute::UnknownService
        } else if !candidates.clone().any(|&p| up(p)) {
            NoRoute::NoHealthy
        } else if !candidates
            .clone()
            .any(|&p| up(p) && routes.providers[p].kind.takes_request(flags))
        {
            NoRoute::NeedsExtension
        } else {
            NoRoute::Full
        })
    }

    /// Writes `call` to provider connection `k`: `inner` is its v1 body, `as_sent` how
    /// its frame came. A provider that takes deadlines is given the call's, as it came
    /// when it may go on unchanged: the call is written in the round that read it, so the
    /// time left is its whole budget, or, for a provider that caps every call at the call
    /// timeout, what that cap leaves. `false` when the connection's table is full.
    pub(super) fn send(
        &mut self,
        k: usize,
        call: Call,
        flags: Flags,
        inner: &[u8],
        as_sent: AsSent<'_>,
    ) -> bool {
        let p = self.upstreams[k].provider;
        let to = self.routes.providers[p].kind;
        let up = &mut self.upstreams[k];
        let State::Up(sock) = &mut up.state else {
            return false;
        };
        // Ask for extended statuses always from a provider that has them: they are
        // degraded for a v1 caller on the way back.
        let out_flags = match to {
            PeerKind::Rpcmesh => flags | Flags::EXT_STATUS,
            PeerKind::V1 => Flags::NONE,
        };
        let (caller_id, limit) = (call.caller_id, call.limit);
        let Some((id, _)) = up
            .calls
            .insert_keyed(call, |key| neutral_id(caller_id, key))
        else {
            return false;
        };
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
        true
    }

    /// Handles a readiness event of provider connection `k`.
    pub(super) fn on_upstream_event(&mut self, k: usize, event: &Event, to_the_end: bool) {
        let Some(up) = self.upstreams.get_mut(k) else {
            return;
        };
        if let State::Connecting(sock) = &mut up.state {
            if !(event.is_writable() || to_the_end) {
                return;
            }
            // Connected once the socket has a peer; failed when it holds an error.
            match (sock.stream.take_error(), sock.stream.peer_addr()) {
                (Ok(None), Ok(_)) => {
                    let State::Connecting(sock) =
                        mem::replace(&mut up.state, State::Down { retry_at: self.now })
                    else {
                        unreachable!("matched above");
                    };
                    up.state = State::Up(sock);
                    self.ask_call_fields(k);
                }
                (Ok(Some(e)) | Err(e), _) => {
                    return self.upstream_lost(k, ConnEnd::Socket(Arc::new(e)));
                }
                (Ok(None), Err(e)) if e.kind() == io::ErrorKind::NotConnected => return,
                (Ok(None), Err(e)) => {
                    return self.upstream_lost(k, ConnEnd::Socket(Arc::new(e)));
                }
            }
        }
        if event.is_readable() || to_the_end {
            self.read_upstream(k, to_the_end);
        }
    }

    /// Asks an rpcmesh provider, on connection `k` just made, which call fields it takes,
    /// and gives it the cap of every call's deadline here (the call timeout). Until it
    /// answers, its calls go as plain v1 calls (the broker keeps their deadlines).
    fn ask_call_fields(&mut self, k: usize) {
        let p = self.upstreams[k].provider;
        if self.routes.providers[p].kind != PeerKind::Rpcmesh {
            return;
        }
        let State::Up(sock) = &mut self.upstreams[k].state else {
            return;
        };
        let extra = [
            (ext::HEARTBEAT_KEY, ""),
            (ext::CAP_KEY, self.cap_value.as_str()),
        ];
        let _ = Heartbeat::put_now_with(&mut sock.out, 0, "broker", "rpcmesh-broker", &extra);
    }

    /// The call fields a heartbeat answer on connection `k` says the provider takes.
    fn take_call_fields(&mut self, k: usize, body: &[u8]) {
        if let Ok(fields) = Heartbeat::extra_value_in(body, ext::HEARTBEAT_KEY) {
            let takes = |field| fields.is_some_and(|v| ext::takes(v, field));
            let up = &mut self.upstreams[k];
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
        let p = self.upstreams[k].provider;
        let result = loop {
            match self.codec.peek_frame(&mut rbuf) {
                Ok(Some(h)) => {
                    if h.msg_type == MsgType::Heartbeat {
                        self.take_call_fields(k, body_in_place(&rbuf, &h));
                    } else if h.msg_type == MsgType::Response {
                        if let Some(call) = self.upstreams[k].calls.take(h.req_id) {
                            self.routes.providers[p].outstanding -= 1;
                            let body = body_in_place(&rbuf, &h);
                            if body.len() < MIN_REPLY_BODY {
                                self.answer_call(&call, &Failure::MalformedReply);
                            } else {
                                let end = FRAME_OVERHEAD + h.body_len as usize;
                                let t =
                                    [rbuf[end - 4], rbuf[end - 3], rbuf[end - 2], rbuf[end - 1]];
                                let info = CallInfo {
                                    client_id: call.caller_id,
                                    client_flags: call.flags,
                                    tag: 0,
                                    admitted: self.now,
                                    routed: None,
                                    replied: None,
                                };
                                let trailer = Some(u32::from_be_bytes(t));
                                if self.deliver(call.session, |out| {
                                    write_reply_to(out, h.flags, body, trailer, info);
                                }) {
                                    self.summary.replied += 1;
                                }
                            }
                        }
                    }
                    skip_frame(&mut rbuf, &h);
                }
                Ok(None) => break Ok(()),
                Err(e) => {
                    let call = e
                        .request_id()
                        .and_then(|id| self.upstreams[k].calls.take(id));
                    if let Some(call) = call {
                        self.routes.providers[p].outstanding -= 1;
                        let provider = self.routes.providers[p].label.clone();
                        let failure = Failure::ReplyRefused {
                            provider,
                            error: e.clone(),
                        };
                        self.answer_call(&call, &failure);
                    }
                    if e.is_fatal() {
                        break Err(ConnEnd::BadFrames(e));
                    }
                }
            }
        };
        if let State::Up(sock) = &mut self.upstreams[k].state {
            sock.rbuf = rbuf;
        }
        result
    }

    /// Provider connection `k` is lost: its calls are answered, and it is made again
    /// after [`RECONNECT_AFTER`].
    pub(super) fn upstream_lost(&mut self, k: usize, cause: ConnEnd) {
        let old = mem::replace(
            &mut self.upstreams[k].state,
            State::Down {
                retry_at: self.now + RECONNECT_AFTER,
            },
        );
        if let State::Up(mut sock) | State::Connecting(mut sock) = old {
            let _ = self.poll.registry().deregister(&mut sock.stream);
        }
        let up = &mut self.upstreams[k];
        (up.takes_deadline, up.takes_cap) = (false, false);
        let p = up.provider;
        let provider = self.routes.providers[p].label.clone();
        let calls: Vec<(u64, Call)> = up.calls.drain().collect();
        for (_, call) in calls {
            self.routes.providers[p].outstanding -= 1;
            let failure = Failure::ConnectionLost {
                provider: provider.clone(),
                cause: cause.clone(),
            };
            self.answer_call(&call, &failure);
        }
    }

    /// Makes again each lost provider connection whose wait is over.
    pub(super) fn reconnect_due(&mut self) {
        for k in 0..self.upstreams.len() {
            if let State::Down { retry_at } = self.upstreams[k].state {
                if self.now >= retry_at {
                    let p = self.upstreams[k].provider;
                    self.upstreams[k].state =
                        connect(&self.routes.providers[p].addr, &self.poll, k);
                }
            }
        }
    }

    /// Answers the calls past their deadline, and finds the next deadline.
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
        self.next_expiry = next;
    }

    /// Answers every call in flight with what `failure` makes for its provider (the
    /// drain's grace is over).
    pub(super) fn answer_all_in_flight(&mut self, failure: impl Fn(&str) -> Failure) {
        for k in 0..self.upstreams.len() {
            let p = self.upstreams[k].provider;
            let calls: Vec<(u64, Call)> = self.upstreams[k].calls.drain().collect();
            for (_, call) in calls {
                self.routes.providers[p].outstanding -= 1;
                let f = failure(&self.routes.providers[p].label);
                self.answer_call(&call, &f);
            }
        }
    }
}
