//! One memory budget per process for the bytes it buffers: partial frames and unread
//! frames in read buffers, write backlogs, and (in the broker) large requests queued
//! toward providers. Every holder reports what it holds; the budget says how close the
//! process is to its limit, and wakes paused readers when it falls back.
//!
//! What the sessions do with it (`crate::net::session`): past [`HIGH_SHARE`] of the limit
//! (half), the programs answer new calls whose body is [`SMALL_BODY`] or larger
//! "overloaded"; past [`PAUSE_SHARE`] (three quarters), a connection that holds
//! [`PAUSE_FLOOR`] or more stops reading until the budget falls below that mark again;
//! past the limit itself, so does every connection that holds more than its
//! [`CONNECTION_BASE`] (many callers each sending frames under the pause floor would
//! otherwise take the process past its limit together). The calls and connections that
//! hold the most are refused or wait, small callers go on. Buffers grow only as bytes
//! arrive (the frame codec never reserves on a header's claim), so what is held is what
//! was sent; and under pressure an emptied buffer gives its room back at once.
//!
//! Every connection counts [`CONNECTION_BASE`] from the moment it exists, what any
//! connection costs (its first buffers, its session, its task); beyond it holders report
//! in steps of [`GRANULE`]: a connection with small calls never touches the shared counter
//! again, and the budget is exact to a granule per holder.
//!
//! A paused connection is not excused for ever: the budget keeps what each paused holder
//! holds, so that a paused connection can ask whether it is one of those *holding* the
//! budget ([`MemoryBudget::is_holding`]): the paused holders are, when without what they
//! hold the budget would be back under the pause mark. Such a connection's frame clock
//! runs while it waits, and its frame timeout closes it (as Envoy's overload manager
//! resets the streams that hold its buffers): a hundred callers that each send part of a
//! large frame and stop cannot keep one another paused, and the budget spent, until the
//! process restarts; they are closed within one frame timeout. A connection paused by
//! what others hold (calls in flight, other callers' backlogs) is still not timed out for
//! it.
//!
//! Nor can holders that keep their bytes without stopping, such as callers that read
//! their replies a byte at a time (no write timeout fires while they take some) or send
//! large frames without end: when the budget stays past its high mark, where large calls
//! are refused, for [`SHED_AFTER`], the largest holder is closed, then the next, each
//! as it looks ([`SHED_CHECK`]), until the budget is back under the mark (as Envoy's
//! overload manager resets the streams that hold the most). A connection closed so gives
//! its buffers back at once, without the final flush of other closes: its backlog is what
//! was shed, and a second spent flushing it to a caller that does not read would keep the
//! budget past the mark, and so close the next holder too. Only connections holding
//! [`PAUSE_FLOOR`] or more are candidates: callers of small calls never are.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The budget unless told otherwise: 512 MiB. The buffered bytes of small-call traffic are
/// a few MiB (the reference workload at 200 users holds under 10 MiB in the broker), so
/// this is reached only by large frames or callers that stop reading; it fits beside the
/// kernel's socket buffers on a 2 GiB VM, on which a broker without a budget can grow to
/// 2.8 GiB and abort.
pub const DEFAULT_MEMORY_BUDGET: usize = 512 << 20;
/// What a process's resident memory may exceed its budget by, whatever it is sent: the
/// program itself (about 15 MiB for a debug build of the broker), its runtime, threads and
/// metrics, and what the budget does not count: the allocator's slack, and the moment a
/// growing buffer is copied into one twice as large (both live then), and the pages of
/// freed buffers the allocator keeps (a thousand connections' buffers coming and going in
/// one heap). Measured: 49-78 MiB over a 32 MiB budget under a thousand callers
/// pipelining 128 KiB calls (`system-tests/tests/bounds.rs`, which holds the flood to it);
/// 96 MiB leaves a loaded machine's scheduling its margin.
pub const RSS_OVERHEAD: usize = 96 << 20;
/// The smallest budget accepted: a few large frames' worth.
pub const MIN_MEMORY_BUDGET: usize = 16 << 20;

