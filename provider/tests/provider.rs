//! Black-box tests of the provider over real TCP on 127.0.0.1: the built-in services,
//! v1 interop byte for byte, errors, compression, bad input, shedding and shutdown.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use bytes::BytesMut;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_provider::service::{Held, echo};
use rpcmesh_provider::{ProviderConfig, Registry};
use rpcmesh_testkit::{self as testkit, Gate, InProcess, wait_until};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Request;
use rpcmesh_wire::frame::Flags;
use rpcmesh_wire::proto::platform::{QueryResponse, reference_query};
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

type Running = InProcess<ServeSummary>;

async fn start(config: ProviderConfig) -> Running {
    start_with(config, Registry::builtin()).await
}

async fn start_with(config: ProviderConfig, registry: Registry) -> Running {
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(config, registry, telemetry, listener, stop)
    })
    .await
}

/// A provider whose `EchoService.Echo` calls wait at `gate` before they answer: a slow
/// service that finishes when the test says.
async fn start_held(config: ProviderConfig, gate: &Arc<Gate>) -> Running {
    let mut registry = Registry::builtin();
    let held = Held {
        inner: echo::echo,
        hold: gate.holder(),
    };
    registry.register(echo::SERVICE, echo::METHOD, held);
    start_with(config, registry).await
}

