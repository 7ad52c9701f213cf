#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The yardsticks `examples/floor.rs` and `examples/floor_epoll.rs` answer every call with
//! its own reply. They are what the broker's cost per call is set against
//! (docs/performance.md, "What limits them"): a floor that lost calls, or gave one call
//! another's reply, would measure less work than forwarding is. Nor may one keep a
//! connection its caller closed.

use std::io::Write;

use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::{Signal, Spawned, echo_calls, wait_until};
use rpcmesh_wire::Status;
use rpcmesh_wire::proto::rpc::EchoResponse;

/// Calls in flight on each client connection at once: several per read, both ways.
const CALLS_PER_CLIENT: usize = 64;
/// Client connections: more than the provider connections of the spread floor, so that
/// connections share one.
const CLIENTS: usize = 4;

#[tokio::test]
async fn each_floor_answers_every_call_with_its_own_reply() {
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    let floors: [(&str, &[&str]); 3] = [
        ("floor", &[]),
        ("floor_epoll", &[]),
        // Calls spread over three provider connections, the loop spinning between reads.
        ("floor_epoll", &["--pool-size", "3", "--busy-poll", "50us"]),
    ];
    for (name, extra) in floors {
        let mut args = vec!["--upstream", upstream.as_str()];
        args.extend_from_slice(extra);
        let floor = Spawned::start_example("rpcmesh-broker", name, &args);
        let mut clients = Vec::new();
        for _ in 0..CLIENTS {
            let c = Client::connect(floor.rpc, ClientConfig::default())
                .await
                .unwrap_or_else(|e| panic!("{name} {extra:?} takes a connection: {e}"));
            clients.push(c);
        }
        // All calls of every connection in flight at once; call i carries "m{i}".
        let calls: Vec<_> = clients
            .iter()
            .map(|c| echo_calls(c, CALLS_PER_CLIENT))
            .collect();
        for handles in calls {
            for (i, h) in handles.into_iter().enumerate() {
                let r = h.await.expect("call task").unwrap_or_else(|e| {
                    panic!("{name} {extra:?}: call {i} failed: {e}");
                });
                assert_eq!(r.status, Status::Success, "{name} {extra:?}: call {i}");
                let echoed = r.decode::<EchoResponse>().expect("an echo reply").message;
                assert_eq!(echoed, format!("m{i}"), "{name} {extra:?}: call {i}");
            }
        }
    }
}

/// Open sockets of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test]
async fn the_epoll_floor_closes_a_connection_whose_last_bytes_came_with_its_end() {
    // Stopped while a client writes part of a frame and closes, the floor finds the bytes
    // and the end of stream already there when it next reads: one edge for both. A read that
    // took the bytes and stopped there, as a read that does not fill the buffer may, would
    // never see the end, and the connection would stay open for good.
    let provider = Spawned::start("provider", &["--threads", "1"]);
    let upstream = provider.rpc.to_string();
    let floor = Spawned::start_example("rpcmesh-broker", "floor_epoll", &["--upstream", &upstream]);
    let before = open_fds(floor.pid());
    floor.child.signal(Signal::STOP);
    {
        let mut c = std::net::TcpStream::connect(floor.rpc).unwrap();
        c.write_all(b"RPCF\x01\x00").unwrap();
    }
    floor.child.signal(Signal::CONT);
    // A call through a second connection, taken after the first: once it is answered, the
    // floor has taken the first one and looked at what it had.
    let second = Client::connect(floor.rpc, ClientConfig::default())
        .await
        .unwrap();
    let r = echo_calls(&second, 1).remove(0).await.unwrap().unwrap();
    assert_eq!(r.status, Status::Success);
    wait_until(
        "the floor to close the connection its caller closed",
        || open_fds(floor.pid()) == before + 1,
    )
    .await;
}
