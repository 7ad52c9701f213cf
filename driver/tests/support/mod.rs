//! What the driver's black-box tests that run the load in-process share: starting a run on
//! its own telemetry and stop token, and ending it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_driver::{DriverConfig, Report};
use rpcmesh_testkit::WAIT_TIMEOUT;

/// Starts a run of `config`: its telemetry (to watch it), the token that stops it, and
/// the task that ends with its report.
pub fn start(
    config: DriverConfig,
) -> (
    Telemetry,
    CancellationToken,
    tokio::task::JoinHandle<anyhow::Result<Report>>,
) {
    let telemetry = Telemetry::new();
    let stop = CancellationToken::new();
    let run = tokio::spawn(rpcmesh_driver::run_with(
        config,
        telemetry.clone(),
        stop.clone(),
    ));
    (telemetry, stop, run)
}

/// Ends the run (now, if it is still going) and returns its report.
pub async fn finish(
    run: tokio::task::JoinHandle<anyhow::Result<Report>>,
    stop: CancellationToken,
) -> Report {
    stop.cancel();
    tokio::time::timeout(WAIT_TIMEOUT, run)
        .await
        .expect("the run ends once stopped")
        .unwrap()
        .unwrap()
}
