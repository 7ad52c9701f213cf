//! The capacity experiment's HTML report, opened in a real browser: every chart the report
//! has data for is drawn (its inline SVG is there, has an area and holds drawn elements,
//! as the page's own script finds after headless Chromium ran it), and charts without data
//! are left out rather than drawn empty.
//!
//! Needs `chromium` (Debian package `chromium`; `scripts/deps` installs it).

use std::collections::BTreeMap;
use std::path::PathBuf;

use rpcmesh_capacity::Compared;
use rpcmesh_capacity::html::render;
use rpcmesh_capacity::report::{
    CapacityReport, CapacitySetup, Comparison, LatencySummary, Phase, ProbeSetup, Search, Step,
    Sweep, SweepPoint,
};
use rpcmesh_capacity::slo::Slo;
use rpcmesh_capacity::usl::UslFit;
use rpcmesh_system_tests::headless_dom;

fn latency(p50: f64, p99: f64, p999: f64) -> LatencySummary {
    LatencySummary {
        count: 10_000,
        mean_ms: p50 * 1.1,
        p50_ms: p50,
        p90_ms: (p50 + p99) / 2.0,
        p99_ms: p99,
        p999_ms: p999,
        p9999_ms: p999 * 1.5,
        max_ms: p999 * 2.0,
    }
}

fn roles(driver: f64, broker: f64, provider: f64) -> BTreeMap<String, f64> {
    [
        ("driver", driver),
        ("broker", broker),
        ("provider", provider),
    ]
    .into_iter()
    .map(|(r, v)| (r.to_string(), v))
    .collect()
}

/// A step at `offered` requests/s: passes below `knee`, where latency takes off.
fn step(phase: Phase, offered: f64, knee: f64, compression: bool) -> Step {
    let load = offered / knee;
    let achieved = offered.min(knee * 1.05);
    let p99 = 2.0 + 40.0 * load.powi(4);
    let pass = p99 <= 20.0;
    let (out, cpu) = if compression {
        (180.0, 1.3)
    } else {
        (900.0, 1.0)
    };
    Step {
        phase,
        offered,
        achieved,
        calls_per_second: achieved * 4.0,
        due: (offered * 10.0) as u64,
        ok: (achieved * 10.0) as u64,
        failed: 0,
        not_sent: 0,
        latency: latency(0.8 + load, p99, p99 * 1.8),
        latency_uncorrected: latency(0.8, p99 / 2.0, p99),
        errors: BTreeMap::new(),
        error_ratio: if pass { 0.0 } else { 0.002 },
        bytes_out_per_call: out,
        bytes_in_per_call: 120.0,
        cpu_us_per_call: roles(30.0 * cpu, 22.0 * cpu, 15.0 * cpu),
        idle_poll_us_per_call: BTreeMap::from([("broker".to_string(), 3.0)]),
        cpu_cores: roles(0.4, 0.3, 0.2),
        softirq_share: [("broker".to_string(), 0.04)].into_iter().collect(),
        pass,
        broken: if pass {
            Vec::new()
        } else {
            vec![
                format!("p99 {p99:.1} > 20"),
                "errors 0.200% > 0.100%".to_string(),
            ]
        },
    }
}

fn search(compression: bool, knee: f64) -> Search {
    // Out of order on purpose (bisection steps fall between growth steps): the charts sort.
    let steps = [
        (Phase::Grow, 1000.0),
        (Phase::Grow, 2000.0),
        (Phase::Grow, 4000.0),
        (Phase::Grow, 8000.0),
        (Phase::Bisect, 6000.0),
        (Phase::Bisect, 5000.0),
        (Phase::Confirm, 5000.0),
        (Phase::Common, 4500.0),
    ]
    .into_iter()
    .map(|(phase, rate)| step(phase, rate, knee, compression))
    .collect();
    Search {
        compression,
        tls: false,
        steps,
        capacity: Some(5000.0),
        lowest_failing: Some(6000.0),
        ended_by: "slo".to_string(),
    }
}

