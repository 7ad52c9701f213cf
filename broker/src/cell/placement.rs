//! Where the client connections of a broker of several cells live: gathered on as few
//! cells as keep up with them, spread over more only when a cell cannot and a trial shows
//! that another one helps.
//!
//! A second cell pays only with a core of its own. On a machine whose cores the callers
//! and providers keep busy, it is one more thread competing with them and it splits each
//! cell's batches in two: on 2 vCPUs, two cells dealt the same connections made 0.74–0.93
//! of one cell's calls/s (docs/performance.md, "Scaling with threads: cells"). Neither the
//! thread count nor the core count tells beforehand which machine this is, so the
//! placement asks the calls: every [`REVIEW`] it reads each open cell's CPU time (its
//! thread's, less the time its spinner polled for nothing) and the calls answered.
//!
//! - **Gathered first.** New connections are dealt among the *open* cells, the first
//!   only at the start (`--cell-placement gather`, the default).
//! - **Trials against a steady load.** A trial is judged against the mean calls/s of the
//!   [`STEADY_REVIEWS`] reviews before it, all within [`STEADY_SPREAD`] of one another (a
//!   load starting or ending is no ground), and over the [`TRIAL_REVIEWS`] reviews after.
//! - **One more cell** is tried when an open cell was busy for at least
//!   [`SPREAD_BUSY_PCT`] per cent of each of the steady reviews: the next cell opens and
//!   connections carrying about half the busiest cell's calls move to it (by each one's
//!   calls/s: a heavy connection counts for many light ones). Kept if it answers over [`SPREAD_GAIN_PCT`] per cent of
//!   the calls before; else they move back and the cell closes.
//! - **One fewer** is tried, with several open and none that busy: the last open cell's
//!   connections move to the others. Kept if it answers at least [`GATHER_KEEP`] of the
//!   calls before (fewer cells cost less: a tie gathers); else they spread again.
//! - An undone trial puts the next off by [`RETRY_FIRST`], twice as long after each
//!   failure up to [`RETRY_MAX`]; a kept one resets the wait.
//! - **Gathered when light**: when the open cells' work would fit in one fewer with room to
//!   spare (all of it under [`GATHER_BELOW_PCT`] per cent of a core per remaining cell, for
//!   [`STEADY_REVIEWS`] reviews running), the last open cell's connections move to the
//!   others and it closes.
//!
//! A connection moves between two of its rounds, its calls in flight with it (their
//! replies reach it through its inbox wherever it runs), unless it is draining or the
//! memory budget pauses it (`rpcmesh_common::net::session::serve_movable`). With
//! `--cell-placement spread` every cell is open from the start and nothing moves: the
//! dealing the broker did before, for machines known to give each cell a core.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rpcmesh_common::net::shutdown::CancellationToken;

use super::Cells;
use crate::config::PlacementTuning;

/// How often the placement looks: long enough that a review's calls are many thousands
/// on a busy broker (a steady rate to compare), short enough that a failed trial costs a
/// fraction of a second.
pub const REVIEW: Duration = Duration::from_millis(500);
/// The per cent of a review an open cell must have been busy to try another: a cell that
/// idles for a sixth of the time keeps up.
pub const SPREAD_BUSY_PCT: u32 = 85;
/// The per cent of the calls of the review before a trial that the trial's review must
/// beat to be kept: more than the review-to-review noise of a steady load on a shared
/// 2-vCPU machine (a few per cent), far less than the gain of a core of its own.
pub const SPREAD_GAIN_PCT: u32 = 110;
/// Below this share of a core per remaining cell, for [`STEADY_REVIEWS`] reviews running,
/// the open cells' work fits in one fewer without a trial: well under the load at which
/// one more cell was worth trying, so that a spread kept is not undone by the next dip.
pub const GATHER_BELOW_PCT: u32 = 30;
/// Reviews of a steady load a trial is judged against (2 s): one review's rate on a
/// shared machine varies by a tenth and more.
pub const STEADY_REVIEWS: usize = 4;
/// How far apart a steady load's reviews may be: the highest at most this times the
/// lowest. A load that changes (a run starting or ending) is no ground for a trial.
pub const STEADY_SPREAD: f64 = 1.25;
/// Reviews a trial runs before it is judged (1 s): the first includes the moves.
pub const TRIAL_REVIEWS: usize = 2;
/// The share of the calls before a trial of one fewer cell that it must keep to be kept.
pub const GATHER_KEEP: f64 = 0.95;
/// The wait before trying again after the first undone trial: a trial of a cell that
/// does not pay costs about a second at nine tenths of the calls, and a first failure
/// is more likely the machine than noise.
pub const RETRY_FIRST: Duration = Duration::from_secs(20);
/// The longest wait between trials: a trial that does not pay then costs about 0.1 % of
/// the calls (a second at nine tenths, once every 160 s), and a machine whose cores
/// free up is still found within three minutes.
pub const RETRY_MAX: Duration = Duration::from_secs(160);

