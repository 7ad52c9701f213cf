//! A timer finer than Tokio's: Tokio's timer wheel ticks every millisecond, so a sleep of
//! 200 µs lasts about 1.1 ms and one of 5 ms about 6 ms (on the 2-vCPU reference VM). This
//! one is a Linux `timerfd` (a kernel hrtimer) registered with the runtime's reactor: the
//! kernel makes it readable at the instant asked, and the runtime wakes for it as for a
//! socket, without a thread of its own and without spinning.
//!
//! What is left is the wake-up: the reactor notices the timer some tens of µs late (on the
//! same VM, 25–30 µs mean from idle, p99 40–75 µs). [`PreciseTimer`] learns that lateness as
//! it goes (a moving average) and aims that much early, so that:
//!
//! - [`Aim::Mean`]: the wake-ups are, on average, at the deadline (a single one may be a
//!   few µs early or late). For simulated service times, whose mean is what must be right.
//! - [`Aim::NotBefore`]: never before the deadline: it aims early by a high quantile of
//!   the lateness (learned as well, from a decaying histogram of the wake-ups), then
//!   yields to the runtime (which keeps serving sockets) until the deadline has passed.
//!   For the driver's pacer, where a request must not leave early and should leave within
//!   tens of µs. The spin costs that lead per wake-up: where wake-ups are prompt (bare
//!   metal) it is a few µs; on the 2-vCPU VM, whose wake-ups from idle have a tail of
//!   100–200 µs, it is about that (a fifth of a core at 1,000 wake-ups a second). The lead
//!   is a learned quantile, not a fixed margin: the mean plus 40 µs leaves the pacer's
//!   start-lag p99 at 110–150 µs there.
//! - [`Aim::Sleeping`]: at or after the deadline, by arming the timer for the deadline
//!   itself: no lead, no spin, as late as the wake-up is. For the driver's lean pacer,
//!   which must cost no CPU while it waits whatever the load (under load the lateness's
//!   tail, and with it `NotBefore`'s spin, grows to milliseconds).
//! - [`Aim::Spinning`]: the same, spinning for at least a given time before the deadline.
//!   On a shared VM a halted vCPU is sometimes woken hundreds of µs late, in stretches of
//!   seconds (neighbours' load), whatever the lead learned so far: the driver's exact
//!   pacing does not let its thread halt between requests. At 1,000 requests/s, with the
//!   thread free to halt, a lead of 150, 300 or 500 µs leaves the start-lag p99 at 15–110,
//!   6–51 and 5–188 µs from run to run; with no halt, at 1–2 µs.
//!
//! Where no `timerfd` can be made (or one fails), the timer says so once in the log and
//! waits on Tokio's timer instead: never early, up to a millisecond late.
//!
//! One timer serves one task and one deadline at a time (the earliest of whatever the task
//! waits for); arming is a syscall, so a deadline that did not change is not armed again.

use std::io;
use std::time::{Duration, Instant};

use rustix::fd::OwnedFd;
use rustix::time::{
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create,
    timerfd_settime,
};
use tokio::io::unix::AsyncFd;

/// What a wake-up aims at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aim {
    /// On average at the deadline.
    Mean,
    /// At or after the deadline, as soon after as can be.
    NotBefore,
    /// At or after the deadline, by sleeping until it: the timer is armed for the
    /// deadline itself, with no lead and no spinning, so the thread sleeps the whole gap
    /// and the wake-up is as late as the host makes it. What costs no CPU while waiting,
    /// whatever the lateness (a learned lead would spin through it, and on a loaded VM the
    /// lateness's tail, and so the spinning, grows with the load).
    Sleeping,
    /// At or after the deadline, having spun (yielding to the runtime) for at least the
    /// given time before it: the thread does not sleep through that time, so a CPU that
    /// would halt (and, in a VM, take hundreds of µs to be woken) keeps running.
    Spinning(Duration),
}

