//! The loop engine: one thread and one epoll loop (mio) that owns its client sessions and
//! its connections to every provider outright. A call goes from the socket it came on to
//! the one it leaves on as a copy between two buffers, with no task, waker, channel or
//! lock in between; each socket given something in a round is written once at its end.
//! That is the shape of an L4 proxy's event loop, and of the floor the Tokio engine is
//! weighed against (docs/performance.md, "The floor without the runtime").
//!
//! Not yet the broker's engine: [`spawn`] serves a listener with the per-call part of the
//! broker's behaviour, so that the tests and `scripts/bench` can weigh what that part
//! costs on a loop against the Tokio engine (docs/performance.md, "The loop engine").
//! What it does per call, as the Tokio engine does:
//!
//! - every frame checked where it lies (the broker's codec, CRC included); bad input
//!   answered (`bad request`) where the frame names its call, the connection closed when
//!   the stream cannot be followed;
//! - heartbeats answered; a call's extension block read (its deadline);
//! - the names read and checked; the caps on calls in flight per connection and in all
//!   (`--max-in-flight-per-conn`, `--max-in-flight`); a draining broker refusing;
//! - routed: the providers named for the service first, then those for any service, by
//!   the less loaded of two; within a provider, packed onto the oldest connection with
//!   fewer than `--pack-in-flight` calls, else the least loaded; a compressed call only to
//!   an rpcmesh provider;
//! - copied under an id neutral to its CRC (`rpcmesh_wire::neutral`), the reply matched
//!   back by it and copied under the caller's id, statuses degraded for v1 callers;
//! - timed out at the earlier of its deadline and `--call-timeout`; its calls answered
//!   when a provider connection is lost, and the connection made again.
//!
//! What it does not do yet, and the Tokio engine does: TLS, metrics, the providers file,
//! health checks, pacing, ejection, retries and re-routing, the memory budget, idle and
//! slow-peer timeouts, several threads. [`spawn`] refuses a configuration that asks for
//! TLS or a providers file.

mod provider;
mod session;
pub mod socket;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::envelope::{put_error_response, put_not_run_response};
use rpcmesh_wire::frame::Flags;

use crate::config::BrokerConfig;
use crate::failure::Failure;
use provider::{Routes, Upstream};
use session::Sessions;

/// The listener's token.
const LISTENER: Token = Token(0);
/// The token of the waker that [`LoopHandle::stop`] rings.
const WAKER: Token = Token(1);
/// Provider connection `k` is `Token(FIRST_UPSTREAM + k)`.
const FIRST_UPSTREAM: usize = 2;
/// Session `i` is `Token(FIRST_SESSION + i)`: far above any provider connection.
const FIRST_SESSION: usize = 1 << 32;
/// Readiness events taken per `epoll_wait`. More wait for the next one, which does not
/// sleep while they do.
const EVENTS: usize = 1024;
/// How long a lost provider connection waits before it is made again: long enough not to
/// hammer a provider that is down, short against a restart.
const RECONNECT_AFTER: Duration = Duration::from_millis(100);
/// How often a round is taken with nothing to do while the engine drains or a provider
/// connection waits to be made again: the loop's only clock besides the sockets.
const TICK: Duration = Duration::from_millis(10);

/// What the engine did, for the tests: every call read has exactly one outcome.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Client connections accepted.
    pub accepted: u64,
    /// Requests read (plain and extended).
    pub calls: u64,
    /// Calls answered with the provider's reply.
    pub replied: u64,
    /// Calls answered by the broker itself (refused, timed out, lost).
    pub answered: u64,
    /// Calls whose caller had gone when their outcome came.
    pub orphaned: u64,
}

/// A running engine: its address, and the way to stop it.
#[derive(Debug)]
pub struct LoopHandle {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: JoinHandle<io::Result<Summary>>,
}

impl LoopHandle {
    /// The address it serves.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts the drain: no new connection, new calls refused, the calls in flight
    /// answered (by their providers, or when `--grace` is over by the broker).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.waker.wake();
    }

    /// Waits for the engine to end (after [`LoopHandle::stop`]).
    pub fn join(self) -> io::Result<Summary> {
        self.thread
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the loop engine's thread panicked")))
    }
}

/// Serves `listener` on a thread of its own with the loop engine, until told to stop.
/// Refuses what the engine does not do yet: TLS on either side, a providers file. (It
/// serves no metrics: none is asked of it.)
pub fn spawn(config: BrokerConfig, listener: std::net::TcpListener) -> io::Result<LoopHandle> {
    let unsupported = [
        (config.tls.is_some() || config.upstream_tls.is_some(), "TLS"),
        (config.providers_file.is_some(), "a providers file"),
    ];
    if let Some((_, what)) = unsupported.iter().find(|(asked, _)| *asked) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("the loop engine does not serve {what} yet"),
        ));
    }
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let poll = Poll::new()?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
    let stop = Arc::new(AtomicBool::new(false));
    let mut engine = Engine::new(config, poll)?;
    let flag = stop.clone();
    let thread = std::thread::Builder::new()
        .name("rpcmesh-loop".into())
        .spawn(move || engine.run(TcpListener::from_std(listener), &flag))?;
    Ok(LoopHandle {
        addr,
        stop,
        waker,
        thread,
    })
}

