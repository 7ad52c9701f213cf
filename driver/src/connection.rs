//! The driver's side of reaching its targets: which target a worker dials next, when, and
//! the dialling itself (a timeout per attempt).
//!
//! A worker has every target of the run, starting from its own (workers are spread over
//! them). It moves to the next target in turn whenever the one it used refuses a connect,
//! loses its connection, or says it is draining (a reply flagged `NOT_RUN`): with several
//! targets a restarting broker costs no waiting, the healthy one takes over at once. Each
//! target keeps its own back-off: after a failed attempt it is not tried again before a
//! pause that doubles (with jitter, the shared [`Backoff`]) until it brings a reply, and a
//! connection that died before bringing a single reply counts as a failed attempt, so that
//! a server that accepts and closes at once, as a broker at its connection cap does, is not
//! hammered. Only when every target is pausing does the worker wait, for the first pause
//! to end.
//!
//! A worker that moved away goes back to its own target once that answers again: every
//! [`HOME_RETRY`] while it is away (and its own target is not pausing) it dials it, and a
//! connection that is made there becomes the worker's (the old one finishes its calls and
//! closes). Without that, every worker of a rolling restart would end on the broker that
//! restarted first, and the run would go on measuring one broker instead of all of them.
//!
//! A connection made to an rpcmesh target (unless told not to, `--deadline off`) first
//! asks, in a heartbeat, which call fields the target takes (`rpcmesh_wire::ext`); one
//! that takes the deadline is sent every call with the time left to it, so that a broker
//! or provider drops a call its caller has given up on instead of running it. A target
//! that answers without the pair (a plain v1 server, an older rpcmesh one), or not within
//! [`ASK_TIMEOUT`], gets plain calls.
//!
//! Owns the choice of target, the back-offs and the counts; the connections themselves,
//! and what runs over them, are the worker's.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rpcmesh_common::metrics::{ErrorKind, Side};
use std::sync::Arc;

use rpcmesh_common::net::backoff::Backoff;
use rpcmesh_common::net::connection::{FramedIo, IoEvent};
use rpcmesh_common::net::stream::Stream;
use rpcmesh_common::net::tls::{ClientTls, ConnectError};
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::ext;
use rpcmesh_wire::frame::{DEFAULT_MAX_BODY_LEN, MsgType};
use tokio::net::TcpStream;

use crate::metrics::DriverMetrics;
use crate::outcome::Loss;

/// Timeout of one connection attempt: a healthy target on a LAN answers in well under a
/// millisecond; two seconds covers a loaded one and a lost SYN's first retransmission.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a worker away from its own target tries to go back to it: a broker that
/// restarts is listening again within a second or two, and a target that stays down costs
/// one connection attempt per interval per worker.
pub const HOME_RETRY: Duration = Duration::from_secs(1);
/// How long a worker's connection must have been its current one before the worker leaves
/// it for a call its target shed ("overloaded"), to send the call to the next target: so
/// that a worker moves at most once a second for shedding, and a mesh that sheds
/// everywhere does not have its workers reconnect at the rate of its retries. The same
/// second as [`HOME_RETRY`]: a worker that left its own target comes back after it.
pub const SHED_MOVE_SPACING: Duration = Duration::from_secs(1);
/// How long a new connection waits for the answer to its question about call fields
/// before it carries plain calls: a target answers a heartbeat in well under a
/// millisecond, a loaded one within a few; a second covers that many times, and a target
/// that never answers heartbeats costs it once per connection.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(1);
/// The request id of that question (the only frame on the connection before its calls,
/// whose ids count up from 1).
const ASK_ID: u64 = u64::MAX;
/// Connections lost that are logged at warn per worker; the next ones at debug (the
/// report counts them all): a rolling restart is a few, a flapping target is many.
const LOST_WARNINGS: u64 = 3;

