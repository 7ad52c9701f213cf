//! `driver`: validates the command line, runs the load (with an embedded provider and
//! broker when no target is given), prints the report and writes it as JSON when asked.
//! Ctrl-C ends the run early and still reports. The exit status says how the run ended
//! (`rpcmesh_driver::verdict`, listed in `--help`). `driver merge` combines interval logs;
//! `driver capacity` runs a capacity experiment; `driver fault-report` makes the fault
//! lab's report.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use rpcmesh_common::cli::{ConfigProblems, startup};
use rpcmesh_common::metrics::{Telemetry, recorder};
use rpcmesh_common::net::shutdown::{self, CancellationToken};
use rpcmesh_driver::capacity::config::CapacityConfig;
use rpcmesh_driver::config::{CapacityArgs, Command, FaultReportArgs, MergeArgs};
use rpcmesh_driver::verdict::{FAILED, REFUSED};
use rpcmesh_driver::{Args, Verdict};

fn main() -> ExitCode {
    let args = Args::parse();
    let done = match &args.command {
        Some(Command::Merge(m)) => merge(m),
        Some(Command::Capacity(c)) => capacity(c),
        Some(Command::FaultReport(f)) => fault_report(f),
        Some(Command::Serve(s)) => {
            rpcmesh_driver::capacity::mesh::serve(s.role, &s.flags).map(|()| 0)
        }
        None => run(&args),
    };
    match done {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let refused = e.downcast_ref::<ConfigProblems>().is_some();
            eprintln!("driver: {e:#}");
            ExitCode::from(if refused { REFUSED } else { FAILED })
        }
    }
}

/// A run: the report, and the exit status its verdict gives.
fn run(args: &Args) -> anyhow::Result<u8> {
    let config = args.config()?;
    let json = config.json.clone();
    let rt = startup::start("driver", "warn", args.load.runtime.threads)?;
    let report = rt.block_on(async {
        let stop = stop_on_signal();
        let telemetry = recorder::start(args.load.metrics_listen.0).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "metrics endpoint not started; running without it");
            Telemetry::discard()
        });
        rpcmesh_driver::run_with(config, telemetry, stop).await
    })?;
    print_report(&report.render_text());
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let linger = args.linger.0;
    if !linger.is_zero() {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        tracing::info!(
            seconds = linger.as_secs_f64(),
            "lingering so that the last figures get scraped"
        );
        rt.block_on(async {
            tokio::select! {
                () = tokio::time::sleep(linger) => {}
                () = shutdown::signal() => {}
            }
        });
    }
    let verdict = Verdict::of(&report, args.allow_unsent);
    if let Some(m) = verdict.message(&report) {
        eprintln!("driver: {m}");
    }
    Ok(verdict.exit_code())
}

/// `driver merge`: the combined report of a fleet's interval logs.
fn merge(m: &MergeArgs) -> anyhow::Result<u8> {
    let report = rpcmesh_driver::hdr_log::merge(&m.files)?;
    print_report(&report.render_text());
    if let Some(path) = &m.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(0)
}

/// `driver fault-report`: the fault lab's report, on stdout (Markdown) and in the files
/// asked for.
fn fault_report(args: &FaultReportArgs) -> anyhow::Result<u8> {
    let report = rpcmesh_driver::fault_report::make(&args.runs)?;
    let markdown = report.render_markdown();
    print_report(&markdown);
    let write = |path: &std::path::Path, text: String| {
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    };
    if let Some(p) = &args.json {
        write(p, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    if let Some(p) = &args.markdown {
        write(p, markdown)?;
    }
    if let Some(p) = &args.html {
        write(p, rpcmesh_capacity::html::render_faults(&report))?;
    }
    Ok(0)
}

/// `driver capacity`: the experiment, its report on stdout and in the files asked for.
fn capacity(args: &CapacityArgs) -> anyhow::Result<u8> {
    let config = CapacityConfig::new(args)?;
    let exe = std::env::current_exe().context("finding the driver binary")?;
    let rt = startup::start("driver", "warn", args.load.runtime.threads)?;
    let outputs = config.outputs.clone();
    let stop = rt.block_on(async { stop_on_signal() });
    let report = rpcmesh_driver::capacity::run(config, &exe, &rt, stop)?;
    print_report(&report.render_text());
    let write = |path: &std::path::Path, text: String| {
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    };
    if let Some(p) = &outputs.json {
        write(p, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    if let Some(p) = &outputs.markdown {
        write(p, report.render_markdown())?;
    }
    if let Some(p) = &outputs.html {
        write(p, rpcmesh_capacity::html::render(&report))?;
    }
    Ok(0)
}

/// A token cancelled by SIGTERM or SIGINT (Ctrl-C): the run ends early and still reports.
fn stop_on_signal() -> CancellationToken {
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move {
        shutdown::signal().await;
        s.cancel();
    });
    stop
}

/// Writes a report's text to stdout. A stdout that is gone (`driver … | head` once `head`
/// has exited) loses the text, not the run: the JSON file, the exit status and the metrics
/// still tell what happened, where `print!` would panic.
fn print_report(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        tracing::warn!(error = %e, "the report could not be written to stdout");
    }
}
