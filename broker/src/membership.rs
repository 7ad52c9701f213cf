//! Which providers the broker serves, and how that set changes while it runs.
//!
//! [`Membership`] owns the providers served now: for each, its pool and its keeper task in
//! every cell (`crate::cell`). Each cell's router, over the cell's own pools, is rebuilt
//! from it and published whole in the `ArcSwap` the cell's sessions read, at each change,
//! so the per-call path takes no lock. [`watch`] reads the
//! providers file again when asked ([`Reload`]: SIGHUP) and when the file changes (its
//! [`FileStamp`] is looked at every [`FILE_POLL`]), and applies what changed:
//!
//! - a provider new to the set **joins**: its pool is made and its keeper started, and
//!   the new router is published once its pool has settled (its first connections
//!   answered their heartbeats, or a connect failed; at most the connect and heartbeat
//!   timeouts), so that it takes calls with connections ready. Until then the read's
//!   other changes wait too: the routing is the one before, whole;
//! - a provider no longer listed **leaves**: the new router offers it no call, its keeper
//!   stops, and its connections close once the calls they carry are answered or time out;
//! - a provider listed before (same address, same kind) keeps its pool and connections
//!   untouched; a change of its services changes only the routing.
//!
//! A file that cannot be read, does not parse, or lists no provider (unless
//! `--allow-empty-providers`) is kept out: one log line with the file, the line numbers
//! and what is wrong, `rpcmesh_config_reloads_total{result="error"}`, and the providers
//! stay as they were. Providers of the flags are always served. What the
//! file's lines mean is `providers_file`'s.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_wire::PeerKind;
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

use crate::cell::{self, Cells};
use crate::config::BrokerConfig;
use crate::metrics::BrokerMetrics;
use crate::providers_file::{self, FileStamp, ProvidersFileError};
use crate::route::Router;
use crate::upstream::{Placement, PoolLink, ProviderPool};
use crate::upstream_spec::UpstreamSpec;
use rpcmesh_common::retry::Idempotent;

/// How often the providers file's stamp (device, inode, size, modification time) is
/// looked at. Ansible and editors replace the file by rename, which a stamp always shows
/// (a new inode); one `stat` a second costs nothing, works on every file system (inotify
/// would have to watch the directory to see a rename, and misses changes made on another
/// host of a network file system), and a change is served within a second. SIGHUP
/// (`systemctl reload`) applies it at once.
pub const FILE_POLL: Duration = Duration::from_secs(1);

/// Asks a running broker to read its providers file again: what SIGHUP does. Requests
/// made while a read is under way are served by one more read.
#[derive(Debug, Clone, Default)]
pub struct Reload(Arc<Notify>);

impl Reload {
    /// A trigger nobody has pulled yet.
    pub fn new() -> Self {
        Reload::default()
    }

    /// Asks for a read of the providers file.
    pub fn request(&self) {
        self.0.notify_one();
    }

    pub(crate) async fn requested(&self) {
        self.0.notified().await;
    }
}

/// What making a provider's pools takes, beyond its spec.
pub(crate) struct PoolMaker {
    pub config: BrokerConfig,
    pub metrics: BrokerMetrics,
    /// The cells: a provider has a pool in each (`crate::cell`).
    pub cells: Arc<Cells>,
    pub grace_over: CancellationToken,
    pub budget: Arc<MemoryBudget>,
    /// TLS towards the providers, when on.
    pub tls: Option<Arc<rpcmesh_common::net::tls::ClientTls>>,
    /// Ejections and the retry budget, shared by every provider.
    pub guards: Arc<crate::resilience::Guards>,
    /// Told by a pool when its provider gains its first healthy connection or loses its
    /// last: the routing is then made again ([`watch`]).
    pub liveness: Arc<Notify>,
}