/// Lateness assumed before any was measured: about what the 2-vCPU VM shows.
const INITIAL_LATENESS: Duration = Duration::from_micros(25);
/// The moving average gives each new measurement this weight: 1/32, so that a few hundred
/// wake-ups settle it and one slow wake-up moves it by a few per cent.
const EWMA_WEIGHT: f64 = 1.0 / 32.0;
/// A [`Aim::NotBefore`] wake-up aims early by this quantile of the lateness, so that only
/// one wake-up in 200 comes after its deadline (and then by little): the driver's pacer
/// keeps its start-lag p99 within tens of µs. Higher buys precision with spinning.
const NOT_BEFORE_QUANTILE: f64 = 0.995;
/// Until this many wake-ups were measured, a [`Aim::NotBefore`] wake-up aims early by
/// [`INITIAL_NOT_BEFORE_LEAD`]: fewer say little about a tail.
const SPREAD_MIN_SAMPLES: u32 = 200;
/// The lead before the spread is known: about the VM's wake-up p99.5.
const INITIAL_NOT_BEFORE_LEAD: Duration = Duration::from_micros(150);
/// A lateness beyond this (the runtime was busy, the VM descheduled) is not learned from:
/// it says nothing about the reactor's wake-up. It also bounds the spin per wake-up.
const LATENESS_CAP: Duration = Duration::from_micros(500);
/// Width of the spread's buckets: the lead's resolution.
const SPREAD_BUCKET_US: u64 = 5;
/// The spread halves its counts after this many wake-ups, so that it follows a change of
/// machine load within a few seconds at the pacer's rates and its memory stays fixed.
const SPREAD_HALF_LIFE: u32 = 4096;
/// Buckets of the spread: up to the cap.
const SPREAD_BUCKETS: usize = (LATENESS_CAP.as_micros() as u64 / SPREAD_BUCKET_US) as usize;

/// A fine-grained timer for one task.
#[derive(Debug)]
pub struct PreciseTimer {
    fd: Fd,
    /// The deadline the timer is armed for, and the instant it fires at, if it is.
    armed: Option<(Instant, Instant)>,
    /// Mean lateness of the wake-ups, in µs.
    lateness_us: f64,
    /// How the lateness spreads, once a wake-up was measured (boxed: its counters would
    /// make the timer 400 bytes).
    spread: Option<Box<Spread>>,
}

/// The timer's `timerfd`: made on first use, so that a timer that never waits costs
/// nothing; Tokio's timer where none can be made or one failed.
#[derive(Debug)]
enum Fd {
    Unmade,
    Fine(AsyncFd<OwnedFd>),
    Coarse,
}

/// A decaying histogram of the wake-ups' lateness, in fixed buckets up to the cap. (An
/// HdrHistogram cannot decay, and a hundred counters need no crate.)
#[derive(Debug)]
struct Spread {
    counts: [u32; SPREAD_BUCKETS],
    /// The sum of `counts`.
    total: u32,
    /// Wake-ups since the counts last halved.
    since_halving: u32,
}

impl Spread {
    fn new() -> Self {
        Spread {
            counts: [0; SPREAD_BUCKETS],
            total: 0,
            since_halving: 0,
        }
    }

    fn record(&mut self, late: Duration) {
        let i = (late.as_micros() as u64 / SPREAD_BUCKET_US) as usize;
        self.counts[i.min(SPREAD_BUCKETS - 1)] += 1;
        self.total += 1;
        self.since_halving += 1;
        if self.since_halving >= SPREAD_HALF_LIFE {
            self.since_halving = 0;
            self.total = 0;
            for c in &mut self.counts {
                *c /= 2;
                self.total += *c;
            }
        }
    }

    /// The upper edge of the bucket that holds quantile `q`; `None` until enough samples.
    fn quantile(&self, q: f64) -> Option<Duration> {
        if self.total < SPREAD_MIN_SAMPLES {
            return None;
        }
        let rank = (q * f64::from(self.total)).ceil() as u32;
        let mut seen = 0;
        let i = self
            .counts
            .iter()
            .position(|c| {
                seen += c;
                seen >= rank
            })
            .unwrap_or(SPREAD_BUCKETS - 1);
        Some(Duration::from_micros((i as u64 + 1) * SPREAD_BUCKET_US))
    }
}

impl Default for PreciseTimer {
    fn default() -> Self {
        Self::new()
    }
}

impl PreciseTimer {
    /// A timer for one task. It makes its `timerfd`, registered with the current runtime's
    /// reactor, on its first wait; where none can be made, or one fails, it says so once
    /// in the log and waits on Tokio's timer from then on (up to a millisecond late).
    pub fn new() -> Self {
        PreciseTimer {
            fd: Fd::Unmade,
            armed: None,
            lateness_us: INITIAL_LATENESS.as_secs_f64() * 1e6,
            spread: None,
        }
    }

    /// How early a wake-up with `aim` fires before its deadline: the mean lateness learned
    /// so far ([`Aim::Mean`]), none ([`Aim::Sleeping`]), a high quantile of it
    /// ([`Aim::NotBefore`]), at least the
    /// spin ([`Aim::Spinning`]); zero on Tokio's timer.
    pub fn lead(&self, aim: Aim) -> Duration {
        if !matches!(self.fd, Fd::Fine(_)) {
            return Duration::ZERO;
        }
        let not_before = || {
            self.spread
                .as_ref()
                .and_then(|s| s.quantile(NOT_BEFORE_QUANTILE))
                .unwrap_or(INITIAL_NOT_BEFORE_LEAD)
        };
        match aim {
            Aim::Mean => Duration::from_secs_f64(self.lateness_us / 1e6),
            Aim::Sleeping => Duration::ZERO,
            Aim::NotBefore => not_before(),
            Aim::Spinning(d) => d.max(not_before()),
        }
    }

