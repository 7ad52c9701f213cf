//! The provider against clients that hold resources without using them (the start of the
//! hostile-client suite of issue 14): real process, real sockets, memory read from
//! `/proc/PID/status`, no wall-time assertions.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use rpcmesh_common::cli::startup::parse_listening_line;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_common::testkit;
use rpcmesh_wire::Status;

/// Idle connections opened at once.
const IDLE: usize = 500;
/// The most an idle connection may cost the provider: its buffers, not a zlib state (which
/// took 342 KiB each when it was made on accept).
const MAX_KIB_PER_IDLE_CONNECTION: u64 = 64;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// Kills the provider however the test ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn idle_connections_hold_no_compression_state() {
    let child = Command::new(testkit::bin_path("provider"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--threads",
            "1",
        ])
        .args(["--compress", "on", "--max-connections", "4096"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut child = Killed(child);
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let (addr, _) = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| parse_listening_line(&l))
        .expect("the listening line");
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
    let before = rss_kib(child.0.id());
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
    let after = rss_kib(child.0.id());
    let each = after.saturating_sub(before) / IDLE as u64;
    assert!(
        each <= MAX_KIB_PER_IDLE_CONNECTION,
        "{IDLE} idle connections took {before} → {after} KiB ({each} KiB each)"
    );
    drop(idle);
}
