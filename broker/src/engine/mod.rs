//! The loop engine: per worker thread one epoll loop (mio) that owns its client sessions
//! and its connections to every provider outright (`--threads`; `workers`: the first
//! listens and deals the connections, placed as the Tokio engine's cells are). A call goes from the socket it came on to
//! the one it leaves on as a copy between two buffers, with no task, waker, channel or
//! lock in between; each socket given something in a round is written once at its end.
//! That is the shape of an L4 proxy's event loop, and of the floor the Tokio engine is
//! weighed against (docs/performance.md, "The floor without the runtime").
//!
//! The broker runs it unless told `--engine tokio` ([`run`]): it holds every bound the
//! Tokio engine holds, at about two thirds of its instructions per call
//! (docs/performance.md, "The loop engine").
//! What it does, as the Tokio engine does:
//!
//! - every frame checked where it lies (the broker's codec, CRC included); bad input
//!   counted by kind and logged (thinned), answered (`bad request`) where the frame names
//!   its call, and a connection whose
//!   stream cannot be followed closed once that answer is written
//!   ([`FINAL_FLUSH_TIMEOUT`] at most);
//! - heartbeats answered; a call's extension block read (its deadline);
//! - the names read and checked; the caps on calls in flight per connection and in all
//!   (`--max-in-flight-per-conn`, `--max-in-flight`), on connections
//!   (`--max-connections`), and on replies waiting for a client that does not read
//!   (`WRITE_BACKLOG_LIMIT`: the client is not read meanwhile);
//! - routed (`route`): the providers named for the service first, then those for any
//!   service, by `--balance` (PeakEWMA, the less loaded of two, round robin); a provider
//!   ejected for its failures (`crate::resilience::outlier`) only as a last resort or for
//!   its probe call, one that drains not at all; within a provider, packed onto the
//!   oldest connection with fewer calls than the provider answers in `--pack-wait`
//!   (`crate::upstream::pace`), else the least loaded; a compressed call only to an
//!   rpcmesh provider;
//! - routed again (`reroute`): a call a provider refused `NOT_RUN` (it drains: it takes
//!   no call until it is back) or shed, or whose connection was lost before it was
//!   written, and an idempotent one lost after, within the retry budget, with its request
//!   as kept in its connection's ring;
//! - copied under an id neutral to its CRC (`rpcmesh_wire::neutral`), with its deadline
//!   where the provider takes it, as it came where it may; the reply matched back by it
//!   and copied under the caller's id, statuses degraded for v1 callers; a bad reply
//!   failing its call alone;
//! - TLS to its callers (`--tls-cert`, `socket`): each connection's handshake driven on
//!   its worker's loop, bounded in time (`--tls-handshake-timeout`) and in number
//!   (`--tls-max-handshakes`, over all workers), each refusal counted by reason
//!   and logged (thinned), as the Tokio engine's `ServerTls::accept` does; the files read
//!   again when they change and on SIGHUP (new handshakes use them); a plain address
//!   beside it (`--listen-plain`, the first worker's too), whose callers are anonymous;
//! - allowed by the policy (`--authz-policy`, read again when it changes and on SIGHUP)
//!   for the caller its certificate names (anonymous without one), or answered
//!   "permission denied", counted and logged (thinned);
//! - timed out at the earlier of its deadline and `--call-timeout`;
//! - the providers of the flags and of `--providers-file`, read again on SIGHUP and when
//!   the file changes (`control`), joining and leaving as the Tokio engine's do
//!   (`members`);
//! - provider connections (`upstream`) made within `--connect-timeout`, sent a heartbeat
//!   every `--health-interval` and given up when one goes unanswered for
//!   `--health-timeout`, their calls answered when they are lost, and made again after a
//!   pause that grows while the provider cannot be reached (or answers no heartbeat),
//!   one connect at a time to a provider whose connects fail; a
//!   connection given calls only once it answered its first heartbeat; a provider's
//!   health logged as the Tokio engine's pools log it (ready, not answering, unreachable,
//!   no healthy connection: once each time); no connection taken before
//!   every provider has settled (answered a heartbeat, or refused a connect), so that the
//!   first calls do not find no provider; with `--upstream-tls`, a TLS handshake on each
//!   (within the later of the connect deadline and the handshake timeout, refusals
//!   counted), and the caller's identity told to a provider that takes it; reads from a
//!   plain v1 server that leave calls in flight acknowledged at once (`TCP_QUICKACK`);
//! - an accept error that is not one connection's (no descriptor left) pausing the
//!   accepting, not spinning on it;
//! - a session closed when idle for `--idle-timeout` (heartbeats do not count), when a
//!   frame takes longer than `--frame-timeout` to arrive, or when its client takes none
//!   of its replies for `--write-timeout`; a client that left with calls in flight
//!   ended at once, their outcomes counted abandoned (`abortonclose`);
//! - the memory budget (`--memory-budget`, `rpcmesh_common::net::budget`): every
//!   connection's buffers counted (not what rustls holds of a TLS connection, which it
//!   bounds itself: 64 KiB of records to write), and given back when a peak left them emptied and
//!   large; a read buffer grown only as a frame fills it and the budget allows, told
//!   before the next read; a large call counted until its outcome is written, and
//!   refused "overloaded" past the high mark; a session holding much not read past the
//!   pause mark; the largest holders closed when the budget stays past its high mark;
//! - the lines an operator reads at the start and the end (docs/broker.md, "At the
//!   start": providers still connecting, `broker listening`, `listener closed; draining`,
//!   `broker stopped`), and `READY=1` to systemd once the providers settled
//!   (`crate::listening`); the process's own figures (CPU, memory, log lines dropped,
//!   its build), as every program exports them;
//! - the drain: no new connection, new calls refused ("not run"), the calls in flight
//!   answered by their providers or at the end of `--grace`, every answer written, and
//!   [`DRAIN_LINGER`] without a call before the sessions close (clients that asked are
//!   told of the drain and close themselves, waited for up to [`NOTICED_DRAIN_LINGER`]);
//! - its calls counted in the broker's own families (`metrics`): calls by pair and status,
//!   errors, calls shed, client connections, bytes and system calls on them, calls in
//!   flight, allocations, once a round; each provider's calls by status, connections,
//!   latency estimate, pace, calls in flight per connection, ejections, connect failures;
//!   calls routed again and retries refused for want of budget;
//! - the stages of one call in `--stage-sample` timed (`stages`);
//! - while it busy-polls, the time its polls found nothing
//!   (`rpcmesh_busy_poll_idle_seconds`);
//! - several threads (`workers`): connections dealt to the open workers, moved between
//!   them (between their calls) by the cells' placement, the caps and budgets shared,
//!   each provider's series summed over the workers.
//!
//! Unlike the Tokio engine it keeps a request for a hand-back for as long as its
//! connection's ring holds it, not [`REQUEST_RETAIN`] at most; and it answers a large
//! call "overloaded" by its header when the budget is past its high mark as the header
//! comes, dropping its body as it arrives, where the Tokio engine reads the body first
//! (and may pause its caller meanwhile, unanswered, while others hold the budget).

