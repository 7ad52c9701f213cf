//! The open-loop pacer: when each request of the run is due, whatever the replies. The
//! offered rate follows a [`Schedule`] (constant, a ramp, or steps); the gaps between
//! requests are equal ([`Arrival::Uniform`]) or drawn from an exponential distribution
//! ([`Arrival::Poisson`]: the arrivals of many independent users, as queueing models
//! assume). The dispatcher asks for the due instants up to "now" ([`Pacer::take_due`])
//! and hands each to a connection, which starts a request timed from that intended
//! instant.
//!
//! A request that is due while every slot of its connection is busy (or the connection is
//! down) waits in the connection's [`Backlog`] (bounded, first in first out) and keeps its
//! intended start; beyond the bound it is not sent, and counted as such.
//!
//! Pure: it never reads the clock; the dispatcher passes `now`, and the tests pass made-up
//! instants. Waking at the due instant precisely is the dispatcher's (a `PreciseTimer`).

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// How requests are spaced.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Arrival {
    /// Equal gaps: exactly the rate, every interval.
    #[default]
    Uniform,
    /// Exponential gaps with the rate as mean: a Poisson process.
    Poisson,
}

/// How the pacer waits for each request's intended start.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Pacing {
    /// Spins (yielding to the connections) through the last 2 ms before each request, so
    /// that its thread never halts then: start lag within tens of µs even on a shared VM,
    /// for up to one core's worth of spinning.
    #[default]
    Exact,
    /// Sleeps until each request is due (no lead, no spinning): a few per cent of a core
    /// whatever the load, and a start lag of tens to hundreds of µs on a shared VM (a
    /// halted vCPU is sometimes woken late). For a driver that shares its machine with
    /// what it measures: under load the wake-ups' lateness grows to milliseconds, and
    /// waking early to spin through it would take a core from the mesh.
    Lean,
}

/// Exact pacing spins through this much of the time before each request: at 500
/// requests/s and more, then, the pacer's thread does not halt at all; below, it sleeps
/// the rest of each gap. A vCPU woken 2 ms ahead has time to run again however long its
/// wake-up takes (on a shared VM, up to a few ms, rarely).
pub const EXACT_SPIN: Duration = Duration::from_millis(2);

impl fmt::Display for Pacing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pacing::Exact => "exact",
            Pacing::Lean => "lean",
        })
    }
}

/// The offered rate over the measured window, in requests per second in all.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// The same rate all along.
    Constant(f64),
    /// From one rate to another, linearly, over a time (then held).
    Ramp {
        /// Rate at the start.
        from: f64,
        /// Rate at the end.
        to: f64,
        /// How long the ramp takes.
        over: Duration,
    },
    /// One rate after another, each for the same time (the last is then held).
    Steps {
        /// The rates, in order.
        rates: Vec<f64>,
        /// How long each lasts.
        each: Duration,
    },
}

/// One part of a schedule, reported on its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// When it starts, from the start of the measured window.
    pub start: Duration,
    /// How long it lasts.
    pub length: Duration,
    /// Offered rate at its start and end (equal but in a ramp).
    pub rate_from: f64,
    /// See `rate_from`.
    pub rate_to: f64,
}

/// How long each step of a ramp is reported as (a ramp has no steps of its own).
pub const RAMP_STEP: Duration = Duration::from_secs(1);

impl Schedule {
    /// The offered rate at `t` into the measured window (before it, the first rate).
    pub fn rate_at(&self, t: Duration) -> f64 {
        match self {
            Schedule::Constant(r) => *r,
            Schedule::Ramp { from, to, over } => {
                let f = (t.as_secs_f64() / over.as_secs_f64().max(1e-9)).min(1.0);
                from + (to - from) * f
            }
            Schedule::Steps { rates, each } => {
                let i = (t.as_secs_f64() / each.as_secs_f64().max(1e-9)) as usize;
                rates[i.min(rates.len() - 1)]
            }
        }
    }

