//! The client side of the loop engine: the sessions it accepted, the frames they send
//! (calls admitted and routed, heartbeats answered, bad input answered or ended), and the
//! answers and replies written back to them.

use std::io;
use std::mem;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use mio::Interest;
use mio::net::TcpListener;
use rpcmesh_common::metrics::Side;
use rpcmesh_common::net::budget::{Held, MemoryBudget, Reserved, SMALL_BODY};
use rpcmesh_common::net::connection::{CloseReason, room_to_keep};
use rpcmesh_common::net::listener::{ACCEPT_BATCH, REFUSED_BATCH_PAUSE, Refusal};
use rpcmesh_common::net::session::{
    FINAL_FLUSH_TIMEOUT, PAUSED_PEER_CHECK, Timeouts, WRITE_BACKLOG_LIMIT,
};
use rpcmesh_common::net::sources::Source;
use rpcmesh_common::net::thinned::Thinned;
use rpcmesh_common::net::tls::handshake::HandshakeSlot;
use rpcmesh_common::net::tls::{Identity, Refusal as TlsRefusal, ServerTls};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::{request_names, request_names_head};
use rpcmesh_wire::codec::{body_in_place, skip_frame, trailer_in_place};
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{FRAME_OVERHEAD, Flags, FrameError, HEADER_LEN, Header, MsgType};

use std::sync::atomic::Ordering;

use super::control::Command;
use super::socket::{Filled, MIN_READ, READ_CHUNK, Socket, one_connections};
use super::upstream::{AsSent, Call};
use super::{Engine, FIRST_SESSION};
use crate::call::Avoid;
use crate::failure::{Cap, Failure, put_answer};

/// Connections accepted in one round at most, so that a flood of connects gets about the
/// share of one busy session, not the thread: the Tokio engine's accept batch (its doc
/// says what larger ones cost), for the same reason. The next round takes the rest.
const ACCEPTS_PER_ROUND: usize = ACCEPT_BATCH;

/// Log lines for accept failures (a process out of descriptors), thinned.
static ACCEPT_FAILED_LINES: Thinned = Thinned::new();
/// Log lines for sessions closed by a timeout, thinned.
static TIMEOUT_LINES: Thinned = Thinned::new();

/// How long a session asked to move to another worker may take to have no call in
/// flight and nothing to write (it is not read meanwhile) before it stays where it is: a
/// few of a busy provider's round trips, so that a move stalls none of its calls for long.
const MOVE_WAIT: Duration = Duration::from_millis(50);

/// The least time between two sweeps of the sessions' timeouts: a quarter of the
/// shortest, so that a session is closed at most a quarter late, and no more often than
/// every 10 ms (a sweep walks every session) nor less than every second.
fn timeout_sweep(limits: &Timeouts) -> Duration {
    let shortest = limits.idle.min(limits.frame).min(limits.write);
    (shortest / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// A client connection.
#[derive(Debug)]
pub(super) struct Session {
    sock: Socket,
    /// Its calls in flight (`--max-in-flight-per-conn`).
    in_flight: usize,
    reading: Reading,
    /// The client has closed its side (its end of stream may wait in the socket behind
    /// bytes not yet read, and raises no second edge: kept until it is read).
    read_closed: bool,
    /// Its clocks (`--idle-timeout`, `--frame-timeout`, `--write-timeout`).
    clock: Clock,
    /// The frame it is in the middle of was judged by its header (`refuse_coming`).
    coming_judged: bool,
    /// What its buffers hold, told to the memory budget.
    held: Held,
    /// Calls it sent since it came to this worker, and when it came: its calls/s, which
    /// the placement moves connections by.
    calls: u64,
    since: Instant,
    /// Its TLS handshake, while it is in progress.
    handshake: Option<Box<Handshaking>>,
    /// Whom its client's certificate names (`None`: anonymous), and the extension block
    /// that tells it to providers taking callers' identities.
    identity: Option<Identity>,
    caller: Option<Box<[u8]>>,
    /// Where its client connects from: its count among its source's connections
    /// (`--max-connections-per-source`) goes down when it closes.
    source: Source,
    /// Its client asked to be told of the drain (`ext::DRAINING_KEY`): the drain waits
    /// for it to close (at most `NOTICED_DRAIN_LINGER` once idle).
    drain_notice: bool,
}

/// A TLS handshake in progress: refused if not done by `until` (the handshake timeout),
/// holding its place among the handshakes in progress meanwhile.
#[derive(Debug)]
struct Handshaking {
    until: Instant,
    peer: SocketAddr,
    _slot: HandshakeSlot,
}

impl Session {
    fn new(
        (stream, source): (mio::net::TcpStream, Source),
        now: Instant,
        budget: &std::sync::Arc<MemoryBudget>,
    ) -> Session {
        Session {
            source,
            sock: Socket::new(stream),
            in_flight: 0,
            reading: Reading::Open,
            read_closed: false,
            clock: Clock::new(now),
            coming_judged: false,
            held: Held::new(budget.clone()),
            calls: 0,
            since: now,
            handshake: None,
            identity: None,
            caller: None,
            drain_notice: false,
        }
    }
}

/// When a session's timeouts started to run, as the Tokio engine's sessions keep them
/// (`rpcmesh_common::net::session`): looked at by the engine's sweep
/// ([`Engine::sweep_sessions`]).
#[derive(Debug, Clone, Copy)]
struct Clock {
    /// The last round it read a call or was given a call's outcome: it is idle from then
    /// on while nothing is in flight, to write or partly read (a heartbeat and its answer
    /// do not count: a caller that sends nothing else holds a connection for nothing).
    busy_at: Instant,
    /// When the frame being read began to arrive (while it is read).
    frame_since: Option<Instant>,
    /// Since when bytes have waited for a client that took none of them.
    write_since: Option<Instant>,
}

impl Clock {
    fn new(now: Instant) -> Clock {
        Clock {
            busy_at: now,
            frame_since: None,
            write_since: None,
        }
    }
}

/// Whether a session is read, and how it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    Open,
    /// Not read while its replies wait to be written past [`WRITE_BACKLOG_LIMIT`]: a
    /// client that does not read cannot make the broker buffer without end.
    Paused,
    /// Not read while the memory budget is past its pause mark and the session holds
    /// `PAUSE_FLOOR` or more (`rpcmesh_common::net::budget`); looked at every round.
    BudgetPaused,
    /// The client closed its side: ends once its calls are answered and written.
    PeerClosed,
    /// Sent input the session cannot get past: ends once what it was told is written,
    /// or at this time ([`FINAL_FLUSH_TIMEOUT`]); its calls in flight are dropped.
    BadInput(Instant),
    /// Asked to move to worker `to` (to the open worker serving the fewest when `None`):
    /// not read until it has no call in flight and nothing to write, then handed over;
    /// read here again if that is not so by `by` ([`MOVE_WAIT`]).
    Moving {
        to: Option<usize>,
        by: Instant,
    },
}

/// A session as a call in flight names it: its index, and the generation of that index,
/// so that the outcome of a call whose session has gone is never given to the session
/// that took its index next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SessionRef {
    idx: u32,
    generation: u32,
}

