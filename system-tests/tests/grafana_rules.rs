//! The Prometheus configuration and rules of `grafana/prometheus/`, proven with promtool:
//! `check config`, `check rules` and the rule unit tests of `grafana/prometheus/tests/`
//! (which must name every recording rule and alert). Needs `promtool` (Debian package
//! `prometheus`; `scripts/deps` installs it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod grafana;

use std::collections::BTreeSet;

use grafana::{RECORDING_RULES, grafana_dir, read, run};
use rpcmesh_system_tests as system;

/// The names that lines `key: NAME` give, in order.
fn names_after(text: &str, key: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("- ")
                .unwrap_or(l.trim())
                .strip_prefix(key)
        })
        .map(|n| n.trim().to_string())
        .collect()
}

#[test]
fn promtool_passes_the_config_the_rules_and_their_unit_tests() {
    let promtool = system::need_tool("promtool", "prometheus");
    let prom_dir = grafana_dir().join("prometheus");
    for args in [
        &["check", "config", "prometheus.yml"][..],
        &["check", "rules", "rules/recording.yml", "rules/alerts.yml"][..],
        &[
            "test",
            "rules",
            "tests/recording_test.yml",
            "tests/alerts_test.yml",
        ][..],
    ] {
        let (ok, said) = run(&promtool, args, &prom_dir);
        assert!(ok, "promtool {args:?}:\n{said}");
        assert!(
            !said.contains("WARNING"),
            "promtool {args:?} warns:\n{said}"
        );
    }
    // The unit tests name every rule: each recording rule is an expression tested, each
    // alert an alertname tested.
    let records = names_after(&read(&prom_dir.join("rules/recording.yml")), "record:");
    let alerts = names_after(&read(&prom_dir.join("rules/alerts.yml")), "alert:");
    assert_eq!(records.len(), RECORDING_RULES, "{records:?}");
    assert_eq!(alerts.len(), 11, "{alerts:?}");
    let tested: BTreeSet<String> =
        names_after(&read(&prom_dir.join("tests/recording_test.yml")), "expr:")
            .into_iter()
            .map(|e| e.split('{').next().unwrap().to_string())
            .collect();
    for r in &records {
        assert!(tested.contains(r), "no unit test of the recording rule {r}");
    }
    let alert_tests = names_after(&read(&prom_dir.join("tests/alerts_test.yml")), "alertname:");
    for a in &alerts {
        assert!(alert_tests.contains(a), "no unit test of the alert {a}");
    }
}
