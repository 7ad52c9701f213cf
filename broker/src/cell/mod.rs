//! Cells: with `--threads N` (N > 1) the broker runs N cells, each a single-threaded
//! Tokio runtime on an OS thread of its own that owns its client sessions, its own
//! connections to every provider and its own busy-poll spinner, so that a call never
//! leaves the thread that read it: no cross-thread wake-up, no task moved between
//! workers, no lock taken by two threads at once on the forwarding path.
//!
//! The first cell is the runtime `run` is called on, which also serves the control plane
//! (the accept loop, the providers file and the pools' keepers' publishing, the metrics
//! endpoint, signals, the drain); the others run on threads started here. With one cell
//! (`--threads 1`) there is nothing else: the broker is what it always was, every session
//! on the runtime it runs on.
//!
//! - **Dealing.** One accept loop (`rpcmesh_common::net::listener`) takes every
//!   connection, so the connection cap, the drain and the grace period stay whole; each
//!   accepted socket is dealt to the *open* cell serving the fewest client connections
//!   (ties in turn) and moved onto that cell's reactor. An accept loop per cell on
//!   `SO_REUSEPORT` listeners would hash a few connections unevenly (a client with 8
//!   connections can land 6 and 2), could not share the cap, and drops the connections
//!   queued on a listener that closes; one hand-off per connection costs nothing per call.
//! - **Moving.** Which cells are open, and when connections move between them, is the
//!   [`placement`]'s. A session asked to move ends its stay at the end of a round
//!   (`rpcmesh_common::net::session::serve_movable`), hands its calls in flight over
//!   from its cell's lease of the cap to the next cell's, and goes on there: the task that
//!   serves a connection from the accept loop follows it from cell to cell.
//! - **Pools.** Each provider has a pool in every cell, of its cell's share of
//!   `--pool-size` ([`pool_share`]), kept by a keeper on that cell: the provider sees
//!   about the connections it was sized for, whatever the thread count. What is the
//!   provider's is shared by its pools: its number, its pace, its ejections and its latency
//!   estimate (`crate::upstream::PoolLink`); a drain it announces to one cell is marked
//!   in its pools of every cell at once.
//! - **Shared by every cell**: the settings, the routing's membership (each cell gets its
//!   own router over its own pools, published at every change), the broker-wide
//!   in-flight cap, the memory budget, the retry budget, TLS, and the metrics (the
//!   pools' gauges and counters are summed over the cells).

pub(crate) mod placement;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use futures_util::future::Either;
use rpcmesh_common::alloc::Counted;
use rpcmesh_common::net::connection::CloseReason;
use rpcmesh_common::net::listener::Via;
use rpcmesh_common::net::session::{Ended, Moving, Resume, Stop};
use rpcmesh_common::net::shutdown::CancellationToken;
use tokio::net::TcpStream;
use tokio::runtime::Handle;

use crate::in_flight::HandedOver;
use crate::metrics::BrokerMetrics;
use crate::session::{self, Session, Shared};

/// One cell: its runtime, and what its sessions share.
#[derive(Debug)]
pub(crate) struct Cell {
    /// Where the cell runs (the first cell: the runtime `run` was called on).
    pub handle: Handle,
    pub shared: Arc<Shared>,
    /// Client connections it serves now (and those on their way to it).
    sessions: AtomicUsize,
    /// The sessions living here, by key, for the placement to move.
    residents: Mutex<HashMap<u64, Resident>>,
    next_key: AtomicU64,
}

impl Cell {
    pub fn new(handle: Handle, shared: Arc<Shared>) -> Arc<Cell> {
        Arc::new(Cell {
            handle,
            shared,
            sessions: AtomicUsize::new(0),
            residents: Mutex::new(HashMap::new()),
            next_key: AtomicU64::new(0),
        })
    }

    /// Client connections it serves now.
    pub fn sessions(&self) -> usize {
        self.sessions.load(Ordering::Relaxed)
    }
}

/// Each cell's share of a provider's `pool_size` connections over `cells` cells: the
/// size divided among them, rounded up, so that the provider gets at least the
/// connections it was sized for and each cell at least one.
pub(crate) fn pool_share(pool_size: u32, cells: usize) -> u32 {
    let cells = u32::try_from(cells.max(1)).unwrap_or(u32::MAX);
    pool_size.div_ceil(cells).max(1)
}

