//! The systemd units of `deploy/systemd/` (issue 12): `systemd-analyze verify` finds no
//! problem in any of them (run on copies whose `ExecStart` points at the built binary and
//! whose `EnvironmentFile` is the example beside them), each stop timeout leaves room for
//! the whole drain, every setting of the example environment files is one the program
//! reads, and `systemd-analyze security --offline=yes` scores the programs' units 2.0 or
//! below and the RPS unit 3.0 or below (0 = locked down, 10 = exposed).
//!
//! Needs `systemd-analyze` (Debian package `systemd`; `scripts/deps` installs it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rpcmesh_system_tests as system;
use rpcmesh_testkit as testkit;

const PROGRAMS: [&str; 3] = ["provider", "broker", "driver"];

fn deploy_dir() -> PathBuf {
    testkit::workspace_root().join("deploy/systemd")
}

fn need_systemd_analyze() {
    let found = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "systemd-analyze is not installed: run scripts/deps (Debian package systemd)"
    );
}

/// The value of `key=` in a unit file.
fn unit_value(unit: &str, key: &str) -> String {
    unit.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("{key}= is missing"))
        .trim()
        .to_string()
}

#[test]
fn systemd_analyze_verify_finds_nothing_in_the_units() {
    need_systemd_analyze();
    let dir = std::env::temp_dir().join(format!("rpcmesh-units-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in PROGRAMS {
        let unit_name = format!("rpcmesh-{name}.service");
        let unit = std::fs::read_to_string(deploy_dir().join(&unit_name)).unwrap();
        assert_eq!(
            unit_value(&unit, "ExecStart"),
            format!("/usr/local/bin/{name}")
        );
        assert_eq!(
            unit_value(&unit, "EnvironmentFile"),
            format!("/etc/rpcmesh/{name}.env")
        );
        let local = unit
            .replace(
                &format!("/usr/local/bin/{name}"),
                &testkit::bin_path(name).display().to_string(),
            )
            .replace(
                &format!("/etc/rpcmesh/{name}.env"),
                &deploy_dir()
                    .join(format!("{name}.env"))
                    .display()
                    .to_string(),
            );
        let path = dir.join(&unit_name);
        std::fs::write(&path, local).unwrap();
        system::systemd_analyze_verify(&path);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Most exposure `systemd-analyze security` may give a program's unit: the three run as
/// an unprivileged user with no capability and no writable file system (1.3 as written).
const MAX_PROGRAM_EXPOSURE: f64 = 2.0;
/// Most exposure of rpcmesh-rps.service: it runs as root with CAP_NET_ADMIN and a
/// writable /sys, which it exists to write (1.5 as written).
const MAX_RPS_EXPOSURE: f64 = 3.0;

/// The overall exposure `systemd-analyze security --offline=yes` gives a unit file.
fn exposure(unit: &Path) -> f64 {
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(unit)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.split_once("Overall exposure level for "))
        .and_then(|(_, rest)| rest.split_once(": "))
        .and_then(|(_, score)| score.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no overall exposure for {}: {text}", unit.display()))
}

#[test]
fn the_units_are_locked_down() {
    need_systemd_analyze();
    let rps =
        testkit::workspace_root().join("deploy/ansible/roles/tuning/files/rpcmesh-rps.service");
    let mut scores = Vec::new();
    for name in PROGRAMS {
        let unit = deploy_dir().join(format!("rpcmesh-{name}.service"));
        scores.push((unit, MAX_PROGRAM_EXPOSURE));
    }
    scores.push((rps, MAX_RPS_EXPOSURE));
    for (unit, most) in scores {
        let got = exposure(&unit);
        assert!(
            got <= most,
            "{}: exposure {got} is above {most}",
            unit.display()
        );
    }
}

/// The servers' units are of `Type=notify` (READY=1 once they serve) with a watchdog the
/// programs ping; the driver, a load run, is `Type=exec`.
#[test]
fn the_servers_tell_systemd_they_are_ready_and_alive() {
    for name in ["provider", "broker"] {
        let unit =
            std::fs::read_to_string(deploy_dir().join(format!("rpcmesh-{name}.service"))).unwrap();
        assert_eq!(unit_value(&unit, "Type"), "notify", "{name}");
        let watchdog =
            rpcmesh_common::cli::values::parse_duration(&unit_value(&unit, "WatchdogSec")).unwrap();
        assert!(watchdog > Duration::ZERO, "{name}");
        assert!(
            unit_value(&unit, "RestrictAddressFamilies").contains("AF_UNIX"),
            "{name}: the notifications go over a Unix socket"
        );
    }
}

#[test]
fn the_stop_timeouts_leave_room_for_the_grace_period_and_the_last_answers() {
    let drain = |grace: Duration| grace + rpcmesh_common::net::listener::LAST_ANSWERS_WAIT;
    for (name, grace) in [
        ("provider", rpcmesh_provider::config::DEFAULT_GRACE),
        ("broker", rpcmesh_broker::config::DEFAULT_GRACE),
    ] {
        let unit =
            std::fs::read_to_string(deploy_dir().join(format!("rpcmesh-{name}.service"))).unwrap();
        let stop =
            rpcmesh_common::cli::values::parse_duration(&unit_value(&unit, "TimeoutStopSec"))
                .unwrap();
        assert!(
            stop > drain(grace),
            "{name}: TimeoutStopSec {stop:?} is not above the drain ({:?})",
            drain(grace)
        );
    }
}

/// The `RPCMESH_...` variables a program reads, from its `--help`.
fn env_vars(program: &Path) -> Vec<String> {
    let help = Command::new(program).arg("--help").output().unwrap();
    String::from_utf8_lossy(&help.stdout)
        .split("[env: ")
        .skip(1)
        .filter_map(|s| s.split(['=', ']']).next().map(str::to_string))
        .collect()
}

#[test]
fn every_setting_of_the_example_environment_files_is_read_by_its_program() {
    for name in PROGRAMS {
        let known = env_vars(&testkit::bin_path(name));
        let env = std::fs::read_to_string(deploy_dir().join(format!("{name}.env"))).unwrap();
        for line in env.lines() {
            let line = line.trim_start_matches("# ").trim();
            let Some((key, _)) = line.split_once('=') else {
                continue;
            };
            if key.starts_with("RPCMESH_") {
                assert!(
                    known.iter().any(|k| k == key),
                    "{name}.env sets {key}, which `{name} --help` does not list"
                );
            }
        }
    }
}