impl PoolMaker {
    /// The provider's pools, one per cell (in the cells' order), each made on its cell's
    /// runtime, where its connections run, with its keeper started there.
    fn make(&self, spec: &UpstreamSpec, stop: &CancellationToken) -> Vec<Pool> {
        let cells = self.cells.all();
        let size = cell::pool_share(self.config.pool_size, cells.len());
        let metrics = self
            .metrics
            .upstream(spec.label(), size * cells.len() as u32, cells.len());
        let mut first: Option<Arc<PoolLink>> = None;
        let mut pools = Vec::with_capacity(cells.len());
        for (i, cell) in cells.iter().enumerate() {
            let pool = {
                let _on_cell = cell.handle.enter();
                ProviderPool::new(
                    spec.clone(),
                    &self.config,
                    metrics.in_cell(i, i * size as usize),
                    Placement {
                        size,
                        activity: cell.shared.activity.clone(),
                        sibling: first.as_deref(),
                    },
                    self.grace_over.clone(),
                    (
                        self.budget.clone(),
                        self.guards.clone(),
                        self.liveness.clone(),
                    ),
                    self.tls.clone(),
                )
            };
            first.get_or_insert_with(|| pool.link());
            let keeper = cell.handle.spawn(pool.clone().keep(stop.clone()));
            pools.push(Pool { pool, keeper });
        }
        pools
    }
}

/// A provider's pool in one cell, and its keeper.
struct Pool {
    pool: Arc<ProviderPool>,
    keeper: JoinHandle<()>,
}

/// A provider served now.
struct Member {
    /// As listed now (its services may differ from those its pool was made with).
    spec: UpstreamSpec,
    /// Its pool in each cell, in the cells' order.
    pools: Vec<Pool>,
    /// Stops its keepers.
    stop: CancellationToken,
}

impl Member {
    /// The same provider: the same address, of the same kind (rpcmesh or plain v1).
    fn is(&self, spec: &UpstreamSpec) -> bool {
        self.spec.addr == spec.addr && self.spec.kind == spec.kind
    }
}

/// The providers served now, and those that left until their connections are closed.
pub(crate) struct Membership {
    maker: PoolMaker,
    members: Vec<Member>,
    /// One task per provider that left, until its connections are closed.
    leaving: JoinSet<()>,
    /// Parent of every keeper's stop token.
    stop_all: CancellationToken,
    /// The calls the providers file marks idempotent (beside the flags').
    idempotent: Idempotent,
}

/// What a change of the providers did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Change {
    joined: usize,
    left: usize,
    kept: usize,
}

impl Membership {
    /// Serves `specs` (a valid set: no address twice).
    pub fn start(maker: PoolMaker, specs: &[UpstreamSpec]) -> Self {
        let mut m = Membership {
            maker,
            members: Vec::new(),
            leaving: JoinSet::new(),
            stop_all: CancellationToken::new(),
            idempotent: Idempotent::default(),
        };
        m.members = specs.iter().map(|s| m.join(s)).collect();
        m
    }

    /// Takes the calls the providers file's `text` (as served now) marks idempotent.
    pub fn marking(mut self, text: Option<&str>) -> Self {
        self.idempotent = text.map(providers_file::idempotent).unwrap_or_default();
        self
    }

    fn join(&self, spec: &UpstreamSpec) -> Member {
        let stop = self.stop_all.child_token();
        Member {
            spec: spec.clone(),
            pools: self.maker.make(spec, &stop),
            stop,
        }
    }

    /// Waits until every provider served now has settled (its first connections answered
    /// their heartbeats, or a connect failed; `upstream`'s module doc), at most one pool
    /// connection timeout (`--connect-timeout` + `--health-timeout`), by which a pool's
    /// first round has normally ended; logs those still connecting then: not settled, or
    /// settled with connections made that did not answer (the round timed out, as the wait
    /// did). Providers that settled before cost nothing.
    pub async fn settled(&self) {
        let bound = self.maker.config.checkout_timeout();
        let waits = self
            .members
            .iter()
            .flat_map(|m| &m.pools)
            .map(|p| p.pool.settled());
        let _ = tokio::time::timeout(bound, futures_util::future::join_all(waits)).await;
        let late: Vec<&str> = self
            .members
            .iter()
            .filter(|m| m.pools.iter().any(|p| p.pool.is_connecting()))
            .map(|m| m.spec.addr.as_str())
            .collect();
        if !late.is_empty() {
            tracing::warn!(providers = %late.join(","), "providers still connecting: calls to them are answered \"unavailable\" until they answer");
        }
    }

    /// Publishes to each cell the router over its pools of the providers served now.
    pub fn publish(&self) {
        // The cap on ejections is a share of the providers served now.
        self.maker.guards.ejections.set_members(self.members.len());
        let config = &self.maker.config;
        let idempotent = config.idempotent.and(&self.idempotent);
        for (i, cell) in self.maker.cells.all().iter().enumerate() {
            let members: Vec<_> = self
                .members
                .iter()
                .map(|m| (m.spec.clone(), m.pools[i].pool.clone()))
                .collect();
            let router = Router::new(
                &members,
                config.balance,
                config.pack_in_flight,
                idempotent.clone(),
            );
            cell.shared.router.store(Arc::new(router));
        }
    }

