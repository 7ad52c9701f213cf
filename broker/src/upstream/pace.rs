//! How fast a provider works through the calls queued on one of its connections, and so
//! how many calls the router may pack onto one connection.
//!
//! A connection's calls are worked through one after another: a plain v1 server answers
//! them one at a time, in order, and an rpcmesh provider's session task runs a read's
//! handlers in turn on one thread. Calls packed onto one connection therefore wait for
//! each other, where calls spread over the pool might run side by side (a server with a
//! thread per connection, a provider with several worker threads). But a provider that
//! answers faster than a call crosses the broker gains from packing: it reads several
//! requests at once, writes their replies together, and the broker reads them together
//! (`route::Router`; on 2 vCPUs at 64 calls in flight, 10–15 % more calls/s, and behind
//! the classic server at 8 in flight a quarter more: docs/performance.md, "What each
//! optimisation bought" and "Packing a plain v1 server's connections by its measured
//! pace").
//!
//! So the router packs a provider's connections only as deep as keeps the wait short: a
//! call may have at most as many calls ahead of it on its connection as the provider
//! answers in `--pack-wait` ([`DEFAULT_PACK_WAIT`], 100 µs). Where the time per call comes
//! from depends on the provider ([`Source`]):
//!
//! - **A plain v1 server** is timed on the connections themselves ([`Backlog`]): between
//!   two reads of a connection that had calls written and unanswered at the first, the
//!   server was working through that connection's queue, so the time between them divided
//!   by the replies the second read brought is the time it takes per call on that
//!   connection (its work on other connections meanwhile included, which is the wait a
//!   packed call sees). An interval is that work plus whatever else kept the next read
//!   back: a reply's round trip (the server's Nagle holds a reply until the broker's ACK),
//!   the broker's or the server's wait for a CPU. Those mostly add, and they do not grow
//!   with the depth, so the pool keeps a *lower envelope* of the samples
//!   ([`ENVELOPE_FALL_SHIFT`], [`ENVELOPE_RISE_SHIFT`]), not their average: with two calls
//!   on a connection a read brings one reply, the interval is a round trip (60–110 µs
//!   behind a server that works a few µs per call, on a busy machine), and an average of
//!   those would keep the depth at 2 and the calls spread for good, where packed deeper
//!   the same server shows its few µs. It starts at the longest of the first few samples
//!   ([`ENVELOPE_FIRST_SAMPLES`]). Only a read that brought a reply starts an interval
//!   ([`Backlog`]). A connection whose server has answered nothing for longer
//!   than the wait while calls wait there is timed at its deadline sweep too
//!   ([`Backlog::on_sweep`]; every 100 ms at the default call timeout): the envelope is
//!   raised to that silence at once, so that a server that hangs on a call stops being
//!   packed without waiting for a reply that may never come. Until there is a sample
//!   nothing is packed: the less loaded of two connections takes each call.
//! - **An rpcmesh provider** answers calls in batches, so the time between the broker's
//!   reads is mostly the round trip, not the work (behind the echo provider at 8 calls in
//!   flight it comes to 26–33 µs per call, where the provider spends under 1 µs on each).
//!   The provider measures its own time per call instead (a read's frames decoded,
//!   handled and encoded, over the calls whose handlers ran in it) and reports it in its
//!   answers to the pool's heartbeats, once per health interval per connection
//!   (`rpcmesh_common::net::pace::HEARTBEAT_KEY`). Until it has reported a time (an older
//!   rpcmesh provider never does) the connections are packed to `--pack-in-flight`: a
//!   provider with light handlers, the common case, loses nothing while the first report
//!   is on its way.
//!
//! Either way, a provider slower than the wait per call is not packed at all, and with
//! `--pack-wait 0` no provider is.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rpcmesh_common::net::pace::PerCall;
use rpcmesh_wire::PeerKind;

#[cfg(doc)]
use crate::config::DEFAULT_PACK_WAIT;

