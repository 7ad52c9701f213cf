//! The server-session skeleton the provider and the broker share: one task per accepted
//! connection that reads frames, lets the program's [`Protocol`] act on them and on its own
//! events, and writes what was produced, once per round. The skeleton owns what every
//! server session does the same way: the loop, reading only while the write backlog is
//! under [`WRITE_BACKLOG_LIMIT`] and the memory budget does not pause it
//! ([`crate::net::budget`]), splitting reads into frames and stopping on input beyond
//! repair, the connection's [`Timeouts`] (idle, frame, write), the drain on shutdown
//! (answering what still arrives for [`DRAIN_LINGER`] once idle, then closing), the end of
//! the grace period (every call still in flight answered "unavailable: shutting down"
//! before the connection closes), the final flush, [`SessionError`], and the
//! [`CloseReason`] the session ended with; and, for a server of several runtimes, the
//! move of a session to another between two of its rounds ([`serve_movable`]: its
//! connection, buffers and clocks go whole, its calls in flight stay in flight).
//!
//! The protocol owns what the frames mean: the provider decodes calls and runs handlers;
//! the broker routes calls to providers and writes their replies back. Neither sees the
//! loop, and the loop never looks inside a frame.

use std::future::Future;
use std::time::Duration;

use rpcmesh_wire::frame::{Frame, FrameError, MsgType};

use tokio::time::Instant;

use crate::net::connection::{CloseReason, DetachedIo, FramedIo, IoEvent};
use crate::net::shutdown::{CancellationToken, Cancelled};

/// Replies waiting to be written beyond which a session stops reading requests until the
/// caller reads: 8 MiB, so a caller that stops reading cannot make a server buffer without
/// end (beyond what the calls already admitted bring), while a fast one never hits it.
pub const WRITE_BACKLOG_LIMIT: usize = 8 * 1024 * 1024;
/// How long a closing session waits to deliver its last replies (e.g. the error reply to a
/// too-large frame) before dropping the socket.
pub const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a draining session, once it has nothing in flight, keeps reading and
/// answering before it closes: requests its caller sent before hearing of the drain are
/// still on their way, and closing on them would lose them (and reset the connection).
/// 200 ms covers any LAN round trip many times. Every call read while draining starts
/// the linger again (a caller starved of CPU may act on the refusal late), so a caller
/// that keeps sending calls keeps its session until the grace period ends; a heartbeat
/// does not, or a pool checking its connections more often than the linger would hold
/// an idle session for the whole grace.
pub const DRAIN_LINGER: Duration = Duration::from_millis(200);
/// How long a draining session that told its caller so (a drain notice) waits, once idle,
/// for the caller to close: such a caller stops writing calls as soon as it reads the
/// notice and closes once its calls are answered, within a round trip; 2 s covers a caller
/// starved of CPU many times, and bounds one that never closes.
pub const NOTICED_DRAIN_LINGER: Duration = Duration::from_secs(2);
/// Calls in flight on one multiplexed connection between a broker and a provider, by
/// default: the broker puts up to this many on one pooled connection and the provider
/// takes as many, so that the broker, which can move calls to another connection, is the
/// one to shed.
pub const DEFAULT_MAX_IN_FLIGHT_PER_LINK: usize = 16_384;

/// How long a connection may be idle (no call in flight, nothing to write, nothing read)
/// before the server closes it: a minute, long beyond any pause of a caller that means to
/// go on (the broker's pooled connections send a heartbeat every second), short enough that
/// idle sockets cannot hold the connection cap for long (HAProxy's `timeout client` is
/// commonly 30-60 s, nginx's `keepalive_timeout` 75 s).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a frame may take to arrive once its first byte has: 10 s, HAProxy's advice for
/// `timeout http-request`. A frame of the default largest body (10 MiB) needs about
/// 8.4 Mbit/s; a byte-a-second trickler is closed after 10 s instead of never. Time while
/// the server itself is not reading (its write backlog is full) does not count, nor time
/// the memory budget pauses it for what others hold (`crate::net::budget`).
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(10);
/// How long replies may wait for a peer that takes none of them: 30 s (HAProxy's common
/// `timeout client`), beyond a long GC pause of a caller, short enough that a caller that
/// stopped reading does not keep its backlog for ever.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a connection the memory budget pauses looks whether its caller left in the
/// middle of a frame (`FramedIo::peer_left_mid_frame`): while bytes it has not read wait in
/// the kernel the socket stays readable, so the caller's FIN wakes no one. A second: a
/// hundred callers that sent part of a frame and left free the budget within about one,
/// for two system calls a second per paused connection, and only while paused.
pub const PAUSED_PEER_CHECK: Duration = Duration::from_secs(1);

/// The time limits of one server connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// No call in flight, nothing to write and nothing read for this long: closed.
    pub idle: Duration,
    /// A frame begun and not complete after this long: closed.
    pub frame: Duration,
    /// Bytes to write and none taken by the peer for this long: closed.
    pub write: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            idle: DEFAULT_IDLE_TIMEOUT,
            frame: DEFAULT_FRAME_TIMEOUT,
            write: DEFAULT_WRITE_TIMEOUT,
        }
    }
}

/// The two moments of a server's shutdown, as a session sees them.
#[derive(Clone, Debug, Default)]
pub struct Stop {
    /// Shutdown began: take no new calls, finish the ones in flight.
    pub drain: CancellationToken,
    /// The grace period is over: answer every call still in flight "shutting down" now,
    /// then close.
    pub grace_over: CancellationToken,
}

/// Why a session ended before its caller left.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The socket failed (reset, broken pipe...).
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// The caller sent bytes the stream cannot be resynchronised after.
    #[error("input beyond repair: {0}")]
    BadInput(FrameError),
    /// One of the connection's [`Timeouts`] passed (the reason says which).
    #[error("{} passed", .0.label())]
    Timeout(CloseReason),
}