fn usl(x1: f64, sigma: f64, kappa: f64, users: f64) -> f64 {
    x1 * users / (1.0 + sigma * (users - 1.0) + kappa * users * (users - 1.0))
}

fn report(two_searches: bool, with_sweep: bool) -> CapacityReport {
    let mut searches = vec![search(false, 5200.0)];
    if two_searches {
        searches.push(search(true, 4600.0));
    }
    let comparison = two_searches.then(|| Comparison {
        compared: Compared::Compression,
        capacity_off: Some(5000.0),
        capacity_on: Some(4500.0),
        capacity_change_percent: Some(-10.0),
        common_rate: Some(4500.0),
        p99_ms_off: Some(8.0),
        p99_ms_on: Some(14.0),
        bytes_per_call_off: Some(1020.0),
        bytes_per_call_on: Some(300.0),
        cpu_us_per_call_off: roles(30.0, 22.0, 15.0),
        cpu_us_per_call_on: roles(39.0, 28.6, 19.5),
        verdict: "compression costs 10% of capacity <and> saves 71% of the bytes".to_string(),
    });
    let (x1, sigma, kappa) = (900.0, 0.05, 0.002);
    let sweep = with_sweep.then(|| Sweep {
        compression: false,
        tls: false,
        points: [1usize, 2, 4, 8, 16, 32, 64]
            .into_iter()
            .map(|n| {
                let throughput = usl(x1, sigma, kappa, n as f64) * (1.0 + 0.01 * (n % 3) as f64);
                SweepPoint {
                    users: n,
                    throughput,
                    calls_per_second: throughput * 4.0,
                    latency: latency(n as f64 / 2.0, n as f64 * 2.0, n as f64 * 3.0),
                    error_ratio: 0.0,
                    cpu_cores: roles(0.1 * n as f64, 0.05 * n as f64, 0.04 * n as f64),
                }
            })
            .collect(),
        fit: Some(UslFit {
            sigma,
            kappa,
            x1,
            r_squared: 0.993,
            peak_users: Some(((1.0 - sigma) / kappa).sqrt()),
            peak_throughput: Some(usl(x1, sigma, kappa, ((1.0 - sigma) / kappa).sqrt())),
            points: 7,
            constrained: false,
        }),
        fit_error: None,
    });
    CapacityReport {
        version: "0.1.0".to_string(),
        started_unix: 1_796_130_557,
        setup: CapacitySetup {
            workload: "platform".to_string(),
            payload_size: 0,
            fanout: 4,
            parallel: true,
            concurrency: 256,
            connections: 4,
            targets: vec!["127.0.0.1:7100".to_string()],
            local_mesh: true,
            service_work: Some("200us".to_string()),
            step_seconds: 10.0,
            warmup_seconds: 2.0,
            start_rate: 1000.0,
            max_rate: 100_000.0,
            growth: 2.0,
            precision: 0.05,
            time_limit_seconds: 600.0,
            probes: vec![ProbeSetup {
                role: "broker".to_string(),
                address: "127.0.0.1:9100".to_string(),
            }],
        },
        slo: "p99<=20ms,p99.9<=50ms,errors<=0.1%"
            .parse::<Slo>()
            .expect("the test's SLO parses"),
        searches,
        comparison,
        sweep,
        elapsed_seconds: 321.5,
        stopped_early: None,
    }
}

/// A page written to a fresh folder under the test target's temporary folder (removed
/// when this is dropped).
struct Page {
    dir: PathBuf,
    path: PathBuf,
}

impl Page {
    fn write(name: &str, html: &str) -> Page {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("capacity-html-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a folder for the page");
        let path = dir.join("report.html");
        std::fs::write(&path, html).expect("write the page");
        Page { dir, path }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The opening tags `<NAME ...>` of `dom`.
fn tags<'a>(dom: &'a str, name: &str) -> Vec<&'a str> {
    let open = format!("<{name} ");
    dom.match_indices(&open)
        .filter_map(|(i, _)| dom[i..].find('>').map(|end| &dom[i..=i + end]))
        .collect()
}

