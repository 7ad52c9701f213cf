//! Starting providers and brokers in the test process, on 127.0.0.1 port 0; a provider
//! that holds calls until the test lets them through; a plain v1 server.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;

use rpcmesh_broker::BrokerConfig;
use rpcmesh_common::net::client::{Client, ClientConfig, ClientError, Reply};
use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_common::net::pace;
use rpcmesh_provider::service::{Held, echo};
use rpcmesh_provider::{ProviderConfig, Registry};
use rpcmesh_testkit::{self as testkit, Gate, InProcess};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::envelope::CallCodec;
use rpcmesh_wire::frame::{Flags, MsgType};
use rpcmesh_wire::proto::rpc::{EchoRequest, EchoResponse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// A provider or broker running in this process.
pub type Running = InProcess<ServeSummary>;

/// The reference platform query.
pub fn query() -> rpcmesh_wire::proto::platform::QueryRequest {
    rpcmesh_wire::proto::platform::reference_query()
}

/// An echo request carrying `m`.
pub fn echo(m: &str) -> EchoRequest {
    EchoRequest { message: m.into() }
}

pub async fn provider(config: ProviderConfig) -> Running {
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(config, Registry::builtin(), telemetry, listener, stop)
    })
    .await
}

/// A provider on a listener the test bound itself (to start one again on the same port).
pub fn provider_on(listener: TcpListener, config: ProviderConfig) -> Running {
    InProcess::start_on(listener, |listener, telemetry, stop| {
        rpcmesh_provider::run_with(config, Registry::builtin(), telemetry, listener, stop)
    })
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

/// A broker on a listener the test bound itself (what waits in its backlog was there
/// before the broker ran).
pub fn broker_on(listener: TcpListener, config: BrokerConfig) -> Running {
    InProcess::start_on(listener, |listener, telemetry, stop| {
        rpcmesh_broker::run_with(config, telemetry, listener, stop)
    })
}

/// A provider, a broker in front of it with test settings changed by `tune`, and a client
/// of the broker that has made a successful call.
pub struct Mesh {
    pub p: Running,
    pub b: Running,
    pub c: Client,
}

pub async fn mesh(tune: impl FnOnce(&mut BrokerConfig)) -> Mesh {
    mesh_in_front_of(provider(ProviderConfig::default()).await, tune).await
}

/// As [`mesh`], with a [`held_provider`]: calls to [`HELD_SERVICE`] wait at the returned
/// gate.
pub async fn held_mesh(tune: impl FnOnce(&mut BrokerConfig)) -> (Mesh, Arc<Gate>) {
    let gate = Gate::new();
    let mesh = mesh_in_front_of(held_provider(&gate).await, tune).await;
    (mesh, gate)
}

async fn mesh_in_front_of(p: Running, tune: impl FnOnce(&mut BrokerConfig)) -> Mesh {
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

/// `n` clients of `addr`, each having made a successful call.
pub async fn ready_clients(addr: SocketAddr, n: usize) -> Vec<Client> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        let c = client(addr).await;
        until_ready(&c).await;
        clients.push(c);
    }
    clients
}

/// Calls echo until one succeeds (the broker's pools connect in the background).
pub async fn until_ready(c: &Client) {
    testkit::wait_for("the broker to answer an echo call", || async {
        let r = c
            .call(
                "EchoService",
                "Echo",
                &EchoRequest {
                    message: "ready?".into(),
                },
            )
            .await;
        r.is_ok_and(|r| r.status == Status::Success).then_some(())
    })
    .await;
}

/// The service whose calls a [`held_provider`] holds at its gate: its method `Echo`
/// answers as `EchoService.Echo` does, once the gate is open.
pub const HELD_SERVICE: &str = "HeldService";

/// A provider with the built-in services, and [`HELD_SERVICE`], whose calls wait at
/// `gate`: a slow provider that answers when the test says.
pub async fn held_provider(gate: &Arc<Gate>) -> Running {
    let mut registry = Registry::builtin();
    let held = Held {
        inner: echo::echo,
        hold: gate.holder(),
    };
    registry.register(HELD_SERVICE, echo::METHOD, held);
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::run_with(
            ProviderConfig::default(),
            registry,
            telemetry,
            listener,
            stop,
        )
    })
    .await
}

/// The classic server (`provider --classic`: a plain v1 server with Nagle's algorithm on
/// that answers one call at a time per connection), with [`HELD_SERVICE`] besides its
/// `EchoService`: a call of it holds its connection at `gate` until the test opens it.
pub async fn held_classic(gate: &Arc<Gate>) -> Running {
    let mut registry = rpcmesh_provider::classic::registry();
    let held = Held {
        inner: echo::echo,
        hold: gate.holder(),
    };
    registry.register(HELD_SERVICE, echo::METHOD, held);
    InProcess::start(|listener, telemetry, stop| {
        rpcmesh_provider::classic::run_with(
            ProviderConfig::default(),
            registry,
            telemetry,
            listener,
            stop,
        )
    })
    .await
}