/// The share of the limit past which large new calls are answered "overloaded": half, so
/// that what is already in flight then (replies to calls admitted, buffers doubling as
/// they grow) fits in the other half. Pausing readers at three quarters is not enough on
/// its own: without refusals, two 1 MiB-frame flooders take a 64 MiB broker to 72 MiB.
pub const HIGH_SHARE: f64 = 0.5;
/// Bytes a connection must hold before it is paused under pressure: four read chunks,
/// well above what a caller of small calls ever holds, well below a large-frame flooder.
pub const PAUSE_FLOOR: usize = 256 * 1024;
/// The share of the limit past which a connection holding [`PAUSE_FLOOR`] or more stops
/// reading: three quarters. Large calls are refused from half on, so what is still growing
/// past this is partial frames and replies to calls admitted before; pausing their readers
/// keeps it within the last quarter.
pub const PAUSE_SHARE: f64 = 0.75;
/// Bodies this large or larger are answered "overloaded" past the high mark; the smaller
/// calls of well-behaved callers cost the budget little and go on.
pub const SMALL_BODY: usize = 4096;
/// How much a holder's bytes must change before it tells the budget.
pub const GRANULE: usize = 16 * 1024;
/// How long the budget may stay past its high mark (large calls refused) before the
/// largest holder is closed: the frame timeout's default, so that the timeouts of holders
/// that stopped (a frame left unfinished, a backlog nobody reads) act first, and what is
/// still past the mark after that is held by peers that keep it on purpose or cannot be
/// served anyway. A burst of large calls lives well under it.
pub const SHED_AFTER: Duration = Duration::from_secs(10);
/// How often a connection holding [`PAUSE_FLOOR`] or more looks whether it is the one to
/// close: a second, a small part of [`SHED_AFTER`], and only for the few large holders.
pub const SHED_CHECK: Duration = Duration::from_secs(1);
/// What every holder (a connection) counts from the start: a granule, about what a
/// connection costs before it holds anything (its 4 KiB read buffer, its write buffer,
/// its session and task; measured: 14 KiB of resident memory each for 1,000 connections),
/// and what a holder of small calls never outgrows. Counted, so that connections do not
/// hold memory the budget does not see: 10,000 of them take 160 MiB.
pub const CONNECTION_BASE: usize = GRANULE;

/// The buffered bytes of one process against their limit.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    high: usize,
    pause: usize,
    used: AtomicUsize,
    relieved: Notify,
    /// What each paused holder holds, by ticket (only connections that wait for the
    /// budget are here, so it is empty but under pressure), and what each holder of
    /// [`PAUSE_FLOOR`] or more holds.
    holders: Mutex<Holders>,
    next_ticket: AtomicU64,
    /// The instant the nanoseconds below count from.
    epoch: Instant,
    /// Since when (nanoseconds from `epoch`, plus one) the budget has been past its high
    /// mark, as first seen by a large holder's look; 0 while it is not.
    over_since: AtomicU64,
}

/// The paused holders and their sum; the large holders.
#[derive(Debug, Default)]
struct Holders {
    paused: HashMap<u64, usize>,
    sum: usize,
    large: HashMap<u64, usize>,
}

