//! What the black-box tests of the provider, the broker and the driver share, one module
//! per job:
//!
//! ```text
//!   in_process  a server's `run_with` in the test process on port 0, echo calls to it
//!   spawned     a program run as a real process, its addresses, metrics and /proc figures;
//!               the broker with a memory budget that the hostile tests flood
//!   child       a child process killed and reaped when dropped, signals by PID
//!   stderr      stderr sinks that take nothing: a pipe whose reader has gone, a full one
//!   notify      systemd's side of sd_notify: what a program says (READY=1, WATCHDOG=1)
//!   paths       the workspace's root, the programs' and examples' binaries, free ports
//!   wait        waiting on a condition instead of sleeping (async and blocking)
//!   gate        holding calls in a handler until the test lets them through
//!   frames      request frames made by hand, reading frames off a socket
//!   flags       walking a program's flags: every duration flag refuses a bare number
//!   bad_input   the bad inputs every server must survive, and the probe that sends one
//!   golden      the reference implementation's golden frames
//!   http        a GET on 127.0.0.1 that checks the status
//!   quoted      the constants the docs quote, held to the code by each crate's test
//!   capacity    the short `driver capacity` experiment both tiers run
//!   certs       a test CA and the certificates it issues, as PEM files
//!   source      connections from 127.0.0.2, 127.0.0.3…, as other client hosts would
//! ```
//!
//! The tests prove order and causality, never how long something took: a test waits for
//! the condition it needs, and the only deadlines here are hang detectors that fail a
//! stuck test. Nothing here runs an outside command: the fast tier (`cargo test`) needs
//! no tool beyond Rust's. What only the system tier uses (a browser, systemd-analyze, the
//! measurement scripts) is in `rpcmesh-system-tests`.
//!
//! Every item is also at the crate's root, so that a test names `testkit::wait_until`.

pub mod bad_input;
pub mod capacity;
pub mod certs;
pub mod child;
pub mod flags;
pub mod frames;
pub mod gate;
pub mod golden;
pub mod http;
pub mod in_process;
pub mod notify;
pub mod paths;
pub mod quoted;
pub mod source;
pub mod spawned;
pub mod stderr;
pub mod wait;

pub use bad_input::{BadInput, Observed, PROBE_TIMEOUT, bad_inputs, garbage, probe};
pub use capacity::{short_capacity_search, short_tls_comparison};
pub use certs::{CertFiles, Leaf, Pki, spiffe};
pub use child::{ChildGuard, Signal};
pub use frames::{
    compressed_request, echo_request, large_claim, metadata_bomb, put_echo_with_metadata,
    read_frames,
};
pub use gate::Gate;
pub use golden::{golden, golden_exchange};
pub use http::{get, get_query};
pub use in_process::{InProcess, echo_call, echo_calls};
pub use notify::NotifySocket;
pub use paths::{bin_path, example_path, free_port, replace_with_fifo, workspace_root};
pub use source::{connect_from, loopback_source};
pub use spawned::{
    BROKER_BUDGET_MIB, Launch, PeakRss, Spawned, budgeted_broker, budgeted_broker_with,
};
pub use stderr::{closed_pipe, full_pipe};
pub use wait::{
    WAIT_POLL, WAIT_TIMEOUT, eventually, wait_for, wait_listening, wait_refused, wait_until,
    wait_until_blocking,
};
