//! The embedded mesh of the driver's default run: a provider and a broker started in this
//! process on 127.0.0.1 (each on its own runtime and threads, as separate programs would
//! be), torn down when the run ends.

use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use rpcmesh_common::net::client::{Client, ClientConfig};
use rpcmesh_wire::Status;
use rpcmesh_wire::proto::rpc::EchoRequest;
use tokio::sync::oneshot;

/// Worker threads of the embedded provider and of the embedded broker each: one, so that
/// on a small machine the driver keeps CPU to generate load with.
pub const EMBEDDED_THREADS: usize = 1;
/// Where the embedded programs listen: loopback, on a port the kernel picks.
const EMBEDDED_ADDR: std::net::SocketAddr =
    std::net::SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);
/// How long the embedded mesh may take to answer its first call.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

struct Server {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// A running provider and broker.
pub struct Embedded {
    /// Where the broker listens.
    pub broker: SocketAddr,
    /// Where the provider listens.
    pub provider: SocketAddr,
    servers: Vec<Server>,
}

impl std::fmt::Debug for Embedded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedded")
            .field("broker", &self.broker)
            .field("provider", &self.provider)
            .finish()
    }
}

impl Embedded {
    /// Starts the provider, then the broker in front of it, and waits until a call goes
    /// through.
    pub async fn start() -> anyhow::Result<Embedded> {
        let (provider, p) = spawn_server("provider", |listener, stop| async move {
            rpcmesh_provider::run(rpcmesh_provider::ProviderConfig::default(), listener, stop)
                .await;
        })?;
        let (broker, b) = spawn_server("broker", move |listener, stop| async move {
            let config = rpcmesh_broker::BrokerConfig::with_upstreams([provider.to_string()]);
            rpcmesh_broker::run(config, listener, stop).await;
        })?;
        let mesh = Embedded {
            broker,
            provider,
            servers: vec![b, p],
        };
        mesh.wait_ready().await?;
        Ok(mesh)
    }

    async fn wait_ready(&self) -> anyhow::Result<()> {
        let c = Client::connect(self.broker, ClientConfig::default()).await?;
        let give_up = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            let r = c
                .call(
                    "EchoService",
                    "Echo",
                    &EchoRequest {
                        message: "ready?".into(),
                    },
                )
                .await;
            if matches!(&r, Ok(r) if r.status == Status::Success) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= give_up {
                anyhow::bail!(
                    "the embedded broker did not get a call through in {READY_TIMEOUT:?}: {r:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the broker, then the provider, and waits for both.
    pub fn stop(mut self) {
        for s in &mut self.servers {
            if let Some(tx) = s.stop.take() {
                let _ = tx.send(());
            }
            if let Some(t) = s.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn spawn_server<F, Fut>(name: &'static str, serve: F) -> anyhow::Result<(SocketAddr, Server)>
where
    F: FnOnce(
            tokio::net::TcpListener,
            std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
        ) -> Fut
        + Send
        + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let (stop, stop_rx) = oneshot::channel::<()>();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(format!("embedded-{name}"))
        .spawn(move || {
            let rt = match rpcmesh_common::cli::startup::build(name, EMBEDDED_THREADS) {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = addr_tx.send(Err(anyhow::Error::from(e)));
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match rpcmesh_common::cli::startup::bind(EMBEDDED_ADDR) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = addr_tx.send(Err(e.into()));
                        return;
                    }
                };
                let addr = listener.local_addr().map_err(anyhow::Error::from);
                let _ = addr_tx.send(addr);
                serve(
                    listener,
                    Box::pin(async {
                        let _ = stop_rx.await;
                    }),
                )
                .await;
            });
        })
        .context("starting a thread")?;
    let addr = addr_rx.recv().context("embedded server thread ended")??;
    Ok((
        addr,
        Server {
            stop: Some(stop),
            thread: Some(thread),
        },
    ))
}
