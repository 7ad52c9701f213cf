//! The driver's interval log (`--hdr-log`) as HdrHistogram's own tools read it: an
//! open-loop run against a real provider writes the log, and HdrHistogram's Java
//! `HistogramLogProcessor` (Debian package `libhdrhistogram-java`, run by a real JVM)
//! reads every tag of it. Its totals must be the driver's own report: every sample in
//! the log, at the values the report gives.
//!
//! Needs `java` and `/usr/share/java/hdrhistogram.jar` (`scripts/deps` installs both).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_driver::config::ProgressMode;
use rpcmesh_driver::pacer::Schedule;
use rpcmesh_driver::stats::LatencySummary;
use rpcmesh_driver::{DriverConfig, Stop};
use rpcmesh_provider::{ProviderConfig, Registry};
use rpcmesh_testkit::InProcess;

/// Where Debian's `libhdrhistogram-java` puts HdrHistogram.
const HDRHISTOGRAM_JAR: &str = "/usr/share/java/hdrhistogram.jar";

/// The totals of the last line of `HistogramLogProcessor -csv` for one tag: count, p50,
/// p90, p99 and max, in ms.
#[derive(Debug)]
struct Totals {
    count: u64,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

fn process(log: &Path, tag: &str) -> Totals {
    assert!(
        Path::new(HDRHISTOGRAM_JAR).is_file(),
        "{HDRHISTOGRAM_JAR} is missing: run scripts/deps (Debian package libhdrhistogram-java)"
    );
    let out = log.with_extension(tag);
    let run = Command::new("java")
        .args([
            "-cp",
            HDRHISTOGRAM_JAR,
            "org.HdrHistogram.HistogramLogProcessor",
        ])
        .arg("-i")
        .arg(log)
        .args(["-tag", tag, "-csv", "-outputValueUnitRatio", "1000", "-o"])
        .arg(&out)
        .output()
        .unwrap_or_else(|e| panic!("java: {e} (run scripts/deps: default-jre-headless)"));
    assert!(
        run.status.success(),
        "HistogramLogProcessor on {tag}: {}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let csv = std::fs::read_to_string(&out).unwrap();
    // "Timestamp","Int_Count","Int_50%","Int_90%","Int_Max","Total_Count","Total_50%",
    // "Total_90%","Total_99%","Total_99.9%","Total_99.99%","Total_Max"
    let last = csv
        .lines()
        .rfind(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .unwrap_or_else(|| panic!("no interval read for {tag}:\n{csv}"));
    let f: Vec<f64> = last.split(',').map(|x| x.parse().unwrap()).collect();
    assert_eq!(f.len(), 12, "{last}");
    Totals {
        count: f[5] as u64,
        p50: f[6],
        p90: f[7],
        p99: f[8],
        max: f[11],
    }
}

/// The processor's totals are the report's: the same samples, the same histogram.
fn assert_same(tag: &str, java: &Totals, ours: &LatencySummary) {
    assert_eq!(java.count, ours.count, "{tag}: {java:?} vs {ours:?}");
    // Both read one histogram; the processor prints three decimals of a millisecond.
    for (what, j, o) in [
        ("p50", java.p50, ours.p50_ms),
        ("p90", java.p90, ours.p90_ms),
        ("p99", java.p99, ours.p99_ms),
        ("max", java.max, ours.max_ms),
    ] {
        assert!(
            (j - o).abs() <= 0.0015 + o * 1e-3,
            "{tag} {what}: HdrHistogram says {j} ms, the report {o} ms"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hdrhistograms_own_log_processor_reads_the_log_and_finds_the_reports_figures() {
    let provider = InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(
            ProviderConfig::default(),
            Registry::builtin(),
            telemetry,
            listener,
            stop,
        )
    })
    .await;
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hdr-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("driver.hlog");
    // Open loop, so that all four tags are written; over two seconds, so that the log has
    // several intervals (one a second, and the last part).
    let config = DriverConfig {
        targets: vec![provider.addr.to_string()],
        schedule: Some(Schedule::Constant(1000.0)),
        concurrency: 100,
        connections: 2,
        stop: Stop::Duration(Duration::from_millis(2500)),
        warmup: Duration::from_millis(300),
        progress: ProgressMode::Off,
        hdr_log: Some(log.clone()),
        ..DriverConfig::default()
    };
    let r = rpcmesh_driver::run(config, CancellationToken::new())
        .await
        .unwrap();
    provider.stop().await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.lines().filter(|l| l.starts_with("Tag=calls,")).count() >= 3,
        "an interval a second:\n{text}"
    );
    assert_same("requests", &process(&log, "requests"), &r.requests.latency);
    assert_same("calls", &process(&log, "calls"), &r.calls.latency);
    assert_same(
        "requests_uncorrected",
        &process(&log, "requests_uncorrected"),
        r.requests.latency_uncorrected.as_ref().unwrap(),
    );
    assert_same(
        "calls_uncorrected",
        &process(&log, "calls_uncorrected"),
        r.calls.latency_uncorrected.as_ref().unwrap(),
    );
    let _ = std::fs::remove_dir_all(&dir);
}