/// Starts a call of [`HELD_SERVICE`] carrying `message` on `c`, in the background.
pub fn held_call(c: &Client, message: &str) -> JoinHandle<Result<Reply, ClientError>> {
    let (c, message) = (c.clone(), message.to_string());
    tokio::spawn(async move {
        c.call(HELD_SERVICE, echo::METHOD, &EchoRequest { message })
            .await
    })
}

/// A plain RPCF v1 echo server, written here from the protocol alone (not rpcmesh's
/// provider). It counts the requests of each accepted connection and every frame with an
/// extension bit, and can hold its replies until enough requests have come in
/// ([`V1Server::hold_replies_until`]); it counts the heartbeats it receives, so that a
/// test sees a broker's pool connect and wait for it ([`V1Server::heartbeats`]). Strict, it ignores flagged frames as a v1 peer
/// does; lenient, it answers them plainly (as an rpcmesh provider may: a plain reply is a
/// valid answer to an extended request).
pub struct V1Server {
    pub addr: SocketAddr,
    /// Frames seen with an extension bit set.
    pub flagged: Arc<AtomicUsize>,
    state: Arc<V1State>,
    task: JoinHandle<()>,
}

/// What the connections of a [`V1Server`] share.
struct V1State {
    lenient: bool,
    /// Requests answered, per accepted connection in accept order.
    per_conn: Mutex<Vec<usize>>,
    flagged: Arc<AtomicUsize>,
    /// Requests received so far, on every connection.
    received: watch::Sender<usize>,
    /// Heartbeats received so far, on every connection (answered or held).
    heartbeats: AtomicUsize,
    /// Replies wait until `received` reaches this.
    hold_until: AtomicUsize,
    /// One write per reply, each this long after the one before (`None`: the replies
    /// to one read leave together, at once).
    one_by_one: Option<Duration>,
    /// The time per call it reports when a heartbeat asks for it, as an rpcmesh provider
    /// does (`rpcmesh_common::net::pace`); `None`: it never reports.
    report: Option<Duration>,
}

impl V1Server {
    pub async fn start(lenient: bool) -> V1Server {
        V1Server::start_with(lenient, None, None).await
    }

    /// A strict server that writes each reply on its own, `per_call` after the one before
    /// on the same connection.
    pub async fn one_by_one(per_call: Duration) -> V1Server {
        V1Server::start_with(false, Some(per_call), None).await
    }

    /// A lenient server that answers at once but, asked in a heartbeat as an rpcmesh
    /// provider is, reports that it takes `per_call` per call.
    pub async fn reporting(per_call: Duration) -> V1Server {
        V1Server::start_with(true, None, Some(per_call)).await
    }

