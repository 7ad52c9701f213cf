//! One worker's connections and their lifecycle ([`Links`]). Its state says what the
//! worker writes new calls on:
//!
//! - **dialing**: nothing; an attempt is under way, to the target the [`Connector`] chose
//!   (at once, unless every target is pausing after a failure). Calls wait, parked.
//! - **up**: the current connection takes every new call. While the worker is away from its
//!   own target an attempt to go back may be under way beside it; a connection made there
//!   becomes the current one, and the one it replaces drains.
//! - **ending**: the current connection's peer closed it, or its input is beyond repair.
//!   The replies already read are handled, but no call is written on it (it would only be
//!   lost with it); it is lost next.
//! - **gave up**: no target could be reached in time ([`Patience`]). Nothing is dialled
//!   again; the worker ends once its draining connections are answered.
//! - **closed**: the run is over, every connection was handed back to be closed.
//!
//! Losing the current connection moves to dialing: the attempt to go back home if one is
//! under way, else the next target in turn (an attempt the [`Connector`] may make wait for
//! its back-off), or gives up when that would come too late.
//!
//! Beside the state, connections that take no more calls drain: one that refused a call
//! unstarted (`NOT_RUN`: its target is draining) or that the way back home replaced is kept,
//! and read, until the calls written on it are answered, then closed; one with none in
//! flight is closed at once. At most [`MAX_DRAINING`] drain at once; beyond that the oldest
//! is lost. Losing a draining connection changes nothing else.
//!
//! Owns the state, its transitions, and each connection's count of the calls in flight on
//! it. Which target to dial, and when, is the [`Connector`]'s; the calls themselves (their
//! slots, outcomes, figures) and the reading and writing are the worker's. A connection's
//! I/O is a type parameter, so that the tests drive the transitions without a socket.

use std::io;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rpcmesh_common::net::connection::{FramedIo, IoEvent};
use rpcmesh_common::net::shutdown::CancellationToken;

use crate::connection::{
    Connected, Connector, DialError, Dialing, Heard, Reach, SHED_MOVE_SPACING,
};
use crate::metrics::DriverMetrics;
use crate::outcome::Loss;

/// Connections one worker keeps draining at once (each until the calls written on it are
/// answered: within the server's grace period, 10 s by default). A rolling restart drains
/// one target at a time, so four covers one through five targets faster than a grace
/// period, and bounds a worker's sockets at five; beyond it the oldest is lost and its
/// calls count as `connection`.
pub const MAX_DRAINING: usize = 4;

/// One of the worker's connections.
#[derive(Debug)]
pub(crate) struct Link<C> {
    /// Its reading and writing (a `FramedIo`).
    pub io: C,
    /// Tells its calls apart from the other connections' in the worker's slot table.
    serial: u32,
    /// Which target it is to.
    target: usize,
    /// Calls written on it and not yet answered (or timed out).
    in_flight: usize,
    /// Whether it has brought a reply.
    heard: Heard,
    /// Bytes put in its write buffer since it was made: where the next call's frame
    /// starts in the byte stream (calls starting at or past what was written when it is
    /// lost never left the worker).
    encoded: u64,
    /// When it became the worker's current connection.
    opened: Instant,
}

impl<C> Link<C> {
    /// Its serial: the worker's calls on it say so.
    pub fn serial(&self) -> u32 {
        self.serial
    }

    /// A call whose frame is `frame_len` bytes was put in its write buffer; returns where
    /// the frame starts in the connection's byte stream.
    pub fn carry(&mut self, frame_len: usize) -> u64 {
        self.in_flight += 1;
        let at = self.encoded;
        self.encoded += frame_len as u64;
        at
    }
}

impl Link<FramedIo> {
    /// Where in the connection's byte stream its writes have reached: a call whose frame
    /// starts at or past it was never handed to the socket (it still waits in the write
    /// buffer), so it did not run.
    pub fn written(&self) -> u64 {
        self.encoded.saturating_sub(self.io.pending_write() as u64)
    }
}

/// What the worker writes new calls on (see the module's doc).
#[derive(Debug)]
enum State<C> {
    /// No connection; `attempt` is under way. `since`: when the last connection went (or
    /// the worker started), from which the worker's [`Patience`] runs.
    Dialing { attempt: Dialing, since: Instant },
    /// `link` takes the calls; `home`: an attempt to go back to the worker's own target.
    Up {
        link: Link<C>,
        home: Option<Dialing>,
    },
    /// `link` still has its last reads handled, and takes no call.
    Ending {
        link: Link<C>,
        home: Option<Dialing>,
    },
    /// No target could be reached in time.
    GaveUp,
    /// The run is over.
    Closed,
}

