//! One pooled connection to a provider, carrying many calls at once.
//!
//! [`UpstreamConn`] (here) is the handle sessions and the pool hold; behind it one task owns
//! the socket. A session that routes a call here queues it itself
//! ([`UpstreamConn::try_forward`]); no message is passed per call. The parts:
//!
//! - [`queue`]: what the handles and the task share: the calls queued by sessions, under
//!   one lock, and the in-flight table (upstream request id → caller) with each call's
//!   slot;
//! - [`task`]: the task's loop: batched writes, the deadline sweep, health-check
//!   heartbeats, the end of the grace period, quick ACKs towards plain v1 servers, and how
//!   the connection ends (calls in flight answered, calls still queued routed again);
//! - [`kept`]: where a call's request is kept while it may be handed back (the queue's
//!   buffer, then a ring of the connection's recent requests), never as a slice of the
//!   session's read buffer;
//! - [`replies`]: what the task reads: each reply matched to its call and copied to the
//!   caller's session, `NOT_RUN` refusals handed back to be routed elsewhere, the
//!   provider's pace taken for the router, unusable frames, and how each call gets its
//!   outcome.

pub(crate) mod kept;
pub use kept::{RING_MAX, RING_MIN};
mod queue;
mod replies;
pub(crate) use replies::{SKIP_FACTOR, failure_verdict, verdict_of};
mod task;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rpcmesh_common::alloc::Counted;
use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::busy_poll::Activity;
use rpcmesh_common::net::shutdown::CancellationToken;
use rpcmesh_common::net::stream::Stream;
use rpcmesh_common::net::tls::ClientTls;
use rpcmesh_wire::PeerKind;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use self::queue::ConnState;
use self::task::ConnTask;
use crate::call::Forward;
use crate::metrics::UpstreamMetrics;
use crate::upstream::{PoolLink, UpstreamError};

/// A health check's waiter: told when the heartbeat's answer comes.
type HeartbeatTx = oneshot::Sender<()>;

/// Finest and coarsest interval of the deadline sweep (it runs at a twentieth of the call
/// timeout, within these bounds): timeouts fire at most this late.
const SWEEP_MIN: Duration = Duration::from_millis(1);
const SWEEP_MAX: Duration = Duration::from_millis(100);

/// How often calls past their deadline are looked for, with `call_timeout`: a twentieth of
/// it, within [`SWEEP_MIN`] and [`SWEEP_MAX`] (both engines).
pub(crate) fn sweep_period(call_timeout: Duration) -> Duration {
    (call_timeout / 20).clamp(SWEEP_MIN, SWEEP_MAX)
}
/// How long a call's request is kept after the call was admitted (`kept`), so that a
/// `NOT_RUN` refusal can be routed elsewhere. A draining provider refuses a call as soon
/// as it reads it, so the refusal comes one round trip after the write unless the
/// provider had stopped reading; a second covers any pause of a live provider. Bounded
/// because a large request is kept as the frame the session read, which holds its read
/// buffer: a call held by a slow provider must not pin it for the whole call timeout. A
/// refusal that comes later is passed on to the caller (with `NOT_RUN` if it takes
/// extended statuses, so a driver may send it to another broker).
pub const REQUEST_RETAIN: Duration = Duration::from_secs(1);

/// Why a call could not be queued on this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The connection is at its in-flight cap.
    Full,
    /// The connection is closed or closing.
    Closed,
}

/// Settings of an upstream connection.
#[derive(Debug, Clone)]
pub(crate) struct ConnSettings {
    pub label: Arc<str>,
    /// What the provider may be sent (and, for a plain v1 server, whose replies Nagle's
    /// algorithm may hold, that its reads are ACKed at once: `task`'s module doc).
    pub kind: PeerKind,
    pub max_body_len: u32,
    pub max_in_flight: usize,
    pub call_timeout: Duration,
    /// Reads are reported here when the broker busy-polls.
    pub activity: Option<Arc<Activity>>,
    /// Cancelled when the broker's grace period ends.
    pub grace_over: CancellationToken,
    /// The broker's budget of buffered bytes (this connection's buffers count in it).
    pub budget: Arc<MemoryBudget>,
    /// TLS towards this provider, when on: the connection's calls then carry their
    /// callers' identities once the provider says it takes them.
    pub tls: Option<Arc<ClientTls>>,
}

/// The handle of one upstream connection. Dropping the last handle lets the task finish
/// the calls in flight and close the socket.
#[derive(Debug)]
pub(crate) struct UpstreamConn {
    /// Unique per provider, in the order the connections were made.
    id: u64,
    /// Health checks to the task; closed when the last handle is dropped.
    heartbeats: mpsc::UnboundedSender<HeartbeatTx>,
    state: Arc<ConnState>,
    cap: usize,
    /// What the provider may be sent (an rpcmesh provider's calls ask for extended
    /// statuses).
    kind: PeerKind,
}

impl UpstreamConn {
    /// Connects and starts the connection's task. The pool's `link` is notified when the
    /// connection fails or the provider says it is draining, so the pool acts at once.
    pub async fn connect(
        addr: &str,
        id: u64,
        settings: ConnSettings,
        metrics: UpstreamMetrics,
        link: Arc<PoolLink>,
        connect_timeout: Duration,
    ) -> Result<UpstreamConn, UpstreamError> {
        let tcp = tokio::time::timeout(connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| UpstreamError::ConnectTimeout(connect_timeout))?
            .map_err(UpstreamError::Connect)?;
        let stream = match &settings.tls {
            Some(tls) => {
                let secured = tls.connect(tcp, addr).await?;
                if let Some(id) = &secured.identity {
                    tracing::debug!(provider = %addr, identity = %id, "tls connection to provider");
                }
                secured.stream
            }
            None => Stream::Plain(tcp),
        };
        let span = tracing::debug_span!("upstream", provider = %settings.label, conn = id);
        let sweep = sweep_period(settings.call_timeout);
        let (conn, task) = UpstreamConn::pair(stream, id, settings, metrics, link);
        tracing::debug!(parent: &span, "connected");
        task.link.task_started();
        let allocations = task.metrics.allocations.clone();
        tokio::spawn(Counted::new(task.run(sweep).instrument(span), allocations));
        Ok(conn)
    }

