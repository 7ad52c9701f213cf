//! The broker's limits, timeouts and defaults that the docs quote are the code's: each quote
//! (a row of the limits table in docs/architecture.md, or a value followed by
//! "(`broker::NAME`" in any doc; the rules are in testkit/src/quoted.rs) is held to the
//! constant it names, and the test fails naming the row or line that differs.

use rpcmesh_broker::config::{
    DEFAULT_BUSY_POLL, DEFAULT_CALL_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_GRACE,
    DEFAULT_HEALTH_INTERVAL, DEFAULT_HEALTH_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_IN_FLIGHT_PER_CONN, DEFAULT_MAX_IN_FLIGHT_PER_UPSTREAM_CONN,
    DEFAULT_PACK_IN_FLIGHT, DEFAULT_PACK_WAIT,
};
use rpcmesh_broker::metrics::MAX_CALL_LABELS;
use rpcmesh_broker::providers_file::{MAX_FILE_BYTES, MAX_PROVIDERS};
use rpcmesh_broker::{FILE_POLL, MAX_RETRIES, REQUEST_RETAIN};
use rpcmesh_testkit::quoted::{self, Value, bytes, count, time};

/// The broker's constants the docs quote, by the name they quote them under.
fn broker() -> Vec<(&'static str, Value)> {
    vec![
        (
            "broker::DEFAULT_MAX_CONNECTIONS",
            count(DEFAULT_MAX_CONNECTIONS),
        ),
        (
            "broker::DEFAULT_MAX_IN_FLIGHT_PER_CONN",
            count(DEFAULT_MAX_IN_FLIGHT_PER_CONN),
        ),
        (
            "broker::DEFAULT_MAX_IN_FLIGHT",
            count(DEFAULT_MAX_IN_FLIGHT),
        ),
        (
            "broker::DEFAULT_MAX_IN_FLIGHT_PER_UPSTREAM_CONN",
            count(DEFAULT_MAX_IN_FLIGHT_PER_UPSTREAM_CONN),
        ),
        ("broker::DEFAULT_CALL_TIMEOUT", time(DEFAULT_CALL_TIMEOUT)),
        (
            "broker::DEFAULT_CONNECT_TIMEOUT",
            time(DEFAULT_CONNECT_TIMEOUT),
        ),
        (
            "broker::DEFAULT_HEALTH_INTERVAL",
            time(DEFAULT_HEALTH_INTERVAL),
        ),
        (
            "broker::DEFAULT_HEALTH_TIMEOUT",
            time(DEFAULT_HEALTH_TIMEOUT),
        ),
        (
            "broker::DEFAULT_CONNECT_TIMEOUT + broker::DEFAULT_HEALTH_TIMEOUT",
            time(DEFAULT_CONNECT_TIMEOUT + DEFAULT_HEALTH_TIMEOUT),
        ),
        ("broker::DEFAULT_GRACE", time(DEFAULT_GRACE)),
        ("broker::DEFAULT_BUSY_POLL", time(DEFAULT_BUSY_POLL)),
        (
            "broker::DEFAULT_PACK_IN_FLIGHT",
            count(DEFAULT_PACK_IN_FLIGHT),
        ),
        ("broker::DEFAULT_PACK_WAIT", time(DEFAULT_PACK_WAIT)),
        ("broker::MAX_FILE_BYTES", bytes(MAX_FILE_BYTES)),
        ("broker::MAX_PROVIDERS", count(MAX_PROVIDERS)),
        ("broker::FILE_POLL", time(FILE_POLL)),
        ("broker::REQUEST_RETAIN", time(REQUEST_RETAIN)),
        ("broker::MAX_RETRIES", count(MAX_RETRIES)),
        ("broker::MAX_CALL_LABELS", count(MAX_CALL_LABELS)),
    ]
}

#[test]
fn the_reader_of_quoted_constants_reads_what_it_should() {
    quoted::self_test();
}

#[test]
fn the_docs_quote_the_brokers_limits_timeouts_and_retries_as_the_code_sets_them() {
    quoted::check("broker", &broker());
}
