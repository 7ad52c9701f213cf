//! Several loops: with `--threads N` (N > 1) the loop engine runs N workers, each a loop
//! of its own (`super::Engine`) on a thread of its own, owning the client sessions dealt
//! to it and its own connections to every provider, so that a call is read, routed,
//! written to its provider, answered and written back by the thread that read it: no
//! hand-off, lock or shared atomic on a call's way, as with the Tokio engine's cells
//! (`crate::cell`, whose reasons hold here).
//!
//! - **Dealing.** The first worker alone listens, once every worker's providers have
//!   settled: it takes every connection (so the connection cap and the drain stay whole)
//!   and deals each to the *open* worker serving the fewest (ties to the lowest), handing the
//!   socket to it with a wake-up: one hand-off per connection, none per call.
//! - **Open workers.** With `--cell-placement spread` every worker is open from the start.
//!   With `gather` (the default) only the first is, until the placement
//!   (`crate::cell::placement`'s rules) opens more.
//! - **Per worker**: the sessions, the provider connections (each provider's
//!   `--pool-size` divided among the workers, rounded up: `crate::cell::pool_share`), the
//!   routing and its balancing state, each provider's latency estimate, pace and outlier
//!   detector, the busy-poll spin.
//! - **Shared**: the settings, the providers (each list applied by every worker, the same
//!   way, in the same order), the broker-wide in-flight cap (leased in blocks:
//!   `crate::in_flight`), the connection cap (a count per worker, moved per connection),
//!   the memory budget, the retry budget and the cap on ejections, the metrics (each
//!   provider's series summed over the workers, as over cells).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use mio::Waker;
use rpcmesh_common::cli::security::Security;
use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_common::net::sources::{OverLimit, Source, Sources};

use super::control::{Command, Control};
use crate::cell::placement::{Change, Placement, Reading, Seen, decide};
use crate::config::PlacementTuning;
use crate::in_flight::InFlightCap;
use crate::metrics::{BrokerMetrics, UpstreamMetrics};
use crate::resilience::Guards;

/// How often a worker reads its thread's CPU time while it runs, for the placement: a
/// fraction of its review, and one system call per 100 ms.
pub(super) const WORK_READ: Duration = Duration::from_millis(100);

/// One worker, as the others and the control side reach it.
#[derive(Debug)]
pub(super) struct Link {
    /// Commands on their way to it.
    pub control: Arc<Control>,
    pub waker: Waker,
    /// Client connections it serves, and those dealt to it on their way: raised by the
    /// worker that deals, lowered by this one as each closes.
    pub sessions: AtomicUsize,
    /// Calls it answered so far (stored by it once a round).
    pub answered: AtomicU64,
    /// Its thread's CPU time less the time its busy polling found nothing, in
    /// nanoseconds, as last read (by it, every [`WORK_READ`] while it runs).
    pub work_ns: AtomicU64,
    /// It has ended (its drain is over, or its poll failed): dealt nothing more.
    pub ended: AtomicBool,
}

impl Link {
    /// Hands `command` to the worker, and wakes it.
    pub fn command(&self, command: Command) {
        self.control.send(command);
        let _ = self.waker.wake();
    }
}

/// What the workers share.
#[derive(Debug)]
pub(super) struct Shared {
    pub metrics: BrokerMetrics,
    pub guards: Arc<Guards>,
    pub budget: Arc<MemoryBudget>,
    /// The broker-wide cap on calls in flight, leased by each worker.
    pub in_flight: Arc<InFlightCap>,
    /// The policy (`--authz-policy`) and where denials are counted.
    pub security: Security,
    /// Stops the policy file's watcher when the engine ends.
    pub watching: CancellationToken,
    /// The drain has been asked for.
    pub stop: AtomicBool,
    /// Workers whose providers have all settled (answered a heartbeat or refused a
    /// connect) or whose time to settle is up: the first listens once all have.
    pub settled: AtomicUsize,
    /// Heap allocations the rounds made, over the workers.
    pub allocations: Arc<AtomicU64>,
    pub workers: Vec<Link>,
    /// Workers dealt new connections: the first `open`.
    open: AtomicUsize,
    /// `rpcmesh_cells_open`, `rpcmesh_cell_moves_total`.
    open_gauge: metrics::Gauge,
    moves: metrics::Counter,
    /// Each provider's series, by its label and the number of the list it joined with,
    /// until every worker has taken its handles (`Shared::upstream_metrics`).
    upstreams: Mutex<HashMap<(Arc<str>, u64), Handed>>,
    /// Each source's connections open and its bucket (`rpcmesh_common::net::sources`):
    /// admitted by the listening worker, closed by whichever worker holds the session.
    sources: Mutex<Sources>,
}

