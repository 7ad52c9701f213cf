//! The driver's limits, timeouts and defaults that the docs quote are the code's: each
//! quote (a row of the limits table in docs/architecture.md, or a value followed by
//! "(`driver::NAME`" in any doc; the rules are in testkit/src/quoted.rs) is held to
//! the constant it names, and the test fails naming the row or line that differs.

use std::time::Duration;

use rpcmesh_driver::config::{DEFAULT_BACKLOG, DEFAULT_CALL_TIMEOUT};
use rpcmesh_driver::connection::{ASK_TIMEOUT, HOME_RETRY, SHED_MOVE_SPACING};
use rpcmesh_driver::failures::{MAX_TEXT_BYTES, MAX_TEXTS};
use rpcmesh_driver::pacer::EXACT_SPIN;
use rpcmesh_driver::stats::MAX_LATENCY_US;
use rpcmesh_driver::{MAX_DRAINING, MAX_RETRIES};
use rpcmesh_testkit::quoted::{self, Value, bytes, count, time};

/// The driver's constants the docs quote, by the name they quote them under.
fn driver() -> Vec<(&'static str, Value)> {
    vec![
        ("driver::MAX_RETRIES", count(MAX_RETRIES)),
        ("driver::SHED_MOVE_SPACING", time(SHED_MOVE_SPACING)),
        ("driver::MAX_DRAINING", count(MAX_DRAINING)),
        ("driver::DEFAULT_CALL_TIMEOUT", time(DEFAULT_CALL_TIMEOUT)),
        ("driver::DEFAULT_BACKLOG", count(DEFAULT_BACKLOG)),
        ("driver::HOME_RETRY", time(HOME_RETRY)),
        ("driver::ASK_TIMEOUT", time(ASK_TIMEOUT)),
        ("driver::MAX_TEXT_BYTES", bytes(MAX_TEXT_BYTES)),
        ("driver::MAX_TEXTS", count(MAX_TEXTS)),
        ("driver::EXACT_SPIN", time(EXACT_SPIN)),
        (
            "driver::MAX_LATENCY_US",
            time(Duration::from_micros(MAX_LATENCY_US)),
        ),
    ]
}

#[test]
fn the_reader_of_quoted_constants_reads_what_it_should() {
    quoted::self_test();
}

#[test]
fn the_docs_quote_the_drivers_limits_timeouts_and_re_sends_as_the_code_sets_them() {
    quoted::check("driver", &driver());
}