/// The runtimes of the cells beyond the first, each on a thread of its own, until
/// [`CellThreads::stop`].
#[derive(Debug)]
pub(crate) struct CellThreads {
    stop: CancellationToken,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CellThreads {
    /// Starts `count` cell runtimes named after `program`; returns their handles.
    pub fn start(program: &str, count: usize) -> std::io::Result<(CellThreads, Vec<Handle>)> {
        let stop = CancellationToken::new();
        let mut started = CellThreads {
            stop: stop.clone(),
            threads: Vec::with_capacity(count),
        };
        let mut handles = Vec::with_capacity(count);
        for i in 1..=count {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            let stop = stop.clone();
            let thread = std::thread::Builder::new()
                .name(format!("{program}-cell-{i}"))
                .spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build();
                    match rt {
                        Ok(rt) => {
                            let _ = tx.send(Ok(rt.handle().clone()));
                            rt.block_on(stop.cancelled());
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                })?;
            started.threads.push(thread);
            // The thread answers as soon as its runtime is built (or could not be).
            let handle = rx
                .recv()
                .map_err(|_| std::io::Error::other("a cell's thread ended at its start"))??;
            handles.push(handle);
        }
        Ok((started, handles))
    }

    /// Stops the cells' runtimes (whatever they still run is dropped) and waits for their
    /// threads.
    pub async fn stop(mut self) {
        self.stop.cancel();
        let threads = std::mem::take(&mut self.threads);
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
    }
}

/// The broker's cells, and how accepted connections are dealt to them and moved between
/// them.
#[derive(Debug)]
pub(crate) struct Cells {
    cells: Vec<Arc<Cell>>,
    /// Where ties are broken next.
    turn: AtomicUsize,
    /// The cells new connections are dealt to: the first `open` (`placement`).
    open: AtomicUsize,
    /// `rpcmesh_cells_open`, `rpcmesh_cell_moves_total`.
    open_gauge: metrics::Gauge,
    moves: metrics::Counter,
}

impl Cells {
    /// The cells, all open at first when `gather` is false, else only the first
    /// (`placement`).
    pub fn new(cells: Vec<Arc<Cell>>, gather: bool, metrics: &BrokerMetrics) -> Arc<Cells> {
        let open = if gather { 1 } else { cells.len() };
        let (open_gauge, moves) = metrics.placement(cells.len());
        open_gauge.set(open as f64);
        Arc::new(Cells {
            cells,
            turn: AtomicUsize::new(0),
            open: AtomicUsize::new(open),
            open_gauge,
            moves,
        })
    }

    pub fn all(&self) -> &[Arc<Cell>] {
        &self.cells
    }

    /// How many cells take new connections (the first ones).
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    fn set_open(&self, n: usize) {
        let n = n.clamp(1, self.cells.len());
        self.open.store(n, Ordering::Relaxed);
        self.open_gauge.set(n as f64);
    }

    /// Serves an accepted connection: on this runtime when there is one cell (the
    /// session itself, as the broker always did), else on the open cell serving the
    /// fewest, and on the cells it is moved to.
    pub fn serve(
        self: &Arc<Self>,
        stream: TcpStream,
        peer: SocketAddr,
        via: Via,
        stop: Stop,
    ) -> impl Future<Output = CloseReason> + Send + use<> {
        if self.cells.len() == 1 {
            let shared = self.cells[0].shared.clone();
            let allocations = shared.metrics.allocations.clone();
            return Either::Left(Counted::new(
                session::serve(stream, peer, via, shared, stop),
                allocations,
            ));
        }
        let at = self.pick(self.open());
        Either::Right(dealt(self.clone(), at, stream, peer, via, stop))
    }

    /// Of the first `among` cells, the one serving the fewest client connections (ties:
    /// the next in turn), counting the new one at once.
    fn pick(&self, among: usize) -> Counting {
        let n = among.clamp(1, self.cells.len());
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % n;
        let best = (0..n)
            .map(|k| &self.cells[(start + k) % n])
            .min_by_key(|c| c.sessions.load(Ordering::Relaxed))
            .unwrap_or(&self.cells[0]);
        Counting::on(best)
    }

    /// Asks up to `count` of the sessions of cell `from` to move to cell `to`; returns
    /// how many were asked. Each moves at the end of its current round (`session`'s
    /// `serve_on_cell`), unless it is draining or closing.
    pub fn ask_to_move(&self, from: usize, to: usize, count: usize) -> usize {
        let Some(residents) = self.residents_moving(from, to) else {
            return 0;
        };
        let mut asked = 0;
        for r in residents.values().filter(|r| !r.asked.is_cancelled()) {
            if asked == count {
                break;
            }
            r.ask(to);
            asked += 1;
        }
        asked
    }

