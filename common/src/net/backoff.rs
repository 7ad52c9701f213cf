//! Pauses between attempts to reach a peer that keeps failing: exponential, capped, with
//! jitter, for every loop that reconnects (the broker's pools, the driver's connections).
//!
//! Why jitter: many clients that lost the same peer at the same instant would otherwise
//! retry in lock-step, each wave landing together (the "thundering herd" that Envoy,
//! Finagle and gRPC all spread with a random share of the pause). Here each pause is drawn
//! between half and all of the current step ("equal jitter"), so it never drops below
//! half the step (the rate stays bounded) and clients spread over the other half.

use std::time::Duration;

/// First step of the pauses unless told otherwise: short enough that a peer that restarts
/// is found again within a blink, long enough not to spin.
pub const RECONNECT_MIN: Duration = Duration::from_millis(50);
/// Largest step unless told otherwise: a peer that stays down costs one attempt a second
/// per connection, and one that comes back is found within about a second.
pub const RECONNECT_MAX: Duration = Duration::from_secs(1);

/// Steps that double from a minimum to a maximum; each pause drawn from the step's upper
/// half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    step: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(RECONNECT_MIN, RECONNECT_MAX)
    }
}

impl Backoff {
    /// Steps from `min` up to `max` (`max` below `min` is taken as `min`).
    pub fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max: max.max(min),
            step: min,
        }
    }

    /// The pause to make now (between half and all of the current step); the next step is
    /// twice as long, up to the maximum.
    pub fn pause(&mut self) -> Duration {
        let step = self.step;
        self.step = (step * 2).min(self.max);
        let half = step / 2;
        half + half.mul_f64(fastrand::f64())
    }

    /// Back to the first step (after a success).
    pub fn reset(&mut self) {
        self.step = self.min;
    }

    /// True while no pause has been taken since the start or the last reset.
    pub fn is_reset(&self) -> bool {
        self.step == self.min
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_the_maximum_with_jitter_in_the_upper_half_and_reset() {
        let mut b = Backoff::default();
        let mut step = RECONNECT_MIN;
        for _ in 0..10 {
            let p = b.pause();
            assert!(
                p >= step / 2 && p <= step,
                "{p:?} outside the upper half of {step:?}"
            );
            step = (step * 2).min(RECONNECT_MAX);
        }
        assert_eq!(step, RECONNECT_MAX, "the steps reached the cap");
        assert!(b.pause() <= RECONNECT_MAX);
        b.reset();
        assert!(b.is_reset());
        assert!(b.pause() <= RECONNECT_MIN);
    }

    #[test]
    fn the_pauses_of_many_clients_spread_out() {
        let pauses: Vec<Duration> = (0..100).map(|_| Backoff::default().pause()).collect();
        let distinct: std::collections::HashSet<_> = pauses.iter().collect();
        assert!(distinct.len() > 50, "jitter spreads the first retries");
    }
}
