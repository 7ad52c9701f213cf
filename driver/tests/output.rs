//! The driver's own output never fails or blocks its run: with its stdout a pipe whose
//! reader has gone (`driver … | head` once `head` has exited) and its stderr a full pipe
//! nobody reads, a run with live progress lines ends, writes its JSON report and exits 0.
//! (What the servers do with a dead stderr is `broker/tests/stderr.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;

use rpcmesh_testkit::{ChildGuard, Spawned, WAIT_TIMEOUT, closed_pipe, full_pipe};

#[test]
fn a_run_whose_stdout_is_closed_and_stderr_full_ends_and_writes_its_json() {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let dir = std::env::temp_dir().join(format!("rpcmesh-output-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    let (_stderr_read, stderr) = full_pipe();
    // Long enough for progress lines (one a second) to be due on the full stderr.
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(["--target", &provider.rpc.to_string(), "--workload", "echo"])
        .args(["--fanout", "1", "--concurrency", "4", "--duration", "2s"])
        .args([
            "--warmup",
            "0s",
            "--progress",
            "plain",
            "--metrics-listen",
            "off",
        ])
        .arg("--json")
        .arg(&json)
        .stdout(Stdio::from(closed_pipe()))
        .stderr(Stdio::from(stderr))
        .spawn()
        .unwrap();
    let status = ChildGuard(Some(child))
        .wait_timeout(WAIT_TIMEOUT)
        .expect("the driver ends its run (it hung on its output)");
    assert!(status.success(), "driver: {status}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(report["calls"]["ok"].as_u64().unwrap() > 0, "{report}");
    let _ = std::fs::remove_dir_all(&dir);
}
