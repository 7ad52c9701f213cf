//! How fast a plain v1 server works through the calls queued on one connection, and so how
//! many calls the router may pack onto one of its connections.
//!
//! A plain v1 server answers a connection's calls one at a time, in order. Calls packed
//! onto one of its connections therefore wait for each other, where calls spread over the
//! pool might run side by side (a server with a thread per connection). But a server that
//! answers faster than a call crosses the broker gains from packing what an rpcmesh
//! provider gains (`route::Router`): it reads several requests at once, its Nagle-held
//! replies leave together after the broker's ACK, and the broker reads them together. On
//! 2 vCPUs behind the classic server at 8 calls in flight over 8 client connections,
//! packing all of them onto one connection instead of two on each of four raised the
//! broker path's calls/s by a quarter and cut its p99.9 (docs/performance.md).
//!
//! So the router packs a plain v1 server's connections only as deep as keeps the wait
//! short: a call may have at most as many calls ahead of it on its connection as the
//! server answers in `--pack-wait-v1` ([`DEFAULT_PACK_WAIT_V1`], 100 µs). How long the
//! server takes per call is measured on the connections themselves ([`Backlog`]): between
//! two reads of a connection that had calls written and unanswered at the first, the
//! server was working through that connection's queue, so the time between them divided
//! by the replies the second read brought is the time it takes per call on that
//! connection (its work on other connections meanwhile included, which is the wait a
//! packed call sees). The pool keeps a moving average of those samples ([`Pace`]). A connection whose server has answered
//! nothing for longer than the wait while calls wait there is timed at its deadline sweep
//! too ([`Backlog::on_sweep`]; every 100 ms at the default call timeout), so that a server
//! that hangs on a call stops being packed without waiting for a reply that may never
//! come. Until there is a sample, and whenever the server is slower than the wait per
//! call, nothing is packed: the less loaded of two connections takes each call, as before
//! the pace was measured.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[cfg(doc)]
use crate::config::DEFAULT_PACK_WAIT_V1;

/// Weight of a new sample in the pool's moving average, as a right shift: 1/32. The
/// samples are noisy (an interval also holds the server's wake-ups and the broker's own
/// delays before it reads: behind the classic server, mostly 2–4 µs with a third over
/// 14 µs): with 1/8 the depth swung between about 6 and 14 around the 8 calls of the
/// bench's shape, and the broker path did 8 % fewer calls/s (8 alternating pairs). A
/// server that turns slow still stops packing within a few calls: two calls of 2 ms take
/// the average from 7 µs to over 100 µs.
const PACE_SHIFT: u32 = 5;

/// A pool's moving average of how long its plain v1 server takes per call on one
/// connection. Shared by the pool's connection tasks (which feed it) and the router (which
/// reads it per call, one relaxed load).
#[derive(Debug)]
pub(crate) struct Pace {
    /// Nanoseconds per call, averaged; 0 = no sample yet.
    per_call_ns: AtomicU64,
    /// How long a packed call may wait (`--pack-wait-v1`); zero = never pack.
    wait: Duration,
}

impl Pace {
    /// No sample yet; packs as deep as keeps a call's wait under `wait`.
    pub fn new(wait: Duration) -> Self {
        Pace {
            per_call_ns: AtomicU64::new(0),
            wait,
        }
    }

    /// Takes one sample: `replies` calls answered over `busy`.
    pub fn note(&self, busy: Duration, replies: usize) {
        if replies == 0 {
            return;
        }
        let sample = u64::try_from(busy.as_nanos() / replies as u128)
            .unwrap_or(u64::MAX)
            .max(1);
        // A lost update between two connection tasks on different threads loses a
        // sample, no more: the average needs no lock.
        let old = self.per_call_ns.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - (old >> PACE_SHIFT) + (sample >> PACE_SHIFT)
        };
        self.per_call_ns.store(new.max(1), Ordering::Relaxed);
    }

    /// The time per call the pool has measured, if any (the pool's keeper publishes it as
    /// `rpcmesh_upstream_v1_pace_seconds`).
    pub fn per_call(&self) -> Option<Duration> {
        match self.per_call_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// How many calls one connection may hold before the router goes on to the next, as
    /// `--pack-in-flight` says it (`pack`, the most): one more than the server answers in
    /// the wait, or 0 (no packing) when no call may wait at all, or nothing is measured.
    pub fn depth(&self, pack: usize) -> usize {
        let ns = self.per_call_ns.load(Ordering::Relaxed);
        if ns == 0 {
            return 0;
        }
        match usize::try_from(self.wait.as_nanos() / u128::from(ns)).unwrap_or(usize::MAX) {
            0 => 0,
            ahead => ahead.saturating_add(1).min(pack),
        }
    }
}

/// One connection's side of the measurement: what was waiting at the server at its last
/// read.
#[derive(Debug, Default)]
pub(crate) struct Backlog {
    /// When the last read that left written calls unanswered ended, and how many it left.
    since: Option<(Instant, usize)>,
}

impl Backlog {
    /// After a read at `now` that answered `answered` calls and left `waiting` calls
    /// written and unanswered: when calls were waiting at the server since the last read,
    /// `pace` takes the time since then per call answered (at most as many as were
    /// waiting: calls written after that read were not at the server all along). A read
    /// that answered nothing (a partial frame, a heartbeat) keeps the interval open.
    pub fn on_read(&mut self, now: Instant, answered: usize, waiting: usize, pace: &Pace) {
        if answered == 0 && self.since.is_some() {
            return;
        }
        if let Some((then, before)) = self.since {
            pace.note(now.saturating_duration_since(then), answered.min(before));
        }
        self.since = (waiting > 0).then_some((now, waiting));
    }