    /// How long the schedule runs, when it has a length of its own.
    pub fn length(&self) -> Option<Duration> {
        match self {
            Schedule::Constant(_) => None,
            Schedule::Ramp { over, .. } => Some(*over),
            Schedule::Steps { rates, each } => Some(*each * rates.len() as u32),
        }
    }

    /// The highest rate it offers.
    pub fn peak(&self) -> f64 {
        match self {
            Schedule::Constant(r) => *r,
            Schedule::Ramp { from, to, .. } => from.max(*to),
            Schedule::Steps { rates, .. } => rates.iter().copied().fold(0.0, f64::max),
        }
    }

    /// The lowest rate it offers.
    pub fn lowest(&self) -> f64 {
        match self {
            Schedule::Constant(r) => *r,
            Schedule::Ramp { from, to, .. } => from.min(*to),
            Schedule::Steps { rates, .. } => rates.iter().copied().fold(f64::INFINITY, f64::min),
        }
    }

    /// Its parts over a measured window of `window`: one for a constant rate, one per step,
    /// one per [`RAMP_STEP`] of a ramp.
    pub fn steps(&self, window: Duration) -> Vec<Step> {
        let cut = |each: Duration| -> Vec<Step> {
            let mut v = Vec::new();
            let mut start = Duration::ZERO;
            while start < window {
                let length = each.min(window - start);
                v.push(Step {
                    start,
                    length,
                    rate_from: self.rate_at(start),
                    rate_to: self.rate_at(start + length),
                });
                start += length;
            }
            v
        };
        match self {
            Schedule::Constant(r) => vec![Step {
                start: Duration::ZERO,
                length: window,
                rate_from: *r,
                rate_to: *r,
            }],
            Schedule::Ramp { .. } => cut(RAMP_STEP),
            Schedule::Steps { each, .. } => {
                let mut v = cut(*each);
                for s in &mut v {
                    s.rate_to = s.rate_from;
                }
                v
            }
        }
    }

    /// The step (by [`Schedule::steps`]) that `t` into the measured window falls in.
    pub fn step_of(&self, t: Duration) -> usize {
        match self.step_length() {
            Some(each) => (t.as_secs_f64() / each.as_secs_f64().max(1e-9)) as usize,
            None => 0,
        }
    }

    /// How long each of its steps lasts: [`RAMP_STEP`] along a ramp; `None` for a
    /// constant rate (one step, the whole window).
    pub fn step_length(&self) -> Option<Duration> {
        match self {
            Schedule::Constant(_) => None,
            Schedule::Ramp { .. } => Some(RAMP_STEP),
            Schedule::Steps { each, .. } => Some(*each),
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Constant(r) => write!(f, "{r} requests/s"),
            Schedule::Ramp { from, to, over } => {
                write!(
                    f,
                    "{from} to {to} requests/s over {:.0} s",
                    over.as_secs_f64()
                )
            }
            Schedule::Steps { rates, each } => {
                let r: Vec<String> = rates.iter().map(|r| r.to_string()).collect();
                write!(
                    f,
                    "steps of {} requests/s, {:.0} s each",
                    r.join(", "),
                    each.as_secs_f64()
                )
            }
        }
    }
}

/// Parses `--rate`: `R` (constant) or `FROM:TO` (a ramp, with `--ramp`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateArg {
    /// The rate, or the ramp's first.
    pub from: f64,
    /// The ramp's last rate.
    pub to: Option<f64>,
}

impl FromStr for RateArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |x: &str| {
            x.trim()
                .parse::<f64>()
                .map_err(|e| format!("{s}: {e} (expected RATE or FROM:TO, requests per second)"))
        };
        match s.split_once(':') {
            Some((a, b)) => Ok(RateArg {
                from: num(a)?,
                to: Some(num(b)?),
            }),
            None => Ok(RateArg {
                from: num(s)?,
                to: None,
            }),
        }
    }
}

impl fmt::Display for RateArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to {
            Some(to) => write!(f, "{}:{to}", self.from),
            None => write!(f, "{}", self.from),
        }
    }
}

