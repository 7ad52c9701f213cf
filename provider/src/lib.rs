//! rpcmesh provider: hosts services and answers RPCF v1 calls (with rpcmesh's extensions
//! for callers that ask for them).
//!
//! - [`config`]: command line, defaults, validation.
//! - [`service`]: the handler interface, the registry, and the built-in services.
//! - `session`: one connection: frames → calls → handlers → replies (the protocol run by
//!   the shared server-session skeleton, `rpcmesh_common::net::session`).
//! - [`metrics`]: the metric handles.
//! - [`classic`]: the classic plain RPCF v1 server (`provider --classic`): Nagle on, one
//!   call at a time per connection, one write per reply, as the original framework's
//!   server; the broker is tested and benchmarked behind it.
//!
//! [`run`] serves a bound listener until its shutdown future resolves, then drains; tests
//! call it on port 0, `main` with the configured address and SIGTERM/SIGINT
//! ([`classic::run`] likewise).

pub mod classic;
pub mod config;
pub mod metrics;
pub mod service;
mod session;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use rpcmesh_common::cli::security::{Security, SecuritySettings};
use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::metrics::families::publish_budget;
use rpcmesh_common::metrics::system::Housekeeping;
use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::connection::CloseReason;
use rpcmesh_common::net::listener::{self, AcceptConfig, Listeners, ServeSummary, Via};
use rpcmesh_common::net::pace::PerCall;
use rpcmesh_common::net::session::Stop;
use rpcmesh_common::net::shutdown::{self, CancellationToken};
use tokio::net::TcpStream;

pub use config::{Args, ProviderConfig};
pub use metrics::ProviderMetrics;
pub use service::Registry;

/// The whole program after its flags are parsed: validates them, then serves until
/// SIGTERM/SIGINT (what `provider`'s `main` is, and `driver serve provider`).
pub fn main_with(args: &Args) -> anyhow::Result<()> {
    let config = args.config()?;
    // Bound before the runtime, so that a plain address in use stops the start.
    let plain = args
        .tls
        .listen_plain
        .map(rpcmesh_common::cli::startup::bind_std)
        .transpose()?;
    let server = rpcmesh_common::cli::startup::Server {
        program: "provider",
        listen: args.listen,
        metrics: args.metrics_listen,
        threads: args.runtime.threads,
        grace: config.grace,
    };
    rpcmesh_common::cli::startup::serve(server, |telemetry, listener, shutdown| async move {
        config.warnings.log();
        let listeners = Listeners::with_plain(listener, plain);
        let mut registry = if config.classic {
            classic::registry()
        } else {
            Registry::builtin()
        };
        if config.fail_calls {
            registry.fail_every_call();
            tracing::warn!("--fail-calls: every call is answered failed");
        }
        if config.classic {
            classic::run_with(config, registry, telemetry, listeners.main, shutdown).await
        } else {
            run_with(config, registry, telemetry, listeners, shutdown).await
        }
    })?;
    Ok(())
}

/// Serves the built-in services on `listener` until `shutdown` resolves, then stops
/// accepting and lets calls in flight finish within the grace period.
pub async fn run(
    config: ProviderConfig,
    listener: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> ServeSummary {
    run_with(
        config,
        Registry::builtin(),
        Telemetry::new(),
        listener,
        shutdown,
    )
    .await
}

/// What the provider and the classic server ([`classic`]) share around their sessions:
/// the memory budget and its gauges, the housekeeping metrics, and the accept loop that
/// runs `session` for each connection until `shutdown`, then drains.
pub(crate) async fn serve_connections<F, Fut>(
    config: ProviderConfig,
    registry: Registry,
    metrics: ProviderMetrics,
    listener: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    session: F,
) -> ServeSummary
where
    F: Fn(TcpStream, SocketAddr, Via, Arc<session::Shared>, Stop) -> Fut,
    Fut: Future<Output = CloseReason> + Send + 'static,
{
    let accept = AcceptConfig {
        max_connections: config.max_connections,
        sources: config.sources,
        grace: config.grace,
    };
    let observer = metrics.conns.clone();
    let budget = MemoryBudget::new(config.memory_budget);
    publish_budget(&metrics.telemetry, metrics::ROLE, &budget);
    let token = shutdown::token_from(shutdown);
    let settings = SecuritySettings {
        server: config.tls.clone(),
        client: None,
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
            tracing::error!(error = %e, "provider not started");
            return ServeSummary::default();
        }
    };
    let shared = Arc::new(session::Shared {
        budget,
        config,
        registry,
        metrics,
        pace: PerCall::new(),
        security,
    });
    let housekeeping = Housekeeping::start(&shared.metrics.telemetry, metrics::ROLE);
    let summary = listener::serve(
        listener,
        accept,
        token,
        CancellationToken::new(),
        observer,
        move |stream, peer, via, stop| session(stream, peer, via, shared.clone(), stop),
    )
    .await;
    drop(housekeeping);
    summary
}

/// As [`run`], with the services and the metrics recorder given.
pub async fn run_with(
    config: ProviderConfig,
    registry: Registry,
    telemetry: Telemetry,
    listener: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> ServeSummary {
    let registry = registry.with_service_time(config.service_time, config.service_mode);
    let metrics = ProviderMetrics::new(telemetry, &registry, config.stage_sample);
    let listener = listener.into();
    tracing::info!(
        addr = listener.main.local_addr().ok().map(tracing::field::display),
        tls = config.tls.is_some(),
        authz_policy = config.authz_policy.as_deref().map(|p| tracing::field::display(p.display())),
        services = %registry.services().join(","),
        compression = config.compression.is_some(),
        service_time = %config.service_time,
        service_mode = %config.service_mode,
        "provider listening"
    );
    let summary = serve_connections(
        config,
        registry,
        metrics,
        listener,
        shutdown,
        session::serve,
    )
    .await;
    tracing::info!(
        accepted = summary.accepted,
        refused = summary.refused,
        cut = summary.cut,
        aborted = summary.aborted,
        "provider stopped"
    );
    summary
}
