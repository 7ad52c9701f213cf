//! Which providers the loop engine serves, and how that set changes while it runs, by
//! the Tokio engine's rules (`crate::membership`): the control side reads the providers
//! file (`super::control`) and hands the loop the whole list ([`Engine::set_providers`]).
//!
//! - a provider new to the list **joins**: its connections are made at once, and the
//!   new list is routed to once every provider that joined has settled (answered a
//!   heartbeat, or refused a connect; at most `--connect-timeout` + `--health-timeout`),
//!   so that it takes calls with connections ready; until then the routing is the one
//!   before, whole;
//! - a provider no longer listed **leaves**: it is offered no call, and its connections
//!   close once the calls they carry are answered or time out, never to be made again;
//! - a provider listed before (the same address, of the same kind) keeps its
//!   connections; a change of its services changes only the routing.
//!
//! A provider that left keeps its place (its index names it in calls still in flight
//! and in retries that avoid it); a later list that names it again makes a new one.

use std::time::Instant;

use rpcmesh_common::retry::Idempotent;
use rpcmesh_wire::PeerKind;

use super::Engine;
use super::route::Provider;
use super::upstream::Upstream;
use crate::resilience::ewma::PeakEwma;
use crate::resilience::outlier::Outlier;
use crate::upstream::pace::{Pace, Source};
use crate::upstream_spec::UpstreamSpec;

/// A list of providers waiting for those that joined to settle.
#[derive(Debug)]
pub(super) struct Pending {
    specs: Vec<UpstreamSpec>,
    /// Each spec's provider, in order.
    listed: Vec<usize>,
    /// The providers that joined with it.
    joined: Vec<usize>,
    /// The calls the list marks idempotent.
    idempotent: Idempotent,
    /// When it is routed to whatever the joiners did.
    by: Instant,
    /// Its number, told back to the control side once it is routed to.
    seq: u64,
}

impl Engine {
    /// Serves `specs` from the start, marking `idempotent` the calls the providers file
    /// marks so.
    pub(super) fn start_providers(&mut self, specs: Vec<UpstreamSpec>, idempotent: Idempotent) {
        self.set_providers(specs, idempotent, 0);
        // Nothing is routed to before the first list: it is routed to at once.
        if let Some(p) = self.pending.as_mut() {
            p.by = self.now;
        }
        self.commit_providers();
    }

    /// Makes `specs` the providers served (see the module's doc): those new join now, and
    /// the list is routed to once they have settled.
    pub(super) fn set_providers(
        &mut self,
        specs: Vec<UpstreamSpec>,
        idempotent: Idempotent,
        seq: u64,
    ) {
        let mut listed: Vec<usize> = Vec::with_capacity(specs.len());
        let mut joined = Vec::new();
        for spec in &specs {
            let same = |(p, pr): &(usize, &Provider)| {
                !pr.left && pr.host == spec.addr && pr.kind == spec.kind && !listed.contains(p)
            };
            let found = self.routes.providers.iter().enumerate().find(same);
            let p = match found {
                Some((p, _)) => p,
                None => {
                    let p = self.join(spec, seq);
                    joined.push(p);
                    p
                }
            };
            listed.push(p);
        }
        let settle = self.config.connect_timeout + self.config.health_timeout;
        self.pending = Some(Pending {
            specs,
            listed,
            joined,
            idempotent,
            by: self.now + settle,
            seq,
        });
        // The joiners' connections are made at once.
        self.next_keep = self.now;
    }

