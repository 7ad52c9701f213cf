//! A server (a provider's or a broker's `run_with`) running in the test process on
//! 127.0.0.1 port 0 with metrics of its own, and echo calls to it. The test reads its
//! metrics straight from its [`Telemetry`], with no scrape.

use std::future::Future;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use rpcmesh_common::metrics::Telemetry;
use rpcmesh_common::metrics::catalogue::{CALLS_TOTAL, ERRORS_TOTAL};
use rpcmesh_common::metrics::recorder::sample;
use rpcmesh_common::net::client::{Client, ClientError, Reply};
use rpcmesh_common::net::shutdown::ShutdownSignal;
use rpcmesh_wire::proto::rpc::EchoRequest;

/// A server running in the test process until [`InProcess::stop`].
#[derive(Debug)]
pub struct InProcess<T> {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    /// Its metrics.
    pub telemetry: Telemetry,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<T>,
}

impl<T: Send + 'static> InProcess<T> {
    /// Binds a listener on 127.0.0.1 port 0 and spawns `run(listener, telemetry, stop)`.
    pub async fn start<F, Fut>(run: F) -> InProcess<T>
    where
        F: FnOnce(TcpListener, Telemetry, ShutdownSignal) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        InProcess::start_on(listener, run)
    }

    /// As [`InProcess::start`], on a listener the test bound itself: what it has in its
    /// backlog (a connection, a request already written) is there before the server runs.
    pub fn start_on<F, Fut>(listener: TcpListener, run: F) -> InProcess<T>
    where
        F: FnOnce(TcpListener, Telemetry, ShutdownSignal) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
    {
        let addr = listener.local_addr().expect("local address");
        let telemetry = Telemetry::new();
        let (stop, rx) = oneshot::channel::<()>();
        let signal: ShutdownSignal = Box::pin(async {
            let _ = rx.await;
        });
        let task = tokio::spawn(run(listener, telemetry.clone(), signal));
        InProcess {
            addr,
            telemetry,
            stop: Some(stop),
            task,
        }
    }

    /// The sum of the samples of metric `name` whose labels include `labels`, so far
    /// (0 when there is none).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sample(&self.telemetry.render(), name, labels).unwrap_or(0.0)
    }

    /// `rpcmesh_errors_total{kind}` so far, every side.
    pub fn errors(&self, kind: &str) -> f64 {
        self.metric(ERRORS_TOTAL.name, &[("kind", kind)])
    }

    /// `rpcmesh_errors_total{kind, side}` so far.
    pub fn errors_from(&self, kind: &str, side: &str) -> f64 {
        self.metric(ERRORS_TOTAL.name, &[("kind", kind), ("side", side)])
    }

    /// `rpcmesh_calls_total{status}` so far.
    pub fn calls(&self, status: &str) -> f64 {
        self.metric(CALLS_TOTAL.name, &[("status", status)])
    }

    /// Tells it to stop (it drains), without waiting.
    pub fn signal_stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    /// Tells it to stop and waits for what it returns.
    pub async fn stop(mut self) -> T {
        self.signal_stop();
        self.task.await.expect("server task")
    }
}

/// Starts an echo call carrying `message` on `c`, in the background.
pub fn echo_call(c: &Client, message: impl Into<String>) -> JoinHandle<Result<Reply, ClientError>> {
    let (c, message) = (c.clone(), message.into());
    tokio::spawn(async move {
        c.call("EchoService", "Echo", &EchoRequest { message })
            .await
    })
}

/// Starts `n` echo calls at once on `c`, call `i` carrying the message `m{i}`; await the
/// handles in order to check each reply.
pub fn echo_calls(c: &Client, n: usize) -> Vec<JoinHandle<Result<Reply, ClientError>>> {
    (0..n).map(|i| echo_call(c, format!("m{i}"))).collect()
}