/// How fast the lower envelope of a plain v1 server's samples rises towards a sample above
/// it: by 1/2^6 = 1/64 of itself per sample, never past the sample. Slow enough that a run
/// of round trips between rarer quick samples (one in 20 at 5 µs among 60 µs ones) leaves
/// the envelope near the quick ones; a server that slows for good (from 5 µs per call to 2
/// ms) is packed no deeper than its new pace allows within about 250 samples, and one that
/// stalls within a deadline sweep ([`Backlog::on_sweep`]).
pub(crate) const ENVELOPE_RISE_SHIFT: u32 = 6;

/// How far a sample below the envelope takes it: half the way (the gap over 2^1), not all
/// of it. A sample can come out short: when the broker was kept off the CPU for a while
/// before a read, the next reply follows that read sooner than the server's time per call
/// (on this 2-vCPU machine beside two or three spinning processes, the broker is held off
/// for milliseconds). Taken whole, one such sample made a server that takes 2 ms per call
/// read 73 µs, and packed it; halved, one takes 2 ms to 1 ms, and it takes seven in a row
/// to bring it under the 100 µs wait.
pub(crate) const ENVELOPE_FALL_SHIFT: u32 = 1;

/// How many samples the envelope starts from: the longest of the first 4, then it follows
/// the fall and the rise. A short sample is likeliest to matter at the start, when there is
/// nothing yet to halve it against (behind a slow server spread over the pool, a connection
/// gives a sample only now and then); taken whole it would get the server packed until
/// enough long ones had raised the envelope a sixty-fourth at a time. A fast server is
/// packed a few samples later, no more.
pub(crate) const ENVELOPE_FIRST_SAMPLES: u32 = 4;

/// Where a pool's time per call comes from, and what the router does before it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// Timed by the broker between reads ([`Backlog`]): a plain v1 server. Unknown until
    /// timed, and a server with a thread per connection would run spread calls side by
    /// side: no packing until then.
    Measured,
    /// Reported by the provider in its heartbeat answers: an rpcmesh provider. Packed to
    /// `--pack-in-flight` until it reports.
    Reported,
}

impl Source {
    /// An rpcmesh provider's time is reported, a plain v1 server's measured.
    pub fn of(kind: PeerKind) -> Source {
        match kind {
            PeerKind::Rpcmesh => Source::Reported,
            PeerKind::V1 => Source::Measured,
        }
    }
}

/// A pool's time per call on one connection, and how deep that lets the router pack.
/// Shared by the pool's connection tasks (which feed it) and the router (which reads it
/// per call, one relaxed load).
#[derive(Debug)]
pub(crate) struct Pace {
    /// The time per call (nanoseconds, lock-free): a plain v1 server's lower envelope, an
    /// rpcmesh provider's report.
    per_call: PerCall,
    /// How long a packed call may wait (`--pack-wait`), in nanoseconds (the router divides
    /// it per read); zero = never pack.
    wait_ns: u64,
    /// Where the time comes from.
    source: Source,
    /// Samples taken so far, counted up to [`ENVELOPE_FIRST_SAMPLES`].
    first_samples: AtomicU32,
}

