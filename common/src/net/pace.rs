//! How long one call takes on one connection, kept where tasks on several threads feed and
//! read it without a lock: as a moving average of the samples (a provider's own time) or as
//! their lower envelope (the broker's timing of a plain v1 server, whose intervals a round
//! trip or a wait for a CPU mostly lengthens).
//!
//! A connection's calls are worked through one after another: by a plain v1 server (one
//! call at a time, in order) and by an rpcmesh provider (its session task runs a read's
//! handlers in turn, on one thread). A call packed onto a busy connection waits for the
//! ones ahead of it, so the broker packs a provider's connections only as deep as this
//! time allows (`broker::upstream::pace`). The broker measures it for a plain v1 server
//! (between two reads of a connection with calls waiting); an rpcmesh provider measures
//! its own (a read's frames, decoded, handled and encoded, over the calls whose handlers
//! ran within it) and reports it in its answer to the broker's heartbeat ([`HEARTBEAT_KEY`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The heartbeat pair that carries the time per call (`rpcmesh_wire::body::Heartbeat`'s
/// extra pairs): a broker's heartbeat to an rpcmesh provider carries it with an empty value
/// (a question), and the provider answers with its average in nanoseconds (`"0"` before its
/// first call). A plain v1 peer never sees it: only rpcmesh providers are asked, and they
/// answer only when asked.
pub const HEARTBEAT_KEY: &str = "rpcmesh-ns-per-call";

/// Weight of a new sample in the moving average, as a right shift: 1/32. Samples are
/// noisy (a read's work varies with what else the thread did): a weight of 1/8 swung the
/// broker's packing depth between about 6 and 14 around the 8 calls of the bench's shape
/// and cost it 8 % of its calls/s. A connection that turns slow still shows it within a
/// few calls: two calls of 2 ms take the average from 7 µs to over 100 µs.
const SHIFT: u32 = 5;

/// One sample in nanoseconds per call (at least 1): `calls` calls worked through in `busy`;
/// none without a call.
fn sample_nanos(busy: Duration, calls: usize) -> Option<u64> {
    (calls > 0).then(|| {
        u64::try_from(busy.as_nanos() / calls as u128)
            .unwrap_or(u64::MAX)
            .max(1)
    })
}

/// Nanoseconds per call, a moving average or a lower envelope of the samples (whichever its
/// feeder uses); 0 means nothing measured yet.
#[derive(Debug, Default)]
pub struct PerCall {
    ns: AtomicU64,
}

impl PerCall {
    /// Nothing measured yet.
    pub fn new() -> Self {
        PerCall::default()
    }

    /// Takes one sample into the moving average: `calls` calls worked through in `busy`.
    pub fn note(&self, busy: Duration, calls: usize) {
        let Some(sample) = sample_nanos(busy, calls) else {
            return;
        };
        // A lost update between two tasks on different threads loses a sample, no more:
        // neither way of keeping it needs a lock.
        let old = self.ns.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - (old >> SHIFT) + (sample >> SHIFT)
        };
        self.ns.store(new.max(1), Ordering::Relaxed);
    }

    /// Takes one sample into the lower envelope: a sample below it takes it down by
    /// 1/2^`fall_shift` of the gap (0: to the sample); one above raises it by
    /// 1/2^`rise_shift` of itself, never past the sample.
    pub fn note_lowest(&self, busy: Duration, calls: usize, fall_shift: u32, rise_shift: u32) {
        let Some(sample) = sample_nanos(busy, calls) else {
            return;
        };
        let old = self.ns.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else if sample <= old {
            (old - ((old - sample) >> fall_shift)).max(1)
        } else {
            sample.min(old.saturating_add((old >> rise_shift).max(1)))
        };
        self.ns.store(new, Ordering::Relaxed);
    }

    /// Takes one sample as a floor: raises it to the sample, or leaves it (the start of a
    /// lower envelope, the longest of its first samples).
    pub fn note_highest(&self, busy: Duration, calls: usize) {
        if let Some(sample) = sample_nanos(busy, calls) {
            self.ns.fetch_max(sample, Ordering::Relaxed);
        }
    }

    /// Raises it to `at_least` at once (a call seen to take that long), or leaves it.
    pub fn raise_to(&self, at_least: Duration) {
        let at_least = u64::try_from(at_least.as_nanos()).unwrap_or(u64::MAX);
        self.ns.fetch_max(at_least, Ordering::Relaxed);
    }

    /// Replaces the average with one measured elsewhere (a provider's report); `None`
    /// forgets it.
    pub fn set(&self, per_call: Option<Duration>) {
        let ns = per_call.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        self.ns.store(ns, Ordering::Relaxed);
    }

    /// The average, if anything was measured.
    pub fn get(&self) -> Option<Duration> {
        match self.nanos() {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// The average in nanoseconds, 0 when nothing was measured (one relaxed load, for
    /// readers on the call path).
    pub fn nanos(&self) -> u64 {
        self.ns.load(Ordering::Relaxed)
    }

    /// The average as the heartbeat pair's value: nanoseconds, `"0"` when nothing was
    /// measured.
    pub fn to_heartbeat_value(&self) -> String {
        self.nanos().to_string()
    }

    /// Reads a heartbeat pair's value: `None` for `"0"`, an empty or a malformed value.
    pub fn parse_heartbeat_value(value: &str) -> Option<Duration> {
        match value.parse::<u64>() {
            Ok(0) | Err(_) => None,
            Ok(ns) => Some(Duration::from_nanos(ns)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn the_first_sample_is_taken_whole_and_later_ones_weigh_a_thirty_second() {
        let p = PerCall::new();
        assert_eq!(p.get(), None);
        p.note(10 * US, 0);
        assert_eq!(p.get(), None, "no calls, no sample");
        p.note(20 * US, 4);
        assert_eq!(p.get(), Some(5 * US));
        p.note(37 * US, 1);
        assert_eq!(p.get(), Some(6 * US), "5 µs + (37 − 5) / 32");
        p.set(None);
        assert_eq!(p.get(), None);
        p.set(Some(2 * US));
        assert_eq!(p.get(), Some(2 * US));
    }

    #[test]
    fn the_heartbeat_value_round_trips_and_zero_or_junk_means_unmeasured() {
        let p = PerCall::new();
        assert_eq!(p.to_heartbeat_value(), "0");
        assert_eq!(PerCall::parse_heartbeat_value("0"), None);
        p.note(1500 * Duration::from_nanos(1), 1);
        assert_eq!(p.to_heartbeat_value(), "1500");
        assert_eq!(
            PerCall::parse_heartbeat_value("1500"),
            Some(Duration::from_nanos(1500))
        );
        for junk in ["", "-3", "1e3", "x", "18446744073709551616"] {
            assert_eq!(PerCall::parse_heartbeat_value(junk), None, "{junk:?}");
        }
    }
}