impl SessionError {
    /// The reason the connection is counted as closed for.
    pub fn reason(&self) -> CloseReason {
        match self {
            SessionError::Io(_) => CloseReason::Error,
            SessionError::BadInput(_) => CloseReason::BadInput,
            SessionError::Timeout(r) => *r,
        }
    }
}

/// What a server program does on one connection; [`serve`] runs the loop around it. Every
/// method gets the connection to append its frames to.
pub trait Protocol: Send {
    /// An event of the protocol's own: a reply from upstream, a handler that finished.
    type Event: Send;

    /// Waits for the next event of the protocol's own. Must be cancel-safe (it is raced
    /// against the socket each round); pending for ever when none can come.
    fn next_event(&mut self) -> impl Future<Output = Self::Event> + Send;

    /// Handles one event (and may take others that are ready now, for the same write).
    fn on_event(&mut self, event: Self::Event, io: &mut FramedIo);

    /// A read brought bytes; its frames follow.
    fn on_read(&mut self) {}

    /// Called after the frames of a read were handled (before anything is written), also
    /// when the read ends in input the session cannot get past.
    fn after_frames(&mut self) {}

    /// Handles one request. `draining`: shutdown has begun, new calls are to be refused.
    fn on_request(&mut self, frame: Frame, io: &mut FramedIo, draining: bool);

    /// Told the CRC trailer of the request frame handed over next (as received, already
    /// checked), for a forwarder that rewrites only the frame's id and keeps its CRC
    /// (`rpcmesh_wire::neutral`).
    fn on_trailer(&mut self, _trailer: u32) {}

    /// Handles a request carrying a call extension (`rpcmesh_wire::ext`), which only a
    /// server that says it takes it is sent; by default it is what a v1 peer makes of it,
    /// a frame of unknown type.
    fn on_ext_request(&mut self, frame: Frame, io: &mut FramedIo, _draining: bool) {
        let e = FrameError::UnknownType {
            req_id: frame.header.req_id,
            raw_type: MsgType::ExtRequest as u8 | frame.header.flags.bits(),
        };
        self.on_bad_frame(&e, io);
    }

    /// Whether a read of heartbeats alone keeps the connection from being idle. True by
    /// default: the broker's pooled connections to a provider carry only heartbeats while
    /// no call comes, and must stay. A server whose callers have no reason to keep an
    /// unused connection (the broker's client side) says false, so that sockets sending
    /// one heartbeat per idle period cannot hold the connection cap.
    fn heartbeats_are_activity(&self) -> bool {
        true
    }

    /// Answers a heartbeat (with one of the server's own, under the same request id).
    fn on_heartbeat(&mut self, frame: Frame, io: &mut FramedIo);

    /// Shutdown has begun. A protocol whose caller asked for a drain notice
    /// (`rpcmesh_wire::ext::DRAINING_KEY`) writes it and returns true: the session then
    /// waits for the caller to close (at most [`NOTICED_DRAIN_LINGER`] once idle) instead
    /// of closing after [`DRAIN_LINGER`], so that no call crosses its close.
    fn on_drain(&mut self, _io: &mut FramedIo) -> bool {
        false
    }

    /// A response frame came from the caller, which makes no sense in that direction: it
    /// is dropped (the skeleton logs it at debug); count it.
    fn on_unexpected(&mut self);

    /// Handles bytes that are not a usable frame (count, log, answer if a request id is
    /// known). The skeleton ends the session after it when the error is fatal.
    fn on_bad_frame(&mut self, error: &FrameError, io: &mut FramedIo);

    /// Runs just before the round's write: a chance to gather more output into it.
    fn before_write(&mut self, _io: &mut FramedIo) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Runs after the round's write (and after the final flush): record what was written,
    /// report counts.
    fn after_write(&mut self, io: &mut FramedIo);

    /// Calls taken and not yet answered: the session may close only when none is left.
    fn in_flight(&self) -> usize;

    /// The grace period is over: answer every call still in flight "unavailable: shutting
    /// down" (or make sure its answer comes as an event soon, as the broker's upstream
    /// connections do); the session closes once none is left.
    fn on_grace_over(&mut self, _io: &mut FramedIo) {}

    /// The session is ending: calls still in flight will get no answer here.
    fn on_end(&mut self) {}
}

/// Serves one connection with `protocol` until the caller leaves, the input is beyond
/// repair, the socket fails, a timeout passes, or `shutdown` has drained it; then delivers
/// what is already answered (within [`FINAL_FLUSH_TIMEOUT`]) and closes. Logs at debug how
/// it ended (callers wrap it in their span) and returns why.
pub async fn serve<P: Protocol>(
    io: FramedIo,
    protocol: P,
    timeouts: Timeouts,
    stop: Stop,
) -> CloseReason {
    match serve_movable(io, protocol, timeouts, stop, None, Resume::default()).await {
        Ended::Closed(reason) => reason,
        // Never asked to move.
        Ended::Moving(_) => CloseReason::Local,
    }
}

/// How a movable session ended on this runtime.
#[derive(Debug)]
pub enum Ended<P> {
    /// The connection is closed.
    Closed(CloseReason),
    /// It was asked to move and is ready to: serve it on the runtime it goes to, with
    /// [`Moving::resume`] (boxed: a session's state is large, and a closed one needs
    /// none of its room).
    Moving(Box<Moving<P>>),
}

/// A session between two runtimes: its connection off the reactor, its protocol, and
/// its timeouts' clocks, which keep running.
#[derive(Debug)]
pub struct Moving<P> {
    /// The connection, to [`DetachedIo::attach`] on the runtime it goes to.
    pub io: DetachedIo,
    /// The protocol's state, to be rebound to that runtime's parts by its owner.
    pub protocol: P,
    /// The clocks, for [`serve_movable`] there.
    pub resume: Resume,
}