    /// Asks the sessions of cell `from` that carry about half its calls to move to cell
    /// `to` ([`half_by_load`] of each one's calls/s on `from`); returns how many were
    /// asked. Splitting by count instead could move the light connections and leave the
    /// heavy one, and a trial of one more cell would then measure nothing.
    pub fn ask_half_to_move(&self, from: usize, to: usize) -> usize {
        let Some(residents) = self.residents_moving(from, to) else {
            return 0;
        };
        let now = Instant::now();
        let staying: Vec<&Resident> = residents
            .values()
            .filter(|r| !r.asked.is_cancelled())
            .collect();
        let loads: Vec<f64> = staying.iter().map(|r| r.calls_per_second(now)).collect();
        let chosen = half_by_load(&loads);
        for &i in &chosen {
            staying[i].ask(to);
        }
        chosen.len()
    }

    /// The residents of cell `from`, locked, when both `from` and `to` are cells.
    fn residents_moving(
        &self,
        from: usize,
        to: usize,
    ) -> Option<MutexGuard<'_, HashMap<u64, Resident>>> {
        let (Some(from), Some(_)) = (self.cells.get(from), self.cells.get(to)) else {
            return None;
        };
        Some(
            from.residents
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }
}

/// Which of connections carrying `loads` (calls/s each) to move so that about half the
/// calls move: the heaviest first, each taken if it brings the moved share nearer half
/// (so idle connections stay, and one connection carrying most of the calls moves alone).
/// With no calls to go by (connections too new to tell), half of them by count.
pub(crate) fn half_by_load(loads: &[f64]) -> Vec<usize> {
    let total: f64 = loads.iter().sum();
    if total <= 0.0 || !total.is_finite() {
        return (0..loads.len() / 2).collect();
    }
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by(|&a, &b| loads[b].total_cmp(&loads[a]));
    let half = total / 2.0;
    let mut moved = 0.0;
    let mut chosen = Vec::new();
    for i in order {
        if (half - (moved + loads[i])).abs() < (half - moved).abs() {
            moved += loads[i];
            chosen.push(i);
        }
    }
    chosen
}

/// A session living on a cell, as the cell's placement sees it.
#[derive(Debug)]
struct Resident {
    /// Cancelled to ask the session to move.
    asked: CancellationToken,
    /// The cell it is asked to move to.
    to: Arc<AtomicUsize>,
    /// The calls its session answered, wherever it ran (added once per round).
    calls: Arc<AtomicU64>,
    /// `calls` and the time when it arrived on this cell.
    arrived: (u64, Instant),
}

impl Resident {
    /// Its calls answered per second since it arrived on this cell.
    fn calls_per_second(&self, now: Instant) -> f64 {
        let (since, at) = self.arrived;
        let calls = self.calls.load(Ordering::Relaxed).saturating_sub(since);
        let secs = now.saturating_duration_since(at).as_secs_f64();
        if secs > 0.0 { calls as f64 / secs } else { 0.0 }
    }

