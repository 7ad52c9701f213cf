//! The limits, timeouts and defaults of `rpcmesh-wire` and `rpcmesh-common` that the docs
//! quote are the code's: each quote (a row of the limits table in docs/architecture.md,
//! or a value followed by "(`CRATE::NAME`" in any doc; the rules are in `testkit/src/quoted.rs`)
//! is held to the constant it names, and a test fails naming the row or line that
//! differs.

use rpcmesh_common::cli::startup::{
    EXIT_DEADLINE_STATUS, EXIT_MARGIN, LISTEN_BACKLOG, RUNTIME_STOP_WAIT,
};
use rpcmesh_common::log_sink::{LOG_FLUSH_WAIT, LOG_QUEUE_LINES};
use rpcmesh_common::metrics::endpoint::{
    ACCEPT_ERROR_PAUSE, CONNECTION_LIFETIME, HEADER_READ_TIMEOUT, MAX_CONNECTIONS,
};
use rpcmesh_common::metrics::families::DEFAULT_STAGE_SAMPLE;
use rpcmesh_common::metrics::recorder::LATENCY_BUCKETS;
use rpcmesh_common::metrics::system::DEFAULT_INTERVAL;
use rpcmesh_common::net::backoff::{RECONNECT_MAX, RECONNECT_MIN};
use rpcmesh_common::net::budget::{
    CONNECTION_BASE, DEFAULT_MEMORY_BUDGET, PAUSE_FLOOR, RSS_OVERHEAD, SHED_AFTER, SHED_CHECK,
    SMALL_BODY,
};
use rpcmesh_common::net::connection::{
    KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES, SHRINK_ABOVE,
};
use rpcmesh_common::net::listener::{
    ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF_MIN, ACCEPT_BATCH, LAST_ANSWERS_WAIT, REFUSED_BATCH_PAUSE,
};
use rpcmesh_common::net::session::{
    DEFAULT_FRAME_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_IN_FLIGHT_PER_LINK,
    DEFAULT_WRITE_TIMEOUT, DRAIN_LINGER, NOTICED_DRAIN_LINGER, PAUSED_PEER_CHECK,
    WRITE_BACKLOG_LIMIT,
};
use rpcmesh_common::net::sources::{
    DEFAULT_ACCEPT_BURST_PER_SOURCE, DEFAULT_ACCEPT_RATE_PER_SOURCE,
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
};
use rpcmesh_common::net::tls::{DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_HANDSHAKES};
use rpcmesh_common::retry::{
    DEFAULT_RETRY_MIN_PER_SECOND, DEFAULT_RETRY_PERCENT, RETRY_BUDGET_TTL,
};
use rpcmesh_testkit::quoted::{self, Value, bytes, count, time};
use rpcmesh_wire::codec::RESYNC_SCAN_LIMIT;
use rpcmesh_wire::compress::{
    DEFAULT_COMPRESS_LEVEL, DEFAULT_COMPRESS_THRESHOLD, DEFAULT_MAX_INFLATED_LEN,
};
use rpcmesh_wire::envelope::DEFAULT_MAX_METADATA_BYTES;
use rpcmesh_wire::frame::DEFAULT_MAX_BODY_LEN;

/// The wire layer's constants the docs quote, by the name they quote them under.
fn wire() -> Vec<(&'static str, Value)> {
    vec![
        ("wire::DEFAULT_MAX_BODY_LEN", bytes(DEFAULT_MAX_BODY_LEN)),
        (
            "wire::DEFAULT_MAX_INFLATED_LEN",
            bytes(DEFAULT_MAX_INFLATED_LEN),
        ),
        (
            "wire::DEFAULT_MAX_METADATA_BYTES",
            bytes(DEFAULT_MAX_METADATA_BYTES),
        ),
        (
            "wire::DEFAULT_COMPRESS_THRESHOLD",
            bytes(DEFAULT_COMPRESS_THRESHOLD),
        ),
        (
            "wire::DEFAULT_COMPRESS_LEVEL",
            count(DEFAULT_COMPRESS_LEVEL),
        ),
        ("wire::RESYNC_SCAN_LIMIT", bytes(RESYNC_SCAN_LIMIT)),
    ]
}

