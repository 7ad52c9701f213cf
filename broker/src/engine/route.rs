//! Routing and balancing on the loop engine: which providers serve a service, and which
//! provider connection takes a call, by the Tokio engine's rules (`crate::route`):
//!
//! - the providers named for the service first, then those for any service;
//! - among them, by `--balance`: the better of two chosen at random by PeakEWMA (latency
//!   estimate × (calls in flight + 1), `crate::resilience::ewma`) or by calls in flight,
//!   or the next in turn; then the others in order;
//! - a provider ejected (`crate::resilience::outlier`) only as a last resort, or for its
//!   probe call; one that drains (it refused a call `NOT_RUN`) not at all; a call routed
//!   again keeps away from the provider that refused it ([`Avoid`]);
//! - within a provider, packed onto the oldest connection with fewer calls than its
//!   packing depth (as many as the provider answers in `--pack-wait`, at most
//!   `--pack-in-flight`: `crate::upstream::pace`), else the least loaded under its cap;
//! - a compressed call only to an rpcmesh provider.
//!
//! The latency estimate is decayed once per round at most for each provider it is asked
//! of ([`Provider::estimate`]): within a round the decay is nothing.

use std::cell::Cell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use rpcmesh_wire::PeerKind;
use rpcmesh_wire::frame::Flags;

use super::Engine;
use super::upstream::Upstream;
use crate::call::Avoid;
use crate::config::{Balance, BrokerConfig};
use crate::metrics::{StatusTally, UpstreamMetrics};
use crate::resilience::ewma::PeakEwma;
use crate::resilience::outlier::Outlier;
use crate::route::{NoRoute, Pass, avoided};
use crate::upstream::pace::Pace;

/// Why a provider has no healthy connection, as its log line says it (docs/broker.md, "At
/// the start").
#[derive(Debug, Clone)]
pub(super) enum Down {
    /// Its connects fail: nothing takes connections there.
    Unreachable(String),
    /// It takes connections and does not answer their heartbeats.
    Silent(String),
    /// A connection that served was lost.
    Lost(String),
}

/// A provider, as configured, and what the engine knows of it.
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
    /// Its series in the broker's metrics.
    pub metrics: UpstreamMetrics,
    /// Its calls' outcomes this round, told to `metrics` at the round's end.
    pub outcomes: StatusTally,
    /// Its calls' successes not yet told to the outlier detector, and the earliest
    /// admission among the replies of the read being handled (its latency).
    pub successes: u64,
    pub oldest: Option<Instant>,
    pub outlier: Outlier,
    pub ewma: PeakEwma,
    /// The latency estimate in nanoseconds, and the round it was taken in.
    estimate: Cell<Option<(u64, f64)>>,
    /// It said it drains (a call refused `NOT_RUN`): it takes no call until a connection
    /// made after that (its serial at least this) answers a heartbeat.
    pub draining_below: Option<u64>,
    /// It had a healthy connection when last looked at (its coming back is news).
    pub was_healthy: bool,
    /// How it last went without a healthy connection, and whether that was said since
    /// it last had one (said once, as the Tokio engine's pools say it).
    pub down: Option<Down>,
    pub down_told: bool,
    /// While its connects fail: no connection of it is made before this, so that one
    /// attempt at a time goes to a provider that cannot be reached (its pauses growing),
    /// not one per connection of its pool. Cleared by a connect that succeeds.
    pub failing_until: Option<Instant>,
    /// It answered a heartbeat, or a connect to it failed: the engine need not wait for
    /// it before taking calls.
    pub settled: bool,
    /// Its time per call on one connection, and so how deep its connections are packed
    /// (`crate::upstream::pace`).
    pub pace: Pace,
    /// It left the providers (`super::members`): offered no call, its connections closed
    /// once their calls are done, never made again; and once they all are, it is gone.
    pub left: bool,
    pub gone: bool,
}

impl Provider {
    pub fn new(
        label: Arc<str>,
        host: String,
        kind: PeerKind,
        metrics: UpstreamMetrics,
        outlier: Outlier,
        ewma: PeakEwma,
        pace: Pace,
    ) -> Provider {
        Provider {
            addr: resolve(&host),
            label,
            host,
            kind,
            conns: Vec::new(),
            outstanding: 0,
            metrics,
            outcomes: StatusTally::default(),
            successes: 0,
            oldest: None,
            outlier,
            ewma,
            estimate: Cell::new(None),
            draining_below: None,
            was_healthy: false,
            down: None,
            down_told: false,
            failing_until: None,
            settled: false,
            pace,
            left: false,
            gone: false,
        }
    }