/// How long a worker without a connection keeps trying to make one.
#[derive(Debug, Clone)]
pub(crate) struct Patience {
    /// The run's end, in duration mode: no attempt is worth making after it.
    pub until: Option<Instant>,
    /// Otherwise, how long after the last connection went: the call timeout, past which
    /// the calls waiting for a connection fail anyway.
    pub after: Duration,
    /// Cancelled when the run stops (Ctrl-C): then no attempt waits out a back-off.
    pub stop: CancellationToken,
}

impl Patience {
    /// When a worker without a connection since `since` stops trying.
    fn give_up_by(&self, since: Instant) -> Instant {
        self.until.unwrap_or(since + self.after)
    }
}

/// Whether a transition made the worker give up reaching any target.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Move {
    /// It goes on: a connection is up, an attempt is under way, or nothing changed.
    On,
    /// It gave up, now: no target can be reached in time, nothing is dialled any more
    /// ([`Links::reach`] says so from then on). The worker fails the calls waiting for a
    /// connection and starts nothing new.
    GaveUp,
}

/// What the worker does with a connection that takes no more calls.
#[must_use]
#[derive(Debug)]
pub(crate) enum Aside<C> {
    /// Nothing: there was none, or it drains and there was room.
    Kept,
    /// It had no call in flight: close it now.
    Close(Link<C>),
    /// It drains, in place of the oldest draining one, which is handed back lost
    /// ([`Loss::TooManyDraining`]): its calls fail.
    Evict(Link<C>),
}

/// What one of the worker's connections did.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    /// The connection with this serial made progress, or failed.
    Io(u32, io::Result<IoEvent>),
    /// The attempt to this target ended: the worker hands what it made to
    /// [`Links::connected`] or [`Links::dial_failed`], which put the finished attempt away.
    /// (Boxed: a framed connection is far larger than the other events.)
    Dialed(usize, Result<Box<Connected>, DialError>),
}

/// One worker's connections: the state, the connections draining, and the connector that
/// chooses the targets.
#[derive(Debug)]
pub(crate) struct Links<C> {
    state: State<C>,
    /// Oldest first, at most [`MAX_DRAINING`].
    draining: Vec<Link<C>>,
    connector: Connector,
    patience: Patience,
    /// The last connection's serial.
    serials: u32,
}

impl<C> Links<C> {
    /// A worker's connections, dialling its first target at once (no target is pausing yet).
    pub fn new(connector: Connector, patience: Patience, now: Instant) -> Self {
        let attempt = connector.dial(connector.next_attempt(now));
        Links {
            state: State::Dialing {
                attempt,
                since: now,
            },
            draining: Vec::new(),
            connector,
            patience,
            serials: 0,
        }
    }

    /// Its connector (the counts of failures and returns home).
    pub fn connector(&self) -> &Connector {
        &self.connector
    }

    /// The connection new calls are written on (none while dialing, ending or given up).
    pub fn writable(&mut self) -> Option<&mut Link<C>> {
        match &mut self.state {
            State::Up { link, .. } => Some(link),
            _ => None,
        }
    }

    /// Whether new calls can be written now.
    pub fn is_writable(&self) -> bool {
        matches!(self.state, State::Up { .. })
    }

    /// Whether the worker still reaches, or tries to reach, a target.
    pub fn reach(&self) -> Reach {
        match self.state {
            State::GaveUp => Reach::GaveUp,
            _ => Reach::Reachable,
        }
    }

    /// The connection `serial`, current or draining.
    pub fn find(&mut self, serial: u32) -> Option<&mut Link<C>> {
        find(&mut self.state, &mut self.draining, serial)
    }

