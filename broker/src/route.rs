//! Routing and balancing: which provider, and which of its connections, takes a call.
//!
//! A service's providers are those configured for it by name, then, as a fallback, those
//! configured for any service: a call goes to a provider of any service only when no
//! provider named for its service takes it (they drain, have no healthy connection, are
//! full, or cannot take a compressed call), and a service no one names goes to those of any
//! service alone. A provider given for any service says it serves every service, so it is
//! a provider of the named ones too; the names say which to prefer (a deployment that
//! must keep a service off the others names services on every provider). Among the
//! providers of one rank the broker picks by least outstanding calls of two chosen at
//! random (the default) or in turn. Within a provider, calls are packed: the oldest
//! connection with fewer than its packing depth in flight takes the call, and only when
//! all are that busy does the less loaded of two (see [`Router`]). A provider works
//! through a connection's calls one after another, so the depth is as many calls as it
//! answers in `--pack-wait`, by its time per call (measured for a plain v1 server,
//! reported by an rpcmesh provider), at most `--pack-in-flight` (64); a v1 server not yet
//! measured gets the less loaded of two, an rpcmesh provider not yet reported the whole
//! 64 (`crate::upstream::pace`). A provider with no open connection is passed over; a
//! full one too, and one that is draining (it refused a call with `NOT_RUN`), and the
//! call goes to the next (the fallbacks after the named). Only when no provider takes it
//! is the caller answered.
//!
//! A [`Router`] is immutable: the providers file's reloads (`membership`) build a new one
//! and publish it in an `ArcSwap`, which each call reads without a lock. So does a
//! provider gaining its first healthy connection or losing its last: each list of
//! candidates holds the providers with connections first, and the balancing draws among
//! those, so that providers nothing answers at (a thousand dead ones in the providers
//! file) cost a call nothing; the others are offered a call only when none of those took
//! it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use rpcmesh_common::retry::Idempotent;
use rpcmesh_wire::body::request_service;
use rpcmesh_wire::frame::Flags;

use crate::call::{Avoid, Forward};
use crate::config::Balance;
use crate::failure::Failure;
use crate::upstream::{ProviderPool, Refused, UpstreamConn};
use crate::upstream_spec::UpstreamSpec;

/// Why no provider took a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoRoute {
    /// No provider is configured for the service.
    UnknownService,
    /// Providers are configured, but none has an open connection.
    NoHealthy,
    /// Every open connection is at its in-flight cap.
    Full,
    /// The payload is compressed and only plain v1 servers serve the service.
    NeedsExtension,
    /// The providers that could take it are draining.
    Draining,
}

impl NoRoute {
    /// The broker's answer to a call for `service` that no provider took.
    pub(crate) fn failure(self, service: String) -> Failure {
        match self {
            NoRoute::UnknownService => Failure::UnknownService(service),
            NoRoute::NoHealthy => Failure::NoHealthy(service),
            NoRoute::Full => Failure::Full(service),
            NoRoute::NeedsExtension => Failure::NeedsExtension(service),
            NoRoute::Draining => Failure::ProvidersDraining(service),
        }
    }
}

/// Per-session balancing state (so that balancing shares nothing between sessions).
///
/// The calls a session reads together go to one connection together: the choice is made
/// for the first call of a read and kept for the rest ([`Picker::new_batch`] starts a new
/// one). Calls that arrived in one segment then leave in one write and come back in one,
/// instead of being spread thin over the pool and trickling back; balancing still acts
/// on every read.
#[derive(Debug)]
pub(crate) struct Picker {
    rng: fastrand::Rng,
    turn: usize,
    /// The provider (an index into the session's router, which stays the same for the
    /// round), the list of candidates it was drawn from ([`Candidates::id`]) and the
    /// connection that took the current batch's first call.
    batch: Option<(usize, u32, Arc<UpstreamConn>)>,
    /// When the session's current read returned: the instant latency estimates are
    /// decayed to and ejections are timed by.
    pub now: Instant,
}

impl Picker {
    pub fn new() -> Self {
        let mut rng = fastrand::Rng::new();
        let turn = rng.usize(..1024);
        Picker {
            rng,
            turn,
            batch: None,
            now: Instant::now(),
        }
    }

