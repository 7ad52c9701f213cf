//! The deployment test: `deploy/rehearse`, the whole rehearsal of deploy/REHEARSAL.md,
//! end to end. Eight Debian machines booted with systemd-nspawn in network namespaces,
//! the Ansible playbooks run over SSH from a controller namespace (mutual TLS on every
//! hop), the units and the Prometheus targets (every node_exporter's too) checked, the
//! firewall keeping a driver away from a provider, drivers with no certificate, in
//! plaintext or with an identity the policy does not name getting no call through, both
//! drivers against both brokers with their HDR logs merged, a third provider joined
//! through the providers file, every certificate rotated under load, the rolling restart
//! under load, a rollout that fails after its copy and the run after it, a lost restart
//! caught, a broken build rolled back automatically, all with zero failed calls, a
//! provider failing its calls firing an alert that reaches a webhook and then resolves,
//! `--check --diff` clean on every host, and a frozen provider restarted by systemd's
//! watchdog; then everything removed.
//!
//! It needs root, systemd-nspawn, debootstrap and ansible-core in the rehearsal's venv
//! (`scripts/deps` installs them: `deploy/rehearse --install`); it fails, saying so, when
//! one is missing, and never skips. It builds the Debian base once (about 100 s) when
//! /var/lib/rpcmesh-lab/ has none.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsStr;
use std::path::Path;
use std::time::Duration;

use rpcmesh_system_tests as system;
use rpcmesh_testkit as testkit;

/// The rehearsal's Ansible is CPU-bound, so its minutes are those of the cores it gets:
/// with the tests' debug build, 15 to 22 minutes on the 2-core development host while other
/// builds took half of its cores (two more with the base image to build). This only
/// catches a hang (every wait of the rehearsal is bounded on its own).
const REHEARSAL_TIMEOUT: Duration = Duration::from_secs(45 * 60);

/// Requests/s each driver offers in the fleet run, and during the changes (the join, the
/// restarts, the rollouts): a quarter and an eighth of the rehearsal's defaults (1,000 and
/// 250), because the test deploys its own debug build, which spends about nine times the
/// release build's CPU per call; at the defaults the debug programs starved Ansible of the
/// 2 cores (the join took 340 s instead of 147 s, the whole rehearsal 588 s instead of
/// 343 s). The change run lasts the whole of the changes (minutes of Ansible, which is
/// CPU-bound: each module run costs a quarter of a second of a core on its host): at 60
/// requests/s its drivers, brokers and providers took about 0.65 of the 2 cores
/// throughout (a driver 0.13); at 30 about half that, and still 300 calls/s through every
/// drain. What is checked does not depend on the rate: every deployment step, and
/// zero failed calls through every change.
const FLEET_RATE: &str = "250";
const CHANGE_RATE: &str = "30";

/// The steps the report must have, each ok, in this order.
const STEPS: [&str; 20] = [
    "build",
    "image",
    "network",
    "boot",
    "lint",
    "deploy",
    "units active",
    "firewall and mTLS",
    "fleet run",
    "join a provider",
    "rotate certificates",
    "rolling restart",
    "lost restart",
    "rollback",
    "changes under load",
    "alert fires",
    "check mode",
    "alert resolves",
    "watchdog",
    "teardown",
];