    /// Every connection, the current one first.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Link<C>> {
        let current = match &mut self.state {
            State::Up { link, .. } | State::Ending { link, .. } => Some(link),
            _ => None,
        };
        current.into_iter().chain(self.draining.iter_mut())
    }

    /// A reply came on the connection `serial`: its first shows the target healthy, and
    /// ends the target's back-off.
    pub fn heard(&mut self, serial: u32) {
        if let Some(link) = find(&mut self.state, &mut self.draining, serial)
            && link.heard == Heard::Nothing
        {
            link.heard = Heard::Reply;
            self.connector.replied(link.target);
        }
    }

    /// A call written on the connection `serial` was answered or timed out.
    pub fn settle(&mut self, serial: u32) {
        if let Some(link) = self.find(serial) {
            link.in_flight = link.in_flight.saturating_sub(1);
        }
    }

    /// The current connection `serial` is ending (its peer closed it, or its input is
    /// beyond repair): it takes no more calls, and the worker loses it once it has
    /// handled what it read.
    pub fn ending(&mut self, serial: u32) {
        if let State::Up { link, .. } = &self.state
            && link.serial == serial
        {
            self.state = match std::mem::replace(&mut self.state, State::Closed) {
                State::Up { link, home } => State::Ending { link, home },
                other => other,
            };
        }
    }

    /// A connection to `target` is up (`io`, at `now`): it becomes the current one. A
    /// current one it replaces (it was the way back to the worker's own target) is set
    /// aside.
    pub fn connected(&mut self, target: usize, io: C, now: Instant) -> Aside<C> {
        self.serials = self.serials.wrapping_add(1);
        let link = Link {
            io,
            serial: self.serials,
            target,
            in_flight: 0,
            heard: Heard::Nothing,
            encoded: 0,
            opened: now,
        };
        let replaced = match std::mem::replace(&mut self.state, State::Up { link, home: None }) {
            State::Up { link, .. } | State::Ending { link, .. } => Some(link),
            State::Dialing { .. } | State::GaveUp | State::Closed => None,
        };
        self.connector.now_on(target);
        match replaced {
            Some(old) => self.set_aside(old),
            None => Aside::Kept,
        }
    }

    /// The attempt to `target` failed: the target pauses. Without a connection the worker
    /// makes the next attempt, or gives up; beside one (the way back home), it goes on
    /// with the one it has.
    pub fn dial_failed(
        &mut self,
        target: usize,
        error: &DialError,
        metrics: &DriverMetrics,
        now: Instant,
    ) -> Move {
        self.connector.failed(target, error, metrics);
        match &mut self.state {
            State::Dialing { since, .. } => {
                let since = *since;
                self.dial_next(since, now)
            }
            State::Up { home, .. } | State::Ending { home, .. } => {
                *home = None;
                Move::On
            }
            State::GaveUp | State::Closed => Move::On,
        }
    }

    /// The connection `serial` is lost (`loss`): it is handed back, to close and fail the
    /// calls on it. When it was the current one the worker moves on (see the module's
    /// doc). `None` when there is no such connection.
    pub fn lose(&mut self, serial: u32, loss: &Loss, now: Instant) -> Option<(Link<C>, Move)> {
        match std::mem::replace(&mut self.state, State::Closed) {
            State::Up { link, home } | State::Ending { link, home } if link.serial == serial => {
                self.connector
                    .lost(link.target, link.heard, link.in_flight, loss);
                let moved = self.move_on(home, now);
                Some((link, moved))
            }
            other => {
                self.state = other;
                let i = self.draining.iter().position(|l| l.serial == serial)?;
                let link = self.draining.remove(i);
                self.log_draining_lost(&link, loss);
                Some((link, Move::On))
            }
        }
    }

    /// The connection `serial` refused a call unstarted: its target is draining. When it
    /// is the current one it takes no more calls (it is set aside), and the worker moves
    /// on as when it is lost. `None` when it is not the current one.
    pub fn drained(&mut self, serial: u32, now: Instant) -> Option<(Aside<C>, Move)> {
        self.leave(serial, now, Connector::drained)
    }

    /// Leaves the current connection `serial` (telling the connector with `tell`, by its
    /// target): it takes no more calls (it is set aside) and the worker moves on. `None`
    /// when it is not the current one.
    fn leave(
        &mut self,
        serial: u32,
        now: Instant,
        tell: fn(&mut Connector, usize),
    ) -> Option<(Aside<C>, Move)> {
        match std::mem::replace(&mut self.state, State::Closed) {
            State::Up { link, home } | State::Ending { link, home } if link.serial == serial => {
                tell(&mut self.connector, link.target);
                let aside = self.set_aside(link);
                let moved = self.move_on(home, now);
                Some((aside, moved))
            }
            other => {
                self.state = other;
                None
            }
        }
    }

    /// The current connection `serial`'s target shed a call ("overloaded"): when the run
    /// has another target and the connection has been the current one for
    /// [`SHED_MOVE_SPACING`], it takes no more calls (it is set aside) and the worker
    /// moves on, as when it drains, so that the call goes to another target. `None` when
    /// it stays (then the call is not sent again: its only other way is back to the
    /// target that shed it).
    pub fn leave_shedding(&mut self, serial: u32, now: Instant) -> Option<(Aside<C>, Move)> {
        if !self.would_leave_shedding(serial, now) {
            return None;
        }
        self.leave(serial, now, Connector::shed)
    }

    /// Whether the current connection `serial` would be left for a call its target shed
    /// ([`Links::leave_shedding`]), without leaving it.
    pub fn would_leave_shedding(&self, serial: u32, now: Instant) -> bool {
        match &self.state {
            State::Up { link, .. } => {
                link.serial == serial
                    && self.connector.targets() > 1
                    && now.saturating_duration_since(link.opened) >= SHED_MOVE_SPACING
            }
            _ => false,
        }
    }

    /// Away from its own target, the worker dials it again from time to time
    /// (`Connector::return_home`); the current connection carries the calls meanwhile.
    pub fn return_home(&mut self, now: Instant) {
        if self.patience.stop.is_cancelled() {
            return;
        }
        if let State::Up { link, home } = &mut self.state
            && home.is_none()
            && let Some(attempt) = self.connector.return_home(link.target, now)
        {
            *home = Some(self.connector.dial(attempt));
        }
    }

    /// A draining connection whose calls are all answered, to close (the oldest first).
    pub fn take_answered(&mut self) -> Option<Link<C>> {
        let i = self.draining.iter().position(|l| l.in_flight == 0)?;
        Some(self.draining.remove(i))
    }

    /// The run is over: every connection, the current one first, to close.
    pub fn close_all(&mut self) -> Vec<Link<C>> {
        let current = match std::mem::replace(&mut self.state, State::Closed) {
            State::Up { link, .. } | State::Ending { link, .. } => Some(link),
            _ => None,
        };
        current.into_iter().chain(self.draining.drain(..)).collect()
    }

    /// Without a current connection since `now`: to the attempt to go back home if one is
    /// under way, else to the next target in turn.
    fn move_on(&mut self, home: Option<Dialing>, now: Instant) -> Move {
        match home {
            Some(attempt) => {
                self.state = State::Dialing {
                    attempt,
                    since: now,
                };
                Move::On
            }
            None => self.dial_next(now, now),
        }
    }

    /// Without a connection since `since`: starts the next attempt (the next target in
    /// turn, at once unless every target is pausing), or gives up when that attempt would
    /// come too late or the run is stopping.
    fn dial_next(&mut self, since: Instant, now: Instant) -> Move {
        let attempt = self.connector.next_attempt(now);
        if attempt.at > now
            && (attempt.at >= self.patience.give_up_by(since) || self.patience.stop.is_cancelled())
        {
            self.state = State::GaveUp;
            return Move::GaveUp;
        }
        self.state = State::Dialing {
            attempt: self.connector.dial(attempt),
            since,
        };
        Move::On
    }

    /// `link` takes no more calls: closed now if none is in flight on it, else kept and
    /// read until they are answered (in place of the oldest when [`MAX_DRAINING`] drain).
    fn set_aside(&mut self, link: Link<C>) -> Aside<C> {
        if link.in_flight == 0 {
            return Aside::Close(link);
        }
        let evicted = (self.draining.len() >= MAX_DRAINING).then(|| self.draining.remove(0));
        if let Some(oldest) = &evicted {
            self.log_draining_lost(oldest, &Loss::TooManyDraining);
        }
        self.draining.push(link);
        match evicted {
            Some(oldest) => Aside::Evict(oldest),
            None => Aside::Kept,
        }
    }

    fn log_draining_lost(&self, link: &Link<C>, loss: &Loss) {
        let worker = self.connector.worker();
        if link.in_flight > 0 {
            let target = self.connector.addr(link.target);
            tracing::warn!(worker, target, calls = link.in_flight, cause = %loss, "draining connection lost");
        } else {
            tracing::debug!(worker, cause = %loss, "draining connection closed");
        }
    }
}