    /// The next calls belong to a new batch: choose afresh. Also lets go of the batch's
    /// connection, which a session must not keep while idle (a pool that dropped it waits
    /// for its last handle).
    pub fn new_batch(&mut self) {
        self.batch = None;
    }
}

/// Services → providers.
///
/// Packing: a provider's connections are filled in order up to its depth of calls in
/// flight each ([`ProviderPool::pack_depth`], at most `pack`); only when every one has that
/// many does the less loaded of two take the next call. Calls packed onto one connection
/// pile up in one socket while the provider is busy and are read, answered and written
/// back in large batches: on a 2-core machine at 64 calls in flight, the provider spends
/// 0.73 µs of CPU per call packed against 1.15 µs spread over four connections, and the
/// broker path makes 10–15 % more calls/s (docs/performance.md, "What each optimisation
/// bought"). The price is parallelism: an rpcmesh provider runs a connection's handlers on
/// one thread, so behind a provider with CPU-heavy handlers on several threads, calls
/// packed onto one connection would wait for one thread while the others idle. Its time
/// per call bounds the depth (20 µs handlers: 5 calls): on 2 vCPUs at 64 calls in flight,
/// such a provider on two threads then does 0.88 of HAProxy's calls/s, against 0.63
/// packed to the full depth (docs/performance.md, "Packing an rpcmesh provider by its
/// reported time per call").
#[derive(Debug)]
pub(crate) struct Router {
    pools: Vec<Arc<ProviderPool>>,
    by_service: HashMap<Box<[u8]>, Candidates>,
    any: Candidates,
    balance: Balance,
    pack: usize,
    /// The calls marked idempotent (the flags' and the providers file's).
    idempotent: Idempotent,
}

/// The providers a call may go to at one rank (those named for its service, or those of
/// any service): indices into the router's pools, those that had a healthy connection
/// when the router was built first.
#[derive(Debug, Default)]
struct Candidates {
    /// Which list this is in its router (the batch remembers it).
    id: u32,
    all: Vec<usize>,
    /// How many of `all`, at its start, had a healthy connection.
    live: usize,
}

impl Candidates {
    /// `all`, those of them whose pool `is_live` first (in their order).
    fn new(id: u32, all: Vec<usize>, is_live: impl Fn(usize) -> bool) -> Self {
        let (mut first, rest): (Vec<usize>, Vec<usize>) =
            all.into_iter().partition(|&i| is_live(i));
        let live = first.len();
        first.extend(rest);
        Candidates {
            id,
            all: first,
            live,
        }
    }

    fn is_empty(&self) -> bool {
        self.all.is_empty()
    }
}

impl Router {
    /// Routes to `members`: each provider's pool, with the services it serves now (a
    /// reload may change them and keep the pool).
    pub fn new(
        members: &[(UpstreamSpec, Arc<ProviderPool>)],
        balance: Balance,
        pack: usize,
        idempotent: Idempotent,
    ) -> Self {
        let mut named: HashMap<Box<[u8]>, Vec<usize>> = HashMap::new();
        let mut any = Vec::new();
        for (i, (spec, _)) in members.iter().enumerate() {
            if spec.services.is_empty() {
                any.push(i);
            }
            for s in &spec.services {
                named.entry(s.as_bytes().into()).or_default().push(i);
            }
        }
        let is_live = |i: usize| members[i].1.has_healthy();
        let by_service = named
            .into_iter()
            .zip(1..)
            .map(|((service, list), id)| (service, Candidates::new(id, list, is_live)))
            .collect();
        let pools = members.iter().map(|(_, p)| p.clone()).collect();
        Router {
            pools,
            by_service,
            any: Candidates::new(0, any, is_live),
            balance,
            pack,
            idempotent,
        }
    }

    /// Whether calls of `service`'s `method` are marked idempotent (lost in flight, they
    /// may be sent again).
    pub fn idempotent(&self, service: &[u8], method: &[u8]) -> bool {
        self.idempotent.covers_bytes(service, method)
    }

    /// The providers of `service`, in the order they are offered its calls: those named
    /// for it, then those of any service (the fallback); a service no one names goes to
    /// those of any service alone.
    fn candidates(&self, service: &[u8]) -> (&Candidates, Option<&Candidates>) {
        match self.by_service.get(service) {
            Some(named) => (named, Some(&self.any)),
            None => (&self.any, None),
        }
    }