mod control;
mod members;
mod metrics;
mod reroute;
mod route;
mod session;
pub mod socket;
mod stages;
mod upstream;
mod workers;

use std::io;
use std::mem;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};
use rpcmesh_common::metrics::families::publish_budget;
use rpcmesh_common::net::backoff::Backoff;
use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::busy_poll::IDLE_RECORD_CHUNK;
use rpcmesh_common::net::listener::{ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN, Listeners};
use rpcmesh_common::net::session::{DRAIN_LINGER, FINAL_FLUSH_TIMEOUT, NOTICED_DRAIN_LINGER};
use rpcmesh_wire::codec::FrameCodec;

use self::metrics::Counts;
use crate::config::BrokerConfig;
use crate::failure::Failure;
use crate::membership::Reload;
use crate::metrics::BrokerMetrics;
use crate::resilience::Guards;
use reroute::HandedBack;
use route::Routes;
use rpcmesh_common::metrics::Telemetry;
use session::Sessions;
use std::future::Future;
use upstream::Upstream;

#[cfg(doc)]
use crate::upstream::connection::REQUEST_RETAIN;

/// The listener's token.
const LISTENER: Token = Token(0);
/// The token of the waker that [`LoopHandle::stop`] rings.
const WAKER: Token = Token(1);
/// The plain listener's token (`--listen-plain`, beside TLS).
const LISTENER_PLAIN: Token = Token(2);
/// Provider connection `k` is `Token(FIRST_UPSTREAM + k)`.
const FIRST_UPSTREAM: usize = 3;
/// Session `i` is `Token(FIRST_SESSION + i)`: far above any provider connection.
const FIRST_SESSION: usize = 1 << (usize::BITS - 2);
/// Readiness events taken per `epoll_wait`. More wait for the next one, which does not
/// sleep while they do.
const EVENTS: usize = 1024;
/// How often a round is taken with nothing to do while the engine drains or a session
/// that sent bad input waits to end.
const TICK: Duration = Duration::from_millis(10);

/// What the engine did, for the tests: every call read has exactly one outcome.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Client connections accepted.
    pub accepted: u64,
    /// Client connections refused at the connection cap (`--max-connections`).
    pub refused: u64,
    /// Sessions still open when the grace period ended, closed by it; and those of them
    /// whose last answers were still not written [`FINAL_FLUSH_TIMEOUT`] later (aborted).
    pub cut: u64,
    pub aborted: u64,
    /// Requests read (plain and extended).
    pub calls: u64,
    /// Calls answered with the provider's reply.
    pub replied: u64,
    /// Calls answered by the broker itself (refused, timed out, lost).
    pub answered: u64,
    /// Calls whose caller had gone when their outcome came.
    pub orphaned: u64,
    /// Heap allocations (and reallocations) the rounds made, when the program counts
    /// them (`rpcmesh_common::alloc`; else 0).
    pub allocations: u64,
}

impl Summary {
    /// The sum of two workers' summaries.
    fn add(self, o: Summary) -> Summary {
        Summary {
            accepted: self.accepted + o.accepted,
            refused: self.refused + o.refused,
            cut: self.cut + o.cut,
            aborted: self.aborted + o.aborted,
            calls: self.calls + o.calls,
            replied: self.replied + o.replied,
            answered: self.answered + o.answered,
            orphaned: self.orphaned + o.orphaned,
            allocations: self.allocations + o.allocations,
        }
    }
}

