//! A provider's latency as a peak-sensitive moving average (PeakEWMA), as linkerd2-proxy
//! (tower's `PeakEwma`), Finagle and brpc keep it, for the router's choice of the better
//! of two providers: the one with the lower estimate × (calls in flight + 1).
//!
//! A reply slower than the estimate replaces it at once (the peak: a provider that slows
//! down is avoided from its first slow reply); a faster one moves it by a weight that
//! grows with the time since the last update (`1 - e^(-elapsed/decay)`). With no reply
//! the estimate decays towards zero at the same rate, so a provider that was avoided
//! gets a call again once the others' cost is higher, and is measured afresh. Before its
//! first reply a provider is assumed to take the default round trip, and the first reply
//! replaces that assumption whole. (tower averages the first reply into it by the time
//! since the estimate was made: a broker that starts with its providers and takes calls
//! at once would then balance by load alone for about one decay, 10 s, until the default
//! has faded, and send a provider 20 ms slow about as many calls as a healthy one.)
//!
//! A provider not yet measured (new, or back after it had no healthy connection or
//! drained: [`PeakEwma::forget`]) costs nothing while no call is in flight to it: the
//! router sends it one call, a probe, whose reply measures it. While the probe is out it
//! costs the default round trip × 2, so that it gets no more until then. Without the
//! probe a provider beside faster ones would never be chosen until its default had
//! decayed below their estimates (about 45 s from 30 ms to a LAN's 0.3 ms at a 10 s
//! decay), whatever it could do.
//!
//! Lock-free: the estimate and the instant of its last update are two atomics, written
//! by the connection tasks once per read (the slowest reply of the read, or a call timed
//! out) and read by every routing decision; a race between two updates loses one of them,
//! which an average of thousands shrugs off. tower's `PeakEwma` is not used: it is a
//! `Service` wrapper whose estimate sits behind a mutex locked for every request and
//! every look, and the broker's calls do not pass through `Service`s.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::nanos;

/// One provider's latency estimate.
#[derive(Debug)]
pub(crate) struct PeakEwma {
    /// The estimate in nanoseconds, as `f64` bits.
    rtt: AtomicU64,
    /// When it was last updated (`super::nanos`).
    at: AtomicU64,
    /// The decay, in nanoseconds.
    decay: f64,
    /// False until the first reply: the estimate is still the default.
    measured: AtomicBool,
}

impl PeakEwma {
    /// An estimate of `default_rtt` as of now, forgetting over `decay`.
    pub fn new(default_rtt: Duration, decay: Duration) -> Self {
        PeakEwma {
            rtt: AtomicU64::new((default_rtt.as_nanos() as f64).to_bits()),
            at: AtomicU64::new(nanos(Instant::now())),
            decay: (decay.as_nanos() as f64).max(1.0),
            measured: AtomicBool::new(false),
        }
    }

    /// The estimate and the time since its update, as of `now` (nanoseconds).
    fn load(&self, now: u64) -> (f64, f64) {
        let rtt = f64::from_bits(self.rtt.load(Ordering::Relaxed));
        let at = self.at.load(Ordering::Relaxed);
        (rtt, now.saturating_sub(at) as f64)
    }

    /// A reply (or a timeout) took `rtt`, seen at `now`.
    pub fn observe(&self, rtt: Duration, now: Instant) {
        let now = nanos(now);
        let rtt = rtt.as_nanos() as f64;
        let (est, elapsed) = self.load(now);
        let first =
            !self.measured.load(Ordering::Relaxed) && !self.measured.swap(true, Ordering::Relaxed);
        let next = if first || rtt > est {
            rtt
        } else {
            let keep = (-elapsed / self.decay).exp();
            est * keep + rtt * (1.0 - keep)
        };
        self.rtt.store(next.to_bits(), Ordering::Relaxed);
        self.at.store(now, Ordering::Relaxed);
    }

    /// The estimate as of `now`, decayed since the last update.
    pub fn estimate(&self, now: Instant) -> Duration {
        Duration::from_nanos(self.estimate_ns(nanos(now)) as u64)
    }

    fn estimate_ns(&self, now: u64) -> f64 {
        let (est, elapsed) = self.load(now);
        est * (-elapsed / self.decay).exp()
    }

    /// Whether a reply has measured it since it was new.
    pub fn is_measured(&self) -> bool {
        self.measured.load(Ordering::Relaxed)
    }

    /// The router's cost of sending one more call: the estimate × (`pending` + 1); none
    /// for a provider not yet measured with no call in flight (its probe).
    pub fn cost(&self, now: Instant, pending: usize) -> f64 {
        if pending == 0 && !self.is_measured() {
            return 0.0;
        }
        self.estimate_ns(nanos(now)) * (pending as f64 + 1.0)
    }

    /// The provider is new again (its connections came back after it had none, or after
    /// its drain): what was measured of it is forgotten, back to `default_rtt` as of `now`,
    /// and its next call is a probe.
    pub fn forget(&self, default_rtt: Duration, now: Instant) {
        self.rtt
            .store((default_rtt.as_nanos() as f64).to_bits(), Ordering::Relaxed);
        self.at.store(nanos(now), Ordering::Relaxed);
        self.measured.store(false, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_slow_reply_is_the_estimate_at_once_and_fast_ones_bring_it_down_with_time() {
        let e = PeakEwma::new(30 * MS, Duration::from_secs(10));
        let t0 = Instant::now();
        e.observe(MS / 5, t0);
        assert_eq!(
            e.estimate(t0),
            MS / 5,
            "the first reply replaces the default"
        );
        e.observe(MS, t0);
        e.observe(MS / 10, t0);
        // Elapsed ~0: a faster reply barely moves it.
        assert_eq!(e.estimate(t0), MS);
        e.observe(50 * MS, t0);
        assert_eq!(e.estimate(t0), 50 * MS, "the peak replaces it");
        // Ten seconds of fast replies later (one decay): about 1/e of the way left.
        let t1 = t0 + Duration::from_secs(10);
        e.observe(MS / 5, t1);
        let est = e.estimate(t1);
        assert!(est > 18 * MS && est < 19 * MS, "{est:?}");
    }

    #[test]
    fn a_provider_not_yet_measured_takes_one_probe_call_and_is_new_again_once_forgotten() {
        let e = PeakEwma::new(30 * MS, Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(e.cost(t0, 0), 0.0, "the probe: no cost");
        assert!(
            e.cost(t0, 1) >= 2.0 * (29 * MS).as_nanos() as f64,
            "probe out"
        );
        e.observe(MS / 5, t0);
        assert!(e.cost(t0, 0) > 0.0, "measured: its estimate");
        e.forget(30 * MS, t0);
        assert_eq!(e.cost(t0, 0), 0.0, "new again");
        assert_eq!(e.estimate(t0), 30 * MS);
    }

    #[test]
    fn with_no_reply_the_estimate_decays_and_more_calls_in_flight_cost_more() {
        let e = PeakEwma::new(20 * MS, Duration::from_secs(10));
        let t0 = Instant::now();
        e.observe(20 * MS, t0);
        let later = e.estimate(t0 + Duration::from_secs(30));
        assert!(later < 2 * MS, "{later:?}");
        assert!(e.cost(t0, 3) > 3.9 * e.cost(t0, 0));
    }
}
