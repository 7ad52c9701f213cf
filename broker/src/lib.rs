//! rpcmesh broker: a stateless RPCF v1 proxy. It accepts framed calls from many clients
//! and multiplexes them onto a few pooled connections per provider; it routes, balances,
//! times out and sheds calls, and never decodes or inflates a payload it forwards.
//!
//! The request path, in modules (see `docs/architecture.md`):
//!
//! - `session`: a client connection: frames in, names read, caps checked, routed;
//!   replies back under the caller's id (the protocol run by the shared server-session
//!   skeleton, `rpcmesh_common::net::session`).
//! - `route`: which provider and which of its connections takes a call.
//! - `membership`: which providers are served, and their joins and leaves when the
//!   providers file changes (SIGHUP, or a change seen on disk); `providers_file`: that
//!   file's format.
//! - `upstream`: the pools (`bb8`) and the connections: a session queues a call on one
//!   itself, under the connection's request id; the connection's task writes the calls,
//!   matches the replies and times calls out. Towards a plain v1 server (`--upstream-v1`),
//!   which may leave Nagle's algorithm on, a connection ACKs each read at once while calls
//!   are still in flight on it, so that the server's next reply does not wait 40 ms for a
//!   delayed ACK (`upstream::connection`; docs/performance.md, "Behind a plain v1 server
//!   with Nagle on").
//! - `call`: what passes between sessions and upstream connections: a call offered for
//!   routing (`Forward`), and the session's inbox, into which upstream connections copy
//!   replies under the callers' ids.
//! - `cell`: with `--threads N`, N cells, each a single-threaded runtime serving the
//!   client connections dealt to it over its own pools, so that no call crosses threads.
//! - `in_flight`: the broker-wide cap on calls in flight, leased to the cells in blocks.
//! - `failure`: every answer the broker makes itself, with its side and retry safety.
//! - [`config`], [`UpstreamSpec`] (the `--upstream` syntax), [`metrics`].
//!
//! [`run`] serves a bound listener until its shutdown future resolves, then drains; tests
//! call it on port 0, `main` with the configured address and SIGTERM/SIGINT, and SIGHUP
//! as the [`Reload`] trigger ([`run_with_reload`]).

mod call;
mod cell;
pub mod config;
pub mod engine;
mod failure;
mod in_flight;
mod membership;
pub mod metrics;
pub mod providers_file;
pub mod resilience;
mod route;
mod session;
pub mod upstream;
mod upstream_spec;

use std::future::Future;
use std::sync::Arc;

use rpcmesh_common::cli::DurationArg;
use rpcmesh_common::cli::security::{Security, SecuritySettings};
use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::metrics::families::publish_budget;
use rpcmesh_common::metrics::system::Housekeeping;
use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::busy_poll::{self, Activity};
use rpcmesh_common::net::listener::{self, AcceptConfig, Listeners, ServeSummary};
use rpcmesh_common::net::shutdown::{self, CancellationToken};

pub use config::{
    Args, Balance, BrokerConfig, BusyPoll, CellPlacement, EngineKind, PlacementTuning,
};
pub use membership::{FILE_POLL, Reload};
pub use metrics::BrokerMetrics;
pub use upstream_spec::UpstreamSpec;
// Fixed limits that are not flags, public so that the docs quoting them are held to the
// code (`tests/docs_constants.rs`).
pub use cell::placement::{
    RETRY_FIRST, RETRY_MAX, REVIEW as PLACEMENT_REVIEW, SPREAD_BUSY_PCT, SPREAD_GAIN_PCT,
    STEADY_REVIEWS,
};
pub use in_flight::LEASE_BLOCK;
pub use session::MAX_RETRIES;
pub use upstream::connection::{REQUEST_RETAIN, RING_MAX, RING_MIN};

