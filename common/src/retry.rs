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
//! Which calls are idempotent ([`Idempotent`], `--idempotent`): those the configuration
//! says may run twice without harm, so that a call lost in flight (its connection lost
//! after it was written) may be sent again too. Written as the authorization policy's
//! calls are (`Service.Method`, `Service.*`, `*`; [`crate::authz`]).
//!
//! Pure (atomics, instants and names), used by the programs; which failures are safe to
//! retry is each program's own rule (docs/resilience.md).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::authz::{Pattern, call_pattern_problem};

/// Retries allowed per call, in percent (`--retry-budget-percent`): Finagle's
/// `RetryBudget` and tower's `TpsBudget` both take 20 %, so that under overload retries
/// add at most a fifth to the load.
pub const DEFAULT_RETRY_PERCENT: u32 = 20;
/// Retries allowed per second whatever the traffic (`--retry-budget-min-per-second`):
/// Finagle's and tower's 10, so that a quiet program can still retry.
pub const DEFAULT_RETRY_MIN_PER_SECOND: u32 = 10;
/// How long a call's deposit in the retry budget lasts: Finagle's and tower's 10 s.
pub const RETRY_BUDGET_TTL: Duration = Duration::from_secs(10);

/// Why a call was sent again (the `reason` of `rpcmesh_calls_rerouted_total` and
/// `rpcmesh_retry_budget_exhausted_total`, the keys of the driver's report): each a
/// failure after which the call is known not to have run, but [`RetryReason::Lost`],
/// which only idempotent calls are retried for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryReason {
    /// Its connection closed before it was written.
    Unsent,
    /// A draining server refused it without running it (`NOT_RUN`).
    NotRun,
    /// The server answered "overloaded": it shed the call without running it.
    Overloaded,
    /// Its connection was lost after it was written (it may have run): idempotent calls
    /// only.
    Lost,
}

impl RetryReason {
    /// How many reasons there are: the size of a table indexed by `reason as usize`.
    pub const COUNT: usize = 4;
    /// Every reason, in the order of their indexes.
    pub const ALL: [RetryReason; Self::COUNT] = [
        RetryReason::Unsent,
        RetryReason::NotRun,
        RetryReason::Overloaded,
        RetryReason::Lost,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            RetryReason::Unsent => "unsent",
            RetryReason::NotRun => "not_run",
            RetryReason::Overloaded => "overloaded",
            RetryReason::Lost => "lost",
        }
    }
}

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

/// The calls marked idempotent: retried when lost in flight (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Idempotent(Vec<Pattern>);

impl Idempotent {
    /// The calls `patterns` name (`Service.Method`, `Service.*`, `*`); the first pattern
    /// that is none of those is the error, with what is wrong with it.
    pub fn parse<S: AsRef<str>>(patterns: &[S]) -> Result<Self, String> {
        let mut out = Vec::with_capacity(patterns.len());
        for p in patterns {
            let p = p.as_ref().trim();
            if let Some(problem) = call_pattern_problem(p) {
                return Err(problem);
            }
            out.push(Pattern::new(p));
        }
        Ok(Idempotent(out))
    }

    /// True when no call is marked.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether calls of `service`'s `method` are marked idempotent.
    pub fn covers(&self, service: &str, method: &str) -> bool {
        self.0.iter().any(|p| p.matches_call(service, method))
    }

    /// [`Idempotent::covers`] of names as the wire carries them (bytes that are not UTF-8
    /// name nothing marked).
    pub fn covers_bytes(&self, service: &[u8], method: &[u8]) -> bool {
        !self.is_empty()
            && matches!(
                (std::str::from_utf8(service), std::str::from_utf8(method)),
                (Ok(s), Ok(m)) if self.covers(s, m)
            )
    }

    /// The calls either marks.
    pub fn and(&self, other: &Idempotent) -> Idempotent {
        Idempotent(self.0.iter().chain(&other.0).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_in_their_index_order() {
        for (i, r) in RetryReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{}", r.label());
        }
    }

    #[test]
    fn idempotent_calls_are_named_as_the_policy_names_them() {
        let i = Idempotent::parse(&["EchoService.*", "platform.PlatformService.doQuery"]).unwrap();
        assert!(i.covers("EchoService", "Echo"));
        assert!(i.covers("platform.PlatformService", "doQuery"));
        assert!(!i.covers("platform.PlatformService", "doUpdate"));
        assert!(!i.covers("EchoServiceX", "Echo"));
        assert!(i.covers_bytes(b"EchoService", b"Echo"));
        assert!(!i.covers_bytes(b"EchoService", b"\xff"));
        assert!(!Idempotent::default().covers("EchoService", "Echo"));
        assert!(Idempotent::parse(&["*"]).unwrap().covers("A", "b"));
        let e = Idempotent::parse(&["EchoService"]).unwrap_err();
        assert!(e.contains("not Service.Method"), "{e}");
        let both = Idempotent::parse(&["A.x"])
            .unwrap()
            .and(&Idempotent::parse(&["B.*"]).unwrap());
        assert!(both.covers("A", "x") && both.covers("B", "y") && !both.covers("A", "y"));
    }

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
