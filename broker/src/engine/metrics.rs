//! What the loop engine counts, into the broker's own metrics (`crate::metrics`), so that
//! its calls show in the same families, under the same names and labels: calls by
//! (service, method) and status, errors by kind and side, calls shed by cap, outcomes
//! whose caller had gone, calls in flight, client connections (refusals at the cap too),
//! bytes and system calls on them, and what the rounds allocated.
//!
//! Nothing shared is touched per call: the counts are kept on the loop's own thread and
//! added to the shared counters once a round (a counter per (service, method) that
//! counted, the rest as they happen: refusals, connections). A (service, method) pair gets
//! labels of its own once one of its calls has succeeded, as with the Tokio engine
//! (`BrokerMetrics::calls`), so that callers cannot use the labels up with names no one
//! serves; until then its calls count as `_other`.

use std::collections::HashMap;
use std::sync::Arc;

use rpcmesh_common::metrics::families::CallCounters;
use rpcmesh_common::metrics::{ErrorKind, Side};
use rpcmesh_common::net::connection::{CloseReason, IoCounts};
use rpcmesh_common::net::listener::{AcceptObserver, Refusal};
use rpcmesh_common::net::thinned::Thinned;
use rpcmesh_wire::Status;
use rpcmesh_wire::frame::{FrameError, MsgType};

use crate::failure::Failure;
use crate::metrics::{BrokerMetrics, MAX_CALL_LABELS, StatusTally};

/// Log lines for bad input, thinned for the process.
static BAD_INPUT_LINES: Thinned = Thinned::new();

/// A call's tag with this bit set names a pair without labels yet; the rest is the index
/// of its names in [`Counts::pending`].
const PENDING: u32 = 1 << 31;

/// The loop's counts, and the broker's metrics they go to.
#[derive(Debug)]
pub(super) struct Counts {
    pub metrics: BrokerMetrics,
    /// (service, method) bytes → tag; tag → counters and what they have not been told.
    tags: HashMap<Box<[u8]>, u32>,
    counters: Vec<(Arc<CallCounters>, StatusTally)>,
    /// The tags whose tallies hold counts.
    uncounted: Vec<usize>,
    /// Each tag's names (none for `_other`'s), and the last tag given: most connections
    /// call one method over and over.
    names: Vec<Box<[u8]>>,
    last: u32,
    /// The names of forwarded calls whose pair has no labels yet (with the length of the
    /// service's part), until their outcome; freed slots reused.
    pending: Vec<Option<(Box<[u8]>, usize)>>,
    free_pending: Vec<u32>,
    /// Client connections' reads and writes this round.
    pub inbound: IoCounts,
    /// Provider connections' reads and writes this round.
    pub outbound: IoCounts,
    /// Calls in flight as last reported.
    in_flight: usize,
}

impl Counts {
    pub fn new(metrics: BrokerMetrics) -> Counts {
        let other = metrics.calls_other();
        Counts {
            metrics,
            tags: HashMap::new(),
            counters: vec![(other, StatusTally::default())],
            uncounted: Vec::new(),
            names: vec![Box::default()],
            last: 0,
            pending: Vec::new(),
            free_pending: Vec::new(),
            inbound: IoCounts::default(),
            outbound: IoCounts::default(),
            in_flight: 0,
        }
    }

    /// The tag of a call of the pair `names` (the service's part its first
    /// `service_len` bytes, then the method's length and name). `forwarded`: the call goes
    /// to a provider, so a pair without labels keeps its names until the outcome says
    /// whether the pair exists; one refused at once counts as `_other`.
    pub fn tag(&mut self, names: &[u8], service_len: usize, forwarded: bool) -> u32 {
        if self.last != 0 && *self.names[self.last as usize] == *names {
            return self.last;
        }
        if let Some(&t) = self.tags.get(names) {
            self.last = t;
            return t;
        }
        if let Some(c) = self.metrics.known_calls(names) {
            return self.label(names, c);
        }
        if !forwarded {
            return 0;
        }
        let entry = Some((Box::<[u8]>::from(names), service_len));
        match self.free_pending.pop() {
            Some(i) => {
                self.pending[i as usize] = entry;
                PENDING | i
            }
            None => {
                self.pending.push(entry);
                PENDING | (self.pending.len() - 1) as u32
            }
        }
    }

