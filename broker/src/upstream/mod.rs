//! The broker's side towards providers: per provider, a pool of multiplexed connections.
//!
//! - [`connection`]: one connection and the task that owns its calls in flight (and, to
//!   a plain v1 server, ACKs its reads at once while calls are in flight: see its `task`).
//! - [`pace`]: how long the provider takes per call on one connection (measured for a
//!   plain v1 server, reported by an rpcmesh provider), and so how deep the router may
//!   pack its connections.
//! - [`ProviderPool`] (here): the connections of one provider. `bb8` owns their life:
//!   connecting, validating each with a heartbeat round trip on checkout, dropping broken
//!   ones and reconnecting. A keeper task checks all of them out every health interval
//!   (and at once when one fails) and publishes the healthy set in an `ArcSwap`, which is
//!   all the per-call path reads: no lock, no checkout per call. The heartbeats of one
//!   round run at once, so a stalled provider is out of service one health interval plus
//!   one heartbeat timeout after it stalled, whatever the pool's size.
//! - A provider that answers a call "unavailable" with `NOT_RUN` is draining (it was told
//!   to stop, and refuses what it did not start): the whole pool, in every cell, is
//!   marked draining ([`PoolLink`]), the router passes it over, its connections open at that moment fail
//!   their next check and close once their calls are done, and the mark is lifted when a
//!   connection made after it answers a heartbeat (the provider is back, typically
//!   restarted on the same address; reconnects back off meanwhile).
//! - At the start a pool **settles** ([`ProviderPool::settled`]) when its first round of
//!   checks is published, or at once when a connect fails (nothing listens there): the
//!   broker accepts calls only once every pool has settled, so that a call sent as soon
//!   as the broker runs is not answered "unavailable" only because the first connections
//!   were still being made. Bounded by the pool's connection timeout (`--connect-timeout`
//!   + `--health-timeout`), after which a round always ends.
//! - Reconnects back off per provider: after a failed connect, a failed heartbeat, or a
//!   connection that closed before its first heartbeat was answered (a provider at its
//!   connection cap accepts and closes at once), the next connect waits for the shared
//!   [`Backoff`]'s pause; the first answered heartbeat resets it. While a provider's
//!   connects fail, they are made one at a time: the others of its pool wait for that
//!   one's outcome and share it (a provider nothing listens at costs one connect per
//!   pause, not one per pooled connection), and bb8 does not retry on its own. A failed
//!   connect ends the keeper's round at once (bb8 would leave its checkouts waiting out
//!   their timeout), so a provider restarted on its address is back within one pause.

pub(crate) mod connection;
pub(crate) mod pace;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::StreamExt as _;
use rpcmesh_common::cli::DurationArg;
use rpcmesh_common::net::backoff::Backoff;
use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_common::net::thinned::Thinned;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use rpcmesh_common::net::busy_poll::Activity;
use rpcmesh_common::net::listener::AcceptObserver;

use crate::config::BrokerConfig;
use crate::metrics::UpstreamMetrics;
use crate::resilience::Guards;
use crate::resilience::ewma::PeakEwma;
use crate::resilience::outlier::{EjectReason, Outlier};
use crate::upstream_spec::UpstreamSpec;
pub(crate) use connection::{ConnSettings, Refused, UpstreamConn};

/// Why an upstream connection could not be made or kept.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// TCP connect failed.
    #[error("connect failed: {0}")]
    Connect(std::io::Error),
    /// TCP connect took too long.
    #[error("connect timed out after {}", DurationArg(*.0))]
    ConnectTimeout(Duration),
    /// The health-check heartbeat was not answered in time.
    #[error("heartbeat not answered within {}", DurationArg(*.0))]
    HeartbeatTimeout(Duration),
    /// The connection is closed.
    #[error("connection closed")]
    Closed,
    /// The TLS handshake was refused.
    #[error("{0}")]
    Tls(#[from] rpcmesh_common::net::tls::ConnectError),
    /// Not tried: the provider's connect made meanwhile failed.
    #[error("provider unreachable: the connect made meanwhile failed")]
    Unreachable,
}

