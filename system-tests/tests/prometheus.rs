//! The metrics of the three programs as Prometheus sees them: a real provider, broker and
//! driver (processes on 127.0.0.1, stopped by PID) under a fan-out run, `promtool check
//! metrics` on each `/metrics` (and on one collection of the host and process figures),
//! and a real Prometheus server (its own config and data folder, stopped by PID) scraping
//! them all, queried through its HTTP API.
//!
//! Needs `promtool` and `prometheus` (Debian package `prometheus`; `scripts/deps` installs
//! it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rpcmesh_common::metrics::catalogue::{self, CATALOGUE, CONDITIONAL, Family, Kind};
use rpcmesh_common::metrics::system::SystemMetrics;
use rpcmesh_common::metrics::{Role, Telemetry};
use rpcmesh_system_tests as system;
use rpcmesh_system_tests::prometheus::query;
use rpcmesh_testkit::{self as testkit, ChildGuard};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn scalar(prom: SocketAddr, q: &str) -> f64 {
    let r = query(prom, q);
    assert_eq!(r.len(), 1, "{q}: expected one series, got {r:?}");
    r[0].1
}

/// How long a wait here may take before it fails the test: a hang detector, not a
/// measurement (the Prometheus server scrapes every second, so each condition normally
/// holds within a few).
const WAIT: Duration = testkit::WAIT_TIMEOUT;

/// Looks every 200 ms until `f` holds; false if it still does not after `timeout`.
fn eventually(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    testkit::eventually(timeout, Duration::from_millis(200), f)
}

/// Waits until `f` holds; fails the test, naming `what`, after `timeout`.
fn wait_until(what: &str, timeout: Duration, f: impl FnMut() -> bool) {
    assert!(eventually(timeout, f), "timed out waiting for {what}");
}

/// Seconds since the Unix epoch, the clock of Prometheus's sample timestamps.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is past 1970")
        .as_secs_f64()
}

fn promtool_check(promtool: &Path, name: &str, text: &str) {
    assert!(text.contains("rpcmesh_"), "{name}: empty /metrics");
    for forbidden in ["instance=\"", "job=\""] {
        assert!(
            !text.contains(forbidden),
            "{name}: exports a label {forbidden}"
        );
    }
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool on {name}'s /metrics:\n{said}"
    );
}

/// The host and process figures of one collection (softirqs, CPU modes, the process's
/// CPU, memory, descriptors and threads) are what promtool accepts: counters end in
/// `_total`, the CPU histogram's `_sum` is no gauge.
#[test]
fn promtool_finds_no_problem_in_the_system_metrics() {
    let promtool = system::need_tool("promtool", "prometheus");
    let t = Telemetry::new();
    SystemMetrics::new(&t, Role::Provider).collect();
    let text = t.render();
    assert!(text.contains("rpcmesh_softirqs_total{"), "{text}");
    promtool_check(&promtool, "the system metrics", &text);
}