    /// Gives the pair `names` its counters' tag (or `_other`'s, past the cap on pairs).
    fn label(&mut self, names: &[u8], counters: Arc<CallCounters>) -> u32 {
        if self.tags.len() >= MAX_CALL_LABELS {
            return 0;
        }
        let t = self.counters.len() as u32;
        self.counters.push((counters, StatusTally::default()));
        self.names.push(names.into());
        self.tags.insert(names.into(), t);
        self.last = t;
        t
    }

    /// A call with `tag` was answered with `status`.
    pub fn answered(&mut self, tag: u32, status: Status) {
        let mut i = tag as usize;
        if tag & PENDING != 0 {
            let slot = (tag & !PENDING) as usize;
            let names = self.pending.get_mut(slot).and_then(Option::take);
            self.free_pending.push(slot as u32);
            i = match names {
                // The pair exists: it gets labels (registered once in the broker).
                Some((names, service_len)) if status == Status::Success => {
                    match self.tags.get(&names) {
                        Some(&t) => t as usize,
                        None => {
                            let c = self.metrics.calls(&names, service_len);
                            self.label(&names, c) as usize
                        }
                    }
                }
                _ => 0,
            };
        }
        let tally = &mut self.counters[i].1;
        if tally.is_empty() {
            self.uncounted.push(i);
        }
        tally.add(status);
    }

    /// The broker answered a call itself: the error is counted by kind and side, and a
    /// shed call by the cap it met.
    pub fn failed(&self, failure: &Failure) {
        failure.count(&self.metrics.errors);
        if let Some(cap) = failure.shed_cap() {
            self.metrics.shed.inc(cap);
        }
    }

    /// A frame from `side` that cannot be used: logged (thinned for the process, as the
    /// Tokio engine's `BadInputLog` logs it), and counted by its kind unless the frame
    /// names its call, whose answer counts it ([`Failure::BadRequest`] or
    /// [`Failure::ReplyRefused`], the same kind and side).
    pub fn bad_input(&self, e: &FrameError, side: Side) {
        let names_its_call = match side {
            Side::Provider => matches!(e.frame_id(), Some((_, Some(MsgType::Response)))),
            _ => e.request_id().is_some(),
        };
        if !names_its_call {
            self.metrics.errors.inc(ErrorKind::of_frame(e), side);
        }
        if let Some(a) = BAD_INPUT_LINES.admit() {
            tracing::warn!(error = %e, fatal = e.is_fatal(), in_process = a.seen, left_out = a.left_out, peer = side.label(), "bad input");
        }
    }

    /// A frame of a type `side` should not send (a reply from a caller, a request from a
    /// provider): counted, and dropped.
    pub fn unexpected(&self, side: Side) {
        self.metrics.errors.inc(ErrorKind::Unexpected, side);
    }

    /// A call's outcome came after its caller had gone.
    pub fn abandoned(&self) {
        self.metrics.abandoned.increment(1);
    }

    pub fn opened(&self) {
        self.metrics.conns.opened();
    }

    pub fn refused(&self, reason: Refusal) {
        self.metrics.conns.refused(reason);
    }

    pub fn closed(&self, reason: CloseReason) {
        self.metrics.conns.closed(reason);
    }

    /// The end of a round: what it counted goes to the shared counters, with the calls in
    /// flight.
    pub fn end_round(&mut self, in_flight: usize) {
        for i in self.uncounted.drain(..) {
            let (counters, tally) = &mut self.counters[i];
            tally.drain(|status, n| counters.add(status, n));
        }
        if self.inbound != IoCounts::default() {
            self.metrics.wire.add(std::mem::take(&mut self.inbound));
        }
        if in_flight != self.in_flight {
            // Moved by the change: every worker adds its own to the gauge.
            self.metrics
                .in_flight
                .increment(in_flight as f64 - self.in_flight as f64);
            self.in_flight = in_flight;
        }
    }
}