/// A running engine: its address, and the way to stop it.
#[derive(Debug)]
pub struct LoopHandle {
    addr: SocketAddr,
    /// What the workers share, their commands and wake-ups among it.
    shared: Arc<workers::Shared>,
    /// The providers served at the start, and the providers file's text then.
    served: Vec<crate::upstream_spec::UpstreamSpec>,
    text: Option<String>,
    /// The workers' threads, the listening one first.
    threads: Vec<JoinHandle<io::Result<Summary>>>,
}

impl LoopHandle {
    /// The address it serves.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Heap allocations (and reallocations) the engine's rounds made so far, when the
    /// program counts them (`rpcmesh_common::alloc`): a round's count is added when it
    /// ends.
    pub fn allocations(&self) -> u64 {
        self.shared.allocations.load(Ordering::Relaxed)
    }

    /// Hands every worker the command `make` makes, and wakes it.
    fn command(&self, make: impl Fn() -> control::Command) {
        for w in &self.shared.workers {
            w.command(make());
        }
    }

    /// Resolves once every worker routes to the list numbered `seq` or a later one.
    async fn until_applied(&self, seq: u64) {
        for w in &self.shared.workers {
            w.control.until_applied(seq).await;
        }
    }

    /// Starts the drain: no new connection, new calls refused, the calls in flight
    /// answered (by their providers, or when `--grace` is over by the broker).
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for w in &self.shared.workers {
            let _ = w.waker.wake();
        }
    }

    /// Waits for the engine to end (after [`LoopHandle::stop`]): what its workers did,
    /// summed.
    pub fn join(self) -> io::Result<Summary> {
        self.shared.watching.cancel();
        let mut sum = Ok(Summary::default());
        for t in self.threads {
            let one = t
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the loop engine's thread panicked")));
            sum = match (sum, one) {
                (Ok(a), Ok(b)) => Ok(a.add(b)),
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
        }
        sum
    }
}

