//! The dashboards and rules of `grafana/` live: a real provider, broker and driver
//! (processes on 127.0.0.1 under open-loop load with compression on, stopped by PID)
//! scraped by a real Prometheus running the committed `prometheus.yml` and rules (its own
//! data folder, stopped by PID). Every panel query, its variables substituted as Grafana
//! would for "All", must return data; no alert may fire or even pend while the mesh is
//! healthy; then the provider is stopped (SIGSTOP: it hangs, as a wedged host does) and
//! every alert it causes must fire.
//!
//! What the test changes, and only that: the scrape and evaluation intervals (1s instead
//! of 15s, scrape timeout to match) and every alert's `for` (shortened to [`TEST_FOR`]);
//! the expressions are the committed ones. The softirq red line (30 % of the CPU time)
//! cannot be reached on purpose on a shared two-core machine; its alert is proven by the
//! promtool unit tests (`grafana_rules.rs`), and here its expression is evaluated with the
//! threshold at 0 to show that it reads real series of every host.
//!
//! Needs `prometheus` (Debian package `prometheus`; `scripts/deps` installs it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod grafana;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use grafana::{
    PanelQuery, RECORDING_RULES, dashboards, grafana_dir, panel_queries, read, substitute,
};
use rpcmesh_system_tests as system;
use rpcmesh_system_tests::prometheus::{api, query};
use rpcmesh_testkit::{self as testkit, ChildGuard, Spawned};
use serde_json::Value;

/// The scrape and evaluation interval of the live test (the deployment's is 15s).
const TEST_INTERVAL: &str = "1s";

/// Every alert's `for` in the live test: short enough that the fault test ends in seconds,
/// long enough that an alert must hold over several evaluations (one a second) to fire.
const TEST_FOR: &str = "5s";

/// What Grafana makes of `$__rate_interval` at a 1s scrape interval and a 1s `$__interval`:
/// max(4 × scrape interval, interval + scrape interval).
const TEST_RATE_INTERVAL: &str = "4s";

/// How long the mesh must stay healthy, with every panel showing data, while the test
/// watches for alerts: three `for` windows.
const HEALTHY_WINDOW: Duration = Duration::from_secs(15);

/// How long a wait here may take before it fails the test: a hang detector, not a
/// measurement (each condition normally holds within a few scrapes).
const WAIT: Duration = Duration::from_secs(60);

/// The driver's load: open loop, requests per second (each 5 calls in a row).
const DRIVER_RATE: &str = "100";
/// The driver's run length: longer than the test needs, so that it is still running when
/// the test ends (and is stopped by PID); a bound in case it is not.
const DRIVER_DURATION: &str = "120s";
/// The broker's cap on calls in flight: far above the healthy run's (about one at 500
/// calls/s), reached within a second once the provider hangs, so the broker sheds.
const BROKER_MAX_IN_FLIGHT: &str = "100";

/// The alerts a hung provider must cause (all but the softirq red line).
const FAULT_ALERTS: [&str; 6] = [
    "RpcmeshLatencyP99High",
    "RpcmeshErrorRatioHigh",
    "RpcmeshProviderDown",
    "RpcmeshBrokerShedding",
    "RpcmeshPoolUnhealthy",
    "RpcmeshDriverBelowRate",
];
/// The alerts a hung provider does not cause, and that must stay quiet here too: no
/// broker goes down, nothing restarts, and a lone provider is never ejected (at most half
/// of the providers are, rounded down).
const QUIET_ALERTS: [&str; 3] = [
    "RpcmeshBrokerDown",
    "RpcmeshRestarting",
    "RpcmeshProviderEjected",
];
/// The alert no fault here can cause, and its threshold as written in the rules.
const SOFTIRQ_ALERT: &str = "RpcmeshSoftirqHigh";
const SOFTIRQ_THRESHOLD: &str = "> 0.3";
/// The alert of a mesh with TLS, which this one (plain) cannot fire.
const CERT_ALERT: &str = "RpcmeshCertificateExpiresSoon";

/// Data, as a panel needs it: at least one series with a number (not NaN).
fn has_data(prom: SocketAddr, q: &str) -> bool {
    query(prom, q).iter().any(|(_, v)| v.is_finite())
}

/// Looks every 500 ms until `f` holds; false if it still does not after `timeout`.
fn eventually(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    testkit::eventually(timeout, Duration::from_millis(500), f)
}

