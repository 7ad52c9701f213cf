//! `provider`: validates the command line and runs the library until SIGTERM/SIGINT.

use clap::Parser;
use rpcmesh_common::cli::startup;
use rpcmesh_provider::{Args, Registry};

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = args.config()?;
    startup::serve(
        "provider",
        args.listen,
        args.metrics_listen,
        args.runtime.threads,
        |telemetry, listener, shutdown| {
            rpcmesh_provider::run_with(config, Registry::builtin(), telemetry, listener, shutdown)
        },
    )?;
    Ok(())
}
