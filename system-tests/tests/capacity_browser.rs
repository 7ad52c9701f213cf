//! `driver capacity`'s HTML report in a real browser: the test kit's short experiment (a
//! search with compression off and on, and a sweep), whose report must draw all four of
//! its charts once headless Chromium has run the page's script. The figures themselves
//! (search, JSON, schema) are checked by the fast tier (`driver/tests/capacity.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rpcmesh_system_tests::headless_dom;
use rpcmesh_testkit as testkit;

#[test]
fn a_short_search_draws_every_chart_of_its_html_report_in_a_browser() {
    let dir = std::env::temp_dir().join(format!("rpcmesh-capacity-html-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let html = dir.join("c.html");
    let out = testkit::short_capacity_search(&testkit::bin_path("driver"), &[("--html", &html)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");

    // Every chart is drawn in a real browser.
    let dom = headless_dom(&html).unwrap();
    for chart in ["throughput", "latency", "usl", "compression"] {
        assert!(
            dom.contains(&format!("data-chart=\"{chart}\"")),
            "{chart} missing"
        );
    }
    assert!(dom.contains("data-charts-drawn=\"4\""), "{dom}");
    assert!(!dom.contains("data-drawn=\"no\""), "{dom}");
    let _ = std::fs::remove_dir_all(&dir);
}
