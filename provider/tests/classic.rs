//! Black-box tests of the classic server (`provider --classic`, `rpcmesh_provider::classic`)
//! over real TCP on 127.0.0.1: it answers as a plain RPCF v1 server (byte for byte on the
//! golden frames, v1 statuses, no flags), in order, one call at a time per connection and
//! one write per reply, and it never sets `TCP_NODELAY` on the sockets it accepts.
//!
//! What the server does with its sockets is read from the sockets themselves: the test
//! takes a duplicate of the server's end of a connection from this process's descriptors
//! (`pidfd_getfd` on itself: the in-process server's sockets are ours) and asks the kernel
//! (`getsockopt(TCP_NODELAY)`, `ioctl(FIONREAD)`). Nothing is timed: order is proven by
//! what a reply stream holds and by what a socket has not yet had read from it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::os::fd::OwnedFd;

use bytes::{Bytes, BytesMut};
use rpcmesh_common::metrics::catalogue::WIRE_SYSCALLS_TOTAL;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_provider::ProviderConfig;
use rpcmesh_testkit::{self as testkit, InProcess, Spawned, wait_until};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::{Heartbeat, Request};
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{Flags, Frame, MsgType};
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse, RpcRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

type Running = InProcess<ServeSummary>;

async fn classic() -> Running {
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::classic::run(ProviderConfig::default(), telemetry, listener, stop)
    })
    .await
}

async fn provider() -> Running {
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(
            ProviderConfig::default(),
            rpcmesh_provider::Registry::builtin(),
            telemetry,
            listener,
            stop,
        )
    })
    .await
}

/// A request frame for `service.method` carrying an `EchoRequest` with `message`.
fn request(req_id: u64, service: &'static str, method: &'static str, message: &str) -> BytesMut {
    flagged_request(req_id, service, method, message, Flags::NONE)
}

/// As [`request`], with rpcmesh's flag bits `flags` in the header.
fn flagged_request(
    req_id: u64,
    service: &'static str,
    method: &'static str,
    message: &str,
    flags: Flags,
) -> BytesMut {
    let payload = prost::Message::encode_to_vec(&RpcRequest {
        payload: prost::Message::encode_to_vec(&EchoRequest {
            message: message.into(),
        })
        .into(),
        metadata: Default::default(),
    });
    let mut b = BytesMut::new();
    Request {
        service: Bytes::from_static(service.as_bytes()),
        method: Bytes::from_static(method.as_bytes()),
        payload: payload.into(),
    }
    .put(&mut b, flags, req_id)
    .unwrap();
    b
}

/// Status byte, and the message (`EchoResponse.message` on success, `error_msg` else) of a
/// response frame.
fn answer(f: &Frame) -> (u8, String) {
    let mut codec = CallCodec::new(None, 1 << 24);
    let r = codec.decode_response(f).unwrap();
    let text = if r.status == Status::Success {
        prost::Message::decode(r.rpc.payload)
            .map(|m: EchoResponse| m.message)
            .unwrap()
    } else {
        r.rpc.error_msg
    };
    (f.body[0], text)
}

/// A duplicate of the server's end of `client`'s connection: the socket in this process
/// whose local address is `client`'s peer and whose peer is `client`.
fn server_end(client: &TcpStream) -> OwnedFd {
    use rustix::process::{PidfdFlags, PidfdGetfdFlags, getpid, pidfd_getfd, pidfd_open};
    let (local, peer) = (client.peer_addr().unwrap(), client.local_addr().unwrap());
    let me = pidfd_open(getpid(), PidfdFlags::empty()).expect("pidfd_open on this process");
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let entry = entry.unwrap();
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"));
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if !is_socket {
            continue;
        }
        let Ok(dup) = pidfd_getfd(&me, fd, PidfdGetfdFlags::empty()) else {
            continue; // closed meanwhile
        };
        let s = socket2::SockRef::from(&dup);
        let addr = |a: std::io::Result<socket2::SockAddr>| a.ok().and_then(|a| a.as_socket());
        if addr(s.local_addr()) == Some(local) && addr(s.peer_addr()) == Some(peer) {
            return dup;
        }
    }
    panic!("no socket in this process is the server's end of {peer} -> {local}");
}

/// Bytes that have arrived on a socket and not been read by its owner.
fn unread(fd: &OwnedFd) -> u64 {
    rustix::io::ioctl_fionread(fd).unwrap()
}

async fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).await.unwrap()
}

#[tokio::test]
async fn classic_answers_the_golden_echo_byte_for_byte() {
    let s = classic().await;
    let (got, want) = testkit::golden_exchange(s.addr, "echo_request_id1", "echo_response_ok_id1")
        .await
        .unwrap();
    assert_eq!(got, want);
    s.stop().await;
}

