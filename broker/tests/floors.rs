#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The yardsticks `examples/floor.rs` and `examples/floor_epoll.rs` answer every call with
//! its own reply. They are what the broker's cost per call is set against
//! (docs/performance.md, "What limits them"): a floor that lost calls, or gave one call
//! another's reply, would measure less work than forwarding is.

use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_testkit::{Spawned, echo_calls};
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