/// How close the process is to its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pressure {
    /// Under [`HIGH_SHARE`] of the limit.
    Normal,
    /// Past it: large new calls are answered "overloaded" (and past [`PAUSE_SHARE`] the
    /// largest holders stop reading).
    High,
    /// At or over the limit (what was in flight when the mark was passed overshot it).
    Spent,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            limit,
            high: (limit as f64 * HIGH_SHARE) as usize,
            pause: (limit as f64 * PAUSE_SHARE) as usize,
            used: AtomicUsize::new(0),
            relieved: Notify::new(),
            holders: Mutex::default(),
            next_ticket: AtomicU64::new(0),
            epoch: Instant::now(),
            over_since: AtomicU64::new(0),
        })
    }

    fn holders(&self) -> std::sync::MutexGuard<'_, Holders> {
        // Every update under the lock is a few words, done whole.
        self.holders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records that the holder of `ticket` waits for the budget, holding `n` bytes (again
    /// each round while it waits: what it holds may shrink as its backlog is written).
    fn set_paused(&self, ticket: u64, n: usize) {
        let mut p = self.holders();
        let before = p.paused.insert(ticket, n).unwrap_or(0);
        p.sum = p.sum + n - before;
    }

    /// The holder of `ticket` reads again (or is gone).
    fn unset_paused(&self, ticket: u64) {
        let mut p = self.holders();
        if let Some(n) = p.paused.remove(&ticket) {
            p.sum -= n;
        }
    }

    /// Records what the holder of `ticket` holds when it is [`PAUSE_FLOOR`] or more
    /// (`None`: it holds less, or is gone).
    fn set_large(&self, ticket: u64, n: Option<usize>) {
        let mut h = self.holders();
        match n {
            Some(n) => h.large.insert(ticket, n),
            None => h.large.remove(&ticket),
        };
    }

    /// How many holders wait for the budget now.
    pub fn paused_holders(&self) -> usize {
        self.holders().paused.len()
    }

    /// True when the large holder of `ticket` is to be closed now: the budget has been past
    /// its high mark for [`SHED_AFTER`] and it holds the most (of equal holders, the
    /// oldest). It is then no longer a candidate, so that the next look closes the next
    /// largest while the budget stays past the mark.
    pub fn sheds(&self, ticket: u64) -> bool {
        self.sheds_at(ticket, self.epoch.elapsed().as_nanos() as u64 + 1)
    }

    /// [`MemoryBudget::sheds`] at `now`, nanoseconds from `epoch` plus one.
    fn sheds_at(&self, ticket: u64, now: u64) -> bool {
        if self.used() < self.high {
            self.over_since.store(0, Ordering::Relaxed);
            return false;
        }
        let since =
            match self
                .over_since
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => now,
                Err(since) => since,
            };
        if now - since < SHED_AFTER.as_nanos() as u64 {
            return false;
        }
        let mut h = self.holders();
        let largest = h
            .large
            .iter()
            .max_by_key(|&(t, n)| (*n, std::cmp::Reverse(*t)))
            .map(|(t, _)| *t);
        if largest != Some(ticket) {
            return false;
        }
        h.large.remove(&ticket);
        true
    }

    /// True when the paused holder of `ticket` is one of those holding the budget: the
    /// budget is past its pause mark and what the paused holders hold together is why
    /// (without it the budget would be under the mark). Then the time each of them waits
    /// is its own: the callers that stopped mid-frame cannot keep one another paused.
    /// When others hold the budget (calls in flight, backlogs being written), a paused
    /// holder waits for them, excused.
    pub fn is_holding(&self, ticket: u64) -> bool {
        let used = self.used();
        if used < self.pause {
            return false;
        }
        let p = self.holders();
        p.paused.contains_key(&ticket) && used.saturating_sub(p.sum) < self.pause
    }

    /// The limit, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now (to a granule per holder).
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The pressure now.
    pub fn pressure(&self) -> Pressure {
        let used = self.used();
        if used >= self.limit {
            Pressure::Spent
        } else if used >= self.high {
            Pressure::High
        } else {
            Pressure::Normal
        }
    }

    /// True when a connection holding `held` bytes should stop reading now: past the
    /// pause mark, if it holds [`PAUSE_FLOOR`] or more.
    pub fn should_pause(&self, held: usize) -> bool {
        held >= PAUSE_FLOOR && self.used() >= self.pause
    }

    /// True when `more` bytes still fit under the limit: a connection whose read buffer
    /// must grow before it can read (by doubling, or by a read chunk) reads only if the
    /// growth fits, and waits otherwise. A buffer's growth is told to the budget as it
    /// happens, so that many connections growing together cannot take the process past
    /// its limit: each sees the room the others took already.
    pub fn fits(&self, more: usize) -> bool {
        self.used().saturating_add(more) <= self.limit
    }

    /// True when a new call with a body of `len` bytes is to be answered "overloaded": it
    /// is large and what the others hold is past the high mark. Its own bytes, in its read
    /// buffer already, do not count: a call past the mark by its own size alone would
    /// refuse itself, and with the others holding just under the mark (where no holder is
    /// shed) every large call would be refused for as long as they held it.
    pub fn refuses(&self, len: usize) -> bool {
        len >= SMALL_BODY && self.used().saturating_sub(len) >= self.high
    }

    /// Resolves once the budget is back under the pause mark (at once if it is).
    pub async fn relieved(&self) {
        loop {
            let notified = self.relieved.notified();
            if self.used() < self.pause {
                return;
            }
            notified.await;
        }
    }

    /// Adds `n` held bytes.
    pub fn add(&self, n: usize) {
        self.used.fetch_add(n, Ordering::Relaxed);
    }

    /// Releases `n` held bytes; wakes paused readers if that brought the budget under the
    /// pause mark.
    pub fn release(&self, n: usize) {
        let before = self.used.fetch_sub(n, Ordering::Relaxed);
        if before >= self.high && before - n < self.high {
            self.over_since.store(0, Ordering::Relaxed);
        }
        if before >= self.pause && before - n < self.pause {
            self.relieved.notify_waiters();
        }
    }
}

/// Bytes held by one item on its way (a large request queued toward a provider), released
/// when it is dropped.
#[derive(Debug)]
pub struct Reserved {
    budget: Arc<MemoryBudget>,
    n: usize,
}

