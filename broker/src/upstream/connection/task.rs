//! The task that owns one upstream connection's socket: its loop, the writes, the
//! deadline sweep, the health checks' heartbeats, the end of the grace period, quick ACKs
//! towards plain v1 servers, and how the connection ends.
//!
//! Once per round the task moves what sessions queued (`queue`) to its write buffer, after
//! letting the other ready sessions queue theirs, so that everything queued in a round
//! leaves in one `write`. What it does with what it reads is `replies`'. Its deadline
//! sweep answers the calls past their deadline "timeout" (and, towards a plain v1 server,
//! times a server that has fallen silent: `crate::upstream::pace`). When the socket
//! fails it answers every call in flight at once with "unavailable" and the cause, and
//! hands calls still queued (never moved to its write buffer) back to their sessions to be
//! routed again; when the broker's grace period ends it answers every call in flight
//! "unavailable: shutting down", so that no caller is left without an answer.
//!
//! ## Quick ACKs towards plain v1 servers
//!
//! The broker puts several calls on one pooled connection. A plain RPCF v1 server such as
//! the original framework's (`provider --classic` stands for it) answers them one at a time,
//! one `write` per reply, and never sets `TCP_NODELAY`. Nagle's algorithm then holds each
//! reply written while the previous one is still unacknowledged until its ACK arrives. On
//! the broker's side Linux delays that ACK (up to 40 ms, `TCP_DELACK_MIN`) in the hope of
//! sending it with data of its own, and with every other call on the connection waiting
//! for its reply the broker has no data to send there: the server waits for the ACK, the
//! broker for the reply, and the call stalls about 40 ms. Through an L4 proxy each client
//! connection has a server connection of its own, and a client that makes one call at a
//! time never has a second reply queued behind the first, so the stall is the broker's
//! alone.
//!
//! So after every read from a plain v1 server that leaves calls (or a heartbeat) in flight
//! on the connection, the task asks the kernel for an immediate ACK
//! ([`FramedIo::quick_ack`], `TCP_QUICKACK`). Linux does not keep that setting: it leaves
//! quick-ACK mode by itself once the connection looks interactive again, so it is asked
//! again after each such read. It costs one `setsockopt` per read and, at most, one pure
//! ACK segment per reply; a read that leaves nothing in flight needs none (the next
//! request carries the ACK). rpcmesh providers set `TCP_NODELAY` and are never asked:
//! their connections take no extra system call. Figures: docs/performance.md, "Behind a
//! plain v1 server with Nagle on".

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::BytesMut;

use rpcmesh_common::metrics::{BadInputLog, Side};
use rpcmesh_common::net::connection::{FramedIo, IoEvent};
use rpcmesh_common::net::listener::AcceptObserver;
use rpcmesh_common::net::pace::HEARTBEAT_KEY;
use rpcmesh_common::net::shutdown::Cancelled;
use rpcmesh_common::net::stream::Stream;
use rpcmesh_common::net::thinned::Thinned;
use rpcmesh_wire::PeerKind;
use rpcmesh_wire::body::Heartbeat;
use rpcmesh_wire::codec::FrameCodec;
use rpcmesh_wire::ext;
use tokio::sync::mpsc;

use super::kept::{Kept, Ring};
use super::queue::{ConnState, Slot};
use super::{ConnSettings, HeartbeatTx, REQUEST_RETAIN};
use crate::call::Reroute;
use crate::failure::{ConnEnd, Failure};
use crate::metrics::{QUEUE, UpstreamMetrics};
use crate::upstream::PoolLink;
use crate::upstream::pace::Backlog;

/// Times the task lets the other ready tasks run before writing, while each turn brings
/// more calls: sessions woken by the same poll add theirs and one write carries them all
/// (about half the upstream writes of writing at once, for one extra poll).
const GATHER_YIELDS: usize = 4;

/// The process's budget of lost-connection log lines (a provider that accepts and closes
/// at once loses a connection per reconnect).
static LOST_LINES: Thinned = Thinned::new();
/// The process's budget of "quick ACK refused" log lines (one per connection at most).
static QUICK_ACK_LINES: Thinned = Thinned::new();

