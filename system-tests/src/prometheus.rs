//! Asking a Prometheus server of a test (its HTTP API on 127.0.0.1): an API call's `data`,
//! and an instant query's result vector. A test fails at once on an error answer, naming
//! what it asked.

use std::net::SocketAddr;

use serde_json::Value;

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
