//! One caller's connection to the provider (a broker's pooled connection, or a client's):
//! reads request frames, decodes the calls, runs their handlers and writes each reply as it
//! finishes, batched into as few writes as the socket allows. Answers heartbeats, sheds
//! over the in-flight cap, and turns bad input into error replies, counts and log lines.
//!
//! One task owns the socket, the calls waiting on handlers and the write buffer; nothing
//! here is shared with other connections but the read-only registry and metric handles.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::stream::{FuturesUnordered, StreamExt};
use rpcmesh_common::Status;
use rpcmesh_common::call::{CallCodec, put_error_response, service_not_found};
use rpcmesh_common::codec::FrameCodec;
use rpcmesh_common::frame::{Flags, Frame, FrameError, Heartbeat, MsgType};
use rpcmesh_common::io::{FramedIo, IoEvent};
use rpcmesh_common::listener::Drain;
use rpcmesh_common::shutdown::CancellationToken;
use rpcmesh_common::telemetry::{BadInputLog, ErrorKind, Sampler, Stages};
use tokio::net::TcpStream;
use tracing::Instrument;

use crate::ProviderConfig;
use crate::metrics::{DECODE, ENCODE, HANDLER, ProviderMetrics, QUEUE, TOTAL};
use crate::service::{HandlerFuture, Lookup, MethodId, Outcome, Registry, ServiceError};

/// Replies waiting to be written beyond which the session stops reading requests until
/// the caller reads: 8 MiB, so a caller that stops reading cannot make us buffer without
/// end, while a fast one never hits it.
pub const WRITE_BACKLOG_LIMIT: usize = 8 * 1024 * 1024;
/// How long a closing session waits to deliver its last replies (e.g. the error reply to a
/// too-large frame) before dropping the socket.
pub const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// What every session of one provider shares (read-only).
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: ProviderConfig,
    pub registry: Registry,
    pub metrics: ProviderMetrics,
}

/// Serves one connection until the caller leaves, the input is beyond repair, or shutdown
/// drained it.
pub(crate) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
) {
    let span = tracing::debug_span!("conn", %peer);
    async move {
        let mut session = Session::new(stream, shared);
        let end = session.run(&shutdown).await;
        match &end {
            Ok(()) => tracing::debug!("connection closed"),
            Err(e) => tracing::debug!(error = %e, "connection ended"),
        }
        // Deliver what is already answered (e.g. the error reply to a bad frame).
        let _ = tokio::time::timeout(FINAL_FLUSH_TIMEOUT, session.io.shutdown()).await;
        session.report();
        session.report_in_flight(0);
    }
    .instrument(span)
    .await
}

/// Why a session ended early.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("input beyond repair: {0}")]
    BadInput(FrameError),
}

struct Session {
    io: FramedIo,
    calls: CallCodec,
    shared: Arc<Shared>,
    pending: FuturesUnordered<Pending>,
    scratch: BytesMut,
    draining: bool,
    drain: Drain,
    in_flight_reported: usize,
    bad_input: BadInputLog,
    /// Read times of the timed calls answered this round (for the `total` stage).
    answered: Vec<Instant>,
    /// Picks the calls whose stages are timed.
    sampler: Sampler,
    /// The registry index of the last call's method.
    last_method: Option<MethodId>,
}

impl Session {
    fn new(stream: TcpStream, shared: Arc<Shared>) -> Self {
        let c = &shared.config;
        Session {
            io: FramedIo::new(stream, FrameCodec::new(c.max_body_len)),
            calls: CallCodec::new(c.compression, c.max_inflated)
                .timed(shared.metrics.compression.clone())
                .with_max_body(c.max_body_len),
            pending: FuturesUnordered::new(),
            scratch: BytesMut::with_capacity(1024),
            draining: false,
            drain: Drain::default(),
            in_flight_reported: 0,
            bad_input: BadInputLog::default(),
            answered: Vec::new(),
            sampler: shared.metrics.stages.sampler(),
            last_method: None,
            shared,
        }
    }

    async fn run(&mut self, shutdown: &CancellationToken) -> Result<(), SessionError> {
        loop {
            let reading = !self.io.is_eof() && self.io.pending_write() < WRITE_BACKLOG_LIMIT;
            tokio::select! {
                biased;
                Some(done) = self.pending.next(), if !self.pending.is_empty() => {
                    self.finish(done);
                    // Collect every other answer that is ready, for one write.
                    while let Some(Some(done)) = futures_util::FutureExt::now_or_never(self.pending.next()) {
                        self.finish(done);
                    }
                }
                ev = self.io.wait_io(reading) => {
                    if let IoEvent::Read = ev? {
                        self.take_frames()?;
                    }
                }
                () = self.drain.lingered(), if self.draining => {}
                () = shutdown.cancelled(), if !self.draining => {
                    tracing::debug!(in_flight = self.pending.len(), "draining");
                    self.draining = true;
                }
            }
            self.io.try_flush()?;
            self.record_totals();
            self.report();
            self.report_in_flight(self.pending.len());
            let idle = self.pending.is_empty() && self.io.pending_write() == 0;
            if idle && self.io.is_eof() {
                return Ok(());
            }
            if self.drain.should_close(self.draining, idle) {
                return Ok(());
            }
        }
    }

