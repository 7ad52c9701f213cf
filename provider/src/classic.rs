//! The classic server (`provider --classic`): a plain RPCF v1 server that behaves as the
//! original RPCF framework's server does, so that the broker can be measured and tested
//! behind the servers it must front as they are, not as rpcmesh's provider would be.
//!
//! What makes it classic, each on purpose: the habits of the original framework's server,
//! as its published benchmark runs it (docs/broker.md, "Plain v1 servers", says how the
//! broker meets them):
//!
//! - **Nagle's algorithm stays on**: `TCP_NODELAY` is never set on an accepted socket
//!   ([`FramedIo::keeping_nagle`]). A small reply written while an earlier one is still
//!   unacknowledged waits in the kernel for that ACK.
//! - **One call at a time per connection, in order**: a request is taken from the read
//!   buffer, answered, and its reply written in full before the next request is looked at,
//!   even one already read. Nothing more is read from the socket until every request
//!   already read has been answered and written.
//! - **One write per reply frame** (the framework's "one `writev` per frame"): replies are
//!   never gathered into one write, as rpcmesh's provider gathers them.
//! - **Plain v1 frames only**: `EchoService.Echo` answers an `EchoResponse` with the
//!   request's message; an unknown service is answered status 1 `service not found:
//!   <name>`, an unknown method status 1 `method not found: <service>.<method>`, a
//!   heartbeat with a heartbeat of the same id (the broker's pool checks connections with
//!   them). rpcmesh's flag bits are not understood: such a request (a v1 server reads its
//!   type byte as unknown) is answered status 1 `bad request: …` and counted
//!   `unknown_type`; replies never carry flags, and statuses are v1's (0, 1, 2).
//!
//! What it shares with the provider: the accept loop (connection cap, drain on shutdown,
//! [`rpcmesh_common::net::listener`]), the framed connection and its codec (so bad input
//! is met as everywhere: counted, logged thinned, answered where a request id is known,
//! the connection closed when the stream cannot be resynchronised), the connection's
//! idle, frame and write timeouts, the memory budget and the provider's metric families
//! (`role="provider"`). What it leaves out, as a v1 server has none of it: compression,
//! extended statuses, simulated service times, and the in-flight cap (a connection never
//! has more than one call being answered).
//!
//! Shutdown: the listener closes; each connection answers the requests it has already
//! read, then keeps answering what still arrives until it has been idle for
//! [`DRAIN_LINGER`], and closes. When the grace period ends, a connection still writing
//! (to a peer that does not read) closes at once.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rpcmesh_common::metrics::{BadInputLog, ErrorKind, Side, Telemetry};
use rpcmesh_common::net::connection::{CloseReason, FramedIo};
use rpcmesh_common::net::listener::ServeSummary;
use rpcmesh_common::net::session::{DRAIN_LINGER, Stop};
use rpcmesh_wire::Status;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::envelope::{CallCodec, put_error_response};
use rpcmesh_wire::frame::{Flags, Frame, FrameError, MsgType};
use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use crate::ProviderConfig;
use crate::metrics::ProviderMetrics;
use crate::service::{Lookup, MethodId, Outcome, Registry, ServiceError, echo};
use crate::session::Shared;

/// The services of the classic server: `EchoService.Echo`, the one the original
/// framework's benchmark calls.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(echo::SERVICE, echo::METHOD, echo::echo);
    r
}

