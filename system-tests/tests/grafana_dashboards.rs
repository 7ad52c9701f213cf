//! The Grafana dashboards of `grafana/dashboards/`, proven statically: every dashboard
//! validates against `grafana/schema/dashboard.schema.json` (made from Grafana's own
//! published types by `grafana/schema/generate`), uses the one provisioned datasource, its
//! template variables and `$__rate_interval`, and is what `grafana/make-dashboards`
//! writes. Needs `python3` (for `grafana/make-dashboards --check`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod grafana;

use std::collections::BTreeSet;

use grafana::{dashboards, grafana_dir, panels, read, run};
use rpcmesh_system_tests as system;
use rpcmesh_testkit as testkit;
use serde_json::Value;

/// The datasource uid every dashboard names, as provisioned.
const DATASOURCE_UID: &str = "rpcmesh-prometheus";

#[test]
fn every_dashboard_meets_grafanas_schema_and_the_house_rules() {
    let schema: Value =
        serde_json::from_str(&read(&grafana_dir().join("schema/dashboard.schema.json"))).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let all = dashboards();
    let mut uids = BTreeSet::new();
    for (name, d) in &all {
        let problems: Vec<String> = validator
            .iter_errors(d)
            .map(|e| format!("{}: {e}", e.instance_path))
            .collect();
        assert!(problems.is_empty(), "{name}: {problems:#?}");
        assert!(uids.insert(d["uid"].as_str().unwrap()), "{name}: uid twice");

        let vars: Vec<&str> = d["templating"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        for v in ["job", "instance"] {
            assert!(vars.contains(&v), "{name}: no ${v} variable");
        }
        for v in d["templating"]["list"].as_array().unwrap() {
            assert_eq!(v["datasource"]["uid"], DATASOURCE_UID, "{name}: {v}");
        }
        let mut titles = BTreeSet::new();
        let mut used = BTreeSet::new();
        for p in panels(d) {
            let title = p["title"].as_str().unwrap();
            assert!(titles.insert(title), "{name}: two panels titled {title}");
            assert!(
                ["timeseries", "stat"].contains(&p["type"].as_str().unwrap()),
                "{name} / {title}: a panel type the schema has no options for"
            );
            assert_eq!(p["datasource"]["uid"], DATASOURCE_UID, "{name} / {title}");
            let targets = p["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{name} / {title}: no query");
            for t in targets {
                assert_eq!(t["datasource"]["uid"], DATASOURCE_UID, "{name} / {title}");
                let expr = t["expr"].as_str().unwrap();
                for v in ["$job", "$instance"] {
                    assert!(expr.contains(v), "{name} / {title}: no {v} in {expr}");
                }
                // Raw rates follow the dashboard's resolution; recording rules have theirs.
                let windows = expr.matches('[').count();
                let rate_windows = expr.matches("[$__rate_interval]").count();
                assert_eq!(
                    windows, rate_windows,
                    "{name} / {title}: a fixed window in {expr}"
                );
                for v in &vars {
                    if expr.contains(&format!("${v}")) {
                        used.insert(*v);
                    }
                }
            }
        }
        for v in &vars {
            assert!(used.contains(v), "{name}: variable ${v} filters no panel");
        }
    }

    // The schema is strict: a query field Grafana does not know, a time series option of
    // another panel type, and a missing required field are each rejected.
    // The overview with its first time series panel changed by `change`.
    let with_first_ts = |change: fn(&mut Value)| {
        let mut d = all["overview.json"].clone();
        let first_ts = d["panels"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|p| p["type"] == "timeseries")
            .unwrap();
        change(first_ts);
        d
    };
    let d = with_first_ts(|ts| ts["targets"][0]["exprr"] = Value::from("up"));
    assert!(!validator.is_valid(&d), "an unknown query field passed");
    let d = with_first_ts(|ts| ts["options"]["graphMode"] = Value::from("area"));
    assert!(
        !validator.is_valid(&d),
        "a stat option on a time series passed"
    );
    let mut d = all["overview.json"].clone();
    d.as_object_mut().unwrap().remove("schemaVersion");
    assert!(
        !validator.is_valid(&d),
        "a dashboard without schemaVersion passed"
    );

    // The JSON is what the generator writes.
    let python = system::need_tool("python3", "python3");
    let (ok, said) = run(
        &python,
        &["grafana/make-dashboards", "--check"],
        &testkit::workspace_root(),
    );
    assert!(ok, "{said}");

    // Provisioning: one Prometheus datasource with the dashboards' uid, and a file
    // provider for the dashboards.
    let ds = read(&grafana_dir().join("provisioning/datasources/rpcmesh.yml"));
    assert!(ds.contains(&format!("uid: {DATASOURCE_UID}")), "{ds}");
    assert!(ds.contains("type: prometheus"), "{ds}");
    let providers = read(&grafana_dir().join("provisioning/dashboards/rpcmesh.yml"));
    assert!(providers.contains("type: file"), "{providers}");
}