    /// Routes to the pending list once the providers that joined with it have settled,
    /// or its time is up; the providers it does not name leave.
    pub(super) fn commit_providers(&mut self) {
        let Some(pending) = &self.pending else {
            return;
        };
        let settled = pending
            .joined
            .iter()
            .all(|&p| self.routes.providers[p].settled);
        if !settled && self.now < pending.by {
            return;
        }
        let Some(pending) = self.pending.take() else {
            return;
        };
        for p in 0..self.routes.providers.len() {
            if !self.routes.providers[p].left && !pending.listed.contains(&p) {
                self.leave(p);
            }
        }
        for (&p, spec) in pending.listed.iter().zip(&pending.specs) {
            if !pending.joined.contains(&p) && self.services[p] != spec.services {
                tracing::info!(provider = %spec.addr, services = %spec.services_text(), "provider's services changed");
            }
        }
        self.services = vec![Vec::new(); self.routes.providers.len()];
        for (&p, spec) in pending.listed.iter().zip(&pending.specs) {
            self.services[p] = spec.services.clone();
        }
        let services = &self.services;
        self.routes
            .relist(pending.listed.iter().map(|&p| (p, &services[p][..])));
        self.idempotent = self.config.idempotent.and(&pending.idempotent);
        // The cap on ejections is a share of the providers served now.
        self.guards.ejections.set_members(pending.listed.len());
        self.control.applied(pending.seq);
    }

    /// When the pending list is routed to whatever its joiners did, if there is one.
    pub(super) fn pending_by(&self) -> Option<Instant> {
        self.pending.as_ref().map(|p| p.by)
    }

    /// Provider `spec` joins with the list `seq`: this worker's share of its
    /// `--pool-size` connections, made by the next look after the connections. Returns
    /// its index.
    fn join(&mut self, spec: &UpstreamSpec, seq: u64) -> usize {
        let p = self.routes.providers.len();
        let pool_size = self.config.pool_size.max(1);
        let size = crate::cell::pool_share(pool_size, self.shared.workers.len());
        let label: std::sync::Arc<str> = spec.label().into();
        let metrics = self
            .shared
            .upstream_metrics(&label, seq, pool_size, self.index, size);
        let r = &self.guards.config;
        let outlier = Outlier::new(
            *r,
            self.guards.ejections.clone(),
            label.clone(),
            metrics.ejections.clone(),
        );
        let ewma = PeakEwma::new(r.ewma_default_rtt, r.ewma_decay);
        let pace = Pace::new(self.config.pack_wait, Source::of(spec.kind));
        let mut provider = Provider::new(
            label,
            spec.addr.clone(),
            spec.kind,
            metrics,
            outlier,
            ewma,
            pace,
        );
        for _ in 0..size {
            provider.conns.push(self.upstreams.len());
            self.upstreams
                .push(Upstream::new(p, &self.budget, self.now));
        }
        self.routes.providers.push(provider);
        self.services.push(Vec::new());
        if self.listening && self.index == 0 {
            tracing::info!(provider = %spec.addr, services = %spec.services_text(), v1 = spec.kind == PeerKind::V1, "provider joined");
        }
        p
    }

    /// Provider `p` leaves: offered no call from now on, its connections closed once their
    /// calls are done, and never made again.
    fn leave(&mut self, p: usize) {
        let provider = &mut self.routes.providers[p];
        provider.left = true;
        tracing::info!(provider = %provider.host, calls_in_flight = provider.outstanding, "provider left: no new calls; its connections close once their calls are done");
        for k in provider.conns.clone() {
            self.upstreams[k].retire();
            if self.upstreams[k].is_up() {
                self.retire_if_done(k);
            } else {
                self.close_upstream(k, &crate::failure::ConnEnd::Released);
            }
        }
        self.gone_if_closed(p);
    }

    /// Provider `p`, which left, is gone once its connections are all closed: its gauges
    /// go to zero.
    pub(super) fn gone_if_closed(&mut self, p: usize) {
        let provider = &self.routes.providers[p];
        if provider.gone || !provider.conns.iter().all(|&k| self.upstreams[k].is_gone()) {
            return;
        }
        tracing::info!(provider = %provider.host, "provider gone: its connections are closed");
        provider.metrics.publish_gone(provider.conns.len());
        let provider = &mut self.routes.providers[p];
        provider.metrics.unexpose();
        provider.gone = true;
    }
}