    /// The latency estimate as of round `round` (at `now`), in nanoseconds: decayed once
    /// per round.
    fn estimate(&self, round: u64, now: Instant) -> f64 {
        match self.estimate.get() {
            Some((r, ns)) if r == round => ns,
            _ => {
                let ns = self.ewma.estimate(now).as_nanos() as f64;
                self.estimate.set(Some((round, ns)));
                ns
            }
        }
    }

    /// The estimate changed: taken afresh when next asked.
    pub fn estimate_changed(&self) {
        self.estimate.set(None);
    }

    /// The PeakEWMA cost of one more call here: nothing for a provider not yet measured
    /// with no call in flight (its probe), else the estimate × (calls in flight + 1).
    fn cost(&self, round: u64, now: Instant) -> f64 {
        if self.outstanding == 0 && !self.ewma.is_measured() {
            return 0.0;
        }
        self.estimate(round, now) * (self.outstanding as f64 + 1.0)
    }
}

/// The first address `host` resolves to. Blocking: done at the start, and at a connect
/// only while a provider's name has never resolved.
pub(super) fn resolve(host: &str) -> Option<SocketAddr> {
    use std::net::ToSocketAddrs;
    host.to_socket_addrs().ok().and_then(|mut a| a.next())
}

/// The providers, and which serve which service.
#[derive(Debug, Default)]
pub(super) struct Routes {
    pub providers: Vec<Provider>,
    /// The providers named for a service.
    pub named: HashMap<Box<[u8]>, Vec<usize>>,
    /// The providers given for any service.
    pub any: Vec<usize>,
    /// The same two, with only the providers that have a healthy connection: a call is
    /// offered to those first, so that providers that cannot be reached (a thousand in a
    /// providers file) cost a call nothing, as on the Tokio engine, where the routing
    /// table lists the providers with connections first. Kept by [`Routes::keep_healthy`].
    pub healthy_named: HashMap<Box<[u8]>, Vec<usize>>,
    pub healthy_any: Vec<usize>,
}

impl Routes {
    /// Routes to `listed`: each provider (its index) with the services it serves (none:
    /// any service). The providers not listed are offered no call.
    pub fn relist<'a>(&mut self, listed: impl IntoIterator<Item = (usize, &'a [String])>) {
        self.named.clear();
        self.any.clear();
        for (p, services) in listed {
            if services.is_empty() {
                self.any.push(p);
            }
            for service in services {
                self.named
                    .entry(service.as_bytes().into())
                    .or_default()
                    .push(p);
            }
        }
        self.keep_healthy();
    }

    /// Lists again the providers with a healthy connection (when one gains its first or
    /// loses its last, and when the providers are listed again).
    pub fn keep_healthy(&mut self) {
        let providers = &self.providers;
        let healthy = |list: &[usize]| -> Vec<usize> {
            list.iter()
                .copied()
                .filter(|&p| providers[p].was_healthy)
                .collect()
        };
        self.healthy_any = healthy(&self.any);
        self.healthy_named = self
            .named
            .iter()
            .map(|(service, list)| (service.clone(), healthy(list)))
            .collect();
    }
}

/// What the balancing reads: the providers, their connections' loads, the caps, the
/// time; and why none took the call so far.
struct Pick<'a> {
    routes: &'a Routes,
    upstreams: &'a [Upstream],
    config: &'a BrokerConfig,
    now: Instant,
    round: u64,
    why: NoRoute,
}