/// Serves `listener` until `shutdown` resolves, then drains: the broker's `run` on the
/// loop engine, which runs on a thread of its own while this future waits; its calls are
/// counted in `telemetry`'s broker families: what `broker --engine loop` runs.
pub async fn run(
    config: BrokerConfig,
    telemetry: Telemetry,
    listener: impl Into<Listeners>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<Summary> {
    run_with_reload(config, telemetry, listener, shutdown, Reload::new()).await
}

/// As [`run`], reading the providers file again whenever `reload` is pulled (and when the
/// file changes, as always): what `broker --engine loop` runs.
pub async fn run_with_reload(
    config: BrokerConfig,
    telemetry: Telemetry,
    listeners: impl Into<Listeners>,
    shutdown: impl Future<Output = ()>,
    reload: Reload,
) -> io::Result<Summary> {
    let metrics = BrokerMetrics::new(telemetry, config.stage_sample);
    let Listeners { main, plain } = listeners.into();
    let plain = plain.map(|p| p.into_std()).transpose()?;
    let mut h = spawn_serving(config.clone(), (main.into_std()?, plain), metrics.clone())?;
    let (served, text) = (std::mem::take(&mut h.served), h.text.take());
    let watch = control::watch(&h, &config, &metrics, served, text, reload);
    let place = workers::place(&h.shared, config.placement_tuning);
    // The process's own figures (CPU, memory, log lines dropped, the build), as every
    // program exports them.
    let housekeeping = rpcmesh_common::metrics::system::Housekeeping::start(
        &metrics.telemetry,
        crate::metrics::ROLE,
    );
    tokio::select! {
        () = shutdown => {}
        _ = async { tokio::join!(watch, place) } => {}
    }
    drop(housekeeping);
    h.stop();
    tokio::task::spawn_blocking(move || h.join())
        .await
        .map_err(io::Error::other)?
}

/// Serves `listener` on a thread of its own with the loop engine, until told to stop,
/// counting into metrics of its own that nothing serves.
pub fn spawn(config: BrokerConfig, listener: std::net::TcpListener) -> io::Result<LoopHandle> {
    let metrics = BrokerMetrics::new(Telemetry::new(), config.stage_sample);
    spawn_counted(config, listener, metrics)
}

/// Serves `listener` on a thread of its own with the loop engine, until told to stop,
/// counting into `metrics`, serving the providers of the flags and of the providers file
/// as read now. Refuses what the engine does not do yet: TLS on either side.
pub fn spawn_counted(
    config: BrokerConfig,
    listener: std::net::TcpListener,
    metrics: BrokerMetrics,
) -> io::Result<LoopHandle> {
    spawn_serving(config, (listener, None), metrics)
}

/// As [`spawn_counted`], serving `listeners`: the main one (TLS when the broker has it)
/// and a plain one beside it (`--listen-plain`), whose callers are anonymous.
fn spawn_serving(
    config: BrokerConfig,
    (listener, plain): (std::net::TcpListener, Option<std::net::TcpListener>),
    metrics: BrokerMetrics,
) -> io::Result<LoopHandle> {
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let count = config.cells.max(1);
    let mut polls = Vec::with_capacity(count);
    let mut links = Vec::with_capacity(count);
    for _ in 0..count {
        let poll = Poll::new()?;
        links.push(workers::Link {
            control: Arc::default(),
            waker: Waker::new(poll.registry(), WAKER)?,
            sessions: AtomicUsize::new(0),
            answered: AtomicU64::new(0),
            work_ns: AtomicU64::new(0),
            ended: AtomicBool::new(false),
        });
        polls.push(poll);
    }
    let guards = Guards::new(config.resilience, &metrics);
    let budget = MemoryBudget::new(config.memory_budget);
    publish_budget(&metrics.telemetry, crate::metrics::ROLE, &budget);
    let in_flight = crate::in_flight::InFlightCap::new(config.max_in_flight, count);
    let open = match config.cell_placement {
        crate::config::CellPlacement::Spread => count,
        crate::config::CellPlacement::Gather => 1,
    };
    // The policy, read again when its file changes or on SIGHUP (on the runtime this is
    // called on: one is needed when a policy is set).
    let watching = rpcmesh_common::net::shutdown::CancellationToken::new();
    let settings = rpcmesh_common::cli::security::SecuritySettings {
        server: config.tls.clone(),
        client: config.upstream_tls.clone(),
        policy: config.authz_policy.clone(),
    };
    let watched =
        settings.policy.is_some() || settings.server.is_some() || settings.client.is_some();
    if watched && tokio::runtime::Handle::try_current().is_err() {
        return Err(io::Error::other(
            "the loop engine watches its TLS and policy files on a Tokio runtime: start it on one",
        ));
    }
    let security = rpcmesh_common::cli::security::Security::start(
        crate::metrics::ROLE,
        &metrics.telemetry,
        settings,
        watching.clone(),
    )
    .map_err(io::Error::other)?;
    let shared = Arc::new(workers::Shared::new(
        metrics,
        (security, watching),
        guards,
        budget,
        in_flight,
        links,
        (
            open,
            rpcmesh_common::net::sources::Sources::new(config.sources, config.max_connections),
        ),
    ));
    // The providers of the flags and of the file, as the Tokio engine reads them.
    let (served, text) = crate::membership::initial(&config, &shared.metrics);
    let idempotent = text
        .as_deref()
        .map(crate::providers_file::idempotent)
        .unwrap_or_default();
    if let Some(p) = &plain {
        p.set_nonblocking(true)?;
    }
    let mut listener = Some((
        TcpListener::from_std(listener),
        plain.map(TcpListener::from_std),
    ));
    let mut threads = Vec::with_capacity(count);
    for (index, poll) in polls.into_iter().enumerate() {
        let mut engine = Engine::new(config.clone(), poll, shared.clone(), index);
        engine.start_providers(served.clone(), idempotent.clone());
        if index == 0 {
            engine.announce = Some(served.clone());
        }
        let listener = listener.take();
        let s = shared.clone();
        let started = std::thread::Builder::new()
            .name(format!("rpcmesh-loop-{index}"))
            .spawn(move || engine.run(listener, &s.stop));
        match started {
            Ok(t) => threads.push(t),
            Err(e) => {
                // The workers started drain (they have no connection yet) and end.
                let h = LoopHandle {
                    addr,
                    shared,
                    served,
                    text,
                    threads,
                };
                h.stop();
                let _ = h.join();
                return Err(e);
            }
        }
    }
    Ok(LoopHandle {
        addr,
        shared,
        served,
        text,
        threads,
    })
}

/// The time busy polling found nothing (`rpcmesh_busy_poll_idle_seconds`), told in chunks
/// of [`IDLE_RECORD_CHUNK`] as the Tokio engine's spinner tells it: a stretch of empty
/// polls counts from its first to its last, or to the end of the spin window.
#[derive(Debug, Default)]
struct SpinIdle {
    /// The first and the latest empty poll of the current stretch.
    stretch: Option<(Instant, Instant)>,
    unrecorded: Duration,
}

impl SpinIdle {
    /// A poll at `now`: `spinning`, it did not sleep for the spin; `found`, it brought
    /// events; `expired`, the spin window is over. What to record, if a chunk is due.
    fn polled(
        &mut self,
        now: Instant,
        spinning: bool,
        found: bool,
        expired: bool,
    ) -> Option<Duration> {
        if found || expired {
            if let Some((first, latest)) = self.stretch.take() {
                // To the last empty poll when events ended it, to now when the window did.
                self.unrecorded += if found { latest - first } else { now - first };
            }
        } else if spinning {
            let first = self.stretch.map_or(now, |(first, _)| first);
            self.stretch = Some((first, now));
        }
        (self.unrecorded >= IDLE_RECORD_CHUNK || (expired && !self.unrecorded.is_zero()))
            .then(|| std::mem::take(&mut self.unrecorded))
    }
}

/// Everything a worker's loop owns: one thread, sharing only what `workers::Shared`
/// holds.
struct Engine {
    /// Which worker this is (the first listens), and what the workers share.
    index: usize,
    shared: Arc<workers::Shared>,
    /// This worker's lease on `--max-in-flight` when there are several (with one, the cap
    /// is checked against `in_flight`), and the calls it counted out this round.
    lease: Option<crate::in_flight::Lease>,
    released: usize,
    /// Calls answered as last told (`workers::Link::answered`), and where they are
    /// counted by worker (`rpcmesh_cell_calls_total`).
    answered_told: u64,
    cell_calls: ::metrics::Counter,
    /// The time busy polling found nothing so far, and when the thread's work is next
    /// read for the placement (`workers::WORK_READ`; never with one worker).
    spin_idle_ns: u64,
    next_work_read: Option<Instant>,
    poll: Poll,
    codec: FrameCodec,
    config: BrokerConfig,
    sessions: Sessions,
    upstreams: Vec<Upstream>,
    routes: Routes,
    /// Each provider's services as listed (`members`).
    services: Vec<Vec<String>>,
    /// A list of providers waiting for its joiners to settle (`members`).
    pending: Option<members::Pending>,
    /// The calls marked idempotent: the flags' and the providers file's.
    idempotent: rpcmesh_common::retry::Idempotent,
    /// Commands from the control side.
    control: Arc<control::Control>,
    /// The timed calls' stamps (`--stage-metrics`).
    timing: stages::Timing,
    /// Calls in flight in this worker.
    in_flight: usize,
    /// The clock, read once per round.
    now: Instant,
    /// No earlier than the earliest deadline of a call in flight: when the calls are
    /// looked through for those past theirs.
    next_expiry: Option<Instant>,
    /// The drain has begun: new calls are refused, until all is answered and written or
    /// this time. Until then, `None`.
    grace_until: Option<Instant>,
    /// During the drain: since when nothing has been in flight or waiting to be written.
    idle_since: Option<Instant>,
    /// When to take connections again: after an accept error's pause, or at once when a
    /// round took as many as it may.
    accept_at: Option<Instant>,
    accept_backoff: Backoff,
    /// When the provider connections are next looked after: heartbeats, connects that
    /// take too long, connections to make again.
    next_keep: Instant,
    /// Where each read lands first ([`socket::Socket::fill`]).
    scratch: Vec<u8>,
    /// The text of the broker's own answers, kept to spare an allocation per answer.
    message: String,
    /// What the heartbeat asking a provider's call fields gives as the cap of every
    /// call's deadline (`rpcmesh_wire::ext::CAP_KEY`): the call timeout.
    cap_value: String,
    rng: fastrand::Rng,
    /// The turn of `--balance round-robin`.
    turn: usize,
    /// Rounds taken so far.
    rounds: u64,
    /// Connections made to providers so far (each one's serial).
    serials: u64,
    /// When the providers' gauges are next published.
    next_publish: Instant,
    /// The outlier detectors' count of ejections, the retry budget.
    guards: Arc<Guards>,
    /// The broker's budget of buffered bytes: the requests kept for hand-backs count in
    /// it.
    budget: Arc<MemoryBudget>,
    /// Calls handed back this round, routed again at its end (`reroute`).
    handed_back: Vec<HandedBack>,
    /// The provider connections that are up (the others have nothing to write), and the
    /// round's copy of that list while they are written.
    up_conns: Vec<usize>,
    flushing: Vec<usize>,
    /// The providers given an outcome this round (told to their series at its end).
    told: Vec<usize>,
    /// Calls admitted this round: what they deposit in the retry budget.
    admitted: usize,
    /// The listener is registered: the providers have settled (`Engine::listen`), or
    /// this time has passed (`--connect-timeout` + `--health-timeout` after the start).
    listening: bool,
    settle_by: Instant,
    /// The providers the listening worker names when it starts listening (`None` in the
    /// others, and once said).
    announce: Option<Vec<crate::upstream_spec::UpstreamSpec>>,
    /// The plain listener beside TLS (`--listen-plain`; the first worker's), registered
    /// with the main one.
    plain: Option<TcpListener>,
    /// This worker's providers have settled, and it told the others
    /// (`workers::Shared::settled`).
    told_settled: bool,
    /// When the sessions the memory budget paused are next looked at for a caller that
    /// left (`session::Engine::resume_budget_paused`).
    next_peer_check: Instant,
    /// When the sessions' timeouts are next looked at (`session::Engine::sweep_sessions`).
    next_session_sweep: Instant,
    summary: Summary,
    /// The rounds' allocations so far, for [`LoopHandle::allocations`].
    allocations: Arc<AtomicU64>,
    counts: Counts,
}

impl Engine {
    fn new(config: BrokerConfig, poll: Poll, shared: Arc<workers::Shared>, index: usize) -> Engine {
        let cap_value = rpcmesh_wire::ext::cap_value(config.call_timeout);
        let settle_by = Instant::now() + config.connect_timeout + config.health_timeout;
        let idempotent = config.idempotent.clone();
        let workers = shared.workers.len();
        let metrics = shared.metrics.clone();
        Engine {
            index,
            lease: (workers > 1).then(|| shared.in_flight.lease()),
            released: 0,
            answered_told: 0,
            cell_calls: metrics.cell_calls(index, workers),
            spin_idle_ns: 0,
            next_work_read: (workers > 1).then(Instant::now),
            control: shared.workers[index].control.clone(),
            guards: shared.guards.clone(),
            budget: shared.budget.clone(),
            allocations: shared.allocations.clone(),
            shared,
            codec: FrameCodec::new(config.max_body_len),
            poll,
            config,
            sessions: Sessions::default(),
            upstreams: Vec::new(),
            routes: Routes::default(),
            services: Vec::new(),
            pending: None,
            idempotent,
            timing: stages::Timing::new(metrics.stages.clone()),
            in_flight: 0,
            now: Instant::now(),
            next_expiry: None,
            grace_until: None,
            idle_since: None,
            accept_at: None,
            accept_backoff: Backoff::new(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX),
            next_keep: Instant::now(),
            scratch: vec![0; socket::READ_CHUNK],
            message: String::new(),
            cap_value,
            rng: fastrand::Rng::new(),
            turn: 0,
            rounds: 0,
            serials: 0,
            next_publish: Instant::now(),
            handed_back: Vec::new(),
            up_conns: Vec::new(),
            flushing: Vec::new(),
            told: Vec::new(),
            admitted: 0,
            // Only the first worker listens.
            listening: index > 0,
            announce: None,
            told_settled: false,
            plain: None,
            settle_by,
            next_session_sweep: Instant::now(),
            next_peer_check: Instant::now(),
            summary: Summary::default(),
            counts: Counts::new(metrics),
        }
    }

    /// The loop: wait for sockets, read every ready one until drained (handing calls and
    /// replies along as they are found), keep the time (deadlines, heartbeats, connects,
    /// the drain), write what the round gave.
    fn run(
        &mut self,
        listeners: Option<(TcpListener, Option<TcpListener>)>,
        stop: &AtomicBool,
    ) -> io::Result<Summary> {
        // Registered once the providers have settled (`Engine::listen`).
        let (mut listener, plain) = listeners.map_or((None, None), |(m, p)| (Some(m), p));
        self.plain = plain;
        let spin = self.busy_poll();
        // While spinning: polls that do not sleep, each empty one followed by
        // `sched_yield`, until `spin` passes with no event (`common::net::busy_poll`).
        let mut spin_until: Option<Instant> = None;
        let mut spin_idle = SpinIdle::default();
        let mut events = Events::with_capacity(EVENTS);
        loop {
            let now_due = !self.sessions.resume.is_empty()
                || self.accept_at == Some(self.now)
                || self.any_handed_back();
            let timeout = if spin_until.is_some() || now_due {
                Some(Duration::ZERO)
            } else {
                self.sleep_for()
            };
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.ended();
                    return Err(e);
                }
            }
            self.now = Instant::now();
            if let Some(window) = spin {
                let spinning = spin_until.is_some();
                let expired = spin_until.is_some_and(|until| self.now >= until);
                if !events.is_empty() {
                    spin_until = Some(self.now + window);
                } else if expired {
                    spin_until = None;
                } else {
                    std::thread::yield_now();
                }
                let found = !events.is_empty();
                if let Some(idle) = spin_idle.polled(self.now, spinning, found, expired) {
                    self.spin_idle_ns += idle.as_nanos() as u64;
                    self.counts
                        .metrics
                        .busy_poll_idle
                        .record(idle.as_secs_f64());
                }
            }
            // What the round allocates, counted (when the program counts): the steady state
            // of forwarding allocates nothing.
            let (done, allocated) =
                rpcmesh_common::alloc::measure(|| self.round(&events, &mut listener, stop));
            if allocated > 0 {
                self.summary.allocations += allocated;
                self.allocations.fetch_add(allocated, Ordering::Relaxed);
                self.counts.metrics.allocations.increment(allocated);
            }
            if done {
                self.ended();
                return Ok(self.summary);
            }
        }
    }

    /// This worker has ended: no connection is dealt to it any more, and those handed to
    /// it that it did not take (dealt, or moved, as it ended) are closed and counted out.
    fn ended(&mut self) {
        let link = &self.shared.workers[self.index];
        link.ended.store(true, Ordering::Relaxed);
        for command in self.control.take().into_iter().flatten() {
            if let control::Command::Adopt(_, moved) = command {
                link.sessions.fetch_sub(1, Ordering::Relaxed);
                if moved {
                    self.counts
                        .closed(rpcmesh_common::net::connection::CloseReason::Shutdown);
                }
            }
        }
    }

    /// One round's work once the poll returned: sessions let read again, connections to
    /// take, the sockets that are ready, the drain, deadlines, the provider connections'
    /// upkeep, and the round's writes. True when the engine is done.
    fn round(
        &mut self,
        events: &Events,
        listener: &mut Option<TcpListener>,
        stop: &AtomicBool,
    ) -> bool {
        self.rounds += 1;
        if let Some(commands) = self.control.take() {
            for command in commands {
                match command {
                    control::Command::Providers {
                        specs,
                        idempotent,
                        seq,
                    } => self.set_providers(specs, idempotent, seq),
                    control::Command::Adopt(session, moved) => self.adopt(*session, moved),
                    control::Command::Move(to) => self.ask_to_move(to),
                }
            }
        }
        self.commit_providers();
        self.listen(listener);
        self.resume_budget_paused();
        for i in std::mem::take(&mut self.sessions.resume) {
            self.read_session(i as usize);
        }
        if let Some(l) = listener.as_ref() {
            if self.accept_at.is_some_and(|t| self.now >= t) {
                self.accept_at = None;
                self.accept(l, false);
                self.accept_plain();
            }
        }
        for event in events.iter() {
            match event.token() {
                LISTENER => {
                    if let (Some(l), None) = (listener.as_ref(), self.accept_at) {
                        self.accept(l, false);
                    }
                }
                LISTENER_PLAIN if self.accept_at.is_none() => self.accept_plain(),
                LISTENER_PLAIN => {}
                WAKER => {}
                Token(t) if t >= FIRST_SESSION => self.on_session_event(t - FIRST_SESSION, event),
                Token(t) => self.on_upstream_event(t - FIRST_UPSTREAM, event),
            }
        }
        if stop.load(Ordering::Relaxed) && self.grace_until.is_none() {
            let mut addr = None;
            if let Some(mut l) = listener.take() {
                addr = l.local_addr().ok();
                let _ = self.poll.registry().deregister(&mut l);
            }
            if let Some(mut l) = self.plain.take() {
                let _ = self.poll.registry().deregister(&mut l);
            }
            // No connection is taken from now on: nothing to wake for.
            (self.accept_at, self.listening) = (None, true);
            self.grace_until = Some(self.now + self.config.grace);
            self.tell_drain();
            if self.index == 0 {
                tracing::info!(
                    addr = addr.map(tracing::field::display),
                    sessions = self.shared.sessions(),
                    grace_ms = self.config.grace.as_millis() as u64,
                    "listener closed; draining"
                );
            }
        }
        if self.next_expiry.is_some_and(|t| self.now >= t) {
            self.expire_calls();
        }
        self.keep_upstreams();
        self.sweep_sessions();
        self.reroute();
        if let Some(until) = self.grace_until {
            if self.in_flight > 0 && self.now >= until {
                self.answer_all_in_flight(&Failure::GraceOver);
                self.answer_handed_back(&Failure::GraceOver);
            }
        }
        if self.admitted > 0 {
            self.guards
                .budget
                .deposit(mem::take(&mut self.admitted), self.now);
        }
        // Counted before the replies leave: a scrape after a reply includes its call.
        self.tell_providers();
        self.tell_workers();
        self.counts.end_round(self.in_flight);
        self.flush();
        self.hand_over_moving();
        let done = self.drain_over();
        if done {
            self.close_all();
        }
        done
    }

    /// Starts taking connections once every provider has settled, in every worker: it
    /// answered a heartbeat, or a connect to it failed, or `settle_by` has passed. A call sent as
    /// soon as the broker runs is then not answered "unavailable" only because the first
    /// connections were still being made; the connections waiting meanwhile are in the
    /// listener's backlog, taken at once.
    fn listen(&mut self, listener: &mut Option<TcpListener>) {
        if !self.told_settled
            && (self.now >= self.settle_by || self.routes.providers.iter().all(|p| p.settled))
        {
            // With several workers, the listening one waits for every worker's providers.
            self.told_settled = true;
            self.shared.settled.fetch_add(1, Ordering::Relaxed);
        }
        if self.listening {
            return;
        }
        let settled = self.now >= self.settle_by || self.shared.all_settled();
        let Some(l) = listener.as_mut().filter(|_| settled) else {
            return;
        };
        match self
            .poll
            .registry()
            .register(l, LISTENER, Interest::READABLE)
        {
            Ok(()) => {
                self.listening = true;
                self.accept_at = Some(self.now);
                self.say_listening(l.local_addr().ok());
                if let Some(p) = self.plain.as_mut() {
                    let registered =
                        self.poll
                            .registry()
                            .register(p, LISTENER_PLAIN, Interest::READABLE);
                    if let Err(e) = registered {
                        tracing::error!(error = %e, "the plain address cannot be served");
                        self.plain = None;
                    }
                }
            }
            Err(e) => {
                // Tried again next round, after the pause.
                let pause = self.accept_backoff.pause();
                tracing::warn!(error = %e, ?pause, "the listener could not be registered; tried again after a pause");
                self.settle_by = self.now + pause;
            }
        }
    }

    /// Says that the broker serves, as the Tokio engine does (`crate::listening`), after
    /// naming the providers it did not hear from in time: those this worker has not
    /// settled (their connects neither failed nor answered a heartbeat).
    fn say_listening(&mut self, addr: Option<SocketAddr>) {
        let Some(served) = self.announce.take() else {
            return;
        };
        let late: Vec<&str> = self
            .routes
            .providers
            .iter()
            .filter(|p| !p.settled && !p.left)
            .map(|p| p.host.as_str())
            .collect();
        if !late.is_empty() {
            tracing::warn!(providers = %late.join(","), "providers still connecting: calls to them are answered \"unavailable\" until they answer");
        }
        crate::listening(
            &self.config,
            addr,
            &served,
            self.busy_poll(),
            self.shared.workers.len(),
        );
    }

    /// How long a worker spins on empty polls before it sleeps (`--busy-poll`). Gathered
    /// workers spin only where the connections are (a worker without them reads
    /// nothing): busy polling is `auto`'s for one spinner then.
    fn busy_poll(&self) -> Option<Duration> {
        let spinners = match self.config.cell_placement {
            crate::config::CellPlacement::Gather => 1,
            crate::config::CellPlacement::Spread => self.shared.workers.len(),
        };
        self.config.busy_poll.window(spinners)
    }

    /// Whether the drain is over: every call answered and every answer written, and no
    /// call come for [`DRAIN_LINGER`] (one sent as the drain began is refused "not run",
    /// not met by a closed connection), nor any client told of the drain left that has
    /// not closed (for [`NOTICED_DRAIN_LINGER`] at most); or the grace period over and
    /// its last answers given [`FINAL_FLUSH_TIMEOUT`] to be written.
    fn drain_over(&mut self) -> bool {
        let Some(grace) = self.grace_until else {
            return false;
        };
        if self.now >= grace + FINAL_FLUSH_TIMEOUT {
            return true;
        }
        if self.in_flight > 0 || !self.all_written() {
            self.idle_since = None;
            return false;
        }
        let since = *self.idle_since.get_or_insert(self.now);
        self.now >= since + DRAIN_LINGER
            && (self.now >= since + NOTICED_DRAIN_LINGER || !self.any_told_of_drain())
    }

    /// How long the loop may sleep: until the next call's deadline, heartbeat, accept
    /// or provider connection's retry, and in ticks while the drain or a session's end
    /// waits.
    fn sleep_for(&self) -> Option<Duration> {
        let mut wake = Some(self.next_keep);
        let mut at = |t: Option<Instant>| {
            if let Some(t) = t {
                wake = Some(wake.map_or(t, |w| w.min(t)));
            }
        };
        at(self.next_expiry);
        at(self.accept_at);
        if !self.listening {
            at(Some(self.settle_by));
            if self.shared.workers.len() > 1 {
                // The other workers' providers settle on their threads: looked at soon.
                at(Some(self.now + TICK));
            }
        }
        at(self.pending_by());
        if self.any_budget_paused() {
            // Looked at again soon: the budget's relief raises no event here.
            at(Some(self.now + TICK));
        }
        if self.sessions_open() > 0 {
            at(Some(self.next_session_sweep));
        }
        if self.grace_until.is_some() || self.any_ending() || self.any_moving() {
            at(Some(self.now + TICK));
        }
        wake.map(|w| w.saturating_duration_since(Instant::now()))
    }

    /// Writes what this round gave: the calls, then the replies. The calls of a
    /// provider connection whose write failed are routed again and written at once, once
    /// (those of a second failure in the next round, which does not wait).
    fn flush(&mut self) {
        // Only the connections that are up can have something to write: with many
        // providers that cannot be reached, looking at every connection each round cost
        // most of the round.
        let mut up = mem::take(&mut self.flushing);
        for pass in 0..2 {
            up.clear();
            up.extend_from_slice(&self.up_conns);
            for &k in &up {
                if let Err(e) = self.upstreams[k].flush(&self.budget) {
                    self.upstream_lost(k, crate::failure::ConnEnd::Write(Arc::new(e)));
                }
            }
            if pass == 1 || !self.any_handed_back() {
                break;
            }
            self.reroute();
        }
        self.flushing = up;
        self.timing.flushed_upstream();
        self.flush_sessions();
        self.timing.flushed_back();
    }

    /// Tells the other workers what this one did this round: the calls it counted out of
    /// its lease on the cap, and the calls it answered.
    fn tell_workers(&mut self) {
        if let Some(lease) = &self.lease {
            if self.released > 0 {
                lease.release(mem::take(&mut self.released));
            }
        }
        let answered = self.summary.replied + self.summary.answered;
        if answered != self.answered_told {
            self.cell_calls.increment(answered - self.answered_told);
            self.answered_told = answered;
            self.shared.workers[self.index]
                .answered
                .store(answered, Ordering::Relaxed);
        }
        if self.next_work_read.is_some_and(|t| self.now >= t) {
            self.next_work_read = Some(self.now + workers::WORK_READ);
            let work = crate::cell::placement::thread_cpu_ns().saturating_sub(self.spin_idle_ns);
            self.shared.workers[self.index]
                .work_ns
                .store(work, Ordering::Relaxed);
        }
    }

    /// Tells the shared counters what the round counted of each provider: its calls'
    /// outcomes, the bytes and system calls on its connections.
    fn tell_providers(&mut self) {
        for p in self.told.drain(..) {
            if let Some(provider) = self.routes.providers.get_mut(p) {
                let m = &provider.metrics;
                provider.outcomes.drain(|status, n| m.outcomes(status, n));
            }
        }
        if self.counts.outbound != Default::default() {
            if let Some(p) = self.routes.providers.first() {
                p.metrics.wire.add(mem::take(&mut self.counts.outbound));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn busy_polling_tells_its_empty_stretches_in_chunks_and_at_the_windows_end() {
        let t0 = Instant::now();
        let mut idle = SpinIdle::default();
        // Empty polls for 6 ms, then a read: 6 ms idle, under a chunk, kept.
        assert_eq!(idle.polled(t0, true, false, false), None);
        assert_eq!(idle.polled(t0 + 6 * MS, true, false, false), None);
        assert_eq!(idle.polled(t0 + 7 * MS, true, true, false), None);
        // A poll that slept (not spinning) counts nothing.
        assert_eq!(idle.polled(t0 + 50 * MS, false, false, false), None);
        // Another 5 ms stretch ended by a read: 11 ms, a chunk told.
        assert_eq!(idle.polled(t0 + 60 * MS, true, false, false), None);
        assert_eq!(idle.polled(t0 + 65 * MS, true, false, false), None);
        assert_eq!(idle.polled(t0 + 66 * MS, true, true, false), Some(11 * MS));
        // The window ends after 2 ms of empty polls: told at once, to its end.
        assert_eq!(idle.polled(t0 + 70 * MS, true, false, false), None);
        assert_eq!(idle.polled(t0 + 72 * MS, true, false, true), Some(2 * MS));
        assert_eq!(idle.polled(t0 + 80 * MS, false, false, false), None);
    }
}