/// The whole program after its flags are parsed: validates them, then serves until
/// SIGTERM/SIGINT, reading the providers file again on SIGHUP (what `broker`'s `main` is,
/// and `driver serve broker`).
pub fn main_with(args: &Args) -> anyhow::Result<()> {
    let config = args.config()?;
    if config.engine == config::EngineKind::Loop {
        return main_on_loop(args, config);
    }
    // Bound before the runtime, so that a plain address in use stops the start.
    let plain = args
        .tls
        .listen_plain
        .map(rpcmesh_common::cli::startup::bind_std)
        .transpose()?;
    // Ready for systemd once the pools have settled (run_with_reload says so), not when
    // the port is bound: "active" then means calls are routed.
    rpcmesh_common::cli::startup::serve_with(
        server(args, &config),
        rpcmesh_common::cli::systemd::Readiness::Announced,
        |telemetry, listener, shutdown| {
            // Installed before the first call is served: from then on SIGHUP reloads
            // instead of ending the process.
            let reload = Reload::new();
            on_sighup(reload.clone());
            let listeners = Listeners::with_plain(listener, plain);
            run_with_reload(config, telemetry, listeners, shutdown, reload)
        },
    )?;
    Ok(())
}

/// Says that the broker serves, once its providers have settled (docs/broker.md, "At the
/// start"), as both engines do: the log line `broker listening` with what it serves and
/// how, and `READY=1` to systemd (a no-op unless systemd runs it, `Type=notify`), so that
/// "active" means calls are routed.
pub(crate) fn listening(
    config: &BrokerConfig,
    addr: Option<std::net::SocketAddr>,
    providers: &[UpstreamSpec],
    busy_poll: Option<std::time::Duration>,
    workers: usize,
) {
    let upstreams: Vec<String> = providers.iter().map(ToString::to_string).collect();
    tracing::info!(
        addr = addr.map(tracing::field::display),
        engine = %config.engine,
        tls = config.tls.is_some(),
        upstream_tls = config.upstream_tls.is_some(),
        authz_policy = config.authz_policy.as_deref().map(|p| tracing::field::display(p.display())),
        // One field: quoted, as the specs are written on the command line.
        upstreams = ?upstreams.join(" "),
        providers_file = config.providers_file.as_deref().map(|p| tracing::field::display(p.display())),
        pool_size = config.pool_size,
        balance = %config.balance,
        busy_poll = %busy_poll.map_or_else(|| "off".to_string(), |w| DurationArg(w).to_string()),
        workers,
        cells = config.cells,
        "broker listening"
    );
    rpcmesh_common::cli::systemd::notify_ready(&format!(
        "routing to {} providers",
        providers.len()
    ));
}

/// `main_with` on the loop engine (`--engine loop`): a runtime of one thread serves the
/// metrics endpoint and waits for SIGTERM/SIGINT while the engine's own thread serves the
/// calls (`engine::run`). Ready for systemd once its providers have settled, as on Tokio
/// (the engine says so: [`listening`]).
fn main_on_loop(args: &Args, config: BrokerConfig) -> anyhow::Result<()> {
    // Bound before the runtime, so that a plain address in use stops the start.
    let plain = args
        .tls
        .listen_plain
        .map(rpcmesh_common::cli::startup::bind_std)
        .transpose()?;
    let outcome = Arc::new(std::sync::Mutex::new(None));
    let ended = outcome.clone();
    rpcmesh_common::cli::startup::serve_with(
        server(args, &config),
        rpcmesh_common::cli::systemd::Readiness::Announced,
        |telemetry, listener, shutdown| async move {
            // Installed before the first call is served: from then on SIGHUP reads the
            // providers file again instead of ending the process.
            let reload = Reload::new();
            on_sighup(reload.clone());
            let listeners = Listeners::with_plain(listener, plain);
            let r = engine::run_with_reload(config, telemetry, listeners, shutdown, reload).await;
            if let Ok(s) = &r {
                tracing::info!(
                    accepted = s.accepted,
                    refused = s.refused,
                    cut = s.cut,
                    aborted = s.aborted,
                    calls = s.calls,
                    "broker stopped"
                );
            }
            *ended
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(r);
        },
    )?;
    let r = outcome
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    match r {
        Some(Err(e)) => Err(anyhow::Error::new(e).context("the loop engine failed")),
        _ => Ok(()),
    }
}