impl Pick<'_> {
    /// Among `list`, the first choice by the balancing, then the others in turn, in
    /// `pass`; `avoid`: the provider a call routed again keeps away from.
    fn among(
        &mut self,
        list: &[usize],
        flags: Flags,
        pass: Pass,
        avoid: Avoid,
        rng: &mut fastrand::Rng,
        turn: &mut usize,
    ) -> Option<usize> {
        let n = list.len();
        if n == 0 {
            return None;
        }
        let providers = &self.routes.providers;
        let better = |a: usize, b: usize, cheaper: &dyn Fn(&Provider, &Provider) -> bool| {
            if cheaper(&providers[list[b]], &providers[list[a]]) {
                b
            } else {
                a
            }
        };
        let (round, now) = (self.round, self.now);
        let first = match self.config.balance {
            Balance::PeakEwma | Balance::P2c if n > 1 => {
                let a = rng.usize(..n);
                let b = (a + 1 + rng.usize(..n - 1)) % n;
                if self.config.balance == Balance::PeakEwma {
                    better(a, b, &|x, y| x.cost(round, now) < y.cost(round, now))
                } else {
                    better(a, b, &|x, y| x.outstanding < y.outstanding)
                }
            }
            Balance::PeakEwma | Balance::P2c => 0,
            Balance::RoundRobin => {
                *turn = turn.wrapping_add(1);
                *turn % n
            }
        };
        for i in 0..n {
            let p = list[(first + i) % n];
            let provider = &self.routes.providers[p];
            let skip = match pass {
                // Those out are skipped (a probing one takes its one probe call).
                Pass::Admitted => !provider.outlier.admits(self.now),
                // Those out, and the one a retry would rather avoid.
                Pass::LastResort => !provider.outlier.is_out() && avoid != Avoid::Prefer(p as u64),
            };
            if skip || avoided(avoid, p as u64, pass) {
                continue;
            }
            if let Some(k) = self.offer(p, flags) {
                return Some(k);
            }
        }
        None
    }

    /// Which connection of provider `p` takes a call with `flags`: the oldest with fewer
    /// calls than its packing depth, else the least loaded under its cap. A refusal
    /// updates why none took the call: `Full` wins, else the first provider's reason
    /// (it cannot take a compressed call, or it drains).
    fn offer(&mut self, p: usize, flags: Flags) -> Option<usize> {
        let provider = &self.routes.providers[p];
        let refusal = if !provider.kind.takes_request(flags) {
            Some(NoRoute::NeedsExtension)
        } else if provider.draining_below.is_some() {
            Some(NoRoute::Draining)
        } else {
            None
        };
        if let Some(r) = refusal {
            if self.why == NoRoute::NoHealthy {
                self.why = r;
            }
            return None;
        }
        let cap = self.config.max_in_flight_per_upstream_conn;
        let pack = provider.pace.depth(self.config.pack_in_flight).min(cap);
        let mut least: Option<(usize, usize)> = None;
        for &k in &provider.conns {
            let Some(load) = self.upstreams[k].load() else {
                continue;
            };
            if load < pack {
                return Some(k);
            }
            if load < cap && least.is_none_or(|(l, _)| load < l) {
                least = Some((load, k));
            }
            if load >= cap {
                self.why = NoRoute::Full;
            }
        }
        least.map(|(_, k)| k)
    }
}

impl Engine {
    /// Which provider connection takes a call for `service` with `flags`, keeping away
    /// from `avoid`: the providers in service first (the named, then those of any
    /// service), then, when none took it, those ejected.
    pub(super) fn route(
        &mut self,
        service: &[u8],
        flags: Flags,
        avoid: Avoid,
    ) -> Result<usize, NoRoute> {
        let Engine {
            routes,
            upstreams,
            config,
            rng,
            turn,
            now,
            rounds,
            ..
        } = self;
        let lists: [&[usize]; 2] = match routes.named.get(service) {
            Some(named) => [named, &routes.any],
            None => [&routes.any, &[]],
        };
        if lists[0].is_empty() {
            return Err(NoRoute::UnknownService);
        }
        let healthy: [&[usize]; 2] = match routes.healthy_named.get(service) {
            Some(named) => [named, &routes.healthy_any],
            None => [&routes.healthy_any, &[]],
        };
        let mut pick = Pick {
            routes,
            upstreams,
            config,
            now: *now,
            round: *rounds,
            why: NoRoute::NoHealthy,
        };
        // The providers with a healthy connection first; the others only when none of
        // those took the call (they take none either: it is to say why).
        for lists in [healthy, lists] {
            for pass in [Pass::Admitted, Pass::LastResort] {
                for list in lists {
                    if let Some(k) = pick.among(list, flags, pass, avoid, rng, turn) {
                        return Ok(k);
                    }
                }
            }
        }
        Err(pick.why)
    }
}
