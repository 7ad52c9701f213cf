//! `broker`: validates the command line and runs the library until SIGTERM/SIGINT.

use clap::Parser;
use rpcmesh_broker::Args;
use rpcmesh_common::cli::startup;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = args.config()?;
    startup::serve(
        "broker",
        args.listen,
        args.metrics_listen,
        args.runtime.threads,
        |telemetry, listener, shutdown| {
            rpcmesh_broker::run_with(config, telemetry, listener, shutdown)
        },
    )?;
    Ok(())
}