#[test]
fn rehearsal_deploys_changes_and_rolls_back_the_fleet_with_zero_failed_calls() {
    let bins = system::program_dir();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("rehearsal");
    let run = system::run_repo_command(
        "deploy/rehearse",
        &[
            OsStr::new("--bin-dir"),
            bins.as_os_str(),
            OsStr::new("--rate"),
            OsStr::new(FLEET_RATE),
            OsStr::new("--change-rate"),
            OsStr::new(CHANGE_RATE),
            OsStr::new("--out"),
            out.as_os_str(),
        ],
        REHEARSAL_TIMEOUT,
    );
    let output = &run.output;
    assert!(
        run.status.success(),
        "deploy/rehearse failed ({})\n{output}",
        run.status
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["ok"], true, "{report:#}\n{output}");
    let steps: Vec<(&str, bool)> = report["steps"]
        .as_array()
        .expect("a list of steps")
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["ok"] == true))
        .collect();
    assert_eq!(
        steps,
        STEPS.iter().map(|s| (*s, true)).collect::<Vec<_>>(),
        "{output}"
    );

    let f = &report["figures"];
    // Both drivers' logs, merged.
    assert_eq!(f["fleet"]["drivers"], 2, "{f:#}");
    assert!(f["fleet"]["calls"].as_u64().unwrap() > 0, "{f:#}");
    assert!(f["fleet"]["p99_ms"].as_f64().unwrap() > 0.0, "{f:#}");
    assert_eq!(f["fleet"]["failed_calls"], 0, "{f:#}");
    // Every program's metrics scraped by the monitoring host: 2 providers, 2 brokers and
    // 2 drivers, and every machine's node_exporter (7); then the third provider and its
    // machine's node_exporter after the join. Each node_exporter counts softirqs.
    assert_eq!(f["prometheus_targets_up"]["fleet_run"], 6 + 7, "{f:#}");
    assert_eq!(f["prometheus_targets_up"]["after_join"], 7 + 8, "{f:#}");
    assert_eq!(f["node_exporter_softirq_hosts"], 7, "{f:#}");
    // The third provider took calls once the providers file named it.
    assert!(
        f["joined_provider"]["calls_answered"].as_u64().unwrap() >= 100,
        "{f:#}"
    );
    // The firewall: a driver reaches the brokers, never a provider.
    let firewall = &f["firewall"];
    assert_eq!(firewall["rpcm-drv1->rpcm-prv1:7800"], "dropped", "{f:#}");
    assert_eq!(firewall["rpcm-drv1->rpcm-brk1:7700"], "open", "{f:#}");
    // Mutual TLS on every hop: a driver with no certificate, and one in plaintext, is
    // refused at the handshake, counted by reason; an identity the policy does not name
    // gets "permission denied" on every call, each counted by the broker.
    let refused = &f["mtls_refusals"];
    assert!(
        refused["refused_no_certificate"].as_u64().unwrap() >= 1,
        "{f:#}"
    );
    assert!(refused["refused_not_tls"].as_u64().unwrap() >= 1, "{f:#}");
    let denied = refused["denied_calls"].as_u64().unwrap();
    assert!(denied > 0, "{f:#}");
    assert_eq!(refused["denied_counted"].as_u64(), Some(denied), "{f:#}");
    assert!(
        refused["denied_said"]
            .as_str()
            .unwrap()
            .starts_with("permission denied: spiffe://rpcmesh.internal/tester/"),
        "{f:#}"
    );
    // Every certificate renewed under load and read by the 3 providers and 2 brokers
    // without a restart (the change run's zero failed calls covers it, below).
    assert_eq!(
        f["rotation"]["servers_reloaded_without_restart"], 5,
        "{f:#}"
    );
    // The broken build was put back on the first provider, the others never touched.
    assert_eq!(f["rollback"]["host"], "rpcm-prv1", "{f:#}");
    assert_eq!(f["rollback"]["others_untouched"], 2, "{f:#}");
    // The join, the rotation, the rolling restart, the lost restart and the rollback
    // under load: not one call failed.
    let during = &f["during_changes"];
    assert!(during["calls"].as_u64().unwrap() > 0, "{f:#}");
    assert_eq!(during["failed_calls"], 0, "{f:#}");
    // A provider failing its calls (some of the fault's run's calls failed before the
    // brokers ejected it): RpcmeshProviderEjected reached the webhook receiver on the
    // monitoring machine, firing; once the provider was put right and called again, it
    // reached it resolved, and no call of that run failed.
    let alert = &f["alert"];
    assert_eq!(alert["alert"], "RpcmeshProviderEjected", "{f:#}");
    assert!(!alert["brokers"].as_array().unwrap().is_empty(), "{f:#}");
    assert!(alert["fault_run_failed"].as_u64().unwrap() > 0, "{f:#}");
    assert!(alert["resolved_after_calls_s"].as_f64().is_some(), "{f:#}");
    assert!(alert["probe_run_calls"].as_u64().unwrap() > 0, "{f:#}");
    assert_eq!(alert["probe_run_failed"], 0, "{f:#}");
    // Check mode on the converged fleet: nothing would change anywhere.
    let check = f["check_mode_changed"].as_object().expect("hosts");
    assert_eq!(check.len(), 8, "{f:#}");
    assert!(check.values().all(|n| n == 0), "{f:#}");

    // Nothing is left behind: no namespace of the rehearsal, no machine state.
    let left = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(
        !left.lines().any(|l| l.starts_with("rpcm-")),
        "namespaces left: {left}"
    );
    assert!(
        !Path::new("/run/rpcm-rehearsal").exists(),
        "the run's files were left in /run/rpcm-rehearsal"
    );
}