    /// Hands `fwd` to a connection of a provider of its service, or gives it back with
    /// the reason none took it. The providers named for the service are offered it first;
    /// when none of them takes it (drained, no healthy connection, full, or unable to take
    /// a compressed call), those of any service are, as a fallback.
    // A refused call is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    pub fn forward(&self, mut fwd: Forward, picker: &mut Picker) -> Result<(), (Forward, NoRoute)> {
        let (first, fallback) = self.candidates(request_service(&fwd.frame.body));
        if first.is_empty() {
            return Err((fwd, NoRoute::UnknownService));
        }
        let flags = fwd.frame.header.flags;
        let mut why = NoRoute::NoHealthy;
        // The rest of a batch goes straight to the connection that took its first call
        // (without looking up the pool's connections); when that one cannot take it, the
        // call is balanced like any other. Only a batch on a first-choice provider: one on
        // a fallback goes through the first choices again, which may be back.
        if let Some((pool_idx, list, conn)) = &picker.batch {
            if *list == first.id
                && self.refusal(*pool_idx, flags).is_none()
                && self.pools[*pool_idx].admits(picker.now)
                && !avoided(fwd.avoid, self.pools[*pool_idx].id(), Pass::Admitted)
            {
                fwd = match conn.try_forward(fwd, picker.now) {
                    Ok(()) => return Ok(()),
                    Err((f, refused)) => {
                        if refused == Refused::Full {
                            why = NoRoute::Full;
                        }
                        f
                    }
                };
            }
        }
        for cands in std::iter::once(first).chain(fallback) {
            fwd = match self.offer_among(cands, fwd, picker, flags, &mut why, Pass::Admitted) {
                Ok(()) => return Ok(()),
                Err(f) => f,
            };
        }
        // No provider in service took it: an ejected one may, rather than none.
        for cands in std::iter::once(first).chain(fallback) {
            fwd = match self.offer_among(cands, fwd, picker, flags, &mut why, Pass::LastResort) {
                Ok(()) => return Ok(()),
                Err(f) => f,
            };
        }
        Err((fwd, why))
    }

    /// Offers `fwd` to the providers `cands`: the better of two random ones of those with
    /// a healthy connection (or the next in turn) first, then the others with one, then
    /// those without.
    // A refused call is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    fn offer_among(
        &self,
        cands: &Candidates,
        mut fwd: Forward,
        picker: &mut Picker,
        flags: Flags,
        why: &mut NoRoute,
        pass: Pass,
    ) -> Result<(), Forward> {
        let (all, list) = (cands.all.len(), cands.id);
        if all == 0 {
            return Err(fwd);
        }
        // Balanced among the live ones (among all when none was live).
        let n = if cands.live > 0 { cands.live } else { all };
        let cands_all = &cands.all;
        let cands = &cands_all[..n];
        let first = match self.balance {
            Balance::PeakEwma if n > 1 => {
                let a = picker.rng.usize(..n);
                let b = (a + 1 + picker.rng.usize(..n - 1)) % n;
                let now = picker.now;
                if self.pools[cands[b]].cost(now) < self.pools[cands[a]].cost(now) {
                    b
                } else {
                    a
                }
            }
            Balance::P2c if n > 1 => {
                let a = picker.rng.usize(..n);
                let b = (a + 1 + picker.rng.usize(..n - 1)) % n;
                if self.pools[cands[b]].load() < self.pools[cands[a]].load() {
                    b
                } else {
                    a
                }
            }
            Balance::P2c | Balance::PeakEwma => 0,
            Balance::RoundRobin => {
                picker.turn = picker.turn.wrapping_add(1);
                picker.turn % n
            }
        };
        for k in 0..all {
            let pool_idx = if k < n {
                cands[(first + k) % n]
            } else {
                cands_all[k]
            };
            let pool = &self.pools[pool_idx];
            let skip = match pass {
                // Those out are skipped (a probing one takes its one probe call).
                Pass::Admitted => !pool.admits(picker.now),
                // Those out, and the one a retry would rather avoid.
                Pass::LastResort => !pool.is_out() && fwd.avoid != Avoid::Prefer(pool.id()),
            };
            if skip || avoided(fwd.avoid, pool.id(), pass) {
                continue;
            }
            fwd = match self.offer(pool_idx, list, fwd, picker, flags, why) {
                Ok(()) => return Ok(()),
                Err(f) => f,
            };
        }
        Err(fwd)
    }

    /// Why provider `pool_idx` takes no call with these `flags` now, if it does not: it
    /// cannot take a compressed call (a plain v1 server), or it drains.
    fn refusal(&self, pool_idx: usize, flags: Flags) -> Option<NoRoute> {
        let pool = &self.pools[pool_idx];
        if !pool.spec.kind.takes_request(flags) {
            Some(NoRoute::NeedsExtension)
        } else if pool.is_draining() {
            Some(NoRoute::Draining)
        } else {
            None
        }
    }

    /// Offers `fwd` to provider `pool_idx` (see [`try_pool`]); on success it becomes the
    /// batch's provider. A refusal updates `why`: `Full` wins, else `NeedsExtension` when
    /// the provider cannot take a compressed call, else `Draining` when it drains.
    // A refused call is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    fn offer(
        &self,
        pool_idx: usize,
        list: u32,
        fwd: Forward,
        picker: &mut Picker,
        flags: Flags,
        why: &mut NoRoute,
    ) -> Result<(), Forward> {
        if let Some(r) = self.refusal(pool_idx, flags) {
            if *why == NoRoute::NoHealthy {
                *why = r;
            }
            return Err(fwd);
        }
        match try_pool(&self.pools[pool_idx], fwd, picker, self.pack) {
            Ok(conn) => {
                picker.batch = Some((pool_idx, list, conn));
                Ok(())
            }
            Err((fwd, refused)) => {
                if refused == Some(Refused::Full) {
                    *why = NoRoute::Full;
                }
                Err(fwd)
            }
        }
    }
}