/// The timeouts' clocks of a session that moved: an idle or slow caller is timed across
/// a move as if it had not moved. Default: a fresh session's.
#[derive(Clone, Copy, Debug, Default)]
pub struct Resume {
    idle_since: Option<Instant>,
    frame_since: Option<Instant>,
    shed_check: Option<Instant>,
    /// Not a fresh session: the clocks above are the session's.
    moved: bool,
}

/// As [`serve`], and movable: once `move_asked` is cancelled the session ends on this
/// runtime at the end of its round, its connection detached, unless it is draining
/// (then it stays, and the drain ends it here), the memory budget pauses it, or its
/// caller has left. Calls in flight stay in flight: a protocol whose outcomes reach it
/// through a channel any thread may write to (the broker's inbox) has them delivered
/// wherever it runs next. `resume`: the clocks of a session that moved here.
pub async fn serve_movable<P: Protocol>(
    mut io: FramedIo,
    mut protocol: P,
    timeouts: Timeouts,
    stop: Stop,
    move_asked: Option<&CancellationToken>,
    resume: Resume,
) -> Ended<P> {
    let end = run(&mut io, &mut protocol, timeouts, &stop, move_asked, resume).await;
    let reason = match end {
        Ok(Round::Close(reason)) => {
            tracing::debug!(reason = reason.label(), "connection closed");
            reason
        }
        Ok(Round::Move(resume)) => match io.detach() {
            Ok(io) => {
                tracing::debug!(in_flight = protocol.in_flight(), "moving");
                return Ended::Moving(Box::new(Moving {
                    io,
                    protocol,
                    resume,
                }));
            }
            Err(e) => {
                // The socket is gone with the error: nothing is left to flush.
                tracing::debug!(error = %e, "connection lost while moving");
                protocol.on_end();
                return Ended::Closed(CloseReason::Error);
            }
        },
        Err(e) => {
            tracing::debug!(error = %e, "connection ended");
            e.reason()
        }
    };
    protocol.on_end();
    if reason.flushes_on_close() {
        let _ = tokio::time::timeout(FINAL_FLUSH_TIMEOUT, io.shutdown()).await;
    }
    protocol.after_write(&mut io);
    Ended::Closed(reason)
}

/// How a session's loop ended without error.
enum Round {
    Close(CloseReason),
    Move(Resume),
}

/// The loop: one round per event (the socket's, the protocol's, the drain's, a timeout's),
/// one write per round.
async fn run<P: Protocol>(
    io: &mut FramedIo,
    p: &mut P,
    timeouts: Timeouts,
    stop: &Stop,
    move_asked: Option<&CancellationToken>,
    resume: Resume,
) -> Result<Round, SessionError> {
    let mut draining = false;
    let mut cut = false;
    let mut drain = Drain::default();
    let mut clock = Clock::new(timeouts, resume);
    clock.arm_earliest(io);
    let mut moving = false;
    let mut move_begun = move_asked.map(Cancelled::new);
    // Made once and kept registered with their tokens, and asking them only when they
    // woke the task: a `cancelled()` made each round would lock the token to add itself as
    // a waiter and lock it again to leave, and even one kept locks it twice per poll, every
    // round, for a signal that comes once in the session's life.
    let mut drain_begun = Cancelled::new(&stop.drain);
    let mut grace_ended = Cancelled::new(&stop.grace_over);
    // While the budget pauses the connection: when it next looks whether its caller left.
    // Kept across rounds, so that other wake-ups (the clock's own looks) do not put it off.
    let mut peer_check: Option<Instant> = None;
    loop {
        let paused = io.budget_pause();
        peer_check = match (&paused, peer_check) {
            (None, _) => None,
            (Some(_), None) => Some(Instant::now() + PAUSED_PEER_CHECK),
            (Some(_), due) => due,
        };
        let reading = !io.is_eof() && io.pending_write() < WRITE_BACKLOG_LIMIT && paused.is_none();
        if !reading && paused.is_none() {
            // The frame clock stops while the caller's own unread backlog keeps this side
            // from reading: that frame is not the caller's slowness. Stopped now, before
            // the round waits, and not only at its end: the timer armed while reading
            // would otherwise fire in the wait and close it. A connection the memory
            // budget pauses keeps its clock: when it is due, the time counts if this
            // connection is one of those holding the budget, and is excused if others
            // hold it (`Clock::expired`).
            clock.stop_frame();
        }
        let mut frames = None;
        let mut quiet = false;
        tokio::select! {
            biased;
            event = p.next_event() => p.on_event(event, io),
            ev = io.wait_io(reading) => {
                if let IoEvent::Read = ev? {
                    let (n, heartbeats) = take_frames(io, p, draining)?;
                    // A read of heartbeats alone is no activity to a protocol that says
                    // so: the idle clock runs on.
                    quiet = n > 0 && n == heartbeats && !p.heartbeats_are_activity();
                    if draining && n > heartbeats {
                        // The caller is still sending calls (it has not heard of the
                        // drain yet, or was too busy to act on it): closing now would
                        // lose what it sends next. The linger starts again once idle; the
                        // grace period bounds it all. Heartbeats do not (see
                        // `DRAIN_LINGER`).
                        drain.restart();
                    }
                    frames = Some(n);
                }
            }
            () = drain.lingered(), if draining => {}
            () = &mut drain_begun, if !draining => {
                tracing::debug!(in_flight = p.in_flight(), "draining");
                draining = true;
                if p.on_drain(io) {
                    drain.linger = NOTICED_DRAIN_LINGER;
                }
            }
            () = async { if let Some(m) = move_begun.as_mut() { m.await } }, if move_begun.is_some() && !moving => {
                moving = true;
            }
            () = &mut grace_ended, if !cut => {
                tracing::debug!(in_flight = p.in_flight(), "grace period over");
                p.on_grace_over(io);
                (draining, cut) = (true, true);
            }
            () = clock.fired() => {
                if let Some(reason) = clock.expired(io) {
                    return Err(SessionError::Timeout(reason));
                }
            }
            () = relieved(paused.as_deref()), if paused.is_some() => {}
            // Made only when polled: `select!` evaluates a disabled branch's future too,
            // and a `Sleep` reads the clock and builds a timer entry (a cost per round).
            () = async { tokio::time::sleep_until(peer_check.unwrap_or_else(Instant::now)).await }, if paused.is_some() => {
                peer_check = None;
                if io.note_peer_left() {
                    take_frames(io, p, draining)?;
                }
            }
        }
        p.before_write(io).await;
        io.try_flush()?;
        io.account();
        p.after_write(io);
        let idle = p.in_flight() == 0 && io.pending_write() == 0;
        if io.is_eof() && (idle || p.in_flight() > 0) {
            // The caller left: its calls in flight are abandoned at once (as HAProxy's
            // `abortonclose`), so a caller that sends and closes costs no session while
            // its replies are on their way; they are dropped when they come. What is
            // already answered still goes out in the final flush.
            return Ok(Round::Close(CloseReason::Peer));
        }
        if (cut && idle) || drain.should_close(draining, idle) {
            return Ok(Round::Close(CloseReason::Shutdown));
        }
        if moving && !draining && paused.is_none() && !io.is_eof() {
            return Ok(Round::Move(clock.resume()));
        }
        clock.update(io, frames, reading, idle, quiet);
    }
}