    fn ask(&self, to: usize) {
        self.to.store(to, Ordering::Relaxed);
        self.asked.cancel();
    }
}

/// Counts a cell's client connection out when it ends or moves away, however it ends.
struct Counting(Arc<Cell>);

impl Counting {
    fn on(cell: &Arc<Cell>) -> Counting {
        cell.sessions.fetch_add(1, Ordering::Relaxed);
        Counting(cell.clone())
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        self.0.sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Takes a session's entry off its cell's residents however its stay ends.
struct Residing {
    cell: Arc<Cell>,
    key: u64,
}

impl Residing {
    /// A session whose answered calls `calls` counts arrives on `cell`.
    fn on(
        cell: &Arc<Cell>,
        calls: &Arc<AtomicU64>,
    ) -> (Residing, CancellationToken, Arc<AtomicUsize>) {
        let asked = CancellationToken::new();
        let to = Arc::new(AtomicUsize::new(0));
        let key = cell.next_key.fetch_add(1, Ordering::Relaxed);
        cell.residents
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                key,
                Resident {
                    asked: asked.clone(),
                    to: to.clone(),
                    calls: calls.clone(),
                    arrived: (calls.load(Ordering::Relaxed), Instant::now()),
                },
            );
        (
            Residing {
                cell: cell.clone(),
                key,
            },
            asked,
            to,
        )
    }
}

impl Drop for Residing {
    fn drop(&mut self) {
        self.cell
            .residents
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
    }
}

/// Aborts a session on its cell when its accept-loop task is aborted (the end of the
/// drain).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Cells' threads dropped without [`CellThreads::stop`] (the broker could not start):
/// their runtimes stop, so that no thread is left waiting.
impl Drop for CellThreads {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// How a session arrives on a cell.
enum Arrival {
    /// Just accepted (its TLS handshake, if any, is still to come).
    New(std::net::TcpStream),
    /// Moved from another cell, with its calls in flight.
    Moved(Box<Moving<Session>>, HandedOver),
}

/// How a session's stay on a cell ended.
enum Stay {
    Closed(CloseReason),
    Moves(Box<Moving<Session>>, HandedOver),
}

/// Serves `stream` on the cell that counted it, and on each cell it is moved to;
/// resolves when its session ends.
async fn dealt(
    cells: Arc<Cells>,
    counted: Counting,
    stream: TcpStream,
    peer: SocketAddr,
    via: Via,
    stop: Stop,
) -> CloseReason {
    // Off this runtime's reactor, onto the cell's (it stays non-blocking).
    let Ok(stream) = stream.into_std() else {
        return CloseReason::Error;
    };
    let mut counted = counted;
    let mut arrival = Arrival::New(stream);
    // The calls the connection's session answers, for the placement to split by load.
    let calls = Arc::new(AtomicU64::new(0));
    loop {
        let cell = counted.0.clone();
        let (residing, asked, to) = Residing::on(&cell, &calls);
        let shared = cell.shared.clone();
        let stop = stop.clone();
        let counts_calls = calls.clone();
        let task = cell.handle.spawn(async move {
            let (io, session, resume) = match arrival {
                Arrival::New(stream) => {
                    let Ok(stream) = TcpStream::from_std(stream) else {
                        return Stay::Closed(CloseReason::Error);
                    };
                    match session::open(stream, peer, via, shared.clone()).await {
                        Some((io, mut session)) => {
                            session.count_calls_in(counts_calls);
                            (io, session, Resume::default())
                        }
                        None => return Stay::Closed(CloseReason::TlsHandshake),
                    }
                }
                Arrival::Moved(moving, calls) => {
                    let Moving {
                        io,
                        mut protocol,
                        resume,
                    } = *moving;
                    protocol.join_cell(shared.clone(), calls);
                    match io.attach(shared.activity.clone()) {
                        Ok(io) => (io, protocol, resume),
                        Err(_) => {
                            // Its socket could not be registered here: closed, its
                            // calls in flight counted out as for a caller that left.
                            rpcmesh_common::net::session::Protocol::on_end(&mut protocol);
                            return Stay::Closed(CloseReason::Error);
                        }
                    }
                }
            };
            let allocations = shared.metrics.allocations.clone();
            let served = session::serve_on_cell(io, session, peer, stop, &asked, resume);
            match Counted::new(served, allocations).await {
                Ended::Closed(reason) => Stay::Closed(reason),
                Ended::Moving(mut moving) => {
                    let calls = moving.protocol.leave_cell();
                    Stay::Moves(moving, calls)
                }
            }
        });
        let abort = AbortOnDrop(task.abort_handle());
        // Aborted (the cell stopped under it): this side closed it.
        let stay = task.await;
        drop(abort);
        drop(residing);
        match stay {
            Err(_) => return CloseReason::Local,
            Ok(Stay::Closed(reason)) => return reason,
            Ok(Stay::Moves(moving, calls)) => {
                cells.moves.increment(1);
                let to = to.load(Ordering::Relaxed).min(cells.cells.len() - 1);
                counted = Counting::on(&cells.cells[to]);
                arrival = Arrival::Moved(moving, calls);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_the_calls_move_heaviest_first() {
        // One heavy connection among light ones moves alone; the light ones stay.
        assert_eq!(half_by_load(&[10.0, 900.0, 10.0, 10.0, 10.0]), vec![1]);
        // Even loads: half of them.
        assert_eq!(half_by_load(&[5.0, 5.0, 5.0, 5.0]).len(), 2);
        // Two heavy and two light: one heavy and one light, about half.
        let mut c = half_by_load(&[100.0, 1.0, 100.0, 2.0]);
        c.sort_unstable();
        assert!(c == vec![0, 3] || c == vec![2, 3], "{c:?}");
        // Idle connections never move with a load to go by.
        assert_eq!(half_by_load(&[0.0, 50.0, 0.0, 50.0]).len(), 1);
        // Nothing measured yet: half by count.
        assert_eq!(half_by_load(&[0.0; 6]), vec![0, 1, 2]);
        // One connection with every call: moving it would move the whole load.
        assert!(half_by_load(&[10.0]).is_empty());
        assert!(half_by_load(&[]).is_empty());
    }

    #[test]
    fn a_pool_is_shared_among_cells_rounding_up() {
        assert_eq!(pool_share(4, 1), 4);
        assert_eq!(pool_share(4, 2), 2);
        assert_eq!(pool_share(4, 3), 2);
        assert_eq!(pool_share(4, 16), 1);
        assert_eq!(pool_share(1, 2), 1);
        assert_eq!(pool_share(5, 0), 5);
    }
}