impl Links<FramedIo> {
    /// The next thing one of the connections did: the current one's progress first, then a
    /// draining one's, then the end of an attempt (pending for ever while there is none).
    pub async fn next_event(&mut self) -> LinkEvent {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<LinkEvent> {
        let (current, attempt) = match &mut self.state {
            State::Dialing { attempt, .. } => (None, Some(attempt)),
            State::Up { link, home } | State::Ending { link, home } => (Some(link), home.as_mut()),
            State::GaveUp | State::Closed => (None, None),
        };
        let links = current.into_iter().chain(self.draining.iter_mut());
        for l in links {
            if let Poll::Ready(r) = l.io.poll_io(cx, true) {
                return Poll::Ready(LinkEvent::Io(l.serial, r));
            }
        }
        if let Some(d) = attempt
            && let Poll::Ready(r) = d.poll_finish(cx)
        {
            return Poll::Ready(LinkEvent::Dialed(d.target, r.map(Box::new)));
        }
        Poll::Pending
    }

    /// Writes what the connections have to write, in turn from the `from`th (the current
    /// one first; a draining one may still hold calls encoded in the round it said it was
    /// draining). Stops at the first whose write fails, with its place, serial and error:
    /// the worker loses it, and goes on from the same place, where the next one now is.
    pub fn flush(&mut self, from: usize) -> Result<(), (usize, u32, io::Error)> {
        for (i, l) in self.iter_mut().enumerate().skip(from) {
            if let Err(e) = l.io.try_flush() {
                return Err((i, l.serial, e));
            }
        }
        Ok(())
    }
}

/// The connection `serial`, current or draining.
fn find<'a, C>(
    state: &'a mut State<C>,
    draining: &'a mut [Link<C>],
    serial: u32,
) -> Option<&'a mut Link<C>> {
    match state {
        State::Up { link, .. } | State::Ending { link, .. } if link.serial == serial => Some(link),
        _ => draining.iter_mut().find(|l| l.serial == serial),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connection::HOME_RETRY;
    use rpcmesh_common::metrics::Telemetry;

    /// A patience that outlasts every back-off of these tests.
    const LONG: Duration = Duration::from_secs(60);

    fn metrics() -> DriverMetrics {
        DriverMetrics::new(Telemetry::new(), "EchoService", "Echo", 0)
    }

    /// A worker's connections over `n` targets, its own being `home`, trying to connect
    /// for `after` without one. No socket: an attempt is only dialled when polled.
    fn links(n: usize, home: usize, after: Duration) -> Links<()> {
        let targets = (0..n).map(|i| format!("127.0.0.1:{}", i + 1)).collect();
        let patience = Patience {
            until: None,
            after,
            stop: CancellationToken::new(),
        };
        Links::new(Connector::new(targets, home, 0), patience, Instant::now())
    }

    fn refused() -> DialError {
        io::Error::from(io::ErrorKind::ConnectionRefused).into()
    }

    /// The state, in short.
    #[derive(Debug, PartialEq, Eq)]
    enum Is {
        /// Dialing this target.
        Dialing(usize),
        /// Up on this serial and target, maybe dialing the way back home.
        Up {
            serial: u32,
            target: usize,
            home: Option<usize>,
        },
        Ending(u32),
        GaveUp,
        Closed,
    }

    fn is(l: &Links<()>) -> Is {
        match &l.state {
            State::Dialing { attempt, .. } => Is::Dialing(attempt.target),
            State::Up { link, home } => Is::Up {
                serial: link.serial,
                target: link.target,
                home: home.as_ref().map(|d| d.target),
            },
            State::Ending { link, .. } => Is::Ending(link.serial),
            State::GaveUp => Is::GaveUp,
            State::Closed => Is::Closed,
        }
    }

    /// Writes `calls` calls on the current connection; returns its serial.
    fn carrying(l: &mut Links<()>, calls: usize) -> u32 {
        let link = l.writable().expect("a current connection");
        for _ in 0..calls {
            link.carry(0);
        }
        link.serial()
    }

    fn draining(l: &Links<()>) -> Vec<u32> {
        l.draining.iter().map(|l| l.serial).collect()
    }

    fn serial(link: &Link<()>) -> u32 {
        link.serial
    }

    #[test]
    fn a_worker_starts_by_dialling_its_own_target_and_writes_on_the_connection_made() {
        let mut l = links(2, 1, LONG);
        assert_eq!(is(&l), Is::Dialing(1));
        assert!(!l.is_writable() && l.reach() == Reach::Reachable);
        assert!(matches!(l.connected(1, (), Instant::now()), Aside::Kept));
        let up = Is::Up {
            serial: 1,
            target: 1,
            home: None,
        };
        assert_eq!(is(&l), up);
        assert!(l.is_writable());
    }

    #[test]
    fn a_refused_attempt_dials_the_next_target_at_once() {
        let mut l = links(2, 0, LONG);
        let moved = l.dial_failed(0, &refused(), &metrics(), Instant::now());
        assert_eq!(moved, Move::On);
        assert_eq!(is(&l), Is::Dialing(1));
        assert_eq!(l.connector().failures(), 1);
    }

    #[test]
    fn a_worker_waits_out_a_pause_while_its_patience_lasts_and_gives_up_after() {
        let mut patient = links(1, 0, LONG);
        let r = patient.dial_failed(0, &refused(), &metrics(), Instant::now());
        assert_eq!(r, Move::On);
        assert_eq!(
            is(&patient),
            Is::Dialing(0),
            "the pause ends before the patience"
        );

        let mut hasty = links(1, 0, Duration::ZERO);
        let r = hasty.dial_failed(0, &refused(), &metrics(), Instant::now());
        assert_eq!(r, Move::GaveUp);
        assert_eq!(is(&hasty), Is::GaveUp);
        assert!(hasty.reach() == Reach::GaveUp && !hasty.is_writable());
        hasty.return_home(Instant::now() + HOME_RETRY * 2);
        assert_eq!(is(&hasty), Is::GaveUp, "nothing is dialled any more");
    }

    #[test]
    fn a_stopping_run_does_not_wait_out_a_pause() {
        let mut l = links(1, 0, LONG);
        l.patience.stop.cancel();
        let r = l.dial_failed(0, &refused(), &metrics(), Instant::now());
        assert_eq!(r, Move::GaveUp);
    }

    #[test]
    fn a_target_that_is_not_pausing_is_dialled_whatever_the_patience() {
        let mut l = links(2, 0, Duration::ZERO);
        let r = l.dial_failed(0, &refused(), &metrics(), Instant::now());
        assert_eq!(r, Move::On);
        assert_eq!(is(&l), Is::Dialing(1));
    }

    #[test]
    fn a_lost_connection_that_had_replied_moves_to_the_next_target_at_once() {
        let mut l = links(2, 0, LONG);
        let _ = l.connected(0, (), Instant::now());
        let s = carrying(&mut l, 2);
        l.heard(s);
        let (link, moved) = l.lose(s, &Loss::ClosedByPeer, Instant::now()).unwrap();
        assert_eq!((serial(&link), link.in_flight, moved), (s, 2, Move::On));
        assert_eq!(is(&l), Is::Dialing(1));
        assert_eq!(l.connector().failures(), 0);
        assert!(l.lose(s, &Loss::ClosedByPeer, Instant::now()).is_none());
    }

    #[test]
    fn a_connection_lost_before_any_reply_counts_as_a_failed_attempt() {
        let mut l = links(2, 0, LONG);
        let _ = l.connected(0, (), Instant::now());
        let s = carrying(&mut l, 1);
        let _ = l.lose(s, &Loss::ClosedByPeer, Instant::now()).unwrap();
        assert_eq!(l.connector().failures(), 1);
        assert_eq!(is(&l), Is::Dialing(1));
    }

    #[test]
    fn a_connection_that_refused_a_call_takes_no_more_and_drains_until_its_calls_are_answered() {
        let mut l = links(2, 0, LONG);
        let _ = l.connected(0, (), Instant::now());
        let s = carrying(&mut l, 2);
        let (aside, moved) = l.drained(s, Instant::now()).unwrap();
        assert!(matches!(aside, Aside::Kept));
        assert_eq!(moved, Move::On);
        assert_eq!(is(&l), Is::Dialing(1), "new calls go to the next target");
        assert_eq!(draining(&l), [s]);
        assert!(l.drained(s, Instant::now()).is_none(), "it drains already");
        assert!(l.find(s).is_some(), "still read");
        l.settle(s);
        assert!(l.take_answered().is_none(), "a call is still out");
        l.settle(s);
        let done = l.take_answered().expect("its calls are answered");
        assert_eq!(serial(&done), s);
        assert!(draining(&l).is_empty());
    }

    #[test]
    fn a_connection_set_aside_with_no_call_in_flight_is_closed_at_once() {
        let mut l = links(2, 0, LONG);
        let _ = l.connected(0, (), Instant::now());
        let s = carrying(&mut l, 0);
        let (aside, _) = l.drained(s, Instant::now()).unwrap();
        assert!(matches!(aside, Aside::Close(link) if serial(&link) == s));
        assert!(draining(&l).is_empty());
    }

    #[test]
    fn beyond_the_draining_bound_the_oldest_draining_connection_is_lost() {
        let mut l = links(2, 0, LONG);
        let mut serials = Vec::new();
        for i in 0..=MAX_DRAINING {
            let _ = l.connected(i % 2, (), Instant::now());
            serials.push(carrying(&mut l, 1));
            let (aside, _) = l.drained(serials[i], Instant::now()).unwrap();
            if i < MAX_DRAINING {
                assert!(matches!(aside, Aside::Kept), "{i}");
            } else {
                assert!(matches!(aside, Aside::Evict(link) if serial(&link) == serials[0]));
            }
        }
        assert_eq!(draining(&l), serials[1..]);
    }

    /// A worker away from its own target 0, on target 1, dialling the way back.
    fn away_and_going_home(after: Duration) -> (Links<()>, u32) {
        let mut l = links(2, 0, after);
        let t0 = Instant::now();
        let _ = l.dial_failed(0, &refused(), &metrics(), t0);
        let _ = l.connected(1, (), Instant::now());
        let s = carrying(&mut l, 1);
        l.heard(s);
        l.return_home(t0);
        assert!(matches!(is(&l), Is::Up { home: None, .. }), "not yet");
        l.return_home(t0 + HOME_RETRY);
        let up = Is::Up {
            serial: s,
            target: 1,
            home: Some(0),
        };
        assert_eq!(is(&l), up);
        (l, s)
    }

    #[test]
    fn the_connection_made_on_the_way_back_home_takes_over_and_the_old_one_drains() {
        let (mut l, old) = away_and_going_home(LONG);
        assert!(matches!(l.connected(0, (), Instant::now()), Aside::Kept));
        let home = Is::Up {
            serial: old + 1,
            target: 0,
            home: None,
        };
        assert_eq!(is(&l), home);
        assert_eq!(draining(&l), [old]);
        assert_eq!(l.connector().returns(), 1);
    }

    #[test]
    fn a_failed_way_back_keeps_the_current_connection() {
        let (mut l, s) = away_and_going_home(LONG);
        let r = l.dial_failed(0, &refused(), &metrics(), Instant::now());
        assert_eq!(r, Move::On);
        let up = Is::Up {
            serial: s,
            target: 1,
            home: None,
        };
        assert_eq!(is(&l), up);
    }

    #[test]
    fn the_way_back_home_under_way_outlives_the_current_connection() {
        let (mut l, s) = away_and_going_home(Duration::ZERO);
        let (_, moved) = l.lose(s, &Loss::ClosedByPeer, Instant::now()).unwrap();
        assert_eq!(moved, Move::On);
        assert_eq!(is(&l), Is::Dialing(0), "the attempt home goes on");
    }

    #[test]
    fn a_worker_leaves_a_shedding_target_only_for_another_and_at_most_once_a_spacing() {
        let t0 = Instant::now();
        let mut one = links(1, 0, LONG);
        let _ = one.connected(0, (), t0);
        let s = carrying(&mut one, 1);
        let later = t0 + SHED_MOVE_SPACING;
        assert!(!one.would_leave_shedding(s, later), "no other target");
        assert!(one.leave_shedding(s, later).is_none());

        let mut two = links(2, 0, LONG);
        let _ = two.connected(0, (), t0);
        let s = carrying(&mut two, 1);
        let soon = t0 + SHED_MOVE_SPACING / 2;
        assert!(!two.would_leave_shedding(s, soon), "too soon after it came");
        assert!(
            !two.would_leave_shedding(s + 1, later),
            "not the current one"
        );
        assert!(two.would_leave_shedding(s, later));
        let (aside, moved) = two.leave_shedding(s, later).unwrap();
        assert!(matches!(aside, Aside::Kept), "its call in flight drains");
        assert_eq!(moved, Move::On);
        assert_eq!(is(&two), Is::Dialing(1));
        assert_eq!(draining(&two), [s]);
    }

    #[test]
    fn a_connection_made_while_the_draining_bound_is_reached_dials_nothing_more() {
        let (mut l, old) = away_and_going_home(LONG);
        for i in 0..MAX_DRAINING as u32 {
            l.draining.push(Link {
                io: (),
                serial: 100 + i,
                target: 1,
                in_flight: 1,
                heard: Heard::Reply,
                encoded: 0,
                opened: Instant::now(),
            });
        }
        let aside = l.connected(0, (), Instant::now());
        assert!(matches!(aside, Aside::Evict(link) if serial(&link) == 100));
        let home = Is::Up {
            serial: old + 1,
            target: 0,
            home: None,
        };
        assert_eq!(is(&l), home, "on its own target, with no other attempt");
        assert_eq!(draining(&l), [101, 102, 103, old]);
    }

    #[test]
    fn an_ending_connection_takes_no_call_but_is_read_until_it_is_lost() {
        let mut l = links(2, 0, LONG);
        let _ = l.connected(0, (), Instant::now());
        let s = carrying(&mut l, 1);
        l.ending(s + 1);
        assert!(l.is_writable(), "another serial: no change");
        l.ending(s);
        assert_eq!(is(&l), Is::Ending(s));
        assert!(!l.is_writable());
        l.heard(s);
        l.settle(s);
        assert!(l.find(s).is_some_and(|link| link.in_flight == 0));
        let (_, moved) = l.lose(s, &Loss::ClosedByPeer, Instant::now()).unwrap();
        assert_eq!(moved, Move::On);
        assert_eq!(is(&l), Is::Dialing(1));
        assert_eq!(l.connector().failures(), 0, "it had replied");
    }

    #[test]
    fn at_the_end_every_connection_is_handed_back_the_current_one_first() {
        let mut l = links(2, 0, LONG);
        let _ = l.connected(0, (), Instant::now());
        let first = carrying(&mut l, 1);
        let _ = l.drained(first, Instant::now());
        let _ = l.connected(1, (), Instant::now());
        let second = carrying(&mut l, 1);
        let all: Vec<u32> = l.close_all().iter().map(serial).collect();
        assert_eq!(all, [second, first]);
        assert_eq!(is(&l), Is::Closed);
        assert!(!l.is_writable() && l.reach() == Reach::Reachable);
    }

    #[test]
    fn a_worker_does_not_dial_home_while_its_run_stops() {
        let mut l = links(2, 0, LONG);
        let t0 = Instant::now();
        let _ = l.dial_failed(0, &refused(), &metrics(), t0);
        let _ = l.connected(1, (), Instant::now());
        l.return_home(t0);
        l.patience.stop.cancel();
        l.return_home(t0 + HOME_RETRY);
        assert!(matches!(is(&l), Is::Up { home: None, .. }));
    }
}