/// The value of attribute `attr` in the opening tag `tag`.
fn attr<'a>(tag: &'a str, attr: &str) -> Option<&'a str> {
    let key = format!(" {attr}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(&tag[start..start + len])
}

/// The charts of the page at `path` as Chromium saw them: (name, drawn), and the count the
/// page's script wrote on `<body>`.
fn charts_in_browser(path: &std::path::Path) -> (Vec<(String, String)>, usize, String) {
    let dom = headless_dom(path).unwrap_or_else(|e| panic!("headless chromium: {e}"));
    let charts = tags(&dom, "figure")
        .into_iter()
        .filter(|t| attr(t, "class") == Some("chart"))
        .map(|t| {
            (
                attr(t, "data-chart").unwrap_or("?").to_string(),
                attr(t, "data-drawn").unwrap_or("(not marked)").to_string(),
            )
        })
        .collect();
    let body = tags(&dom, "body").into_iter().next().unwrap_or_default();
    let drawn = attr(body, "data-charts-drawn")
        .unwrap_or_else(|| panic!("the page's script did not run: {body}"))
        .parse()
        .expect("a count");
    (charts, drawn, dom)
}

#[test]
fn a_full_report_draws_its_four_charts_in_a_browser() {
    let html = render(&report(true, true));
    assert!(
        !html.contains("<script src"),
        "nothing is loaded from outside"
    );
    assert!(!html.contains("<link"), "nothing is loaded from outside");
    assert!(
        html.contains("&lt;and&gt;") && !html.contains("<and>"),
        "the verdict is escaped"
    );
    let page = Page::write("full", &html);
    let started = std::time::Instant::now();
    let (charts, drawn, dom) = charts_in_browser(&page.path);
    eprintln!("headless chromium took {:?}", started.elapsed());
    let names: Vec<&str> = charts.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["throughput", "latency", "compression", "usl"],
        "charts on the page"
    );
    for (name, d) in &charts {
        assert_eq!(d, "yes", "chart {name} not drawn");
    }
    assert_eq!(drawn, 4, "data-charts-drawn");
    assert!(
        dom.contains("pass") && dom.contains("p99 "),
        "the steps' table is there"
    );
}

#[test]
fn one_search_without_a_sweep_draws_throughput_and_latency_only() {
    let page = Page::write("one-search", &render(&report(false, false)));
    let (charts, drawn, _) = charts_in_browser(&page.path);
    let names: Vec<&str> = charts.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["throughput", "latency"]);
    assert!(charts.iter().all(|(_, d)| d == "yes"), "{charts:?}");
    assert_eq!(drawn, 2);
}

#[test]
fn figures_that_are_not_numbers_are_skipped_and_empty_charts_left_out() {
    let mut r = report(true, true);
    // A search whose every latency is NaN or zero draws no latency series; its throughput
    // points stay.
    for st in &mut r.searches[1].steps {
        st.latency = latency(f64::NAN, 0.0, f64::INFINITY);
    }
    r.searches[0].steps[2].achieved = f64::NAN;
    r.searches[0].steps[3].offered = f64::INFINITY;
    if let Some(s) = &mut r.sweep {
        s.fit = None;
        s.fit_error = Some("3 distinct concurrencies measured".to_string());
        s.points.iter_mut().for_each(|p| p.throughput = f64::NAN);
    }
    let html = render(&r);
    assert!(
        !html.contains("NaN") && !html.contains("inf"),
        "no NaN or inf shown"
    );
    assert!(
        !html.contains("data-chart=\"usl\""),
        "a sweep without one finite point has no chart"
    );
    let page = Page::write("not-numbers", &html);
    let (charts, drawn, _) = charts_in_browser(&page.path);
    let names: Vec<&str> = charts.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["throughput", "latency", "compression"]);
    assert!(charts.iter().all(|(_, d)| d == "yes"), "{charts:?}");
    assert_eq!(drawn, 3);

    // No steps at all: no charts, and the page still renders.
    let mut empty = report(false, false);
    empty.searches.clear();
    let html = render(&empty);
    assert!(!html.contains("<figure"), "no chart without data");
}
