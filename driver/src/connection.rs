//! The driver's side of one connection to its target: connecting, with a timeout per
//! attempt and pauses that double between failed attempts (with jitter, the shared
//! [`Backoff`]); and, when a connection is lost,
//! whether to wait before the next one (a connection that died before bringing a single
//! reply counts as a failed attempt, so that a server that accepts and closes at once, as
//! a broker at its connection cap does, is not hammered).
//!
//! Owns the dialling and its counts; what runs over the connection is the worker's.

use std::time::{Duration, Instant};

use rpcmesh_common::metrics::{ErrorKind, Side};
use rpcmesh_common::net::backoff::Backoff;
use rpcmesh_common::net::connection::FramedIo;
use rpcmesh_common::net::listener::AcceptObserver;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::frame::DEFAULT_MAX_BODY_LEN;
use tokio::net::TcpStream;

use crate::metrics::DriverMetrics;

/// Timeout of one connection attempt: a healthy target on a LAN answers in well under a
/// millisecond; two seconds covers a loaded one and a lost SYN's first retransmission.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Dials one worker's target and keeps its connection counts.
#[derive(Debug)]
pub struct Connector {
    target: String,
    /// The worker's number, for logs.
    worker: usize,
    /// Failed attempts, and connections lost before any reply.
    failures: u64,
    /// Connections lost so far (for thinning the log).
    lost: u64,
    /// The current connection has brought a reply.
    replied: bool,
    /// Pause before reconnecting after connections that brought nothing.
    reconnect: Backoff,
}

impl Connector {
    /// A connector for worker `worker`'s `target` (`HOST:PORT`).
    pub fn new(target: String, worker: usize) -> Self {
        Connector {
            target,
            worker,
            failures: 0,
            lost: 0,
            replied: false,
            reconnect: Backoff::default(),
        }
    }

    /// Failed connection attempts so far (the report's `connect_failures`).
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// The current connection brought a reply.
    pub fn replied(&mut self) {
        self.replied = true;
    }

    /// Connects, retrying after failures with doubling pauses, until `give_up` or `stop`;
    /// `None` then.
    pub async fn connect(
        &mut self,
        give_up: Instant,
        stop: &CancellationToken,
        metrics: &DriverMetrics,
    ) -> Option<FramedIo> {
        let mut backoff = Backoff::default();
        loop {
            let attempt = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.target));
            let error = match attempt.await {
                Ok(Ok(s)) => {
                    metrics.conns.opened();
                    self.replied = false;
                    return Some(FramedIo::new(s, FrameCodec::new(DEFAULT_MAX_BODY_LEN)));
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("timed out after {CONNECT_TIMEOUT:?}"),
            };
            self.failures += 1;
            metrics.errors.inc(ErrorKind::Io, Side::Server);
            // One line per worker and outage; the count goes in the report.
            if self.failures == 1 {
                tracing::warn!(worker = self.worker, target = %self.target, %error, "connect failed; retrying");
            } else {
                tracing::debug!(worker = self.worker, target = %self.target, %error, "connect failed");
            }
            if !wait_to_retry(backoff.pause(), give_up, stop).await {
                return None;
            }
        }
    }

    /// The connection was lost with `calls` calls on it; connects again (after a pause if
    /// it had brought no reply), until `give_up` or `stop`.
    pub async fn reconnect(
        &mut self,
        calls: usize,
        cause: &str,
        give_up: Instant,
        stop: &CancellationToken,
        metrics: &DriverMetrics,
    ) -> Option<FramedIo> {
        self.lost += 1;
        if self.lost <= 3 {
            tracing::warn!(worker = self.worker, calls, %cause, "connection lost; reconnecting");
        } else {
            tracing::debug!(worker = self.worker, calls, %cause, "connection lost; reconnecting");
        }
        if self.replied {
            self.reconnect.reset();
        } else {
            self.failures += 1;
            if !wait_to_retry(self.reconnect.pause(), give_up, stop).await {
                return None;
            }
        }
        self.connect(give_up, stop, metrics).await
    }
}

/// Sleeps `pause` before another attempt; false, at once, when that would pass `give_up`
/// or the run is stopping.
async fn wait_to_retry(pause: Duration, give_up: Instant, stop: &CancellationToken) -> bool {
    if Instant::now() + pause >= give_up || stop.is_cancelled() {
        return false;
    }
    tokio::time::sleep(pause).await;
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpcmesh_common::metrics::Telemetry;

    fn metrics() -> DriverMetrics {
        DriverMetrics::new(Telemetry::new(), "EchoService", "Echo", 0)
    }

    #[tokio::test]
    async fn a_listening_target_is_connected_at_once() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut c = Connector::new(l.local_addr().unwrap().to_string(), 0);
        let give_up = Instant::now() + Duration::from_secs(30);
        let io = c
            .connect(give_up, &CancellationToken::new(), &metrics())
            .await;
        assert!(io.is_some());
        assert_eq!(c.failures(), 0);
    }

    #[tokio::test]
    async fn a_target_nobody_listens_on_is_given_up_by_the_deadline_with_the_failures_counted() {
        // Bound and dropped: nothing listens there (connections are refused at once).
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut c = Connector::new(addr.to_string(), 0);
        // Room for the first pauses (50 + 100 ms) but not the third (200 ms).
        let give_up = Instant::now() + Duration::from_millis(300);
        let io = c
            .connect(give_up, &CancellationToken::new(), &metrics())
            .await;
        assert!(io.is_none());
        assert!(c.failures() >= 2, "{}", c.failures());
    }

    #[tokio::test]
    async fn a_stopped_run_does_not_retry() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut c = Connector::new(addr.to_string(), 0);
        let stop = CancellationToken::new();
        stop.cancel();
        let give_up = Instant::now() + Duration::from_secs(30);
        assert!(c.connect(give_up, &stop, &metrics()).await.is_none());
        assert_eq!(c.failures(), 1, "one attempt, then no retry");
    }
}