/// Asks the target on `io` which call fields it takes: a heartbeat carrying the
/// extension's pair, whose answer lists them (`rpcmesh_wire::ext`). Its value asks the
/// target to tell of its drain (`ext::DRAIN_NOTICE_FIELD`): the worker then stops
/// writing calls on the connection and closes it, rather than meet the target's close
/// with a call. Nothing else is on the connection yet, so every frame read is that answer.
async fn ask_fields(io: &mut FramedIo) -> io::Result<CallFields> {
    let ask = [(ext::HEARTBEAT_KEY, ext::DRAIN_NOTICE_FIELD)];
    Heartbeat::put_now_with(io.wbuf(), ASK_ID, "driver", "rpcmesh-driver", &ask)
        .map_err(io::Error::other)?;
    loop {
        io.try_flush()?;
        if let IoEvent::Read = io.wait_io(true).await? {
            while let Some(frame) = io.next_frame().map_err(io::Error::other)? {
                if frame.header.msg_type != MsgType::Heartbeat || frame.header.req_id != ASK_ID {
                    continue;
                }
                let takes = Heartbeat::parse(&frame.body).is_ok_and(|hb| {
                    hb.extra_value(ext::HEARTBEAT_KEY)
                        .is_some_and(|v| ext::takes(v, ext::DEADLINE_FIELD))
                });
                return Ok(if takes {
                    CallFields::Deadline
                } else {
                    CallFields::Plain
                });
            }
            if io.is_eof() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }
}

/// One target and its back-off.
#[derive(Debug)]
struct Target {
    addr: String,
    /// Pauses between failed attempts.
    backoff: Backoff,
    /// Not dialled again before this (after a failed attempt).
    not_before: Option<Instant>,
}

/// The next connection attempt: to which target, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// The target's index in the run's `--target` list.
    pub target: usize,
    /// When to make it (now, unless every target is pausing).
    pub at: Instant,
}

/// What a connection has heard from its target: one lost before its first reply counts as
/// a failed attempt ([`Connector::lost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// No reply yet.
    Nothing,
    /// At least one reply: the target is healthy.
    Reply,
}

/// Whether a worker still reaches, or tries to reach, a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// A connection is up, or an attempt is under way (or the run is over).
    Reachable,
    /// No target could be reached in time, and nothing is dialled any more: the worker
    /// starts nothing new, and its requests under way end at once.
    GaveUp,
}

/// Why a connection attempt made no connection.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// The connect failed (refused, unreachable, ...).
    #[error("{0}")]
    Connect(#[from] io::Error),
    /// No answer within [`CONNECT_TIMEOUT`].
    #[error("timed out after {CONNECT_TIMEOUT:?}")]
    TimedOut,
    /// The TLS handshake was refused (counted in `rpcmesh_tls_handshake_failures_total`).
    #[error("{0}")]
    Tls(#[from] ConnectError),
    /// The target closed the connection, or sent bytes beyond repair, before answering
    /// which call fields it takes.
    #[error("closed before answering a heartbeat: {0}")]
    Asking(io::Error),
}

/// What the calls on a connection carry besides the plain v1 request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFields {
    /// Nothing: plain v1 requests (a target that did not say it takes more).
    Plain,
    /// The caller's deadline: extension requests with the time left to each call.
    Deadline,
}

/// A connection made: its I/O, and what its calls carry.
#[derive(Debug)]
pub struct Connected {
    /// The connection, framed.
    pub io: FramedIo,
    /// What the target said it takes.
    pub fields: CallFields,
}

/// A connection attempt under way: a future that owns what it needs, so that the worker
/// keeps it across its rounds (serving its other connections meanwhile).
pub struct Dialing {
    /// The target being dialled.
    pub target: usize,
    attempt: Pin<Box<dyn Future<Output = Result<Connected, DialError>> + Send>>,
}

impl std::fmt::Debug for Dialing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialing")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl Dialing {
    /// Waits for the attempt: the connected socket, or why there is none.
    pub async fn finish(&mut self) -> Result<Connected, DialError> {
        (&mut self.attempt).await
    }

    /// [`Dialing::finish`] as a poll, for a caller that waits on its connections too.
    pub fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<Connected, DialError>> {
        self.attempt.as_mut().poll(cx)
    }
}

/// Chooses and dials one worker's targets, and keeps its connection counts.
#[derive(Debug)]
pub struct Connector {
    targets: Vec<Target>,
    /// The target to try first next time.
    next: usize,
    /// The worker's own target (where it started).
    home: usize,
    /// While the worker is away from its own target: since when, or since its last try to
    /// go back.
    away_since: Option<Instant>,
    /// How long away before trying to go back ([`HOME_RETRY`] unless told).
    home_retry: Duration,
    /// Times the worker went back to its own target.
    returns: u64,
    /// The worker's number, for logs.
    worker: usize,
    /// Failed attempts, and connections lost before any reply.
    failures: u64,
    /// Connections lost so far (for thinning the log).
    lost: u64,
    /// TLS to the targets, when on.
    tls: Option<Arc<ClientTls>>,
    /// Ask each new connection which call fields its target takes.
    ask: bool,
}

