//! `driver`: parses the command line, starts logging and the runtime, runs the load (with
//! an embedded provider and broker when no target is given), prints the report and writes
//! it as JSON when asked. Ctrl-C ends the run early and still reports.

use anyhow::Context;
use clap::Parser;
use rpcmesh_common::runtime;
use rpcmesh_common::shutdown::CancellationToken;
use rpcmesh_driver::Args;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    runtime::init_logging("warn");
    let config = args.config()?;
    let json = config.json.clone();
    let rt = runtime::build("driver", args.threads).context("starting the runtime")?;
    let report = rt.block_on(async {
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            rpcmesh_common::shutdown::signal().await;
            s.cancel();
        });
        rpcmesh_driver::run(config, stop).await
    })?;
    print!("{}", report.render_text());
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