/// The process's budget of log lines for connections closed to relieve the memory budget.
static SHED_LINES: crate::net::thinned::Thinned = crate::net::thinned::Thinned::new();

/// Resolves when the memory budget that paused this connection's reads is relieved.
async fn relieved(budget: Option<&crate::net::budget::MemoryBudget>) {
    if let Some(b) = budget {
        b.relieved().await;
    }
}

/// The connection's timeouts: when each started to run, and one timer armed at the
/// earliest deadline. The timer is moved earlier when a deadline comes before it, never
/// later: a deadline that moved away (the connection was busy again) makes it fire once
/// for nothing and re-arm, so a busy connection touches the timer at most once per timeout
/// period instead of once per round.
struct Clock {
    limits: Timeouts,
    /// Since when the connection has been idle (no call in flight, nothing to write,
    /// nothing partly read), read or not.
    idle_since: Option<Instant>,
    /// When the frame being read began to arrive.
    frame_since: Option<Instant>,
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    armed: Option<Instant>,
    /// The memory budget paused the connection at the last update.
    was_paused: bool,
    /// When a connection holding much of the memory budget next looks whether it is the
    /// one to close (`budget::SHED_CHECK`); `None` while it holds little.
    shed_check: Option<Instant>,
}

impl Clock {
    fn new(limits: Timeouts, resume: Resume) -> Self {
        let now = Instant::now();
        let mut clock = Clock {
            limits,
            idle_since: Some(now),
            frame_since: None,
            was_paused: false,
            shed_check: None,
            timer: Box::pin(tokio::time::sleep_until(now + limits.idle)),
            armed: None,
        };
        if resume.moved {
            clock.idle_since = resume.idle_since;
            clock.frame_since = resume.frame_since;
            clock.shed_check = resume.shed_check;
        }
        clock.arm(now + limits.idle);
        clock
    }

    /// Arms the timer for the earliest deadline, if it is before the one armed (a moved
    /// session's clocks may be due before its idle timeout).
    fn arm_earliest(&mut self, io: &FramedIo) {
        if let Some(due) = self.next_due(io) {
            if self.armed.is_none_or(|armed| due < armed) {
                self.arm(due);
            }
        }
    }

    /// The clocks, for the runtime the session moves to (its timer stays behind).
    fn resume(&self) -> Resume {
        Resume {
            idle_since: self.idle_since,
            frame_since: self.frame_since,
            shed_check: self.shed_check,
            moved: true,
        }
    }

    /// This side stopped reading: the frame being read is not timed meanwhile (it starts
    /// again, from zero, when reading resumes).
    fn stop_frame(&mut self) {
        self.frame_since = None;
    }

    /// Takes the round's state: `frames` is how many whole frames a read brought (`None`:
    /// no read this round); `reading`: whether the session read at all; `idle`: nothing in
    /// flight, nothing to write.
    fn update(
        &mut self,
        io: &FramedIo,
        frames: Option<usize>,
        reading: bool,
        idle: bool,
        quiet: bool,
    ) {
        let partial = io.has_partial_frame();
        let paused = io.is_budget_paused();
        // Reads resumed after a pause: the frame is timed from now, as if it had begun
        // (the time paused was either excused or, had this connection held the budget,
        // would have closed it).
        let resumed = std::mem::replace(&mut self.was_paused, paused) && !paused;
        if !(reading || paused) || !partial {
            self.frame_since = None;
        } else if frames.is_some_and(|n| n > 0) || self.frame_since.is_none() || resumed {
            self.frame_since = Some(Instant::now());
        }
        if !idle || partial {
            self.idle_since = None;
        } else if (frames.is_some() && !quiet) || self.idle_since.is_none() {
            self.idle_since = Some(Instant::now());
        }
        if !io.is_large_holder() {
            self.shed_check = None;
        } else if self.shed_check.is_none() {
            self.shed_check = Some(Instant::now() + crate::net::budget::SHED_CHECK);
        }
        self.arm_earliest(io);
    }