/// The task of one upstream connection (see the module doc).
pub(super) struct ConnTask {
    pub io: FramedIo,
    /// Health checks from the pool; `None` once every handle is gone.
    heartbeat_rx: mpsc::UnboundedReceiver<HeartbeatTx>,
    pub state: Arc<ConnState>,
    pub heartbeats: Vec<(u64, HeartbeatTx)>,
    next_heartbeat_id: u64,
    /// ACK reads at once while calls are in flight (see the module doc); turned off on
    /// this connection if the kernel refuses it.
    quick_ack: bool,
    /// The provider told of its drain (`rpcmesh_wire::ext::DRAINING_KEY`): the
    /// connection closes as soon as nothing is in flight on it, without waiting for the
    /// pool to let it go, since the provider waits for that close to finish its drain.
    pub drain_told: bool,
    /// Ids of the timed calls written this round.
    round: Vec<u64>,
    pub settings: ConnSettings,
    pub metrics: UpstreamMetrics,
    /// What this connection shares with its pool.
    pub link: Arc<PoolLink>,
    /// Bad frames from the provider: counted, and logged thinned.
    pub bad_input: BadInputLog,
    /// A plain v1 server's calls waiting at its last read, to time how fast it answers
    /// (`crate::upstream::pace`); unused towards rpcmesh providers.
    pub backlog: Backlog,
    /// When the last read returned (the outcomes it brought are judged at that instant).
    pub now: Instant,
    /// When the call of the current read's slowest reply was admitted (all its replies are
    /// read at `now`), for the balancer's estimate.
    pub oldest: Option<Instant>,
    /// Successes of the current read not yet told to the provider's outlier detector:
    /// told once per read (or before a fault, to keep their order), so that a reply
    /// costs no atomic shared with the other cells calling this provider.
    pub successes: u64,
    /// Replies of the current read answered in place, by status, not yet added to the
    /// provider's outcome counters (added once per read, for the same reason).
    pub outcomes: crate::metrics::StatusTally,
    /// The cap this connection gives an rpcmesh provider in its heartbeats
    /// (`rpcmesh_wire::ext::CAP_KEY`): the call timeout, made once.
    cap_value: String,
}

impl ConnTask {
    /// The task of a connected socket, sharing `state` with the handle and taking health
    /// checks from `heartbeat_rx`.
    pub fn new(
        stream: Stream,
        state: Arc<ConnState>,
        heartbeat_rx: mpsc::UnboundedReceiver<HeartbeatTx>,
        settings: ConnSettings,
        metrics: UpstreamMetrics,
        link: Arc<PoolLink>,
    ) -> ConnTask {
        ConnTask {
            io: FramedIo::over(stream, FrameCodec::new(settings.max_body_len))
                .with_activity(settings.activity.clone())
                .with_budget(Some(settings.budget.clone())),
            heartbeat_rx,
            state,
            heartbeats: Vec::new(),
            next_heartbeat_id: 1,
            // A plain v1 server may leave Nagle's algorithm on (see the module doc).
            quick_ack: settings.kind == PeerKind::V1,
            drain_told: false,
            round: Vec::new(),
            bad_input: BadInputLog::new(metrics.errors.clone(), Side::Provider),
            cap_value: ext::cap_value(settings.call_timeout),
            settings,
            metrics,
            link,
            backlog: Backlog::default(),
            now: Instant::now(),
            oldest: None,
            successes: 0,
            outcomes: Default::default(),
        }
    }

