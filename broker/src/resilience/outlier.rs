//! Outlier ejection: a provider that fails its calls is taken out of the routing for a
//! while, though it answers its heartbeats (Envoy's outlier detection, Finagle's failure
//! accrual).
//!
//! - Only the provider's faults count ([`Verdict`]): an error status it answered that is
//!   not about the call itself (not "bad request", "permission denied", an unknown service
//!   or method, nor "overloaded", which it answers by design when busy), a connection lost
//!   with the call on it, an unusable reply, or a timeout at the broker's own call
//!   timeout. A deadline the caller set shorter is the caller's.
//! - A provider is ejected after `--eject-consecutive-failures` faults in a row (5), or
//!   when its success rate over `--eject-window` (10 s, at least `--eject-min-calls` 100
//!   calls) falls under `--eject-success-rate` (80 %).
//! - The n-th ejection lasts n × `--eject-base-time` (30 s), at most `--eject-max-time`
//!   (300 s); the count starts again once the provider has served that long without one.
//! - When its time is up the provider is **probing**: the router lets one call through
//!   (one at most every [`PROBE_SPACING`]); a success brings it back, a fault ejects it
//!   again for longer. Its heartbeats go on all the while, as for any provider.
//! - At most `--max-ejection-percent` (50 %) of the providers, rounded down, are ejected
//!   (or probing) at once ([`Ejections`]): with one provider none is, so a fault everywhere
//!   never empties the pool. An ejected provider is still offered a call when no other
//!   takes it.
//!
//! The per-call path adds relaxed atomics only: a success resets the run of faults (a
//! load, and a store only when it was not zero) and counts in the window; the rest happens
//! on faults and transitions.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use metrics::{Counter, Gauge};
use rpcmesh_common::net::thinned::Thinned;

use super::{ResilienceConfig, nanos};

/// How often a probing provider is sent a call at most: one call a second risks at most
/// one failed call a second while it is on probation, and a call whose outcome says
/// nothing (the caller's bad request) does not hold the probe up for longer.
pub const PROBE_SPACING: Duration = Duration::from_secs(1);

/// What a call's outcome says of its provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The provider answered it.
    Success,
    /// The provider's fault.
    Fault,
    /// Nothing about the provider (the caller's request, a refusal by design).
    Neutral,
}

/// Why a provider was ejected: the `reason` of `rpcmesh_upstream_ejections_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EjectReason {
    /// Too many faults in a row.
    ConsecutiveFailures,
    /// The success rate over the window fell too low.
    SuccessRate,
    /// Its probe call failed.
    Probe,
}

impl EjectReason {
    /// Every reason, in the order of their metric handles.
    pub const ALL: [EjectReason; 3] = [
        EjectReason::ConsecutiveFailures,
        EjectReason::SuccessRate,
        EjectReason::Probe,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            EjectReason::ConsecutiveFailures => "consecutive_failures",
            EjectReason::SuccessRate => "success_rate",
            EjectReason::Probe => "probe_failed",
        }
    }
}

/// Where a provider stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum State {
    Serving = 0,
    Ejected = 1,
    Probing = 2,
}

impl State {
    fn from_u8(v: u8) -> State {
        match v {
            1 => State::Ejected,
            2 => State::Probing,
            _ => State::Serving,
        }
    }
}

/// How many providers are out, against the cap: shared by every provider of a broker.
#[derive(Debug)]
pub(crate) struct Ejections {
    members: AtomicUsize,
    out: AtomicUsize,
    max_percent: u32,
    gauge: Gauge,
}

impl Ejections {
    pub fn new(max_percent: u32, gauge: Gauge) -> Self {
        Ejections {
            members: AtomicUsize::new(0),
            out: AtomicUsize::new(0),
            max_percent,
            gauge,
        }
    }

    /// The providers served now (the cap is a share of them).
    pub fn set_members(&self, n: usize) {
        self.members.store(n, Ordering::Relaxed);
    }