    /// The handle and the task of a connected socket (the task not started yet).
    fn pair(
        stream: Stream,
        id: u64,
        settings: ConnSettings,
        metrics: UpstreamMetrics,
        link: Arc<PoolLink>,
    ) -> (UpstreamConn, ConnTask) {
        let (heartbeats, heartbeat_rx) = mpsc::unbounded_channel();
        let state = Arc::new(ConnState::default());
        let cap = settings.max_in_flight;
        let kind = settings.kind;
        let task = ConnTask::new(stream, state.clone(), heartbeat_rx, settings, metrics, link);
        let conn = UpstreamConn {
            id,
            heartbeats,
            state,
            cap,
            kind,
        };
        (conn, task)
    }

    /// Queues a call at `now` (the session's clock, read once per round): its frame goes
    /// into the connection's queue under a fresh request id, and the task is woken if it
    /// waits. On refusal the call is handed back untouched.
    // A refused call is handed back by value (no allocation on the per-call path).
    #[allow(clippy::result_large_err)]
    pub fn try_forward(&self, fwd: Forward, now: Instant) -> Result<(), (Forward, Refused)> {
        self.state.try_queue(fwd, now, self.cap, self.kind)
    }

    /// A heartbeat round trip, for the pool's health check.
    pub async fn heartbeat(&self, timeout: Duration) -> Result<(), UpstreamError> {
        let (tx, rx) = oneshot::channel();
        self.heartbeats
            .send(tx)
            .map_err(|_| UpstreamError::Closed)?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(UpstreamError::Closed),
            Err(_) => Err(UpstreamError::HeartbeatTimeout(timeout)),
        }
    }

    /// Takes the connection out of service: no new call is queued on it (those in flight
    /// finish or time out). For a connection that failed its health check. It sets the
    /// same `closed` flag a failure sets, so a later real failure of the retired
    /// connection no longer notifies the keeper, which has already let it go.
    pub fn retire(&self) {
        self.state.closed.store(true, Ordering::Relaxed);
    }

    /// True once the connection failed or was closed.
    pub fn is_closed(&self) -> bool {
        self.state.closed.load(Ordering::Relaxed)
    }

    /// The connection's number: unique per provider, in the order they were made.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Calls queued or in flight on this connection.
    pub fn load(&self) -> usize {
        self.state.in_flight.load(Ordering::Relaxed)
    }
}

/// A connection with its task not started, and calls to put on it: the unit tests'.
#[cfg(test)]
mod fixtures {
    use super::*;
    use crate::call::{CallInfo, Inbox};
    use crate::upstream::pace;
    use bytes::{Bytes, BytesMut};
    use rpcmesh_common::metrics::Telemetry;
    use rpcmesh_wire::body::Request;
    use rpcmesh_wire::frame::{Flags, Frame};
    use std::time::Instant;
    use tokio::net::TcpListener;

    /// A connection to a listener of the test's (which accepts and reads nothing), with
    /// its task not started: the test drives the task's steps itself.
    pub async fn connection(kind: PeerKind) -> (UpstreamConn, ConnTask, TcpStream) {
        let link = PoolLink::for_test(Duration::ZERO, pace::Source::of(kind));
        connection_with(kind, Arc::new(link)).await
    }

    /// The same, sharing `link` with the test.
    pub async fn connection_with(
        kind: PeerKind,
        link: Arc<PoolLink>,
    ) -> (UpstreamConn, ConnTask, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let settings = ConnSettings {
            label: Arc::from("test"),
            kind,
            max_body_len: 1 << 20,
            max_in_flight: 4,
            call_timeout: Duration::from_secs(5),
            activity: None,
            grace_over: CancellationToken::new(),
            budget: MemoryBudget::new(1 << 30),
            tls: None,
        };
        let metrics =
            crate::metrics::BrokerMetrics::new(Telemetry::new(), 8).upstream("test", 1, 1);
        let (conn, task) = UpstreamConn::pair(Stream::Plain(stream), 1, settings, metrics, link);
        (conn, task, server)
    }

    /// A call from a session with inbox `inbox`, with the caller's id `id`.
    pub fn call(id: u64, inbox: &Arc<Inbox>) -> Forward {
        let mut b = BytesMut::new();
        Request {
            service: Bytes::from_static(b"EchoService"),
            method: Bytes::from_static(b"Echo"),
            payload: Bytes::from_static(b"x"),
        }
        .put(&mut b, Flags::EXT_STATUS, id)
        .unwrap();
        let now = Instant::now();
        Forward {
            frame: Frame::from_bytes(b.freeze()).unwrap(),
            verbatim: crate::call::Verbatim::No,
            info: CallInfo {
                client_id: id,
                client_flags: Flags::EXT_STATUS,
                tag: 0,
                admitted: now,
                routed: None,
                replied: None,
            },
            reply_to: inbox.clone(),
            deadline: now + Duration::from_secs(5),
            retries: 0,
            refused_by_drain: false,
            avoid: crate::call::Avoid::None,
            reserved: None,
            idempotent: false,
        }
    }
}