/// What a pool shares with the tasks of its connections.
#[derive(Debug)]
pub(crate) struct PoolLink {
    /// Notified when a connection fails or the provider says it is draining: the keeper
    /// looks again at once.
    wake: Notify,
    /// Notified when a connect fails: the keeper's round stops waiting for the checkouts
    /// still out, since bb8 tells a waiting checkout nothing of a failed connect (it would
    /// wait out its whole timeout, `--connect-timeout` + `--health-timeout`, and a provider
    /// restarted meanwhile would stay out of service that long).
    connect_failed: Notify,
    /// The number the next connection gets (numbers follow the order connections are made).
    next_id: AtomicU64,
    /// While the provider drains: connections numbered below this are out of service
    /// (those open when it said so); 0 when it is not draining.
    draining_below: AtomicU64,
    /// Connection tasks still running (a pool that left is gone once this is 0).
    tasks: AtomicUsize,
    /// Notified when a connection task ends.
    task_done: Notify,
    /// True once the pool has settled (see the module's doc); never unset.
    settled: watch::Sender<bool>,
    /// Why the last attempt to make or check a connection failed, for the log line that
    /// says a provider has no healthy connection (bb8 reports only that it timed out).
    last_failure: std::sync::Mutex<Option<Failure>>,
    /// The provider's time per call on one connection, measured by the connections (a
    /// plain v1 server) or reported in heartbeat answers (an rpcmesh provider), and read by
    /// the router to decide how deep it packs them ([`pace`]). This and the three below
    /// are the provider's, shared by the pools of every cell (`crate::cell`).
    pub pace: Arc<pace::Pace>,
    /// The provider's number, unique in the process: what a retry avoids.
    pub id: u64,
    /// Its faults and ejections (`crate::resilience::outlier`).
    pub outlier: Arc<Outlier>,
    /// Its latency as the balancer sees it (`crate::resilience::ewma`).
    pub ewma: Arc<PeakEwma>,
    /// The provider's pools in every cell, told of a drain together.
    siblings: Arc<Siblings>,
    /// What every provider of the broker shares: the settings, the retry budget.
    pub guards: Arc<Guards>,
}

/// The links of one provider's pools, one per cell (`crate::cell`): a drain one cell
/// learns of from a refused call is every cell's at once, so that the others do not each
/// send it calls to be refused (and routed again at the retry budget's expense).
#[derive(Debug, Default)]
struct Siblings(std::sync::Mutex<Vec<std::sync::Weak<PoolLink>>>);

impl Siblings {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<std::sync::Weak<PoolLink>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts `link` among the provider's pools (those gone are let go).
    fn add(&self, link: &Arc<PoolLink>) {
        let mut links = self.lock();
        links.retain(|l| l.strong_count() > 0);
        links.push(Arc::downgrade(link));
    }

    /// Calls `f` with each of the provider's pools but `this`.
    fn each_other(&self, this: &PoolLink, mut f: impl FnMut(&PoolLink)) {
        for other in self.lock().iter().filter_map(std::sync::Weak::upgrade) {
            if !std::ptr::eq(Arc::as_ptr(&other), this) {
                f(&other);
            }
        }
    }
}

/// The number the next provider's pool gets.
static NEXT_PROVIDER: AtomicU64 = AtomicU64::new(1);

impl PoolLink {
    /// `pack_wait`: how long packing may make a call wait behind others on one of the
    /// provider's connections (`--pack-wait`); `source`: where its time per call comes from.
    fn new(
        pack_wait: Duration,
        source: pace::Source,
        guards: Arc<Guards>,
        label: Arc<str>,
        ejections: [metrics::Counter; EjectReason::ALL.len()],
    ) -> Self {
        let r = guards.config;
        PoolLink::of_provider(
            NEXT_PROVIDER.fetch_add(1, Ordering::Relaxed),
            Arc::new(Outlier::new(
                r,
                Arc::clone(&guards.ejections),
                label,
                ejections,
            )),
            Arc::new(PeakEwma::new(r.ewma_default_rtt, r.ewma_decay)),
            Arc::new(pace::Pace::new(pack_wait, source)),
            guards,
        )
    }

    /// The link of another cell's pool of the same provider (`crate::cell`): the
    /// provider's number, pace, ejections and latency estimate are this link's; its
    /// connections, their numbering, its drain mark and its keeper's wake-ups are its own.
    fn sibling(&self) -> Self {
        PoolLink {
            siblings: Arc::clone(&self.siblings),
            ..PoolLink::of_provider(
                self.id,
                Arc::clone(&self.outlier),
                Arc::clone(&self.ewma),
                Arc::clone(&self.pace),
                Arc::clone(&self.guards),
            )
        }
    }