impl Connector {
    /// A connector for worker `worker` over `targets` (`HOST:PORT` each, at least one),
    /// trying `first` first.
    pub fn new(targets: Vec<String>, first: usize, worker: usize) -> Self {
        let n = targets.len().max(1);
        Connector {
            targets: targets
                .into_iter()
                .map(|addr| Target {
                    addr,
                    backoff: Backoff::default(),
                    not_before: None,
                })
                .collect(),
            next: first % n,
            home: first % n,
            away_since: None,
            home_retry: HOME_RETRY,
            returns: 0,
            worker,
            failures: 0,
            lost: 0,
            tls: None,
            ask: false,
        }
    }

    /// Asks each new connection, when `ask`, which call fields its target takes (see the
    /// module's doc); else every connection carries plain calls.
    pub fn asking(mut self, ask: bool) -> Self {
        self.ask = ask;
        self
    }

    /// Speaks TLS to the targets with `tls`, when given.
    pub fn with_tls(mut self, tls: Option<Arc<ClientTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// Failed connection attempts so far (the report's `connect_failures`).
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// Times the worker went back to its own target after moving away.
    pub fn returns(&self) -> u64 {
        self.returns
    }

    /// Tries to go back to the worker's own target every `every` while away, instead of
    /// every [`HOME_RETRY`].
    pub fn home_retry(mut self, every: Duration) -> Self {
        self.home_retry = every;
        self
    }

    /// The worker's number (for logs).
    pub fn worker(&self) -> usize {
        self.worker
    }

    /// With the current connection on `current`: the attempt to go back to the worker's
    /// own target, when it is away from it, has been for the home retry since it left or
    /// last tried, and its own target is not pausing after a failed attempt.
    pub fn return_home(&mut self, current: usize, now: Instant) -> Option<Attempt> {
        if current == self.home {
            self.away_since = None;
            return None;
        }
        let since = *self.away_since.get_or_insert(now);
        let pausing = self
            .targets
            .get(self.home)
            .and_then(|t| t.not_before)
            .is_some_and(|t| t > now);
        if pausing || now.duration_since(since) < self.home_retry {
            return None;
        }
        self.away_since = Some(now);
        Some(Attempt {
            target: self.home,
            at: now,
        })
    }

    /// A connection to `target` became the worker's: when that is its own target after
    /// being away, it is back.
    pub fn now_on(&mut self, target: usize) {
        if target == self.home && self.away_since.take().is_some() {
            self.returns += 1;
            tracing::debug!(worker = self.worker, target = %self.addr(target), "back on its own target");
        }
    }

    /// The address of target `target`.
    pub fn addr(&self, target: usize) -> &str {
        self.targets.get(target).map_or("", |t| t.addr.as_str())
    }

    /// The next attempt: the first target in turn whose pause is over, now; when every
    /// target is pausing, the one whose pause ends first, then.
    pub fn next_attempt(&self, now: Instant) -> Attempt {
        let n = self.targets.len().max(1);
        let mut soonest = Attempt {
            target: self.next,
            at: now,
        };
        let mut earliest: Option<Instant> = None;
        for k in 0..n {
            let i = (self.next + k) % n;
            match self.targets.get(i).and_then(|t| t.not_before) {
                Some(t) if t > now => {
                    if earliest.is_none_or(|e| t < e) {
                        earliest = Some(t);
                        soonest = Attempt { target: i, at: t };
                    }
                }
                _ => return Attempt { target: i, at: now },
            }
        }
        soonest
    }

    /// Starts `attempt`: waits until its time, then connects within [`CONNECT_TIMEOUT`]
    /// (and, with TLS, makes the handshake), then, when asking, asks which call fields the
    /// target takes (within [`ASK_TIMEOUT`]).
    pub fn dial(&self, attempt: Attempt) -> Dialing {
        let addr = self.addr(attempt.target).to_string();
        let at = attempt.at;
        let tls = self.tls.clone();
        let ask = self.ask;
        Dialing {
            target: attempt.target,
            attempt: Box::pin(async move {
                tokio::time::sleep_until(at.into()).await;
                let tcp =
                    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&addr)).await {
                        Ok(r) => r?,
                        Err(_) => return Err(DialError::TimedOut),
                    };
                let stream = match tls {
                    Some(t) => t.connect(tcp, &addr).await?.stream,
                    None => Stream::Plain(tcp),
                };
                let mut io = FramedIo::over(stream, FrameCodec::new(DEFAULT_MAX_BODY_LEN));
                let fields = if ask {
                    match tokio::time::timeout(ASK_TIMEOUT, ask_fields(&mut io)).await {
                        Ok(r) => r.map_err(DialError::Asking)?,
                        Err(_) => {
                            tracing::debug!(target = %addr, "no answer to the call-fields question; plain calls");
                            CallFields::Plain
                        }
                    }
                } else {
                    CallFields::Plain
                };
                Ok(Connected { io, fields })
            }),
        }
    }

    /// The attempt to `target` failed with `error`: it pauses, and the next target in turn
    /// is tried first.
    pub fn failed(&mut self, target: usize, error: &DialError, metrics: &DriverMetrics) {
        self.failures += 1;
        metrics.errors.inc(ErrorKind::Io, Side::Server);
        // One line per worker and outage; the count goes in the report.
        let addr = self.addr(target).to_string();
        if self.failures == 1 {
            tracing::warn!(worker = self.worker, target = %addr, %error, "connect failed; trying the next target");
        } else {
            tracing::debug!(worker = self.worker, target = %addr, %error, "connect failed");
        }
        self.pause(target);
    }

    /// Target `target`'s connection brought its first reply: the target is healthy, its
    /// back-off starts over.
    pub fn replied(&mut self, target: usize) {
        if let Some(t) = self.targets.get_mut(target) {
            t.backoff.reset();
            t.not_before = None;
        }
    }

    /// The connection to `target` was lost with `calls` calls on it, having `heard` a reply
    /// or not; the next target in turn is tried first, at once, unless the connection
    /// brought nothing (that counts as a failed attempt, and the target pauses).
    pub fn lost(&mut self, target: usize, heard: Heard, calls: usize, cause: &Loss) {
        self.lost += 1;
        let addr = self.addr(target).to_string();
        if self.lost <= LOST_WARNINGS {
            tracing::warn!(worker = self.worker, target = %addr, calls, %cause, "connection lost; reconnecting");
        } else {
            tracing::debug!(worker = self.worker, target = %addr, calls, %cause, "connection lost; reconnecting");
        }
        match heard {
            Heard::Reply => self.next = self.after(target),
            Heard::Nothing => {
                self.failures += 1;
                self.pause(target);
            }
        }
    }

    /// `target` said it is draining (a reply flagged `NOT_RUN`): new calls go to the next
    /// target in turn (a draining server closes its listener, so dialling it again would
    /// only be refused until it is back).
    pub fn drained(&mut self, target: usize) {
        let addr = self.addr(target).to_string();
        tracing::info!(worker = self.worker, target = %addr, "target draining; moving to the next");
        self.next = self.after(target);
    }

    /// `target` shed a call ("overloaded") and the worker leaves it to send the call to
    /// the next target in turn.
    pub fn shed(&mut self, target: usize) {
        let addr = self.addr(target).to_string();
        tracing::debug!(worker = self.worker, target = %addr, "target shed a call; moving to the next");
        self.next = self.after(target);
    }

    /// How many targets the run has.
    pub fn targets(&self) -> usize {
        self.targets.len()
    }

    fn pause(&mut self, target: usize) {
        if let Some(t) = self.targets.get_mut(target) {
            t.not_before = Some(Instant::now() + t.backoff.pause());
        }
        self.next = self.after(target);
    }

    fn after(&self, target: usize) -> usize {
        (target + 1) % self.targets.len().max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpcmesh_common::metrics::Telemetry;

    fn metrics() -> DriverMetrics {
        DriverMetrics::new(Telemetry::new(), "EchoService", "Echo", 0)
    }

    fn refused() -> DialError {
        io::Error::from(io::ErrorKind::ConnectionRefused).into()
    }

    fn two() -> Connector {
        Connector::new(vec!["a:1".into(), "b:2".into()], 1, 7)
    }

    #[tokio::test]
    async fn a_listening_target_is_connected_at_once() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = Connector::new(vec![l.local_addr().unwrap().to_string()], 0, 0);
        let mut d = c.dial(c.next_attempt(Instant::now()));
        assert!(d.finish().await.is_ok());
        assert_eq!(c.failures(), 0);
    }

    #[tokio::test]
    async fn a_target_nobody_listens_on_is_refused() {
        // Bound and dropped: nothing listens there (connections are refused at once).
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let c = Connector::new(vec![addr.to_string()], 0, 0);
        let mut d = c.dial(c.next_attempt(Instant::now()));
        assert!(d.finish().await.is_err());
    }

    #[test]
    fn a_worker_away_from_its_own_target_tries_it_again_every_interval_unless_it_pauses() {
        let mut c = two();
        let m = metrics();
        let t0 = Instant::now();
        assert_eq!(c.return_home(1, t0), None, "at home");
        // Moved to target 0: the first look starts the clock.
        assert_eq!(c.return_home(0, t0), None);
        assert_eq!(c.return_home(0, t0 + HOME_RETRY / 2), None);
        let back = Attempt {
            target: 1,
            at: t0 + HOME_RETRY,
        };
        assert_eq!(c.return_home(0, t0 + HOME_RETRY), Some(back));
        // That try failed: its own target pauses, and no try is made before the pause ends.
        c.failed(1, &refused(), &m);
        let paused_until = c.targets[1].not_before.unwrap();
        let later = (t0 + HOME_RETRY * 2).min(paused_until);
        if later < paused_until {
            assert_eq!(c.return_home(0, later), None, "pausing");
        }
        let after = paused_until.max(t0 + HOME_RETRY * 2);
        assert_eq!(c.return_home(0, after).map(|a| a.target), Some(1));
        assert_eq!(c.returns(), 0);
        c.now_on(1);
        assert_eq!(c.returns(), 1, "back home");
        assert_eq!(c.return_home(1, after), None);
        c.now_on(1);
        assert_eq!(c.returns(), 1, "only a return counts");
    }

    #[test]
    fn a_worker_starts_on_its_own_target() {
        let c = two();
        let now = Instant::now();
        assert_eq!(c.next_attempt(now), Attempt { target: 1, at: now });
    }

    #[test]
    fn a_refused_target_hands_over_to_the_next_at_once_and_pauses_itself() {
        let mut c = two();
        let m = metrics();
        c.failed(1, &refused(), &m);
        let now = Instant::now();
        assert_eq!(c.next_attempt(now), Attempt { target: 0, at: now });
        // Both refuse: the worker waits for the first pause to end, on that target.
        c.failed(0, &refused(), &m);
        let next = c.next_attempt(now);
        assert!(next.at > now, "{next:?}");
        assert_eq!(c.failures(), 2);
        // A reply from one target ends its pause.
        c.replied(0);
        assert_eq!(c.next_attempt(now), Attempt { target: 0, at: now });
    }

    #[test]
    fn a_targets_pauses_double_while_it_keeps_failing() {
        let mut c = Connector::new(vec!["a:1".into()], 0, 0);
        let m = metrics();
        let now = Instant::now();
        let mut last = Duration::ZERO;
        let mut grew = 0;
        for _ in 0..6 {
            c.failed(0, &refused(), &m);
            let wait = c.next_attempt(now).at.duration_since(now);
            if wait > last {
                grew += 1;
            }
            last = wait;
        }
        // Jitter draws each pause from the upper half of its step: the steps double, so
        // the pauses grow overall.
        assert!(grew >= 4, "{grew}");
        assert!(last >= Duration::from_millis(500), "{last:?}");
    }

    #[test]
    fn a_lost_connection_moves_on_at_once_if_it_had_replied_and_pauses_if_not() {
        let mut c = two();
        let now = Instant::now();
        c.lost(1, Heard::Reply, 3, &Loss::ClosedByPeer);
        assert_eq!(c.next_attempt(now), Attempt { target: 0, at: now });
        assert_eq!(c.failures(), 0);
        c.lost(0, Heard::Nothing, 0, &Loss::ClosedByPeer);
        assert_eq!(
            c.failures(),
            1,
            "a connection that brought nothing is a failure"
        );
        assert_eq!(c.next_attempt(now), Attempt { target: 1, at: now });
    }

    #[test]
    fn a_draining_target_hands_new_calls_to_the_next_one() {
        let mut c = two();
        let now = Instant::now();
        c.drained(1);
        assert_eq!(c.next_attempt(now), Attempt { target: 0, at: now });
        c.drained(0);
        assert_eq!(c.next_attempt(now), Attempt { target: 1, at: now });
        assert_eq!(c.failures(), 0, "a drain is no failure");
    }
}
