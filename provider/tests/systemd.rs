//! The provider as systemd runs it: a unit of `Type=notify` with `WatchdogSec=` gives it
//! `NOTIFY_SOCKET` and `WATCHDOG_USEC`; it must say `READY=1` once it listens, ping the
//! watchdog while it runs and say `STOPPING=1` when SIGTERM starts its drain. And it says
//! which build it is: `--version` and `rpcmesh_build_info` name the commit.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rpcmesh_common::build;
use rpcmesh_testkit::{Launch, NotifySocket, Signal, Spawned, bin_path};

/// The watchdog period the test gives: short, so that pings come at once (every half of
/// it); nothing here waits for one to be missed.
const WATCHDOG_USEC: &str = "200000";

#[test]
fn the_provider_tells_systemd_it_is_ready_alive_and_stopping() {
    let notify = NotifySocket::bind();
    let p = Spawned::start_with(
        "provider",
        &["--threads", "1"],
        Launch {
            env: &[
                ("NOTIFY_SOCKET", notify.path()),
                ("WATCHDOG_USEC", WATCHDOG_USEC),
            ],
            ..Launch::default()
        },
    );
    let (ready, _) = notify.wait_for_line("READY=1");
    assert!(
        ready.contains(&format!("STATUS=rpcmesh provider listening rpc={}", p.rpc)),
        "{ready}"
    );
    // Two pings: the task keeps pinging, it did not send one and stop.
    notify.wait_for_line("WATCHDOG=1");
    notify.wait_for_line("WATCHDOG=1");
    p.child.signal(Signal::TERM);
    notify.wait_for_line("STOPPING=1");
}

#[test]
fn the_provider_names_its_build() {
    let out = std::process::Command::new(bin_path("provider"))
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim(), format!("provider {}", build::VERSION_LINE));
    assert!(text.contains(build::COMMIT), "{text}");

    let p = Spawned::start("provider", &["--threads", "1"]);
    let labels = [
        ("role", "provider"),
        ("version", build::VERSION),
        ("commit", build::COMMIT),
    ];
    rpcmesh_testkit::wait_until_blocking("rpcmesh_build_info exported", || {
        p.metric("rpcmesh_build_info", &labels) == 1.0
    });
}
