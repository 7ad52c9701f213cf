//! Starting providers and brokers in the test process, on 127.0.0.1 port 0.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;

use rpcmesh_broker::BrokerConfig;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_common::testkit::InProcess;
use rpcmesh_provider::{ProviderConfig, Registry};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{Flags, MsgType};
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A provider or broker running in this process.
pub type Running = InProcess<ServeSummary>;

pub async fn provider(config: ProviderConfig) -> Running {
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(config, Registry::builtin(), telemetry, listener, stop)
    })
    .await
}

/// Test-friendly broker settings: fast health checks, so that the pool notices changes
/// within a fraction of a second.
pub fn broker_config(upstreams: &[SocketAddr]) -> BrokerConfig {
    let mut c = BrokerConfig::with_upstreams(upstreams.iter().map(|a| a.to_string()));
    c.health_interval = Duration::from_millis(100);
    c.connect_timeout = Duration::from_millis(500);
    c.health_timeout = Duration::from_millis(500);
    c.grace = Duration::from_secs(5);
    c
}

pub async fn broker(config: BrokerConfig) -> Running {
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_broker::run_with(config, telemetry, listener, stop)
    })
    .await
}

/// A provider, a broker in front of it with test settings changed by `tune`, and a client
/// of the broker that has made a successful call.
pub struct Mesh {
    pub p: Running,
    pub b: Running,
    pub c: Client,
}

pub async fn mesh(tune: impl FnOnce(&mut BrokerConfig)) -> Mesh {
    mesh_with(ProviderConfig::default(), tune).await
}

/// As [`mesh`], with a provider whose every call takes `service_time`.
pub async fn slow_mesh(service_time: Duration, tune: impl FnOnce(&mut BrokerConfig)) -> Mesh {
    let config = ProviderConfig {
        service_time,
        ..ProviderConfig::default()
    };
    mesh_with(config, tune).await
}

async fn mesh_with(provider_config: ProviderConfig, tune: impl FnOnce(&mut BrokerConfig)) -> Mesh {
    let p = provider(provider_config).await;
    let mut cfg = broker_config(&[p.addr]);
    tune(&mut cfg);
    let b = broker(cfg).await;
    let c = client(b.addr).await;
    until_ready(&c).await;
    Mesh { p, b, c }
}

impl Mesh {
    /// Stops the broker, then the provider.
    pub async fn stop(self) {
        self.b.stop().await;
        self.p.stop().await;
    }
}

pub async fn client(addr: SocketAddr) -> Client {
    Client::connect(addr, ClientConfig::default())
        .await
        .unwrap()
}

/// Calls echo until one succeeds (the broker's pools connect in the background).
pub async fn until_ready(c: &Client) {
    for _ in 0..200 {
        if let Ok(r) = c
            .call(
                "EchoService",
                "Echo",
                &EchoRequest {
                    message: "ready?".into(),
                },
            )
            .await
        {
            if r.status == Status::Success {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("broker never became ready");
}

/// A plain RPCF v1 echo server, written here from the protocol alone (not rpcmesh's
/// provider). It counts the requests of each accepted connection and every frame with an
/// extension bit, and answers each read's requests after `delay_ms`. Strict, it ignores
/// flagged frames as a v1 peer does; lenient, it answers them plainly (as an rpcmesh
/// provider may: a plain reply is a valid answer to an extended request).
pub struct V1Server {
    pub addr: SocketAddr,
    /// Requests answered, per accepted connection in accept order.
    pub per_conn: Arc<Mutex<Vec<usize>>>,
    /// Frames seen with an extension bit set.
    pub flagged: Arc<AtomicUsize>,
    /// Milliseconds to wait before answering a read's requests.
    pub delay_ms: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl V1Server {
    pub async fn start(lenient: bool) -> V1Server {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let per_conn = Arc::new(Mutex::new(Vec::new()));
        let flagged = Arc::new(AtomicUsize::new(0));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (pc, fl, dl) = (per_conn.clone(), flagged.clone(), delay_ms.clone());
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let n = {
                    let mut v = pc.lock().unwrap();
                    v.push(0);
                    v.len() - 1
                };
                tokio::spawn(v1_echo(s, n, lenient, pc.clone(), fl.clone(), dl.clone()));
            }
        });
        V1Server {
            addr,
            per_conn,
            flagged,
            delay_ms,
            task,
        }
    }

    /// Requests answered so far, per connection.
    pub fn counts(&self) -> Vec<usize> {
        self.per_conn.lock().unwrap().clone()
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

async fn v1_echo(
    mut s: TcpStream,
    n: usize,
    lenient: bool,
    per_conn: Arc<Mutex<Vec<usize>>>,
    flagged: Arc<AtomicUsize>,
    delay_ms: Arc<AtomicU64>,
) {
    let fc = FrameCodec::default();
    let mut codec = CallCodec::new(None, 1 << 20);
    let mut buf = BytesMut::with_capacity(64 << 10);
    loop {
        buf.reserve(64 << 10);
        match s.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let mut out = BytesMut::new();
        let mut requests = 0;
        while let Ok(Some(f)) = fc.decode_frame(&mut buf) {
            if !f.header.flags.is_empty() {
                flagged.fetch_add(1, Ordering::Relaxed);
                if !lenient {
                    continue; // what a v1 peer does with an unknown type
                }
            }
            match f.header.msg_type {
                MsgType::Heartbeat => Heartbeat::default().put(&mut out, f.header.req_id).unwrap(),
                MsgType::Request => {
                    let call = codec.decode_request(&f).unwrap();
                    let msg = <EchoRequest as prost::Message>::decode(call.rpc.payload).unwrap();
                    let inner = prost::Message::encode_to_vec(&EchoResponse {
                        message: msg.message,
                    });
                    codec
                        .put_ok_response(&mut out, f.header.req_id, Flags::NONE, &inner)
                        .unwrap();
                    requests += 1;
                }
                MsgType::Response => {}
            }
        }
        let delay = delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        per_conn.lock().unwrap()[n] += requests;
        if s.write_all(&out).await.is_err() {
            return;
        }
    }
}