/// The net, metrics and cli layers' constants the docs quote.
fn common() -> Vec<(&'static str, Value)> {
    vec![
        (
            "common::DEFAULT_HANDSHAKE_TIMEOUT",
            time(DEFAULT_HANDSHAKE_TIMEOUT),
        ),
        (
            "common::DEFAULT_MAX_HANDSHAKES",
            count(DEFAULT_MAX_HANDSHAKES),
        ),
        (
            "common::DEFAULT_MAX_IN_FLIGHT_PER_LINK",
            count(DEFAULT_MAX_IN_FLIGHT_PER_LINK),
        ),
        ("common::WRITE_BACKLOG_LIMIT", bytes(WRITE_BACKLOG_LIMIT)),
        ("common::DEFAULT_IDLE_TIMEOUT", time(DEFAULT_IDLE_TIMEOUT)),
        ("common::DEFAULT_FRAME_TIMEOUT", time(DEFAULT_FRAME_TIMEOUT)),
        ("common::DEFAULT_WRITE_TIMEOUT", time(DEFAULT_WRITE_TIMEOUT)),
        ("common::DRAIN_LINGER", time(DRAIN_LINGER)),
        ("common::NOTICED_DRAIN_LINGER", time(NOTICED_DRAIN_LINGER)),
        ("common::PAUSED_PEER_CHECK", time(PAUSED_PEER_CHECK)),
        (
            "common::DEFAULT_MEMORY_BUDGET",
            bytes(DEFAULT_MEMORY_BUDGET),
        ),
        ("common::SMALL_BODY", bytes(SMALL_BODY)),
        ("common::PAUSE_FLOOR", bytes(PAUSE_FLOOR)),
        ("common::SHED_AFTER", time(SHED_AFTER)),
        ("common::SHED_CHECK", time(SHED_CHECK)),
        ("common::SHRINK_ABOVE", bytes(SHRINK_ABOVE)),
        ("common::KEEPALIVE_IDLE", time(KEEPALIVE_IDLE)),
        ("common::KEEPALIVE_INTERVAL", time(KEEPALIVE_INTERVAL)),
        ("common::KEEPALIVE_PROBES", count(KEEPALIVE_PROBES)),
        ("common::ACCEPT_BACKOFF_MIN", time(ACCEPT_BACKOFF_MIN)),
        ("common::ACCEPT_BACKOFF_MAX", time(ACCEPT_BACKOFF_MAX)),
        ("common::LAST_ANSWERS_WAIT", time(LAST_ANSWERS_WAIT)),
        ("common::RECONNECT_MIN", time(RECONNECT_MIN)),
        ("common::RECONNECT_MAX", time(RECONNECT_MAX)),
        ("common::MAX_CONNECTIONS", count(MAX_CONNECTIONS)),
        ("common::HEADER_READ_TIMEOUT", time(HEADER_READ_TIMEOUT)),
        ("common::CONNECTION_LIFETIME", time(CONNECTION_LIFETIME)),
        ("common::ACCEPT_ERROR_PAUSE", time(ACCEPT_ERROR_PAUSE)),
        ("common::DEFAULT_STAGE_SAMPLE", count(DEFAULT_STAGE_SAMPLE)),
        ("common::DEFAULT_INTERVAL", time(DEFAULT_INTERVAL)),
        ("common::LISTEN_BACKLOG", count(LISTEN_BACKLOG)),
        ("common::LOG_QUEUE_LINES", count(LOG_QUEUE_LINES)),
        ("common::LOG_FLUSH_WAIT", time(LOG_FLUSH_WAIT)),
        (
            "common::DEFAULT_RETRY_PERCENT",
            count(DEFAULT_RETRY_PERCENT),
        ),
        ("common::RETRY_BUDGET_TTL", time(RETRY_BUDGET_TTL)),
        (
            "common::DEFAULT_RETRY_MIN_PER_SECOND",
            count(DEFAULT_RETRY_MIN_PER_SECOND),
        ),
        (
            "common::DEFAULT_MAX_CONNECTIONS_PER_SOURCE",
            count(DEFAULT_MAX_CONNECTIONS_PER_SOURCE),
        ),
        (
            "common::DEFAULT_ACCEPT_RATE_PER_SOURCE",
            count(DEFAULT_ACCEPT_RATE_PER_SOURCE),
        ),
        (
            "common::DEFAULT_ACCEPT_BURST_PER_SOURCE",
            count(DEFAULT_ACCEPT_BURST_PER_SOURCE),
        ),
        ("common::ACCEPT_BATCH", count(ACCEPT_BATCH)),
        ("common::REFUSED_BATCH_PAUSE", time(REFUSED_BATCH_PAUSE)),
        ("common::EXIT_MARGIN", time(EXIT_MARGIN)),
        ("common::RUNTIME_STOP_WAIT", time(RUNTIME_STOP_WAIT)),
        (
            "common::EXIT_DEADLINE_STATUS",
            count(EXIT_DEADLINE_STATUS.unsigned_abs()),
        ),
        ("common::CONNECTION_BASE", bytes(CONNECTION_BASE)),
        ("common::RSS_OVERHEAD", bytes(RSS_OVERHEAD)),
    ]
}

#[test]
fn the_reader_of_quoted_constants_reads_what_it_should() {
    quoted::self_test();
}

#[test]
fn the_docs_quote_the_wire_layers_limits_as_the_code_sets_them() {
    quoted::check("wire", &wire());
}

#[test]
fn the_docs_quote_the_common_layers_limits_and_timeouts_as_the_code_sets_them() {
    quoted::check("common", &common());
}

/// The bucket list in docs/metrics.md is the recorder's.
#[test]
fn the_metrics_doc_lists_the_histogram_buckets_of_the_recorder() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
        .expect("docs/metrics.md");
    let list = LATENCY_BUCKETS
        .iter()
        .map(|b| format!("{b}"))
        .collect::<Vec<_>>()
        .join(", ");
    assert!(
        doc.contains(&format!("`{list}` (seconds)")),
        "docs/metrics.md's bucket list is not the recorder's: `{list}` (seconds)"
    );
}