/// The sessions, by index; indices are reused, under a new generation.
#[derive(Debug, Default)]
pub(super) struct Sessions {
    slots: Vec<(u32, Option<Session>)>,
    free: Vec<u32>,
    /// Sessions given something to write this round.
    dirty: Vec<u32>,
    /// Sessions that were paused and may be read again: read in the next round, which
    /// does not wait.
    pub resume: Vec<u32>,
    /// Sessions that end after bad input, looked at every round until they do.
    ending: Vec<u32>,
    /// Sessions not read for the memory budget, looked at every round until they are.
    budget_paused: Vec<u32>,
    /// Sessions asked to move to another worker, looked at every round until they go or
    /// stay.
    moving: Vec<u32>,
}

impl Sessions {
    fn insert(&mut self, session: Session) -> usize {
        match self.free.pop() {
            Some(i) => {
                let slot = &mut self.slots[i as usize];
                slot.0 = slot.0.wrapping_add(1);
                slot.1 = Some(session);
                i as usize
            }
            None => {
                self.slots.push((0, Some(session)));
                self.slots.len() - 1
            }
        }
    }

    fn remove(&mut self, i: usize) -> Option<Session> {
        let session = self.slots.get_mut(i)?.1.take()?;
        self.free.push(i as u32);
        Some(session)
    }

