//! Shutdown plumbing shared by the three programs: waiting for SIGTERM / SIGINT, and a
//! cancellation token that `run` hands to every task it starts.
//!
//! Each program's `run(config, listener, shutdown)` takes any future as its shutdown
//! trigger; tests pass a oneshot receiver, `main` passes [`signal`].

use std::future::Future;

pub use tokio_util::sync::CancellationToken;

/// A boxed shutdown trigger, as a server's `run` is handed one by `cli::startup::serve`
/// (SIGTERM or SIGINT) or by `testkit::InProcess` (the test's stop).
pub type ShutdownSignal = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Resolves on the first SIGTERM or SIGINT (Ctrl-C).
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops this");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// A token cancelled when `trigger` resolves (or when the token is cancelled otherwise).
pub fn token_from(trigger: impl Future<Output = ()> + Send + 'static) -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = trigger => t.cancel(),
            () = t.cancelled() => {}
        }
    });
    token
}
