//! The benchmark command, `scripts/bench`, in its smoke mode: one short repeat of echo at 8
//! calls in flight over each of the three paths (direct, through the broker, through
//! HAProxy), so that the command cannot rot. Nothing about speed is asserted: only that the
//! command exits 0, that its JSON report has calls on every path and, for every run, where
//! the CPU of each process on the path went, and that the machine's stall probe ran.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use rpcmesh_common::testkit;

/// The smoke run takes a few seconds; this only catches a hang (the script bounds every
/// wait itself, and its processes die with it).
const SMOKE_TIMEOUT: Duration = Duration::from_secs(180);

/// Whether HAProxy is installed: on `PATH`, or where Debian puts it (`/usr/sbin`, often
/// missing from a non-root `PATH`; the bench looks there too).
fn haproxy_installed() -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join("haproxy").is_file()))
        || Path::new("/usr/sbin/haproxy").is_file()
}

/// HAProxy is one of the three paths. Tests never install anything: `scripts/test` runs
/// `scripts/deps` first, which installs it; a test run without it fails here, saying so.
fn require_haproxy() {
    assert!(
        haproxy_installed(),
        "haproxy is not installed: run scripts/deps (or install the Debian package `haproxy`), \
         or run the tests through scripts/test, which does"
    );
}

#[test]
fn bench_smoke_mode_reports_calls_on_all_three_paths() {
    require_haproxy();
    let smoke = testkit::smoke_script(
        "bench",
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        SMOKE_TIMEOUT,
    );
    let (run, output) = (&smoke.run, &smoke.run.output);
    let json = smoke.report("bench-", "json");
    smoke.report("bench-", "md");
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["mode"], "smoke");
    // The stall probe ran one clock-reading spinner per CPU.
    let stalls = &report["stall_probe"];
    assert!(
        stalls["spinners"].as_u64().is_some_and(|n| n >= 1)
            && stalls["stalls"].as_u64().is_some()
            && stalls["largest_us"].is_array(),
        "no stall probe in the report: {stalls}\n{output}"
    );
    let runs = report["runs"].as_array().expect("runs is a list");
    for path in ["direct", "broker", "haproxy"] {
        let ok: u64 = runs
            .iter()
            .filter(|r| r["path"] == path)
            .map(|r| r["calls_ok"].as_u64().unwrap_or(0))
            .sum();
        assert!(ok > 0, "no successful call on the {path} path\n{output}");
    }
    // Where the CPU went: user and kernel µs and context switches per call, for the driver
    // and each server on the run's path.
    let on_path = |path: &str| match path {
        "direct" => vec!["driver", "provider"],
        "broker" => vec!["driver", "broker", "provider"],
        _ => vec!["driver", "haproxy", "provider"],
    };
    // Servers are read in 10 ms ticks, so one short run may show none; over all runs,
    // each server must show some CPU or some context switches.
    let mut seen: std::collections::HashMap<&str, f64> = Default::default();
    for run in runs {
        let path = run["path"].as_str().expect("a run names its path");
        for process in on_path(path) {
            let split = &run["per_call"][process];
            let mut sum = 0.0;
            for field in ["user_us", "system_us", "switches"] {
                let v = split[field].as_f64().unwrap_or_else(|| {
                    panic!("run on {path}: no per_call.{process}.{field}\n{output}")
                });
                assert!(v >= 0.0, "run on {path}: per_call.{process}.{field} = {v}");
                sum += v;
            }
            if process == "driver" {
                // The driver's figures come from its rusage, in microseconds.
                let cpu = split["user_us"].as_f64().unwrap() + split["system_us"].as_f64().unwrap();
                assert!(cpu > 0.0, "run on {path}: no driver CPU counted\n{output}");
            }
            *seen.entry(process).or_default() += sum;
        }
    }
    for process in ["provider", "broker", "haproxy"] {
        assert!(
            seen.get(process).is_some_and(|&v| v > 0.0),
            "{process}: neither CPU nor context switches counted in any run\n{output}"
        );
    }
    assert!(
        run.stdout.contains("Where the CPU goes"),
        "the text report lacks the CPU split table\n{output}"
    );
}