impl Pace {
    /// Nothing measured yet; packs as deep as keeps a call's wait under `wait`.
    pub fn new(wait: Duration, source: Source) -> Self {
        Pace {
            per_call: PerCall::new(),
            wait_ns: u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX),
            source,
            first_samples: AtomicU32::new(0),
        }
    }

    /// Takes one sample of the broker's own timing, `replies` calls answered over `busy`,
    /// into the lower envelope: the first [`ENVELOPE_FIRST_SAMPLES`] set it to the longest
    /// of them; after those a sample below it takes it down by [`ENVELOPE_FALL_SHIFT`], one
    /// above raises it by [`ENVELOPE_RISE_SHIFT`], never past the sample
    /// (`PerCall::note_lowest`).
    pub fn note(&self, busy: Duration, replies: usize) {
        if replies == 0 {
            return;
        }
        // Two connections' tasks may both count one of the first samples: the start then
        // takes one sample fewer, no more.
        let taken = self.first_samples.load(Ordering::Relaxed);
        if taken < ENVELOPE_FIRST_SAMPLES {
            self.first_samples.store(taken + 1, Ordering::Relaxed);
            self.per_call.note_highest(busy, replies);
        } else {
            self.per_call
                .note_lowest(busy, replies, ENVELOPE_FALL_SHIFT, ENVELOPE_RISE_SHIFT);
        }
    }

    /// Takes the provider's report (`None`: it has measured nothing yet).
    pub fn reported(&self, per_call: Option<Duration>) {
        self.per_call.set(per_call);
    }

    /// The time per call the pool knows, if any (the pool's keeper publishes it as
    /// `rpcmesh_upstream_pace_seconds`).
    pub fn per_call(&self) -> Option<Duration> {
        self.per_call.get()
    }

    /// How many calls one connection may hold before the router goes on to the next, as
    /// `--pack-in-flight` says it (`pack`, the most): one more than the provider answers in
    /// the wait, or 0 (no packing) when no call may wait at all (`--pack-wait 0`, or a
    /// provider slower than the wait per call). Unknown: 0 for a plain v1 server, `pack`
    /// for an rpcmesh provider ([`Source`]).
    pub fn depth(&self, pack: usize) -> usize {
        match (self.wait_ns, self.per_call.nanos(), self.source) {
            (0, _, _) | (_, 0, Source::Measured) => 0,
            (_, 0, Source::Reported) => pack,
            (wait, ns, _) => match usize::try_from(wait / ns).unwrap_or(usize::MAX) {
                0 => 0,
                ahead => ahead.saturating_add(1).min(pack),
            },
        }
    }
}

/// One connection's side of the measurement: what was waiting at the server at its last
/// read that brought a reply.
///
/// Only such a read starts an interval. The server had just finished a call then, and the
/// calls left waiting were already written, so from there to the next reply it was
/// working through them (or waiting for a CPU, or for the broker's ACK: longer, never
/// shorter, which is what the envelope needs). A read that brought no reply (a heartbeat's
/// answer, a partial frame) starts nothing: the server may be well into a call by then, and
/// timing from it would make a slow server look fast.
#[derive(Debug, Default)]
pub(crate) struct Backlog {
    /// When the last read that brought a reply and left written calls unanswered ended,
    /// and how many it left.
    since: Option<(Instant, usize)>,
}

impl Backlog {
    /// After a read at `now` that answered `answered` calls and left `waiting` calls
    /// written and unanswered: when calls were waiting at the server since the last read
    /// that brought a reply, `pace` takes the time since then per call answered (at most
    /// as many as were waiting: calls written after that read were not at the server all
    /// along). A read that answered nothing changes nothing.
    pub fn on_read(&mut self, now: Instant, answered: usize, waiting: usize, pace: &Pace) {
        if answered == 0 {
            return;
        }
        if let Some((then, before)) = self.since {
            pace.note(now.saturating_duration_since(then), answered.min(before));
        }
        self.since = (waiting > 0).then_some((now, waiting));
    }

