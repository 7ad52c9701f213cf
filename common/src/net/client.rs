//! A small multiplexed RPCF client: one connection, any number of concurrent calls, each
//! answered through its own oneshot. For tests, examples and tools; the load generator
//! (driver) has its own engine that avoids the per-call task hop and allocation.
//!
//! One task owns the connection, its write buffer and the table of calls in flight.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};

use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::compress::{CompressionConfig, DEFAULT_MAX_INFLATED_LEN};
use rpcmesh_wire::envelope::{CallCodec, CallError, IncomingReply};
use rpcmesh_wire::frame::{DEFAULT_MAX_BODY_LEN, Flags, FrameError, MsgType};
use rpcmesh_wire::peer::PeerKind;
use rpcmesh_wire::status::Status;

use crate::net::connection::{FramedIo, IoEvent};

/// How long a call waits for its reply unless configured otherwise: long enough for any
/// healthy mesh, short enough that a test that goes wrong fails instead of hanging.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Calls queued towards the connection task before `call` waits.
const QUEUE_DEPTH: usize = 1024;
/// When the table of calls in flight grows past this, entries whose caller gave up
/// (timed out) are dropped, so it stays bounded even if replies never come.
const PURGE_AT: usize = 4096;

/// What the client sends and accepts.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Compress request payloads (and accept compressed replies); `None` = plain.
    pub compression: Option<CompressionConfig>,
    /// What the client speaks as: an rpcmesh client asks for the extended statuses
    /// (overloaded, unavailable, bad request), a plain v1 one does not.
    pub kind: PeerKind,
    /// Largest reply body accepted.
    pub max_body_len: u32,
    /// Largest inflated reply payload.
    pub max_inflated: usize,
    /// Per-call timeout.
    pub timeout: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            compression: None,
            kind: PeerKind::Rpcmesh,
            max_body_len: DEFAULT_MAX_BODY_LEN,
            max_inflated: DEFAULT_MAX_INFLATED_LEN,
            timeout: DEFAULT_CALL_TIMEOUT,
        }
    }
}

impl ClientConfig {
    /// A client that sends exactly what an RPCF v1 client sends.
    pub fn plain_v1() -> Self {
        ClientConfig {
            kind: PeerKind::V1,
            ..ClientConfig::default()
        }
    }

    /// A client that compresses request payloads of `threshold` bytes or more (default
    /// level) and accepts compressed replies.
    pub fn compressed(threshold: usize) -> Self {
        ClientConfig {
            compression: Some(CompressionConfig {
                threshold,
                ..CompressionConfig::default()
            }),
            ..ClientConfig::default()
        }
    }

    fn flags(&self) -> Flags {
        let mut f = Flags::NONE;
        if self.kind == PeerKind::Rpcmesh {
            f = f | Flags::EXT_STATUS;
        }
        if self.compression.is_some() {
            f = f | Flags::ACCEPT_COMPRESSED;
        }
        f
    }
}

/// How the connection ended under a call, or why the call found it gone.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConnectionEnd {
    /// The connection's task is gone: it ended before the call was sent or answered.
    #[error("connection task ended")]
    TaskEnded,
    /// The peer closed its side.
    #[error("closed by peer")]
    ClosedByPeer,
    /// The socket failed, reading or writing.
    #[error("{0}")]
    Io(Arc<io::Error>),
    /// The peer sent bytes the stream cannot be resynchronised after.
    #[error("{0}")]
    BadFrames(FrameError),
}

/// Why a call got no reply.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting failed.
    #[error("connect: {0}")]
    Connect(io::Error),
    /// The connection failed or was closed with the call on it.
    #[error("connection closed: {0}")]
    Closed(ConnectionEnd),
    /// The peer answered the call with a frame of another type (a heartbeat for a call,
    /// a response for a heartbeat).
    #[error("peer answered with a {0:?} frame")]
    WrongFrame(MsgType),
    /// No reply within the timeout.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The request could not be encoded.
    #[error(transparent)]
    Encode(#[from] FrameError),
    /// The reply could not be read.
    #[error(transparent)]
    Reply(#[from] CallError),
}

/// The reply to a call.
#[derive(Debug)]
pub struct Reply {
    /// Status as received.
    pub status: Status,
    /// `RpcResponse.success`.
    pub success: bool,
    /// `RpcResponse.error_msg`.
    pub error_msg: String,
    /// The application message (`RpcResponse.payload`).
    pub payload: Bytes,
    /// True when the reply frame was compressed.
    pub compressed: bool,
}

impl Reply {
    /// Decodes the application message.
    pub fn decode<R: Message + Default>(&self) -> Result<R, prost::DecodeError> {
        R::decode(self.payload.clone())
    }
}

enum Op {
    Call {
        service: String,
        method: String,
        inner: Bytes,
        metadata: HashMap<String, String>,
        reply: oneshot::Sender<Result<Reply, ClientError>>,
    },
    Heartbeat {
        reply: oneshot::Sender<Result<Heartbeat, ClientError>>,
    },
}

enum Waiter {
    Call(oneshot::Sender<Result<Reply, ClientError>>),
    Heartbeat(oneshot::Sender<Result<Heartbeat, ClientError>>),
}

impl Waiter {
    fn fail(self, e: ClientError) {
        match self {
            Waiter::Call(tx) => drop(tx.send(Err(e))),
            Waiter::Heartbeat(tx) => drop(tx.send(Err(e))),
        }
    }
    fn is_closed(&self) -> bool {
        match self {
            Waiter::Call(tx) => tx.is_closed(),
            Waiter::Heartbeat(tx) => tx.is_closed(),
        }
    }
}

/// A connection to a provider or broker. Cheap to clone; the connection closes when the
/// last clone is dropped.
#[derive(Clone, Debug)]
pub struct Client {
    ops: mpsc::Sender<Op>,
    timeout: Duration,
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Op")
    }
}