    /// A new pool's link to the provider's shared state.
    fn of_provider(
        id: u64,
        outlier: Arc<Outlier>,
        ewma: Arc<PeakEwma>,
        pace: Arc<pace::Pace>,
        guards: Arc<Guards>,
    ) -> Self {
        PoolLink {
            id,
            outlier,
            ewma,
            pace,
            guards,
            siblings: Arc::default(),
            wake: Notify::new(),
            connect_failed: Notify::new(),
            next_id: AtomicU64::new(1),
            draining_below: AtomicU64::new(0),
            tasks: AtomicUsize::new(0),
            task_done: Notify::new(),
            settled: watch::Sender::new(false),
            last_failure: std::sync::Mutex::new(None),
        }
    }

    /// A link with the default resilience settings, for the unit tests.
    #[cfg(test)]
    pub fn for_test(pack_wait: Duration, source: pace::Source) -> Self {
        let m = crate::metrics::BrokerMetrics::new(rpcmesh_common::metrics::Telemetry::new(), 8);
        let guards = Guards::new(crate::resilience::ResilienceConfig::default(), &m);
        let counters = EjectReason::ALL.map(|_| metrics::Counter::noop());
        PoolLink::new(pack_wait, source, guards, Arc::from("test"), counters)
    }

    /// Records why an attempt failed.
    fn failed(&self, failure: Failure) {
        *self
            .last_failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(failure);
    }

    /// Why the last attempt failed, if one did.
    fn last_failure(&self) -> Option<Failure> {
        self.last_failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Asks the keeper to check the connections now.
    pub fn wake_keeper(&self) {
        self.wake.notify_one();
    }

    /// The provider said it is draining: every connection open now is out, in this pool and
    /// in the provider's pools of the other cells. True when this is news to this pool (the
    /// first word of this drain), so that it is logged once.
    pub fn mark_draining(&self) -> bool {
        let news = self.mark_own_draining();
        self.siblings.each_other(self, |other| {
            other.mark_own_draining();
        });
        news
    }

    /// [`PoolLink::mark_draining`] in this pool alone.
    fn mark_own_draining(&self) -> bool {
        let mark = self.next_id.load(Ordering::Relaxed);
        let before = self.draining_below.fetch_max(mark, Ordering::Relaxed);
        if before < mark {
            self.wake.notify_one();
        }
        before == 0
    }

    /// True while the provider drains and no connection made since has proved healthy.
    pub fn is_draining(&self) -> bool {
        self.draining_below.load(Ordering::Relaxed) != 0
    }

    /// True when connection `id` was open when the provider said it was draining.
    fn is_drained(&self, id: u64) -> bool {
        id < self.draining_below.load(Ordering::Relaxed)
    }

    /// A connection task started.
    pub fn task_started(&self) {
        self.tasks.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection task ended.
    pub fn task_ended(&self) {
        self.tasks.fetch_sub(1, Ordering::Relaxed);
        self.task_done.notify_waiters();
    }

    /// Connection tasks still running.
    pub fn open_tasks(&self) -> usize {
        self.tasks.load(Ordering::Relaxed)
    }

    /// The pool has settled: its first round of checks is published, or a connect failed.
    fn settle(&self) {
        self.settled.send_replace(true);
    }

    fn is_settled(&self) -> bool {
        *self.settled.borrow()
    }

    async fn settled(&self) {
        // The sender lives as long as `self`: the wait ends only when it is true.
        let _ = self.settled.subscribe().wait_for(|settled| *settled).await;
    }

    /// Waits until no connection task of the pool runs (once the pool is dropped, each
    /// ends when its calls are done).
    pub async fn all_closed(&self) {
        loop {
            let done = self.task_done.notified();
            tokio::pin!(done);
            // Registered before looking, so that an end between the two is not missed.
            done.as_mut().enable();
            if self.open_tasks() == 0 {
                return;
            }
            done.await;
        }
    }
}

/// How the last attempt to make or check one of a provider's connections failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The connect failed (refused, unreachable, timed out): nothing takes connections
    /// there. The text is the error's.
    Connect(String),
    /// A connection was made, but it closed or its heartbeat was not answered: the
    /// provider takes connections and does not answer on them.
    Silent(String),
}

impl Failure {
    /// True when the provider took the connection (it is there, and does not answer).
    pub fn is_silent(&self) -> bool {
        matches!(self, Failure::Silent(_))
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Connect(e) | Failure::Silent(e) => f.write_str(e),
        }
    }
}