    fn deadlines(&self, io: &FramedIo) -> [(Option<Instant>, CloseReason); 4] {
        let l = &self.limits;
        [
            (self.shed_check, CloseReason::MemoryBudget),
            (
                io.write_stalled_since().map(|t| t + l.write),
                CloseReason::WriteTimeout,
            ),
            (
                self.frame_since.map(|t| t + l.frame),
                CloseReason::FrameTimeout,
            ),
            (
                self.idle_since.map(|t| t + l.idle),
                CloseReason::IdleTimeout,
            ),
        ]
    }

    fn next_due(&self, io: &FramedIo) -> Option<Instant> {
        self.deadlines(io).into_iter().filter_map(|(d, _)| d).min()
    }

    fn arm(&mut self, at: Instant) {
        self.armed = Some(at);
        self.timer.as_mut().reset(at);
    }

    /// Resolves when the timer is due (never while it is not armed).
    async fn fired(&mut self) {
        match self.armed {
            Some(_) => (&mut self.timer).await,
            None => std::future::pending().await,
        }
    }

    /// After the timer fired: the timeout that passed, if one did; else the timer is
    /// re-armed for the next deadline.
    fn expired(&mut self, io: &FramedIo) -> Option<CloseReason> {
        let now = Instant::now();
        if let Some((_, reason)) = self
            .deadlines(io)
            .into_iter()
            .find(|(d, _)| d.is_some_and(|d| d <= now))
        {
            if reason == CloseReason::MemoryBudget {
                // A large holder's look: closed if it holds the most of a budget long
                // past its high mark; else it looks again later.
                if io.sheds() {
                    if let Some(a) = SHED_LINES.admit() {
                        tracing::warn!(
                            held = io.buffered(),
                            after_s = crate::net::budget::SHED_AFTER.as_secs(),
                            closed = a.seen,
                            left_out = a.left_out,
                            "memory budget past its high mark too long: closing the connection that holds the most"
                        );
                    }
                    return Some(reason);
                }
                self.shed_check = Some(now + crate::net::budget::SHED_CHECK);
                return self.expired(io);
            }
            if reason != CloseReason::FrameTimeout || !io.is_budget_paused() {
                return Some(reason);
            }
            if io.holds_budget() {
                return Some(CloseReason::MemoryBudget);
            }
            // Paused by what others hold: the time so far is excused, and the clock looks
            // again one frame timeout on.
            self.frame_since = Some(now);
            return self.expired(io);
        }
        self.armed = None;
        if let Some(due) = self.next_due(io) {
            self.arm(due);
        }
        None
    }
}

/// Hands every whole frame read so far to the protocol; returns how many there were, and
/// how many of them were heartbeats.
fn take_frames<P: Protocol>(
    io: &mut FramedIo,
    p: &mut P,
    draining: bool,
) -> Result<(usize, usize), SessionError> {
    p.on_read();
    let mut n = 0;
    let mut heartbeats = 0;
    loop {
        match io.next_frame_with_trailer() {
            Ok(Some((frame, trailer))) => match frame.header.msg_type {
                MsgType::Request => {
                    p.on_trailer(trailer);
                    p.on_request(frame, io, draining);
                }
                MsgType::Heartbeat => {
                    heartbeats += 1;
                    p.on_heartbeat(frame, io);
                }
                MsgType::ExtRequest => {
                    p.on_trailer(trailer);
                    p.on_ext_request(frame, io, draining);
                }
                MsgType::Response => {
                    tracing::debug!(
                        req_id = frame.header.req_id,
                        "response frame from a caller dropped"
                    );
                    p.on_unexpected();
                }
            },
            Ok(None) => {
                p.after_frames();
                return Ok((n, heartbeats));
            }
            Err(e) => {
                p.on_bad_frame(&e, io);
                if e.is_fatal() {
                    p.after_frames();
                    return Err(SessionError::BadInput(e));
                }
            }
        }
        n += 1;
    }
}

/// When a session that is draining may close.
#[derive(Debug)]
struct Drain {
    deadline: Option<tokio::time::Instant>,
    /// How long it stays once idle: [`DRAIN_LINGER`], or [`NOTICED_DRAIN_LINGER`] when
    /// its caller was told of the drain (and closes itself).
    linger: Duration,
}

impl Default for Drain {
    fn default() -> Drain {
        Drain {
            deadline: None,
            linger: DRAIN_LINGER,
        }
    }
}

impl Drain {
    /// True when the session should close now: draining, `idle` (no call in flight,
    /// nothing left to write), and idle for its linger since it first was.
    fn should_close(&mut self, draining: bool, idle: bool) -> bool {
        if !draining || !idle {
            return false;
        }
        let now = tokio::time::Instant::now();
        let deadline = *self.deadline.get_or_insert(now + self.linger);
        now >= deadline
    }

    /// Frames arrived while draining: the linger counts again from the next idle moment.
    fn restart(&mut self) {
        self.deadline = None;
    }

