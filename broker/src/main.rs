//! `broker`: parses the command line, starts logging and the runtime, binds, and runs the
//! library until SIGTERM/SIGINT.

use anyhow::Context;
use clap::Parser;
use rpcmesh_broker::Args;
use rpcmesh_common::runtime;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    runtime::init_logging("info");
    let mut config = args.config()?;
    if args.metrics_listen.0.is_none() {
        // Nobody can read the histograms: do not time stages at all.
        config.stage_sample = 0;
    }
    let rt = runtime::build("broker", args.threads).context("starting the runtime")?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let telemetry = rpcmesh_common::telemetry::start(args.metrics_listen)
            .context("starting the metrics endpoint")?;
        rpcmesh_broker::run_with(
            config,
            telemetry,
            listener,
            rpcmesh_common::shutdown::signal(),
        )
        .await;
        Ok(())
    })
}