    /// At the connection's deadline sweep (`now`, while calls are in flight): a server
    /// that has answered nothing for longer than a packed call may wait, with calls
    /// waiting there, has taken at least that long over its current call. `pace` takes
    /// that as a sample at once, so that a server that stalls or hangs on a call stops
    /// being packed within a sweep instead of at its next reply (which may never come),
    /// and the interval starts again from here.
    pub fn on_sweep(&mut self, now: Instant, pace: &Pace) {
        let Some((then, waiting)) = self.since else {
            return;
        };
        let silent = now.saturating_duration_since(then);
        if silent > pace.wait && !pace.wait.is_zero() {
            pace.note(silent, 1);
            self.since = Some((now, waiting));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);
    const WAIT: Duration = crate::config::DEFAULT_PACK_WAIT_V1;

    fn new_pace() -> Pace {
        Pace::new(WAIT)
    }

    #[test]
    fn no_sample_no_packing() {
        let pace = new_pace();
        assert_eq!(pace.per_call(), None);
        assert_eq!(pace.depth(64), 0);
    }

    #[test]
    fn depth_is_one_more_than_the_calls_answered_in_the_wait() {
        let pace = new_pace();
        pace.note(5 * US, 1);
        assert_eq!(pace.per_call(), Some(5 * US));
        assert_eq!(
            pace.depth(64),
            21,
            "100 µs / 5 µs calls ahead, plus the call"
        );
        assert_eq!(pace.depth(8), 8, "never beyond --pack-in-flight");
        assert_eq!(pace.depth(0), 0, "--pack-in-flight 0 turns packing off");
        let slow = new_pace();
        slow.note(Duration::from_millis(20), 1);
        assert_eq!(
            slow.depth(64),
            0,
            "a slow server's connections are not packed"
        );
        let edge = new_pace();
        edge.note(WAIT, 1);
        assert_eq!(edge.depth(64), 2, "one call may wait one call's time");
        let never = Pace::new(Duration::ZERO);
        never.note(US, 1);
        assert_eq!(never.depth(64), 0, "--pack-wait-v1 0 turns it off");
    }

    #[test]
    fn the_average_moves_a_thirty_second_per_sample() {
        let pace = new_pace();
        pace.note(80 * US, 8);
        assert_eq!(
            pace.per_call(),
            Some(10 * US),
            "the first sample is taken whole"
        );
        // 10 − 10/32 + 2000/32 = 72.1875 µs: one slow call halves the depth ...
        pace.note(Duration::from_millis(2), 1);
        assert_eq!(pace.per_call(), Some(Duration::from_nanos(72_188)));
        assert_eq!(pace.depth(64), 2);
        // ... and a second stops packing.
        pace.note(Duration::from_millis(2), 1);
        assert_eq!(pace.depth(64), 0, "{:?}", pace.per_call());
        // Fast calls bring it back, more slowly.
        for _ in 0..150 {
            pace.note(5 * US, 1);
        }
        assert!(pace.depth(64) >= 8, "{:?}", pace.per_call());
        pace.note(Duration::ZERO, 0);
        assert!(
            pace.per_call().is_some(),
            "a read with no reply is no sample"
        );
    }

    #[test]
    fn only_calls_waiting_since_the_last_read_are_timed() {
        let pace = new_pace();
        let mut backlog = Backlog::default();
        let t0 = Instant::now();
        // Nothing was waiting before the first read: no sample, however long it took.
        backlog.on_read(t0, 1, 2, &pace);
        assert_eq!(pace.per_call(), None);
        // Two were waiting; this read brought three replies, the third for a call written
        // after the last read: 30 µs over the two.
        backlog.on_read(t0 + 30 * US, 3, 0, &pace);
        assert_eq!(pace.per_call(), Some(15 * US));
        // Nothing was left waiting: the next read's interval includes the request's way
        // to the server and is not a sample.
        backlog.on_read(t0 + Duration::from_millis(5), 1, 1, &pace);
        assert_eq!(pace.per_call(), Some(15 * US));
    }

    #[test]
    fn a_server_that_answers_nothing_is_timed_at_the_sweep() {
        let pace = new_pace();
        let mut backlog = Backlog::default();
        let t0 = Instant::now();
        backlog.on_sweep(t0 + Duration::from_secs(1), &pace);
        assert_eq!(pace.per_call(), None, "nothing was waiting");
        backlog.on_read(t0, 1, 3, &pace);
        backlog.on_read(t0 + 5 * US, 1, 2, &pace);
        assert_eq!(pace.depth(64), 21);
        // A sweep within the wait says nothing ...
        backlog.on_sweep(t0 + 50 * US, &pace);
        assert_eq!(pace.per_call(), Some(5 * US));
        // ... one after 20 ms of silence stops the packing, before any reply ...
        backlog.on_sweep(t0 + Duration::from_millis(20), &pace);
        assert_eq!(pace.depth(64), 0, "{:?}", pace.per_call());
        // ... and the reply that ends the silence is timed from that sweep.
        let before = pace.per_call().unwrap();
        backlog.on_read(t0 + Duration::from_millis(20) + 10 * US, 1, 1, &pace);
        let after = pace.per_call().unwrap();
        assert!(after < before, "{before:?} -> {after:?}");
    }

    #[test]
    fn a_read_without_replies_keeps_the_interval_open() {
        let pace = new_pace();
        let mut backlog = Backlog::default();
        let t0 = Instant::now();
        backlog.on_read(t0, 1, 1, &pace);
        backlog.on_read(t0 + 4 * US, 0, 1, &pace);
        assert_eq!(pace.per_call(), None);
        backlog.on_read(t0 + 12 * US, 1, 0, &pace);
        assert_eq!(
            pace.per_call(),
            Some(12 * US),
            "timed from the read that left it waiting"
        );
    }
}
