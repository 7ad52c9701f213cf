//! The broker-wide cap on calls in flight (`--max-in-flight`), leased to the cells in
//! blocks: admitting or finishing a call changes only its own cell's counts, and the count
//! the cells share moves once per block, so that no atomic written by two cores is
//! touched per call (docs/performance.md, "Scaling with threads: cells").
//!
//! The cap is never exceeded: a cell admits a call only within what it has leased, and
//! the leases add up to at most the cap. It can refuse a little early: when the cap is
//! leased out, the other cells may hold part of it unused, at most twice a block each
//! ([`Lease::release`] gives back what is beyond one block), under half the cap in all.
//! With one cell, or a cap under four calls per cell, the cap is exact.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The most calls a cell leases at once. Large enough that the shared count moves once
/// per 64 calls at most; small against the default cap (65,536), so that what cells hold
/// unused (two blocks each at most) is under 2 % of it with 8 cells.
pub const LEASE_BLOCK: usize = 64;

/// The cap, and how much of it the cells have leased.
#[derive(Debug)]
pub(crate) struct InFlightCap {
    max: usize,
    block: usize,
    /// What a cell keeps unused after giving back: a block, or none when the cap is too
    /// small to leave that much idle in every cell.
    keep: usize,
    leased: AtomicUsize,
}

impl InFlightCap {
    /// A cap of `max` calls over `cells` cells. A block is at most a quarter of each
    /// cell's share of the cap, so that what cells hold unused stays under half of it; a
    /// cap under four calls per cell is leased call by call, and exact.
    pub fn new(max: usize, cells: usize) -> Arc<InFlightCap> {
        let per_cell = max / (4 * cells.max(1));
        let block = per_cell.clamp(1, LEASE_BLOCK);
        Arc::new(InFlightCap {
            max,
            block,
            keep: if per_cell == 0 { 0 } else { block },
            leased: AtomicUsize::new(0),
        })
    }

    /// A cell's lease on the cap.
    pub fn lease(self: &Arc<Self>) -> Lease {
        Lease {
            cap: self.clone(),
            held: AtomicUsize::new(0),
            used: AtomicUsize::new(0),
        }
    }

    /// Takes up to `want` of what is not leased; 0 when the cap is leased out.
    fn take(&self, want: usize) -> usize {
        let mut leased = self.leased.load(Ordering::Relaxed);
        loop {
            let n = want.min(self.max.saturating_sub(leased));
            if n == 0 {
                return 0;
            }
            match self.leased.compare_exchange_weak(
                leased,
                leased + n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return n,
                Err(now) => leased = now,
            }
        }
    }

    /// Calls leased by the cells, used or not (for tests).
    #[cfg(test)]
    fn leased(&self) -> usize {
        self.leased.load(Ordering::Relaxed)
    }
}

/// One cell's part of the cap. Only the cell's own thread changes it, so its atomics are
/// never contended (they are atomics because a session may be dropped elsewhere).
#[derive(Debug)]
pub(crate) struct Lease {
    cap: Arc<InFlightCap>,
    /// Calls of the cap this cell holds.
    held: AtomicUsize,
    /// Calls of this cell in flight (at most `held`).
    used: AtomicUsize,
}

impl Lease {
    /// Counts a call in, within the cell's lease or a new block of the cap; false when the
    /// cap is reached (the call is refused and nothing is counted).
    #[inline]
    pub fn admit(&self) -> bool {
        let used = self.used.fetch_add(1, Ordering::Relaxed) + 1;
        if used <= self.held.load(Ordering::Relaxed) {
            return true;
        }
        let got = self.cap.take(self.cap.block);
        if got == 0 {
            self.used.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        self.held.fetch_add(got, Ordering::Relaxed);
        true
    }

    /// Counts `n` calls out; a lease holding more than two blocks unused gives back all
    /// but one.
    #[inline]
    pub fn release(&self, n: usize) {
        let used = self.used.fetch_sub(n, Ordering::Relaxed) - n;
        let held = self.held.load(Ordering::Relaxed);
        let spare = held - used;
        if spare > 2 * self.cap.keep {
            let back = spare - self.cap.keep;
            self.held.fetch_sub(back, Ordering::Relaxed);
            self.cap.leased.fetch_sub(back, Ordering::Relaxed);
        }
    }
}

/// Calls in flight of a session moving between cells, handed from one cell's lease to
/// the other's ([`Lease::hand_over`], [`Lease::take_over`]): they stay leased from the
/// cap meanwhile, so the move neither frees room for other calls nor needs any. Dropped
/// without being taken over (the session ended on its way), they are counted out of the
/// cap.
#[derive(Debug)]
#[must_use = "calls handed over are counted out when dropped"]
pub(crate) struct HandedOver {
    cap: Arc<InFlightCap>,
    calls: usize,
}

impl Drop for HandedOver {
    fn drop(&mut self) {
        self.cap.leased.fetch_sub(self.calls, Ordering::Relaxed);
    }
}

impl Lease {
    /// Counts `n` calls out of this cell's lease without giving their room back to the
    /// cap (on this cell's thread, as the session leaves it).
    pub fn hand_over(&self, n: usize) -> HandedOver {
        self.used.fetch_sub(n, Ordering::Relaxed);
        self.held.fetch_sub(n, Ordering::Relaxed);
        HandedOver {
            cap: self.cap.clone(),
            calls: n,
        }
    }

