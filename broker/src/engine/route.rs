//! Routing and balancing on the loop engine: which providers serve a service, and which
//! provider connection takes a call, by the Tokio engine's rules (`crate::route`): the
//! providers named for the service first, then those for any service; among them the
//! less loaded of two chosen at random; within a provider, packed onto the oldest
//! connection with fewer than `--pack-in-flight` calls, else the least loaded under its
//! cap; a compressed call only to an rpcmesh provider.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use rpcmesh_wire::PeerKind;
use rpcmesh_wire::frame::Flags;

use super::Engine;
use super::upstream::Upstream;
use crate::config::BrokerConfig;
use crate::route::NoRoute;

/// A provider, as configured.
#[derive(Debug)]
pub(super) struct Provider {
    pub label: Arc<str>,
    /// `HOST:PORT` as configured, and what it resolved to (at the start; again at a
    /// connect while it has not).
    pub host: String,
    pub addr: Option<SocketAddr>,
    pub kind: PeerKind,
    /// Its connections, as indices of [`Engine::upstreams`], oldest first.
    pub conns: Vec<usize>,
    /// Its calls in flight, for the balancing.
    pub outstanding: usize,
}

/// The providers, and which serve which service.
#[derive(Debug, Default)]
pub(super) struct Routes {
    pub providers: Vec<Provider>,
    /// The providers named for a service.
    pub named: HashMap<Box<[u8]>, Vec<usize>>,
    /// The providers given for any service.
    pub any: Vec<usize>,
}

impl Routes {
    /// Adds provider `p`, serving `services` (none: any service).
    pub fn add(&mut self, provider: Provider, services: &[String]) -> usize {
        let p = self.providers.len();
        if services.is_empty() {
            self.any.push(p);
        }
        for service in services {
            self.named
                .entry(service.as_bytes().into())
                .or_default()
                .push(p);
        }
        self.providers.push(provider);
        p
    }
}

/// What the balancing reads: the providers, their connections' loads, the caps.
struct Pick<'a> {
    routes: &'a Routes,
    upstreams: &'a [Upstream],
    config: &'a BrokerConfig,
}

impl Pick<'_> {
    /// Among `list`, the less loaded of two chosen at random, or the other, or any that
    /// takes the call.
    fn among(&self, list: &[usize], flags: Flags, rng: &mut fastrand::Rng) -> Option<usize> {
        match list.len() {
            0 => None,
            1 => self.take_on(list[0], flags),
            n => {
                let a = rng.usize(..n);
                let mut b = rng.usize(..n - 1);
                if b >= a {
                    b += 1;
                }
                let out = |i: usize| self.routes.providers[list[i]].outstanding;
                let (first, second) = if out(b) < out(a) { (b, a) } else { (a, b) };
                self.take_on(list[first], flags)
                    .or_else(|| self.take_on(list[second], flags))
                    .or_else(|| list.iter().find_map(|&p| self.take_on(p, flags)))
            }
        }
    }

    /// Which connection of provider `p` takes a call with `flags`: the oldest with fewer
    /// than `--pack-in-flight` calls, else the least loaded under its cap.
    fn take_on(&self, p: usize, flags: Flags) -> Option<usize> {
        let provider = &self.routes.providers[p];
        if !provider.kind.takes_request(flags) {
            return None;
        }
        let cap = self.config.max_in_flight_per_upstream_conn;
        let mut least: Option<(usize, usize)> = None;
        for &k in &provider.conns {
            let Some(load) = self.upstreams[k].load() else {
                continue;
            };
            if load < self.config.pack_in_flight.min(cap) {
                return Some(k);
            }
            if load < cap && least.is_none_or(|(l, _)| load < l) {
                least = Some((load, k));
            }
        }
        least.map(|(_, k)| k)
    }
}

impl Engine {
    /// Which provider connection takes a call for `service` with `flags`.
    pub(super) fn route(&mut self, service: &[u8], flags: Flags) -> Result<usize, NoRoute> {
        let Engine {
            routes,
            upstreams,
            config,
            rng,
            ..
        } = self;
        let pick = Pick {
            routes,
            upstreams,
            config,
        };
        let named = routes
            .named
            .get(service)
            .map(|v| &v[..])
            .unwrap_or_default();
        for list in [named, &routes.any[..]] {
            if let Some(k) = pick.among(list, flags, rng) {
                return Ok(k);
            }
        }
        let candidates = named.iter().chain(&routes.any);
        let up = |p: usize| {
            routes.providers[p]
                .conns
                .iter()
                .any(|&k| upstreams[k].is_up())
        };
        Err(if named.is_empty() && routes.any.is_empty() {
            NoRoute::UnknownService
        } else if !candidates.clone().any(|&p| up(p)) {
            NoRoute::NoHealthy
        } else if !candidates
            .clone()
            .any(|&p| up(p) && routes.providers[p].kind.takes_request(flags))
        {
            NoRoute::NeedsExtension
        } else {
            NoRoute::Full
        })
    }
}