/// bb8's view of a provider: how to make, check and judge its connections.
struct Manager {
    spec: UpstreamSpec,
    settings: ConnSettings,
    connect_timeout: Duration,
    health_timeout: Duration,
    metrics: UpstreamMetrics,
    link: Arc<PoolLink>,
    /// The pauses between failing attempts, and when the next connect may start.
    retry: std::sync::Mutex<Retry>,
    /// Held by the one connect that may run while the provider's connects fail.
    probe: tokio::sync::Mutex<()>,
    /// Connects that failed so far: one that waited for the probe and sees it grown
    /// shares its failure instead of trying again.
    connect_failures: AtomicU64,
}

/// The back-off state of one provider's connects.
#[derive(Debug, Default)]
struct Retry {
    backoff: Backoff,
    not_before: Option<Instant>,
}

/// The process's budget of failed-connect log lines.
static CONNECT_FAILED_LINES: Thinned = Thinned::new();

impl Manager {
    fn retry(&self) -> std::sync::MutexGuard<'_, Retry> {
        self.retry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An attempt failed: the next connect waits for a pause (each failure lengthens it).
    fn failed(&self) {
        let mut r = self.retry();
        let pause = r.backoff.pause();
        r.not_before = Some(Instant::now() + pause);
    }

    /// A connection proved healthy: connects go at once again.
    fn succeeded(&self) {
        let mut r = self.retry();
        if !r.backoff.is_reset() {
            r.backoff.reset();
            r.not_before = None;
        }
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = Arc<UpstreamConn>;
    type Error = UpstreamError;

    async fn connect(&self) -> Result<Arc<UpstreamConn>, UpstreamError> {
        // While the provider's connects fail, one at a time: the others wait for its
        // outcome, and share a failure rather than try again at once.
        let failures = self.connect_failures.load(Ordering::Relaxed);
        let failing = !self.retry().backoff.is_reset();
        let _probe = match failing {
            true => Some(self.probe.lock().await),
            false => None,
        };
        if self.connect_failures.load(Ordering::Relaxed) != failures {
            return Err(UpstreamError::Unreachable);
        }
        let not_before = self.retry().not_before;
        if let Some(t) = not_before {
            tokio::time::sleep_until(t).await;
        }
        let id = self.link.next_id.fetch_add(1, Ordering::Relaxed);
        let r = UpstreamConn::connect(
            &self.spec.addr,
            id,
            self.settings.clone(),
            self.metrics.clone(),
            self.link.clone(),
            self.connect_timeout,
        )
        .await;
        match &r {
            Ok(_) => self.metrics.conns.opened(),
            Err(e) => {
                self.metrics.connect_failures.increment(1);
                self.connect_failures.fetch_add(1, Ordering::Relaxed);
                self.failed();
                self.link.failed(Failure::Connect(e.to_string()));
                self.link.connect_failed.notify_one();
                // Nothing answers there (yet): waiting for the round would not help.
                self.link.settle();
                match CONNECT_FAILED_LINES.admit() {
                    Some(a) => {
                        tracing::warn!(provider = %self.spec.addr, error = %e, failures = a.seen, left_out = a.left_out, "connect failed")
                    }
                    None => {
                        tracing::debug!(provider = %self.spec.addr, error = %e, "connect failed")
                    }
                }
            }
        }
        r.map(Arc::new)
    }

    async fn is_valid(&self, conn: &mut Arc<UpstreamConn>) -> Result<(), UpstreamError> {
        if self.link.is_drained(conn.id()) {
            // Open when the provider said it was draining: it closes once its calls are
            // done, and a connection made after it restarted takes its place.
            conn.retire();
        }
        if conn.is_closed() {
            self.failed();
            self.link
                .failed(Failure::Silent(UpstreamError::Closed.to_string()));
            return Err(UpstreamError::Closed);
        }
        let r = conn.heartbeat(self.health_timeout).await;
        match &r {
            Ok(()) => self.succeeded(),
            Err(e) => {
                conn.retire();
                self.failed();
                self.link.failed(Failure::Silent(e.to_string()));
            }
        }
        r
    }

    fn has_broken(&self, conn: &mut Arc<UpstreamConn>) -> bool {
        conn.is_closed() || self.link.is_drained(conn.id())
    }
}

/// Where a provider's pool runs (`crate::cell`).
pub(crate) struct Placement<'a> {
    /// Its connections: its cell's share of `--pool-size`.
    pub size: u32,
    /// Its cell's spinner, when the broker busy-polls.
    pub activity: Option<Arc<Activity>>,
    /// The same provider's pool in the first cell, whose provider-level state (number,
    /// pace, ejections, latency estimate) this one shares; `None`: this is the first.
    pub sibling: Option<&'a PoolLink>,
}