/// What one review saw.
#[derive(Clone, Debug, Default)]
pub(crate) struct Reading {
    pub at: Option<Instant>,
    /// Each cell's thread CPU time less its idle polling, in nanoseconds.
    pub work_ns: Vec<u64>,
    /// Calls answered by all cells.
    pub answered: u64,
}

/// A trial in progress: one more cell (`spread`) or one fewer, and what it is judged
/// against.
#[derive(Debug)]
struct Trial {
    spread: bool,
    /// The calls/s of the steady reviews before it.
    before: f64,
    /// The calls/s of its reviews so far.
    rates: Vec<f64>,
}

/// The placement's state between reviews (the loop engine's workers are placed by it
/// too: `crate::engine`).
#[derive(Debug)]
pub(crate) struct Placement {
    trial: Option<Trial>,
    /// The calls/s of the last reviews since the cells last changed (at most
    /// [`STEADY_REVIEWS`]).
    history: std::collections::VecDeque<f64>,
    /// The wait before the next trial of the same kind, after failures.
    retry: Duration,
    /// No trial before this.
    next_trial: Instant,
    /// Reviews running in which the open cells' work fit in one fewer.
    light_reviews: u32,
    /// Reviews running in which an open cell was busy enough to try one more.
    busy_reviews: usize,
}

/// Runs the placement of `cells` until `stop` is cancelled.
pub async fn run(cells: Arc<Cells>, tuning: PlacementTuning, stop: CancellationToken) {
    let mut last = read(&cells).await;
    let mut state = Placement::new(Instant::now());
    loop {
        tokio::select! {
            () = tokio::time::sleep(tuning.review) => {}
            () = stop.cancelled() => return,
        }
        let now = read(&cells).await;
        review(&cells, &tuning, &mut state, &last, &now);
        last = now;
    }
}

/// Each cell's work so far and the calls answered, read on each cell's own thread.
async fn read(cells: &Cells) -> Reading {
    let mut work_ns = Vec::with_capacity(cells.all().len());
    let mut answered = 0;
    for cell in cells.all() {
        let cpu = cell
            .handle
            .spawn(async { thread_cpu_ns() })
            .await
            .unwrap_or(0);
        let idle = cell.shared.spin_idle_ns.load(Ordering::Relaxed);
        work_ns.push(cpu.saturating_sub(idle));
        answered += cell.shared.answered.load(Ordering::Relaxed);
    }
    Reading {
        at: Some(Instant::now()),
        work_ns,
        answered,
    }
}

/// The CPU time of the thread it runs on.
pub(crate) fn thread_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(t.tv_nsec).unwrap_or(0)
}

/// What one review saw of the open cells, between two readings.
#[derive(Debug)]
pub(crate) struct Seen {
    pub at: Instant,
    /// Calls answered per second by all cells.
    pub rate: f64,
    /// Each open cell's work, in cores.
    pub busy: Vec<f64>,
    /// Each open cell's client connections.
    pub sessions: Vec<usize>,
    /// The cells there are, open or not.
    pub cells: usize,
}

impl Seen {
    /// What a review sees between the readings `before` and `now` of `cells` cells, the
    /// open ones serving `sessions` client connections each; `None` without time between.
    pub(crate) fn between(
        before: &Reading,
        now: &Reading,
        sessions: Vec<usize>,
        cells: usize,
    ) -> Option<Seen> {
        let (Some(t0), Some(t1)) = (before.at, now.at) else {
            return None;
        };
        let wall = (t1 - t0).as_secs_f64();
        if wall <= 0.0 {
            return None;
        }
        Some(Seen {
            at: t1,
            rate: now.answered.saturating_sub(before.answered) as f64 / wall,
            busy: (0..sessions.len())
                .map(|i| {
                    let was = before.work_ns.get(i).copied().unwrap_or(0);
                    let d = now.work_ns.get(i).copied().unwrap_or(0).saturating_sub(was);
                    d as f64 / 1e9 / wall
                })
                .collect(),
            sessions,
            cells,
        })
    }
}

