//! Log lines thinned per process: an event that a peer can cause at will (bad input, a
//! connection refused at the cap, a failed accept, a failed reconnect) is logged the first
//! [`Thinned::FIRST`] times, then at most once per [`Thinned::INTERVAL`] with the count of
//! lines left out since, however many connections the events come from. The events are
//! still counted in full by the metrics; the log only has to say that they happen.
//!
//! Owns the decision to log, not the line: callers keep one `static` [`Thinned`] per kind
//! of event and write their own line when [`Thinned::admit`] says so.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The log budget of one kind of event, for the whole process.
#[derive(Debug)]
pub struct Thinned {
    seen: AtomicU64,
    left_out: AtomicU64,
    /// Milliseconds since [`epoch`] before which no further line is logged.
    next_ms: AtomicU64,
}

/// A line to log: the event's number in the process, and the lines left out before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admitted {
    /// Events of this kind so far, this one included.
    pub seen: u64,
    /// Events not logged since the last line.
    pub left_out: u64,
}

impl Thinned {
    /// Lines logged before thinning starts: enough to diagnose.
    pub const FIRST: u64 = 10;
    /// After those, at most one line in this long: a flood of events costs a line a
    /// second, not a line per event.
    pub const INTERVAL: Duration = Duration::from_secs(1);

    /// A fresh budget (for a `static`).
    pub const fn new() -> Self {
        Thinned {
            seen: AtomicU64::new(0),
            left_out: AtomicU64::new(0),
            next_ms: AtomicU64::new(0),
        }
    }

    /// Counts one event; `Some` when it is to be logged.
    pub fn admit(&self) -> Option<Admitted> {
        let seen = self.seen.fetch_add(1, Ordering::Relaxed) + 1;
        if seen <= Self::FIRST {
            return Some(Admitted { seen, left_out: 0 });
        }
        let now = epoch().elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        let step = Self::INTERVAL.as_millis() as u64;
        if now >= next
            && self
                .next_ms
                .compare_exchange(next, now + step, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let left_out = self.left_out.swap(0, Ordering::Relaxed);
            return Some(Admitted { seen, left_out });
        }
        self.left_out.fetch_add(1, Ordering::Relaxed);
        None
    }
}

impl Default for Thinned {
    fn default() -> Self {
        Thinned::new()
    }
}

/// The process's reference instant for [`Thinned`]'s deadlines.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_logs_the_first_lines_then_one_per_interval_with_the_count_left_out() {
        let t = Thinned::new();
        let mut logged = (0..10_000).filter_map(|_| t.admit()).collect::<Vec<_>>();
        let seen: Vec<u64> = logged.iter().take(11).map(|a| a.seen).collect();
        assert_eq!(seen[..10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        // The flood takes far less than an interval: the line after the first ten is
        // the 11th event (the first interval opens at once), then one per interval.
        assert_eq!(seen[10], 11);
        std::thread::sleep(Thinned::INTERVAL);
        logged.push(t.admit().expect("a line once the interval passed"));
        let total: u64 = logged.iter().map(|a| 1 + a.left_out).sum();
        assert_eq!(
            total, 10_001,
            "every event was logged or counted as left out"
        );
    }
}