/// The connections of one provider (in one cell).
pub(crate) struct ProviderPool {
    pub spec: UpstreamSpec,
    ready: ArcSwap<Vec<Arc<UpstreamConn>>>,
    /// Told when the provider gains its first healthy connection or loses its last, so
    /// that the routing is made again with it among the providers with connections (or
    /// not): see `route`.
    liveness: Arc<Notify>,
    pool: bb8::Pool<Manager>,
    link: Arc<PoolLink>,
    size: u32,
    health_interval: Duration,
    metrics: UpstreamMetrics,
}

impl std::fmt::Debug for ProviderPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderPool")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl ProviderPool {
    /// Builds the pool (connections are made in the background, on the runtime this is
    /// called in: its cell's). What every pool shares: the process's memory budget, the
    /// resilience guards, and what to tell when the provider gains or loses its healthy
    /// connections.
    pub fn new(
        spec: UpstreamSpec,
        config: &BrokerConfig,
        metrics: UpstreamMetrics,
        place: Placement<'_>,
        grace_over: CancellationToken,
        (budget, guards, liveness): (Arc<MemoryBudget>, Arc<Guards>, Arc<Notify>),
        tls: Option<Arc<rpcmesh_common::net::tls::ClientTls>>,
    ) -> Arc<ProviderPool> {
        let source = pace::Source::of(spec.kind);
        let link = Arc::new(match place.sibling {
            Some(first) => first.sibling(),
            None => PoolLink::new(
                config.pack_wait,
                source,
                guards,
                Arc::from(spec.label()),
                metrics.ejections.clone(),
            ),
        });
        link.siblings.add(&link);
        let activity = place.activity;
        let settings = ConnSettings {
            label: Arc::from(spec.label()),
            kind: spec.kind,
            max_body_len: config.max_body_len,
            max_in_flight: config.max_in_flight_per_upstream_conn,
            call_timeout: config.call_timeout,
            activity,
            grace_over,
            budget,
            // Only rpcmesh providers: a plain v1 server speaks no TLS.
            tls: tls.filter(|_| spec.kind == rpcmesh_wire::PeerKind::Rpcmesh),
        };
        let manager = Manager {
            spec: spec.clone(),
            settings,
            connect_timeout: config.connect_timeout,
            health_timeout: config.health_timeout,
            metrics: metrics.clone(),
            link: link.clone(),
            retry: std::sync::Mutex::new(Retry::default()),
            probe: tokio::sync::Mutex::new(()),
            connect_failures: AtomicU64::new(0),
        };
        let pool = bb8::Pool::builder()
            .max_size(place.size)
            .min_idle(Some(place.size))
            .test_on_check_out(true)
            // Connects back off in the manager, per provider; bb8 retrying a failed one
            // on its own would make several attempts per pause.
            .retry_connection(false)
            // The keeper checks connections out and in every health interval, so bb8's
            // idle and lifetime reapers would only close busy connections.
            .idle_timeout(None)
            .max_lifetime(None)
            .connection_timeout(config.checkout_timeout())
            .build_unchecked(manager);
        Arc::new(ProviderPool {
            spec,
            ready: ArcSwap::from_pointee(Vec::new()),
            liveness,
            pool,
            link,
            size: place.size,
            health_interval: config.health_interval,
            metrics,
        })
    }

    /// The connections to use now (some may have closed since; check `is_closed`).
    pub fn ready(&self) -> arc_swap::Guard<Arc<Vec<Arc<UpstreamConn>>>> {
        self.ready.load()
    }

    /// True when the last round of checks found a healthy connection.
    pub fn has_healthy(&self) -> bool {
        !self.ready.load().is_empty()
    }

    /// How many calls the router may pack onto one connection of this provider before it
    /// goes on to the next (0 = none: the less loaded of two): as deep as its time per
    /// call allows, at most `pack` (`--pack-in-flight`; see [`pace`]).
    pub fn pack_depth(&self, pack: usize) -> usize {
        self.link.pace.depth(pack)
    }

    /// Waits until the pool has settled (see the module's doc).
    pub async fn settled(&self) {
        self.link.settled().await;
    }

    /// True once the pool has settled.
    pub fn is_settled(&self) -> bool {
        self.link.is_settled()
    }

    /// True when the provider is still being connected to: the pool has not settled, or it
    /// has no healthy connection and the last attempt made one that did not answer (a
    /// provider that accepts and does not answer, or not yet), rather than a connect that
    /// failed.
    pub fn is_connecting(&self) -> bool {
        !self.is_settled()
            || (self.ready.load().is_empty()
                && self.link.last_failure().is_none_or(|f| f.is_silent()))
    }

    /// True while the provider drains (see [`PoolLink`]): the router passes it over.
    pub fn is_draining(&self) -> bool {
        self.link.is_draining()
    }

    /// Calls queued or in flight on this provider, on the connections the router sees.
    pub fn calls_in_flight(&self) -> usize {
        self.ready.load().iter().map(|c| c.load()).sum()
    }

    /// What the pool shares with its connections: outlives the pool, to see them close.
    pub fn link(&self) -> Arc<PoolLink> {
        self.link.clone()
    }

    /// Calls queued or in flight on this provider; `usize::MAX` when it has no open
    /// connection or drains.
    pub fn load(&self) -> usize {
        if self.is_draining() {
            return usize::MAX;
        }
        let conns = self.ready.load();
        let mut open = false;
        let mut sum = 0;
        for c in conns.iter().filter(|c| !c.is_closed()) {
            open = true;
            sum += c.load();
        }
        if open { sum } else { usize::MAX }
    }

    /// The PeakEWMA cost of one more call here (`crate::resilience::ewma`): the latency
    /// estimate × (calls in flight + 1); infinite when it has no open connection or drains.
    pub fn cost(&self, now: std::time::Instant) -> f64 {
        match self.load() {
            usize::MAX => f64::INFINITY,
            pending => self.link.ewma.cost(now, pending),
        }
    }

    /// Whether the router may offer this provider a call now (not ejected, or its probe;
    /// `crate::resilience::outlier`).
    pub fn admits(&self, now: std::time::Instant) -> bool {
        self.link.outlier.admits(now)
    }

    /// True while it is ejected or probing.
    pub fn is_out(&self) -> bool {
        self.link.outlier.is_out()
    }

    /// The provider's number (what a retry avoids).
    pub fn id(&self) -> u64 {
        self.link.id
    }

    /// Keeps the published set of healthy connections current until `stop`.
    pub async fn keep(self: Arc<Self>, stop: CancellationToken) {
        let mut healthy_before = usize::MAX;
        let mut waited_before = Duration::ZERO;
        'rounds: loop {
            // Every connection is checked out (and its heartbeat sent) at once. A connect
            // that fails ends the round: the checkouts still out would wait for bb8's
            // timeout, and the next round's connects wait for the back-off's pause instead.
            let mut checkouts: futures_util::stream::FuturesUnordered<_> =
                (0..self.size).map(|_| self.pool.get_owned()).collect();
            let connect_failed = self.link.connect_failed.notified();
            tokio::pin!(connect_failed);
            let mut held = Vec::with_capacity(self.size as usize);
            let mut last_error = None;
            let mut cut_short = false;
            loop {
                tokio::select! {
                    biased;
                    () = stop.cancelled() => break 'rounds,
                    got = checkouts.next() => match got {
                        Some(Ok(c)) => held.push(c),
                        Some(Err(e)) => last_error = Some(e),
                        None => break,
                    },
                    () = &mut connect_failed => {
                        cut_short = true;
                        break;
                    }
                }
            }
            drop(checkouts);
            // Connections open when the provider said it was draining failed their check;
            // any that slipped through (marked since) are left out.
            let mut conns: Vec<Arc<UpstreamConn>> = held
                .iter()
                .map(|c| Arc::clone(&**c))
                .filter(|c| !self.link.is_drained(c.id()))
                .collect();
            if cut_short {
                // The checks still out were of connections healthy at the last round: they
                // stay in service until a check fails (which retires them).
                for c in self.ready.load().iter() {
                    if !c.is_closed()
                        && !self.link.is_drained(c.id())
                        && !conns.iter().any(|h| h.id() == c.id())
                    {
                        conns.push(Arc::clone(c));
                    }
                }
            }
            // Oldest first, in a stable order: the router packs calls onto the first
            // connections, and they should not move between connections at every check.
            conns.sort_unstable_by_key(|c| c.id());
            let healthy = conns.len();
            self.metrics
                .publish_conn_loads(self.size as usize, conns.iter().map(|c| c.load()));
            self.metrics.publish_pace(self.link.pace.per_call());
            self.metrics
                .publish_latency_estimate(self.link.ewma.estimate(std::time::Instant::now()));
            // A connection made after the provider said it was draining answered its
            // heartbeat: the provider is back.
            let mark = self.link.draining_below.load(Ordering::Relaxed);
            let back = mark != 0
                && healthy > 0
                && self
                    .link
                    .draining_below
                    .compare_exchange(mark, 0, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok();
            // Back after it had no healthy connection, or after its drain: what was
            // measured of it was another process's, and its next call is a probe
            // (`crate::resilience::ewma`).
            if back || (healthy_before == 0 && healthy > 0) {
                let now = std::time::Instant::now();
                self.link
                    .ewma
                    .forget(self.link.guards.config.ewma_default_rtt, now);
            }
            self.ready.store(Arc::new(conns));
            if (healthy > 0) != (healthy_before > 0 && healthy_before != usize::MAX) {
                self.liveness.notify_one();
            }
            self.link.settle();
            if back {
                tracing::info!(provider = %self.spec.addr, connections = healthy, "provider back after its drain");
            }
            drop(held);
            self.metrics
                .publish_pool(&self.pool.state(), healthy, &mut waited_before);
            if healthy != healthy_before {
                // bb8 says only that the checkouts timed out; the pool knows why.
                let failure = self.link.last_failure();
                match (healthy, &last_error, failure) {
                    (0, _, Some(f @ Failure::Silent(_))) => {
                        tracing::warn!(provider = %self.spec.addr, error = %f, "provider not answering: it takes connections and does not answer their heartbeats")
                    }
                    (0, _, Some(f @ Failure::Connect(_))) => {
                        tracing::warn!(provider = %self.spec.addr, error = %f, "provider unreachable")
                    }
                    (0, Some(e), None) => {
                        tracing::warn!(provider = %self.spec.addr, error = %e, "provider has no healthy connection")
                    }
                    (0, None, None) => {
                        tracing::warn!(provider = %self.spec.addr, "provider has no healthy connection")
                    }
                    (n, _, _) => {
                        tracing::info!(provider = %self.spec.addr, connections = n, "provider connections ready")
                    }
                }
                healthy_before = healthy;
            }
            if cut_short {
                // The next round's connects wait for the back-off's pause on their own.
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(self.health_interval) => {}
                () = self.link.wake.notified() => {}
                () = stop.cancelled() => break,
            }
        }
        self.ready.store(Arc::new(Vec::new()));
        self.liveness.notify_one();
        self.metrics.publish_gone(self.size as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A provider's pools in two cells: a drain one learns of is the other's at once, and
    /// what is the provider's (its number, its latency estimate) is one.
    #[test]
    fn a_drain_one_cell_learns_of_is_marked_in_every_cell() {
        let first = Arc::new(PoolLink::for_test(Duration::ZERO, pace::Source::Reported));
        first.siblings.add(&first);
        let second = Arc::new(first.sibling());
        second.siblings.add(&second);
        assert_eq!(first.id, second.id);
        assert!(Arc::ptr_eq(&first.ewma, &second.ewma));
        // Each pool has made two connections (numbered 1 and 2).
        for link in [&first, &second] {
            link.next_id.fetch_add(2, Ordering::Relaxed);
        }
        assert!(!first.is_draining() && !second.is_draining());
        assert!(second.mark_draining(), "news to the cell that learnt it");
        assert!(first.is_draining() && second.is_draining());
        assert!(first.is_drained(2) && !first.is_drained(3));
        assert!(!first.mark_draining(), "no news to the other cell after");
    }
}