impl Reserved {
    /// Counts `n` bytes against `budget` until dropped.
    pub fn new(budget: &Arc<MemoryBudget>, n: usize) -> Self {
        budget.add(n);
        Reserved {
            budget: budget.clone(),
            n,
        }
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.budget.release(self.n);
    }
}

/// What one holder (a connection's buffers) has told the budget; released when dropped.
#[derive(Debug)]
pub struct Held {
    budget: Arc<MemoryBudget>,
    told: usize,
    /// Its number among the budget's paused and large holders.
    ticket: u64,
    /// True while it waits for the budget.
    paused: bool,
    /// True while it holds [`PAUSE_FLOOR`] or more (as last told).
    large: bool,
}

impl Held {
    /// A holder of nothing yet, counting its [`CONNECTION_BASE`].
    pub fn new(budget: Arc<MemoryBudget>) -> Self {
        budget.add(CONNECTION_BASE);
        let ticket = budget.next_ticket.fetch_add(1, Ordering::Relaxed);
        Held {
            budget,
            told: CONNECTION_BASE,
            ticket,
            paused: false,
            large: false,
        }
    }

    /// Says whether the holder waits for the budget now (it holds `now` bytes).
    pub fn set_waiting(&mut self, waiting: bool, now: usize) {
        if waiting {
            self.budget.set_paused(self.ticket, now);
        } else if self.paused {
            self.budget.unset_paused(self.ticket);
        }
        self.paused = waiting;
    }

    /// True while it waits for the budget and is one of those holding it
    /// ([`MemoryBudget::is_holding`]).
    pub fn is_holding(&self) -> bool {
        self.paused && self.budget.is_holding(self.ticket)
    }

    /// True while it waits for the budget.
    pub fn is_waiting(&self) -> bool {
        self.paused
    }

    /// True while it holds [`PAUSE_FLOOR`] or more: it looks every [`SHED_CHECK`] whether
    /// it is to be closed ([`Held::sheds`]).
    pub fn is_large(&self) -> bool {
        self.large
    }

    /// True when this holder is to be closed to bring the budget back under its high mark
    /// ([`MemoryBudget::sheds`]).
    pub fn sheds(&self) -> bool {
        self.large && self.budget.sheds(self.ticket)
    }