    /// Makes `specs` the providers served: returns what changed, and the members that
    /// left, to [`Membership::retire`] once a router without them is published.
    fn change(&mut self, specs: &[UpstreamSpec]) -> (Change, Vec<Member>) {
        let mut old = std::mem::take(&mut self.members);
        let mut change = Change::default();
        for spec in specs {
            let member = match old.iter().position(|m| m.is(spec)) {
                Some(i) => {
                    let mut m = old.swap_remove(i);
                    if m.spec.services != spec.services {
                        tracing::info!(provider = %spec.addr, services = %spec.services_text(), "provider's services changed");
                        m.spec = spec.clone();
                    }
                    change.kept += 1;
                    m
                }
                None => {
                    tracing::info!(provider = %spec.addr, services = %spec.services_text(), v1 = spec.kind == PeerKind::V1, "provider joined");
                    change.joined += 1;
                    self.join(spec)
                }
            };
            self.members.push(member);
        }
        change.left = old.len();
        (change, old)
    }

    /// Lets providers that left go: their keepers stop, and their connections close once
    /// the calls they carry are done (each call still gets its reply or its timeout).
    fn retire(&mut self, left: Vec<Member>) {
        // Beyond the call timeout, by a connect attempt in progress and its heartbeat,
        // which may hold the pool that long.
        let config = &self.maker.config;
        let bound = config.call_timeout + config.checkout_timeout();
        for m in left {
            let calls: usize = m.pools.iter().map(|p| p.pool.calls_in_flight()).sum();
            tracing::info!(provider = %m.spec.addr, calls_in_flight = calls, "provider left: no new calls; its connections close once their calls are done");
            m.stop.cancel();
            let addr = m.spec.addr;
            let pools = m.pools;
            self.leaving.spawn(async move {
                let mut links: Vec<Arc<PoolLink>> = Vec::with_capacity(pools.len());
                for Pool { pool, keeper } in pools {
                    let _ = keeper.await;
                    links.push(pool.link());
                    // The last handles of its connections go with the pool: each
                    // connection task then ends once its calls are answered.
                    drop(pool);
                }
                let closed = futures_util::future::join_all(links.iter().map(|l| l.all_closed()));
                match tokio::time::timeout(bound, closed).await {
                    Ok(_) => tracing::info!(provider = %addr, "provider gone: its connections are closed"),
                    Err(_) => {
                        let open: usize = links.iter().map(|l| l.open_tasks()).sum();
                        tracing::warn!(provider = %addr, open, "provider left with connections still open past the call timeout");
                    }
                }
            });
        }
    }

    /// Reads the providers file at `path` and serves what it lists with the flags'
    /// providers; on success the new routers are published to the cells, once the providers
    /// that joined have settled (as at the start: a call is not answered "unavailable"
    /// only because a new provider's first connections were still being made), or `stop`.
    async fn apply(
        &mut self,
        path: &Path,
        text: &str,
        stop: &CancellationToken,
    ) -> Result<Change, ProvidersFileError> {
        let config = &self.maker.config;
        let specs = providers_file::providers_of(path, text, &config.upstreams, config.if_empty())?;
        self.idempotent = providers_file::idempotent(text);
        let (change, left) = self.change(&specs);
        if change.joined > 0 {
            tokio::select! {
                () = self.settled() => {}
                () = stop.cancelled() => {}
            }
        }
        self.publish();
        self.retire(left);
        Ok(change)
    }

    /// Stops every keeper (of providers served and leaving) and waits for them.
    pub async fn stop(mut self) {
        self.stop_all.cancel();
        for m in self.members.drain(..) {
            for p in m.pools {
                let _ = p.keeper.await;
            }
        }
        self.leaving.shutdown().await;
    }
}

/// The providers to serve at the start: the flags' and the file's. A file that cannot be
/// read now (it was checked when the flags were) is logged and counted, and only the
/// flags' are served until it can. Returns the providers and the file's text.
pub(crate) fn initial(
    config: &BrokerConfig,
    metrics: &BrokerMetrics,
) -> (Vec<UpstreamSpec>, Option<String>) {
    let Some(path) = &config.providers_file else {
        return (config.upstreams.clone(), None);
    };
    let read = providers_file::read_text(path).and_then(|text| {
        Ok((
            providers_file::providers_of(path, &text, &config.upstreams, config.if_empty())?,
            text,
        ))
    });
    match read {
        Ok((specs, text)) => {
            if specs.is_empty() {
                tracing::warn!(file = %path.display(), "no provider yet: calls are answered \"service not found\" until the providers file lists some");
            }
            (specs, Some(text))
        }
        Err(e) => {
            metrics.reloads_error.increment(1);
            tracing::error!(error = %e, "providers file kept out; serving the providers of the flags only");
            (config.upstreams.clone(), None)
        }
    }
}

