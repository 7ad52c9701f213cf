//! Starting providers and brokers in the test process, on 127.0.0.1 port 0.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use rpcmesh_broker::BrokerConfig;
use rpcmesh_common::Status;
use rpcmesh_common::client::{Client, ClientConfig};
use rpcmesh_common::listener::ServeSummary;
use rpcmesh_common::proto::rpc::EchoRequest;
use rpcmesh_common::telemetry::{Telemetry, sample};
use rpcmesh_provider::{ProviderConfig, Registry};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A server running in this process.
pub struct Running {
    pub addr: SocketAddr,
    pub telemetry: Telemetry,
    stop: Option<oneshot::Sender<()>>,
    pub task: JoinHandle<ServeSummary>,
}

impl Running {
    pub fn errors(&self, kind: &str) -> f64 {
        sample(
            &self.telemetry.render(),
            "rpcmesh_errors_total",
            &[("kind", kind)],
        )
        .unwrap_or(0.0)
    }

    pub fn calls(&self, status: &str) -> f64 {
        sample(
            &self.telemetry.render(),
            "rpcmesh_calls_total",
            &[("status", status)],
        )
        .unwrap_or(0.0)
    }

    pub async fn stop(mut self) -> ServeSummary {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.expect("server task")
    }
}

pub async fn provider(config: ProviderConfig) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let telemetry = Telemetry::new();
    let (stop, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(rpcmesh_provider::run_with(
        config,
        Registry::builtin(),
        telemetry.clone(),
        listener,
        async {
            let _ = rx.await;
        },
    ));
    Running {
        addr,
        telemetry,
        stop: Some(stop),
        task,
    }
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
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let telemetry = Telemetry::new();
    let (stop, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(rpcmesh_broker::run_with(
        config,
        telemetry.clone(),
        listener,
        async {
            let _ = rx.await;
        },
    ));
    Running {
        addr,
        telemetry,
        stop: Some(stop),
        task,
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
