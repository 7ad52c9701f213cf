//! The hostile-client suite (issue 14) against the broker and the provider as real
//! processes on 127.0.0.1: sockets that hold a connection without using it, partial frames.
//! Facts come from the programs' own `/metrics` and from what the sockets see; the only
//! times here are the timeouts under test (set short by flag), never an assertion on how
//! long something took.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_common::testkit::{self, Spawned};
use rpcmesh_wire::Status;

/// Hostile sockets of each kind (idle, partial frame); together they fill the cap.
const EACH: usize = 12;
/// How long a hostile socket waits for the server to close it before the test fails (a
/// hang detector, far beyond the timeouts set below).
const CLOSE_WAIT: Duration = Duration::from_secs(20);

/// The connection cap, the idle timeout and the frame timeout of the server under test.
const CAP_FLAGS: [&str; 6] = [
    "--max-connections",
    "24",
    "--idle-timeout",
    "3s",
    "--frame-timeout",
    "1500ms",
];

fn inbound(reason: &str) -> [(&'static str, &str); 2] {
    [("side", "inbound"), ("reason", reason)]
}

/// One echo call on a fresh connection; true when it succeeded.
async fn call_succeeds(to: std::net::SocketAddr) -> bool {
    let Ok(c) = Client::connect(to, ClientConfig::default()).await else {
        return false;
    };
    matches!(
        testkit::echo_call(&c, "let me in").await,
        Ok(Ok(r)) if r.status == Status::Success
    )
}

/// Fills the cap of `server` with idle sockets and sockets that sent half a header, and
/// shows that a newcomer is refused while they hold it, then served once the timeouts
/// have closed them, each counted by its reason.
async fn the_cap_is_not_held_by_idle_or_partial_sockets(server: &Spawned) {
    let header_part = &testkit::echo_request(1, "never finished")[..10];
    let idle: Vec<TcpStream> = (0..EACH)
        .map(|_| TcpStream::connect(server.rpc).unwrap())
        .collect();
    let partial: Vec<TcpStream> = (0..EACH)
        .map(|_| {
            let mut s = TcpStream::connect(server.rpc).unwrap();
            s.write_all(header_part).unwrap();
            s
        })
        .collect();
    testkit::wait_until("the hostile sockets are accepted", || {
        server.metric("rpcmesh_connections_open", &[("side", "inbound")]) == (2 * EACH) as f64
    })
    .await;
    // The cap is full: a newcomer is accepted and closed at once.
    let mut newcomer = TcpStream::connect(server.rpc).unwrap();
    newcomer.set_read_timeout(Some(CLOSE_WAIT)).unwrap();
    assert!(
        matches!(newcomer.read(&mut [0; 1]), Ok(0) | Err(_)),
        "a newcomer is refused while the cap is held"
    );
    // Once the timeouts pass, it gets in.
    testkit::wait_for("a newcomer's call succeeds", || async {
        call_succeeds(server.rpc).await.then_some(())
    })
    .await;
    for mut s in idle.into_iter().chain(partial) {
        s.set_read_timeout(Some(CLOSE_WAIT)).unwrap();
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(_) => assert!(rest.is_empty(), "a hostile socket got no answer"),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
    }
    let m = server.scrape();
    let closed = |reason| {
        rpcmesh_common::metrics::recorder::sample(
            &m,
            "rpcmesh_connections_closed_total",
            &inbound(reason),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(closed("idle_timeout"), EACH as f64, "{m}");
    assert_eq!(closed("frame_timeout"), EACH as f64, "{m}");
    assert!(
        server.metric("rpcmesh_connections_refused_total", &[("side", "inbound")]) >= 1.0,
        "the newcomer was counted as refused"
    );
}

#[tokio::test]
async fn idle_and_partial_sockets_cannot_lock_a_provider() {
    let mut args = vec!["--threads", "1"];
    args.extend(CAP_FLAGS);
    let provider = Spawned::start("provider", &args);
    the_cap_is_not_held_by_idle_or_partial_sockets(&provider).await;
}

#[tokio::test]
async fn idle_and_partial_sockets_cannot_lock_a_broker() {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    let mut args = vec!["--threads", "1", "--upstream", &upstream];
    args.extend(CAP_FLAGS);
    let broker = Spawned::start("broker", &args);
    the_cap_is_not_held_by_idle_or_partial_sockets(&broker).await;
}