    /// Takes a place among the ejected if the cap leaves one.
    fn take(&self) -> bool {
        let cap = self.members.load(Ordering::Relaxed) * self.max_percent as usize / 100;
        let taken = self
            .out
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < cap).then_some(n + 1)
            })
            .is_ok();
        if taken {
            self.gauge.increment(1.0);
        }
        taken
    }

    fn give_back(&self) {
        if self
            .out
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
        {
            self.gauge.decrement(1.0);
        }
    }

    /// Providers ejected or probing now.
    #[cfg(test)]
    pub fn out(&self) -> usize {
        self.out.load(Ordering::Relaxed)
    }
}

/// The process's budget of ejection log lines.
static EJECT_LINES: Thinned = Thinned::new();

/// One provider's outlier state (see the module doc).
#[derive(Debug)]
pub(crate) struct Outlier {
    config: ResilienceConfig,
    shared: Arc<Ejections>,
    label: Arc<str>,
    counters: [Counter; EjectReason::ALL.len()],
    state: AtomicU8,
    /// Faults in a row.
    run: AtomicU32,
    /// The window: when it began, its calls and its faults.
    window_at: AtomicU64,
    calls: AtomicU64,
    faults: AtomicU64,
    /// While ejected: until when; while probing: when the last probe was let through.
    until: AtomicU64,
    probe_at: AtomicU64,
    /// Ejections in the current series, and when the last one ended.
    count: AtomicU32,
    back_at: AtomicU64,
}

impl Outlier {
    pub fn new(
        config: ResilienceConfig,
        shared: Arc<Ejections>,
        label: Arc<str>,
        counters: [Counter; EjectReason::ALL.len()],
    ) -> Self {
        Outlier {
            config,
            shared,
            label,
            counters,
            state: AtomicU8::new(State::Serving as u8),
            run: AtomicU32::new(0),
            window_at: AtomicU64::new(nanos(Instant::now())),
            calls: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            until: AtomicU64::new(0),
            probe_at: AtomicU64::new(0),
            count: AtomicU32::new(0),
            back_at: AtomicU64::new(0),
        }
    }

    fn state(&self) -> State {
        State::from_u8(self.state.load(Ordering::Relaxed))
    }

    /// True while ejected or probing (the router offers it calls only as a last resort,
    /// or the probe).
    pub fn is_out(&self) -> bool {
        self.state() != State::Serving
    }