/// Serves `EchoService.Echo` the classic way on `listener` until `shutdown` resolves, then
/// drains (see the module doc). `config` gives the listener's connection cap and grace
/// period, the frame limit, the connection timeouts, the memory budget and the node id;
/// its compression, service time and in-flight cap do not apply.
pub async fn run(
    config: ProviderConfig,
    telemetry: Telemetry,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> ServeSummary {
    run_with(config, registry(), telemetry, listener, shutdown).await
}

/// As [`run`], with the services given (answered one at a time all the same: a handler
/// that returns a future is waited for before anything else on its connection).
pub async fn run_with(
    config: ProviderConfig,
    registry: Registry,
    telemetry: Telemetry,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> ServeSummary {
    // No stage is timed: the classic server stands for a program without rpcmesh's stages.
    let metrics = ProviderMetrics::new(telemetry, &registry, 0);
    tracing::info!(
        addr = listener.local_addr().ok().map(tracing::field::display),
        services = %registry.services().join(","),
        "classic plain RPCF v1 server listening (Nagle on, one call at a time per connection)"
    );
    let summary =
        crate::serve_connections(config, registry, metrics, listener, shutdown, serve).await;
    tracing::info!(
        accepted = summary.accepted,
        refused = summary.refused,
        cut = summary.cut,
        aborted = summary.aborted,
        "classic server stopped"
    );
    summary
}

/// Serves one connection until the caller leaves, the input is beyond repair, a timeout
/// passes, or shutdown drained it; returns why it closed.
async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    _via: rpcmesh_common::net::listener::Via,
    shared: Arc<Shared>,
    stop: Stop,
) -> CloseReason {
    let io = FramedIo::keeping_nagle(stream, FrameCodec::new(shared.config.max_body_len))
        .with_budget(Some(shared.budget.clone()));
    let span = tracing::debug_span!("classic", %peer);
    let conn = Conn {
        // Replies are never compressed: a plain v1 caller could not read them.
        calls: shared.config.call_codec(None),
        bad_input: BadInputLog::new(shared.metrics.errors.clone(), Side::Client),
        scratch: BytesMut::with_capacity(1024),
        io,
        shared,
    };
    let reason = conn.run(stop).instrument(span.clone()).await;
    tracing::debug!(parent: &span, reason = reason.label(), "connection closed");
    reason
}

/// One connection: its socket, and what answering its calls needs.
struct Conn {
    io: FramedIo,
    calls: CallCodec,
    bad_input: BadInputLog,
    /// The handler's encoded answer, reused.
    scratch: BytesMut,
    shared: Arc<Shared>,
}

impl Conn {
    async fn run(mut self, stop: Stop) -> CloseReason {
        let timeouts = self.shared.config.timeouts;
        let mut draining = false;
        loop {
            // Every whole frame already read, one at a time: answered and written before
            // the next is looked at.
            loop {
                match self.io.next_frame() {
                    Ok(Some(frame)) => self.answer(frame).await,
                    Ok(None) => break,
                    Err(e) => {
                        if let Some((id, _)) = self.bad_input.record(&e) {
                            put_error_response(
                                self.io.wbuf(),
                                id,
                                Flags::NONE,
                                Status::BadRequest,
                                &e.to_string(),
                            );
                        }
                        if e.is_fatal() {
                            // The error reply, if any, goes out before the close.
                            let _ = self.write_out(&stop, timeouts.write).await;
                            return CloseReason::BadInput;
                        }
                    }
                }
                if let Err(reason) = self.write_out(&stop, timeouts.write).await {
                    return reason;
                }
            }
            self.io.account();
            if self.io.is_eof() {
                return CloseReason::Peer;
            }
            // Then, and only then, the socket is read again.
            let partial = self.io.has_partial_frame();
            let wait = if draining {
                DRAIN_LINGER
            } else if partial {
                timeouts.frame
            } else {
                timeouts.idle
            };
            tokio::select! {
                biased;
                () = stop.drain.cancelled(), if !draining => draining = true,
                () = stop.grace_over.cancelled() => return CloseReason::Shutdown,
                r = tokio::time::timeout(wait, self.io.wait_io(true)) => match r {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "socket error");
                        return CloseReason::Error;
                    }
                    Err(_) if draining => return CloseReason::Shutdown,
                    Err(_) if partial => return CloseReason::FrameTimeout,
                    Err(_) => return CloseReason::IdleTimeout,
                },
            }
        }
    }

    /// Writes the reply in the write buffer (one frame, or none) before anything else
    /// happens on this connection: one `write` when the socket takes it whole. Fails on a
    /// socket error, when the peer takes nothing for `limit`, or when the grace period
    /// ends meanwhile.
    async fn write_out(&mut self, stop: &Stop, limit: Duration) -> Result<(), CloseReason> {
        while self.io.pending_write() > 0 {
            tokio::select! {
                biased;
                () = stop.grace_over.cancelled() => return Err(CloseReason::Shutdown),
                r = tokio::time::timeout(limit, self.io.wait_io(false)) => match r {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "write failed");
                        return Err(CloseReason::Error);
                    }
                    Err(_) => return Err(CloseReason::WriteTimeout),
                },
            }
        }
        self.shared.metrics.wire.add(self.io.take_counts());
        Ok(())
    }

    /// Puts the answer to one frame in the write buffer (nothing for a frame that gets
    /// none: a response sent to a server is counted and dropped).
    async fn answer(&mut self, frame: Frame) {
        let id = frame.header.req_id;
        match frame.header.msg_type {
            MsgType::Heartbeat => {
                if let Err(e) = Heartbeat::parse(&frame.body) {
                    self.bad_input.record(&e);
                }
                let node_id = &self.shared.config.node_id;
                if let Err(e) = Heartbeat::put_now(self.io.wbuf(), id, "provider", node_id) {
                    tracing::warn!(error = %e, "heartbeat reply not encodable (node id too long?)");
                }
            }
            MsgType::Response => self.bad_input.unexpected(),
            MsgType::Request | MsgType::ExtRequest
                if !frame.header.flags.is_empty()
                    || frame.header.msg_type == MsgType::ExtRequest =>
            {
                // A v1 server knows no flag bits: to it this is a frame of unknown type.
                let e = FrameError::UnknownType {
                    req_id: id,
                    raw_type: frame.header.raw_type(),
                };
                self.bad_input.record(&e);
                let msg = format!(
                    "plain RPCF v1 server: flag bits 0x{:02x} not understood",
                    frame.header.flags.bits()
                );
                self.reply_error(id, None, Status::BadRequest, &msg);
            }
            MsgType::Request | MsgType::ExtRequest => self.call(frame).await,
        }
    }

    /// Answers one call.
    async fn call(&mut self, frame: Frame) {
        let id = frame.header.req_id;
        let m = &self.shared.metrics;
        if self.shared.budget.refuses(frame.body.len()) {
            m.errors.inc(ErrorKind::Overloaded, Side::Provider);
            let msg = format!(
                "provider memory budget of {} MiB spent",
                self.shared.budget.limit() >> 20
            );
            return self.reply_error(id, None, Status::Overloaded, &msg);
        }
        let call = match self.calls.decode_request(&frame) {
            Ok(c) => c,
            Err(e) => {
                m.errors.inc(ErrorKind::of_call(&e), Side::Client);
                return self.reply_error(id, None, Status::BadRequest, &e.to_string());
            }
        };
        m.payload.received(call.size);
        let shared = self.shared.clone();
        let (handler, method) = match shared
            .registry
            .lookup(&call.request.service, &call.request.method)
        {
            Lookup::Found(h, method) => (h, method),
            miss => {
                let (service, method) = (call.request.service_name(), call.request.method_name());
                if let Some((kind, msg)) = miss.not_found(service, method) {
                    shared.metrics.errors.inc(kind, Side::Client);
                    self.reply_error(id, None, Status::Failed, &msg);
                }
                return;
            }
        };
        self.scratch.clear();
        let result = match handler.call(call.rpc, &mut self.scratch) {
            // No simulated service time here: an answer made is an answer sent.
            Outcome::Ready(r) | Outcome::At(_, r) => r,
            // One call at a time: nothing else on this connection until it is done.
            Outcome::Later(fut) => fut.await.map(|answer| {
                self.scratch.clear();
                self.scratch.extend_from_slice(&answer);
            }),
        };
        match result {
            Ok(()) => self.reply_ok(id, method),
            Err(e) => {
                let (kind, side) = match e {
                    ServiceError::BadPayload { .. } => (ErrorKind::Decode, Side::Client),
                    ServiceError::Failed(_) => (ErrorKind::Failed, Side::Provider),
                };
                shared.metrics.errors.inc(kind, side);
                self.reply_error(id, Some(method), e.status(), &e.to_string());
            }
        }
    }

    fn reply_ok(&mut self, id: u64, method: MethodId) {
        let answer = std::mem::take(&mut self.scratch);
        let m = &self.shared.metrics;
        match self
            .calls
            .put_ok_response(self.io.wbuf(), id, Flags::NONE, &answer)
        {
            Ok(size) => {
                m.payload.sent(size);
                m.calls(Some(method)).inc(Status::Success);
            }
            Err(FrameError::TooLarge { body_len, max, .. }) => {
                m.errors.inc(ErrorKind::TooLarge, Side::Provider);
                let msg = format!("reply of {body_len} bytes exceeds the frame limit of {max}");
                self.reply_error(id, Some(method), Status::Failed, &msg);
            }
            Err(e) => {
                tracing::warn!(error = %e, "reply not encodable");
                self.reply_error(id, Some(method), Status::Failed, &e.to_string());
            }
        }
        self.scratch = answer;
    }

    /// A failure reply, in v1 form (status 1 or 2; the request carried no flags), counted
    /// by status.
    fn reply_error(&mut self, id: u64, method: Option<MethodId>, status: Status, msg: &str) {
        put_error_response(self.io.wbuf(), id, Flags::NONE, status, msg);
        self.shared.metrics.calls(method).inc(status);
    }
}