fn wait_until(what: &str, timeout: Duration, f: impl FnMut() -> bool) {
    assert!(eventually(timeout, f), "timed out waiting for {what}");
}

/// Copies `from` to `to`, rewriting each line `KEY: VALUE` (after indentation) whose key
/// is in `set` to the given value; returns how many lines it rewrote.
fn copy_rewriting(from: &Path, to: &Path, set: &[(&str, &str)]) -> usize {
    let mut n = 0;
    let text: Vec<String> = read(from)
        .lines()
        .map(|l| {
            let indent = &l[..l.len() - l.trim_start().len()];
            for (key, value) in set {
                if l.trim_start().starts_with(&format!("{key}:")) {
                    n += 1;
                    return format!("{indent}{key}: {value}");
                }
            }
            l.to_string()
        })
        .collect();
    std::fs::write(to, text.join("\n") + "\n").unwrap();
    n
}

/// The alerts Prometheus holds now, as (name, state, labels).
fn alerts(prom: SocketAddr) -> Vec<(String, String, Value)> {
    api(prom, "/api/v1/alerts", &[])["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["labels"]["alertname"].as_str().unwrap().to_string(),
                a["state"].as_str().unwrap().to_string(),
                a["labels"].clone(),
            )
        })
        .collect()
}

#[test]
fn every_panel_shows_live_data_and_the_alerts_fire_only_when_a_provider_hangs() {
    let prometheus = system::need_tool("prometheus", "prometheus");
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!("rpcmesh-grafana-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["data", "rules", "targets"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }

    // The mesh: a provider, a broker, an open-loop driver with compression on. The broker
    // times calls out after 1s (so a hung provider's calls end, slow, within the test) and
    // checks its pool twice a second; the driver's own timeout is longer than the
    // broker's, so the broker's answer is what it sees. The broker and the provider speak
    // mutual TLS (the driver's hop stays plain), so that the security panels (certificates'
    // expiry) have their data.
    let pki = testkit::Pki::new(&dir.join("certs"), "live");
    let p_cert = pki.issue(&testkit::Leaf::spiffe("provider", "p1"));
    let b_cert = pki.issue(&testkit::Leaf::spiffe("broker", "b1"));
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (ca, p_crt, p_key, b_crt, b_key) = (
        path(&pki.ca_file),
        path(&p_cert.cert),
        path(&p_cert.key),
        path(&b_cert.cert),
        path(&b_cert.key),
    );
    let provider = Spawned::start(
        "provider",
        &[
            "--threads",
            "1",
            "--tls-cert",
            &p_crt,
            "--tls-key",
            &p_key,
            "--tls-ca",
            &ca,
        ],
    );
    let p_rpc = provider.rpc;
    let p_metrics = provider.metrics.expect("the provider's metrics address");
    let broker = Spawned::start(
        "broker",
        &[
            "--upstream",
            &p_rpc.to_string(),
            // Two cells, so that the cells' panels (absent with one thread) have data.
            "--threads",
            "2",
            "--max-in-flight",
            BROKER_MAX_IN_FLIGHT,
            "--call-timeout",
            "1s",
            "--health-interval",
            "500ms",
            "--health-timeout",
            "1s",
            "--tls-cert",
            &b_crt,
            "--tls-key",
            &b_key,
            "--tls-ca",
            &ca,
            "--listen-tls",
            "off",
            "--upstream-tls",
            "on",
        ],
    );
    let b_rpc = broker.rpc;
    let b_metrics = broker.metrics.expect("the broker's metrics address");
    let d_metrics = SocketAddr::from(([127, 0, 0, 1], testkit::free_port()));
    let _driver = ChildGuard::spawn(
        &testkit::bin_path("driver"),
        &[
            "--target",
            &b_rpc.to_string(),
            "--workload",
            "platform",
            "--fanout",
            "5",
            "--rate",
            DRIVER_RATE,
            "--pacer",
            "lean",
            "--concurrency",
            "200",
            "--connections",
            "4",
            "--duration",
            DRIVER_DURATION,
            "--warmup",
            "0s",
            "--timeout",
            "2s",
            "--compress",
            "on",
            "--progress",
            "off",
            "--threads",
            "1",
            "--metrics-listen",
            &d_metrics.to_string(),
        ],
    )
    .unwrap();

    // Prometheus on the committed configuration and rules: intervals and `for` shortened,
    // the targets written where the deployment writes them.
    let src = grafana_dir().join("prometheus");
    let rewritten = copy_rewriting(
        &src.join("prometheus.yml"),
        &dir.join("prometheus.yml"),
        &[
            ("scrape_interval", TEST_INTERVAL),
            ("scrape_timeout", TEST_INTERVAL),
            ("evaluation_interval", TEST_INTERVAL),
        ],
    );
    assert_eq!(rewritten, 3, "prometheus.yml sets its intervals once each");
    copy_rewriting(
        &src.join("rules/recording.yml"),
        &dir.join("rules/recording.yml"),
        &[],
    );
    let fors = copy_rewriting(
        &src.join("rules/alerts.yml"),
        &dir.join("rules/alerts.yml"),
        &[("for", TEST_FOR)],
    );
    assert_eq!(
        fors,
        FAULT_ALERTS.len() + QUIET_ALERTS.len() + 2,
        "every alert has a `for`"
    );
    for (job, at) in [
        ("provider", p_metrics),
        ("broker", b_metrics),
        ("driver", d_metrics),
    ] {
        std::fs::write(
            dir.join(format!("targets/{job}.json")),
            format!("[{{\"targets\": [\"{at}\"]}}]\n"),
        )
        .unwrap();
    }
    let prom = SocketAddr::from(([127, 0, 0, 1], testkit::free_port()));
    let prom_server = system::prometheus::start(&prometheus, &dir, prom);
    wait_until("Prometheus to scrape all three programs", WAIT, || {
        system::prometheus::scrapes_all(prom, 3)
    });
    let first_scrape = Instant::now();

    // Every panel query has data. Rates need two scrapes and recording rules an
    // evaluation, so the test waits for them all, then names the panels still empty.
    let all = dashboards();
    let queries = panel_queries(&all);
    let mut empty: Vec<&PanelQuery> = queries.iter().collect();
    let filled = eventually(WAIT, || {
        empty.retain(|q| !has_data(prom, &substitute(&q.expr, TEST_RATE_INTERVAL)));
        empty.is_empty()
    });
    let named: Vec<String> = empty
        .iter()
        .map(|q| format!("{} / {} ({}): {}", q.dashboard, q.title, q.ref_id, q.expr))
        .collect();
    assert!(filled, "panels with no data:\n{}", named.join("\n"));
    println!(
        "{} panel queries of {} dashboards have data, {:.1?} after the first scrape",
        queries.len(),
        all.len(),
        first_scrape.elapsed()
    );

    // Every variable's values query finds values (label_values(SELECTOR, LABEL)).
    for (name, d) in &all {
        for v in d["templating"]["list"].as_array().unwrap() {
            let q = v["query"].as_str().unwrap();
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|s| s.strip_suffix(')'))
                .unwrap_or_else(|| panic!("{name}: {q}"));
            let (selector, label) = inner.rsplit_once(',').unwrap();
            let path = format!("/api/v1/label/{}/values", label.trim());
            let selector = substitute(selector, TEST_RATE_INTERVAL);
            let values: Vec<String> = api(prom, &path, &[("match[]", &selector)])
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap().to_string())
                .collect();
            let want: Vec<String> = match v["name"].as_str().unwrap() {
                "job" | "role" => ["broker", "driver", "provider"].map(String::from).to_vec(),
                "instance" => {
                    let mut i = [p_metrics, b_metrics, d_metrics].map(|a| a.to_string());
                    i.sort();
                    i.to_vec()
                }
                "provider" => vec![p_rpc.to_string()],
                other => panic!("{name}: a variable the test does not know: {other}"),
            };
            assert_eq!(values, want, "{name}: variable {}", v["name"]);
        }
    }

    // Every recording rule has data, and every rule evaluates without error.
    let groups = api(prom, "/api/v1/rules", &[])["groups"].clone();
    let rules: Vec<&Value> = groups
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    assert_eq!(
        rules.len(),
        RECORDING_RULES + FAULT_ALERTS.len() + QUIET_ALERTS.len() + 2,
        "{groups}"
    );
    for r in &rules {
        assert_eq!(r["health"], "ok", "{r}");
        if r["type"] == "recording" {
            let name = r["name"].as_str().unwrap();
            wait_until(&format!("data from {name}"), WAIT, || has_data(prom, name));
        }
    }

    // The softirq red line's expression reads a real share for this host (threshold at 0:
    // 30 % is out of reach here on purpose).
    let softirq = rules.iter().find(|r| r["name"] == SOFTIRQ_ALERT).unwrap()["query"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(softirq.ends_with(SOFTIRQ_THRESHOLD), "{softirq}");
    let probe = softirq.replace(SOFTIRQ_THRESHOLD, ">= 0");
    let shares = query(prom, &probe);
    assert!(
        shares.len() == 1 && shares[0].0["host"] == "127.0.0.1" && shares[0].1 < 0.3,
        "{probe}: {shares:?}"
    );

    // Healthy: over three `for` windows, no alert fires, and none even pends.
    let healthy_from = Instant::now();
    std::thread::sleep(HEALTHY_WINDOW);
    let since = started.elapsed().as_secs() + 1;
    let seen = query(prom, &format!("count_over_time(ALERTS[{since}s])"));
    assert!(seen.is_empty(), "alerts while healthy: {seen:?}");
    assert!(alerts(prom).is_empty(), "{:?}", alerts(prom));
    // The mesh was healthy all along: every panel still has data.
    let empty: Vec<String> = queries
        .iter()
        .filter(|q| !has_data(prom, &substitute(&q.expr, TEST_RATE_INTERVAL)))
        .map(|q| format!("{} / {} ({})", q.dashboard, q.title, q.ref_id))
        .collect();
    assert!(empty.is_empty(), "panels that lost their data: {empty:?}");
    println!("healthy for {:.1?}: no alert", healthy_from.elapsed());

    // The fault: the provider hangs. Every alert it causes fires, on the right series.
    provider.child.signal(testkit::Signal::STOP);
    let stopped = Instant::now();
    let mut firing = Vec::new();
    let all_fired = eventually(WAIT, || {
        firing = alerts(prom)
            .into_iter()
            .filter(|(_, state, _)| state == "firing")
            .collect();
        FAULT_ALERTS
            .iter()
            .all(|a| firing.iter().any(|(name, _, _)| name == a))
    });
    assert!(all_fired, "after the provider stopped, firing: {firing:#?}");
    println!(
        "every alert fired {:.1?} after the provider stopped (for: {TEST_FOR})",
        stopped.elapsed()
    );
    let fired = |name: &str, label: &str, value: &str| {
        firing
            .iter()
            .any(|(n, _, l)| n == name && l[label].as_str() == Some(value))
    };
    let (p_at, b_at, d_at) = (
        p_metrics.to_string(),
        b_metrics.to_string(),
        d_metrics.to_string(),
    );
    assert!(
        fired("RpcmeshProviderDown", "instance", &p_at),
        "{firing:#?}"
    );
    assert!(
        fired("RpcmeshPoolUnhealthy", "upstream", &p_rpc.to_string()),
        "{firing:#?}"
    );
    assert!(
        fired("RpcmeshBrokerShedding", "instance", &b_at),
        "{firing:#?}"
    );
    assert!(
        fired("RpcmeshErrorRatioHigh", "instance", &b_at),
        "{firing:#?}"
    );
    assert!(
        fired("RpcmeshErrorRatioHigh", "instance", &d_at),
        "{firing:#?}"
    );
    // The callers' latency: the broker takes the hung provider out of service within a
    // health interval and a timeout, so its own p99 over a minute may stay low (most of
    // its calls are then answered at once); the driver's requests, five calls in a row,
    // see the slow ones.
    assert!(
        fired("RpcmeshLatencyP99High", "job", "driver"),
        "{firing:#?}"
    );
    assert!(
        fired("RpcmeshDriverBelowRate", "instance", &d_at),
        "{firing:#?}"
    );
    assert!(
        !firing
            .iter()
            .any(|(n, _, _)| n == SOFTIRQ_ALERT || n == CERT_ALERT),
        "{firing:#?}"
    );

    // Everything stops (SIGKILL, by PID) before its folder goes; a stopped process takes
    // SIGKILL too, SIGCONT first only lets it see it at once.
    provider.child.signal(testkit::Signal::CONT);
    drop(prom_server);
    drop(provider);
    println!("live test: {:.1?}", started.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}