    /// Sessions open now: every index but the free ones.
    fn open(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn get(&mut self, i: usize) -> Option<&mut Session> {
        self.slots.get_mut(i)?.1.as_mut()
    }

    /// The extension block naming the caller of session `r`, when it has an identity.
    pub fn caller_block(&self, r: SessionRef) -> Option<&[u8]> {
        self.peek(r)?.caller.as_deref().filter(|b| !b.is_empty())
    }

    /// Session `i`, if open.
    fn peek_at(&self, i: usize) -> Option<&Session> {
        self.slots.get(i)?.1.as_ref()
    }

    fn peek(&self, r: SessionRef) -> Option<&Session> {
        match self.slots.get(r.idx as usize)? {
            (g, Some(s)) if *g == r.generation => Some(s),
            _ => None,
        }
    }

    fn get_ref(&mut self, r: SessionRef) -> Option<&mut Session> {
        match self.slots.get_mut(r.idx as usize)? {
            (g, Some(s)) if *g == r.generation => Some(s),
            _ => None,
        }
    }

    fn ref_of(&self, i: usize) -> SessionRef {
        SessionRef {
            idx: i as u32,
            generation: self.slots[i].0,
        }
    }

    /// Puts session `i` in the round's list of sessions to write, once.
    pub fn mark_dirty(&mut self, i: usize) {
        if let Some(s) = self.get(i) {
            if !s.sock.dirty {
                s.sock.dirty = true;
                self.dirty.push(i as u32);
            }
        }
    }
}

/// Where the v1 body starts inside an extension request's body, the caller's budget,
/// and the deadline as sent when the block holds it alone. That block, nearly every
/// call's, is read where it lies; any other is walked.
fn split_ext(body: &[u8]) -> Result<(usize, Option<Duration>, Option<u32>), FrameError> {
    if let Some(d) = body.get(..ext::DEADLINE_BLOCK_LEN) {
        if d[..ext::DEADLINE_ONLY.len()] == ext::DEADLINE_ONLY {
            let micros = u32::from_be_bytes([d[5], d[6], d[7], d[8]]);
            let budget = Duration::from_micros(u64::from(micros));
            return Ok((ext::DEADLINE_BLOCK_LEN, Some(budget), Some(micros)));
        }
    }
    let whole = Bytes::copy_from_slice(body);
    let (fields, inner) = ext::split(&whole)?;
    Ok((body.len() - inner.len(), fields.deadline, None))
}

impl Engine {
    /// Takes the waiting connections, at most [`ACCEPTS_PER_ROUND`] (the next round takes
    /// the rest), up to `--max-connections` open at once (one past it is closed at once).
    /// An error that is not one connection's (no file descriptor left) pauses the
    /// accepting, longer each time it comes back, instead of spinning on it; edges do not
    /// come again for connections already waiting, so the loop takes them when the pause
    /// is over ([`Engine::accept_at`]).
    pub(super) fn accept(&mut self, listener: &TcpListener, plain: bool) {
        let mut refused = 0;
        for _ in 0..ACCEPTS_PER_ROUND {
            let (stream, peer) = match listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.accept_backoff.reset();
                    return;
                }
                Err(e) if one_connections(&e) => continue,
                Err(e) => {
                    let pause = self.accept_backoff.pause();
                    if let Some(a) = ACCEPT_FAILED_LINES.admit() {
                        tracing::warn!(error = %e, ?pause, seen = a.seen, left_out = a.left_out, "accept failed; accepting again after a pause");
                    }
                    self.accept_at = Some(self.now + pause);
                    return;
                }
            };
            // Refused (accepted and closed at once, counted, logged thinned) at the cap
            // and over its source's limits, as the Tokio engine's listener refuses.
            if self.shared.sessions() >= self.config.max_connections {
                self.refuse_connection(peer, Refusal::ConnectionCap, 0);
                refused += 1;
                continue;
            }
            let source = Source::of(peer.ip());
            if let Err((over, open)) = self.shared.admit(source, self.now) {
                self.refuse_connection(peer, Refusal::from(over), open);
                refused += 1;
                continue;
            }
            tracing::debug!(%peer, "connection accepted");
            let mut session = Session::new((stream, source), self.now, &self.budget);
            if let Some(tls) = self.shared.security.tls.as_ref().filter(|_| !plain) {
                match tls.begin() {
                    Ok((conn, slot)) => {
                        session.sock.tls = Some(Box::new(rustls::Connection::Server(conn)));
                        session.handshake = Some(Box::new(Handshaking {
                            until: self.now + tls.handshake_timeout(),
                            peer,
                            _slot: slot,
                        }));
                    }
                    Err((reason, e)) => {
                        // Over the cap on handshakes in progress: closed at once.
                        tls.refused(peer, reason, &e);
                        self.counts.opened();
                        self.counts.closed(CloseReason::TlsHandshake);
                        self.shared.source_closed(source);
                        continue;
                    }
                }
            }
            // Dealt to the open worker serving the fewest (`super::workers`).
            match self.shared.deal() {
                w if w == self.index => self.adopt(session, false),
                w => self.shared.workers[w].command(Command::Adopt(Box::new(session), false)),
            }
        }
        // More may wait: taken next round, or, when the whole round was refused (a flood
        // of connects), after a pause, so that the sessions' reads come first.
        self.accept_at = Some(if refused == ACCEPTS_PER_ROUND {
            self.now + REFUSED_BATCH_PAUSE
        } else {
            self.now
        });
    }

    /// A connection from `peer` refused for `reason` (`open`: what its source has open):
    /// closed at once, counted and logged (thinned), as the Tokio engine's listener does.
    fn refuse_connection(&mut self, peer: SocketAddr, reason: Refusal, open: usize) {
        self.counts.refused(reason);
        self.summary.refused += 1;
        reason.log(peer, self.config.max_connections, open, self.config.sources);
    }

    /// Takes the connections waiting on the plain listener beside TLS (`--listen-plain`),
    /// if there is one: their callers are anonymous.
    pub(super) fn accept_plain(&mut self) {
        if let Some(p) = self.plain.take() {
            self.accept(&p, true);
            self.plain = Some(p);
        }
    }

    /// Serves a session dealt to this worker (already counted in its sessions): a
    /// connection just accepted, or one `moved` from another worker, which is read at
    /// once (what its client sent meanwhile waits in its socket).
    pub(super) fn adopt(&mut self, mut session: Session, moved: bool) {
        (session.calls, session.since) = (0, self.now);
        session.held.set(session.sock.room());
        let i = self.sessions.insert(session);
        let registered = self.sessions.get(i).map(|s| {
            self.poll.registry().register(
                &mut s.sock.stream,
                mio::Token(FIRST_SESSION + i),
                Interest::READABLE | Interest::WRITABLE,
            )
        });
        match registered {
            Some(Ok(())) if moved => self.sessions.resume.push(i as u32),
            Some(Ok(())) => {
                self.summary.accepted += 1;
                self.counts.opened();
                if self.index >= self.shared.open() {
                    // Dealt as the placement closed this worker: it goes where the rest
                    // of its sessions went.
                    if let Some(s) = self.sessions.get(i) {
                        s.reading = Reading::Moving {
                            to: None,
                            by: self.now + MOVE_WAIT,
                        };
                        self.sessions.moving.push(i as u32);
                    }
                }
            }
            _ => {
                if let Some(s) = self.sessions.remove(i) {
                    self.shared.source_closed(s.source);
                }
                self.shared.workers[self.index]
                    .sessions
                    .fetch_sub(1, Ordering::Relaxed);
                if moved {
                    self.counts.closed(CloseReason::Error);
                }
            }
        }
    }

    /// Asks this worker's sessions to move (the placement's `Command::Move`): to worker
    /// `to` those that carry about half its calls (by each one's calls/s, heaviest
    /// first: `crate::cell::half_by_load`), or all of them, dealt over the open workers,
    /// when `to` is `None`. Only sessions read as usual move: one paused, ending, or
    /// draining stays.
    pub(super) fn ask_to_move(&mut self, to: Option<usize>) {
        if self.grace_until.is_some() {
            return;
        }
        let now = self.now;
        let open: Vec<usize> = (0..self.sessions.slots.len())
            .filter(|&i| matches!(&self.sessions.slots[i].1, Some(s) if s.reading == Reading::Open))
            .collect();
        let chosen: Vec<usize> = match to {
            Some(_) => {
                let loads: Vec<f64> = open
                    .iter()
                    .filter_map(|&i| self.sessions.slots[i].1.as_ref())
                    .map(|s| {
                        let secs = now.saturating_duration_since(s.since).as_secs_f64();
                        if secs > 0.0 {
                            s.calls as f64 / secs
                        } else {
                            0.0
                        }
                    })
                    .collect();
                crate::cell::half_by_load(&loads)
                    .into_iter()
                    .map(|j| open[j])
                    .collect()
            }
            None => open,
        };
        for i in chosen {
            if let Some(s) = self.sessions.get(i) {
                s.reading = Reading::Moving {
                    to,
                    by: now + MOVE_WAIT,
                };
                self.sessions.moving.push(i as u32);
            }
        }
    }

    /// Hands the sessions asked to move that have no call in flight and nothing to write
    /// to their worker, whole (socket, buffers, clocks, what they hold of the memory
    /// budget); those still busy at their `by`, or whose worker is no longer open, are
    /// read here again.
    pub(super) fn hand_over_moving(&mut self) {
        if self.sessions.moving.is_empty() {
            return;
        }
        let mut moving = mem::take(&mut self.sessions.moving);
        moving.retain(|&i| {
            let i = i as usize;
            let Some(s) = self.sessions.get(i) else {
                return false;
            };
            let Reading::Moving { to, by } = s.reading else {
                return false;
            };
            let quiet = s.in_flight == 0 && !s.sock.unwritten();
            if !quiet && self.now < by && self.grace_until.is_none() {
                return true;
            }
            // Draining, it stays: the other workers may be ending.
            let to = if quiet && self.grace_until.is_none() {
                self.shared.take_to(to, self.index)
            } else {
                None
            };
            let Some(to) = to else {
                s.reading = Reading::Open;
                self.sessions.resume.push(i as u32);
                return false;
            };
            if let Some(mut s) = self.sessions.remove(i) {
                let _ = self.poll.registry().deregister(&mut s.sock.stream);
                (s.reading, s.sock.dirty) = (Reading::Open, false);
                self.shared.workers[self.index]
                    .sessions
                    .fetch_sub(1, Ordering::Relaxed);
                self.shared.moved();
                self.shared.workers[to].command(Command::Adopt(Box::new(s), true));
            }
            false
        });
        self.sessions.moving = moving;
    }

    /// Whether sessions wait to move.
    pub(super) fn any_moving(&self) -> bool {
        !self.sessions.moving.is_empty()
    }

    /// A readiness event of session `i`.
    pub(super) fn on_session_event(&mut self, i: usize, event: &mio::event::Event) {
        if event.is_writable() {
            self.sessions.mark_dirty(i);
        }
        let closed = event.is_read_closed() || event.is_error();
        if let Some(s) = self.sessions.get(i) {
            s.read_closed |= closed;
        }
        if event.is_readable() || closed {
            self.read_session(i);
        }
    }

    /// Reads session `i` until it is drained (to its end when its client has closed),
    /// handling each frame as it is found.
    pub(super) fn read_session(&mut self, i: usize) {
        loop {
            let Some(s) = self.sessions.get(i) else {
                return;
            };
            if s.reading != Reading::Open {
                return;
            }
            if s.sock.out.len() >= WRITE_BACKLOG_LIMIT {
                // Not reading: the frame being read is not timed meanwhile.
                s.reading = Reading::Paused;
                s.clock.frame_since = None;
                return;
            }
            let room = s.sock.room();
            if budget_pauses(&self.budget, &s.sock) {
                // Its frame is timed meanwhile only while it is one of those holding the
                // budget (the sweep looks).
                s.reading = Reading::BudgetPaused;
                s.held.set_waiting(true, room);
                self.sessions.budget_paused.push(i as u32);
                return;
            }
            // The read buffer grows only as the budget allows, told at once, so that many
            // connections growing together cannot pass the limit.
            let most = s.sock.read_room(&self.budget);
            s.held.set(s.sock.room());
            let filled = s.sock.fill(&mut self.scratch[..most], s.read_closed);
            s.sock.take_counts(&mut self.counts.inbound);
            if s.sock.tls.is_some() {
                // Its TLS may have records to send: the handshake's, an alert.
                if s.sock.unwritten() {
                    self.sessions.mark_dirty(i);
                }
                if !self.handshake_goes_on(i, &filled) {
                    return;
                }
            }
            let Ok(filled) = filled else {
                return self.close_session(i, CloseReason::Error);
            };
            if !self.take_frames(i) {
                return;
            }
            match filled {
                Filled::More => {}
                Filled::Drained => return,
                Filled::Closed => return self.peer_closed(i),
            }
        }
    }

    /// Session `i`'s client closed its side. What is left in its read buffer is a frame
    /// it cut off: counted as bad input, and the session ends as after bad input, once
    /// what it was answered is written ([`FINAL_FLUSH_TIMEOUT`] at most), as the Tokio
    /// engine's does. Else its calls before are answered (`ends_now` says when it ends).
    fn peer_closed(&mut self, i: usize) {
        let Some(s) = self.sessions.get(i) else {
            return;
        };
        let cut = s.sock.rbuf.len();
        s.sock.rbuf.clear();
        if cut > 0 {
            s.reading = Reading::BadInput(self.now + FINAL_FLUSH_TIMEOUT);
            self.sessions.ending.push(i as u32);
            let e = FrameError::Truncated { buffered: cut };
            self.counts.bad_input(&e, Side::Client);
        } else {
            s.reading = Reading::PeerClosed;
        }
        self.sessions.mark_dirty(i);
    }

    /// Whether session `i`, whose TLS was just read (`filled`), goes on: past its
    /// handshake, or still in it. A handshake done tells whom the client's certificate
    /// names; one refused (a record that is not TLS, a certificate the broker does not
    /// trust, the client gone) is counted and logged, and the session closed after one
    /// try at writing its alert.
    fn handshake_goes_on(&mut self, i: usize, filled: &io::Result<Filled>) -> bool {
        let Some(s) = self.sessions.get(i) else {
            return false;
        };
        let (Some(h), Some(tls)) = (&s.handshake, self.shared.security.tls.as_ref()) else {
            return true;
        };
        let refused = match filled {
            Err(e) => {
                tls.refused(h.peer, TlsRefusal::of(e), e);
                true
            }
            Ok(Filled::Closed) if s.sock.handshaking() => {
                let e = io::Error::from(io::ErrorKind::UnexpectedEof);
                tls.refused(h.peer, TlsRefusal::Eof, &e);
                true
            }
            _ => false,
        };
        if refused {
            self.close_session(i, CloseReason::TlsHandshake);
            return false;
        }
        if !s.sock.handshaking() {
            let identity = s.sock.tls.as_deref().and_then(ServerTls::identity_of);
            tls.opened(h.peer, identity.as_ref());
            let caller = identity.as_ref().map(|i| {
                let block = crate::call::caller_block_of(Some(i.as_str()));
                Box::<[u8]>::from(&block[..])
            });
            (s.identity, s.caller, s.handshake) = (identity, caller, None);
        }
        true
    }

    /// Handles the whole frames session `i` has read. `false` when the session ended
    /// (input it cannot get past).
    fn take_frames(&mut self, i: usize) -> bool {
        let from = self.sessions.ref_of(i);
        let Some(s) = self.sessions.get(i) else {
            return false;
        };
        let mut rbuf = mem::take(&mut s.sock.rbuf);
        let mut frames = 0;
        let mut calls = false;
        let ended = loop {
            match self.codec.peek_frame(&mut rbuf) {
                Ok(Some(h)) => {
                    let (body, trailer) = (body_in_place(&rbuf, &h), trailer_in_place(&rbuf, &h));
                    frames += 1;
                    calls |= h.msg_type != MsgType::Heartbeat;
                    match h.msg_type {
                        MsgType::Request => self.admit(from, &h, body, trailer, false),
                        MsgType::ExtRequest => self.admit(from, &h, body, trailer, true),
                        MsgType::Heartbeat => self.answer_heartbeat(i, &h, body),
                        // A reply makes no sense from a caller: dropped.
                        MsgType::Response => self.counts.unexpected(Side::Client),
                    }
                    skip_frame(&mut rbuf, &h);
                }
                Ok(None) => break false,
                Err(e) => {
                    self.counts.bad_input(&e, Side::Client);
                    if let Some(id) = e.request_id() {
                        self.summary.calls += 1;
                        let failure = Failure::BadRequest(e.clone());
                        self.refuse(from, id, e.flags(), &failure, 0);
                    }
                    if e.is_fatal() {
                        break true;
                    }
                }
            }
        };
        if ended {
            // Not read again; closed once what it was told is written.
            if let Some(s) = self.sessions.get(i) {
                s.reading = Reading::BadInput(self.now + FINAL_FLUSH_TIMEOUT);
                self.sessions.ending.push(i as u32);
            }
            self.sessions.mark_dirty(i);
            return false;
        }
        // A call is judged by its header once, when it is first seen whole: one begun
        // under the high mark goes on (the budget's pauses bound it).
        let judged = frames == 0 && self.sessions.get(i).is_some_and(|s| s.coming_judged);
        let (mut refused, mut seen) = (0, judged);
        if !judged && !rbuf.is_empty() {
            (refused, seen) = self.refuse_coming(from, &rbuf);
        }
        let now = self.now;
        if let Some(s) = self.sessions.get(i) {
            if refused > 0 {
                s.sock.skip_from(&mut rbuf, refused);
                (frames, seen) = (frames + 1, false);
            }
            s.coming_judged = seen && !rbuf.is_empty();
            if calls {
                s.clock.busy_at = now;
            }
            let keep = room_to_keep(&self.budget);
            if rbuf.is_empty() {
                // Its room taken back (the frames read are gone; no allocation), and given
                // back past what an emptied buffer may keep.
                rbuf.reserve(MIN_READ);
                if rbuf.capacity() > keep {
                    rbuf = BytesMut::with_capacity(MIN_READ);
                }
            } else if frames > 0 && keep == MIN_READ && rbuf.len() < READ_CHUNK {
                // The part of a frame left after the frames this read took off keeps their
                // whole allocation alive, which `capacity` no longer shows: under pressure
                // it is copied out, so that the allocation goes (as on Tokio).
                let mut own = BytesMut::with_capacity(rbuf.len().max(MIN_READ));
                own.extend_from_slice(&rbuf);
                rbuf = own;
            }
            s.held.set(rbuf.capacity() + s.sock.out.capacity());
            // A frame is timed from its first bytes: from this read when it brought whole
            // frames before it.
            s.clock.frame_since = match (rbuf.is_empty(), s.clock.frame_since) {
                (true, _) => None,
                (false, Some(t)) if frames == 0 => Some(t),
                (false, _) => Some(now),
            };
            s.sock.rbuf = rbuf;
        }
        true
    }

    /// Answers "overloaded" now the call whose header `rbuf` holds and whose body is still
    /// coming, when the memory budget refuses a body of its length (past the high mark):
    /// the body would be buffered only to be dropped, and a caller that holds the pause
    /// floor while it comes would be paused, its call unanswered, for as long as others
    /// hold the budget. Returns the frame's length, to drop as it arrives (0: not
    /// refused), and whether its header was there to judge. Counted under its method
    /// when its first bytes name it.
    fn refuse_coming(&mut self, from: SessionRef, rbuf: &[u8]) -> (usize, bool) {
        let Some(h) = self.codec.pending_call(rbuf) else {
            return (0, rbuf.len() >= HEADER_LEN);
        };
        if !self.budget.refuses(h.body_len as usize) {
            return (0, true);
        }
        self.summary.calls += 1;
        let head = &rbuf[HEADER_LEN..];
        let inner = match h.msg_type {
            MsgType::ExtRequest => head
                .get(..ext::DEADLINE_BLOCK_LEN)
                .filter(|d| d.starts_with(&ext::DEADLINE_ONLY))
                .map(|_| &head[ext::DEADLINE_BLOCK_LEN..]),
            _ => Some(head),
        };
        let tag = inner
            .and_then(|b| {
                let (service, method) = request_names_head(b)?;
                Some(
                    self.counts
                        .tag(&b[service.start..method.end], service.len(), false),
                )
            })
            .unwrap_or(0);
        let failure = Failure::Shed(Cap::Memory(self.budget.limit()));
        self.refuse(from, h.req_id, h.flags, &failure, tag);
        (FRAME_OVERHEAD + h.body_len as usize, true)
    }

    /// Admits, routes and sends one call: the frame `h` with `body`, as read from the
    /// session `from`; `trailer`, the CRC it came with (kept when only its id changes).
    fn admit(&mut self, from: SessionRef, h: &Header, body: &[u8], trailer: u32, ext: bool) {
        self.summary.calls += 1;
        let (id, flags) = (h.req_id, h.flags);
        let (inner_at, budget, as_sent) = if ext {
            match split_ext(body) {
                Ok((at, budget, Some(budget_us))) => {
                    let as_sent = AsSent::Deadline {
                        body,
                        budget_us,
                        trailer,
                    };
                    (at, budget, as_sent)
                }
                Ok((at, budget, None)) => (at, budget, AsSent::No),
                Err(e) => return self.refuse(from, id, flags, &Failure::BadRequest(e), 0),
            }
        } else {
            (0, None, AsSent::Plain(trailer))
        };
        let inner = &body[inner_at..];
        let (service, method) = match request_names(inner) {
            Ok((service, method, _)) => (service, method),
            Err(e) => return self.refuse(from, id, flags, &Failure::BadRequest(e), 0),
        };
        let names = &inner[service.start..method.end];
        let refused = |engine: &mut Engine, failure: &Failure| {
            let tag = engine.counts.tag(names, service.len(), false);
            engine.refuse(from, id, flags, failure, tag);
        };
        // Admitted within the cap from here on: counted out on the refusals below.
        let admitted = |engine: &mut Engine, failure: &Failure| {
            engine.unadmit();
            refused(engine, failure);
        };
        if self.grace_until.is_some() {
            return refused(self, &Failure::Draining);
        }
        if budget.is_some_and(|b| b.is_zero()) {
            return refused(self, &Failure::DeadlineExceeded);
        }
        if self.shared.security.authz.is_some() {
            let caller = self.sessions.peek(from).and_then(|s| s.identity.as_ref());
            let caller = caller.map(Identity::as_str);
            let (s, m) = (&inner[service.clone()], &inner[method.clone()]);
            if let Some(denied) = self.denied(caller, names, s, m) {
                return refused(self, &denied);
            }
        }
        let per_conn = self.config.max_in_flight_per_conn;
        if self
            .sessions
            .get_ref(from)
            .is_none_or(|s| s.in_flight >= per_conn)
        {
            return refused(self, &Failure::Shed(Cap::PerConnection(per_conn)));
        }
        if !self.within_cap() {
            return refused(self, &Failure::Shed(Cap::Total(self.config.max_in_flight)));
        }
        if self.budget.refuses(body.len()) {
            return admitted(self, &Failure::Shed(Cap::Memory(self.budget.limit())));
        }
        let k = match self.route(&inner[service.clone()], flags, Avoid::None) {
            Ok(k) => k,
            Err(no) => {
                let name = String::from_utf8_lossy(&inner[service.clone()]).into_owned();
                return admitted(self, &no.failure(name));
            }
        };
        let limit = budget.map_or(self.config.call_timeout, |b| {
            b.min(self.config.call_timeout)
        });
        let tag = self.counts.tag(names, service.len(), true);
        // (Most brokers mark none: the names are not looked at then.)
        let idempotent = !self.idempotent.is_empty()
            && self
                .idempotent
                .covers_bytes(&inner[service.clone()], &inner[method.clone()]);
        let mut call = Call::new(from, (id, flags), (self.now, limit), tag, idempotent);
        call.timed = self.timing.pick(self.now);
        if body.len() >= SMALL_BODY {
            // About as many bytes come back: counted until its outcome is written.
            call.reserved = Some(Reserved::new(&self.budget, body.len()));
        }
        let deadline = self.now + limit;
        if let Err(call) = self.send(k, call, flags, inner, as_sent) {
            if let Some(t) = call.timed {
                self.timing.done(t, false);
            }
            let name = String::from_utf8_lossy(&inner[service]).into_owned();
            self.unadmit();
            return self.refuse(from, id, flags, &Failure::Full(name), call.tag);
        }
        if let Some(s) = self.sessions.get_ref(from) {
            s.in_flight += 1;
            s.calls += 1;
        }
        self.in_flight += 1;
        self.admitted += 1;
        self.next_expiry = Some(self.next_expiry.map_or(deadline, |t| t.min(deadline)));
    }

    /// The refusal of a call of `service`.`method` (`names`: both, as on the wire) that the
    /// policy (`--authz-policy`) does not allow its caller, counted and logged (thinned)
    /// as the Tokio engine does it; `None` when allowed, or when there is no policy. The
    /// caller is whom its certificate names, `None` for anonymous.
    fn denied(
        &self,
        caller: Option<&str>,
        names: &[u8],
        service: &[u8],
        method: &[u8],
    ) -> Option<Failure> {
        let authz = self.shared.security.authz.as_ref()?;
        let (s, m) = match (std::str::from_utf8(service), std::str::from_utf8(method)) {
            (Ok(s), Ok(m)) if authz.policy().allows(caller, s, m) => return None,
            (Ok(s), Ok(m)) => (s, m),
            // Names that are not UTF-8 name nothing a policy allows.
            _ => ("?", "?"),
        };
        let message = rpcmesh_common::authz::denial(caller, s, m);
        // Labelled only with a pair that has labels already (one that succeeded).
        let known = self.counts.metrics.known_calls(names).is_some();
        self.shared.security.denied.deny(known.then_some((s, m)));
        if let Some(a) = crate::session::DENIED_LINES.admit() {
            tracing::warn!(denied = a.seen, left_out = a.left_out, "{message}");
        }
        Some(Failure::Denied(message))
    }

    /// Counts a call in within `--max-in-flight`: this worker's count against the cap when
    /// it is the only one, else its lease on it. False when the cap is reached.
    fn within_cap(&self) -> bool {
        match &self.lease {
            None => self.in_flight < self.config.max_in_flight,
            Some(lease) => lease.admit(),
        }
    }

    /// Counts out a call [`Engine::within_cap`] let in but that is refused after all.
    fn unadmit(&mut self) {
        if self.lease.is_some() {
            self.released += 1;
        }
    }

    /// Answers a call the broker did not send on (`tag`: its pair's, as the counts have
    /// it).
    fn refuse(&mut self, from: SessionRef, id: u64, flags: Flags, failure: &Failure, tag: u32) {
        self.summary.answered += 1;
        self.counts.failed(failure);
        self.counts.answered(tag, failure.status());
        let Self {
            sessions, message, ..
        } = self;
        if let Some(s) = sessions.get_ref(from) {
            put_answer(&mut s.sock.out, message, id, flags, failure);
            sessions.mark_dirty(from.idx as usize);
        }
    }

    /// Answers a heartbeat with one of the broker's own, under its id; one that asks which
    /// call fields the broker takes is told (the deadline).
    fn answer_heartbeat(&mut self, i: usize, h: &Header, body: &[u8]) {
        if let Some(s) = self.sessions.get(i) {
            s.drain_notice |= rpcmesh_wire::ext::asks_drain_notice(body);
            crate::session::put_heartbeat_answer(&mut s.sock.out, h.req_id, body);
            self.sessions.mark_dirty(i);
        }
    }

    /// The drain began: every client that asked is told (`ext::DRAINING_KEY`), and closes
    /// its connection once its calls are answered.
    pub(super) fn tell_drain(&mut self) {
        for i in 0..self.sessions.slots.len() {
            if let Some(s) = self.sessions.get(i).filter(|s| s.drain_notice) {
                crate::session::put_drain_notice(&mut s.sock.out);
                self.sessions.mark_dirty(i);
            }
        }
    }

    /// Whether a client told of the drain still holds its connection.
    pub(super) fn any_told_of_drain(&self) -> bool {
        self.sessions
            .slots
            .iter()
            .any(|(_, s)| s.as_ref().is_some_and(|s| s.drain_notice))
    }

    /// Gives a call's outcome to its session: `write` puts it in the session's output
    /// and says its status, counted under the call's tag. Counted as abandoned when the
    /// session has gone.
    pub(super) fn deliver(
        &mut self,
        call: &Call,
        write: impl FnOnce(&mut BytesMut) -> Status,
    ) -> bool {
        match self.sessions.get_ref(call.session) {
            Some(s) => {
                self.in_flight -= 1;
                self.released += 1;
                s.in_flight -= 1;
                s.clock.busy_at = self.now;
                if let Some(t) = call.timed {
                    self.timing.done(t, true);
                }
                let status = write(&mut s.sock.out);
                self.sessions.mark_dirty(call.session.idx as usize);
                self.counts.answered(call.tag, status);
                true
            }
            None => {
                self.abandon(call);
                false
            }
        }
    }

    /// Whether the session `call` came from has gone.
    pub(super) fn session_gone(&mut self, call: &Call) -> bool {
        self.sessions.get_ref(call.session).is_none()
    }

    /// Drops a call whose session has gone ([`Engine::session_gone`]): nobody is left
    /// to answer.
    pub(super) fn abandon(&mut self, call: &Call) {
        if let Some(t) = call.timed {
            self.timing.done(t, false);
        }
        self.in_flight -= 1;
        self.released += 1;
        self.summary.orphaned += 1;
        self.counts.abandoned();
    }

    /// Answers a call in flight with the broker's own `failure`.
    pub(super) fn answer_call(&mut self, call: &Call, failure: &Failure) {
        self.counts.failed(failure);
        let mut message = mem::take(&mut self.message);
        if self.deliver(call, |out| {
            put_answer(out, &mut message, call.caller_id, call.flags, failure);
            failure.status()
        }) {
            self.summary.answered += 1;
        }
        self.message = message;
    }

    /// Writes every session given something this round; ends those whose end has come
    /// (their client closed, with calls in flight or with its answers written, or they
    /// sent bad input and what they were told is written or its time is up).
    pub(super) fn flush_sessions(&mut self) {
        let mut dirty = mem::take(&mut self.sessions.dirty);
        for &i in &dirty {
            let i = i as usize;
            let Some(s) = self.sessions.get(i) else {
                continue;
            };
            s.sock.dirty = false;
            let before = s.sock.written;
            let flushed = s.sock.flush();
            s.sock.take_counts(&mut self.counts.inbound);
            s.sock.shrink_emptied(&self.budget);
            s.held.set(s.sock.room());
            let now = self.now;
            s.clock.write_since = match (!s.sock.unwritten(), s.clock.write_since) {
                (true, _) => None,
                (false, Some(t)) if s.sock.written == before => Some(t),
                (false, _) => Some(now),
            };
            if flushed.is_err() {
                self.close_session(i, CloseReason::Error);
            } else if s.reading == Reading::Paused && s.sock.out.len() < WRITE_BACKLOG_LIMIT {
                // What it sent meanwhile waits in its socket, which raises no new edge.
                s.reading = Reading::Open;
                self.sessions.resume.push(i as u32);
            } else if let Some(reason) = self.ends_now(i) {
                self.close_session(i, reason);
            }
        }
        dirty.clear();
        if self.sessions.dirty.is_empty() {
            self.sessions.dirty = dirty;
        }
        // Those that end after bad input without a write this round (their client reads
        // nothing) end when their time is up.
        let mut ending = mem::take(&mut self.sessions.ending);
        ending.retain(|&i| {
            let i = i as usize;
            if self.sessions.get(i).is_none() {
                return false;
            }
            let end = self.ends_now(i);
            if let Some(reason) = end {
                self.close_session(i, reason);
            }
            end.is_none()
        });
        self.sessions.ending = ending;
    }

    /// Whether session `i` ends now, as [`Engine::flush_sessions`] says, and why.
    fn ends_now(&mut self, i: usize) -> Option<CloseReason> {
        let now = self.now;
        let s = self.sessions.get(i)?;
        match s.reading {
            // A client that left with calls in flight ends at once, its calls abandoned
            // (HAProxy's `abortonclose`): callers that send and close cannot hold
            // sessions, and the connection cap, for as long as their calls take. One with
            // nothing in flight is given what it was answered first (a client that only
            // closed its side reads it), for `--write-timeout` at most.
            Reading::PeerClosed if s.in_flight > 0 || !s.sock.unwritten() => {
                Some(CloseReason::Peer)
            }
            Reading::BadInput(until) if !s.sock.unwritten() || now >= until => {
                Some(CloseReason::BadInput)
            }
            _ => None,
        }
    }

    /// Closes the sessions whose time is up: bytes waiting for a client that took none
    /// for `--write-timeout`, a frame begun and not whole after `--frame-timeout`, or
    /// nothing in flight, to write or partly read for `--idle-timeout` since it last read
    /// a call or was given an outcome. Looked at every [`timeout_sweep`] at most.
    pub(super) fn sweep_sessions(&mut self) {
        if self.now < self.next_session_sweep {
            return;
        }
        let limits = self.config.timeouts;
        let mut every = timeout_sweep(&limits);
        if let Some(tls) = &self.shared.security.tls {
            // A handshake is refused at most a quarter of its timeout late.
            every = every.min((tls.handshake_timeout() / 4).max(Duration::from_millis(10)));
        }
        self.next_session_sweep = self.now + every;
        let now = self.now;
        for i in 0..self.sessions.slots.len() {
            let Some(s) = self.sessions.get(i) else {
                continue;
            };
            if let Some(h) = s.handshake.as_ref().filter(|h| h.until <= now) {
                if let Some(tls) = &self.shared.security.tls {
                    let e = io::Error::new(io::ErrorKind::TimedOut, "the handshake took too long");
                    tls.refused(h.peer, TlsRefusal::Timeout, &e);
                }
                self.close_session(i, CloseReason::TlsHandshake);
                continue;
            }
            if s.reading == Reading::BudgetPaused {
                // Timed only while it is one of those holding the budget: a session paused
                // by what others hold is not closed for it.
                if !s.held.is_holding() {
                    s.clock.frame_since = None;
                } else if s.clock.frame_since.is_none() {
                    s.clock.frame_since = Some(now);
                }
            }
            if s.held.sheds() {
                if let Some(a) = TIMEOUT_LINES.admit() {
                    tracing::warn!(
                        held = s.sock.room(),
                        seen = a.seen,
                        left_out = a.left_out,
                        "connection closed: it held the most of a memory budget past its high mark"
                    );
                }
                self.close_session(i, CloseReason::MemoryBudget);
                continue;
            }
            let c = s.clock;
            let idle = s.in_flight == 0 && !s.sock.unwritten() && s.sock.rbuf.is_empty();
            let due = [
                (
                    c.write_since.map(|t| t + limits.write),
                    CloseReason::WriteTimeout,
                ),
                (
                    c.frame_since.map(|t| t + limits.frame),
                    CloseReason::FrameTimeout,
                ),
                (
                    idle.then_some(c.busy_at + limits.idle),
                    CloseReason::IdleTimeout,
                ),
            ];
            if let Some((_, reason)) = due.iter().find(|(d, _)| d.is_some_and(|d| d <= now)) {
                // A frame unfinished while this session is one of those holding the budget
                // past its pause mark (paused, or about to be at its next read): closed for
                // the budget, as on Tokio.
                let holding =
                    s.reading == Reading::BudgetPaused || self.budget.should_pause(s.sock.room());
                let reason = match reason {
                    CloseReason::FrameTimeout if holding => &CloseReason::MemoryBudget,
                    r => r,
                };
                if let Some(a) = TIMEOUT_LINES.admit() {
                    tracing::debug!(
                        reason = reason.label(),
                        seen = a.seen,
                        left_out = a.left_out,
                        "connection closed: its time was up"
                    );
                }
                self.close_session(i, *reason);
            }
        }
    }

    /// Reads again the sessions the memory budget paused, once it no longer pauses them.
    pub(super) fn resume_budget_paused(&mut self) {
        if self.sessions.budget_paused.is_empty() {
            return;
        }
        if self.now >= self.next_peer_check {
            // Paused, it reads nothing, and its caller's leaving raises no event while
            // bytes wait unread: looked for every `PAUSED_PEER_CHECK`.
            self.next_peer_check = self.now + PAUSED_PEER_CHECK;
            for k in 0..self.sessions.budget_paused.len() {
                let i = self.sessions.budget_paused[k] as usize;
                let left = self
                    .sessions
                    .get(i)
                    .filter(|s| s.reading == Reading::BudgetPaused);
                if left.is_some_and(|s| s.sock.peer_left_mid_frame()) {
                    self.peer_closed(i);
                }
            }
        }
        let mut paused = mem::take(&mut self.sessions.budget_paused);
        paused.retain(|&i| {
            let Some(s) = self.sessions.get(i as usize) else {
                return false;
            };
            let room = s.sock.room();
            if s.reading == Reading::BudgetPaused && budget_pauses(&self.budget, &s.sock) {
                return true;
            }
            if s.reading == Reading::BudgetPaused {
                s.reading = Reading::Open;
                s.held.set_waiting(false, room);
                // What it sent meanwhile waits in its socket, which raises no new edge.
                self.sessions.resume.push(i);
            }
            false
        });
        self.sessions.budget_paused = paused;
    }

    /// Whether sessions wait for the memory budget.
    pub(super) fn any_budget_paused(&self) -> bool {
        !self.sessions.budget_paused.is_empty()
    }

    /// Sessions open now.
    pub(super) fn sessions_open(&self) -> usize {
        self.sessions.open()
    }

    /// Whether every session has written all it was given (the drain waits for it).
    pub(super) fn all_written(&self) -> bool {
        self.sessions
            .slots
            .iter()
            .all(|(_, s)| s.as_ref().is_none_or(|s| !s.sock.unwritten()))
    }

    /// Sessions that end after bad input and wait for their time to be up.
    pub(super) fn any_ending(&self) -> bool {
        !self.sessions.ending.is_empty()
    }

    /// Ends session `i`, for `reason`. Its calls in flight stay with their providers;
    /// their outcomes are counted as abandoned when they come.
    pub(super) fn close_session(&mut self, i: usize, reason: CloseReason) {
        if let Some(mut s) = self.sessions.remove(i) {
            if let Some(tls) = &self.shared.security.tls {
                if let Some(h) = &s.handshake {
                    // A handshake cut short by something else than its own refusal
                    // (counted where it was refused) is a refusal too.
                    let (why, what) = match reason {
                        CloseReason::TlsHandshake => (None, ""),
                        CloseReason::IdleTimeout
                        | CloseReason::FrameTimeout
                        | CloseReason::WriteTimeout => (Some(TlsRefusal::Timeout), "timed out"),
                        _ => (Some(TlsRefusal::Other), "closed by the broker"),
                    };
                    if let Some(why) = why {
                        tls.refused(h.peer, why, &io::Error::other(what));
                    }
                }
                if let Some(t) = s.sock.tls.as_mut() {
                    // The end told to the client, as the Tokio engine's streams tell it,
                    // unless it is gone; and the alert of a refusal written, if it can be.
                    if !matches!(reason, CloseReason::Peer | CloseReason::Error) {
                        t.send_close_notify();
                    }
                    let _ = s.sock.flush();
                }
            }
            let _ = self.poll.registry().deregister(&mut s.sock.stream);
            self.shared.source_closed(s.source);
            tracing::debug!(reason = reason.label(), "connection closed");
            self.counts.closed(reason);
            self.shared.workers[self.index]
                .sessions
                .fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Ends every session, after a last write of what each has: the drain is over.
    /// Those still open past the grace period are counted cut, and those of them with
    /// answers left unwritten aborted, as the Tokio engine's listener counts them.
    pub(super) fn close_all(&mut self) {
        self.flush_sessions();
        let past_grace = self.grace_until.is_some_and(|g| self.now >= g);
        for i in 0..self.sessions.slots.len() {
            if let Some(s) = self.sessions.peek_at(i).filter(|_| past_grace) {
                self.summary.cut += 1;
                self.summary.aborted += u64::from(s.sock.unwritten());
            }
            self.close_session(i, CloseReason::Shutdown);
        }
    }
}

/// Whether the memory budget keeps a session with `sock` from reading now, as the Tokio
/// engine's `FramedIo::budget_pause` says: past the pause mark while it holds the pause
/// floor or more, or its read buffer must grow to read on ([`Socket::must_grow`]) and a
/// read chunk more does not fit (so that many connections growing together cannot take
/// the process past its limit, each under the floor).
fn budget_pauses(budget: &MemoryBudget, sock: &Socket) -> bool {
    budget.should_pause(sock.room()) || (sock.must_grow() && !budget.fits(READ_CHUNK))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mio::net::TcpStream;

    #[test]
    fn an_extension_block_gives_where_the_body_starts_the_budget_and_the_deadline_as_sent() {
        let body = b"\0\x0bEchoService\0\x04Echo\0\0\0\0";
        let mut frame_body = ext::deadline_block(Duration::from_millis(1500)).to_vec();
        frame_body.extend_from_slice(body);
        assert_eq!(
            split_ext(&frame_body).unwrap(),
            (
                ext::DEADLINE_BLOCK_LEN,
                Some(Duration::from_millis(1500)),
                Some(1_500_000)
            )
        );
        // A block with a caller and a deadline is walked: no deadline "as sent".
        let mut block = BytesMut::new();
        ext::put_caller_block(&mut block, Some("me")).unwrap();
        let mut one = BytesMut::new();
        ext::put_ext_request_with_deadline(
            &mut one,
            Flags::NONE,
            1,
            &block,
            Some(Duration::from_secs(2)),
            body,
        );
        let walked = &one[rpcmesh_wire::frame::HEADER_LEN..one.len() - 4];
        let (at, budget, as_sent) = split_ext(walked).unwrap();
        assert_eq!(&walked[at..], body);
        assert_eq!((budget, as_sent), (Some(Duration::from_secs(2)), None));
        // A block longer than the body is refused.
        assert!(split_ext(b"\xff\xff").is_err());
    }

    #[test]
    fn a_reused_session_index_is_not_the_session_a_call_named() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let budget = rpcmesh_common::net::budget::MemoryBudget::new(1 << 30);
        let source = Source::of(addr.ip());
        let session = || {
            let stream = TcpStream::connect(addr).unwrap();
            Session::new((stream, source), Instant::now(), &budget)
        };
        let mut sessions = Sessions::default();
        let i = sessions.insert(session());
        let first = sessions.ref_of(i);
        assert!(sessions.get_ref(first).is_some());
        sessions.remove(i);
        assert!(sessions.get_ref(first).is_none(), "gone");
        let j = sessions.insert(session());
        assert_eq!(i, j, "the index is reused");
        assert!(sessions.get_ref(first).is_none(), "under a new generation");
        assert!(sessions.get_ref(sessions.ref_of(j)).is_some());
        assert_eq!(sessions.open(), 1);
    }
}
