//! The search for the highest offered rate that meets the SLO, as a pure state machine:
//! grow geometrically from the start rate until a step fails, then bisect between the
//! highest passing and the lowest failing rate until they are within the precision, then
//! confirm the highest passing rate with a second run. Owns only the choice of the next
//! rate; running steps and judging them is the caller's ([`crate::experiment`]).

use crate::report::Phase;

/// The search's bounds and steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// First rate offered, requests per second.
    pub start: f64,
    /// Lowest rate tried when the start rate fails (the search shrinks by `growth`).
    pub min: f64,
    /// Highest rate offered.
    pub max: f64,
    /// Factor between growing steps (above 1).
    pub growth: f64,
    /// The search has bracketed the capacity when `lowest failing ≤ highest passing × (1 +
    /// precision)`.
    pub precision: f64,
}

/// How a search ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Bracketed within the precision and confirmed.
    Slo,
    /// Every rate up to the maximum passed (and the maximum was confirmed).
    MaxRate,
    /// Nothing passed down to the minimum rate.
    Nothing,
}

impl Ended {
    /// Its name in the report.
    pub fn label(self) -> &'static str {
        match self {
            Ended::Slo => "slo",
            Ended::MaxRate => "max_rate",
            Ended::Nothing => "nothing_passed",
        }
    }
}

/// Where a search stands.
#[derive(Debug, Clone)]
pub struct Search {
    bounds: Bounds,
    /// Rates that passed (and were not refuted by a failed confirmation), ascending.
    passed: Vec<f64>,
    /// Lowest rate that failed.
    failed: Option<f64>,
    /// The rate whose confirmation passed.
    confirmed: Option<f64>,
}

impl Search {
    /// A search within `bounds`.
    pub fn new(bounds: Bounds) -> Self {
        Search {
            bounds,
            passed: Vec::new(),
            failed: None,
            confirmed: None,
        }
    }

    fn highest_pass(&self) -> Option<f64> {
        self.passed.last().copied()
    }

    /// The next step to run, or how the search ended.
    pub fn next(&self) -> Result<(Phase, f64), Ended> {
        let b = &self.bounds;
        match (self.highest_pass(), self.failed) {
            // Nothing run yet.
            (None, None) => Ok((Phase::Grow, b.start.clamp(b.min, b.max))),
            // Nothing passed: shrink until something does, or give up at the minimum.
            (None, Some(f)) => {
                let r = f / b.growth;
                if f <= b.min {
                    Err(Ended::Nothing)
                } else {
                    Ok((Phase::Grow, r.max(b.min)))
                }
            }
            (Some(p), None) => {
                if p >= b.max {
                    self.confirm(p, Ended::MaxRate)
                } else {
                    Ok((Phase::Grow, (p * b.growth).min(b.max)))
                }
            }
            (Some(p), Some(f)) => {
                if f <= p * (1.0 + b.precision) {
                    self.confirm(p, Ended::Slo)
                } else {
                    Ok((Phase::Bisect, (p + f) / 2.0))
                }
            }
        }
    }

    fn confirm(&self, p: f64, ended: Ended) -> Result<(Phase, f64), Ended> {
        if self.confirmed == Some(p) {
            Err(ended)
        } else {
            Ok((Phase::Confirm, p))
        }
    }

    /// Takes the result of a step of `phase` at `rate`.
    pub fn record(&mut self, phase: Phase, rate: f64, pass: bool) {
        match (phase, pass) {
            (Phase::Confirm, true) => self.confirmed = Some(rate),
            (Phase::Confirm, false) => {
                // The rate passed once and failed once: it is not a capacity. Fall back to
                // the next highest pass, which is confirmed in turn.
                self.passed.retain(|&r| r < rate);
                self.failed = Some(self.failed.map_or(rate, |f| f.min(rate)));
            }
            (Phase::Common, _) => {}
            (_, true) => {
                self.passed.push(rate);
                self.passed.sort_by(f64::total_cmp);
            }
            (_, false) => self.failed = Some(self.failed.map_or(rate, |f| f.min(rate))),
        }
    }

    /// The confirmed capacity, requests per second.
    pub fn capacity(&self) -> Option<f64> {
        self.confirmed.filter(|c| self.highest_pass() == Some(*c))
    }

    /// The lowest rate that failed.
    pub fn lowest_failing(&self) -> Option<f64> {
        self.failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds {
        start: 100.0,
        min: 10.0,
        max: 1_000_000.0,
        growth: 2.0,
        precision: 0.05,
    };

    /// Runs a search against a system that passes below `limit` (and, for the first
    /// `flaky` confirmations, fails them); returns the steps and the end.
    fn run(bounds: Bounds, limit: f64, mut flaky: usize) -> (Vec<(Phase, f64)>, Ended, Search) {
        let mut s = Search::new(bounds);
        let mut steps = Vec::new();
        loop {
            match s.next() {
                Ok((phase, rate)) => {
                    let mut pass = rate <= limit;
                    if phase == Phase::Confirm && flaky > 0 {
                        flaky -= 1;
                        pass = false;
                    }
                    steps.push((phase, rate));
                    s.record(phase, rate, pass);
                    assert!(steps.len() < 100, "the search must end: {steps:?}");
                }
                Err(e) => return (steps, e, s),
            }
        }
    }

    #[test]
    fn grows_then_bisects_to_the_precision_then_confirms() {
        let (steps, ended, s) = run(BOUNDS, 5_000.0, 0);
        assert_eq!(ended, Ended::Slo);
        let grow: Vec<f64> = steps
            .iter()
            .filter(|(p, _)| *p == Phase::Grow)
            .map(|s| s.1)
            .collect();
        assert_eq!(grow, [100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0, 6400.0]);
        assert!(steps.iter().any(|(p, _)| *p == Phase::Bisect));
        assert_eq!(steps.last().map(|s| s.0), Some(Phase::Confirm));
        let cap = s.capacity().unwrap();
        let fail = s.lowest_failing().unwrap();
        // The found rate lies between a passing and a failing step, within the precision.
        assert!(cap <= 5_000.0 && fail > 5_000.0, "{cap} {fail}");
        assert!(fail <= cap * 1.05, "{cap} {fail}");
    }

    #[test]
    fn a_system_that_passes_everything_ends_at_the_maximum() {
        let b = Bounds {
            max: 1000.0,
            ..BOUNDS
        };
        let (steps, ended, s) = run(b, f64::INFINITY, 0);
        assert_eq!(ended, Ended::MaxRate);
        assert_eq!(s.capacity(), Some(1000.0));
        assert_eq!(steps.last(), Some(&(Phase::Confirm, 1000.0)));
    }

    #[test]
    fn a_failing_start_shrinks_and_gives_up_at_the_minimum() {
        let (_, ended, s) = run(BOUNDS, 30.0, 0);
        assert_eq!(ended, Ended::Slo);
        assert!(s.capacity().unwrap() <= 30.0);
        let (_, ended, s) = run(BOUNDS, 1.0, 0);
        assert_eq!(ended, Ended::Nothing);
        assert_eq!(s.capacity(), None);
    }

    #[test]
    fn a_failed_confirmation_falls_back_to_the_next_pass() {
        let (steps, ended, s) = run(BOUNDS, 5_000.0, 1);
        assert_eq!(ended, Ended::Slo);
        let confirms = steps.iter().filter(|(p, _)| *p == Phase::Confirm).count();
        assert_eq!(confirms, 2, "{steps:?}");
        let cap = s.capacity().unwrap();
        assert!(cap < 5_000.0 && s.lowest_failing().unwrap() > cap);
    }
}