#[test]
fn prometheus_scrapes_all_three_programs_and_promtool_finds_no_problem() {
    let promtool = system::need_tool("promtool", "prometheus");
    let prometheus = system::need_tool("prometheus", "prometheus");
    let dir = std::env::temp_dir().join(format!("rpcmesh-prom-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let port = |_| testkit::free_port();
    let (p, pm, b, bm, dm, pw) = (port(0), port(1), port(2), port(3), port(4), port(5));

    let _provider = ChildGuard::spawn(
        &testkit::bin_path("provider"),
        &[
            "--listen",
            &addr(p).to_string(),
            "--metrics-listen",
            &addr(pm).to_string(),
            "--threads",
            "1",
        ],
    )
    .unwrap();
    let _broker = ChildGuard::spawn(
        &testkit::bin_path("broker"),
        &[
            "--listen",
            &addr(b).to_string(),
            "--upstream",
            &addr(p).to_string(),
            "--metrics-listen",
            &addr(bm).to_string(),
            "--threads",
            "1",
            "--health-interval",
            "200ms",
        ],
    )
    .unwrap();
    wait_until("the broker's pool", WAIT, || {
        testkit::get(addr(bm), "/metrics").ok().is_some_and(|t| {
            rpcmesh_common::metrics::recorder::sample(&t, "rpcmesh_pool_healthy_connections", &[])
                .unwrap_or(0.0)
                > 0.0
        })
    });

    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: provider\n    static_configs: [{{targets: ['{}']}}]\n  - job_name: broker\n    static_configs: [{{targets: ['{}']}}]\n  - job_name: driver\n    static_configs: [{{targets: ['{}']}}]\n",
        addr(pm),
        addr(bm),
        addr(dm)
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let _prom = system::prometheus::start(&prometheus, &dir, addr(pw));

    let report = dir.join("report.json");
    let mut driver = ChildGuard::spawn(
        &testkit::bin_path("driver"),
        &[
            "--target",
            &addr(b).to_string(),
            "--workload",
            "platform",
            "--fanout",
            "5",
            "--concurrency",
            "40",
            "--connections",
            "4",
            "--duration",
            "6s",
            "--warmup",
            "0s",
            "--compress",
            "on",
            "--progress",
            "off",
            "--threads",
            "1",
            "--metrics-listen",
            &addr(dm).to_string(),
            "--linger",
            "60s",
            "--json",
            &report.display().to_string(),
        ],
    )
    .unwrap();

    // Prometheus is up and has scraped all three.
    let prom = addr(pw);
    wait_until("Prometheus to scrape all three programs", WAIT, || {
        system::prometheus::scrapes_all(prom, 3)
    });

    // Under load: promtool finds no problem in any program's /metrics. Every family it
    // exports is catalogued for it, and every family catalogued for it is exported (the
    // other direction is checked below, on what Prometheus scraped); some appear only
    // once calls have gone through, so the check waits for the run's calls and families
    // to show, and fails with the problems still left if they never do.
    for (role, port) in [(Role::Provider, pm), (Role::Broker, bm), (Role::Driver, dm)] {
        let name = role.label();
        let mut problems = Vec::new();
        let mut text = String::new();
        let shown = eventually(WAIT, || {
            text = testkit::get(addr(port), "/metrics")
                .ok()
                .unwrap_or_default();
            let calls =
                rpcmesh_common::metrics::recorder::sample(&text, "rpcmesh_calls_total", &[]);
            problems = catalogue::mismatches(role, &text);
            calls.is_some_and(|n| n > 0.0) && problems.is_empty()
        });
        assert!(text.contains("rpcmesh_"), "{name}: no /metrics");
        assert!(shown, "{name} under load: {problems:#?}");
        promtool_check(&promtool, name, &text);
    }

    // The run ends; its figures are scraped. The report is written in one go, but not
    // atomically: it is there when it reads whole.
    let mut r = serde_json::Value::Null;
    wait_until("the driver's report", WAIT, || {
        let text = std::fs::read_to_string(&report).unwrap_or_default();
        match serde_json::from_str(&text) {
            Ok(v) => {
                r = v;
                true
            }
            Err(_) => false,
        }
    });
    let ended = unix_now();
    let sent = r["calls"]["sent"].as_f64().unwrap();
    assert!(sent > 100.0, "{r}");
    wait_until("a scrape of the driver's final figures", WAIT, || {
        query(prom, "sum(rpcmesh_calls_total{job=\"driver\"})")
            .first()
            .is_some_and(|(_, v)| *v == sent)
    });
    // Every program scraped since the run ended: what Prometheus holds is final.
    wait_until("a scrape of every program after the run", WAIT, || {
        let scraped = query(prom, "timestamp(up)");
        scraped.len() == 3 && scraped.iter().all(|(_, t)| *t > ended)
    });

    // Every metric of docs/metrics.md has samples, from every program that exports it (but
    // those exported only when configured: this mesh has no TLS).
    let conditional = |d: &Family| CONDITIONAL.iter().any(|c| c.name == d.name);
    for d in CATALOGUE.iter().filter(|d| !conditional(d)) {
        let series = if d.kind == Kind::Histogram {
            format!("{}_count", d.name)
        } else {
            d.name.to_string()
        };
        for role in d.roles.iter().map(|r| r.label()) {
            let n = query(prom, &format!("count({series}{{job=\"{role}\"}})"));
            assert!(
                !n.is_empty() && n[0].1 > 0.0,
                "{} has no samples from {role}",
                d.name
            );
        }
    }

    // histogram_quantile gives a number for every stage of every program.
    for (role, stages) in [
        ("provider", &rpcmesh_provider::metrics::STAGES[..]),
        ("broker", &rpcmesh_broker::metrics::STAGES[..]),
        ("driver", &rpcmesh_driver::metrics::STAGES[..]),
    ] {
        for stage in stages {
            let q = format!(
                "histogram_quantile(0.99, sum by (le) (rpcmesh_stage_seconds_bucket{{job=\"{role}\", stage=\"{stage}\"}}))"
            );
            let v = scalar(prom, &q);
            assert!(v.is_finite() && v > 0.0, "{role} {stage}: p99 = {v}");
        }
    }

    // The three programs agree on the calls (nothing is in flight once the run is over).
    let calls = |job: &str| scalar(prom, &format!("sum(rpcmesh_calls_total{{job=\"{job}\"}})"));
    let in_flight = scalar(prom, "sum(rpcmesh_calls_in_flight)");
    let (d, b_, p_) = (calls("driver"), calls("broker"), calls("provider"));
    println!("calls: driver {d}, broker {b_}, provider {p_}, in flight {in_flight}, report {sent}");
    assert_eq!(d, sent);
    assert!((d - b_).abs() <= in_flight, "driver {d} vs broker {b_}");
    assert!((b_ - p_).abs() <= in_flight, "broker {b_} vs provider {p_}");
    let ok = |job: &str| {
        scalar(
            prom,
            &format!("sum(rpcmesh_calls_total{{job=\"{job}\", status=\"ok\"}})"),
        )
    };
    assert_eq!(ok("driver"), r["calls"]["ok"].as_f64().unwrap());

    // Softirq and CPU series, from each program.
    for job in ["provider", "broker", "driver"] {
        for q in [
            format!("rpcmesh_softirqs_total{{job=\"{job}\", vector=\"net_rx\"}}"),
            format!("rpcmesh_softirqs_total{{job=\"{job}\", vector=\"net_tx\"}}"),
            format!("rpcmesh_cpu_seconds_total{{job=\"{job}\", mode=\"softirq\"}}"),
            format!("rpcmesh_cpu_seconds_total{{job=\"{job}\", mode=\"user\"}}"),
            format!("rpcmesh_process_cpu_seconds_sum{{job=\"{job}\"}}"),
        ] {
            assert!(!query(prom, &q).is_empty(), "no series for {q}");
        }
        // The softirq share is one expression and gives a number.
        let share = scalar(
            prom,
            &format!(
                "sum(rpcmesh_cpu_seconds_total{{job=\"{job}\", mode=\"softirq\"}}) / sum(rpcmesh_cpu_seconds_total{{job=\"{job}\"}})"
            ),
        );
        assert!((0.0..=1.0).contains(&share), "{job}: softirq share {share}");
    }
    // The process did work: its fractional CPU time is above zero.
    assert!(scalar(prom, "sum(rpcmesh_process_cpu_seconds_sum{job=\"broker\"})") > 0.0);

    driver.signal(testkit::Signal::TERM);
    let _ = driver.wait_timeout(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&dir);
}