/// A provider's series, and how many workers have taken their handles.
type Handed = (UpstreamMetrics, usize);

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        metrics: BrokerMetrics,
        security: (Security, CancellationToken),
        guards: Arc<Guards>,
        budget: Arc<MemoryBudget>,
        in_flight: Arc<InFlightCap>,
        workers: Vec<Link>,
        (open, sources): (usize, Sources),
    ) -> Shared {
        let open = open.clamp(1, workers.len().max(1));
        let (open_gauge, moves) = metrics.placement(workers.len());
        open_gauge.set(open as f64);
        Shared {
            open_gauge,
            moves,
            metrics,
            guards,
            budget,
            in_flight,
            security: security.0,
            watching: security.1,
            stop: AtomicBool::new(false),
            settled: AtomicUsize::new(0),
            allocations: Arc::default(),
            workers,
            open: AtomicUsize::new(open),
            upstreams: Mutex::new(HashMap::new()),
            sources: Mutex::new(sources),
        }
    }

    /// Admits one more connection from `source` now, or says which of its limits it is
    /// over, and what it has open.
    pub fn admit(&self, source: Source, now: Instant) -> Result<(), (OverLimit, usize)> {
        let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        let now = tokio::time::Instant::from_std(now);
        sources
            .admit(source, now)
            .map_err(|over| (over, sources.open(source)))
    }

    /// A connection from `source` closed.
    pub fn source_closed(&self, source: Source) {
        let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        sources.closed(source);
    }

    /// Client connections served by all workers (and on their way to one).
    pub fn sessions(&self) -> usize {
        self.workers
            .iter()
            .map(|w| w.sessions.load(Ordering::Relaxed))
            .sum()
    }

    /// The open worker a new connection goes to (the one serving the fewest, ties to the
    /// first), counted as its own from now on.
    pub fn deal(&self) -> usize {
        let open = self.open.load(Ordering::Relaxed).min(self.workers.len());
        let to = (0..open)
            .filter(|&w| !self.workers[w].ended.load(Ordering::Relaxed))
            .min_by_key(|&w| self.workers[w].sessions.load(Ordering::Relaxed))
            .unwrap_or(0);
        self.workers[to].sessions.fetch_add(1, Ordering::Relaxed);
        to
    }

    /// Whether every worker's providers have settled.
    pub fn all_settled(&self) -> bool {
        self.settled.load(Ordering::Relaxed) >= self.workers.len()
    }

    /// Workers open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    fn set_open(&self, n: usize) {
        let n = n.clamp(1, self.workers.len().max(1));
        self.open.store(n, Ordering::Relaxed);
        self.open_gauge.set(n as f64);
    }

    /// The worker a session of worker `from` asked to move to `to` (to the open one
    /// serving the fewest, when `None`) goes to, counted as its own from now on; `None`
    /// when it is to stay (its worker is no longer open, or is `from` itself).
    pub fn take_to(&self, to: Option<usize>, from: usize) -> Option<usize> {
        let to = match to {
            Some(w)
                if w < self.open()
                    && w != from
                    && !self.workers[w].ended.load(Ordering::Relaxed) =>
            {
                self.workers[w].sessions.fetch_add(1, Ordering::Relaxed);
                w
            }
            Some(_) => return None,
            None => self.deal(),
        };
        if to == from {
            self.workers[to].sessions.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(to)
    }

    /// A session moved between workers.
    pub fn moved(&self) {
        self.moves.increment(1);
    }

    /// What the placement reads of the workers now.
    fn reading(&self) -> Reading {
        Reading {
            at: Some(Instant::now()),
            work_ns: self
                .workers
                .iter()
                .map(|w| w.work_ns.load(Ordering::Relaxed))
                .collect(),
            answered: self
                .workers
                .iter()
                .map(|w| w.answered.load(Ordering::Relaxed))
                .sum(),
        }
    }

    /// The series of the provider `label` that joined with the list `seq`, for worker
    /// `index` whose `share` connections to it are numbered from `index × share`: one set
    /// for all workers, each worker's pool figures summed with the others'.
    pub fn upstream_metrics(
        &self,
        label: &Arc<str>,
        seq: u64,
        pool_size: u32,
        index: usize,
        share: u32,
    ) -> UpstreamMetrics {
        let workers = self.workers.len().max(1);
        let mut upstreams = self
            .upstreams
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let key = (label.clone(), seq);
        let (metrics, taken) = upstreams
            .entry(key.clone())
            .or_insert_with(|| (self.metrics.upstream(label, pool_size, workers), 0));
        *taken += 1;
        let mine = metrics.in_cell(index, index * share as usize);
        if *taken >= workers {
            upstreams.remove(&key);
        }
        mine
    }
}

/// Places the client connections of `shared`'s workers for ever (the caller stops it), by
/// the Tokio engine's cells' rules (`crate::cell::placement`): every `tuning.review` it
/// reads each worker's work and the calls answered; one more worker is opened, and about
/// half the busiest one's calls moved to it, when a trial shows more calls answered;
/// one fewer when that costs none. Nothing to do with one worker, or all open from the
/// start (`--cell-placement spread`).
pub(super) async fn place(shared: &Shared, tuning: PlacementTuning) {
    let workers = shared.workers.len();
    if workers < 2 || shared.open() == workers {
        return std::future::pending().await;
    }
    let mut state = Placement::new(Instant::now());
    let mut last = shared.reading();
    loop {
        tokio::time::sleep(tuning.review).await;
        let now = shared.reading();
        let open = shared.open();
        let sessions = (0..open)
            .map(|w| shared.workers[w].sessions.load(Ordering::Relaxed))
            .collect();
        if let Some(seen) = Seen::between(&last, &now, sessions, workers) {
            match decide(&tuning, &mut state, &seen) {
                Change::None => {}
                Change::Spread { from } => {
                    shared.set_open(open + 1);
                    shared.workers[from].command(Command::Move(Some(open)));
                    tracing::debug!(from, to = open, "workers: connections asked to move");
                }
                Change::Gather if open > 1 => {
                    shared.set_open(open - 1);
                    shared.workers[open - 1].command(Command::Move(None));
                }
                Change::Gather => {}
            }
        }
        last = now;
    }
}
