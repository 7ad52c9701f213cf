//! One client connection to the broker: reads request frames, reads only their service
//! and method names, sheds over the in-flight caps, routes each call to a provider
//! connection, and writes each reply back under the caller's request id as it comes,
//! batched into as few writes as the socket allows.
//!
//! One task owns the socket, the write buffer and the session's count of calls in flight.
//! Replies reach it through its own channel from the upstream connections' tasks.

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rpcmesh_common::Status;
use rpcmesh_common::busy_poll::Activity;
use rpcmesh_common::call::{put_error_response, service_not_found};
use rpcmesh_common::codec::FrameCodec;
use rpcmesh_common::frame::{
    Flags, Frame, FrameError, Heartbeat, MsgType, put_forwarded_response, request_names,
    request_service,
};
use rpcmesh_common::io::{FramedIo, IoEvent};
use rpcmesh_common::listener::Drain;
use rpcmesh_common::shutdown::CancellationToken;
use rpcmesh_common::telemetry::{BadInputLog, CallCounters, ErrorKind, Sampler};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::BrokerConfig;
use crate::call::{CallInfo, Forward, Reply};
use crate::metrics::{ADMIT, BrokerMetrics, TOTAL, WRITE_BACK};
use crate::route::{NoRoute, Picker, Router};

/// Replies waiting to be written beyond which the session stops reading requests until
/// the caller reads (8 MiB): a caller that stops reading cannot make the broker buffer
/// without end.
pub const WRITE_BACKLOG_LIMIT: usize = 8 * 1024 * 1024;
/// Replies taken from the channel per round before the socket is served again.
const REPLY_BATCH: usize = 1024;
/// Times the session lets the other ready tasks run before writing, while each turn
/// brings more replies (replies from several upstream connections then share a write).
const GATHER_YIELDS: usize = 1;
/// Tag bit of a call whose (service, method) has no labels yet.
const PENDING: u32 = 1 << 31;
/// How often a call handed back unsent (its connection closed) is routed again.
const MAX_RETRIES: u8 = 2;
/// How long a closing session waits to deliver its last replies.
const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// What every session of one broker shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: BrokerConfig,
    pub router: Router,
    pub metrics: BrokerMetrics,
    /// Calls in flight in the whole broker (the global shedding cap).
    pub in_flight: AtomicUsize,
    /// Reads are reported here when the broker busy-polls.
    pub activity: Option<Arc<Activity>>,
    /// The shedding replies' messages, written once: shedding happens under overload,
    /// when a per-call allocation costs most.
    pub shed: ShedMessages,
}

/// The messages of the two shedding replies (they name the configured caps).
#[derive(Debug)]
pub(crate) struct ShedMessages {
    per_conn: String,
    total: String,
}

impl ShedMessages {
    pub fn new(config: &BrokerConfig) -> Self {
        ShedMessages {
            per_conn: format!(
                "broker has {} calls in flight on this connection",
                config.max_in_flight_per_conn
            ),
            total: format!("broker has {} calls in flight", config.max_in_flight),
        }
    }
}

pub(crate) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
) {
    let span = tracing::debug_span!("client", %peer);
    async move {
        let mut s = Session::new(stream, shared);
        let end = s.run(&shutdown).await;
        match &end {
            Ok(()) => tracing::debug!("connection closed"),
            Err(e) => tracing::debug!(error = %e, "connection ended"),
        }
        // Calls still in flight when the caller left: their replies find no one; count
        // them out of the global cap as they would have been.
        s.forget_in_flight();
        let _ = tokio::time::timeout(FINAL_FLUSH_TIMEOUT, s.io.shutdown()).await;
        s.report();
    }
    .instrument(span)
    .await
}

#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("input beyond repair: {0}")]
    BadInput(FrameError),
}