/// What the broker's runtime is started with: one thread (the Tokio engine's first cell,
/// which starts the others itself (`cell`), or the loop engine's control plane).
fn server<'a>(args: &Args, config: &BrokerConfig) -> rpcmesh_common::cli::startup::Server<'a> {
    rpcmesh_common::cli::startup::Server {
        program: "broker",
        listen: args.listen,
        metrics: args.metrics_listen,
        threads: 1,
        grace: config.grace,
    }
}

/// Pulls `reload` on every SIGHUP, for the life of the runtime.
fn on_sighup(reload: Reload) {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(mut hup) => {
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    tracing::info!("SIGHUP received");
                    reload.request();
                }
            });
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; the providers file is still read when it changes")
        }
    }
}

/// Serves `listener` until `shutdown` resolves, then stops accepting, lets calls in
/// flight finish within the grace period, and closes the provider pools.
pub async fn run(
    config: BrokerConfig,
    listener: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> ServeSummary {
    run_with(config, Telemetry::new(), listener, shutdown).await
}

/// As [`run`], recording metrics into `telemetry`.
pub async fn run_with(
    config: BrokerConfig,
    telemetry: Telemetry,
    listener: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> ServeSummary {
    run_with_reload(config, telemetry, listener, shutdown, Reload::new()).await
}

/// As [`run_with`], reading the providers file again whenever `reload` is pulled (and
/// when the file changes, as always).
pub async fn run_with_reload(
    config: BrokerConfig,
    telemetry: Telemetry,
    listener: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    reload: Reload,
) -> ServeSummary {
    config.warnings.log();
    let listener = listener.into();
    let metrics = BrokerMetrics::new(telemetry, config.stage_sample);
    let token = shutdown::token_from(shutdown);
    let settings = SecuritySettings {
        server: config.tls.clone(),
        client: config.upstream_tls.clone(),
        policy: config.authz_policy.clone(),
    };
    let security = match Security::start(
        metrics::ROLE,
        &metrics.telemetry,
        settings,
        token.child_token(),
    ) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "broker not started");
            return ServeSummary::default();
        }
    };
    // Each cell is a runtime of one thread; with one cell, the runtime `run` is called on
    // (which may have more).
    let (threads, handles) = match cell::CellThreads::start("broker", config.cells.max(1) - 1) {
        Ok(started) => started,
        Err(e) => {
            tracing::error!(error = %e, cells = config.cells, "broker not started: its cells' threads could not be started");
            return ServeSummary::default();
        }
    };
    // The threads serving calls that may spin at once: busy polling is on by default only
    // when that is one (`BusyPoll::Auto`). Gathered cells spin only where connections
    // are, and no more cells hold them than keep up.
    let gather = config.cell_placement == config::CellPlacement::Gather;
    let workers = match config.cells {
        1 => tokio::runtime::Handle::current().metrics().num_workers(),
        _ if gather => 1,
        n => n,
    };
    let busy_poll = config.busy_poll.window(workers);
    // Cancelled by the accept loop when the grace period ends: the upstream connections
    // then answer the calls they still hold, and the sessions pass the answers on.
    let grace_over = CancellationToken::new();
    let budget = MemoryBudget::new(config.memory_budget);
    publish_budget(&metrics.telemetry, metrics::ROLE, &budget);
    let guards = resilience::Guards::new(config.resilience, &metrics);
    let in_flight = in_flight::InFlightCap::new(config.max_in_flight, config.cells);
    let empty = route::Router::new(
        &[],
        config.balance,
        config.pack_in_flight,
        config.idempotent.clone(),
    );
    let empty = Arc::new(empty);
    let cells = cell::Cells::new(
        std::iter::once(tokio::runtime::Handle::current())
            .chain(handles)
            .enumerate()
            .map(|(i, handle)| {
                cell::Cell::new(
                    handle,
                    Arc::new(session::Shared {
                        router: arc_swap::ArcSwap::new(empty.clone()),
                        // Every socket of a cell, client and provider side, tells its
                        // spinner of reads.
                        activity: busy_poll.map(|_| Activity::new()),
                        budget: budget.clone(),
                        config: config.clone(),
                        metrics: metrics.clone(),
                        in_flight: in_flight.lease(),
                        security: security.clone(),
                        guards: guards.clone(),
                        cell_calls: metrics.cell_calls(i, config.cells),
                        answered: Default::default(),
                        spin_idle_ns: Default::default(),
                    }),
                )
            })
            .collect(),
        gather,
        &metrics,
    );
    let (providers, text) = membership::initial(&config, &metrics);
    let members = membership::Membership::start(
        membership::PoolMaker {
            config: config.clone(),
            metrics: metrics.clone(),
            cells: cells.clone(),
            grace_over: grace_over.clone(),
            budget: budget.clone(),
            tls: security.upstream.clone(),
            guards: guards.clone(),
            liveness: Arc::new(tokio::sync::Notify::new()),
        },
        &providers,
    )
    .marking(text.as_deref());
    members.publish();
    // Calls are accepted once every provider has settled (bounded): a caller that connects
    // meanwhile waits in the listen backlog instead of being answered "unavailable".
    let stopped = tokio::select! {
        () = members.settled() => false,
        () = token.cancelled() => true,
    };
    // Stopped before it served: the accept loop below returns at once, and callers that
    // waited in the backlog are reset when the listener closes.
    if !stopped {
        listening(
            &config,
            listener.main.local_addr().ok(),
            &providers,
            busy_poll,
            workers,
        );
    }
    let accept = AcceptConfig {
        max_connections: config.max_connections,
        sources: config.sources,
        grace: config.grace,
    };
    let observer = metrics.conns.clone();
    let watcher = tokio::spawn(membership::watch(
        members,
        text,
        reload,
        token.child_token(),
    ));
    // A spinner per cell, on the cell.
    let spinners: Vec<_> = cells
        .all()
        .iter()
        .filter_map(|cell| {
            let (window, activity) = busy_poll.zip(cell.shared.activity.clone())?;
            let idle = metrics.busy_poll_idle.clone();
            let shared = cell.shared.clone();
            let record = move |d: std::time::Duration| {
                idle.record(d.as_secs_f64());
                let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
                shared
                    .spin_idle_ns
                    .fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
            };
            let _on_cell = cell.handle.enter();
            Some(busy_poll::spawn(
                activity,
                window,
                token.child_token(),
                record,
            ))
        })
        .collect();
    // Where the connections of several cells live (`cell::placement`).
    let placement = (gather && cells.all().len() > 1).then(|| {
        tokio::spawn(cell::placement::run(
            cells.clone(),
            config.placement_tuning,
            token.child_token(),
        ))
    });
    let housekeeping = Housekeeping::start(&metrics.telemetry, metrics::ROLE);
    let dealer = cells.clone();
    let summary = listener::serve(
        listener,
        accept,
        token,
        grace_over,
        observer,
        move |stream, peer, via, stop| dealer.serve(stream, peer, via, stop),
    )
    .await;
    drop(housekeeping);
    if let Some(p) = placement {
        p.abort();
    }
    for s in spinners {
        s.abort();
    }
    // The watcher stopped with the shutdown token; it hands the providers back.
    if let Ok(members) = watcher.await {
        members.stop().await;
    }
    drop(cells);
    threads.stop().await;
    tracing::info!(
        accepted = summary.accepted,
        refused = summary.refused,
        cut = summary.cut,
        aborted = summary.aborted,
        "broker stopped"
    );
    summary
}