/// What the placement does after a review.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// Nothing moves.
    None,
    /// Open one more cell, moving about half the calls of open cell `from` to it (the
    /// connections that carry them: [`Cells::ask_half_to_move`]).
    Spread { from: usize },
    /// Close the last open cell, moving its connections to the others.
    Gather,
}

/// Acts on one review: the change from `before` to `now`.
fn review(
    cells: &Cells,
    tuning: &PlacementTuning,
    state: &mut Placement,
    before: &Reading,
    now: &Reading,
) {
    let open = cells.open();
    let sessions = (0..open).map(|i| cells.all()[i].sessions()).collect();
    let Some(seen) = Seen::between(before, now, sessions, cells.all().len()) else {
        return;
    };
    match decide(tuning, state, &seen) {
        Change::None => {}
        Change::Spread { from } => {
            cells.set_open(open + 1);
            let moved = cells.ask_half_to_move(from, open);
            tracing::debug!(from, to = open, moved, "cells: connections asked to move");
        }
        Change::Gather => gather(cells, open),
    }
}

/// Decides what one review calls for, and logs it.
pub(crate) fn decide(tuning: &PlacementTuning, state: &mut Placement, seen: &Seen) -> Change {
    let open = seen.busy.len();
    let rate = seen.rate;
    if let Some(mut trial) = state.trial.take() {
        trial.rates.push(rate);
        if trial.rates.len() < TRIAL_REVIEWS {
            state.trial = Some(trial);
            return Change::None;
        }
        return judge(tuning, state, trial, seen);
    }
    let total: f64 = seen.busy.iter().sum();
    let gather_below = f64::from(tuning.gather_below_pct) / 100.0;
    if open > 1 && total < (open - 1) as f64 * gather_below {
        state.light_reviews += 1;
        if state.light_reviews >= STEADY_REVIEWS as u32 {
            state.light_reviews = 0;
            state.history.clear();
            tracing::info!(
                cells = open - 1,
                work = total,
                "cells: gathered onto fewer, the load is light"
            );
            return Change::Gather;
        }
        return Change::None;
    }
    state.light_reviews = 0;
    if state.history.len() == tuning.steady_reviews.max(1) {
        state.history.pop_front();
    }
    state.history.push_back(rate);
    let spread_busy = f64::from(tuning.spread_busy_pct) / 100.0;
    let busiest = seen
        .busy
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, b)| (i, *b));
    if busiest.is_some_and(|(_, b)| b >= spread_busy) {
        state.busy_reviews += 1;
    } else {
        state.busy_reviews = 0;
    }
    let Some(steady) = steady_rate(&state.history, tuning.steady_reviews) else {
        return Change::None;
    };
    if seen.at < state.next_trial {
        return Change::None;
    }
    if let Some((from, b)) = busiest {
        let sessions = seen.sessions[from];
        // Busy through the steady reviews, not in one of them only.
        let busy_through = state.busy_reviews >= tuning.steady_reviews.max(1);
        if busy_through && open < seen.cells && sessions >= 2 {
            tracing::info!(
                cells = open + 1,
                busy = b,
                calls_per_s = steady as u64,
                "cells: trying one more"
            );
            state.start(true, steady);
            return Change::Spread { from };
        }
    }
    if open > 1 && tuning.gather_trials {
        tracing::info!(
            cells = open - 1,
            calls_per_s = steady as u64,
            "cells: trying one fewer"
        );
        state.start(false, steady);
        return Change::Gather;
    }
    Change::None
}

impl Placement {
    pub(crate) fn new(now: Instant) -> Placement {
        Placement {
            trial: None,
            history: std::collections::VecDeque::with_capacity(STEADY_REVIEWS),
            retry: RETRY_FIRST,
            next_trial: now,
            light_reviews: 0,
            busy_reviews: 0,
        }
    }

    fn start(&mut self, spread: bool, before: f64) {
        self.history.clear();
        self.busy_reviews = 0;
        self.trial = Some(Trial {
            spread,
            before,
            rates: Vec::with_capacity(TRIAL_REVIEWS),
        });
    }
}

