//! Statistics of a run, kept apart from I/O: latency histograms (HdrHistogram, in
//! microseconds), call outcomes, byte counts, and their summaries. Each connection keeps
//! its [`Books`] (the run's figures and the interval's); the run merges the workers' at
//! the end.

use hdrhistogram::Histogram;
use rpcmesh_wire::envelope::PayloadSize;
use serde::Serialize;

use crate::outcome::CallOutcome;

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
    /// Calls issued. Each has exactly one outcome: `sent = ok + failed`.
    pub sent: u64,
    /// Calls by outcome, indexed by [`CallOutcome::index`] (`ok` first).
    pub outcomes: [u64; CallOutcome::COUNT],
    /// Requests completed with every call successful.
    pub requests_ok: u64,
    /// Requests with at least one failed call.
    pub requests_failed: u64,
    /// Bytes written to the wire.
    pub wire_out: u64,
    /// Bytes read from the wire.
    pub wire_in: u64,
    /// Request payload bytes before compression.
    pub payload_out_plain: u64,
    /// Request payload bytes as sent.
    pub payload_out_wire: u64,
    /// Reply payload bytes after inflation.
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
        // Every field named, so that a new one cannot be forgotten here.
        let Tally {
            calls,
            requests,
            sent,
            outcomes,
            requests_ok,
            requests_failed,
            wire_out,
            wire_in,
            payload_out_plain,
            payload_out_wire,
            payload_in_plain,
            payload_in_wire,
        } = self;
        calls.reset();
        requests.reset();
        *outcomes = [0; CallOutcome::COUNT];
        for n in [
            sent,
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

    /// Counts a finished call, its latency in µs when it succeeded.
    pub fn call(&mut self, outcome: CallOutcome, us: u64) {
        self.outcomes[outcome.index()] += 1;
        if outcome.is_ok() {
            self.calls.record_us(us);
        }
    }

    /// Counts a finished request.
    pub fn request(&mut self, failed: bool, us: u64) {
        self.requests.record_us(us);
        if failed {
            self.requests_failed += 1;
        } else {
            self.requests_ok += 1;
        }
    }

    /// Successful calls.
    pub fn ok(&self) -> u64 {
        self.outcomes[CallOutcome::Ok.index()]
    }

    /// Calls that failed, all kinds.
    pub fn failed(&self) -> u64 {
        self.outcomes[1..].iter().sum()
    }

    /// Failed calls by outcome label, the outcomes that happened only.
    pub fn errors(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        CallOutcome::ALL[1..]
            .iter()
            .map(|o| (o.label(), self.outcomes[o.index()]))
            .filter(|(_, n)| *n > 0)
    }

    /// Adds another tally.
    pub fn add(&mut self, o: &Tally) {
        self.calls.add(&o.calls);
        self.requests.add(&o.requests);
        self.sent += o.sent;
        for (a, b) in self.outcomes.iter_mut().zip(o.outcomes) {
            *a += b;
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

/// The two sets of figures a connection keeps: the run's (what the report gives: only
/// what started in the measured window) and the interval's (everything since the last
/// tick, warm-up included: the progress line and the shared metrics). Every event is
/// entered in both by one call, so they cannot drift apart.
#[derive(Debug)]
pub struct Books {
    /// The measured window's figures.
    pub run: Tally,
    /// Figures since the last tick.
    pub interval: Tally,
}

impl Default for Books {
    fn default() -> Self {
        Books {
            run: Tally::default(),
            interval: Tally::interval(),
        }
    }
}

impl Books {
    /// Enters `f` in the interval's figures, and in the run's when `measured`.
    fn both(&mut self, measured: bool, f: impl Fn(&mut Tally)) {
        f(&mut self.interval);
        if measured {
            f(&mut self.run);
        }
    }

    /// A call was issued.
    pub fn sent(&mut self, measured: bool) {
        self.both(measured, |t| t.sent += 1);
    }

    /// A call ended with `outcome` after `us` µs.
    pub fn call(&mut self, measured: bool, outcome: CallOutcome, us: u64) {
        self.both(measured, |t| t.call(outcome, us));
    }

    /// A request ended after `us` µs.
    pub fn request(&mut self, measured: bool, failed: bool, us: u64) {
        self.both(measured, |t| t.request(failed, us));
    }

    /// A request payload was written.
    pub fn payload_out(&mut self, measured: bool, size: PayloadSize) {
        self.both(measured, |t| {
            t.payload_out_plain += size.plain as u64;
            t.payload_out_wire += size.wire as u64;
        });
    }

    /// A reply payload was read.
    pub fn payload_in(&mut self, measured: bool, size: PayloadSize) {
        self.both(measured, |t| {
            t.payload_in_plain += size.plain as u64;
            t.payload_in_wire += size.wire as u64;
        });
    }

    /// Bytes moved on the wire; only the run counts them (the interval's wire bytes reach
    /// the metrics straight from the connection).
    pub fn wire(&mut self, measured: bool, written: u64, read: u64) {
        if measured {
            self.run.wire_out += written;
            self.run.wire_in += read;
        }
    }

    /// Takes the interval's figures (for the tick), leaving it empty.
    pub fn take_interval(&mut self, into: &mut Tally) {
        into.add(&self.interval);
        self.interval.clear();
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
        use rpcmesh_wire::Status;
        let mut a = Tally {
            sent: 3,
            ..Tally::default()
        };
        a.call(CallOutcome::Ok, 10);
        a.call(CallOutcome::Ok, 10);
        a.call(CallOutcome::NoReply, 0);
        let mut b = Tally {
            sent: 3,
            ..Tally::default()
        };
        b.call(CallOutcome::Ok, 20);
        b.call(CallOutcome::NoReply, 0);
        b.call(CallOutcome::Replied(Status::Overloaded), 0);
        a.add(&b);
        assert_eq!(a.sent, 6);
        assert_eq!(a.ok() + a.failed(), 6);
        let errors: Vec<(&str, u64)> = a.errors().collect();
        assert_eq!(errors, [("overloaded", 1), ("no_reply", 2)]);
        assert_eq!(a.calls.count(), 3, "latency of successful calls only");
    }

    #[test]
    fn the_run_counts_only_what_is_measured_and_the_interval_everything() {
        let mut b = Books::default();
        b.sent(false);
        b.call(false, CallOutcome::Ok, 5);
        b.sent(true);
        b.call(true, CallOutcome::Connection, 7);
        b.request(true, true, 12);
        b.wire(false, 100, 50);
        b.wire(true, 10, 5);
        assert_eq!((b.run.sent, b.run.ok(), b.run.failed()), (1, 0, 1));
        assert_eq!(
            (b.interval.sent, b.interval.ok(), b.interval.failed()),
            (2, 1, 1)
        );
        assert_eq!(
            (b.run.requests_failed, b.run.wire_out, b.run.wire_in),
            (1, 10, 5)
        );
        let mut second = Tally::interval();
        b.take_interval(&mut second);
        assert_eq!(second.sent, 2);
        assert_eq!(b.interval.sent, 0);
        assert_eq!(b.interval.calls.count(), 0);
        assert_eq!(b.run.sent, 1, "the run keeps its figures");
    }
}