    /// Handles every whole frame read so far.
    fn take_frames(&mut self) -> Result<(), SessionError> {
        // One timestamp per read, taken only when stages are recorded at all.
        let read_at = self.shared.metrics.stages.on().then(Instant::now);
        loop {
            match self.io.next_frame() {
                Ok(Some(frame)) => self.on_frame(frame, read_at),
                Ok(None) => return Ok(()),
                Err(e) => {
                    self.on_bad_input(&e);
                    if e.is_fatal() {
                        return Err(SessionError::BadInput(e));
                    }
                }
            }
        }
    }

    fn on_bad_input(&mut self, e: &FrameError) {
        if let Some((id, flags)) = self
            .bad_input
            .record(e, &self.shared.metrics.errors, "caller")
        {
            self.reply_error(id, flags, None, Status::BadRequest, &e.to_string());
        }
    }

    fn on_frame(&mut self, frame: Frame, read_at: Option<Instant>) {
        match frame.header.msg_type {
            MsgType::Request => {
                // Only a sample of the calls is timed.
                let read_at = read_at.filter(|_| self.sampler.pick());
                if self.on_request(frame, read_at) {
                    self.answered.extend(read_at);
                }
            }
            MsgType::Heartbeat => self.on_heartbeat(&frame),
            MsgType::Response => {
                self.shared.metrics.errors.inc(ErrorKind::Unexpected);
                tracing::debug!(
                    req_id = frame.header.req_id,
                    "response frame from a caller dropped"
                );
            }
        }
    }

    fn on_heartbeat(&mut self, frame: &Frame) {
        if let Err(e) = Heartbeat::parse(&frame.body) {
            self.on_bad_input(&e);
        }
        let node_id = &self.shared.config.node_id;
        if let Err(e) = Heartbeat::put_now(self.io.wbuf(), frame.header.req_id, "provider", node_id)
        {
            tracing::warn!(error = %e, "heartbeat reply not encodable (node id too long?)");
        }
    }

    /// Serves one request; true when it was answered now (false: a handler works on it).
    /// `read_at` is set when this call's stages are timed.
    fn on_request(&mut self, frame: Frame, read_at: Option<Instant>) -> bool {
        let stamp = || read_at.map(|_| Instant::now());
        let (id, flags) = (frame.header.req_id, frame.header.flags);
        if self.draining {
            self.reply_error(
                id,
                flags,
                None,
                Status::Unavailable,
                "provider shutting down",
            );
            return true;
        }
        let cap = self.shared.config.max_in_flight_per_conn;
        if self.pending.len() >= cap {
            self.shared.metrics.errors.inc(ErrorKind::Overloaded);
            let msg = format!("provider has {cap} calls in flight on this connection");
            self.reply_error(id, flags, None, Status::Overloaded, &msg);
            return true;
        }
        let started = stamp();
        let call = match self.calls.decode_request(&frame) {
            Ok(c) => c,
            Err(e) => {
                self.shared.metrics.errors.inc(ErrorKind::of_call(&e));
                self.reply_error(id, flags, None, Status::BadRequest, &e.to_string());
                return true;
            }
        };
        let decoded = stamp();
        let stages = &self.shared.metrics.stages;
        stage(stages, QUEUE, read_at, started);
        stage(stages, DECODE, started, decoded);
        let shared = &*self.shared;
        shared.metrics.payload.received(call.size);
        // Most connections call one method over and over: try the last one first (its
        // names are the registry's, so nothing is copied or kept from the read buffer).
        let registry = &shared.registry;
        let lookup = match self.last_method {
            Some(id) if registry.is_method(id, &call.request.service, &call.request.method) => {
                Lookup::Found(registry.handler(id), id)
            }
            _ => registry.lookup(&call.request.service, &call.request.method),
        };
        let (handler, method) = match lookup {
            Lookup::Found(h, m) => {
                self.last_method = Some(m);
                (h, m)
            }
            Lookup::NoService => {
                shared.metrics.errors.inc(ErrorKind::UnknownService);
                let msg = service_not_found(call.request.service_name());
                self.reply_error(id, flags, None, Status::Failed, &msg);
                return true;
            }
            Lookup::NoMethod => {
                shared.metrics.errors.inc(ErrorKind::UnknownMethod);
                let msg = format!(
                    "method not found: {}.{}",
                    call.request.service_name(),
                    call.request.method_name()
                );
                self.reply_error(id, flags, None, Status::Failed, &msg);
                return true;
            }
        };
        self.scratch.clear();
        let outcome = handler.call(call.rpc, &mut self.scratch);
        match outcome {
            Outcome::Ready(Ok(())) => {
                let handled = stamp();
                let answer = std::mem::take(&mut self.scratch);
                self.reply_ok(id, flags, method, &answer);
                self.scratch = answer;
                let stages = &self.shared.metrics.stages;
                stage(stages, HANDLER, decoded, handled);
                stage(stages, ENCODE, handled, stamp());
            }
            Outcome::Ready(Err(e)) => self.reply_service_error(id, flags, method, &e),
            Outcome::Later(fut) => {
                self.pending.push(Pending {
                    fut,
                    meta: CallMeta {
                        req_id: id,
                        flags,
                        method,
                        read_at,
                        decoded,
                    },
                });
                return false;
            }
        }
        true
    }