    /// Whether the router may send this provider a call now: always while it serves;
    /// while it probes, one call every [`PROBE_SPACING`] (this one, when true); while
    /// ejected, not until its time is up, when it starts probing.
    pub fn admits(&self, now: Instant) -> bool {
        match self.state() {
            State::Serving => true,
            State::Ejected => {
                let t = nanos(now);
                if t < self.until.load(Ordering::Relaxed) {
                    return false;
                }
                let _ = self.state.compare_exchange(
                    State::Ejected as u8,
                    State::Probing as u8,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
                self.probe(t)
            }
            State::Probing => self.probe(nanos(now)),
        }
    }

    fn probe(&self, t: u64) -> bool {
        let last = self.probe_at.load(Ordering::Relaxed);
        let spacing = PROBE_SPACING.as_nanos() as u64;
        (last == 0 || t >= last.saturating_add(spacing))
            && self
                .probe_at
                .compare_exchange(last, t, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Records what a call's outcome says of the provider (seen at `now`).
    pub fn record(&self, verdict: Verdict, now: Instant) {
        match verdict {
            Verdict::Neutral => {}
            Verdict::Success => self.succeeded(1, now),
            Verdict::Fault => self.fault(now),
        }
    }

    /// Records `n` successes at once (those of one read: an upstream connection tells
    /// them together, and a fault after them only once they are told).
    pub fn succeeded(&self, n: u64, now: Instant) {
        if self.run.load(Ordering::Relaxed) != 0 {
            self.run.store(0, Ordering::Relaxed);
        }
        self.calls.fetch_add(n, Ordering::Relaxed);
        if self.state() == State::Probing {
            self.come_back(now);
        }
    }

    fn fault(&self, now: Instant) {
        match self.state() {
            State::Ejected => return,
            State::Probing => return self.eject(EjectReason::Probe, now),
            State::Serving => {}
        }
        let t = nanos(now);
        let window = self.config.eject_window.as_nanos() as u64;
        let began = self.window_at.load(Ordering::Relaxed);
        if t.saturating_sub(began) > window
            && self
                .window_at
                .compare_exchange(began, t, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.calls.store(0, Ordering::Relaxed);
            self.faults.store(0, Ordering::Relaxed);
        }
        let calls = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let faults = self.faults.fetch_add(1, Ordering::Relaxed) + 1;
        let run = self.run.fetch_add(1, Ordering::Relaxed) + 1;
        let c = &self.config;
        if c.eject_consecutive > 0 && run >= c.eject_consecutive {
            self.eject(EjectReason::ConsecutiveFailures, now);
        } else if c.eject_success_rate > 0
            && calls >= u64::from(c.eject_min_calls)
            && (calls - faults) * 100 < calls * u64::from(c.eject_success_rate)
        {
            self.eject(EjectReason::SuccessRate, now);
        }
    }

    /// Ejects the provider, if the cap allows (a probing one has its place already).
    fn eject(&self, reason: EjectReason, now: Instant) {
        let t = nanos(now);
        let from = self.state();
        if from == State::Serving && !self.shared.take() {
            // The cap is reached: the provider stays, its run starts again.
            self.run.store(0, Ordering::Relaxed);
            if let Some(a) = EJECT_LINES.admit() {
                tracing::warn!(provider = %self.label, reason = reason.label(), seen = a.seen, left_out = a.left_out, "provider not ejected: --max-ejection-percent are out already");
            }
            return;
        }
        let c = &self.config;
        // A series of ejections ends once the provider served for the longest ejection.
        let back = self.back_at.load(Ordering::Relaxed);
        if from == State::Serving
            && back != 0
            && t.saturating_sub(back) > c.eject_max_time.as_nanos() as u64
        {
            self.count.store(0, Ordering::Relaxed);
        }
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let time = c.eject_base_time.saturating_mul(n).min(c.eject_max_time);
        self.until
            .store(t.saturating_add(time.as_nanos() as u64), Ordering::Relaxed);
        self.probe_at.store(0, Ordering::Relaxed);
        self.run.store(0, Ordering::Relaxed);
        self.state.store(State::Ejected as u8, Ordering::Relaxed);
        self.counters[reason as usize].increment(1);
        if let Some(a) = EJECT_LINES.admit() {
            tracing::warn!(provider = %self.label, reason = reason.label(), ejection = n, for_ms = time.as_millis() as u64, seen = a.seen, left_out = a.left_out, "provider ejected");
        }
    }

    /// A probe succeeded: the provider serves again.
    fn come_back(&self, now: Instant) {
        if self
            .state
            .compare_exchange(
                State::Probing as u8,
                State::Serving as u8,
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            self.shared.give_back();
            self.back_at.store(nanos(now).max(1), Ordering::Relaxed);
            self.window_at.store(nanos(now), Ordering::Relaxed);
            self.calls.store(0, Ordering::Relaxed);
            self.faults.store(0, Ordering::Relaxed);
            tracing::info!(provider = %self.label, "provider back after its probe call succeeded");
        }
    }
}

impl Drop for Outlier {
    /// A provider that leaves while out gives its place back.
    fn drop(&mut self) {
        if self.is_out() {
            self.shared.give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outlier(shared: &Arc<Ejections>, config: ResilienceConfig) -> Outlier {
        let counters = EjectReason::ALL.map(|_| Counter::noop());
        Outlier::new(config, shared.clone(), Arc::from("p"), counters)
    }

    fn shared(members: usize) -> Arc<Ejections> {
        let e = Arc::new(Ejections::new(50, Gauge::noop()));
        e.set_members(members);
        e
    }

    #[test]
    fn five_faults_in_a_row_eject_and_a_success_between_starts_again() {
        let s = shared(2);
        let o = outlier(&s, ResilienceConfig::default());
        let t = Instant::now();
        for _ in 0..4 {
            o.record(Verdict::Fault, t);
        }
        o.record(Verdict::Success, t);
        o.record(Verdict::Neutral, t);
        for _ in 0..4 {
            o.record(Verdict::Fault, t);
        }
        assert!(
            !o.is_out(),
            "a success between, and neutral outcomes do not count"
        );
        o.record(Verdict::Fault, t);
        assert!(o.is_out());
        assert!(!o.admits(t));
        assert_eq!(s.out(), 1);
    }

    #[test]
    fn a_probe_after_the_ejection_decides_and_each_ejection_lasts_longer() {
        let s = shared(2);
        let o = outlier(&s, ResilienceConfig::default());
        let t = Instant::now();
        for _ in 0..5 {
            o.record(Verdict::Fault, t);
        }
        let base = DEFAULT_BASE;
        assert!(!o.admits(t + base - Duration::from_millis(1)));
        let t1 = t + base;
        assert!(o.admits(t1), "the probe");
        assert!(!o.admits(t1), "one probe at a time");
        o.record(Verdict::Fault, t1);
        // Ejected again, for twice as long.
        assert!(!o.admits(t1 + base));
        let t2 = t1 + 2 * base;
        assert!(o.admits(t2));
        o.record(Verdict::Success, t2);
        assert!(!o.is_out() && o.admits(t2));
        assert_eq!(s.out(), 0);
    }

    const DEFAULT_BASE: Duration = super::super::DEFAULT_EJECT_BASE_TIME;

    #[test]
    fn a_low_success_rate_ejects_once_the_window_has_enough_calls() {
        let s = shared(2);
        let o = outlier(&s, ResilienceConfig::default());
        let t = Instant::now();
        // Two successes per fault (67 %): never five in a row.
        for _ in 0..33 {
            o.record(Verdict::Success, t);
            o.record(Verdict::Success, t);
            assert!(!o.is_out());
            o.record(Verdict::Fault, t);
        }
        assert!(!o.is_out(), "99 calls: under the volume");
        o.record(Verdict::Success, t);
        o.record(Verdict::Fault, t);
        assert!(o.is_out());
    }

    #[test]
    fn successes_told_together_count_as_many_and_end_a_run_of_faults() {
        let s = shared(2);
        let o = outlier(&s, ResilienceConfig::default());
        let t = Instant::now();
        // The same calls as the test above, the successes of each read told at once.
        for _ in 0..33 {
            o.succeeded(2, t);
            for _ in 0..4 {
                assert!(!o.is_out());
            }
            o.record(Verdict::Fault, t);
        }
        assert!(!o.is_out(), "99 calls: under the volume");
        o.succeeded(1, t);
        o.record(Verdict::Fault, t);
        assert!(
            o.is_out(),
            "101 calls, 66 % succeeded: under the 80 % asked"
        );
        // A run of four faults, then a read's successes: the run starts again.
        let s = shared(2);
        let o = outlier(&s, ResilienceConfig::default());
        for _ in 0..4 {
            o.record(Verdict::Fault, t);
        }
        o.succeeded(3, t);
        for _ in 0..4 {
            o.record(Verdict::Fault, t);
        }
        assert!(!o.is_out());
        o.record(Verdict::Fault, t);
        assert!(o.is_out(), "five in a row");
    }

    #[test]
    fn at_most_half_the_providers_are_out_and_a_lone_one_never() {
        let s = shared(2);
        let c = ResilienceConfig::default();
        let (a, b) = (outlier(&s, c), outlier(&s, c));
        let t = Instant::now();
        for _ in 0..5 {
            a.record(Verdict::Fault, t);
            b.record(Verdict::Fault, t);
        }
        assert!(a.is_out() && !b.is_out());
        let lone = shared(1);
        let o = outlier(&lone, c);
        for _ in 0..50 {
            o.record(Verdict::Fault, t);
        }
        assert!(!o.is_out());
        drop(a);
        assert_eq!(s.out(), 0, "a provider that leaves gives its place back");
    }
}
