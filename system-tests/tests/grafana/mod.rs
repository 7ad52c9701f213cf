//! What the Grafana and Prometheus tests share: the `grafana/` folder, its dashboards,
//! their panels and the queries those panels make, as Grafana sends them.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rpcmesh_testkit as testkit;
use serde_json::Value;

/// How many recording rules `rules/recording.yml` holds.
pub const RECORDING_RULES: usize = 21;

pub fn grafana_dir() -> PathBuf {
    testkit::workspace_root().join("grafana")
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Runs `program args` in `dir`; its exit status and both outputs.
pub fn run(program: &Path, args: &[&str], dir: &Path) -> (bool, String) {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// The dashboards, by file name.
pub fn dashboards() -> BTreeMap<String, Value> {
    let dir = grafana_dir().join("dashboards");
    let mut all = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let v: Value =
                serde_json::from_str(&read(&path)).unwrap_or_else(|e| panic!("{name}: {e}"));
            all.insert(name, v);
        }
    }
    assert_eq!(all.len(), 8, "the eight dashboards: {:?}", all.keys());
    all
}

/// Every panel of a dashboard that is not a row (rows' own panels included).
pub fn panels(d: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().unwrap().iter());
        } else {
            out.push(p);
        }
    }
    out
}

/// One query of one panel.
pub struct PanelQuery {
    pub dashboard: String,
    pub title: String,
    pub ref_id: String,
    pub expr: String,
}

pub fn panel_queries(all: &BTreeMap<String, Value>) -> Vec<PanelQuery> {
    let mut out = Vec::new();
    for (name, d) in all {
        for p in panels(d) {
            for t in p["targets"].as_array().unwrap() {
                out.push(PanelQuery {
                    dashboard: name.clone(),
                    title: p["title"].as_str().unwrap().to_string(),
                    ref_id: t["refId"].as_str().unwrap().to_string(),
                    expr: t["expr"].as_str().unwrap().to_string(),
                });
            }
        }
    }
    out
}

/// A query as Grafana sends it with every variable at "All" (its allValue `.*`).
pub fn substitute(expr: &str, rate_interval: &str) -> String {
    let mut q = expr.replace("$__rate_interval", rate_interval);
    for var in ["job", "instance", "role", "provider"] {
        q = q
            .replace(&format!("${{{var}}}"), ".*")
            .replace(&format!("${var}"), ".*");
    }
    assert!(!q.contains('$'), "a variable nobody defines in {expr}");
    q
}
