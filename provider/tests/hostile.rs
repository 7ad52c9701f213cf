//! The provider against clients that hold resources without using them: real process,
//! real sockets, memory read from `/proc/PID/status`, no wall-time assertions. The
//! provider's hostile tests that measure CPU or log lines over wall-clock windows (out of
//! descriptors, metadata bombs) are the system tier's (`system-tests/tests/hostile.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpStream;

use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::{self as testkit, Spawned};
use rpcmesh_wire::Status;

/// Idle connections opened at once.
const IDLE: usize = 500;
/// The most an idle connection may cost the provider: its buffers, not a zlib state
/// (hundreds of KiB each, were one made on accept).
const MAX_KIB_PER_IDLE_CONNECTION: u64 = 64;

#[tokio::test]
async fn idle_connections_hold_no_compression_state() {
    let provider = Spawned::start(
        "provider",
        &[
            "--threads",
            "1",
            "--compress",
            "on",
            "--max-connections",
            "4096",
        ],
    );
    let addr = provider.rpc;
    let call = |c: Client| async move {
        let r = testkit::echo_call(&c, "after").await.unwrap().unwrap();
        assert_eq!(r.status, Status::Success);
    };
    // A call first, so that the baseline includes what serving costs.
    call(
        Client::connect(addr, ClientConfig::default())
            .await
            .unwrap(),
    )
    .await;
    let before = provider.status_kib("VmRSS");
    let idle: Vec<TcpStream> = (0..IDLE)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    // The provider accepts in order: once a call on a later connection is answered, every
    // idle one has been accepted (and given whatever a connection gets).
    call(
        Client::connect(addr, ClientConfig::default())
            .await
            .unwrap(),
    )
    .await;
    let after = provider.status_kib("VmRSS");
    let each = after.saturating_sub(before) / IDLE as u64;
    assert!(
        each <= MAX_KIB_PER_IDLE_CONNECTION,
        "{IDLE} idle connections took {before} → {after} KiB ({each} KiB each)"
    );
    drop(idle);
}
