//! The provider's limits and timeouts that the docs quote are the code's: each quote (a row
//! of the limits table in docs/architecture.md, or a value followed by "(`provider::NAME`"
//! in any doc; the rules are in testkit/src/quoted.rs) is held to the constant it
//! names, and the test fails naming the row or line that differs.

use rpcmesh_provider::config::{
    DEFAULT_GRACE, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_IN_FLIGHT_PER_CONN,
};
use rpcmesh_testkit::quoted::{self, Value, count, time};

/// The provider's constants the docs quote, by the name they quote them under.
fn provider() -> Vec<(&'static str, Value)> {
    vec![
        (
            "provider::DEFAULT_MAX_CONNECTIONS",
            count(DEFAULT_MAX_CONNECTIONS),
        ),
        (
            "provider::DEFAULT_MAX_IN_FLIGHT_PER_CONN",
            count(DEFAULT_MAX_IN_FLIGHT_PER_CONN),
        ),
        ("provider::DEFAULT_GRACE", time(DEFAULT_GRACE)),
    ]
}

#[test]
fn the_reader_of_quoted_constants_reads_what_it_should() {
    quoted::self_test();
}

#[test]
fn the_docs_quote_the_providers_limits_and_timeouts_as_the_code_sets_them() {
    quoted::check("provider", &provider());
}
