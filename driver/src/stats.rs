//! Statistics of a run, kept apart from I/O: latency histograms (HdrHistogram, in
//! microseconds), outcome counts by kind, byte counts, and their summaries. Each
//! connection worker owns one [`Tally`]; the run merges them at the end.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Largest latency a histogram holds exactly: 60 s, above any sane call timeout
/// (longer values are clamped to it).
pub const MAX_LATENCY_US: u64 = 60_000_000;
/// Significant digits of the run's histograms: 3 gives 0.1 % resolution, enough to tell
/// p99.99 apart from max.
const SIGFIGS: u8 = 3;
/// Significant digits of the per-second histograms (only p99 is read from them).
const INTERVAL_SIGFIGS: u8 = 2;

/// A latency histogram in microseconds.
#[derive(Debug, Clone)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Latency::with_sigfigs(SIGFIGS)
    }
}

impl Latency {
    /// A histogram for per-second figures (smaller, coarser).
    pub fn interval() -> Self {
        Latency::with_sigfigs(INTERVAL_SIGFIGS)
    }

    fn with_sigfigs(s: u8) -> Self {
        Latency(
            Histogram::new_with_bounds(1, MAX_LATENCY_US, s).expect("bounds are valid constants"),
        )
    }

    /// Records one latency.
    pub fn record_us(&mut self, us: u64) {
        self.0.saturating_record(us.max(1));
    }

    /// Adds another histogram's samples.
    pub fn add(&mut self, other: &Latency) {
        // Same bounds on both sides: addition cannot fail.
        let _ = self.0.add(&other.0);
    }

    /// Forgets every sample.
    pub fn reset(&mut self) {
        self.0.reset();
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.0.len()
    }

    /// The value at quantile `q` (0..=1), in µs; 0 when empty.
    pub fn quantile_us(&self, q: f64) -> u64 {
        if self.0.is_empty() {
            0
        } else {
            self.0.value_at_quantile(q)
        }
    }

    /// The summary of this histogram.
    pub fn summary(&self) -> LatencySummary {
        let q = |x| self.quantile_us(x) as f64 / 1000.0;
        LatencySummary {
            count: self.count(),
            mean_ms: if self.0.is_empty() {
                0.0
            } else {
                self.0.mean() / 1000.0
            },
            p50_ms: q(0.50),
            p90_ms: q(0.90),
            p99_ms: q(0.99),
            p999_ms: q(0.999),
            p9999_ms: q(0.9999),
            max_ms: if self.0.is_empty() {
                0.0
            } else {
                self.0.max() as f64 / 1000.0
            },
        }
    }
}

/// Percentiles of a latency histogram, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// 99.99th percentile.
    pub p9999_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

/// Counts of one run (or one worker, or one second).
#[derive(Debug, Clone, Default)]
pub struct Tally {
    /// Latency of successful calls.
    pub calls: Latency,
    /// Latency of requests (all K calls), successful or not.
    pub requests: Latency,
    /// Calls written.
    pub sent: u64,
    /// Calls answered with success.
    pub ok: u64,
    /// Calls that failed, by kind (status label, `timeout`, `connection`, `decode`...).
    pub errors: BTreeMap<&'static str, u64>,
    /// Requests completed with every call successful.
    pub requests_ok: u64,
    /// Requests with at least one failed call.
    pub requests_failed: u64,
    /// Bytes written / read on the wire.
    pub wire_out: u64,
    /// Bytes read.
    pub wire_in: u64,
    /// Request payload bytes before / after compression.
    pub payload_out_plain: u64,
    /// Request payload bytes as sent.
    pub payload_out_wire: u64,
    /// Reply payload bytes after / before inflation.
    pub payload_in_plain: u64,
    /// Reply payload bytes as received.
    pub payload_in_wire: u64,
}

impl Tally {
    /// A tally for per-second figures (coarser histograms).
    pub fn interval() -> Self {
        Tally {
            calls: Latency::interval(),
            requests: Latency::interval(),
            ..Tally::default()
        }
    }

    /// Zeroes every figure, keeping the histograms' memory.
    pub fn clear(&mut self) {
        self.calls.reset();
        self.requests.reset();
        self.errors.clear();
        let Tally {
            calls: _,
            requests: _,
            errors: _,
            sent,
            ok,
            requests_ok,
            requests_failed,
            wire_out,
            wire_in,
            payload_out_plain,
            payload_out_wire,
            payload_in_plain,
            payload_in_wire,
        } = self;
        for n in [
            sent,
            ok,
            requests_ok,
            requests_failed,
            wire_out,
            wire_in,
            payload_out_plain,
            payload_out_wire,
            payload_in_plain,
            payload_in_wire,
        ] {
            *n = 0;
        }
    }

    /// Counts a failed call.
    pub fn error(&mut self, kind: &'static str) {
        *self.errors.entry(kind).or_default() += 1;
    }

    /// Calls that failed, all kinds.
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Adds another tally.
    pub fn add(&mut self, o: &Tally) {
        self.calls.add(&o.calls);
        self.requests.add(&o.requests);
        self.sent += o.sent;
        self.ok += o.ok;
        for (k, v) in &o.errors {
            *self.errors.entry(k).or_default() += v;
        }
        self.requests_ok += o.requests_ok;
        self.requests_failed += o.requests_failed;
        self.wire_out += o.wire_out;
        self.wire_in += o.wire_in;
        self.payload_out_plain += o.payload_out_plain;
        self.payload_out_wire += o.payload_out_wire;
        self.payload_in_plain += o.payload_in_plain;
        self.payload_in_wire += o.payload_in_wire;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_known_samples() {
        let mut h = Latency::default();
        for us in 1..=10_000u64 {
            h.record_us(us);
        }
        let s = h.summary();
        assert_eq!(s.count, 10_000);
        assert!((s.p50_ms - 5.0).abs() < 0.01, "{s:?}");
        assert!((s.p99_ms - 9.9).abs() < 0.01, "{s:?}");
        assert!((s.max_ms - 10.0).abs() < 0.01, "{s:?}");
        assert!((s.mean_ms - 5.0).abs() < 0.01, "{s:?}");
    }

    #[test]
    fn empty_histograms_summarise_to_zero() {
        assert_eq!(Latency::default().summary(), LatencySummary::default());
    }

    #[test]
    fn huge_values_are_clamped_not_lost() {
        let mut h = Latency::default();
        h.record_us(u64::MAX);
        assert_eq!(h.count(), 1);
        assert!(h.summary().max_ms >= 59_000.0);
    }

    #[test]
    fn tallies_add_up() {
        let mut a = Tally {
            sent: 3,
            ok: 2,
            ..Tally::default()
        };
        a.error("timeout");
        a.calls.record_us(10);
        let mut b = Tally {
            sent: 3,
            ok: 1,
            ..Tally::default()
        };
        b.error("timeout");
        b.error("overloaded");
        b.calls.record_us(20);
        a.add(&b);
        assert_eq!(a.sent, 6);
        assert_eq!(a.ok + a.failed(), 6);
        assert_eq!(a.errors["timeout"], 2);
        assert_eq!(a.calls.count(), 2);
    }
}
