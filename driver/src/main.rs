//! `driver`: parses the command line, starts logging and the runtime, runs the load (with
//! an embedded provider and broker when no target is given), prints the report and writes
//! it as JSON when asked. Ctrl-C ends the run early and still reports. Exits 1 when no
//! call succeeded.

use anyhow::Context;
use clap::Parser;
use rpcmesh_common::runtime;
use rpcmesh_common::shutdown::CancellationToken;
use rpcmesh_driver::Args;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    runtime::init_logging("warn");
    let mut config = args.config()?;
    if args.metrics_listen.0.is_none() {
        // Nobody can read the histograms: do not time stages at all.
        config.stage_sample = 0;
    }
    let json = config.json.clone();
    let rt = runtime::build("driver", args.threads).context("starting the runtime")?;
    let report = rt.block_on(async {
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            rpcmesh_common::shutdown::signal().await;
            s.cancel();
        });
        let telemetry = match rpcmesh_common::telemetry::start(args.metrics_listen) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "metrics endpoint not started; running without it");
                rpcmesh_common::telemetry::Telemetry::discard()
            }
        };
        rpcmesh_driver::run_with(config, telemetry, stop).await
    })?;
    print!("{}", report.render_text());
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if !args.linger.is_zero() {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        tracing::info!(
            seconds = args.linger.as_secs_f64(),
            "lingering so that the last figures get scraped"
        );
        rt.block_on(async {
            tokio::select! {
                () = tokio::time::sleep(args.linger) => {}
                () = rpcmesh_common::shutdown::signal() => {}
            }
        });
    }
    if report.calls.ok == 0 {
        // A run that measured nothing is a failure, for scripts as for people.
        anyhow::bail!(
            "no call succeeded ({} sent, {} failed connection attempts)",
            report.calls.sent,
            report.calls.connect_failures
        );
    }
    Ok(())
}