    pub async fn run(mut self, sweep: Duration) {
        let mut sweeper = tokio::time::interval(sweep);
        sweeper.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut handles_left = true;
        let mut expired = Vec::new();
        let mut grace_over = Cancelled::new(&self.settings.grace_over);
        let mut cut = false;
        let state = self.state.clone();
        let end = loop {
            let busy = state.in_flight.load(Ordering::Relaxed) > 0 || !self.heartbeats.is_empty();
            tokio::select! {
                biased;
                ev = self.io.wait_io(true) => match ev {
                    Ok(IoEvent::Read) => {
                        if let Err(end) = self.take_frames(&state) {
                            break end;
                        }
                        self.ack_at_once();
                    }
                    Ok(IoEvent::Wrote) => {}
                    Err(e) => break ConnEnd::Socket(Arc::new(e)),
                },
                () = std::future::poll_fn(|cx| state.poll_queued(cx)) => {}
                tx = self.heartbeat_rx.recv(), if handles_left => match tx {
                    Some(tx) => self.send_heartbeat(tx),
                    // Every handle is gone: finish what is in flight, then close.
                    None => handles_left = false,
                },
                _ = sweeper.tick(), if busy => {
                    self.answer_timed_out(&mut expired);
                }
                () = &mut grace_over, if !cut => {
                    cut = true;
                    self.answer_grace_over();
                }
            }
            // Calls queued meanwhile leave in the same write. Before writing, when other
            // calls are in flight on this connection (traffic is concurrent), let every
            // other ready task run: sessions woken by the same poll queue their calls, and
            // one write carries them all. A lone call goes out at once.
            let mut taken = self.take_queued();
            let concurrent = state.in_flight.load(Ordering::Relaxed) > taken;
            if self.io.pending_write() > 0 && concurrent {
                for _ in 0..GATHER_YIELDS {
                    tokio::task::yield_now().await;
                    let more = self.take_queued();
                    if more == 0 {
                        break;
                    }
                    taken += more;
                }
            }
            if let Err(e) = self.io.try_flush() {
                break ConnEnd::Write(Arc::new(e));
            }
            self.io.account();
            self.record_sent();
            self.metrics.wire.add(self.io.take_counts());
            let done = !handles_left || (self.drain_told && self.heartbeats.is_empty());
            if done && state.in_flight.load(Ordering::Relaxed) == 0 {
                break ConnEnd::Released;
            }
        };
        self.close(end);
    }

    /// After a read from a plain v1 server: if calls (or a heartbeat) are still in flight
    /// on the connection, the ACK of what was read goes out now instead of up to 40 ms
    /// later, so that a server with Nagle's algorithm on sends its next reply at once (see
    /// the module doc). Counted; a refusal (not expected on Linux) is logged, thinned, and
    /// turns it off for this connection.
    fn ack_at_once(&mut self) {
        if !self.quick_ack
            || (self.state.in_flight.load(Ordering::Relaxed) == 0 && self.heartbeats.is_empty())
        {
            return;
        }
        match self.io.quick_ack() {
            Ok(()) => self.metrics.quick_acks.increment(1),
            Err(e) => {
                self.quick_ack = false;
                if let Some(a) = QUICK_ACK_LINES.admit() {
                    tracing::warn!(error = %e, refused = a.seen, left_out = a.left_out, "TCP_QUICKACK refused; replies of this plain v1 server may wait for delayed ACKs");
                }
            }
        }
    }

    /// The deadline sweep: every call past its deadline is taken off the table and its
    /// caller answered "timeout" (a reply that comes later finds no slot and is dropped,
    /// counted `late_reply`); one still queued, never written, is answered that it timed
    /// out waiting. Health checks whose waiter gave up are forgotten.
    pub fn answer_timed_out(&mut self, expired: &mut Vec<(u64, Slot)>) {
        self.heartbeats.retain(|(_, tx)| !tx.is_closed());
        let now = Instant::now();
        if self.settings.kind == PeerKind::V1 {
            self.backlog.on_sweep(now, &self.link.pace);
        }
        let mut calls = self.state.lock();
        calls.table.take_where(|s| s.deadline <= now, expired);
        // Requests admitted longer ago than REQUEST_RETAIN are let go (large ones hold
        // their read buffers). Calls still queued keep theirs until written.
        if self.settings.kind == PeerKind::Rpcmesh {
            for s in calls.table.values_mut() {
                let written = !matches!(s.kept, Kept::Nowhere | Kept::Queued { .. });
                if written && now.duration_since(s.info.admitted) > REQUEST_RETAIN {
                    s.kept = Kept::Nowhere;
                }
            }
        }
        for (id, slot) in expired.drain(..) {
            let failure = if calls.queued.contains(&id) {
                Failure::TimedOutQueued
            } else {
                Failure::Timeout {
                    provider: self.settings.label.clone(),
                    // The caller's deadline, when shorter than the call timeout.
                    after: slot.deadline.duration_since(slot.info.admitted),
                }
            };
            self.fail_slot(slot, failure);
        }
    }

    /// The broker's grace period is over: every call in flight here is answered
    /// "unavailable: shutting down" at once, so that its session can answer its caller and
    /// close (a reply that comes later finds no slot and is dropped).
    fn answer_grace_over(&mut self) {
        let mut calls = self.state.lock();
        calls.queued.clear();
        calls.wbuf.clear();
        for (_, slot) in calls.table.drain() {
            let failure = Failure::GraceOver;
            self.fail_slot(slot, failure);
        }
    }