/// Which providers a round of offers goes to (the loop engine's routing takes the same
/// two rounds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Those in service (and a probing one's probe call): the first round.
    Admitted,
    /// Those ejected, and the one a retry prefers to avoid, when no other took the call.
    LastResort,
}

/// True when a call that avoids `avoid` must not go to provider `id` in this `pass`: one
/// it prefers to avoid may take it only as a last resort, one it must avoid never.
pub(crate) fn avoided(avoid: Avoid, id: u64, pass: Pass) -> bool {
    match avoid {
        Avoid::None => false,
        Avoid::Never(p) => p == id,
        Avoid::Prefer(p) => p == id && pass == Pass::Admitted,
    }
}

/// Offers the call to the first open connection of `pool` with room under its packing
/// depth ([`ProviderPool::pack_depth`]: by the provider's time per call, at most `pack`;
/// 0 = none), else to the less loaded of two, then to the others; returns
/// the connection that took it. `None` in the error = the pool has no open connection.
// A refused call is handed back by value (no allocation on the per-call path).
#[allow(clippy::result_large_err)]
fn try_pool(
    pool: &ProviderPool,
    mut fwd: Forward,
    picker: &mut Picker,
    pack: usize,
) -> Result<Arc<UpstreamConn>, (Forward, Option<Refused>)> {
    let conns = pool.ready();
    let n = conns.len();
    if n == 0 {
        return Err((fwd, None));
    }
    let depth = pool.pack_depth(pack);
    let start = if let Some(i) = (depth > 0)
        .then(|| conns.iter().position(|c| load(c) < depth))
        .flatten()
    {
        i
    } else if n > 1 {
        let a = picker.rng.usize(..n);
        let b = (a + 1) % n;
        if load(&conns[b]) < load(&conns[a]) {
            b
        } else {
            a
        }
    } else {
        0
    };
    let mut refused = None;
    for k in 0..n {
        let c = &conns[(start + k) % n];
        if c.is_closed() {
            continue;
        }
        match c.try_forward(fwd, picker.now) {
            Ok(()) => return Ok(c.clone()),
            Err((f, r)) => {
                fwd = f;
                if r == Refused::Full {
                    refused = Some(Refused::Full);
                }
            }
        }
    }
    Err((fwd, refused))
}

fn load(c: &UpstreamConn) -> usize {
    if c.is_closed() { usize::MAX } else { c.load() }
}
