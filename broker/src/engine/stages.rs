//! The stages of the calls the loop engine times, in the broker's stage histograms
//! (`crate::metrics`'s `ADMIT` .. `TOTAL`, `--stage-metrics`): one call in
//! `--stage-sample`, as the Tokio engine picks them, so that calls not picked take no
//! clock read at all.
//!
//! A picked call is stamped when it is routed (the clock read once more: the round's
//! time is when its request was read), when the round that wrote it to its provider has
//! flushed, when its reply is read (the round's time), and when the round that wrote its
//! outcome to its caller has flushed. Its stamps are kept here by a small index the call
//! carries, not in the call, which stays small.

use std::time::Instant;

use rpcmesh_common::metrics::families::{Sampler, Stages};

use crate::metrics::{ADMIT, QUEUE, TOTAL, UPSTREAM, WRITE_BACK};

/// A timed call's stamps.
#[derive(Debug, Clone, Copy)]
struct Stamps {
    admitted: Instant,
    routed: Instant,
    /// When the round that wrote it to its provider flushed.
    sent: Option<Instant>,
    /// When its reply was read.
    replied: Option<Instant>,
}

/// The timed calls and what their stamps wait for.
#[derive(Debug)]
pub(super) struct Timing {
    stages: Stages,
    sampler: Sampler,
    calls: Vec<Option<Stamps>>,
    free: Vec<u32>,
    /// Timed calls routed and not yet flushed to their provider.
    unsent: usize,
    /// Outcomes of timed calls written this round: their admission and reply stamps.
    written: Vec<(Instant, Option<Instant>)>,
}

impl Timing {
    pub fn new(stages: Stages) -> Timing {
        Timing {
            sampler: stages.sampler(),
            stages,
            calls: Vec::new(),
            free: Vec::new(),
            unsent: 0,
            written: Vec::new(),
        }
    }

    /// A call read at `admitted` is routed: its index when it is one of those timed.
    pub fn pick(&mut self, admitted: Instant) -> Option<u32> {
        if !self.sampler.pick() {
            return None;
        }
        let routed = Instant::now();
        self.stages.record_span(ADMIT, admitted, routed);
        let stamps = Some(Stamps {
            admitted,
            routed,
            sent: None,
            replied: None,
        });
        self.unsent += 1;
        Some(match self.free.pop() {
            Some(t) => {
                self.calls[t as usize] = stamps;
                t
            }
            None => {
                self.calls.push(stamps);
                (self.calls.len() - 1) as u32
            }
        })
    }

    /// Timed call `t` was written to a provider again (routed again).
    pub fn resent(&mut self, t: u32) {
        if let Some(Some(s)) = self.calls.get_mut(t as usize) {
            if s.sent.take().is_some() {
                self.unsent += 1;
            }
        }
    }

    /// The round's writes to the providers are done: the calls written in it are sent.
    pub fn flushed_upstream(&mut self) {
        if self.unsent == 0 {
            return;
        }
        let now = Instant::now();
        for s in self.calls.iter_mut().flatten() {
            if s.sent.is_none() {
                s.sent = Some(now);
                self.stages.record_span(QUEUE, s.routed, now);
            }
        }
        self.unsent = 0;
    }

    /// Timed call `t`'s reply was read at `now`.
    pub fn replied(&mut self, t: u32, now: Instant) {
        if let Some(Some(s)) = self.calls.get_mut(t as usize) {
            if let Some(sent) = s.sent {
                self.stages.record_span(UPSTREAM, sent, now);
            }
            s.replied = Some(now);
        }
    }

    /// Timed call `t` has its outcome: written to its caller this round (`written`), or
    /// dropped with it.
    pub fn done(&mut self, t: u32, written: bool) {
        let Some(s) = self.calls.get_mut(t as usize).and_then(Option::take) else {
            return;
        };
        self.free.push(t);
        if s.sent.is_none() {
            self.unsent = self.unsent.saturating_sub(1);
        }
        if written {
            self.written.push((s.admitted, s.replied));
        }
    }

    /// The round's writes to the callers are done.
    pub fn flushed_back(&mut self) {
        if self.written.is_empty() {
            return;
        }
        let now = Instant::now();
        for (admitted, replied) in self.written.drain(..) {
            if let Some(r) = replied {
                self.stages.record_span(WRITE_BACK, r, now);
            }
            self.stages.record_span(TOTAL, admitted, now);
        }
    }
}
