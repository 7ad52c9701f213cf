//! Statistics of a run, kept apart from I/O: latency histograms (HdrHistogram, in
//! microseconds), call outcomes, byte counts, and their summaries. Each worker keeps its
//! [`Books`] (the run's figures and the interval's) and hands back its
//! [`WorkerFigures`]; the run adds the workers' up at the end.

use std::collections::BTreeMap;
use std::time::Instant;

use hdrhistogram::Histogram;
use hdrhistogram::errors::AdditionError;
use rpcmesh_common::retry::RetryReason;
use rpcmesh_wire::envelope::PayloadSize;
use serde::Serialize;

use crate::failures::FailureTexts;
use crate::outcome::CallOutcome;

/// Largest latency a histogram holds exactly: 60 s, above any sane call timeout
/// (longer values are clamped to it).
pub const MAX_LATENCY_US: u64 = 60_000_000;
/// How much larger than the largest latency seen so far a connection makes the histograms
/// of a step it prepares (see [`Books::prepare`]), so that they rarely grow during it.
const PREPARED_HEADROOM: u64 = 2;
/// Significant digits of the run's histograms: 3 gives 0.1 % resolution, enough to tell
/// p99.99 apart from max.
const SIGFIGS: u8 = 3;
/// Significant digits of the per-second histograms (only p99 is read from them).
const INTERVAL_SIGFIGS: u8 = 2;

/// A latency histogram in microseconds.
///
/// It covers the latencies it has been given, not [`MAX_LATENCY_US`] from the start: it
/// grows (HdrHistogram's auto-resizing) when a larger one arrives. At 3 significant digits
/// the whole 60 s range takes 147 KB, and every connection keeps four histograms per
/// measured step: made up front, hundreds of connections would fault in tens of MB at the
/// start of the measured window, all at once, holding the driver's thread while every
/// call in flight takes the wait as latency. Calls of a few milliseconds need 16–40 KB.
#[derive(Debug, Clone)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Latency::covering(0, SIGFIGS)
    }
}

impl Latency {
    /// A histogram for per-second figures (smaller, coarser).
    pub fn interval() -> Self {
        Latency::covering(0, INTERVAL_SIGFIGS)
    }

    /// A histogram that already covers latencies up to `high_us` (at least its smallest
    /// range, at most [`MAX_LATENCY_US`]) and grows beyond.
    fn covering(high_us: u64, sigfigs: u8) -> Self {
        let mut h = Histogram::new_with_bounds(1, high_us.clamp(2, MAX_LATENCY_US), sigfigs)
            .expect("bounds and digits are valid constants");
        h.auto(true);
        Latency(h)
    }

    /// Records one latency (clamped to [`MAX_LATENCY_US`], so that no histogram grows
    /// beyond it).
    pub fn record_us(&mut self, us: u64) {
        let us = us.clamp(1, MAX_LATENCY_US);
        // `record` grows the histogram (`saturating_record` would clamp to its current
        // range instead); growing within 60 s cannot fail, and were it to, the sample is
        // still counted, at the range's top.
        if self.0.record(us).is_err() {
            self.0.saturating_record(us);
        }
    }