/// The schedule of the run's requests.
#[derive(Debug, Clone)]
pub struct Pacer {
    schedule: Schedule,
    arrival: Arrival,
    rng: fastrand::Rng,
    /// Time 0 of the schedule: the start of the measured window.
    origin: Instant,
    /// The next request's intended start.
    next_due: Instant,
}

impl Pacer {
    /// The pacer of `schedule` (whose time 0 is `origin`), spaced as `arrival` says, the
    /// first request due at `first`. `seed` makes Poisson gaps repeatable.
    pub fn new(
        schedule: Schedule,
        arrival: Arrival,
        origin: Instant,
        first: Instant,
        seed: u64,
    ) -> Self {
        Pacer {
            schedule,
            arrival,
            rng: fastrand::Rng::with_seed(seed),
            origin,
            next_due: first,
        }
    }

    /// When the next request is due.
    pub fn next_due(&self) -> Instant {
        self.next_due
    }

    /// The intended start of the next request if it is due by `now` (and moves on to the
    /// one after it); `None` when the next is still to come.
    pub fn take_due(&mut self, now: Instant) -> Option<Instant> {
        let due = self.next_due;
        if due > now {
            return None;
        }
        self.next_due = due + self.gap(due);
        Some(due)
    }

    /// The time to the request after one due at `due`.
    fn gap(&mut self, due: Instant) -> Duration {
        let rate = self
            .schedule
            .rate_at(due.saturating_duration_since(self.origin));
        let mean = 1.0 / rate.max(1e-9);
        let secs = match self.arrival {
            Arrival::Uniform => mean,
            // 1 - U is in (0, 1]: its logarithm is finite.
            Arrival::Poisson => -mean * (1.0 - self.rng.f64()).ln(),
        };
        Duration::from_secs_f64(secs.min(3600.0))
    }
}

/// The intended starts of the requests that were due while every slot was busy, oldest
/// first, up to a bound. Each starts when a slot frees, still timed from its intended start.
#[derive(Debug)]
pub struct Backlog {
    waiting: VecDeque<Instant>,
    bound: usize,
}

/// What became of a request offered to a full connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offered {
    /// It waits for a slot.
    Waiting,
    /// The backlog was full: it is not sent.
    NotSent,
}

impl Backlog {
    /// An empty backlog that holds up to `bound` requests.
    pub fn new(bound: usize) -> Self {
        Backlog {
            waiting: VecDeque::new(),
            bound,
        }
    }

    /// A request due at `due` found no free slot: it waits, unless `bound` already do.
    pub fn offer(&mut self, due: Instant) -> Offered {
        if self.waiting.len() < self.bound {
            self.waiting.push_back(due);
            Offered::Waiting
        } else {
            Offered::NotSent
        }
    }

    /// A slot freed: the intended start of the oldest waiting request, to start on it.
    pub fn take(&mut self) -> Option<Instant> {
        self.waiting.pop_front()
    }