#[tokio::test]
async fn echo_answers_the_message() {
    let p = start(ProviderConfig::default()).await;
    let c = Client::connect(p.addr, ClientConfig::default())
        .await
        .unwrap();
    let r = c
        .call(
            "EchoService",
            "Echo",
            &EchoRequest {
                message: "hello".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(r.status, Status::Success);
    assert_eq!(r.decode::<EchoResponse>().unwrap().message, "hello");
    p.stop().await;
}

#[tokio::test]
async fn platform_query_returns_the_fixed_two_entry_list() {
    let p = start(ProviderConfig::default()).await;
    let c = Client::connect(p.addr, ClientConfig::default())
        .await
        .unwrap();
    let r = c
        .call("PlatformService", "doQuery", &reference_query())
        .await
        .unwrap();
    assert_eq!(r.status, Status::Success);
    let resp: QueryResponse = r.decode().unwrap();
    assert_eq!(resp.nodes.len(), 2);
    assert_eq!(resp.nodes[0], resp.nodes[1]);
    assert_eq!(resp.nodes[0].node_id, 100_001);
    assert_eq!(resp.nodes[0].node_name, "機構100001");
    p.stop().await;
}

/// A plain v1 client sending the reference's golden request gets the reference's golden
/// reply, byte for byte.
#[tokio::test]
async fn golden_v1_request_gets_the_golden_v1_reply() {
    let p = start(ProviderConfig::default()).await;
    let (got, want) = testkit::golden_exchange(p.addr, "echo_request_id1", "echo_response_ok_id1")
        .await
        .unwrap();
    assert_eq!(got, want);
    p.stop().await;
}

#[tokio::test]
async fn unknown_service_and_method_fail_with_a_message() {
    let p = start(ProviderConfig::default()).await;
    let c = Client::connect(p.addr, ClientConfig::plain_v1())
        .await
        .unwrap();
    let r = c
        .call("NoSuchService", "Echo", &EchoRequest::default())
        .await
        .unwrap();
    assert_eq!(r.status, Status::Failed);
    assert!(!r.success);
    assert_eq!(r.error_msg, "service not found: NoSuchService");
    let r = c
        .call("EchoService", "Shout", &EchoRequest::default())
        .await
        .unwrap();
    assert_eq!(r.status, Status::Failed);
    assert_eq!(r.error_msg, "method not found: EchoService.Shout");
    assert_eq!(p.errors("unknown_service"), 1.0);
    assert_eq!(p.errors("unknown_method"), 1.0);
    p.stop().await;
}

#[tokio::test]
async fn payload_that_does_not_decode_fails_with_a_message() {
    let p = start(ProviderConfig::default()).await;
    let c = Client::connect(p.addr, ClientConfig::plain_v1())
        .await
        .unwrap();
    // Field 1 of EchoRequest with wire type "fixed64": not a string.
    let r = c
        .call_raw(
            "EchoService",
            "Echo",
            bytes::Bytes::from_static(&[0x09, 1, 2, 3, 4, 5, 6, 7, 8]),
            Default::default(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, Status::Failed);
    assert!(r.error_msg.contains("does not decode"), "{}", r.error_msg);
    p.stop().await;
}

#[tokio::test]
async fn heartbeat_is_answered_with_the_same_id() {
    let p = start(ProviderConfig {
        node_id: "p1".into(),
        ..ProviderConfig::default()
    })
    .await;
    let c = Client::connect(p.addr, ClientConfig::default())
        .await
        .unwrap();
    let hb = c.heartbeat().await.unwrap();
    assert_eq!(hb.node_id, "p1");
    p.stop().await;
}

#[tokio::test]
async fn compressed_and_plain_calls_get_identical_answers() {
    let p = start(ProviderConfig::default()).await;
    let plain = Client::connect(p.addr, ClientConfig::default())
        .await
        .unwrap();
    let zipped = Client::connect(p.addr, ClientConfig::compressed(16))
        .await
        .unwrap();
    let a = plain
        .call("PlatformService", "doQuery", &reference_query())
        .await
        .unwrap();
    let b = zipped
        .call("PlatformService", "doQuery", &reference_query())
        .await
        .unwrap();
    assert!(!a.compressed);
    assert!(
        b.compressed,
        "the platform reply compresses when the caller accepts it"
    );
    assert_eq!(a.payload, b.payload);
    p.stop().await;
}

#[tokio::test]
async fn bad_or_oversized_compressed_payloads_fail_with_a_message() {
    let p = start(ProviderConfig {
        max_inflated: 1000,
        ..ProviderConfig::default()
    })
    .await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let mut b = BytesMut::new();
    Request {
        service: bytes::Bytes::from_static(b"EchoService"),
        method: bytes::Bytes::from_static(b"Echo"),
        payload: bytes::Bytes::from_static(b"this is not zlib"),
    }
    .put(&mut b, Flags::COMPRESSED, 1)
    .unwrap();
    let big = EchoRequest {
        message: "x".repeat(5000),
    };
    b.extend_from_slice(&testkit::compressed_request(
        2,
        Flags::NONE,
        "EchoService",
        "Echo",
        &big,
    ));
    s.write_all(&b).await.unwrap();
    let replies = replies_by_id(&mut s, 2).await;
    assert_eq!(replies[0].1.status, Status::Failed);
    assert!(
        replies[0]
            .1
            .rpc
            .error_msg
            .contains("not a valid zlib stream"),
        "{}",
        replies[0].1.rpc.error_msg
    );
    assert!(
        replies[1]
            .1
            .rpc
            .error_msg
            .contains("inflates past the limit of 1000"),
        "{}",
        replies[1].1.rpc.error_msg
    );
    assert_eq!(p.errors("inflate"), 2.0);
    p.stop().await;
}

#[tokio::test]
async fn bad_input_gets_an_error_reply_or_a_close_and_is_counted() {
    let max = 4096;
    let p = start(ProviderConfig {
        max_body_len: max,
        ..ProviderConfig::default()
    })
    .await;
    let good = Client::connect(p.addr, ClientConfig::default())
        .await
        .unwrap();
    for input in testkit::bad_inputs(max) {
        let before = p.errors(input.kind.label());
        let seen = testkit::probe(p.addr, &input).await.unwrap();
        assert_eq!(seen.closed, input.closes, "{}: {seen:?}", input.name);
        if let Some(id) = input.reply_to {
            let r = seen.frames.iter().find(|f| f.header.req_id == id);
            let r = r.unwrap_or_else(|| panic!("{}: no error reply", input.name));
            let r = Request::parse(&r.body).err();
            assert!(r.is_some(), "reply is a response, not a request");
        }
        if let Some(id) = input.then_answered {
            assert!(
                seen.frames.iter().any(|f| f.header.req_id == id),
                "{}: later frame not answered",
                input.name
            );
        }
        assert_eq!(
            p.errors(input.kind.label()),
            before + 1.0,
            "{} not counted",
            input.name
        );
        // The server keeps serving everybody else.
        let r = good
            .call(
                "EchoService",
                "Echo",
                &EchoRequest {
                    message: input.name.into(),
                },
            )
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success, "{}", input.name);
    }
    p.stop().await;
}

/// The call over the cap is shed while the one that fills it is still held by the
/// service: the answer never waits for a slot to free.
#[tokio::test]
async fn over_the_in_flight_cap_calls_are_shed_at_once() {
    let gate = Gate::new();
    let config = ProviderConfig {
        max_in_flight_per_conn: 1,
        ..ProviderConfig::default()
    };
    let p = start_held(config, &gate).await;
    let c = Client::connect(p.addr, ClientConfig::default())
        .await
        .unwrap();
    let slow = testkit::echo_call(&c, "slow");
    wait_until("the slow call to reach the service", || gate.arrived() == 1).await;
    let r = c
        .call("EchoService", "Echo", &EchoRequest::default())
        .await
        .unwrap();
    assert_eq!(r.status, Status::Overloaded);
    assert!(r.error_msg.starts_with("overloaded"), "{}", r.error_msg);
    assert!(
        !slow.is_finished(),
        "shed answers do not wait for the slow call, which the service still holds"
    );
    assert_eq!(gate.arrived(), 1, "the shed call never reached the service");
    gate.open();
    assert_eq!(slow.await.unwrap().unwrap().status, Status::Success);
    p.stop().await;
}

/// Calls held by the service when shutdown begins: the listener closes while they are
/// still in flight, and they are answered once the service lets them through.
#[tokio::test]
async fn shutdown_finishes_calls_in_flight_and_refuses_new_connections() {
    let gate = Gate::new();
    let p = start_held(ProviderConfig::default(), &gate).await;
    let addr = p.addr;
    let c = Client::connect(addr, ClientConfig::default())
        .await
        .unwrap();
    let calls = testkit::echo_calls(&c, 10);
    wait_until("all 10 calls to reach the service", || gate.arrived() == 10).await;
    let stopping = tokio::spawn(p.stop());
    // "Refused while draining": the calls are still held.
    testkit::wait_refused(addr).await;
    assert!(
        calls.iter().all(|h| !h.is_finished()),
        "the calls in flight are still waiting for the service"
    );
    gate.open();
    for (i, call) in calls.into_iter().enumerate() {
        let r = call.await.unwrap().unwrap();
        assert_eq!(r.status, Status::Success);
        assert_eq!(r.decode::<EchoResponse>().unwrap().message, format!("m{i}"));
    }
    let summary = stopping.await.unwrap();
    assert_eq!(summary.aborted, 0);
}

/// A reply over the frame limit is not sent (the caller would refuse it): the call is
/// answered "failed" with the reason.
#[tokio::test]
async fn a_reply_over_the_frame_limit_is_answered_failed() {
    let p = start(ProviderConfig {
        max_body_len: 4096,
        ..ProviderConfig::default()
    })
    .await;
    // A compressed request of 5,000 x's fits in the limit; its plain echo does not.
    let c = Client::connect(p.addr, ClientConfig::compressed(16))
        .await
        .unwrap();
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let big = EchoRequest {
        message: "x".repeat(5000),
    };
    // compressed, but the caller does not take compressed replies
    let b = testkit::compressed_request(1, Flags::EXT_STATUS, "EchoService", "Echo", &big);
    s.write_all(&b).await.unwrap();
    let f = testkit::read_frames(&mut s, &mut BytesMut::new(), 1)
        .await
        .unwrap()
        .remove(0);
    let mut codec = rpcmesh_wire::envelope::CallCodec::new(None, 1 << 20);
    let r = codec.decode_response(&f).unwrap();
    assert_eq!(r.status, Status::Failed);
    assert!(
        r.rpc.error_msg.contains("exceeds the frame limit of 4096"),
        "{}",
        r.rpc.error_msg
    );
    assert_eq!(p.errors("too_large"), 1.0);
    // The same call with compressed replies accepted fits, and succeeds.
    let ok = c
        .call(
            "EchoService",
            "Echo",
            &EchoRequest {
                message: "x".repeat(5000),
            },
        )
        .await
        .unwrap();
    assert_eq!(ok.status, Status::Success);
    p.stop().await;
}

#[tokio::test]
async fn a_draining_provider_answers_late_requests_unavailable_instead_of_dropping_them() {
    let mut p = start(ProviderConfig::default()).await;
    let c = Client::connect(p.addr, ClientConfig::default())
        .await
        .unwrap();
    assert_eq!(
        c.call("EchoService", "Echo", &EchoRequest::default())
            .await
            .unwrap()
            .status,
        Status::Success
    );
    p.signal_stop();
    // Sent after the drain began, on the open connection: answered, not lost. Every call
    // gets an answer: served until the session learns of the drain, refused from then on.
    let r = testkit::wait_for("a call refused by the draining provider", || async {
        let r = c
            .call("EchoService", "Echo", &EchoRequest::default())
            .await
            .unwrap();
        (r.status != Status::Success).then_some(r)
    })
    .await;
    assert_eq!(r.status, Status::Unavailable);
    assert!(r.error_msg.contains("shutting down"), "{}", r.error_msg);
    p.stop().await;
}

/// The next `n` replies on `s`, decoded, in request-id order.
async fn replies_by_id(
    s: &mut TcpStream,
    n: usize,
) -> Vec<(u64, rpcmesh_wire::envelope::IncomingReply)> {
    let mut codec = rpcmesh_wire::envelope::CallCodec::new(None, 1 << 20);
    let mut replies: Vec<_> = testkit::read_frames(s, &mut BytesMut::new(), n)
        .await
        .unwrap()
        .iter()
        .map(|f| (f.header.req_id, codec.decode_response(f).unwrap()))
        .collect();
    replies.sort_by_key(|r| r.0);
    replies
}

/// A request whose metadata is a bomb (100,000 entries) is refused "bad request" before
/// it is decoded, counted, and the connection goes on serving.
#[tokio::test]
async fn a_metadata_bomb_is_refused_and_the_connection_goes_on() {
    let p = start(ProviderConfig::default()).await;
    let mut s = TcpStream::connect(p.addr).await.unwrap();
    let bomb = testkit::metadata_bomb(100_000);
    let mut b = BytesMut::new();
    testkit::put_echo_with_metadata(&mut b, 1, &bomb);
    testkit::put_echo_with_metadata(&mut b, 2, &Default::default());
    s.write_all(&b).await.unwrap();
    let replies = replies_by_id(&mut s, 2).await;
    assert_eq!(replies[0].1.status, Status::BadRequest);
    assert!(
        replies[0]
            .1
            .rpc
            .error_msg
            .contains("metadata over the limit"),
        "{}",
        replies[0].1.rpc.error_msg
    );
    assert_eq!(
        replies[1].1.status,
        Status::Success,
        "the next call is served"
    );
    assert_eq!(p.errors_from("too_large", "client"), 1.0);
    p.stop().await;
}

/// A broker asks for the provider's time per call in its heartbeats
/// (`rpcmesh_common::net::pace`): the answer carries the provider's moving average over the
/// calls whose handlers it ran ("0" before the first), here a handler that burns 2 ms of
/// CPU a call (calls refused before a handler ran, here for an unknown service, are not
/// in it). A heartbeat that does not ask is answered plainly, as a v1 peer expects.
#[tokio::test]
async fn a_heartbeat_that_asks_is_answered_with_the_time_per_call() {
    use rpcmesh_common::net::pace::{HEARTBEAT_KEY, PerCall};
    use rpcmesh_provider::service::{ServiceMode, ServiceTime};
    use rpcmesh_wire::body::Heartbeat;
    use std::time::Duration;
    let p = start(ProviderConfig {
        service_time: ServiceTime::Fixed(Duration::from_millis(2)),
        service_mode: ServiceMode::Work,
        ..ProviderConfig::default()
    })
    .await;
    let mut raw = TcpStream::connect(p.addr).await.unwrap();
    let mut buf = BytesMut::new();
    let ask = vec![(HEARTBEAT_KEY.to_owned(), String::new())];
    let mut round_trip = async |id: u64, extra: &[(String, String)]| -> Heartbeat {
        let mut out = BytesMut::new();
        Heartbeat::put_now_with(&mut out, id, "broker", "test", extra).unwrap();
        raw.write_all(&out).await.unwrap();
        let got = testkit::read_frames(&mut raw, &mut buf, 1).await.unwrap();
        assert_eq!(got[0].header.req_id, id);
        Heartbeat::parse(&got[0].body).unwrap()
    };
    let before = round_trip(1, &ask).await;
    assert_eq!(before.extra_value(HEARTBEAT_KEY), Some("0"), "{before:?}");
    let c = Client::connect(p.addr, ClientConfig::default())
        .await
        .unwrap();
    for _ in 0..3 {
        let r = c
            .call(
                "EchoService",
                "Echo",
                &EchoRequest {
                    message: "x".into(),
                },
            )
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success);
        // Calls answered with an error before any handler ran are not in the average.
        let r = c
            .call(
                "NoSuchService",
                "Echo",
                &EchoRequest {
                    message: "x".into(),
                },
            )
            .await
            .unwrap();
        assert_eq!(r.status, Status::Failed);
    }
    let after = round_trip(2, &ask).await;
    let per_call = after
        .extra_value(HEARTBEAT_KEY)
        .and_then(PerCall::parse_heartbeat_value)
        .unwrap_or_else(|| panic!("no time per call in {after:?}"));
    assert!(per_call >= Duration::from_millis(2), "{per_call:?}");
    assert!(per_call < Duration::from_secs(1), "{per_call:?}");
    let plain = round_trip(3, &[]).await;
    assert!(plain.extra.is_empty(), "{plain:?}");
    p.stop().await;
}
