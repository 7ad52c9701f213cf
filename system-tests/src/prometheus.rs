//! A Prometheus server of a test: started on a folder of the test's, its API on 127.0.0.1,
//! and asked through that API (an API call's `data`, an instant query's result vector,
//! whether it scrapes every target). A test fails at once on an error answer, naming what
//! it asked.

use std::net::SocketAddr;
use std::path::Path;

use rpcmesh_testkit::ChildGuard;
use serde_json::Value;

/// Starts the `prometheus` binary on `dir/prometheus.yml`, its data in `dir/data`, its API
/// on `listen`; killed when the guard is dropped.
pub fn start(prometheus: &Path, dir: &Path, listen: SocketAddr) -> ChildGuard {
    ChildGuard::spawn(
        prometheus,
        &[
            &format!("--config.file={}", dir.join("prometheus.yml").display()),
            &format!("--storage.tsdb.path={}", dir.join("data").display()),
            &format!("--web.listen-address={listen}"),
            "--log.level=warn",
        ],
    )
    .unwrap_or_else(|e| panic!("start {}: {e}", prometheus.display()))
}

/// Whether the server is ready and has scraped `targets` targets, every one up. (Ready
/// means 200: a starting Prometheus answers 503 "Service Unavailable".)
pub fn scrapes_all(prom: SocketAddr, targets: usize) -> bool {
    rpcmesh_testkit::get(prom, "/-/ready").is_ok() && {
        let up = query(prom, "up");
        up.len() == targets && up.iter().all(|(_, v)| *v == 1.0)
    }
}

/// A Prometheus API call's `data` (`query`'s pairs percent-encoded into the URL); fails
/// the test on an error answer.
pub fn api(prom: SocketAddr, path: &str, query: &[(&str, &str)]) -> Value {
    let body = rpcmesh_testkit::get_query(prom, path, query)
        .unwrap_or_else(|e| panic!("{path} {query:?}: {e}"));
    let mut v: Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path} {query:?}: {e}: {body}"));
    assert_eq!(v["status"], "success", "{path} {query:?}: {body}");
    v["data"].take()
}

/// An instant query: the result vector as (labels, value) pairs (a value that is not a
/// number reads as NaN).
pub fn query(prom: SocketAddr, q: &str) -> Vec<(Value, f64)> {
    let mut data = api(prom, "/api/v1/query", &[("query", q)]);
    let Value::Array(result) = data["result"].take() else {
        return Vec::new();
    };
    result
        .into_iter()
        .map(|mut r| {
            let val = r["value"][1]
                .as_str()
                .unwrap_or("NaN")
                .parse::<f64>()
                .unwrap_or(f64::NAN);
            (r["metric"].take(), val)
        })
        .collect()
}