/// Everything the loop owns: one thread, no sharing.
struct Engine {
    poll: Poll,
    codec: FrameCodec,
    config: BrokerConfig,
    sessions: Sessions,
    upstreams: Vec<Upstream>,
    routes: Routes,
    /// Calls in flight in the whole engine (`--max-in-flight`).
    in_flight: usize,
    /// The clock, read once per round.
    now: Instant,
    /// No earlier than the earliest deadline of a call in flight: when the calls are
    /// looked through for those past theirs.
    next_expiry: Option<Instant>,
    /// The drain has begun: new calls are refused. Until then, `None`.
    grace_until: Option<Instant>,
    /// Where each read lands first ([`socket::Socket::fill`]).
    scratch: Vec<u8>,
    /// The text of the broker's own answers, kept to spare an allocation per answer.
    message: String,
    /// What the heartbeat asking a provider's call fields gives as the cap of every
    /// call's deadline (`rpcmesh_wire::ext::CAP_KEY`): the call timeout.
    cap_value: String,
    rng: fastrand::Rng,
    summary: Summary,
}

impl Engine {
    fn new(config: BrokerConfig, poll: Poll) -> io::Result<Engine> {
        let (routes, upstreams) = provider::connect_all(&config, &poll)?;
        let cap_value = rpcmesh_wire::ext::cap_value(config.call_timeout);
        Ok(Engine {
            codec: FrameCodec::new(config.max_body_len),
            poll,
            config,
            sessions: Sessions::default(),
            upstreams,
            routes,
            in_flight: 0,
            now: Instant::now(),
            next_expiry: None,
            grace_until: None,
            scratch: vec![0; socket::READ_CHUNK],
            message: String::new(),
            cap_value,
            rng: fastrand::Rng::new(),
            summary: Summary::default(),
        })
    }

    /// The loop: wait for sockets, read every ready one until drained (handing calls and
    /// replies along as they are found), time calls out, write what the round gave.
    fn run(&mut self, mut listener: TcpListener, stop: &AtomicBool) -> io::Result<Summary> {
        self.poll
            .registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let mut listener = Some(listener);
        let spin = self.config.busy_poll.window(1);
        // While spinning: polls that do not sleep, each empty one followed by
        // `sched_yield`, until `spin` passes with no event (`common::net::busy_poll`).
        let mut spin_until: Option<Instant> = None;
        let mut events = Events::with_capacity(EVENTS);
        loop {
            let timeout = if spin_until.is_some() || !self.sessions.resume.is_empty() {
                Some(Duration::ZERO)
            } else {
                self.sleep_for()
            };
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            self.now = Instant::now();
            if let Some(window) = spin {
                if !events.is_empty() {
                    spin_until = Some(self.now + window);
                } else if spin_until.is_some_and(|until| self.now >= until) {
                    spin_until = None;
                } else {
                    std::thread::yield_now();
                }
            }
            for i in std::mem::take(&mut self.sessions.resume) {
                self.read_session(i as usize, false);
            }
            for event in events.iter() {
                // The peer closed, or the socket failed: read it to the end.
                let to_the_end = event.is_read_closed() || event.is_error();
                match event.token() {
                    LISTENER => {
                        if let Some(l) = &listener {
                            self.accept(l)?;
                        }
                    }
                    WAKER => {}
                    Token(t) if t >= FIRST_SESSION => {
                        let i = t - FIRST_SESSION;
                        if event.is_writable() {
                            self.sessions.mark_dirty(i);
                        }
                        if event.is_readable() || to_the_end {
                            self.read_session(i, to_the_end);
                        }
                    }
                    Token(t) => self.on_upstream_event(t - FIRST_UPSTREAM, event, to_the_end),
                }
            }
            if stop.load(Ordering::Relaxed) && self.grace_until.is_none() {
                if let Some(mut l) = listener.take() {
                    let _ = self.poll.registry().deregister(&mut l);
                }
                self.grace_until = Some(self.now + self.config.grace);
            }
            if self.next_expiry.is_some_and(|t| self.now >= t) {
                self.expire_calls();
            }
            self.reconnect_due();
            if let Some(until) = self.grace_until {
                if self.in_flight > 0 && self.now >= until {
                    self.answer_all_in_flight(|_| Failure::GraceOver);
                }
            }
            self.flush();
            if self.grace_until.is_some() && self.in_flight == 0 {
                self.close_all();
                return Ok(self.summary);
            }
        }
    }

    /// How long the loop may sleep: until the next call's deadline, a provider
    /// connection's retry or the drain's end, in ticks while either of the last two waits.
    fn sleep_for(&self) -> Option<Duration> {
        let mut wake = self.next_expiry;
        if self.grace_until.is_some() || self.upstreams.iter().any(Upstream::is_down) {
            let tick = self.now + TICK;
            wake = Some(wake.map_or(tick, |w| w.min(tick)));
        }
        wake.map(|w| w.saturating_duration_since(Instant::now()))
    }

    /// Writes what this round gave: the calls, then the replies.
    fn flush(&mut self) {
        for k in 0..self.upstreams.len() {
            if let Err(e) = self.upstreams[k].flush() {
                self.upstream_lost(k, crate::failure::ConnEnd::Write(Arc::new(e)));
            }
        }
        self.flush_sessions();
    }
}

/// Writes the broker's own answer to call `id` (with the caller's `flags`) to `out`.
fn put_answer(out: &mut BytesMut, message: &mut String, id: u64, flags: Flags, failure: &Failure) {
    use std::fmt::Write as _;
    message.clear();
    let _ = write!(message, "{failure}");
    if failure.not_run() {
        // Not run: the caller may send it to another broker.
        put_not_run_response(out, id, flags, message);
    } else {
        put_error_response(out, id, flags, failure.status(), message);
    }
}