struct Session {
    io: FramedIo,
    shared: Arc<Shared>,
    replies_tx: mpsc::UnboundedSender<Reply>,
    replies: mpsc::UnboundedReceiver<Reply>,
    picker: Picker,
    in_flight: usize,
    in_flight_reported: usize,
    draining: bool,
    drain: Drain,
    bad_input: BadInputLog,
    /// (service, method) bytes → tag; tag → counters.
    tags: HashMap<Bytes, u32>,
    counters: Vec<Arc<CallCounters>>,
    /// The names and tag of the last labelled call.
    last_tag: Option<(Bytes, u32)>,
    /// Names of calls in flight whose (service, method) has no labels yet.
    unlabelled: Vec<Option<(Bytes, usize)>>,
    /// (read, reply read) times of the timed calls answered this round, for the stages.
    written: Vec<(Instant, Option<Instant>)>,
    /// Picks the calls whose stages are timed.
    sampler: Sampler,
}

impl Session {
    fn new(stream: TcpStream, shared: Arc<Shared>) -> Self {
        let (replies_tx, replies) = mpsc::unbounded_channel();
        Session {
            io: FramedIo::new(stream, FrameCodec::new(shared.config.max_body_len))
                .with_activity(shared.activity.clone()),
            replies_tx,
            replies,
            picker: Picker::new(),
            in_flight: 0,
            in_flight_reported: 0,
            draining: false,
            drain: Drain::default(),
            bad_input: BadInputLog::default(),
            tags: HashMap::new(),
            counters: vec![shared.metrics.calls_other()],
            written: Vec::new(),
            unlabelled: Vec::new(),
            last_tag: None,
            sampler: shared.metrics.stages.sampler(),
            shared,
        }
    }

    async fn run(&mut self, shutdown: &CancellationToken) -> Result<(), SessionError> {
        loop {
            let reading = !self.io.is_eof() && self.io.pending_write() < WRITE_BACKLOG_LIMIT;
            tokio::select! {
                biased;
                Some(r) = self.replies.recv() => self.on_reply(r),
                ev = self.io.wait_io(reading) => {
                    if let IoEvent::Read = ev? {
                        self.take_frames()?;
                    }
                }
                () = self.drain.lingered(), if self.draining => {}
                () = shutdown.cancelled(), if !self.draining => {
                    tracing::debug!(in_flight = self.in_flight, "draining");
                    self.draining = true;
                }
            }
            // Replies that came meanwhile leave in the same write; before writing, when
            // more replies are due on this connection, let the other ready tasks run once,
            // so that upstream connections woken by the same poll add theirs.
            self.take_replies();
            if self.io.pending_write() > 0 && self.in_flight > 0 {
                for _ in 0..GATHER_YIELDS {
                    tokio::task::yield_now().await;
                    if self.take_replies() == 0 {
                        break;
                    }
                }
            }
            self.io.try_flush()?;
            self.record_stages();
            self.report();
            let idle = self.in_flight == 0 && self.io.pending_write() == 0;
            if idle && self.io.is_eof() {
                return Ok(());
            }
            if self.drain.should_close(self.draining, idle) {
                return Ok(());
            }
        }
    }

    /// Handles the replies arrived so far (up to a batch).
    fn take_replies(&mut self) -> usize {
        for n in 0..REPLY_BATCH {
            match self.replies.try_recv() {
                Ok(r) => self.on_reply(r),
                Err(_) => return n,
            }
        }
        REPLY_BATCH
    }