/// What woke the watcher.
enum Wake {
    Stop,
    Asked,
    Poll,
    LeftGone,
    /// A provider gained its first healthy connection or lost its last.
    Liveness,
}

/// Serves reloads until `stop`: reads the providers file when `reload` is requested and
/// when its stamp changes, and applies it (see the module's doc). `text` is the file's
/// content served now. Returns the membership, for the broker to stop it.
pub(crate) async fn watch(
    mut m: Membership,
    mut text: Option<String>,
    reload: Reload,
    stop: CancellationToken,
) -> Membership {
    let path: Option<PathBuf> = m.maker.config.providers_file.clone();
    let metrics = m.maker.metrics.clone();
    // No stamp yet: the first poll reads the file and compares its text with the text
    // served (read before the start's wait for the providers, which can take seconds), so
    // a change made meanwhile is applied, and an unchanged file changes nothing.
    let mut stamp: Option<FileStamp> = None;
    let mut poll = tokio::time::interval(FILE_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    poll.reset();
    let liveness = m.maker.liveness.clone();
    loop {
        let wake = tokio::select! {
            () = stop.cancelled() => Wake::Stop,
            () = liveness.notified() => Wake::Liveness,
            () = reload.requested() => Wake::Asked,
            _ = poll.tick(), if path.is_some() => Wake::Poll,
            Some(_) = m.leaving.join_next(), if !m.leaving.is_empty() => Wake::LeftGone,
        };
        if let Wake::Liveness = wake {
            // The providers with connections come first in the routing (`route`).
            m.publish();
            continue;
        }
        let Some(path) = &path else {
            match wake {
                Wake::Stop => return m,
                Wake::Asked => tracing::info!(
                    "reload asked for, but the broker has no --providers-file: nothing to read"
                ),
                Wake::Poll | Wake::LeftGone | Wake::Liveness => {}
            }
            continue;
        };
        match wake {
            Wake::Stop => return m,
            Wake::LeftGone | Wake::Liveness => continue,
            Wake::Poll => {
                let now = stamp_of(path.clone()).await;
                if now == stamp {
                    continue;
                }
                stamp = now;
            }
            Wake::Asked => {
                tracing::info!(file = %path.display(), "reload asked for: reading the providers file");
                stamp = stamp_of(path.clone()).await;
            }
        }
        let read = read_off_runtime(path).await;
        // A change of the stamp alone (touched, rewritten alike) changes nothing.
        if matches!(wake, Wake::Poll) && read.as_ref().ok() == text.as_ref() {
            continue;
        }
        let applied = match read {
            Ok(t) => m.apply(path, &t, &stop).await.map(|c| (c, t)),
            Err(e) => Err(e),
        };
        match applied {
            Ok((change, t)) => {
                metrics.reloads_ok.increment(1);
                tracing::info!(file = %path.display(), providers = m.members.len(), joined = change.joined, left = change.left, kept = change.kept, "providers file applied");
                text = Some(t);
            }
            Err(e) => {
                metrics.reloads_error.increment(1);
                tracing::error!(error = %e, providers = m.members.len(), "providers file kept out; the providers stay as they were");
            }
        }
    }
}

/// The text of the providers file at `path`, read off the runtime's threads.
pub(crate) async fn read_off_runtime(path: &Path) -> Result<String, ProvidersFileError> {
    let p = path.to_path_buf();
    tokio::task::spawn_blocking(move || providers_file::read_text(&p))
        .await
        .unwrap_or_else(|e| {
            Err(ProvidersFileError::Read {
                path: path.to_path_buf(),
                source: std::io::Error::other(e),
            })
        })
}

/// The stamp of the file at `path`, looked at off the runtime's threads.
pub(crate) async fn stamp_of(path: PathBuf) -> Option<FileStamp> {
    tokio::task::spawn_blocking(move || FileStamp::of(&path))
        .await
        .ok()
        .flatten()
}