/// Many requests in one segment (echoes, an unknown service and method, a heartbeat, a
/// request with rpcmesh's flag bits) are answered in the order they came, in v1 form, and
/// every reply leaves in a write of its own.
#[tokio::test]
async fn classic_answers_pipelined_calls_in_order_with_one_write_per_reply() {
    let s = classic().await;
    let flagged = flagged_request(5, "EchoService", "Echo", "flagged", Flags::EXT_STATUS);
    let mut heartbeat = BytesMut::new();
    Heartbeat::default().put(&mut heartbeat, 4).unwrap();
    let mut all = BytesMut::new();
    for part in [
        request(1, "EchoService", "Echo", "first"),
        request(2, "NoSuchService", "Echo", "x"),
        request(3, "EchoService", "NoSuchMethod", "x"),
        heartbeat,
        flagged,
        request(6, "EchoService", "Echo", &"6".repeat(5000)),
        request(7, "EchoService", "Echo", "last"),
    ] {
        all.extend_from_slice(&part);
    }
    let mut c = connect(s.addr).await;
    c.write_all(&all).await.unwrap();
    let mut buf = BytesMut::new();
    let frames = testkit::read_frames(&mut c, &mut buf, 7).await.unwrap();
    let ids: Vec<u64> = frames.iter().map(|f| f.header.req_id).collect();
    assert_eq!(
        ids,
        [1, 2, 3, 4, 5, 6, 7],
        "replies in the order of the requests"
    );
    assert!(
        frames.iter().all(|f| f.header.flags.is_empty()),
        "plain v1 replies carry no flags"
    );
    assert_eq!(frames[3].header.msg_type, MsgType::Heartbeat);
    let replies: Vec<(u8, String)> = frames
        .iter()
        .filter(|f| f.header.msg_type == MsgType::Response)
        .map(answer)
        .collect();
    assert_eq!(replies[0], (0, "first".into()));
    assert_eq!(replies[1], (1, "service not found: NoSuchService".into()));
    assert_eq!(
        replies[2],
        (1, "method not found: EchoService.NoSuchMethod".into())
    );
    assert_eq!(replies[3].0, 1, "a flagged request gets a v1 failure");
    assert!(
        replies[3].1.starts_with("bad request:") && replies[3].1.contains("flag bits 0x20"),
        "{}",
        replies[3].1
    );
    assert_eq!(replies[4], (0, "6".repeat(5000)));
    assert_eq!(replies[5], (0, "last".into()));
    assert_eq!(s.errors("unknown_service"), 1.0);
    assert_eq!(s.errors("unknown_method"), 1.0);
    assert_eq!(s.errors("unknown_type"), 1.0);
    // One write per reply: a server that gathered replies (as rpcmesh's provider does)
    // would have written these seven in fewer. The count is added right after each write,
    // so it may trail the bytes the test has read by the last write.
    let writes = || {
        s.metric(
            WIRE_SYSCALLS_TOTAL.name,
            &[("role", "provider"), ("direction", "out")],
        )
    };
    wait_until("the server's writes to reach one per reply", || {
        writes() >= 7.0
    })
    .await;
    assert_eq!(writes(), 7.0, "one write per reply frame, and no more");
    s.stop().await;
}