    /// Stamps the calls written this round and records their `queue` stage.
    fn record_sent(&mut self) {
        if self.round.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut calls = self.state.lock();
        for id in self.round.drain(..) {
            if let Some(slot) = calls.table.get_mut(id) {
                slot.sent = Some(now);
                if let Some(routed) = slot.info.routed {
                    self.metrics.stages.record_span(QUEUE, routed, now);
                }
            }
        }
    }

    /// Moves the calls queued since the last look to the write buffer; returns how many.
    pub fn take_queued(&mut self) -> usize {
        let keep_request = self.settings.kind == PeerKind::Rpcmesh;
        self.state.lock().take_queued(
            self.io.wbuf(),
            keep_request,
            &self.settings.budget,
            &mut self.round,
        )
    }

    /// Writes a health check's heartbeat; its answer is matched by id.
    fn send_heartbeat(&mut self, tx: HeartbeatTx) {
        // Heartbeat ids count down from the top so they never meet call ids.
        let id = u64::MAX - self.next_heartbeat_id;
        self.next_heartbeat_id += 1;
        // An rpcmesh provider is asked for its time per call (`crate::upstream::pace`); a
        // plain v1 server gets the plain heartbeat.
        // It is asked too which call fields it takes (`rpcmesh_wire::ext`): the deadline
        // on any connection, the caller over TLS only (`replies::take_call_fields`); and
        // given the cap of every call's budget here, the call timeout, so that a call
        // written in the round that read it may go on as it came (`ext::CAP_KEY`).
        // And to tell of its drain (`ext::DRAINING_KEY`, `replies`).
        let rpcmesh = [
            (HEARTBEAT_KEY, ""),
            (ext::HEARTBEAT_KEY, ext::DRAIN_NOTICE_FIELD),
            (ext::CAP_KEY, self.cap_value.as_str()),
        ];
        let extra: &[(&str, &str)] = match self.settings.kind {
            PeerKind::Rpcmesh => &rpcmesh,
            PeerKind::V1 => &[],
        };
        if Heartbeat::put_now_with(self.io.wbuf(), id, "broker", "rpcmesh-broker", extra).is_ok() {
            self.heartbeats.push((id, tx));
        }
    }

    /// No new call is routed here; the keeper is told at once the first time.
    pub fn mark_closed(&self) {
        if !self.state.closed.swap(true, Ordering::Relaxed) {
            self.link.wake_keeper();
        }
    }