    /// At the connection's deadline sweep (`now`, while calls are in flight): a server
    /// that has answered nothing for longer than a packed call may wait, with calls
    /// waiting there, has taken at least that long over its current call. `pace` is
    /// raised to that at once, so that a server that stalls or hangs on a call stops
    /// being packed within a sweep instead of at its next reply (which may never come).
    /// The interval stays open: the reply that ends the silence is timed from its start.
    pub fn on_sweep(&self, now: Instant, pace: &Pace) {
        let Some((then, _)) = self.since else {
            return;
        };
        let silent = now.saturating_duration_since(then);
        if pace.wait_ns != 0 && silent > Duration::from_nanos(pace.wait_ns) {
            pace.per_call.raise_to(silent);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);
    const WAIT: Duration = crate::config::DEFAULT_PACK_WAIT;

    fn new_pace() -> Pace {
        Pace::new(WAIT, Source::Measured)
    }

    #[test]
    fn no_sample_no_packing_of_a_v1_server_but_an_rpcmesh_provider_is_packed_whole() {
        let pace = new_pace();
        assert_eq!(pace.per_call(), None);
        assert_eq!(pace.depth(64), 0);
        let reported = Pace::new(WAIT, Source::Reported);
        assert_eq!(reported.depth(64), 64);
        assert_eq!(reported.depth(0), 0, "--pack-in-flight 0 turns packing off");
        let never = Pace::new(Duration::ZERO, Source::Reported);
        assert_eq!(never.depth(64), 0, "--pack-wait 0, reported or not");
        never.reported(Some(US));
        assert_eq!(never.depth(64), 0);
    }

    #[test]
    fn an_rpcmesh_providers_report_sets_the_depth_by_the_same_rule() {
        let pace = Pace::new(WAIT, Source::Reported);
        // Light handlers (the echo provider reports well under 1 µs): packed whole.
        pace.reported(Some(Duration::from_nanos(400)));
        assert_eq!(pace.depth(64), 64);
        // CPU-heavy handlers of 20 µs: 100 / 20 = 5 calls ahead, plus the call.
        pace.reported(Some(20 * US));
        assert_eq!(pace.depth(64), 6);
        assert_eq!(
            pace.per_call(),
            Some(20 * US),
            "a report replaces, not averages"
        );
        // Slower than the wait: not packed.
        pace.reported(Some(Duration::from_millis(1)));
        assert_eq!(pace.depth(64), 0);
        // A provider that has measured nothing (again) is packed whole.
        pace.reported(None);
        assert_eq!(pace.depth(64), 64);
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
        let never = Pace::new(Duration::ZERO, Source::Measured);
        never.note(US, 1);
        assert_eq!(never.depth(64), 0, "--pack-wait 0 turns it off");
    }

    #[test]
    fn the_envelope_falls_half_way_to_a_lower_sample_and_rises_a_sixty_fourth() {
        let pace = new_pace();
        for _ in 0..ENVELOPE_FIRST_SAMPLES {
            pace.note(80 * US, 8);
        }
        assert_eq!(pace.per_call(), Some(10 * US), "the start");
        // A round trip's interval, far above the server's work: a sixty-fourth higher ...
        pace.note(70 * US, 1);
        assert_eq!(pace.per_call(), Some(Duration::from_nanos(10_156)));
        assert_eq!(pace.depth(64), 10);
        // ... and never past the sample.
        pace.note(Duration::from_nanos(10_200), 1);
        assert_eq!(pace.per_call(), Some(Duration::from_nanos(10_200)));
        // A lower sample takes it half the way down.
        pace.note(5 * US, 1);
        assert_eq!(pace.per_call(), Some(Duration::from_nanos(7_600)));
        pace.note(5 * US, 1);
        assert_eq!(pace.per_call(), Some(Duration::from_nanos(6_300)));
        // A run of round trips over a fast server (the calls spread two deep, one reply a
        // read) leaves it packed: the interval does not say the server got slower ...
        for _ in 0..10 {
            pace.note(70 * US, 1);
            pace.note(6 * US, 3);
        }
        assert!(pace.depth(64) >= 8, "{:?}", pace.per_call());
        // ... a server that did stops being packed within about 250 samples.
        let mut n = 0;
        while pace.depth(64) > 0 {
            pace.note(Duration::from_millis(2), 1);
            n += 1;
        }
        assert!((200..=300).contains(&n), "{n} samples");
        pace.note(Duration::ZERO, 0);
        assert!(
            pace.per_call().is_some(),
            "a read with no reply is no sample"
        );
    }

    /// The envelope starts at the longest of the first samples: a short one among them,
    /// first or not, does not get a slow server packed.
    #[test]
    fn the_envelope_starts_at_the_longest_of_the_first_samples() {
        let pace = new_pace();
        pace.note(73 * US, 1);
        assert_eq!(pace.per_call(), Some(73 * US), "packed two deep, for now");
        pace.note(Duration::from_millis(2), 1);
        pace.note(73 * US, 1);
        pace.note(60 * US, 1);
        assert_eq!(pace.per_call(), Some(Duration::from_millis(2)));
        assert_eq!(pace.depth(64), 0);
        // From there on, a short sample takes it half the way.
        pace.note(Duration::ZERO, 0);
        pace.note(Duration::from_millis(1), 1);
        assert_eq!(pace.per_call(), Some(Duration::from_micros(1_500)));
    }

    /// A short sample (the read before it was late: the broker was off the CPU) among a
    /// slow server's does not get the server packed; it takes seven in a row.
    #[test]
    fn one_short_sample_does_not_make_a_slow_server_look_fast() {
        let pace = new_pace();
        for _ in 0..ENVELOPE_FIRST_SAMPLES {
            pace.note(Duration::from_millis(2), 1);
        }
        pace.note(73 * US, 1);
        assert_eq!(pace.depth(64), 0, "{:?}", pace.per_call());
        for _ in 0..5 {
            pace.note(73 * US, 1);
        }
        assert_eq!(pace.depth(64), 0, "six: {:?}", pace.per_call());
        pace.note(73 * US, 1);
        assert_eq!(pace.depth(64), 2, "seven: {:?}", pace.per_call());
    }

    /// The loop an average was caught in: a fast server spread two deep is timed a round
    /// trip per call, which keeps it two deep. Fed what a connection sees, two deep (one
    /// reply a read, 60 µs apart) with a packed read now and then (4 replies 20 µs after
    /// the last), the envelope packs it as deep as its work allows.
    #[test]
    fn round_trips_between_single_replies_do_not_keep_a_fast_server_shallow() {
        let pace = new_pace();
        for i in 0..200 {
            if i % 20 == 19 {
                pace.note(20 * US, 4);
            } else {
                pace.note(60 * US, 1);
            }
        }
        assert!(pace.depth(64) >= 8, "{:?}", pace.per_call());
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
        // ... a later sweep raises it to the longer silence ...
        backlog.on_sweep(t0 + Duration::from_millis(30), &pace);
        assert_eq!(pace.per_call(), Some(Duration::from_millis(30) - 5 * US));
        // ... and the reply that ends the silence is timed from the read before it, not
        // from a sweep (which would make a server that took 30 ms look quick).
        backlog.on_read(t0 + Duration::from_millis(30) + 10 * US, 1, 1, &pace);
        assert_eq!(pace.per_call(), Some(Duration::from_millis(30) + 5 * US));
    }

    #[test]
    fn a_read_without_replies_neither_starts_nor_ends_an_interval() {
        let pace = new_pace();
        let mut backlog = Backlog::default();
        let t0 = Instant::now();
        // A heartbeat's answer with a call waiting: the server may be far into that call,
        // so nothing is timed from here.
        backlog.on_read(t0, 0, 1, &pace);
        backlog.on_read(t0 + 2 * US, 1, 1, &pace);
        assert_eq!(pace.per_call(), None, "2 µs from a heartbeat is no sample");
        // Then a heartbeat's answer between two replies: the interval runs on through it.
        backlog.on_read(t0 + 4 * US, 0, 1, &pace);
        assert_eq!(pace.per_call(), None);
        backlog.on_read(t0 + 14 * US, 1, 0, &pace);
        assert_eq!(
            pace.per_call(),
            Some(12 * US),
            "timed from the read that left it waiting"
        );
    }
}