    async fn start_with(
        lenient: bool,
        one_by_one: Option<Duration>,
        report: Option<Duration>,
    ) -> V1Server {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let flagged = Arc::new(AtomicUsize::new(0));
        let state = Arc::new(V1State {
            lenient,
            per_conn: Mutex::new(Vec::new()),
            flagged: flagged.clone(),
            received: watch::Sender::new(0),
            heartbeats: AtomicUsize::new(0),
            hold_until: AtomicUsize::new(0),
            one_by_one,
            report,
        });
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let n = {
                    let mut v = shared.per_conn.lock().unwrap();
                    v.push(0);
                    v.len() - 1
                };
                tokio::spawn(v1_echo(s, n, shared.clone()));
            }
        });
        V1Server {
            addr,
            flagged,
            state,
            task,
        }
    }

    /// Heartbeats received so far, on every connection: a broker's pool that has
    /// connected and asked is waiting for this server.
    pub fn heartbeats(&self) -> usize {
        self.state.heartbeats.load(Ordering::SeqCst)
    }

    /// Requests answered so far, per connection.
    pub fn counts(&self) -> Vec<usize> {
        self.state.per_conn.lock().unwrap().clone()
    }

    /// Holds every reply (heartbeats too) until `n` more requests have come in, on all
    /// connections together: those `n` calls are then all in flight at once, however the
    /// broker happened to send them.
    pub fn hold_replies_until(&self, n: usize) {
        let target = *self.state.received.borrow() + n;
        self.state.hold_until.store(target, Ordering::SeqCst);
    }

    /// Sends the server a request of its own, as a client beside the broker would: the
    /// one request that replies held by `hold_replies_until(1)` wait for.
    pub async fn release(&self) {
        let direct = Client::connect(self.addr, ClientConfig::plain_v1())
            .await
            .unwrap();
        let r = direct
            .call(
                "EchoService",
                "Echo",
                &EchoRequest {
                    message: "direct".into(),
                },
            )
            .await
            .unwrap();
        assert_eq!(r.status, Status::Success);
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

/// Serves one connection: reads and answers every request of a read together; the
/// answers go to a writer that holds them as [`V1Server::hold_replies_until`] says, while
/// reading goes on.
async fn v1_echo(s: TcpStream, n: usize, state: Arc<V1State>) {
    let (mut rd, mut wr) = s.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<(BytesMut, usize)>();
    let writer = {
        let state = state.clone();
        tokio::spawn(async move {
            let mut received = state.received.subscribe();
            while let Some((out, requests)) = rx.recv().await {
                let target = state.hold_until.load(Ordering::SeqCst);
                if received.wait_for(|r| *r >= target).await.is_err() {
                    return;
                }
                if let Some(pause) = state.one_by_one {
                    tokio::time::sleep(pause).await;
                }
                state.per_conn.lock().unwrap()[n] += requests;
                if wr.write_all(&out).await.is_err() {
                    return;
                }
            }
        })
    };
    let fc = FrameCodec::default();
    let mut codec = CallCodec::new(None, 1 << 20);
    let mut buf = BytesMut::with_capacity(64 << 10);
    loop {
        buf.reserve(64 << 10);
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let mut out = BytesMut::new();
        let mut requests = 0;
        // Answers go to the writer together, after the read, or one by one.
        let hand_on = |out: BytesMut, requests: usize| {
            state.received.send_modify(|r| *r += requests);
            tx.send((out, requests)).is_ok()
        };
        while let Ok(Some(f)) = fc.decode_frame(&mut buf) {
            if !f.header.flags.is_empty() {
                state.flagged.fetch_add(1, Ordering::Relaxed);
                if !state.lenient {
                    continue; // what a v1 peer does with an unknown type
                }
            }
            match f.header.msg_type {
                MsgType::Heartbeat => {
                    state.heartbeats.fetch_add(1, Ordering::SeqCst);
                    let asked = Heartbeat::parse(&f.body)
                        .is_ok_and(|hb| hb.extra_value(pace::HEARTBEAT_KEY).is_some());
                    let extra = match state.report.filter(|_| asked) {
                        Some(t) => vec![(pace::HEARTBEAT_KEY.into(), t.as_nanos().to_string())],
                        None => Vec::new(),
                    };
                    let hb = Heartbeat {
                        extra,
                        ..Heartbeat::default()
                    };
                    hb.put(&mut out, f.header.req_id).unwrap();
                }
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
                MsgType::Response | MsgType::ExtRequest => {}
            }
            if state.one_by_one.is_some()
                && !out.is_empty()
                && !hand_on(out.split(), std::mem::take(&mut requests))
            {
                return;
            }
        }
        if state.one_by_one.is_none() && !hand_on(out, requests) {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}

/// Which engine serves a broker a test starts (`--engine`): tests that hold both
/// engines to one behaviour run once with each. The loop engine does a part of what the
/// broker does: only tests of that part run on it.
pub use rpcmesh_broker::EngineKind as Engine;

/// Both engines.
pub const ENGINES: [Engine; 2] = [Engine::Tokio, Engine::Loop];

/// A broker on either engine, running in the test process.
pub enum AnyBroker {
    Tokio(Running),
    Loop(InProcess<std::io::Result<rpcmesh_broker::engine::Summary>>),
}

impl AnyBroker {
    pub fn addr(&self) -> SocketAddr {
        match self {
            AnyBroker::Tokio(b) => b.addr,
            AnyBroker::Loop(b) => b.addr,
        }
    }

    /// The sum of the samples of metric `name` whose labels include `labels`.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        match self {
            AnyBroker::Tokio(b) => b.metric(name, labels),
            AnyBroker::Loop(b) => b.metric(name, labels),
        }
    }

    /// Stops it and waits for its drain to end.
    pub async fn stop(self) {
        match self {
            AnyBroker::Tokio(b) => {
                b.stop().await;
            }
            AnyBroker::Loop(b) => {
                b.stop().await.unwrap();
            }
        }
    }
}

/// A broker with `config` on `engine`, on 127.0.0.1 port 0.
pub async fn broker_with(engine: Engine, config: BrokerConfig) -> AnyBroker {
    match engine {
        Engine::Tokio => AnyBroker::Tokio(broker(config).await),
        Engine::Loop => AnyBroker::Loop(
            InProcess::start(|listener, telemetry, stop| {
                rpcmesh_broker::engine::run(config, telemetry, listener, stop)
            })
            .await,
        ),
    }
}
