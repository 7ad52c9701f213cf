//! The open-loop pacer: when each request of a connection is due. One request every
//! `every`, from a start instant on, whatever the replies; the worker asks for the due
//! instants up to "now" ([`Pacer::take_due`]) and starts a request for each (or counts it
//! not started, when every slot is busy).
//!
//! Pure: it never reads the clock; the worker passes `now`, and the tests pass made-up
//! instants.

use std::time::{Duration, Instant};

/// The schedule of one connection's requests.
#[derive(Debug, Clone)]
pub struct Pacer {
    every: Duration,
    /// The next request's intended start; `None` once no more may start.
    next_due: Option<Instant>,
}

impl Pacer {
    /// One request every `every`, the first at `first`.
    pub fn new(every: Duration, first: Instant) -> Self {
        Pacer {
            every,
            next_due: Some(first),
        }
    }

    /// When the next request is due; `None` once stopped.
    pub fn next_due(&self) -> Option<Instant> {
        self.next_due
    }

    /// The intended start of the next request if it is due by `now` (and moves on to the
    /// one after it); `None` when the next is still to come, or the pacer has stopped.
    pub fn take_due(&mut self, now: Instant) -> Option<Instant> {
        let due = self.next_due.filter(|d| *d <= now)?;
        self.next_due = Some(due + self.every);
        Some(due)
    }

    /// No more requests start (the run is ending).
    pub fn stop(&mut self) {
        self.next_due = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn requests_are_due_on_the_schedule_whatever_the_clock_says() {
        let t0 = Instant::now();
        let mut p = Pacer::new(10 * MS, t0);
        assert_eq!(p.take_due(t0), Some(t0));
        assert_eq!(p.take_due(t0 + 9 * MS), None, "the second is due at 10 ms");
        assert_eq!(p.next_due(), Some(t0 + 10 * MS));
        // A late look finds every request due since, each at its own intended instant.
        let late = t0 + 35 * MS;
        let due: Vec<Instant> = std::iter::from_fn(|| p.take_due(late)).collect();
        assert_eq!(due, [t0 + 10 * MS, t0 + 20 * MS, t0 + 30 * MS]);
        assert_eq!(p.next_due(), Some(t0 + 40 * MS));
    }

    #[test]
    fn a_stopped_pacer_starts_nothing() {
        let t0 = Instant::now();
        let mut p = Pacer::new(MS, t0);
        p.stop();
        assert_eq!(p.take_due(t0 + 100 * MS), None);
        assert_eq!(p.next_due(), None);
    }

    #[test]
    fn the_rate_over_a_long_run_is_exact() {
        let t0 = Instant::now();
        let every = Duration::from_micros(333);
        let mut p = Pacer::new(every, t0);
        let end = t0 + Duration::from_secs(1);
        let n = std::iter::from_fn(|| p.take_due(end)).count();
        // 0, 333 µs, ..., up to 1 s: 1 + floor(1e6 / 333).
        assert_eq!(n, 1 + 1_000_000 / 333);
    }
}