    /// Handles every whole frame read so far.
    fn take_frames(&mut self) -> Result<(), SessionError> {
        let now = Instant::now();
        self.picker.new_batch();
        loop {
            match self.io.next_frame() {
                Ok(Some(frame)) => self.on_frame(frame, now),
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
            .record(e, &self.shared.metrics.errors, "client")
        {
            self.fail(id, flags, 0, Status::BadRequest, &e.to_string());
        }
    }

    fn on_frame(&mut self, frame: Frame, now: Instant) {
        match frame.header.msg_type {
            MsgType::Request => self.on_request(frame, now),
            MsgType::Heartbeat => {
                let _ = Heartbeat::put_now(
                    self.io.wbuf(),
                    frame.header.req_id,
                    "broker",
                    "rpcmesh-broker",
                );
            }
            MsgType::Response => {
                self.shared.metrics.errors.inc(ErrorKind::Unexpected);
                tracing::debug!(
                    req_id = frame.header.req_id,
                    "response frame from a client dropped"
                );
            }
        }
    }

    fn on_request(&mut self, frame: Frame, now: Instant) {
        let (id, flags) = (frame.header.req_id, frame.header.flags);
        let (service, method, _) = match request_names(&frame.body) {
            Ok(r) => r,
            Err(e) => {
                self.shared.metrics.errors.inc(ErrorKind::BadBody);
                return self.fail(id, flags, 0, Status::BadRequest, &e.to_string());
            }
        };
        let names = frame.body.slice(service.start..method.end);
        let tag = self.tag(&names, service.len());
        if self.draining {
            return self.fail(id, flags, tag, Status::Unavailable, "broker shutting down");
        }
        let cfg = &self.shared.config;
        if self.in_flight >= cfg.max_in_flight_per_conn {
            return self.shed(id, flags, tag, |m| &m.per_conn);
        }
        if self.shared.in_flight.fetch_add(1, Ordering::Relaxed) >= cfg.max_in_flight {
            self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            return self.shed(id, flags, tag, |m| &m.total);
        }
        self.in_flight += 1;
        let fwd = Forward {
            frame,
            info: CallInfo {
                client_id: id,
                client_flags: flags,
                tag,
                admitted: now,
                // Set on the sample of calls whose stages are timed.
                routed: self.sampler.stamp(),
                replied: None,
            },
            reply_to: self.replies_tx.clone(),
            deadline: now + cfg.call_timeout,
            retries: 0,
        };
        self.route(fwd);
    }

    fn route(&mut self, fwd: Forward) {
        if let Some(routed) = fwd.info.routed {
            self.shared
                .metrics
                .stages
                .record_span(ADMIT, fwd.info.admitted, routed);
        }
        if let Err((fwd, why)) = self.shared.router.forward(fwd, &mut self.picker) {
            let name = String::from_utf8_lossy(request_service(&fwd.frame.body)).into_owned();
            let (status, kind, msg) = match why {
                NoRoute::UnknownService => (
                    Status::Failed,
                    ErrorKind::UnknownService,
                    service_not_found(&name),
                ),
                NoRoute::NoHealthy => (
                    Status::Unavailable,
                    ErrorKind::Unavailable,
                    format!("no healthy provider for {name}"),
                ),
                NoRoute::Full => (
                    Status::Overloaded,
                    ErrorKind::Overloaded,
                    format!("every connection to the providers of {name} is full"),
                ),
                NoRoute::NeedsExtension => (
                    Status::BadRequest,
                    ErrorKind::BadBody,
                    format!("no provider of {name} accepts compressed payloads"),
                ),
            };
            self.shared.metrics.errors.inc(kind);
            self.finish(fwd.info, Err((status, msg.into())));
        }
    }

    fn on_reply(&mut self, reply: Reply) {
        match reply {
            Reply::Done { info, outcome } => self.finish(info, outcome),
            Reply::Retry(mut fwd) => {
                if fwd.retries >= MAX_RETRIES || Instant::now() >= fwd.deadline {
                    self.shared.metrics.errors.inc(ErrorKind::Unavailable);
                    let msg = "provider connections kept closing before the call could be sent";
                    return self.finish(fwd.info, Err((Status::Unavailable, msg.into())));
                }
                fwd.retries += 1;
                self.route(fwd);
            }
        }
    }

    /// Writes a call's outcome to the caller and counts it out.
    fn finish(&mut self, info: CallInfo, outcome: Result<Frame, (Status, Cow<'static, str>)>) {
        self.in_flight -= 1;
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        if info.routed.is_some() {
            self.written.push((info.admitted, info.replied));
        }
        match outcome {
            Ok(frame) => {
                let status = self.write_reply(&frame, info);
                self.counted(info.tag, status);
            }
            Err((status, msg)) => {
                self.fail(info.client_id, info.client_flags, info.tag, status, &msg)
            }
        }
    }

    /// Copies the provider's reply to the caller under the caller's id, degrading an
    /// extended status to "failed" for a caller that did not ask for them.
    fn write_reply(&mut self, frame: &Frame, info: CallInfo) -> Status {
        let status = Status::from_wire(frame.body[0]).unwrap_or(Status::Failed);
        let wire = status.to_wire(info.client_flags.contains(Flags::EXT_STATUS));
        put_forwarded_response(
            self.io.wbuf(),
            info.client_id,
            frame.header.flags,
            &frame.body,
            wire,
        );
        status
    }

    /// Answers a call the broker could not forward (or that failed on the way).
    fn fail(&mut self, id: u64, flags: Flags, tag: u32, status: Status, msg: &str) {
        put_error_response(self.io.wbuf(), id, flags, status, msg);
        self.counted(tag, status);
    }

    /// Answers "overloaded" to a call over one of the caps; `which` picks the cap's message.
    fn shed(&mut self, id: u64, flags: Flags, tag: u32, which: fn(&ShedMessages) -> &str) {
        self.shared.metrics.errors.inc(ErrorKind::Overloaded);
        let msg = which(&self.shared.shed);
        put_error_response(self.io.wbuf(), id, flags, Status::Overloaded, msg);
        self.counted(tag, Status::Overloaded);
    }

    /// Counts an answered call's outcome.
    fn counted(&mut self, tag: u32, status: Status) {
        self.counters_for(tag, status).inc(status);
    }

    /// The session's tag for a (service, method) pair: an index into its counters, or,
    /// for a pair that has no labels yet, [`PENDING`] plus the index of its names among
    /// the calls waiting to show that the pair exists (see [`Session::counters_for`]).
    fn tag(&mut self, names: &Bytes, service_len: usize) -> u32 {
        // Most connections call one method over and over: try the last one first.
        if let Some((last, t)) = &self.last_tag {
            if last == names {
                return *t;
            }
        }
        if let Some((key, &t)) = self.tags.get_key_value(names) {
            // The map's key is an owned copy (a slice of `names` would pin the read buffer
            // it came from): sharing it costs no allocation.
            self.last_tag = Some((key.clone(), t));
            return t;
        }
        if let Some(c) = self.shared.metrics.known_calls(names) {
            return self.cache_tag(names, c);
        }
        let slot = match self.unlabelled.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.unlabelled.push(None);
                self.unlabelled.len() - 1
            }
        };
        self.unlabelled[slot] = Some((names.clone(), service_len));
        PENDING | slot as u32
    }

    fn cache_tag(&mut self, names: &Bytes, counters: Arc<CallCounters>) -> u32 {
        // As many names per session as label pairs overall; beyond, they count as other.
        if self.tags.len() >= crate::metrics::MAX_CALL_LABELS {
            return 0;
        }
        let tag = self.counters.len() as u32;
        self.counters.push(counters);
        self.tags.insert(Bytes::copy_from_slice(names), tag);
        tag
    }

    /// The counters a finished call counts in. A call of a pair without labels gives it
    /// labels if it succeeded (the pair exists), else counts as `_other`.
    fn counters_for(&mut self, tag: u32, status: Status) -> &CallCounters {
        let mut tag = tag;
        if tag & PENDING != 0 {
            let names = self
                .unlabelled
                .get_mut((tag & !PENDING) as usize)
                .and_then(Option::take);
            tag = match names {
                Some((names, service_len)) if status == Status::Success => {
                    match self.tags.get(&names) {
                        Some(t) => *t,
                        None => {
                            let c = self.shared.metrics.calls(&names, service_len);
                            self.cache_tag(&names, c)
                        }
                    }
                }
                _ => 0,
            };
        }
        &self.counters[tag as usize]
    }

    /// Records `write_back` and `total` of every call answered this round, once the
    /// replies have been handed to the socket.
    fn record_stages(&mut self) {
        if self.written.is_empty() {
            return;
        }
        let now = Instant::now();
        let stages = &self.shared.metrics.stages;
        for (admitted, replied) in self.written.drain(..) {
            if let Some(r) = replied {
                stages.record_span(WRITE_BACK, r, now);
            }
            stages.record_span(TOTAL, admitted, now);
        }
    }

    fn report(&mut self) {
        self.shared.metrics.wire.add(self.io.take_counts());
        if self.in_flight != self.in_flight_reported {
            let delta = self.in_flight as f64 - self.in_flight_reported as f64;
            self.shared.metrics.in_flight.increment(delta);
            self.in_flight_reported = self.in_flight;
        }
    }

    fn forget_in_flight(&mut self) {
        if self.in_flight > 0 {
            tracing::debug!(calls = self.in_flight, "client left with calls in flight");
            self.shared
                .in_flight
                .fetch_sub(self.in_flight, Ordering::Relaxed);
            self.in_flight = 0;
        }
    }
}