/// One call at a time: while the reply to a call is still being written (the caller is not
/// reading it), the next request stays unread in the server's socket, even while the
/// server answers another connection; it is read and answered only once the reply before
/// it has gone.
#[tokio::test]
async fn classic_reads_no_further_request_while_a_reply_is_unwritten() {
    let s = classic().await;
    // A small receive buffer on the caller and a reply larger than the server's largest
    // send buffer (tcp_wmem's 4 MiB by default): the server's write of it cannot finish
    // until the caller reads.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut c = socket.connect(s.addr).await.unwrap();
    let big = "b".repeat(9 << 20);
    c.write_all(&request(1, "EchoService", "Echo", &big))
        .await
        .unwrap();
    // The first bytes of the big reply: the server is writing it now.
    let mut head = [0u8; 4];
    c.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"RPCF");
    let next = request(2, "EchoService", "Echo", "after the big one");
    c.write_all(&next).await.unwrap();
    let server = server_end(&c);
    wait_until("the next request to reach the server's socket", || {
        unread(&server) == next.len() as u64
    })
    .await;
    // The server goes on serving others meanwhile (it is not stuck, only this connection
    // waits): a call on another connection, sent after the next request had arrived, is
    // answered, and the next request is still unread.
    let other = Client::connect(s.addr, ClientConfig::plain_v1())
        .await
        .unwrap();
    let r = other
        .call(
            "EchoService",
            "Echo",
            &EchoRequest {
                message: "meanwhile".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(r.status, Status::Success);
    assert_eq!(
        unread(&server),
        next.len() as u64,
        "the server read the next request before the reply to the one before was written"
    );
    // Reading the big reply lets the server finish it; then, only then, the next.
    let mut buf = BytesMut::from(&head[..]);
    let frames = testkit::read_frames(&mut c, &mut buf, 2).await.unwrap();
    assert_eq!(frames[0].header.req_id, 1);
    assert_eq!(answer(&frames[0]).1.len(), big.len());
    assert_eq!(frames[1].header.req_id, 2);
    assert_eq!(answer(&frames[1]), (0, "after the big one".into()));
    assert_eq!(unread(&server), 0);
    s.stop().await;
}

/// The classic server leaves Nagle's algorithm on; rpcmesh's provider, seen the same way,
/// turns it off (which shows the check sees the option).
#[tokio::test]
async fn classic_never_sets_tcp_nodelay_on_the_sockets_it_accepts() {
    for (name, server, nodelay) in [
        ("classic", classic().await, false),
        ("provider", provider().await, true),
    ] {
        // Once a call is answered the connection is accepted and served: the server's
        // session owns its socket and has done whatever it does to it.
        let mut raw = connect(server.addr).await;
        raw.write_all(&request(9, "EchoService", "Echo", "x"))
            .await
            .unwrap();
        let mut buf = BytesMut::new();
        testkit::read_frames(&mut raw, &mut buf, 1).await.unwrap();
        let end = server_end(&raw);
        assert_eq!(
            socket2::SockRef::from(&end).tcp_nodelay().unwrap(),
            nodelay,
            "{name}: TCP_NODELAY on the accepted socket"
        );
        server.stop().await;
    }
}

/// Bad input is met as by the provider: counted, answered where the request id is known,
/// the connection closed when the stream cannot be resynchronised; others are served on.
#[tokio::test]
async fn classic_meets_bad_input_like_the_provider() {
    let max = 4096;
    let s = InProcess::start(|listener, telemetry, stop| {
        let config = ProviderConfig {
            max_body_len: max,
            ..ProviderConfig::default()
        };
        rpcmesh_provider::classic::run(config, telemetry, listener, stop)
    })
    .await;
    let good = Client::connect(s.addr, ClientConfig::plain_v1())
        .await
        .unwrap();
    for input in testkit::bad_inputs(max) {
        let before = s.errors(input.kind.label());
        let seen = testkit::probe(s.addr, &input).await.unwrap();
        assert_eq!(seen.closed, input.closes, "{}: {seen:?}", input.name);
        if let Some(id) = input.reply_to {
            let r = seen.frames.iter().find(|f| f.header.req_id == id);
            let r = r.unwrap_or_else(|| panic!("{}: no error reply", input.name));
            assert_eq!(r.body[0], 1, "{}: a v1 failure status", input.name);
        }
        if let Some(id) = input.then_answered {
            assert!(
                seen.frames.iter().any(|f| f.header.req_id == id),
                "{}: later frame not answered",
                input.name
            );
        }
        wait_until(&format!("{} to be counted", input.name), || {
            s.errors(input.kind.label()) == before + 1.0
        })
        .await;
        let r = testkit::echo_call(&good, input.name)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r.status, Status::Success, "{}", input.name);
    }
    s.stop().await;
}

/// On shutdown a connection answers what it has already read, and the server returns.
#[tokio::test]
async fn classic_answers_what_it_read_then_stops_on_shutdown() {
    let mut s = classic().await;
    let mut c = connect(s.addr).await;
    let mut two = request(1, "EchoService", "Echo", "one");
    two.extend_from_slice(&request(2, "EchoService", "Echo", "two"));
    c.write_all(&two).await.unwrap();
    let mut buf = BytesMut::new();
    let frames = testkit::read_frames(&mut c, &mut buf, 2).await.unwrap();
    assert_eq!(answer(&frames[1]), (0, "two".into()));
    s.signal_stop();
    testkit::wait_refused(s.addr).await;
    // The open connection is closed once idle; the server then returns.
    let mut rest = Vec::new();
    let n = c.read_to_end(&mut rest).await.unwrap_or(0);
    assert_eq!(n, 0, "nothing more after the drain");
    let summary = s.stop().await;
    assert_eq!(
        summary.cut, 0,
        "no connection was left to the end of the grace period"
    );
}

/// The program: `provider --classic` answers v1 echoes and names unknown services.
#[test]
fn provider_dash_dash_classic_is_a_plain_v1_echo_server() {
    let p = Spawned::start("provider", &["--classic"]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (got, want) =
            testkit::golden_exchange(p.rpc, "echo_request_id1", "echo_response_ok_id1")
                .await
                .unwrap();
        assert_eq!(got, want);
        let mut c = connect(p.rpc).await;
        c.write_all(&request(3, "Nope", "Echo", "x")).await.unwrap();
        let mut buf = BytesMut::new();
        let f = testkit::read_frames(&mut c, &mut buf, 1).await.unwrap();
        assert_eq!(answer(&f[0]), (1, "service not found: Nope".into()));
    });
    assert_eq!(
        p.metric(
            "rpcmesh_calls_total",
            &[
                ("role", "provider"),
                ("service", "EchoService"),
                ("status", "ok")
            ]
        ),
        1.0
    );
}
