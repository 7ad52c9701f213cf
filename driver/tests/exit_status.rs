//! The driver's command as a script meets it: the exit status says whether the figures
//! are those asked for (requests due but not sent: 3, unless `--allow-unsent`; SIGINT: 130,
//! with a report that says it was interrupted), and the progress line shows what was not
//! sent while it happens.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_driver::{Ending, Report};
use rpcmesh_provider::service::ServiceTime;
use rpcmesh_provider::{ProviderConfig, Registry};
use rpcmesh_testkit::{ChildGuard, InProcess, Signal};

/// A provider whose every call takes `service` to answer.
async fn provider(service: Duration) -> InProcess<ServeSummary> {
    let config = ProviderConfig {
        service_time: ServiceTime::Fixed(service),
        ..ProviderConfig::default()
    };
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(config, Registry::builtin(), telemetry, listener, stop)
    })
    .await
}

/// A folder of this test process's own.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rpcmesh-exit-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The driver's command with `args`, its report written to `json`.
fn driver(target: &str, json: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_driver"));
    c.args(["--target", target, "--workload", "echo", "--fanout", "1"])
        .args(["--metrics-listen", "off", "--progress", "plain", "--json"])
        .arg(json)
        .args(args);
    c
}

fn read_report(json: &Path) -> Report {
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_not_sent_show_while_running_in_the_headline_and_in_the_exit_status() {
    // One slot, each request holding it 20 ms, a request due every millisecond and room
    // for one to wait: most requests due cannot be sent.
    let p = provider(Duration::from_millis(20)).await;
    let dir = scratch("unsent");
    let (target, json) = (p.addr.to_string(), dir.join("r.json"));
    let open_loop = [
        "--rate",
        "1000",
        "--concurrency",
        "1",
        "--connections",
        "1",
        "--backlog",
        "1",
        "--warmup",
        "0s",
    ];
    let (t, j) = (target.clone(), json.clone());
    let out = tokio::task::spawn_blocking(move || {
        driver(&t, &j, &open_loop)
            .args(["--duration", "1500ms"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    let r = read_report(&json);
    assert!(r.requests.not_sent > r.requests.completed, "{r:#?}");
    let headline = stdout.lines().nth(2).unwrap_or_default();
    assert!(
        headline.contains("NOT SENT:") && headline.contains("raise --concurrency"),
        "the third line of\n{stdout}"
    );
    let live = stderr.lines().find(|l| l.contains("measuring]")).unwrap();
    let n: u64 = live
        .split("not sent ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no count of requests not sent in {live:?}"));
    assert!(n > 0, "{live}");
    assert!(stderr.contains("--allow-unsent"), "{stderr}");

    // Asked for: the same run exits 0.
    let (t, j) = (target.clone(), json.clone());
    let out = tokio::task::spawn_blocking(move || {
        driver(&t, &j, &open_loop)
            .args(["--duration", "300ms", "--allow-unsent"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(read_report(&json).requests.not_sent > 0);
    let _ = std::fs::remove_dir_all(&dir);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_ends_the_run_with_a_report_that_says_it_was_interrupted() {
    let p = provider(Duration::ZERO).await;
    let dir = scratch("sigint");
    let (target, json) = (p.addr.to_string(), dir.join("r.json"));
    let j = json.clone();
    let out = tokio::task::spawn_blocking(move || {
        let child = driver(&target, &j, &["--duration", "60s", "--warmup", "0s"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut child = ChildGuard(Some(child));
        // Measuring: the first progress line of the measured window has been printed.
        let stderr = child.0.as_mut().and_then(|c| c.stderr.take()).unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let mut seen = String::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            seen += &line;
            seen.push('\n');
            if line.contains("measuring]") {
                break;
            }
        }
        assert!(seen.contains("measuring]"), "{seen}");
        child.signal(Signal::INT);
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let out = child.0.take().unwrap().wait_with_output().unwrap();
        (out, seen + &rest.join("\n"))
    })
    .await
    .unwrap();
    let (out, stderr) = out;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(130), "{stdout}\n{stderr}");
    assert!(stdout.contains("interrupted after"), "{stdout}");
    let r = read_report(&json);
    assert_eq!(r.ended, Ending::Interrupted);
    assert!(r.measured_seconds < 60.0 && r.calls.ok > 0, "{r:#?}");
    let _ = std::fs::remove_dir_all(&dir);
    p.stop().await;
}