/// The mean calls/s of `history` when it is `reviews` long and steady (every review
/// within [`STEADY_SPREAD`] of the others, none without calls): a trial is judged against
/// a steady load only. With `reviews` 0, the last review's, whatever it was.
fn steady_rate(history: &std::collections::VecDeque<f64>, reviews: usize) -> Option<f64> {
    if reviews == 0 {
        return history.back().copied();
    }
    if history.len() < reviews {
        return None;
    }
    let min = history.iter().copied().fold(f64::INFINITY, f64::min);
    let max = history.iter().copied().fold(0.0, f64::max);
    (min > 0.0 && max <= min * STEADY_SPREAD)
        .then(|| history.iter().sum::<f64>() / history.len() as f64)
}

/// Keeps or undoes a trial by its calls/s against those before it. One more cell is kept
/// only if it answers [`SPREAD_GAIN_PCT`] per cent of the calls before; one fewer, if it
/// answers at least [`GATHER_KEEP`] of them (fewer cells are cheaper: a tie gathers).
/// An undone trial of either kind puts the next trial off by the retry wait, doubled
/// each time; a kept one resets it, and one more cell kept lets the next be tried at once.
fn judge(tuning: &PlacementTuning, state: &mut Placement, trial: Trial, seen: &Seen) -> Change {
    let rate = trial.rates.iter().sum::<f64>() / trial.rates.len() as f64;
    let open = seen.busy.len();
    let kept = if trial.spread {
        rate > trial.before * f64::from(tuning.spread_gain_pct) / 100.0
    } else {
        rate >= trial.before * GATHER_KEEP
    };
    let (calls_per_s, before) = (rate as u64, trial.before as u64);
    let retry_s = state.retry.as_secs();
    let change = match (trial.spread, kept) {
        (true, true) => {
            tracing::info!(cells = open, calls_per_s, before, "cells: one more kept");
            Change::None
        }
        (false, true) => {
            tracing::info!(cells = open, calls_per_s, before, "cells: one fewer kept");
            Change::None
        }
        (true, false) => {
            tracing::info!(
                cells = open - 1,
                calls_per_s,
                before,
                retry_s,
                "cells: one more did not pay; gathered back"
            );
            Change::Gather
        }
        (false, false) => {
            let from = (0..open).max_by_key(|&i| seen.sessions[i]).unwrap_or(0);
            tracing::info!(
                cells = open + 1,
                calls_per_s,
                before,
                retry_s,
                "cells: one fewer answered fewer calls; spread again"
            );
            Change::Spread { from }
        }
    };
    if kept {
        state.retry = RETRY_FIRST;
    }
    // One more cell that paid: the next may be tried as soon as the load is steady again
    // (a broker that needs many cells climbs one per trial).
    state.next_trial = if kept && trial.spread {
        seen.at
    } else {
        seen.at + state.retry
    };
    if !kept {
        state.retry = (state.retry * 2).min(RETRY_MAX);
    }
    change
}

