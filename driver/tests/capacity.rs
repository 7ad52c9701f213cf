//! `driver capacity` end to end: the binary starts its local provider and broker as child
//! processes, runs a short search (with compression off and on) and a sweep, and writes
//! its reports; the test checks that the found rate lies between a passing and a failing
//! step, that every step has its figures, and that the JSON parses and meets the documented
//! schema. That the HTML report's charts are all drawn in headless Chromium is checked by
//! the system tier (`system-tests/tests/capacity_browser.rs`). The experiment is the test
//! kit's short one (`rpcmesh_testkit::capacity`, which says why its capacity is small and
//! independent of the machine's speed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rpcmesh_capacity::report::{CapacityReport, Phase};
use rpcmesh_testkit as testkit;

#[test]
fn a_short_search_brackets_the_capacity_and_reports_it_every_way() {
    let dir = std::env::temp_dir().join(format!("rpcmesh-capacity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, md, html) = (dir.join("c.json"), dir.join("c.md"), dir.join("c.html"));
    let out = testkit::short_capacity_search(
        std::path::Path::new(env!("CARGO_BIN_EXE_driver")),
        &[("--json", &json), ("--markdown", &md), ("--html", &html)],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Search, compression off"), "{text}");
    assert!(text.contains("USL fit"), "{text}");
    // Live progress: a line per step on stderr.
    assert!(stderr.contains("capacity: step 1 (grow"), "{stderr}");

    let raw = std::fs::read_to_string(&json).unwrap();
    let report: CapacityReport = serde_json::from_str(&raw).unwrap();
    assert!(report.stopped_early.is_none(), "{:?}", report.stopped_early);
    assert_eq!(report.searches.len(), 2);
    for s in &report.searches {
        let cap = s.capacity.expect("a capacity");
        let fail = s.lowest_failing.expect("a failing rate");
        assert!(cap < fail, "{cap} {fail}");
        assert!(
            s.steps.iter().any(|t| t.pass && t.offered == cap),
            "the capacity is a passing step's rate"
        );
        assert!(
            s.steps
                .iter()
                .any(|t| !t.pass && t.offered == fail && !t.broken.is_empty()),
            "the lowest failing rate is a failing step's, with what it broke"
        );
        assert!(s.steps.iter().any(|t| t.phase == Phase::Confirm && t.pass));
        for t in &s.steps {
            assert!(t.due > 0 && t.latency.count > 0, "{t:?}");
            assert!(
                t.bytes_out_per_call > 0.0 && t.bytes_in_per_call > 0.0,
                "{t:?}"
            );
            for role in ["driver", "broker", "provider"] {
                assert!(t.cpu_us_per_call.contains_key(role), "{role}: {t:?}");
            }
            assert!(!t.softirq_share.is_empty(), "{t:?}");
        }
    }
    // The compressed search sends fewer bytes per call (the platform reply compresses).
    let c = report.comparison.as_ref().expect("a comparison");
    assert!(
        c.bytes_per_call_on.unwrap() < c.bytes_per_call_off.unwrap(),
        "{c:?}"
    );
    assert!(
        c.verdict.starts_with("on this path compression"),
        "{}",
        c.verdict
    );
    let sweep = report.sweep.as_ref().expect("a sweep");
    assert_eq!(sweep.points.len(), 3);
    assert!(sweep.points.iter().all(|p| p.throughput > 0.0));

    // The JSON meets the documented schema.
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(testkit::workspace_root().join("docs/capacity.schema.json"))
            .unwrap(),
    )
    .unwrap();
    let instance: serde_json::Value = serde_json::from_str(&raw).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let problems: Vec<String> = validator
        .iter_errors(&instance)
        .map(|e| e.to_string())
        .collect();
    assert!(problems.is_empty(), "{problems:?}");

    let markdown = std::fs::read_to_string(&md).unwrap();
    assert!(markdown.contains("| step | offered/s |"), "{markdown}");
    // The HTML report is written; that a browser draws its charts is the system tier's
    // check (rpcmesh-system-tests, capacity_browser.rs).
    assert!(html.exists(), "{} written", html.display());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ctrl-C mid-experiment: the driver stops the search at once, leaves the step it cut short
/// out, reports what it measured (and why it ended), and stops its local mesh.
#[test]
fn ctrl_c_ends_the_experiment_with_a_report_and_no_server_left() {
    use std::io::{BufRead, BufReader};
    let dir = std::env::temp_dir().join(format!("rpcmesh-capacity-int-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("c.json");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_driver"))
        .args([
            "capacity",
            "--step-duration",
            "1s",
            "--warmup",
            "0.2s",
            "--start-rate",
            "100",
            "--sweep",
            "off",
            "--metrics-listen",
            "off",
        ])
        .arg("--json")
        .arg(&json)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines().map_while(Result::ok);
    let mut broker = None;
    // Wait (by what it says, not by time) until the second step has started.
    for line in lines.by_ref() {
        if let Some(rest) = line.strip_prefix("capacity: local mesh: broker ") {
            broker = rest.split_whitespace().next().map(str::to_string);
        }
        if line.starts_with("capacity: step 2 ") {
            break;
        }
    }
    let broker: std::net::SocketAddr = broker.expect("the mesh's line").parse().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::INT,
    )
    .unwrap();
    let rest: Vec<String> = lines.collect();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {rest:?}");
    let report: CapacityReport =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let why = report.stopped_early.as_deref().unwrap_or_default();
    assert!(why.contains("Ctrl-C"), "{why}");
    let s = &report.searches[0];
    assert_eq!(s.ended_by, "stopped");
    assert_eq!(s.capacity, None, "no confirmation ran");
    assert_eq!(
        s.steps.len(),
        1,
        "step 2 was cut short and left out: {:?}",
        s.steps
    );
    // The local broker is gone.
    assert!(std::net::TcpStream::connect(broker).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--compare-tls` on the local mesh: a plaintext pair and a pair with mutual TLS on both
/// hops (a throwaway CA of the driver's), both searched, step by step in turns. That the
/// TLS search really spoke TLS is read from the TLS pair's own counters while the run goes
/// on: its broker made inbound and upstream handshakes, its provider inbound ones, and
/// the plaintext broker none, though it took calls too.
#[test]
fn a_tls_comparison_searches_a_plaintext_and_a_mutual_tls_mesh() {
    use rpcmesh_common::metrics::exposition::sample;
    use std::io::{BufRead, BufReader};
    let dir = std::env::temp_dir().join(format!("rpcmesh-capacity-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("c.json");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(testkit::short_tls_comparison())
        .arg("--json")
        .arg(&json)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let text = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap());
    let mut lines = BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok);
    // The two meshes' metrics addresses, from their lines.
    let metrics = |line: &str| -> Vec<std::net::SocketAddr> {
        line.split("(metrics ")
            .skip(1)
            .map(|m| m.split(')').next().unwrap().parse().unwrap())
            .collect()
    };
    let (mut tls, mut plain) = (Vec::new(), Vec::new());
    let mut seen = Vec::new();
    // Wait (by what it says, not by time) until a TLS step has run its course: step 2 is
    // the first with TLS on, so step 3's start comes after it.
    for line in lines.by_ref() {
        if line.starts_with("capacity: local mesh with mutual TLS:") {
            tls = metrics(&line);
        } else if line.starts_with("capacity: local mesh, plaintext:") {
            plain = metrics(&line);
        }
        let third = line.starts_with("capacity: step 3 ");
        seen.push(line);
        if third {
            break;
        }
    }
    assert_eq!((tls.len(), plain.len()), (2, 2), "{seen:#?}");
    assert!(
        seen.iter()
            .any(|l| l.starts_with("capacity: step 2 (grow, TLS on)")),
        "{seen:#?}"
    );
    let handshakes = |at: std::net::SocketAddr, side: &str| {
        let page = testkit::http::get(at, "/metrics").unwrap();
        sample(&page, "rpcmesh_tls_handshakes_total", &[("side", side)]).unwrap_or(0.0)
    };
    assert!(
        handshakes(tls[0], "inbound") > 0.0,
        "the TLS broker's callers"
    );
    assert!(
        handshakes(tls[0], "upstream") > 0.0,
        "the TLS broker's providers"
    );
    assert!(
        handshakes(tls[1], "inbound") > 0.0,
        "the TLS provider's callers"
    );
    assert_eq!(handshakes(plain[0], "inbound"), 0.0, "the plaintext broker");
    // And step 1, TLS off, called the plaintext pair.
    let calls = |at: std::net::SocketAddr| {
        let page = testkit::http::get(at, "/metrics").unwrap();
        sample(&page, "rpcmesh_calls_total", &[]).unwrap_or(0.0)
    };
    assert!(calls(plain[0]) > 0.0, "the plaintext broker took no call");
    assert!(calls(tls[0]) > 0.0, "the TLS broker took no call");
    let rest: Vec<String> = lines.collect();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {seen:#?} {rest:#?}");
    let text = text.join().unwrap();
    assert!(text.contains("Search, TLS off"), "{text}");
    assert!(text.contains("TLS off against on"), "{text}");

    let report: CapacityReport =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(report.stopped_early.is_none(), "{:?}", report.stopped_early);
    let tls_of: Vec<bool> = report.searches.iter().map(|s| s.tls).collect();
    assert_eq!(tls_of, [false, true]);
    for s in &report.searches {
        assert!(s.capacity.is_some(), "{s:?}");
        for t in &s.steps {
            for role in ["driver", "broker", "provider"] {
                assert!(t.cpu_us_per_call.contains_key(role), "{role}: {t:?}");
            }
        }
    }
    let c = report.comparison.as_ref().expect("a comparison");
    assert_eq!(c.compared, rpcmesh_capacity::Compared::Tls);
    assert!(c.verdict.starts_with("on this path TLS"), "{}", c.verdict);
    assert_eq!(report.setup.targets.len(), 2);
    assert_eq!(report.setup.probes.len(), 4);
    // The throwaway CA is gone with the experiment.
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("rpcmesh-capacity-tls-{}-", child.id()))
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
