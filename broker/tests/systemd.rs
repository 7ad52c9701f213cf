//! The broker as systemd runs it (`Type=notify`): `READY=1` only once the pools to its
//! providers have settled, not when its port is bound, so that "active" means calls are
//! routed; and it names its build (`--version`, `rpcmesh_build_info`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::net::TcpListener;

use rpcmesh_common::build;
use rpcmesh_testkit::{Launch, NotifySocket, Spawned, bin_path, wait_until_blocking};

/// On both engines.
#[test]
fn the_broker_is_ready_only_once_its_pools_have_settled() {
    for engine in ["tokio", "loop"] {
        ready_once_settled(engine);
    }
}

fn ready_once_settled(engine: &str) {
    // A provider that accepts and reads, but answers nothing until the test lets it go:
    // the broker's pool to it cannot settle before.
    let provider = TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = provider.local_addr().unwrap().to_string();
    let notify = NotifySocket::bind();
    let (accepted_tx, accepted) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let (mut conn, _) = provider.accept().unwrap();
        let mut first = [0u8; 1];
        // The pool wrote to it: its first heartbeat is under way.
        conn.read_exact(&mut first).unwrap();
        accepted_tx.send(()).unwrap();
        // Then the provider goes away (connections and listener closed): the heartbeat
        // fails, and the pool settles.
        let _ = released.recv();
    });
    let _broker = Spawned::start_with(
        "broker",
        &[
            "--engine",
            engine,
            "--upstream",
            &upstream,
            "--pool-size",
            "1",
            "--threads",
            "1",
            // Far beyond the test: only the provider's going away settles the pool.
            "--health-timeout",
            "10m",
            "--connect-timeout",
            "10m",
        ],
        Launch {
            env: &[("NOTIFY_SOCKET", notify.path())],
            ..Launch::default()
        },
    );
    accepted.recv().unwrap();
    // The broker listens (its listening line came before the pools were made) and its
    // pool is connecting: a READY=1 sent when listening would be in the socket already.
    let early = notify.received();
    assert!(
        early.iter().all(|m| !m.contains("READY=1")),
        "{engine}: READY=1 before the pools settled: {early:?}"
    );
    release.send(()).unwrap();
    holder.join().unwrap();
    let (ready, _) = notify.wait_for_line("READY=1");
    assert!(
        ready.contains("STATUS=routing to 1 providers"),
        "{engine}: {ready}"
    );
}

#[test]
fn the_broker_names_its_build() {
    let out = std::process::Command::new(bin_path("broker"))
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim(), format!("broker {}", build::VERSION_LINE));
    assert!(text.contains(build::COMMIT), "{text}");

    // A provider where nothing listens: the pool settles at its failed connect.
    let nobody = format!("127.0.0.1:{}", rpcmesh_testkit::free_port());
    let b = Spawned::start("broker", &["--upstream", &nobody, "--threads", "1"]);
    let labels = [
        ("role", "broker"),
        ("version", build::VERSION),
        ("commit", build::COMMIT),
    ];
    wait_until_blocking("rpcmesh_build_info exported", || {
        b.metric("rpcmesh_build_info", &labels) == 1.0
    });
}
