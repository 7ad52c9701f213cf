//! The retry budget, as Finagle's `RetryBudget` and tower's `TpsBudget` keep it: every
//! call deposits a share of a retry (`--retry-budget-percent`, 20 %), every retry takes a
//! whole one, deposits last [`RETRY_BUDGET_TTL`](super::RETRY_BUDGET_TTL) (10 s), and a
//! floor of `--retry-budget-min-per-second` × the TTL is always there. So over any 10 s
//! the broker retries at most 20 % of its calls plus 100: an overload that makes calls
//! fail cannot be multiplied by retries.
//!
//! Ten one-second buckets in a ring hold the deposits and withdrawals; the one of the
//! current second takes them, and one that comes round again is emptied first (what it
//! held is older than the TTL). Each bucket is an atomic, and the ring turns when a
//! deposit or a withdrawal sees a new second (lazily: no task, no clock read of its own;
//! sessions pass the instant of their read). Sessions deposit once per round, for all the
//! calls they admitted in it. Written here rather than taken from tower: its `TpsBudget`
//! locks a mutex and reads the clock on every deposit, that is on every call, from every
//! session thread, and the broker's per-call path takes no shared lock.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::nanos;

/// Units of one retry: deposits are in thousandths of one, so that 20 % is 200.
const UNIT: i64 = 1000;
/// Buckets in the ring: one a second over the TTL.
const BUCKETS: usize = 10;

/// One broker's retry budget (see the module doc).
#[derive(Debug)]
pub(crate) struct RetryBudget {
    /// Deposits less withdrawals, per second, in [`UNIT`]s.
    ring: [AtomicI64; BUCKETS],
    /// The second the ring was last turned to (since `super::nanos`'s epoch).
    second: AtomicU64,
    /// What a call deposits.
    deposit: i64,
    /// What is always there: the floor per second × the TTL.
    reserve: i64,
    /// The length of a bucket, in nanoseconds.
    step: u64,
}

impl RetryBudget {
    /// `percent` of the calls plus `min_per_second`, deposits lasting `ttl`.
    pub fn new(percent: u32, min_per_second: u32, ttl: Duration) -> Self {
        let step = (ttl.as_nanos() as u64 / BUCKETS as u64).max(1);
        RetryBudget {
            ring: Default::default(),
            second: AtomicU64::new(nanos(Instant::now()) / step),
            deposit: i64::from(percent) * UNIT / 100,
            reserve: i64::from(min_per_second) * UNIT * ttl.as_secs() as i64,
            step,
        }
    }

    /// The bucket of `now`, after emptying those the ring passed since the last turn.
    fn bucket(&self, now: Instant) -> &AtomicI64 {
        let second = nanos(now) / self.step;
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

    /// `calls` calls were admitted (at `now`).
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
        b.deposit(1000, Instant::now());
        assert!(!b.withdraw(Instant::now()));
    }
}