    /// Resolves when the linger ends (never before the session first went idle).
    async fn lingered(&self) {
        match self.deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use rpcmesh_wire::body::Request;
    use rpcmesh_wire::codec::FrameCodec;
    use rpcmesh_wire::frame::Flags;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::mpsc;

    /// A protocol that answers each request frame after an event says so: requests are
    /// held in flight until the test sends their id (an id released before its request is
    /// read is answered as soon as it is).
    struct Held {
        release: mpsc::UnboundedReceiver<u64>,
        held: Vec<u64>,
        released: Vec<u64>,
        seen_draining: bool,
        ended: Option<tokio::sync::oneshot::Sender<(usize, bool)>>,
        /// Payload bytes of each answer.
        reply_len: usize,
        /// Request frames of the read being handled, and those of each read handled
        /// (`after_frames`).
        this_read: usize,
        reads: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
    }

    impl Protocol for Held {
        type Event = u64;
        async fn next_event(&mut self) -> u64 {
            match self.release.recv().await {
                Some(id) => id,
                None => std::future::pending().await,
            }
        }
        fn on_event(&mut self, id: u64, io: &mut FramedIo) {
            match self.held.iter().position(|h| *h == id) {
                Some(i) => {
                    self.held.swap_remove(i);
                    answer(io, id, self.reply_len);
                }
                None => self.released.push(id),
            }
        }
        fn on_heartbeat(&mut self, _: Frame, _: &mut FramedIo) {}
        fn on_unexpected(&mut self) {}
        fn after_frames(&mut self) {
            let n = std::mem::take(&mut self.this_read);
            self.reads.lock().unwrap().push(n);
        }
        fn on_request(&mut self, frame: Frame, io: &mut FramedIo, draining: bool) {
            self.this_read += 1;
            if draining || self.released.contains(&frame.header.req_id) {
                self.seen_draining |= draining;
                return answer(io, frame.header.req_id, self.reply_len);
            }
            self.held.push(frame.header.req_id);
        }
        fn on_bad_frame(&mut self, _: &FrameError, _: &mut FramedIo) {}
        fn after_write(&mut self, _: &mut FramedIo) {}
        fn in_flight(&self) -> usize {
            self.held.len()
        }
        fn on_grace_over(&mut self, io: &mut FramedIo) {
            for id in self.held.drain(..) {
                answer(io, id, 0);
            }
        }
        fn on_end(&mut self) {
            if let Some(tx) = self.ended.take() {
                let _ = tx.send((self.held.len(), self.seen_draining));
            }
        }
    }

    fn answer(io: &mut FramedIo, id: u64, len: usize) {
        rpcmesh_wire::body::Response {
            status: 0,
            payload: bytes::Bytes::from(vec![0; len]),
        }
        .put(io.wbuf(), Flags::NONE, id)
        .expect("a small frame encodes");
    }

    fn request(id: u64) -> BytesMut {
        let mut b = BytesMut::new();
        Request {
            service: bytes::Bytes::from_static(b"S"),
            method: bytes::Bytes::from_static(b"M"),
            payload: bytes::Bytes::new(),
        }
        .put(&mut b, Flags::NONE, id)
        .expect("a small frame encodes");
        b
    }

    async fn read_ids(s: &mut TcpStream, buf: &mut BytesMut, n: usize) -> Vec<u64> {
        let codec = FrameCodec::default();
        let mut ids = Vec::new();
        while ids.len() < n {
            while let Some(f) = codec.decode_frame(buf).expect("frames") {
                assert_eq!(f.header.msg_type, MsgType::Response);
                ids.push(f.header.req_id);
            }
            if ids.len() < n {
                assert!(s.read_buf(buf).await.expect("read") > 0, "closed early");
            }
        }
        ids
    }

    /// A session of [`Held`] on a real connection, and the test's end of it.
    struct Running {
        client: TcpStream,
        buf: BytesMut,
        release: mpsc::UnboundedSender<u64>,
        ended: tokio::sync::oneshot::Receiver<(usize, bool)>,
        shutdown: Stop,
        session: tokio::task::JoinHandle<CloseReason>,
        /// Request frames per read, as `after_frames` saw them.
        reads: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
    }

    async fn start() -> Running {
        start_with(Timeouts::default(), 0).await
    }

    /// Timeouts of `ms` milliseconds where given, else the defaults' (long beyond a test).
    fn timeouts(idle: Option<u64>, frame: Option<u64>, write: Option<u64>) -> Timeouts {
        let d = Timeouts::default();
        let ms = |t: Option<u64>, or| t.map(Duration::from_millis).unwrap_or(or);
        Timeouts {
            idle: ms(idle, d.idle),
            frame: ms(frame, d.frame),
            write: ms(write, d.write),
        }
    }

    async fn start_with(timeouts: Timeouts, reply_len: usize) -> Running {
        start_budgeted(timeouts, reply_len, None).await
    }

    /// As [`start_with`], the connection's buffers counted in `budget`.
    async fn start_budgeted(
        timeouts: Timeouts,
        reply_len: usize,
        budget: Option<std::sync::Arc<crate::net::budget::MemoryBudget>>,
    ) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let (release, rx) = mpsc::unbounded_channel();
        let (ended_tx, ended) = tokio::sync::oneshot::channel();
        let shutdown = Stop::default();
        let reads = std::sync::Arc::default();
        let session = tokio::spawn(serve(
            FramedIo::new(stream, FrameCodec::default()).with_budget(budget),
            Held {
                release: rx,
                held: Vec::new(),
                released: Vec::new(),
                seen_draining: false,
                ended: Some(ended_tx),
                reply_len,
                this_read: 0,
                reads: std::sync::Arc::clone(&reads),
            },
            timeouts,
            shutdown.clone(),
        ));
        Running {
            client,
            buf: BytesMut::new(),
            release,
            ended,
            shutdown,
            session,
            reads,
        }
    }

    impl Running {
        async fn send(&mut self, id: u64) {
            self.client.write_all(&request(id)).await.unwrap();
        }

        async fn answered(&mut self) -> u64 {
            read_ids(&mut self.client, &mut self.buf, 1).await[0]
        }

        /// Waits for the session to close the connection.
        async fn closed(&mut self) {
            let mut rest = Vec::new();
            let n =
                tokio::time::timeout(Duration::from_secs(10), self.client.read_to_end(&mut rest))
                    .await
                    .expect("the session closes")
                    .unwrap();
            assert_eq!(n, 0, "nothing more was answered");
        }
    }