/// Closes the last open cell: its connections move to the other open cells, spread by
/// how many each serves.
fn gather(cells: &Cells, open: usize) {
    if open < 2 {
        return;
    }
    let last = open - 1;
    cells.set_open(last);
    let mut left = cells.all()[last].sessions();
    // Dealt to the remaining cells in turn, the least loaded first.
    let mut order: Vec<usize> = (0..last).collect();
    order.sort_by_key(|&i| cells.all()[i].sessions());
    let share = left.div_ceil(last);
    for to in order {
        if left == 0 {
            break;
        }
        left -= cells.ask_to_move(last, to, share.min(left));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(rates: &[f64]) -> std::collections::VecDeque<f64> {
        rates.iter().copied().collect()
    }

    #[test]
    fn a_trial_is_judged_against_a_steady_load_only() {
        let n = STEADY_REVIEWS;
        let steady = history(&vec![100.0; n]);
        assert_eq!(steady_rate(&steady, n), Some(100.0));
        assert_eq!(
            steady_rate(&history(&vec![100.0; n - 1]), n),
            None,
            "too short"
        );
        let mut rising = vec![100.0; n];
        rising[n - 1] = 100.0 * STEADY_SPREAD * 1.01;
        assert_eq!(
            steady_rate(&history(&rising), n),
            None,
            "a load that changes"
        );
        let mut idle = vec![100.0; n];
        idle[0] = 0.0;
        assert_eq!(
            steady_rate(&history(&idle), n),
            None,
            "a review without calls"
        );
        let mut noisy = vec![100.0; n];
        noisy[1] = 120.0;
        let mean = steady_rate(&history(&noisy), n).unwrap();
        assert!((mean - (100.0 * (n - 1) as f64 + 120.0) / n as f64).abs() < 1e-9);
        assert_eq!(
            steady_rate(&history(&[0.0]), 0),
            Some(0.0),
            "tuned off: the last"
        );
    }

    /// The placement's decisions over a run of reviews 500 ms apart, from `t0`.
    struct Run {
        tuning: PlacementTuning,
        state: Placement,
        at: Instant,
    }

    impl Run {
        fn new() -> Run {
            let at = Instant::now();
            Run {
                tuning: PlacementTuning::default(),
                state: Placement::new(at),
                at,
            }
        }

        /// One review of `open` cells of 2, each `busy` with 8 connections, at `rate`.
        fn review(&mut self, open: usize, busy: f64, rate: f64) -> Change {
            self.at += REVIEW;
            let seen = Seen {
                at: self.at,
                rate,
                busy: vec![busy; open],
                sessions: vec![8; open],
                cells: 2,
            };
            decide(&self.tuning, &mut self.state, &seen)
        }

        /// Reviews until one changes something (at most `n`); the change and the reviews
        /// it took.
        fn until_change(&mut self, n: usize, open: usize, busy: f64, rate: f64) -> (Change, usize) {
            for k in 1..=n {
                let c = self.review(open, busy, rate);
                if c != Change::None {
                    return (c, k);
                }
            }
            (Change::None, n)
        }
    }

    #[test]
    fn a_busy_steady_cell_tries_one_more_and_an_unpaid_trial_is_undone_and_put_off() {
        let mut run = Run::new();
        let (c, k) = run.until_change(20, 1, 0.9, 400_000.0);
        assert_eq!(c, Change::Spread { from: 0 });
        assert_eq!(k, STEADY_REVIEWS, "tried after the steady reviews");
        // No more calls with two cells: undone after the trial's reviews.
        let (c, k) = run.until_change(10, 2, 0.6, 420_000.0);
        assert_eq!((c, k), (Change::Gather, TRIAL_REVIEWS));
        // The next trial waits RETRY_FIRST, the one after twice that.
        let (c, k) = run.until_change(200, 1, 0.9, 400_000.0);
        assert_eq!(c, Change::Spread { from: 0 });
        assert_eq!(k as u32, RETRY_FIRST.div_duration_f64(REVIEW) as u32);
        run.until_change(10, 2, 0.6, 400_000.0);
        let (_, k) = run.until_change(400, 1, 0.9, 400_000.0);
        assert_eq!(k as u32, (2 * RETRY_FIRST).div_duration_f64(REVIEW) as u32);
    }

    #[test]
    fn a_cell_that_is_not_busy_or_a_load_that_is_not_steady_tries_nothing() {
        let mut run = Run::new();
        assert_eq!(run.until_change(40, 1, 0.8, 400_000.0).0, Change::None);
        let mut run = Run::new();
        for k in 0..40 {
            // A load that swings by half from one review to the next.
            let rate = if k % 2 == 0 { 200_000.0 } else { 400_000.0 };
            assert_eq!(run.review(1, 0.95, rate), Change::None);
        }
    }

    #[test]
    fn a_paying_cell_is_kept_then_one_fewer_is_tried_and_undone_if_it_costs() {
        let mut run = Run::new();
        run.until_change(20, 1, 0.95, 300_000.0);
        // Two cells answer half as many again: kept, nothing moves.
        let (c, k) = run.until_change(2, 2, 0.8, 450_000.0);
        assert_eq!((c, k), (Change::None, 2));
        assert_eq!(run.state.retry, RETRY_FIRST);
        // Steady again, no cell busy enough for a third (there is none): one fewer.
        let (c, k) = run.until_change(20, 2, 0.8, 450_000.0);
        assert_eq!((c, k), (Change::Gather, STEADY_REVIEWS));
        // One cell answers fewer: spread again, half of its calls.
        let (c, _) = run.until_change(10, 1, 0.95, 300_000.0);
        assert_eq!(c, Change::Spread { from: 0 });
    }

    #[test]
    fn a_light_load_is_gathered_without_a_trial() {
        let mut run = Run::new();
        let (c, k) = run.until_change(10, 2, 0.1, 1_000.0);
        assert_eq!((c, k), (Change::Gather, STEADY_REVIEWS));
        assert!(run.state.trial.is_none());
    }

    #[test]
    fn thread_cpu_time_grows_with_work() {
        let a = thread_cpu_ns();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(thread_cpu_ns() > a);
    }
}
