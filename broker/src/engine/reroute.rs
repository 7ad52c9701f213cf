//! Calls routed again on the loop engine, by the Tokio engine's rules (`crate::session`'s
//! retries, `rpcmesh_common::retry`):
//!
//! - a call a provider did not run goes back to be routed again with its request, as its
//!   caller sent it (kept in its connection's ring, `upstream`): one a draining provider
//!   refused (`NOT_RUN`), one it shed ("overloaded", an rpcmesh provider's), one whose
//!   connection was lost before it was written, and, marked idempotent
//!   (`--idempotent`), one lost after;
//! - each try but those draws from the retry budget (a share of the calls plus a floor a
//!   second), so that retries never multiply an overload; a shed or lost call's draw is
//!   made where it was taken off its connection;
//! - at most [`MAX_RETRIES`] tries, within the call's deadline; the provider that refused
//!   it is not offered it again ([`Avoid::Never`]), the one whose connection failed
//!   before the write only as a last resort ([`Avoid::Prefer`]);
//! - a call that cannot go again is answered as it would have been: "providers
//!   draining" (`NOT_RUN`, so that the caller may try another broker) when a draining
//!   provider refused it, "full" when it was shed, the loss itself when it was lost.
//!
//! Calls handed back in a round are routed again at its end, before its writes
//! ([`Engine::reroute`]).

use std::mem;

use rpcmesh_wire::body::request_service;
use rpcmesh_wire::frame::Frame;

use super::Engine;
use super::upstream::{AsSent, Call};
use crate::call::{Avoid, Reroute};
use crate::failure::Failure;

#[cfg(doc)]
use crate::session::MAX_RETRIES;

/// What a call carries of its tries.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Retry {
    /// Times it was routed again.
    pub retries: u8,
    /// A draining provider refused it at least once: if no provider takes it now, the
    /// caller is told it was not run.
    pub refused_by_drain: bool,
    /// The provider (its index) it keeps away from.
    pub avoid: Avoid,
    /// Its service and method are marked idempotent: lost in flight, it may go again.
    pub idempotent: bool,
}

/// A call handed back, its request, and why.
#[derive(Debug)]
pub(super) struct HandedBack {
    call: Call,
    request: Frame,
    why: Reroute,
}

impl Engine {
    /// Hands `call`, taken off a connection of provider `p`, back to be routed again at
    /// the end of the round, with its `request` as its caller sent it.
    pub(super) fn hand_back(&mut self, p: usize, mut call: Call, request: Frame, why: Reroute) {
        call.retry.refused_by_drain |= why == Reroute::NotRun;
        call.retry.avoid = match why {
            Reroute::Unsent => Avoid::Prefer(p as u64),
            Reroute::NotRun | Reroute::Overloaded | Reroute::Lost => Avoid::Never(p as u64),
        };
        self.handed_back.push(HandedBack { call, request, why });
    }

    /// Whether calls wait to be routed again.
    pub(super) fn any_handed_back(&self) -> bool {
        !self.handed_back.is_empty()
    }

    /// Routes again the calls handed back.
    pub(super) fn reroute(&mut self) {
        let mut list = mem::take(&mut self.handed_back);
        for HandedBack { call, request, why } in list.drain(..) {
            self.reroute_one(call, request, why);
        }
        if self.handed_back.is_empty() {
            // Its room, kept for the next.
            self.handed_back = list;
        }
    }

    fn reroute_one(&mut self, mut call: Call, request: Frame, why: Reroute) {
        if self.session_gone(&call) {
            // Nobody is left to answer.
            return self.abandon(&call);
        }
        let live = call.may_retry(self.now);
        // A call shed or lost had its retry drawn where it was taken off its connection.
        let drawn = matches!(why, Reroute::Overloaded | Reroute::Lost);
        let granted = live && (drawn || self.guards.budget.withdraw(self.now));
        let metrics = &self.counts.metrics;
        if live && !granted {
            metrics.budget_exhausted[why as usize].increment(1);
        }
        let service = || String::from_utf8_lossy(request_service(&request.body)).into_owned();
        if !granted {
            let failure = if call.retry.refused_by_drain {
                Failure::ProvidersDraining(service())
            } else {
                match why {
                    Reroute::Overloaded => Failure::Full(service()),
                    Reroute::Lost => Failure::TimedOutQueued,
                    Reroute::Unsent | Reroute::NotRun => Failure::KeptClosing,
                }
            };
            return self.answer_call(&call, &failure);
        }
        metrics.rerouted[why as usize].increment(1);
        call.retry.retries += 1;
        let flags = request.header.flags;
        let k = match self.route(request_service(&request.body), flags, call.retry.avoid) {
            Ok(k) => k,
            Err(no) => {
                // A draining provider refused it and no other takes it: not run, and the
                // caller may try another broker.
                let failure = if call.retry.refused_by_drain {
                    Failure::ProvidersDraining(service())
                } else {
                    no.failure(service())
                };
                return self.answer_call(&call, &failure);
            }
        };
        let deadline = call.deadline();
        if let Err(call) = self.send(k, call, flags, &request.body, AsSent::No) {
            return self.answer_call(&call, &Failure::Full(service()));
        }
        self.next_expiry = Some(self.next_expiry.map_or(deadline, |t| t.min(deadline)));
    }

    /// Answers every call waiting to be routed again with `failure` (the drain's grace
    /// is over).
    pub(super) fn answer_handed_back(&mut self, failure: &Failure) {
        for HandedBack { call, .. } in mem::take(&mut self.handed_back) {
            self.answer_call(&call, failure);
        }
    }
}