impl Client {
    /// Connects and starts the connection task.
    pub async fn connect(
        addr: impl ToSocketAddrs,
        config: ClientConfig,
    ) -> Result<Client, ClientError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(ClientError::Connect)?;
        let (ops, rx) = mpsc::channel(QUEUE_DEPTH);
        let timeout = config.timeout;
        tokio::spawn(run_connection(stream, config, rx));
        Ok(Client { ops, timeout })
    }

    /// Calls `service.method` with `request`, and waits for the reply.
    pub async fn call<M: Message>(
        &self,
        service: &str,
        method: &str,
        request: &M,
    ) -> Result<Reply, ClientError> {
        self.call_raw(
            service,
            method,
            request.encode_to_vec().into(),
            HashMap::new(),
        )
        .await
    }

    /// Calls with an already encoded application message and envelope metadata.
    pub async fn call_raw(
        &self,
        service: &str,
        method: &str,
        inner: Bytes,
        metadata: HashMap<String, String>,
    ) -> Result<Reply, ClientError> {
        let (tx, rx) = oneshot::channel();
        let op = Op::Call {
            service: service.to_owned(),
            method: method.to_owned(),
            inner,
            metadata,
            reply: tx,
        };
        self.submit(op, rx).await
    }

    /// Sends a heartbeat and waits for the peer's.
    pub async fn heartbeat(&self) -> Result<Heartbeat, ClientError> {
        let (tx, rx) = oneshot::channel();
        self.submit(Op::Heartbeat { reply: tx }, rx).await
    }

    async fn submit<T>(
        &self,
        op: Op,
        rx: oneshot::Receiver<Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        let closed = || ClientError::Closed(ConnectionEnd::TaskEnded);
        self.ops.send(op).await.map_err(|_| closed())?;
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(closed()),
            Err(_) => Err(ClientError::Timeout(self.timeout)),
        }
    }
}

async fn run_connection(stream: TcpStream, config: ClientConfig, mut ops: mpsc::Receiver<Op>) {
    let mut io = FramedIo::new(stream, FrameCodec::new(config.max_body_len));
    let mut codec = CallCodec::new(config.compression, config.max_inflated);
    let flags = config.flags();
    let mut waiting: HashMap<u64, Waiter> = HashMap::new();
    let mut next_id: u64 = 1;
    let mut ops_open = true;
    // `None`: every handle was dropped and no call was left waiting.
    let end = loop {
        if !ops_open && waiting.is_empty() {
            break None;
        }
        tokio::select! {
            biased;
            ev = io.wait_io(true) => match ev {
                Ok(IoEvent::Read) => {
                    if let Err(end) = read_replies(&mut io, &mut codec, &mut waiting) {
                        break Some(end);
                    }
                    if io.is_eof() {
                        break Some(ConnectionEnd::ClosedByPeer);
                    }
                }
                Ok(IoEvent::Wrote) => {}
                Err(e) => break Some(ConnectionEnd::Io(Arc::new(e))),
            },
            op = ops.recv(), if ops_open => match op {
                None => ops_open = false,
                Some(op) => {
                    let id = next_id;
                    next_id = next_id.wrapping_add(1);
                    match op {
                        Op::Call { service, method, inner, metadata, reply } => {
                            match codec.put_request_raw(io.wbuf(), id, flags, service.as_bytes(), method.as_bytes(), &inner, &metadata) {
                                Ok(_) => { waiting.insert(id, Waiter::Call(reply)); }
                                Err(e) => drop(reply.send(Err(e.into()))),
                            }
                        }
                        Op::Heartbeat { reply } => {
                            match Heartbeat::put_now(io.wbuf(), id, "client", "rpcmesh-client") {
                                Ok(()) => { waiting.insert(id, Waiter::Heartbeat(reply)); }
                                Err(e) => drop(reply.send(Err(e.into()))),
                            }
                        }
                    }
                    if waiting.len() > PURGE_AT {
                        waiting.retain(|_, w| !w.is_closed());
                    }
                }
            },
        }
        if let Err(e) = io.try_flush() {
            break Some(ConnectionEnd::Io(Arc::new(e)));
        }
    };
    if let Some(end) = end {
        for (_, w) in waiting.drain() {
            w.fail(ClientError::Closed(end.clone()));
        }
    }
}

fn read_replies(
    io: &mut FramedIo,
    codec: &mut CallCodec,
    waiting: &mut HashMap<u64, Waiter>,
) -> Result<(), ConnectionEnd> {
    loop {
        let frame = match io.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(()),
            Err(e) if !e.is_fatal() => {
                tracing::warn!(error = %e, "client skipped a bad frame");
                continue;
            }
            Err(e) => return Err(ConnectionEnd::BadFrames(e)),
        };
        let Some(w) = waiting.remove(&frame.header.req_id) else {
            tracing::debug!(req_id = frame.header.req_id, "reply for no waiting call");
            continue;
        };
        match (w, frame.header.msg_type) {
            (Waiter::Call(tx), MsgType::Response) => {
                let r = codec.decode_response(&frame).map(|r: IncomingReply| Reply {
                    status: r.status,
                    success: r.rpc.success,
                    error_msg: r.rpc.error_msg,
                    payload: r.rpc.payload,
                    compressed: frame.header.flags.contains(Flags::COMPRESSED),
                });
                let _ = tx.send(r.map_err(ClientError::from));
            }
            (Waiter::Heartbeat(tx), MsgType::Heartbeat) => {
                let _ = tx.send(Heartbeat::parse(&frame.body).map_err(ClientError::from));
            }
            (w, t) => w.fail(ClientError::WrongFrame(t)),
        }
    }
}
