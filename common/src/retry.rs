//! The retry budget every program that retries draws from (the broker for calls its
//! providers did not run, the driver for calls its targets did not run), as Finagle's
//! `RetryBudget` and tower's `TpsBudget` keep it: every call deposits a share of a retry
//! (`--retry-budget-percent`, 20 %), every retry takes a whole one, deposits last
//! [`RETRY_BUDGET_TTL`] (10 s), and a floor of `--retry-budget-min-per-second` × the TTL
//! is always there. So over any 10 s a program retries at most 20 % of its calls plus 100:
//! an overload that makes calls fail cannot be multiplied by retries.
//!
//! Ten one-second buckets in a ring hold the deposits and withdrawals; the one of the
//! current second takes them, and one that comes round again is emptied first (what it
//! held is older than the TTL). Each bucket is an atomic, and the ring turns when a
//! deposit or a withdrawal sees a new second (lazily: no task, no clock read of its own;
//! callers pass the instant they already have). Callers deposit once per round, for all
//! the calls they made in it. Written here rather than taken from tower: its `TpsBudget`
//! locks a mutex and reads the clock on every deposit, that is on every call, from every
//! thread, and the programs' per-call paths take no shared lock.
//!
//! A leaf: pure (atomics and instants), used by the programs; which failures are safe to
//! retry is each program's own rule (docs/resilience.md).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Retries allowed per call, in percent (`--retry-budget-percent`): Finagle's
/// `RetryBudget` and tower's `TpsBudget` both take 20 %, so that under overload retries
/// add at most a fifth to the load.
pub const DEFAULT_RETRY_PERCENT: u32 = 20;
/// Retries allowed per second whatever the traffic (`--retry-budget-min-per-second`):
/// Finagle's and tower's 10, so that a quiet program can still retry.
pub const DEFAULT_RETRY_MIN_PER_SECOND: u32 = 10;
/// How long a call's deposit in the retry budget lasts: Finagle's and tower's 10 s.
pub const RETRY_BUDGET_TTL: Duration = Duration::from_secs(10);

/// Units of one retry: deposits are in thousandths of one, so that 20 % is 200.
const UNIT: i64 = 1000;
/// Buckets in the ring: one a second over the TTL.
const BUCKETS: usize = 10;

/// One program's retry budget (see the module doc).
#[derive(Debug)]
pub struct RetryBudget {
    /// Deposits less withdrawals, per second, in [`UNIT`]s.
    ring: [AtomicI64; BUCKETS],
    /// The bucket number (since `epoch`, in steps) the ring was last turned to.
    second: AtomicU64,
    /// What one call deposits, in [`UNIT`]s.
    deposit: i64,
    /// What is always there, in [`UNIT`]s: the floor per second × the TTL.
    reserve: i64,
    /// The length of a bucket, in nanoseconds.
    step: u64,
    /// The instant the buckets are counted from.
    epoch: Instant,
}

impl RetryBudget {
    /// `percent` of the calls plus `min_per_second`, deposits lasting `ttl`.
    pub fn new(percent: u32, min_per_second: u32, ttl: Duration) -> Self {
        let step = (ttl.as_nanos() as u64 / BUCKETS as u64).max(1);
        RetryBudget {
            ring: Default::default(),
            second: AtomicU64::new(0),
            deposit: i64::from(percent) * UNIT / 100,
            reserve: i64::from(min_per_second) * UNIT * ttl.as_secs() as i64,
            step,
            epoch: Instant::now(),
        }
    }

    /// The budget the flags give, with the usual TTL.
    pub fn of(percent: u32, min_per_second: u32) -> Self {
        RetryBudget::new(percent, min_per_second, RETRY_BUDGET_TTL)
    }

    /// True when it never grants a retry (no share of the calls and no floor).
    pub fn is_none(&self) -> bool {
        self.deposit == 0 && self.reserve == 0
    }

    /// The bucket of `now`, after emptying those the ring passed since the last turn.
    fn bucket(&self, now: Instant) -> &AtomicI64 {
        let since =
            u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        let second = since / self.step;
        let last = self.second.load(Ordering::Relaxed);
        if second > last
            && self
                .second
                .compare_exchange(last, second, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let passed = (second - last).min(BUCKETS as u64);
            for s in 1..=passed {
                self.ring[((last + s) % BUCKETS as u64) as usize].store(0, Ordering::Relaxed);
            }
        }
        &self.ring[(second.max(last) % BUCKETS as u64) as usize]
    }

    /// `calls` calls were made (at `now`).
    pub fn deposit(&self, calls: usize, now: Instant) {
        if calls > 0 && self.deposit > 0 {
            self.bucket(now)
                .fetch_add(self.deposit * calls as i64, Ordering::Relaxed);
        }
    }

    /// Takes one retry if the budget holds one; false when it is spent.
    pub fn withdraw(&self, now: Instant) -> bool {
        let bucket = self.bucket(now);
        let held: i64 = self.ring.iter().map(|b| b.load(Ordering::Relaxed)).sum();
        if held + self.reserve < UNIT {
            return false;
        }
        bucket.fetch_sub(UNIT, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_a_fifth_of_the_calls_plus_the_floor_and_deposits_expire() {
        let b = RetryBudget::new(20, 10, Duration::from_secs(10));
        let t0 = Instant::now();
        b.deposit(1000, t0);
        let mut taken = 0;
        while b.withdraw(t0) {
            taken += 1;
        }
        assert_eq!(taken, 200 + 100, "20 % of 1,000 calls + 10/s × 10 s");
        // Eleven seconds on, the deposits are gone and the withdrawals with them: the
        // floor is back, and no more.
        let t1 = t0 + Duration::from_secs(11);
        let mut later = 0;
        while b.withdraw(t1) {
            later += 1;
        }
        assert_eq!(later, 100);
    }

    #[test]
    fn no_budget_means_no_retry() {
        let b = RetryBudget::new(0, 0, Duration::from_secs(10));
        assert!(b.is_none());
        b.deposit(1000, Instant::now());
        assert!(!b.withdraw(Instant::now()));
        assert!(!RetryBudget::of(0, 1).is_none());
    }
}