    /// Adds another histogram's samples (this one grows to hold them: addition cannot
    /// fail).
    pub fn add(&mut self, other: &Latency) {
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

    /// The histogram itself (microseconds), for the interval log.
    pub fn histogram(&self) -> &Histogram<u64> {
        &self.0
    }

    /// Adds a histogram read from an interval log (this one grows to hold it; growing
    /// fails only past what a `usize` indexes).
    pub fn add_histogram(&mut self, other: &Histogram<u64>) -> Result<(), AdditionError> {
        self.0.add(other)
    }

    /// Each distinct value recorded (µs, as the histogram's resolution keeps it) with how
    /// many times it was.
    pub fn each(&self, mut f: impl FnMut(u64, u64)) {
        for v in self.0.iter_recorded() {
            f(v.value_iterated_to(), v.count_since_last_iteration());
        }
    }

    /// Samples above `us` microseconds: above the histogram bucket that holds `us` (its
    /// resolution is 0.1 %: at 30 ms, samples from 30.016 ms on count).
    pub fn count_above_us(&self, us: u64) -> u64 {
        let from = self.0.next_non_equivalent(us);
        if self.0.is_empty() || from > self.0.max() {
            return 0;
        }
        self.0.count_between(from, self.0.max())
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
///
/// Latency is measured from when a call or request was *meant* to start: in the open loop,
/// from its intended start on the schedule (so a stall that holds requests back shows in
/// the percentiles, instead of being left out: no coordinated omission); in the closed
/// loop, where there is no schedule, from when it started. The open loop also keeps the
/// latency from the actual start (`*_uncorrected`), as wrk2's `-U` does, for comparison.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    /// Latency of successful calls, from their intended start.
    pub calls: Latency,
    /// Latency of successful requests (all K calls), from their intended start.
    pub requests: Latency,
    /// Open loop: latency of successful calls from their actual start.
    pub calls_uncorrected: Latency,
    /// Open loop: latency of successful requests from their actual start.
    pub requests_uncorrected: Latency,
    /// Latency of requests with a failed call, from their intended start: apart from the
    /// successful ones, whose figures a fast failure would otherwise flatter. Not one of
    /// [`Tally::LATENCIES`] (the interval log's and the metrics' histograms).
    pub requests_failed_latency: Latency,
    /// Calls issued. Each has exactly one outcome: `sent = ok + failed`.
    pub sent: u64,
    /// Calls by outcome, indexed by [`CallOutcome::index`] (`ok` first).
    pub outcomes: [u64; CallOutcome::COUNT],
    /// Times a call was sent again, by why (indexed by [`RetryReason`]): not outcomes,
    /// detours (a call sent twice counts once in `sent`).
    pub retries: [u64; RetryReason::COUNT],
    /// Calls safe to retry that were not, for want of retry budget, by why.
    pub retries_refused: [u64; RetryReason::COUNT],
    /// Requests due: the pacer's intended starts in the open loop, the requests started in
    /// the closed loop. Each ends as ok, failed or not sent.
    pub requests_due: u64,
    /// Requests completed with every call successful.
    pub requests_ok: u64,
    /// Requests with at least one failed call.
    pub requests_failed: u64,
    /// Open loop: requests due while every slot was busy and the backlog was full: never
    /// sent (each is a request due = ok + failed + not sent).
    pub requests_not_sent: u64,
    /// Open loop: requests that waited in the backlog for a free slot before they started.
    pub requests_backlogged: u64,
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
    /// What the failed calls' replies said (measured steps only: the report's breakdown).
    pub texts: FailureTexts,
}

impl Tally {
    /// The names of the four latency histograms, in the order of [`Tally::latencies`]
    /// (the interval log's tags).
    pub const LATENCIES: [&'static str; 4] = [
        "requests",
        "calls",
        "requests_uncorrected",
        "calls_uncorrected",
    ];

    /// A tally whose histograms already cover latencies up to `high_us` (see
    /// [`Books::prepare`]).
    pub fn covering(high_us: u64) -> Self {
        Tally::with_latencies(|| Latency::covering(high_us, SIGFIGS))
    }

    /// A tally for per-second figures (coarser histograms).
    pub fn interval() -> Self {
        Tally::with_latencies(Latency::interval)
    }

    fn with_latencies(make: impl Fn() -> Latency) -> Self {
        let mut t = Tally::default();
        for h in t.latencies_mut() {
            *h = make();
        }
        // The failed requests' histogram is not made ahead: it stays at its smallest unless
        // requests fail, and a run without failures pays nothing for it.
        t
    }

    /// The four latency histograms, in the order of [`Tally::LATENCIES`].
    pub fn latencies(&self) -> [&Latency; 4] {
        [
            &self.requests,
            &self.calls,
            &self.requests_uncorrected,
            &self.calls_uncorrected,
        ]
    }

    fn latencies_mut(&mut self) -> [&mut Latency; 4] {
        [
            &mut self.requests,
            &mut self.calls,
            &mut self.requests_uncorrected,
            &mut self.calls_uncorrected,
        ]
    }

    /// Zeroes every figure, keeping the histograms' memory.
    pub fn clear(&mut self) {
        // Every field named, so that a new one cannot be forgotten here.
        let Tally {
            calls,
            requests,
            calls_uncorrected,
            requests_uncorrected,
            requests_failed_latency,
            sent,
            outcomes,
            retries,
            retries_refused,
            requests_due,
            requests_ok,
            requests_failed,
            requests_not_sent,
            requests_backlogged,
            wire_out,
            wire_in,
            payload_out_plain,
            payload_out_wire,
            payload_in_plain,
            payload_in_wire,
            texts,
        } = self;
        for h in [
            calls,
            requests,
            calls_uncorrected,
            requests_uncorrected,
            requests_failed_latency,
        ] {
            h.reset();
        }
        texts.clear();
        *outcomes = [0; CallOutcome::COUNT];
        *retries = [0; RetryReason::COUNT];
        *retries_refused = [0; RetryReason::COUNT];
        for n in [
            sent,
            requests_due,
            requests_ok,
            requests_failed,
            requests_not_sent,
            requests_backlogged,
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

    /// Counts a finished call, with its latency in µs when it succeeded.
    pub fn call(&mut self, outcome: CallOutcome, latency: Took) {
        self.outcomes[outcome.index()] += 1;
        if outcome.is_ok() {
            self.calls.record_us(latency.us);
            if let Some(us) = latency.uncorrected_us {
                self.calls_uncorrected.record_us(us);
            }
        }
    }

    /// Counts a finished request, with its latency among the successful ones' or the
    /// failed ones'.
    pub fn request(&mut self, failed: bool, latency: Took) {
        if failed {
            self.requests_failed += 1;
            self.requests_failed_latency.record_us(latency.us);
            return;
        }
        self.requests_ok += 1;
        self.requests.record_us(latency.us);
        if let Some(us) = latency.uncorrected_us {
            self.requests_uncorrected.record_us(us);
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

    /// Times calls were sent again, for any reason.
    pub fn retried(&self) -> u64 {
        self.retries.iter().sum()
    }

    /// Counts by reason label (`retries` or `retries_refused`), the reasons that happened
    /// only.
    pub fn by_reason(counts: &[u64; RetryReason::COUNT]) -> BTreeMap<String, u64> {
        RetryReason::ALL
            .iter()
            .map(|r| (r.label().to_string(), counts[*r as usize]))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Adds what each of `cells` (the workers' figures, shared) holds, and clears them.
    pub fn take_from(&mut self, cells: &[std::sync::Mutex<Tally>]) {
        for m in cells {
            let mut t = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.add(&t);
            t.clear();
        }
    }

    /// Adds another tally.
    pub fn add(&mut self, o: &Tally) {
        for (a, b) in self.latencies_mut().into_iter().zip(o.latencies()) {
            a.add(b);
        }
        self.requests_failed_latency.add(&o.requests_failed_latency);
        self.sent += o.sent;
        for (a, b) in self.outcomes.iter_mut().zip(o.outcomes) {
            *a += b;
        }
        for (a, b) in self.retries.iter_mut().zip(o.retries) {
            *a += b;
        }
        for (a, b) in self.retries_refused.iter_mut().zip(o.retries_refused) {
            *a += b;
        }
        self.requests_due += o.requests_due;
        self.requests_ok += o.requests_ok;
        self.requests_failed += o.requests_failed;
        self.requests_not_sent += o.requests_not_sent;
        self.requests_backlogged += o.requests_backlogged;
        self.wire_out += o.wire_out;
        self.wire_in += o.wire_in;
        self.payload_out_plain += o.payload_out_plain;
        self.payload_out_wire += o.payload_out_wire;
        self.payload_in_plain += o.payload_in_plain;
        self.payload_in_wire += o.payload_in_wire;
        if !o.texts.is_empty() {
            self.texts.add(&o.texts);
        }
    }
}

/// How long a call or request took, in µs: from its intended start, and (open loop only)
/// from its actual start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Took {
    /// From the intended start (the actual one in the closed loop).
    pub us: u64,
    /// Open loop: from the actual start.
    pub uncorrected_us: Option<u64>,
}

impl Took {
    /// The time from `intended` (and, in the open loop, from `started`) to `now`.
    pub fn between(intended: Instant, started: Instant, now: Instant, open_loop: bool) -> Took {
        let us = |from: Instant| now.saturating_duration_since(from).as_micros() as u64;
        Took {
            us: us(intended),
            uncorrected_us: open_loop.then(|| us(started)),
        }
    }
}

/// The figures a connection keeps: the run's, per step of the schedule (what the report
/// gives: only what was meant to start in the measured window, by the step its intended
/// start falls in; one step but for rate ramps and steps), and the interval's (everything
/// since the last tick, warm-up included: the progress line and the shared metrics), and,
/// with `--hdr-log`, the measured figures since the log last took them. Every event is
/// entered in all of them by one call, so they cannot drift apart. `step` is `None` for
/// what belongs to the warm-up.
#[derive(Debug)]
pub struct Books {
    /// The measured window's figures, by step.
    pub steps: Vec<Tally>,
    /// Figures since the last tick.
    pub interval: Tally,
    /// With `--hdr-log`: the measured figures since the last tick, at full precision (the
    /// interval log's; its intervals add up to the steps').
    pub log: Option<Tally>,
    /// The largest latency entered so far, warm-up included, µs: what a step made ahead
    /// of time is sized for.
    largest_us: u64,
}

impl Default for Books {
    fn default() -> Self {
        Books {
            steps: Vec::new(),
            interval: Tally::interval(),
            log: None,
            largest_us: 0,
        }
    }
}

impl Books {
    /// Enters `f` in the interval's figures, and in step `step`'s when measured.
    fn both(&mut self, step: Option<usize>, f: impl Fn(&mut Tally)) {
        f(&mut self.interval);
        if let Some(t) = self.step(step) {
            f(t);
            if let Some(log) = &mut self.log {
                f(log);
            }
        }
    }

    /// Keeps the measured figures for the interval log too.
    pub fn logging(mut self) -> Self {
        self.log = Some(Tally::default());
        self
    }

    /// Makes the figures of measured step `step` (and of any before it) now, if they are not
    /// made yet, with histograms sized for [`PREPARED_HEADROOM`] times the largest latency
    /// seen so far. A worker calls it on its tick ahead of the step's start: made when the
    /// step's first call ends instead, every connection would make its figures at that
    /// same moment, holding the thread while calls are in flight (the measured window's
    /// first calls would then measure the driver).
    pub fn prepare(&mut self, step: Option<usize>) {
        let Some(i) = step else { return };
        if self.steps.len() <= i {
            let high = self.largest_us.saturating_mul(PREPARED_HEADROOM);
            self.steps.resize_with(i + 1, || Tally::covering(high));
        }
    }

    /// The figures of a measured step (made when first needed, if not prepared).
    fn step(&mut self, step: Option<usize>) -> Option<&mut Tally> {
        self.prepare(step);
        self.steps.get_mut(step?)
    }

    /// A call was issued.
    pub fn sent(&mut self, step: Option<usize>) {
        self.both(step, |t| t.sent += 1);
    }

    /// A call is sent again, for `why`.
    pub fn retried(&mut self, step: Option<usize>, why: RetryReason) {
        self.both(step, |t| t.retries[why as usize] += 1);
    }

    /// A call safe to send again for `why` was not: the retry budget was spent.
    pub fn retry_refused(&mut self, step: Option<usize>, why: RetryReason) {
        self.both(step, |t| t.retries_refused[why as usize] += 1);
    }

    /// A call ended with `outcome`, having taken `latency`.
    pub fn call(&mut self, step: Option<usize>, outcome: CallOutcome, latency: Took) {
        self.saw(latency);
        self.both(step, |t| t.call(outcome, latency));
    }

    /// A failed call of measured step `step` (with `outcome`) said `text` in its reply: kept
    /// for the report's breakdown only (the progress line and the metrics count outcomes).
    pub fn failure_text(&mut self, step: Option<usize>, outcome: CallOutcome, text: &[u8]) {
        if let Some(t) = self.step(step) {
            t.texts.record(outcome, text);
        }
    }

    /// A request ended, having taken `latency`.
    pub fn request(&mut self, step: Option<usize>, failed: bool, latency: Took) {
        self.saw(latency);
        self.both(step, |t| t.request(failed, latency));
    }

    fn saw(&mut self, latency: Took) {
        let us = latency.us.max(latency.uncorrected_us.unwrap_or(0));
        self.largest_us = self.largest_us.max(us);
    }

    /// A request is due (it will start, now or from the backlog, or be not sent).
    pub fn due(&mut self, step: Option<usize>) {
        self.both(step, |t| t.requests_due += 1);
    }

    /// Open loop: a request due found every slot busy and the backlog full.
    pub fn not_sent(&mut self, step: Option<usize>) {
        self.both(step, |t| t.requests_not_sent += 1);
    }

    /// Open loop: a request started late, from the backlog.
    pub fn backlogged(&mut self, step: Option<usize>) {
        self.both(step, |t| t.requests_backlogged += 1);
    }

    /// A request payload was written.
    pub fn payload_out(&mut self, step: Option<usize>, size: PayloadSize) {
        self.both(step, |t| {
            t.payload_out_plain += size.plain as u64;
            t.payload_out_wire += size.wire as u64;
        });
    }

    /// A reply payload was read.
    pub fn payload_in(&mut self, step: Option<usize>, size: PayloadSize) {
        self.both(step, |t| {
            t.payload_in_plain += size.plain as u64;
            t.payload_in_wire += size.wire as u64;
        });
    }

    /// Bytes moved on the wire; only the run counts them (the interval's wire bytes reach
    /// the metrics straight from the connection).
    pub fn wire(&mut self, step: Option<usize>, written: u64, read: u64) {
        if let Some(t) = self.step(step) {
            t.wire_out += written;
            t.wire_in += read;
        }
    }

    /// Takes the interval's figures (for the tick), leaving it empty.
    pub fn take_interval(&mut self, into: &mut Tally) {
        into.add(&self.interval);
        self.interval.clear();
    }

    /// Takes the interval log's figures since the last tick, if it is kept.
    pub fn take_log(&mut self, into: &mut Tally) {
        if let Some(log) = &mut self.log {
            into.add(log);
            log.clear();
        }
    }
}

/// What a worker hands back.
#[derive(Debug, Default)]
pub(crate) struct WorkerFigures {
    /// The measured window's figures, by step of the schedule.
    pub steps: Vec<Tally>,
    /// Connection attempts that failed.
    pub connect_failures: u64,
    /// Times a worker went back to its own target after moving away.
    pub returned_home: u64,
    /// Replies that came after their call had timed out.
    pub late_replies: u64,
    /// When the last measured call finished.
    pub last_done: Option<Instant>,
    /// Open loop: how late measured requests that found a free slot started after their
    /// intended time, µs (the pacer's precision).
    pub lag: Latency,
}

impl WorkerFigures {
    /// Adds another worker's figures (the run's are the sum of its workers').
    pub fn add(&mut self, o: &WorkerFigures) {
        if self.steps.len() < o.steps.len() {
            self.steps.resize_with(o.steps.len(), Tally::default);
        }
        for (a, b) in self.steps.iter_mut().zip(&o.steps) {
            a.add(b);
        }
        self.connect_failures += o.connect_failures;
        self.returned_home += o.returned_home;
        self.late_replies += o.late_replies;
        self.last_done = self.last_done.max(o.last_done);
        self.lag.add(&o.lag);
    }
}

/// The sum of the steps' figures: the whole measured window's.
pub fn total(steps: &[Tally]) -> Tally {
    let mut t = Tally::default();
    for s in steps {
        t.add(s);
    }
    t
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
    fn calls_above_a_threshold_are_counted_apart_from_the_percentiles() {
        let mut h = Latency::default();
        assert_eq!(h.count_above_us(30_000), 0);
        for us in [100, 200, 29_000, 30_000, 41_000, 45_000] {
            h.record_us(us);
        }
        assert_eq!(h.count_above_us(30_000), 2);
        assert_eq!(h.count_above_us(45_000), 0);
        assert_eq!(h.count_above_us(0), 6);
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

    /// The counts array's length: what a histogram's memory grows with.
    fn size(h: &Latency) -> usize {
        h.histogram().distinct_values()
    }

    #[test]
    fn a_histogram_takes_the_memory_of_the_latencies_it_holds_not_of_its_whole_range() {
        let whole = Histogram::<u64>::new_with_bounds(1, MAX_LATENCY_US, SIGFIGS).unwrap();
        let mut h = Latency::default();
        assert!(
            size(&h) * 8 <= whole.distinct_values(),
            "{} of {}",
            size(&h),
            whole.distinct_values()
        );
        h.record_us(500);
        let small = size(&h);
        h.record_us(80_000);
        assert!(size(&h) > small, "it grows for a larger latency");
        assert!(size(&h) < whole.distinct_values() / 2);
        h.record_us(u64::MAX);
        assert_eq!(
            size(&h),
            whole.distinct_values(),
            "and no further than the largest latency kept"
        );
        let s = h.summary();
        assert_eq!(s.count, 3);
        assert!((s.p50_ms - 80.0).abs() < 0.1, "{s:?}");
    }

    #[test]
    fn histograms_of_different_ranges_add_up_sample_for_sample() {
        let mut small = Latency::default();
        for us in [100, 200, 300] {
            small.record_us(us);
        }
        let mut large = Latency::interval();
        large.record_us(45_000);
        let mut a = small.clone();
        a.add(&large);
        let mut b = large.clone();
        b.add(&small);
        for h in [&a, &b] {
            assert_eq!(h.count(), 4);
            assert_eq!(h.count_above_us(30_000), 1);
            assert!((h.summary().max_ms - 45.0).abs() < 0.5, "{:?}", h.summary());
        }
    }

    #[test]
    fn a_prepared_step_holds_latencies_like_those_seen_before_without_growing() {
        let mut b = Books::default();
        b.call(None, CallOutcome::Ok, us(30_000));
        b.prepare(Some(1));
        assert_eq!(b.steps.len(), 2, "a step and every one before it");
        let before: Vec<usize> = b.steps[0].latencies().iter().map(|h| size(h)).collect();
        b.sent(Some(0));
        b.call(Some(0), CallOutcome::Ok, us(55_000));
        b.request(Some(0), false, us(55_000));
        let after: Vec<usize> = b.steps[0].latencies().iter().map(|h| size(h)).collect();
        assert_eq!(before, after, "the step's first figures grow nothing");
        assert_eq!(b.steps[0].calls.count(), 1);
        b.prepare(Some(0));
        assert_eq!(
            b.steps[0].calls.count(),
            1,
            "preparing again keeps the figures"
        );
        b.prepare(None);
        assert_eq!(b.steps.len(), 2, "the warm-up has no step");
    }

    fn us(n: u64) -> Took {
        Took {
            us: n,
            uncorrected_us: None,
        }
    }

    #[test]
    fn the_open_loop_keeps_both_figures_and_the_closed_loop_one() {
        let t0 = Instant::now();
        let started = t0 + std::time::Duration::from_millis(900);
        let now = t0 + std::time::Duration::from_millis(1000);
        let open = Took::between(t0, started, now, true);
        assert_eq!(
            open,
            Took {
                us: 1_000_000,
                uncorrected_us: Some(100_000)
            }
        );
        let closed = Took::between(started, started, now, false);
        assert_eq!(
            closed,
            Took {
                us: 100_000,
                uncorrected_us: None
            }
        );
        let mut t = Tally::default();
        t.request(false, open);
        t.call(CallOutcome::Ok, open);
        assert_eq!(t.requests.quantile_us(0.5) / 1000, 1000);
        assert_eq!(t.requests_uncorrected.quantile_us(0.5) / 1000, 100);
        assert_eq!(t.calls_uncorrected.count(), 1);
        t.request(false, closed);
        assert_eq!(
            t.requests_uncorrected.count(),
            1,
            "the closed loop has no second figure"
        );
    }

    #[test]
    fn failed_requests_are_timed_apart_from_the_successful_ones() {
        let mut t = Tally::default();
        let open = |ms: u64| Took {
            us: ms * 1000,
            uncorrected_us: Some(ms * 500),
        };
        t.request(false, open(10));
        t.request(true, open(1));
        t.request(true, open(2));
        assert_eq!((t.requests_ok, t.requests_failed), (1, 2));
        assert_eq!(t.requests.count(), 1, "successful requests only");
        assert_eq!(t.requests.quantile_us(0.5) / 1000, 10);
        assert_eq!(t.requests_uncorrected.count(), 1);
        assert_eq!(t.requests_failed_latency.count(), 2);
        let mut sum = Tally::default();
        sum.add(&t);
        assert_eq!(sum.requests_failed_latency.count(), 2);
        sum.clear();
        assert_eq!(sum.requests_failed_latency.count(), 0);
    }

    #[test]
    fn tallies_add_up() {
        use rpcmesh_wire::Status;
        let mut a = Tally {
            sent: 3,
            ..Tally::default()
        };
        a.call(CallOutcome::Ok, us(10));
        a.call(CallOutcome::Ok, us(10));
        a.call(CallOutcome::NoReply, us(0));
        let mut b = Tally {
            sent: 3,
            ..Tally::default()
        };
        b.call(CallOutcome::Ok, us(20));
        b.call(CallOutcome::NoReply, us(0));
        b.call(CallOutcome::Replied(Status::Overloaded), us(0));
        a.add(&b);
        assert_eq!(a.sent, 6);
        assert_eq!(a.ok() + a.failed(), 6);
        let errors: Vec<(&str, u64)> = a.errors().collect();
        assert_eq!(errors, [("overloaded", 1), ("no_reply", 2)]);
        assert_eq!(a.calls.count(), 3, "latency of successful calls only");
    }

    #[test]
    fn the_run_counts_only_what_is_measured_by_step_and_the_interval_everything() {
        let mut b = Books::default();
        b.sent(None);
        b.call(None, CallOutcome::Ok, us(5));
        b.sent(Some(0));
        b.call(Some(0), CallOutcome::Connection, us(7));
        b.request(Some(0), true, us(12));
        b.sent(Some(2));
        b.wire(None, 100, 50);
        b.wire(Some(0), 10, 5);
        let s0 = &b.steps[0];
        assert_eq!((s0.sent, s0.ok(), s0.failed()), (1, 0, 1));
        assert_eq!((s0.requests_failed, s0.wire_out, s0.wire_in), (1, 10, 5));
        assert_eq!(b.steps.len(), 3, "steps are made as they are needed");
        assert_eq!(b.steps[1].sent, 0);
        assert_eq!(total(&b.steps).sent, 2);
        let i = &b.interval;
        assert_eq!((i.sent, i.ok(), i.failed()), (3, 1, 1));
        let mut second = Tally::interval();
        b.take_interval(&mut second);
        assert_eq!(second.sent, 3);
        assert_eq!(b.interval.sent, 0);
        assert_eq!(b.interval.calls.count(), 0);
        assert_eq!(b.steps[0].sent, 1, "the run keeps its figures");
    }
}