    /// The budget this holder reports to.
    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }

    /// The holder holds `now` bytes (counted as its [`CONNECTION_BASE`] at least): the
    /// budget hears of it when that differs from what it was told by a granule or more,
    /// or falls back to the base.
    pub fn set(&mut self, now: usize) {
        let now = now.max(CONNECTION_BASE);
        if now == self.told || (now.abs_diff(self.told) < GRANULE && now != CONNECTION_BASE) {
            return;
        }
        if now > self.told {
            self.budget.add(now - self.told);
        } else {
            self.budget.release(self.told - now);
        }
        self.told = now;
        let large = now >= PAUSE_FLOOR;
        if large || self.large {
            self.budget.set_large(self.ticket, large.then_some(now));
            self.large = large;
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.set_waiting(false, 0);
        if self.large {
            self.budget.set_large(self.ticket, None);
        }
        self.budget.release(self.told);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_count_their_base_report_in_granules_and_release_when_dropped() {
        let b = MemoryBudget::new(1 << 20);
        let mut h = Held::new(b.clone());
        assert_eq!(
            b.used(),
            CONNECTION_BASE,
            "a connection counts its base at once"
        );
        h.set(100);
        assert_eq!(b.used(), CONNECTION_BASE, "within its base: not told");
        h.set(2 * GRANULE + 100);
        assert_eq!(b.used(), 2 * GRANULE + 100);
        h.set(100);
        assert_eq!(b.used(), CONNECTION_BASE, "back to the base is always told");
        h.set(300 * 1024);
        drop(h);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_buffer_grows_only_while_its_growth_fits_under_the_limit() {
        let b = MemoryBudget::new(1 << 20);
        let mut flood: Vec<Held> = (0..8).map(|_| Held::new(b.clone())).collect();
        for h in &mut flood {
            h.set(112 * 1024);
        }
        // 896 KiB: under the pause floor, each reads what its room takes; a chunk of
        // 64 KiB more fits, a doubling of one of them past 128 KiB does not.
        assert!(!b.should_pause(112 * 1024));
        assert!(b.fits(64 * 1024));
        assert!(!b.fits(128 * 1024 + 1));
    }

    #[test]
    fn a_large_call_is_not_refused_for_its_own_bytes() {
        let b = MemoryBudget::new(1 << 20);
        let mut others = Held::new(b.clone());
        others.set((512 - 64) * 1024);
        // The call's 256 KiB read: the budget is past its mark (512 KiB) by them alone.
        let mut own = Held::new(b.clone());
        own.set(256 * 1024);
        assert_eq!(b.pressure(), Pressure::High);
        assert!(!b.refuses(256 * 1024), "refused for its own bytes");
        others.set(512 * 1024);
        assert!(b.refuses(256 * 1024), "the others past the mark refuse it");
    }

    #[test]
    fn past_half_large_calls_are_refused_past_three_quarters_large_holders_pause() {
        let b = MemoryBudget::new(1 << 20);
        let mut big = Held::new(b.clone());
        big.set(600 * 1024);
        assert_eq!(b.pressure(), Pressure::High);
        assert!(
            !b.should_pause(PAUSE_FLOOR),
            "under the pause mark, all read"
        );
        assert!(b.refuses(SMALL_BODY), "a large call is refused");
        big.set(800 * 1024);
        assert!(b.should_pause(PAUSE_FLOOR), "a large holder waits");
        assert!(!b.should_pause(64 * 1024), "a small one goes on");
        assert!(b.refuses(SMALL_BODY), "a large call is refused");
        assert!(!b.refuses(100), "small calls still pass");
        big.set(1 << 20);
        assert_eq!(b.pressure(), Pressure::Spent);
        assert!(!b.refuses(100), "small calls pass even then");
        big.set(100 * 1024);
        assert_eq!(b.pressure(), Pressure::Normal);
        assert!(!b.refuses(1 << 20), "under the mark a large call passes");
    }

    #[test]
    fn paused_holders_hold_the_budget_unless_others_do() {
        let b = MemoryBudget::new(1 << 20);
        let mut holders: Vec<Held> = (0..4).map(|_| Held::new(b.clone())).collect();
        // 4 × 240 KiB = 960 KiB, past the 768 KiB mark, and all of it theirs.
        for h in &mut holders {
            h.set(240 * 1024);
            h.set_waiting(true, 240 * 1024);
        }
        assert!(holders.iter().all(Held::is_holding));
        holders[3].set_waiting(false, 240 * 1024);
        assert!(!holders[3].is_holding(), "reading again: not paused");
        // Others hold the budget past the mark: no paused holder is to blame.
        let other = Reserved::new(&b, 800 * 1024);
        assert!(holders.iter().all(|h| !h.is_holding()));
        drop(other);
        holders.truncate(1);
        assert!(!holders[0].is_holding(), "under the mark");
        drop(holders);
        assert_eq!(b.used(), 0);
        assert_eq!(b.paused_holders(), 0);
    }

    #[test]
    fn past_the_high_mark_for_long_the_largest_holders_are_closed_one_by_one() {
        let b = MemoryBudget::new(1 << 20);
        let mut small = Held::new(b.clone());
        small.set(200 * 1024);
        let mut big: Vec<Held> = (0..2).map(|_| Held::new(b.clone())).collect();
        big[0].set(300 * 1024);
        big[1].set(320 * 1024);
        assert_eq!(b.pressure(), Pressure::High);
        assert!(!small.is_large() && big.iter().all(Held::is_large));
        assert!(!big[1].sheds(), "past the mark only just now");
        // SHED_AFTER after the first look.
        let later = b.over_since.load(Ordering::Relaxed) + SHED_AFTER.as_nanos() as u64;
        let sheds = |h: &Held| h.large && b.sheds_at(h.ticket, later);
        assert!(!sheds(&big[0]), "not the largest");
        assert!(!sheds(&small), "under the floor: never");
        assert!(sheds(&big[1]), "the largest");
        assert!(!sheds(&big[1]), "once");
        assert!(sheds(&big[0]), "then the next, while still past the mark");
        assert!(
            b.holders().large.is_empty(),
            "both closed, and no longer candidates"
        );
        drop(big);
        assert_eq!(b.pressure(), Pressure::Normal);
        assert_eq!(
            b.over_since.load(Ordering::Relaxed),
            0,
            "under the mark again"
        );
        small.set(600 * 1024);
        assert!(!small.sheds(), "past it again: the time starts over");
    }

    #[tokio::test]
    async fn paused_readers_are_woken_when_the_budget_falls_under_the_mark() {
        let b = MemoryBudget::new(1 << 20);
        let mut big = Held::new(b.clone());
        big.set(900 * 1024);
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { b.relieved().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        big.set(0);
        waiter.await.unwrap();
    }
}