/// The lock of the rehearsal's base image (deploy/rehearsal/image.py's `IMAGE_LOCK`).
const IMAGE_LOCK: &str = "/var/lib/rpcmesh-lab/image.lock";
/// What `deploy/rehearse --image` says when it finds the lock held (image.py's
/// `IMAGE_LOCK_WAITING`).
const IMAGE_LOCK_WAITING: &str = "waiting for the image lock, held by another image build";

/// `deploy/rehearse --image` (which scripts/test starts beside the compile) waits while
/// another holds the image lock, here a `flock` of util-linux, and ends, having found or
/// built the base, only after that holder is gone: a background build and a rehearsal
/// never build the base at the same time, and the rehearsal uses the background's.
#[test]
fn image_preparation_waits_for_whoever_holds_the_image_lock() {
    use std::process::{Command, Stdio};
    let lock = Path::new(IMAGE_LOCK);
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let flock = system::need_tool("flock", "util-linux");
    // `cat` holds the lock (inherited from flock) until its stdin closes.
    let mut holder = testkit::ChildGuard(Some(
        Command::new(&flock)
            .arg(lock)
            .arg("cat")
            .stdin(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let held = || {
        !Command::new(&flock)
            .args(["-n", IMAGE_LOCK, "true"])
            .status()
            .unwrap()
            .success()
    };
    testkit::wait_until_blocking("the holder to take the lock", held);

    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("rehearse-image");
    let mut child = Command::new(testkit::workspace_root().join("deploy/rehearse"))
        .args([OsStr::new("--image"), OsStr::new("--out"), out.as_os_str()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its stderr, line by line, read by a thread (nothing blocks on a full pipe).
    let (said_tx, said_rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = said_tx.send(line);
        }
    });
    let mut waiter = testkit::ChildGuard(Some(child));
    // It has found the lock held and waits: it says so once (deploy/rehearsal/image.py's
    // IMAGE_LOCK_WAITING), before its first pause.
    let mut stderr_lines = Vec::new();
    let waiting = loop {
        match said_rx.recv_timeout(testkit::WAIT_TIMEOUT) {
            Ok(line) if line.contains(IMAGE_LOCK_WAITING) => break true,
            Ok(line) => stderr_lines.push(line),
            Err(_) => break false,
        }
    };
    assert!(
        waiting,
        "rehearse --image did not say it waits for the lock: {stderr_lines:?}"
    );
    assert!(
        waiter.0.as_mut().unwrap().try_wait().unwrap().is_none(),
        "rehearse --image ended while another held the image lock"
    );
    assert!(held(), "the holder still holds the lock");

    let mut h = holder.0.take().unwrap();
    drop(h.stdin.take());
    assert!(h.wait().unwrap().success(), "the holder let go");
    let done = waiter.0.take().unwrap().wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "rehearse --image failed: {said}");
    assert!(
        said.contains("rehearse --image: /var/lib/rpcmesh-lab/"),
        "it names the base: {said}"
    );
}