#[cfg(test)]
mod written {
    use super::*;
    use rpcmesh_wire::codec::FrameCodec;
    use rpcmesh_wire::frame::DEFAULT_MAX_BODY_LEN;
    use tokio::net::{TcpListener, TcpSocket};

    /// Calls whose frames start at or past where the socket's writes reached never left
    /// the worker (they are `unsent` when the connection is lost); the others may have.
    /// A peer that reads nothing, small socket buffers: most of 1 MiB of calls stays in
    /// the write buffer.
    #[tokio::test]
    async fn calls_past_what_the_socket_took_are_told_apart_from_those_it_took() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_send_buffer_size(4096).unwrap();
        let stream = socket.connect(addr).await.unwrap();
        let (_peer, _) = listener.accept().await.unwrap();
        let io = FramedIo::new(stream, FrameCodec::new(DEFAULT_MAX_BODY_LEN));
        let patience = Patience {
            until: None,
            after: Duration::from_secs(60),
            stop: CancellationToken::new(),
        };
        let connector = Connector::new(vec![addr.to_string()], 0, 0);
        let mut links = Links::new(connector, patience, Instant::now());
        let _ = links.connected(0, io, Instant::now());
        let link = links.writable().unwrap();
        const FRAME: usize = 16 << 10;
        let starts: Vec<u64> = (0..64)
            .map(|_| {
                link.io.wbuf().extend_from_slice(&[0u8; FRAME]);
                link.carry(FRAME)
            })
            .collect();
        link.io.try_flush().unwrap();
        let written = link.written();
        let unsent = starts.iter().filter(|&&s| s >= written).count();
        assert!(written > 0, "the socket took some");
        assert!(unsent > 0 && unsent < starts.len(), "{unsent} of 64 unsent");
        // What the socket took is a prefix: the unsent calls are the last ones.
        assert!(starts[..starts.len() - unsent].iter().all(|&s| s < written));
        assert_eq!(
            written + link.io.pending_write() as u64,
            (64 * FRAME) as u64,
            "every byte is written or waiting"
        );
    }
}