    fn finish(&mut self, (done, result): (CallMeta, Result<Bytes, ServiceError>)) {
        let stamp = || done.read_at.map(|_| Instant::now());
        let handled = stamp();
        stage(&self.shared.metrics.stages, HANDLER, done.decoded, handled);
        match result {
            Ok(answer) => {
                self.reply_ok(done.req_id, done.flags, done.method, &answer);
                stage(&self.shared.metrics.stages, ENCODE, handled, stamp());
            }
            Err(e) => self.reply_service_error(done.req_id, done.flags, done.method, &e),
        }
        self.answered.extend(done.read_at);
    }

    /// Records the total time of every timed call answered this round, once its reply
    /// has been handed to the socket.
    fn record_totals(&mut self) {
        if self.answered.is_empty() {
            return;
        }
        let now = Instant::now();
        for read_at in self.answered.drain(..) {
            self.shared.metrics.stages.record_span(TOTAL, read_at, now);
        }
    }

    fn reply_ok(&mut self, id: u64, flags: Flags, method: MethodId, answer: &[u8]) {
        let m = &self.shared.metrics;
        match self
            .calls
            .put_ok_response(self.io.wbuf(), id, flags, answer)
        {
            Ok(size) => {
                m.payload.sent(size);
                m.calls(Some(method)).inc(Status::Success);
            }
            // A reply over the frame limit would be refused by the caller (a broker would
            // lose it): the codec has left it unwritten; answer "failed".
            Err(FrameError::TooLarge { body_len, max, .. }) => {
                m.errors.inc(ErrorKind::TooLarge);
                let msg = format!("reply of {body_len} bytes exceeds the frame limit of {max}");
                self.reply_error(id, flags, Some(method), Status::Failed, &msg);
            }
            Err(e) => {
                tracing::warn!(error = %e, "reply not encodable");
                self.reply_error(
                    id,
                    flags,
                    Some(method),
                    Status::Failed,
                    &format!("reply not encodable: {e}"),
                );
            }
        }
    }

    fn reply_service_error(&mut self, id: u64, flags: Flags, method: MethodId, e: &ServiceError) {
        if let ServiceError::BadPayload { .. } = e {
            self.shared.metrics.errors.inc(ErrorKind::Decode);
        }
        self.reply_error(id, flags, Some(method), e.status(), &e.to_string());
    }

    fn reply_error(
        &mut self,
        id: u64,
        flags: Flags,
        method: Option<MethodId>,
        status: Status,
        msg: &str,
    ) {
        put_error_response(self.io.wbuf(), id, flags, status, msg);
        self.shared.metrics.calls(method).inc(status);
    }

    /// Adds this round's byte counts to the metrics.
    fn report(&mut self) {
        self.shared.metrics.wire.add(self.io.take_counts());
    }

    fn report_in_flight(&mut self, now: usize) {
        if now != self.in_flight_reported {
            let delta = now as f64 - self.in_flight_reported as f64;
            self.shared.metrics.in_flight.increment(delta);
            self.in_flight_reported = now;
        }
    }
}

/// Records a stage when both ends were stamped.
fn stage(stages: &Stages, which: usize, from: Option<Instant>, to: Option<Instant>) {
    if let (Some(f), Some(t)) = (from, to) {
        stages.record_span(which, f, t);
    }
}

/// What the reply to a call needs besides the handler's answer.
#[derive(Clone, Copy)]
struct CallMeta {
    req_id: u64,
    flags: Flags,
    method: MethodId,
    read_at: Option<Instant>,
    decoded: Option<Instant>,
}

/// A call whose handler answers later.
struct Pending {
    fut: HandlerFuture,
    meta: CallMeta,
}

impl Future for Pending {
    type Output = (CallMeta, Result<Bytes, ServiceError>);
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let result = std::task::ready!(self.fut.as_mut().poll(cx));
        Poll::Ready((self.meta, result))
    }
}