    /// `after_frames` follows every read whose frames were handled, with the frames of that
    /// read behind it, and also a read that ends in input the session cannot get past.
    #[tokio::test]
    async fn after_frames_follows_each_read_also_one_that_ends_the_session() {
        let mut s = start().await;
        let mut three = BytesMut::new();
        for id in 1..=3 {
            three.extend_from_slice(&request(id));
        }
        s.client.write_all(&three).await.unwrap();
        let total = |s: &Running| s.reads.lock().unwrap().iter().sum::<usize>();
        for _ in 0..1000 {
            if total(&s) == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(total(&s), 3, "{:?}", s.reads.lock().unwrap());
        // A request, then a header whose body length is over the frame limit: fatal.
        let mut fatal = request(4);
        fatal.extend_from_slice(b"RPCF\x01\x00");
        fatal.extend_from_slice(&u32::MAX.to_be_bytes());
        fatal.extend_from_slice(&5u64.to_be_bytes());
        s.client.write_all(&fatal).await.unwrap();
        let reason = tokio::time::timeout(Duration::from_secs(10), &mut s.session)
            .await
            .expect("the session ends")
            .unwrap();
        assert_eq!(reason, CloseReason::BadInput, "{reason:?}");
        assert_eq!(total(&s), 4, "{:?}", s.reads.lock().unwrap());
    }

    #[tokio::test]
    async fn a_draining_session_answers_late_requests_finishes_what_it_holds_then_closes() {
        let mut s = start().await;
        s.send(1).await;
        s.send(2).await;
        s.release.send(1).unwrap();
        assert_eq!(s.answered().await, 1);
        // Shutdown with call 2 held: the session stays, answers what still arrives, and
        // closes only after call 2 is answered.
        s.shutdown.drain.cancel();
        s.send(3).await;
        assert_eq!(s.answered().await, 3);
        s.release.send(2).unwrap();
        assert_eq!(s.answered().await, 2);
        s.closed().await;
        let (left, saw_draining) = (&mut s.ended).await.unwrap();
        assert_eq!(left, 0, "nothing was left in flight");
        assert!(saw_draining, "request 3 was answered as draining");
        assert_eq!(s.session.await.unwrap(), CloseReason::Shutdown);
    }

    #[tokio::test]
    async fn an_idle_connection_is_closed_after_the_idle_timeout_and_one_with_a_call_in_flight_is_not()
     {
        let idle = 150;
        let mut s = start_with(timeouts(Some(idle), None, None), 0).await;
        s.send(1).await;
        s.release.send(1).unwrap();
        assert_eq!(s.answered().await, 1);
        // Call 2 is held for four idle timeouts: a call in flight is not idleness.
        s.send(2).await;
        tokio::time::sleep(Duration::from_millis(4 * idle)).await;
        s.release.send(2).unwrap();
        assert_eq!(s.answered().await, 2, "the held call was answered");
        s.closed().await;
        assert_eq!(s.session.await.unwrap(), CloseReason::IdleTimeout);
    }

    #[tokio::test]
    async fn a_frame_begun_and_not_finished_is_closed_after_the_frame_timeout() {
        let mut s = start_with(timeouts(None, Some(150), None), 0).await;
        let frame = request(1);
        s.client.write_all(&frame[..10]).await.unwrap();
        s.closed().await;
        assert_eq!(s.session.await.unwrap(), CloseReason::FrameTimeout);
    }

    #[tokio::test]
    async fn a_frame_the_memory_budget_keeps_from_finishing_is_not_timed_out() {
        use crate::net::budget::{MemoryBudget, PAUSE_FLOOR, PAUSE_SHARE};
        let frame_timeout = 150;
        let budget = MemoryBudget::new(8 << 20);
        let mut s = start_budgeted(
            timeouts(None, Some(frame_timeout), None),
            0,
            Some(budget.clone()),
        )
        .await;
        // A request twice the pause floor, sent up to a little past the floor: the
        // session holds that much of an unfinished frame.
        let (big, cut) = big_request();
        // The rest of the process holds the budget past its pause mark: the session stops
        // reading once it holds the floor.
        let others = (budget.limit() as f64 * PAUSE_SHARE) as usize;
        budget.add(others);
        s.client.write_all(&big[..cut]).await.unwrap();
        wait_until_held(&budget, others + PAUSE_FLOOR).await;
        // Paused for many frame timeouts: the frame is not the caller's to finish.
        tokio::time::sleep(Duration::from_millis(5 * frame_timeout)).await;
        budget.release(others);
        s.client.write_all(&big[cut..]).await.unwrap();
        s.release.send(1).unwrap();
        assert_eq!(
            s.answered().await,
            1,
            "the paused call was read and answered"
        );
        // Reading again, the frame clock runs as before.
        s.client.write_all(&request(2)[..10]).await.unwrap();
        s.closed().await;
        assert_eq!(s.session.await.unwrap(), CloseReason::FrameTimeout);
    }

    /// A request frame twice the pause floor, and how much of it the budget tests send.
    fn big_request() -> (BytesMut, usize) {
        use crate::net::budget::PAUSE_FLOOR;
        let mut big = BytesMut::new();
        Request {
            service: bytes::Bytes::from_static(b"S"),
            method: bytes::Bytes::from_static(b"M"),
            payload: bytes::Bytes::from(vec![7; 2 * PAUSE_FLOOR]),
        }
        .put(&mut big, Flags::NONE, 1)
        .expect("the frame encodes");
        (big, PAUSE_FLOOR + 4096)
    }

    #[tokio::test]
    async fn a_paused_frame_whose_connection_holds_the_budget_is_closed_after_the_frame_timeout() {
        use crate::net::budget::{MemoryBudget, PAUSE_FLOOR, PAUSE_SHARE};
        let budget = MemoryBudget::new(8 << 20);
        let mut s = start_budgeted(timeouts(None, Some(150), None), 0, Some(budget.clone())).await;
        let (big, cut) = big_request();
        // The rest of the process holds a little less than the pause mark: this
        // connection's partial frame is what takes the budget past it.
        let others = (budget.limit() as f64 * PAUSE_SHARE) as usize - PAUSE_FLOOR / 2;
        budget.add(others);
        s.client.write_all(&big[..cut]).await.unwrap();
        let reason = tokio::time::timeout(Duration::from_secs(10), &mut s.session)
            .await
            .expect("the session ends")
            .unwrap();
        assert_eq!(reason, CloseReason::MemoryBudget);
        budget.release(others);
        assert_eq!(budget.used(), 0, "what it held is released");
    }

    #[tokio::test]
    async fn a_paused_connection_whose_caller_left_mid_frame_ends() {
        use crate::net::budget::{MemoryBudget, PAUSE_FLOOR, PAUSE_SHARE};
        let budget = MemoryBudget::new(8 << 20);
        // The frame timeout is beyond the test: only the caller's leaving can end it.
        let mut s = start_budgeted(Timeouts::default(), 0, Some(budget.clone())).await;
        let (big, cut) = big_request();
        // Read whole while the budget is low; then the rest of the process takes it past
        // the pause mark, and one byte more wakes the session, which reads it and pauses
        // with nothing left unread (the caller's FIN then comes at once).
        s.client.write_all(&big[..cut]).await.unwrap();
        wait_until_held(&budget, PAUSE_FLOOR).await;
        let others = (budget.limit() as f64 * PAUSE_SHARE) as usize;
        budget.add(others);
        s.client.write_all(&big[cut..cut + 1]).await.unwrap();
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        while !paused(&budget) {
            assert!(std::time::Instant::now() < give_up, "the session pauses");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(s.client);
        let reason = tokio::time::timeout(Duration::from_secs(10), &mut s.session)
            .await
            .expect("the session ends")
            .unwrap();
        assert_eq!(reason, CloseReason::BadInput, "the frame it cut off");
        budget.release(others);
        assert_eq!(budget.used(), 0);
    }

    /// True once a connection waits for `budget`.
    fn paused(budget: &crate::net::budget::MemoryBudget) -> bool {
        budget.paused_holders() > 0
    }

    /// Waits until `budget` counts at least `n` bytes (the session has read that far).
    async fn wait_until_held(budget: &crate::net::budget::MemoryBudget, n: usize) {
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        while budget.used() < n {
            assert!(
                std::time::Instant::now() < give_up,
                "the session read {} of {n}",
                budget.used()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_trickling_frame_is_closed_by_the_frame_timeout_though_bytes_keep_coming() {
        // A byte every 20 ms never lets the connection go idle (1 s), but the frame (about
        // 30 bytes, 600 ms) cannot finish within its 200 ms.
        let mut s = start_with(timeouts(Some(1000), Some(200), None), 0).await;
        let frame = request(1);
        for b in frame.iter() {
            if s.client.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut rest = Vec::new();
        let _ = s.client.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "the trickled call was never answered");
        assert_eq!(s.session.await.unwrap(), CloseReason::FrameTimeout);
    }

    #[tokio::test]
    async fn a_caller_that_reads_nothing_is_closed_after_the_write_timeout() {
        // 8 MiB answers to a caller that never reads fill both socket buffers.
        let mut s = start_with(timeouts(None, None, Some(150)), 8 << 20).await;
        s.release.send(1).unwrap();
        s.send(1).await;
        let reason = tokio::time::timeout(Duration::from_secs(10), &mut s.session)
            .await
            .expect("the session ends")
            .unwrap();
        assert_eq!(reason, CloseReason::WriteTimeout);
    }

    #[tokio::test]
    async fn at_the_end_of_the_grace_period_calls_in_flight_are_answered_then_the_session_closes() {
        let mut s = start().await;
        s.send(1).await;
        s.send(2).await;
        // Once call 9 is answered, 1 and 2 (sent before it) have been taken and held.
        s.release.send(9).unwrap();
        s.send(9).await;
        assert_eq!(s.answered().await, 9);
        s.shutdown.drain.cancel();
        // Held calls keep the draining session open...
        s.send(3).await;
        assert_eq!(
            s.answered().await,
            3,
            "a late request is answered while draining"
        );
        // ...until the grace period ends: then both are answered, and it closes at once.
        s.shutdown.grace_over.cancel();
        let mut ids = read_ids(&mut s.client, &mut s.buf, 2).await;
        ids.sort_unstable();
        assert_eq!(ids, [1, 2]);
        s.closed().await;
        let (left, _) = (&mut s.ended).await.unwrap();
        assert_eq!(left, 0, "nothing was left without an answer");
        assert_eq!(s.session.await.unwrap(), CloseReason::Shutdown);
    }

    #[tokio::test]
    async fn input_beyond_repair_ends_the_session_and_what_was_answered_is_delivered() {
        let mut s = start().await;
        s.send(7).await;
        s.release.send(7).unwrap();
        assert_eq!(s.answered().await, 7);
        s.client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        s.closed().await;
        assert_eq!(s.session.await.unwrap(), CloseReason::BadInput);
    }

    #[tokio::test(start_paused = true)]
    async fn the_drain_closes_only_after_the_linger_and_only_when_idle() {
        let mut d = Drain::default();
        assert!(!d.should_close(false, true), "not draining");
        assert!(!d.should_close(true, false), "busy");
        assert!(!d.should_close(true, true), "the linger starts now");
        tokio::time::advance(DRAIN_LINGER - Duration::from_millis(1)).await;
        assert!(!d.should_close(true, true));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(d.should_close(true, true));
    }

    #[tokio::test(start_paused = true)]
    async fn frames_read_while_draining_start_the_linger_again() {
        let mut d = Drain::default();
        assert!(!d.should_close(true, true), "the linger starts now");
        tokio::time::advance(DRAIN_LINGER - Duration::from_millis(1)).await;
        d.restart();
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!d.should_close(true, true), "a late frame started it again");
        tokio::time::advance(DRAIN_LINGER - Duration::from_millis(1)).await;
        assert!(!d.should_close(true, true));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(d.should_close(true, true));
    }
}