    /// Waits until `deadline` as `aim` says. Cancel-safe: dropped and called again with
    /// the same deadline, it keeps the timer as armed, and a wake-up that came while no one
    /// was waiting (the task was busy elsewhere) still counts as late as it was.
    pub async fn wait_until(&mut self, deadline: Instant, aim: Aim) {
        if let Fd::Unmade = self.fd {
            self.fd = match make_timerfd() {
                Ok(fd) => Fd::Fine(fd),
                Err(e) => {
                    tracing::warn!(error = %e, "no timerfd: waits get Tokio's millisecond ticks");
                    Fd::Coarse
                }
            };
        }
        if let Fd::Fine(_) = self.fd {
            match self.wait_fine(deadline, aim).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "timerfd failed: waits get Tokio's millisecond ticks from now on");
                    self.fd = Fd::Coarse;
                    self.armed = None;
                }
            }
        }
        tokio::time::sleep_until(deadline.into()).await;
    }

    async fn wait_fine(&mut self, deadline: Instant, aim: Aim) -> io::Result<()> {
        let fire_at = match self.armed {
            Some((d, at)) if d == deadline => at,
            _ => deadline.checked_sub(self.lead(aim)).unwrap_or(deadline),
        };
        let was_armed = self.armed.is_some_and(|(d, _)| d == deadline);
        if Instant::now() < fire_at {
            self.arm(deadline, fire_at)?;
            self.expired().await?;
            self.learn(fire_at);
        } else if was_armed {
            // It fired while this task was busy: that lateness is real, learn it. (The
            // expiry left unread is skipped by the next wait.)
            self.armed = None;
            self.learn(fire_at);
        }
        if matches!(aim, Aim::NotBefore | Aim::Spinning(_)) {
            while Instant::now() < deadline {
                tokio::task::yield_now().await;
            }
        }
        Ok(())
    }

    /// Takes the lateness of a wake-up that was due at `fire_at` into the moving average.
    fn learn(&mut self, fire_at: Instant) {
        let late = Instant::now().saturating_duration_since(fire_at);
        if late < LATENESS_CAP {
            let us = late.as_secs_f64() * 1e6;
            self.lateness_us += EWMA_WEIGHT * (us - self.lateness_us);
            self.spread
                .get_or_insert_with(|| Box::new(Spread::new()))
                .record(late);
        }
    }

    fn fd(&self) -> io::Result<&AsyncFd<OwnedFd>> {
        match &self.fd {
            Fd::Fine(fd) => Ok(fd),
            Fd::Unmade | Fd::Coarse => Err(io::Error::other("no timerfd")),
        }
    }

    /// Arms the timer to fire at `at` for `deadline`, unless it already is.
    fn arm(&mut self, deadline: Instant, at: Instant) -> io::Result<()> {
        if self.armed == Some((deadline, at)) {
            return Ok(());
        }
        // timerfd takes a relative time here (Instant's clock is CLOCK_MONOTONIC, but its
        // value cannot be read); the syscall follows at once, so the error is the µs
        // between the two lines. Zero would disarm: at least 1 ns.
        let after = at
            .saturating_duration_since(Instant::now())
            .max(Duration::from_nanos(1));
        let spec = Itimerspec {
            it_interval: timespec(Duration::ZERO),
            it_value: timespec(after),
        };
        timerfd_settime(self.fd()?.get_ref(), TimerfdTimerFlags::empty(), &spec)?;
        self.armed = Some((deadline, at));
        Ok(())
    }

    /// Waits until the armed timer has expired, and consumes the expiry.
    async fn expired(&mut self) -> io::Result<()> {
        let fd = self.fd()?;
        loop {
            let mut ready = fd.readable().await?;
            let mut count = [0u8; 8];
            match rustix::io::read(fd.get_ref(), &mut count) {
                Ok(_) => break,
                Err(rustix::io::Errno::AGAIN) => ready.clear_ready(),
                Err(e) => return Err(e.into()),
            }
        }
        self.armed = None;
        Ok(())
    }
}