    /// The connection is gone: every waiting request, none of which will be sent.
    pub fn drain(&mut self) -> impl Iterator<Item = Instant> + '_ {
        self.waiting.drain(..)
    }

    /// None waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn constant(per_second: f64, t0: Instant) -> Pacer {
        Pacer::new(Schedule::Constant(per_second), Arrival::Uniform, t0, t0, 1)
    }

    #[test]
    fn requests_are_due_on_the_schedule_whatever_the_clock_says() {
        let t0 = Instant::now();
        let mut p = constant(100.0, t0);
        assert_eq!(p.take_due(t0), Some(t0));
        assert_eq!(p.take_due(t0 + 9 * MS), None, "the second is due at 10 ms");
        assert_eq!(p.next_due(), t0 + 10 * MS);
        // A late look finds every request due since, each at its own intended instant.
        let late = t0 + 35 * MS;
        let due: Vec<Instant> = std::iter::from_fn(|| p.take_due(late)).collect();
        let offsets: Vec<Duration> = due.iter().map(|d| *d - t0).collect();
        let want = [10 * MS, 20 * MS, 30 * MS];
        for (o, w) in offsets.iter().zip(want) {
            assert!(o.abs_diff(w) < Duration::from_nanos(10), "{o:?} vs {w:?}");
        }
        assert_eq!(due.len(), 3);
    }

    #[test]
    fn the_rate_over_a_long_run_is_exact() {
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs(1);
        let mut whole = constant(3000.0, t0);
        let n = std::iter::from_fn(|| whole.take_due(end)).count();
        assert!((2999..=3001).contains(&n), "{n}");
    }

    #[test]
    fn poisson_gaps_have_the_rates_mean_and_an_exponential_spread() {
        let t0 = Instant::now();
        let mut p = Pacer::new(Schedule::Constant(1000.0), Arrival::Poisson, t0, t0, 42);
        let end = t0 + Duration::from_secs(100);
        let due: Vec<Instant> = std::iter::from_fn(|| p.take_due(end)).collect();
        let n = due.len() as f64;
        assert!(
            (n - 100_000.0).abs() < 1_000.0,
            "{n} arrivals in 100 s at 1000/s"
        );
        let gaps: Vec<f64> = due
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.001).abs() < 0.001 * 0.01, "mean gap {mean}");
        // An exponential's standard deviation equals its mean (uniform gaps have none).
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((var.sqrt() - mean).abs() < mean * 0.02, "sd {}", var.sqrt());
    }

    #[test]
    fn a_ramp_goes_from_its_first_rate_to_its_last_and_steps_hold_each() {
        let ramp = Schedule::Ramp {
            from: 1000.0,
            to: 3000.0,
            over: Duration::from_secs(10),
        };
        assert_eq!(ramp.rate_at(Duration::ZERO), 1000.0);
        assert_eq!(ramp.rate_at(Duration::from_secs(5)), 2000.0);
        assert_eq!(ramp.rate_at(Duration::from_secs(20)), 3000.0);
        let steps = ramp.steps(Duration::from_secs(10));
        assert_eq!(steps.len(), 10);
        assert_eq!((steps[0].rate_from, steps[0].rate_to), (1000.0, 1200.0));
        assert_eq!(ramp.step_of(Duration::from_millis(2500)), 2);
        let s = Schedule::Steps {
            rates: vec![100.0, 200.0, 500.0],
            each: Duration::from_secs(10),
        };
        assert_eq!(s.rate_at(Duration::from_secs(15)), 200.0);
        assert_eq!(s.rate_at(Duration::from_secs(99)), 500.0);
        assert_eq!(s.length(), Some(Duration::from_secs(30)));
        let parts = s.steps(Duration::from_secs(30));
        assert_eq!(parts.len(), 3);
        assert!(parts.iter().all(|p| p.rate_from == p.rate_to));
        // The pacer follows the steps: about 1000 + 2000 + 5000 requests over the 30 s.
        let t0 = Instant::now();
        let mut p = Pacer::new(s, Arrival::Uniform, t0, t0, 0);
        let n = std::iter::from_fn(|| p.take_due(t0 + Duration::from_secs(30))).count();
        assert!((7995..=8005).contains(&n), "{n}");
    }

    #[test]
    fn rates_parse_as_a_constant_or_a_ramp() {
        assert_eq!(
            "5000".parse(),
            Ok(RateArg {
                from: 5000.0,
                to: None
            })
        );
        assert_eq!(
            "1000:20000".parse(),
            Ok(RateArg {
                from: 1000.0,
                to: Some(20000.0)
            })
        );
        assert!("fast".parse::<RateArg>().is_err());
        let r = RateArg {
            from: 1.5,
            to: Some(3.0),
        };
        assert_eq!(r.to_string().parse(), Ok(r));
    }

    /// An open loop on a fake clock: a connection with `slots` slots, each request taking
    /// `service`, offered `rate` requests/s for `run`. Returns (latencies from the intended
    /// start of every request that started, in order of start; how many were not sent;
    /// how many were due).
    fn simulate(
        rate: f64,
        slots: usize,
        service: Duration,
        bound: usize,
        run: Duration,
    ) -> (Vec<Duration>, usize, usize) {
        let t0 = Instant::now();
        let end = t0 + run;
        let mut pacer = constant(rate, t0);
        let mut backlog = Backlog::new(bound);
        // When each busy slot frees, soonest last.
        let mut busy: Vec<Instant> = Vec::new();
        let (mut took, mut not_sent, mut due_n) = (Vec::new(), 0, 0);
        let mut start = |intended: Instant, now: Instant, busy: &mut Vec<Instant>| {
            took.push(now + service - intended);
            busy.push(now + service);
            busy.sort_by(|a, b| b.cmp(a));
        };
        loop {
            // The next event: a request due, or a slot freeing (slots first on a tie).
            let due = Some(pacer.next_due()).filter(|d| *d < end);
            let frees = busy.last().copied();
            match (due, frees) {
                (_, Some(f)) if due.is_none_or(|d| f <= d) => {
                    busy.pop();
                    if let Some(intended) = backlog.take() {
                        start(intended, f, &mut busy);
                    }
                }
                (Some(d), _) => {
                    assert_eq!(pacer.take_due(d), Some(d));
                    due_n += 1;
                    if busy.len() < slots {
                        start(d, d, &mut busy);
                    } else if backlog.offer(d) == Offered::NotSent {
                        not_sent += 1;
                    }
                }
                (None, _) => break,
            }
        }
        assert!(
            backlog.is_empty(),
            "every waiting request started by the end"
        );
        (took, not_sent, due_n)
    }

    #[test]
    fn below_capacity_every_request_takes_the_service_time_from_its_intended_start() {
        // 10 slots of 10 ms: 1000 requests/s of capacity, offered 500.
        let ms10 = 10 * MS;
        let (took, not_sent, due) = simulate(500.0, 10, ms10, 100, Duration::from_secs(1));
        assert_eq!((took.len(), not_sent), (due, 0));
        assert!(
            took.iter()
                .all(|t| t.abs_diff(ms10) < Duration::from_micros(1))
        );
    }

    #[test]
    fn over_capacity_requests_wait_in_the_backlog_timed_from_their_intended_start_and_beyond_it_are_not_sent()
     {
        // 1 slot of 10 ms (100/s), offered 200/s for 1 s, a backlog of 20: the first 20
        // requests over capacity wait, and are timed from when they were due; once the
        // backlog is full, about every other request is not sent.
        let (took, not_sent, due) = simulate(200.0, 1, 10 * MS, 20, Duration::from_secs(1));
        assert_eq!(due, 200);
        assert_eq!(took.len() + not_sent, due, "every request has an outcome");
        assert!((70..=80).contains(&not_sent), "{not_sent} not sent");
        // Waiting grows by 5 ms a request until the backlog is full, then holds near
        // 20 waits of 10 ms on top of the service time.
        assert_eq!(took[0], 10 * MS);
        assert_eq!(took[1], 15 * MS);
        let worst = *took.iter().max().unwrap();
        assert!(worst >= 200 * MS && worst <= 215 * MS, "{worst:?}");
    }

    #[test]
    fn a_backlog_holds_its_bound_first_in_first_out_and_drains() {
        let t0 = Instant::now();
        let mut b = Backlog::new(2);
        assert_eq!(b.offer(t0), Offered::Waiting);
        assert_eq!(b.offer(t0 + MS), Offered::Waiting);
        assert_eq!(b.offer(t0 + 2 * MS), Offered::NotSent);
        assert_eq!(b.take(), Some(t0));
        assert_eq!(b.offer(t0 + 3 * MS), Offered::Waiting);
        assert_eq!(b.drain().collect::<Vec<_>>(), vec![t0 + MS, t0 + 3 * MS]);
        assert!(b.is_empty());
    }
}