    /// Ends the connection (`end`: why): every call written is answered with the cause,
    /// every call still queued goes back to its session to be routed again.
    pub fn close(mut self, end: ConnEnd) {
        self.mark_closed();
        self.metrics.conns.closed(end.close_reason());
        self.heartbeat_rx.close();
        let (mut failed, mut requeued) = (0, 0);
        let mut calls = self.state.lock();
        calls.ended = true;
        calls.waker = None;
        let queued: std::collections::HashSet<u64> = calls.queued.drain(..).collect();
        let slots: Vec<(u64, Slot)> = calls.table.drain().collect();
        let mut back = Vec::new();
        for (id, mut slot) in slots {
            // A call never written goes back to be routed again, with its request.
            match queued
                .contains(&id)
                .then(|| calls.take_request(&mut slot))
                .flatten()
            {
                Some(request) => back.push((slot, request)),
                None => {
                    failed += 1;
                    let failure = Failure::ConnectionLost {
                        provider: self.settings.label.clone(),
                        cause: end.clone(),
                    };
                    // Written: an idempotent call may go again, with its request.
                    let request = if slot.idempotent {
                        calls.take_request(&mut slot)
                    } else {
                        None
                    };
                    self.lose_slot(slot, request, failure);
                }
            }
        }
        calls.wbuf = BytesMut::new();
        calls.ring = Ring::default();
        drop(calls);
        for (slot, request) in back {
            self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
            requeued += 1;
            slot.hand_back(request, Reroute::Unsent, self.link.id);
        }
        self.link.task_ended();
        match end {
            ConnEnd::Released => tracing::debug!("closed"),
            cause => match LOST_LINES.admit() {
                Some(a) => {
                    tracing::warn!(%cause, failed, requeued, lost = a.seen, left_out = a.left_out, "provider connection lost")
                }
                None => tracing::debug!(%cause, failed, requeued, "provider connection lost"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Refused;
    use super::super::fixtures::{call, connection, connection_with};
    use super::*;
    use crate::call::{Inbox, Reply, Taken};
    use crate::upstream::pace;
    use rpcmesh_wire::frame::Flags;

    /// A plain v1 server that answers the first of two calls and then nothing is timed at
    /// the deadline sweep, before any further reply: its pace rises above the wait and its
    /// connections are no longer packed.
    #[tokio::test]
    async fn a_plain_v1_server_that_falls_silent_stops_being_packed_at_the_sweep() {
        use rpcmesh_wire::envelope::CallCodec;
        let link = Arc::new(PoolLink::for_test(
            Duration::from_millis(1),
            pace::Source::Measured,
        ));
        let (conn, mut task, mut server) = connection_with(PeerKind::V1, link.clone()).await;
        let inbox = Inbox::new();
        conn.try_forward(call(1, &inbox), Instant::now()).unwrap();
        conn.try_forward(call(2, &inbox), Instant::now()).unwrap();
        assert_eq!(task.take_queued(), 2);
        task.io.try_flush().unwrap();
        // The server reads both and answers the first.
        let mut buf = BytesMut::new();
        let requests = rpcmesh_testkit::read_frames(&mut server, &mut buf, 2)
            .await
            .unwrap();
        let mut reply = BytesMut::new();
        CallCodec::new(None, 1 << 20)
            .put_ok_response(&mut reply, requests[0].header.req_id, Flags::NONE, b"")
            .unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut server, &reply)
            .await
            .unwrap();
        let state = task.state.clone();
        loop {
            assert!(matches!(task.io.wait_io(true).await, Ok(IoEvent::Read)));
            task.take_frames(&state).unwrap();
            if conn.load() == 1 {
                break;
            }
        }
        // One reply, read with the second call waiting: no sample yet.
        assert_eq!(link.pace.per_call(), None);
        tokio::time::sleep(Duration::from_millis(5)).await;
        task.answer_timed_out(&mut Vec::new());
        let pace = link.pace.per_call().expect("timed at the sweep");
        assert!(pace >= Duration::from_millis(5), "{pace:?}");
        assert_eq!(link.pace.depth(64), 0, "not packed");
        assert_eq!(conn.load(), 1, "the sweep answered nothing");
    }

    #[tokio::test]
    async fn when_the_connection_ends_calls_still_queued_go_back_to_be_routed_and_written_ones_fail()
     {
        let (conn, mut task, _server) = connection(PeerKind::V1).await;
        let inbox = Inbox::new();
        conn.try_forward(call(1, &inbox), Instant::now()).unwrap();
        assert_eq!(
            task.take_queued(),
            1,
            "call 1 is in the task's write buffer"
        );
        conn.try_forward(call(2, &inbox), Instant::now()).unwrap();
        task.close(ConnEnd::ClosedByProvider);
        assert!(conn.is_closed());
        assert_eq!(conn.load(), 0);
        let (back, why) = conn
            .try_forward(call(3, &inbox), Instant::now())
            .unwrap_err();
        assert_eq!((back.info.client_id, why), (3, Refused::Closed));

        let mut wbuf = BytesMut::new();
        let mut taken = Taken::default();
        assert_eq!(inbox.take(&mut wbuf, &mut taken), 2);
        let mut lost = None;
        let mut rerouted = None;
        for reply in taken.other.drain(..) {
            match reply {
                Reply::Done {
                    info,
                    outcome: Err(f),
                    ..
                } => lost = Some((info.client_id, f)),
                Reply::Retry(fwd, why) => rerouted = Some((fwd.info.client_id, why, fwd.frame)),
                other => panic!("unexpected {other:?}"),
            }
        }
        let (id, failure) = lost.expect("the written call is answered");
        assert_eq!(id, 1);
        assert!(
            matches!(failure, Failure::ConnectionLost { .. }),
            "{failure:?}"
        );
        let (id, why, frame) = rerouted.expect("the queued call goes back");
        assert_eq!((id, why), (2, Reroute::Unsent));
        assert_eq!(frame.header.req_id, 2, "with the caller's own frame");
    }
}