/// A `timerfd` on the monotonic clock, registered with the current runtime's reactor.
fn make_timerfd() -> io::Result<AsyncFd<OwnedFd>> {
    let fd = timerfd_create(
        TimerfdClockId::Monotonic,
        TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
    )?;
    // `AsyncFd::new` is deprecated because any `AsRawFd` can be passed, a bare `RawFd` or
    // one that changes; an `OwnedFd` owns its descriptor for the timer's whole life and
    // never changes, which is the sound use. (`AsyncFd::register`, the replacement, is
    // `unsafe`, which this workspace forbids.)
    #[allow(deprecated)]
    AsyncFd::new(fd)
}

fn timespec(d: Duration) -> Timespec {
    Timespec {
        tv_sec: d.as_secs() as _,
        tv_nsec: d.subsec_nanos() as _,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_sleeping_wait_has_no_lead_and_never_returns_before_its_deadline() {
        let mut t = PreciseTimer::new();
        for us in [0u64, 50, 200, 1000, 3000] {
            let deadline = Instant::now() + Duration::from_micros(us);
            t.wait_until(deadline, Aim::Sleeping).await;
            assert!(Instant::now() >= deadline, "{us} µs");
        }
        // However late past wake-ups were, it aims at the deadline itself: nothing to spin.
        assert_eq!(t.lead(Aim::Sleeping), Duration::ZERO);
    }

    #[tokio::test]
    async fn a_not_before_wait_never_returns_before_its_deadline() {
        let mut t = PreciseTimer::new();
        for us in [0u64, 50, 200, 1000, 3000] {
            let deadline = Instant::now() + Duration::from_micros(us);
            t.wait_until(deadline, Aim::NotBefore).await;
            assert!(Instant::now() >= deadline, "{us} µs: woke early");
        }
    }

    #[tokio::test]
    async fn a_deadline_in_the_past_returns_at_once_without_arming() {
        let mut t = PreciseTimer::new();
        let past = Instant::now();
        t.wait_until(past, Aim::Mean).await;
        assert_eq!(t.armed, None);
    }

    #[tokio::test]
    async fn a_dropped_wait_keeps_the_arming_and_the_next_call_completes() {
        let mut t = PreciseTimer::new();
        let deadline = Instant::now() + Duration::from_millis(20);
        // Polled once, then dropped: the timer stays armed for the same instant.
        let first =
            tokio::time::timeout(Duration::from_micros(1), t.wait_until(deadline, Aim::Mean));
        let _ = first.await;
        let armed = t.armed;
        assert!(armed.is_some());
        t.wait_until(deadline, Aim::Mean).await;
        assert_eq!(t.armed, None, "the expiry was consumed");
    }

    #[tokio::test]
    async fn the_learned_lateness_stays_within_its_cap() {
        let mut t = PreciseTimer::new();
        for _ in 0..50 {
            let d = Instant::now() + Duration::from_micros(300);
            t.wait_until(d, Aim::Mean).await;
        }
        assert!(t.lead(Aim::Mean) < LATENESS_CAP, "{:?}", t.lead(Aim::Mean));
    }

    #[tokio::test]
    async fn without_a_timerfd_it_waits_on_tokios_timer_never_early_and_aims_at_the_deadline() {
        let mut t = PreciseTimer::new();
        t.fd = Fd::Coarse;
        for us in [0u64, 200, 1500] {
            let deadline = Instant::now() + Duration::from_micros(us);
            t.wait_until(deadline, Aim::Spinning(Duration::from_millis(2)))
                .await;
            assert!(Instant::now() >= deadline, "{us} µs: woke early");
        }
        assert_eq!(t.lead(Aim::Mean), Duration::ZERO);
        assert_eq!(t.armed, None);
    }

    #[test]
    fn the_spread_gives_its_quantile_and_forgets_the_old() {
        let mut s = Spread::new();
        assert_eq!(s.quantile(0.5), None, "too few samples");
        // 990 prompt wake-ups (under 5 µs) and 10 at 120 µs.
        for _ in 0..990 {
            s.record(Duration::from_micros(3));
        }
        for _ in 0..10 {
            s.record(Duration::from_micros(120));
        }
        assert_eq!(s.quantile(0.5), Some(Duration::from_micros(5)));
        assert_eq!(s.quantile(0.995), Some(Duration::from_micros(125)));
        // Past the cap: the last bucket.
        s.record(Duration::from_secs(1));
        assert_eq!(s.quantile(1.0), Some(LATENESS_CAP));
        // Many prompt wake-ups later the slow ones are forgotten.
        for _ in 0..4 * SPREAD_HALF_LIFE {
            s.record(Duration::from_micros(3));
        }
        assert_eq!(s.quantile(0.995), Some(Duration::from_micros(5)));
        assert!(s.total < 2 * SPREAD_HALF_LIFE, "bounded: {}", s.total);
    }
}
