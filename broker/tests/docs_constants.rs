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
use rpcmesh_broker::resilience::{
    DEFAULT_EJECT_BASE_TIME, DEFAULT_EJECT_CONSECUTIVE, DEFAULT_EJECT_MAX_TIME,
    DEFAULT_EJECT_MIN_CALLS, DEFAULT_EJECT_SUCCESS_RATE, DEFAULT_EJECT_WINDOW, DEFAULT_EWMA_DECAY,
    DEFAULT_EWMA_DEFAULT_RTT, DEFAULT_MAX_EJECTION_PERCENT, PROBE_SPACING,
};
use rpcmesh_broker::{
    FILE_POLL, LEASE_BLOCK, MAX_RETRIES, PLACEMENT_REVIEW, REQUEST_RETAIN, RETRY_FIRST, RETRY_MAX,
    RING_MAX, RING_MIN, SPREAD_BUSY_PCT, SPREAD_GAIN_PCT, STEADY_REVIEWS,
};
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
        ("broker::LEASE_BLOCK", count(LEASE_BLOCK)),
        ("broker::PLACEMENT_REVIEW", time(PLACEMENT_REVIEW)),
        ("broker::STEADY_REVIEWS", count(STEADY_REVIEWS as u64)),
        ("broker::SPREAD_BUSY_PCT", count(u64::from(SPREAD_BUSY_PCT))),
        ("broker::SPREAD_GAIN_PCT", count(u64::from(SPREAD_GAIN_PCT))),
        ("broker::RETRY_FIRST", time(RETRY_FIRST)),
        ("broker::RETRY_MAX", time(RETRY_MAX)),
        ("broker::RING_MIN", bytes(RING_MIN)),
        ("broker::RING_MAX", bytes(RING_MAX)),
        ("broker::DEFAULT_BUSY_POLL", time(DEFAULT_BUSY_POLL)),
        (
            "broker::DEFAULT_PACK_IN_FLIGHT",
            count(DEFAULT_PACK_IN_FLIGHT),
        ),
        ("broker::DEFAULT_PACK_WAIT", time(DEFAULT_PACK_WAIT)),
        (
            "broker::DEFAULT_EJECT_CONSECUTIVE",
            count(DEFAULT_EJECT_CONSECUTIVE),
        ),
        (
            "broker::DEFAULT_EJECT_SUCCESS_RATE",
            count(DEFAULT_EJECT_SUCCESS_RATE),
        ),
        ("broker::DEFAULT_EJECT_WINDOW", time(DEFAULT_EJECT_WINDOW)),
        (
            "broker::DEFAULT_EJECT_MIN_CALLS",
            count(DEFAULT_EJECT_MIN_CALLS),
        ),
        (
            "broker::DEFAULT_EJECT_BASE_TIME",
            time(DEFAULT_EJECT_BASE_TIME),
        ),
        (
            "broker::DEFAULT_EJECT_MAX_TIME",
            time(DEFAULT_EJECT_MAX_TIME),
        ),
        ("broker::PROBE_SPACING", time(PROBE_SPACING)),
        (
            "broker::DEFAULT_MAX_EJECTION_PERCENT",
            count(DEFAULT_MAX_EJECTION_PERCENT),
        ),
        ("broker::DEFAULT_EWMA_DECAY", time(DEFAULT_EWMA_DECAY)),
        (
            "broker::DEFAULT_EWMA_DEFAULT_RTT",
            time(DEFAULT_EWMA_DEFAULT_RTT),
        ),
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