    /// Counts calls handed over from another cell into this one's lease (on this cell's
    /// thread, as the session arrives).
    pub fn take_over(&self, mut calls: HandedOver) {
        let n = std::mem::take(&mut calls.calls);
        self.held.fetch_add(n, Ordering::Relaxed);
        self.used.fetch_add(n, Ordering::Relaxed);
    }
}

impl Drop for Lease {
    /// A cell that goes away gives back what it holds.
    fn drop(&mut self) {
        let held = *self.held.get_mut();
        self.cap.leased.fetch_sub(held, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_never_exceeded_and_with_one_cell_is_exact() {
        let cap = InFlightCap::new(100, 1);
        let lease = cap.lease();
        for _ in 0..100 {
            assert!(lease.admit());
        }
        assert!(!lease.admit(), "the 101st call");
        assert_eq!(cap.leased(), 100);
        lease.release(1);
        assert!(lease.admit(), "a call finished makes room");
        assert!(!lease.admit());
    }

    #[test]
    fn cells_lease_in_blocks_and_give_back_what_they_do_not_use() {
        let cap = InFlightCap::new(65_536, 2);
        let (a, b) = (cap.lease(), cap.lease());
        assert!(a.admit());
        assert_eq!(cap.leased(), LEASE_BLOCK, "one block for the first call");
        for _ in 1..LEASE_BLOCK {
            assert!(a.admit());
        }
        assert_eq!(
            cap.leased(),
            LEASE_BLOCK,
            "the block's calls touch no shared count"
        );
        for _ in 0..1000 {
            assert!(a.admit());
        }
        assert!(b.admit());
        a.release(1000 + LEASE_BLOCK);
        assert!(
            cap.leased() <= 2 * LEASE_BLOCK,
            "an idle cell keeps one block: {} leased",
            cap.leased()
        );
        drop(b);
        assert!(cap.leased() <= LEASE_BLOCK);
    }

    #[test]
    fn calls_handed_between_cells_stay_leased_until_they_finish() {
        let cap = InFlightCap::new(10, 2);
        let (a, b) = (cap.lease(), cap.lease());
        for _ in 0..10 {
            assert!(a.admit());
        }
        let moving = a.hand_over(10);
        assert!(!b.admit(), "the calls on their way still hold the cap");
        assert!(!a.admit());
        b.take_over(moving);
        b.release(4);
        assert!(a.admit(), "a call finished on the new cell makes room");
        a.release(1);
        b.release(6);
        // A session that ends on its way: its calls are counted out.
        for _ in 0..3 {
            assert!(a.admit());
        }
        drop(a.hand_over(3));
        let mut admitted = 0;
        while a.admit() || b.admit() {
            admitted += 1;
        }
        assert_eq!(admitted, 10, "no room of the cap is lost");
    }

    #[test]
    fn a_tiny_cap_is_leased_call_by_call() {
        let cap = InFlightCap::new(1, 2);
        let (a, b) = (cap.lease(), cap.lease());
        assert!(a.admit());
        assert!(!b.admit());
        a.release(1);
        assert!(b.admit(), "the idle cell keeps nothing of a cap this small");
        assert!(!a.admit());
    }

    #[test]
    fn a_cell_is_refused_only_when_the_others_hold_the_rest() {
        let cap = InFlightCap::new(1000, 2);
        let (a, b) = (cap.lease(), cap.lease());
        let mut admitted = 0;
        while a.admit() {
            admitted += 1;
        }
        assert_eq!(admitted, 1000, "one cell may take the whole cap");
        assert!(!b.admit());
        a.release(1000);
        let mut admitted = 0;
        while b.admit() {
            admitted += 1;
        }
        let block = 1000 / 8;
        assert!(
            admitted >= 1000 - block,
            "the other cell holds at most a block unused: {admitted} admitted"
        );
    }
}
