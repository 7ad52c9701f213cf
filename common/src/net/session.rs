//! The server-session skeleton the provider and the broker share: one task per accepted
//! connection that reads frames, lets the program's [`Protocol`] act on them and on its own
//! events, and writes what was produced, once per round. The skeleton owns what every
//! server session does the same way: the loop, reading only while the write backlog is
//! under [`WRITE_BACKLOG_LIMIT`], splitting reads into frames and stopping on input beyond
//! repair, the drain on shutdown (answering what still arrives for [`DRAIN_LINGER`] once
//! idle, then closing), the final flush, and [`SessionError`].
//!
//! The protocol owns what the frames mean: the provider decodes calls and runs handlers;
//! the broker routes calls to providers and writes their replies back. Neither sees the
//! loop, and the loop never looks inside a frame.

use std::future::Future;
use std::time::Duration;

use rpcmesh_wire::frame::{Frame, FrameError, MsgType};

use crate::net::connection::{FramedIo, IoEvent};
use crate::net::shutdown::CancellationToken;

/// Replies waiting to be written beyond which a session stops reading requests until the
/// caller reads: 8 MiB, so a caller that stops reading cannot make a server buffer without
/// end (beyond what the calls already admitted bring), while a fast one never hits it.
pub const WRITE_BACKLOG_LIMIT: usize = 8 * 1024 * 1024;
/// How long a closing session waits to deliver its last replies (e.g. the error reply to a
/// too-large frame) before dropping the socket.
pub const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a draining session, once it has nothing in flight, keeps reading and
/// answering before it closes: requests its caller sent before hearing of the drain are
/// still on their way, and closing on them would lose them (and reset the connection).
/// 200 ms covers any LAN round trip many times.
pub const DRAIN_LINGER: Duration = Duration::from_millis(200);
/// Calls in flight on one multiplexed connection between a broker and a provider, by
/// default: the broker puts up to this many on one pooled connection and the provider
/// takes as many, so that the broker, which can move calls to another connection, is the
/// one to shed.
pub const DEFAULT_MAX_IN_FLIGHT_PER_LINK: usize = 16_384;

/// Why a session ended before its caller left.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The socket failed (reset, broken pipe...).
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// The caller sent bytes the stream cannot be resynchronised after.
    #[error("input beyond repair: {0}")]
    BadInput(FrameError),
}

/// What a server program does on one connection; [`serve`] runs the loop around it. Every
/// method gets the connection to append its frames to.
pub trait Protocol: Send {
    /// An event of the protocol's own: a reply from upstream, a handler that finished.
    type Event: Send;

    /// Waits for the next event of the protocol's own. Must be cancel-safe (it is raced
    /// against the socket each round); pending for ever when none can come.
    fn next_event(&mut self) -> impl Future<Output = Self::Event> + Send;

    /// Handles one event (and may take others that are ready now, for the same write).
    fn on_event(&mut self, event: Self::Event, io: &mut FramedIo);

    /// A read brought bytes; its frames follow.
    fn on_read(&mut self) {}

    /// Handles one request. `draining`: shutdown has begun, new calls are to be refused.
    fn on_request(&mut self, frame: Frame, io: &mut FramedIo, draining: bool);

    /// Answers a heartbeat (with one of the server's own, under the same request id).
    fn on_heartbeat(&mut self, frame: Frame, io: &mut FramedIo);

    /// A response frame came from the caller, which makes no sense in that direction: it
    /// is dropped (the skeleton logs it at debug); count it.
    fn on_unexpected(&mut self);

    /// Handles bytes that are not a usable frame (count, log, answer if a request id is
    /// known). The skeleton ends the session after it when the error is fatal.
    fn on_bad_frame(&mut self, error: &FrameError, io: &mut FramedIo);

    /// Runs just before the round's write: a chance to gather more output into it.
    fn before_write(&mut self, _io: &mut FramedIo) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Runs after the round's write (and after the final flush): record what was written,
    /// report counts.
    fn after_write(&mut self, io: &mut FramedIo);

    /// Calls taken and not yet answered: the session may close only when none is left.
    fn in_flight(&self) -> usize;

    /// The session is ending: calls still in flight will get no answer here.
    fn on_end(&mut self) {}
}

/// Serves one connection with `protocol` until the caller leaves, the input is beyond
/// repair, the socket fails, or `shutdown` has drained it; then delivers what is already
/// answered (within [`FINAL_FLUSH_TIMEOUT`]) and closes. Logs at debug how it ended;
/// callers wrap it in their span.
pub async fn serve<P: Protocol>(mut io: FramedIo, mut protocol: P, shutdown: CancellationToken) {
    let end = run(&mut io, &mut protocol, &shutdown).await;
    match &end {
        Ok(()) => tracing::debug!("connection closed"),
        Err(e) => tracing::debug!(error = %e, "connection ended"),
    }
    protocol.on_end();
    let _ = tokio::time::timeout(FINAL_FLUSH_TIMEOUT, io.shutdown()).await;
    protocol.after_write(&mut io);
}

/// The loop: one round per event (the socket's, the protocol's, the drain's), one write per
/// round.
async fn run<P: Protocol>(
    io: &mut FramedIo,
    p: &mut P,
    shutdown: &CancellationToken,
) -> Result<(), SessionError> {
    let mut draining = false;
    let mut drain = Drain::default();
    loop {
        let reading = !io.is_eof() && io.pending_write() < WRITE_BACKLOG_LIMIT;
        tokio::select! {
            biased;
            event = p.next_event() => p.on_event(event, io),
            ev = io.wait_io(reading) => {
                if let IoEvent::Read = ev? {
                    take_frames(io, p, draining)?;
                }
            }
            () = drain.lingered(), if draining => {}
            () = shutdown.cancelled(), if !draining => {
                tracing::debug!(in_flight = p.in_flight(), "draining");
                draining = true;
            }
        }
        p.before_write(io).await;
        io.try_flush()?;
        p.after_write(io);
        let idle = p.in_flight() == 0 && io.pending_write() == 0;
        if idle && io.is_eof() {
            return Ok(());
        }
        if drain.should_close(draining, idle) {
            return Ok(());
        }
    }
}

/// Hands every whole frame read so far to the protocol.
fn take_frames<P: Protocol>(
    io: &mut FramedIo,
    p: &mut P,
    draining: bool,
) -> Result<(), SessionError> {
    p.on_read();
    loop {
        match io.next_frame() {
            Ok(Some(frame)) => match frame.header.msg_type {
                MsgType::Request => p.on_request(frame, io, draining),
                MsgType::Heartbeat => p.on_heartbeat(frame, io),
                MsgType::Response => {
                    tracing::debug!(
                        req_id = frame.header.req_id,
                        "response frame from a caller dropped"
                    );
                    p.on_unexpected();
                }
            },
            Ok(None) => return Ok(()),
            Err(e) => {
                p.on_bad_frame(&e, io);
                if e.is_fatal() {
                    return Err(SessionError::BadInput(e));
                }
            }
        }
    }
}

/// When a session that is draining may close.
#[derive(Debug, Default)]
struct Drain {
    deadline: Option<tokio::time::Instant>,
}

impl Drain {
    /// True when the session should close now: draining, `idle` (no call in flight,
    /// nothing left to write), and idle for [`DRAIN_LINGER`] since it first was.
    fn should_close(&mut self, draining: bool, idle: bool) -> bool {
        if !draining || !idle {
            return false;
        }
        let now = tokio::time::Instant::now();
        let deadline = *self.deadline.get_or_insert(now + DRAIN_LINGER);
        now >= deadline
    }

    /// Resolves when the linger ends (never before the session first went idle).
    async fn lingered(&self) {
        match self.deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use rpcmesh_wire::body::Request;
    use rpcmesh_wire::codec::FrameCodec;
    use rpcmesh_wire::frame::Flags;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::mpsc;

    /// A protocol that answers each request frame after an event says so: requests are
    /// held in flight until the test sends their id (an id released before its request is
    /// read is answered as soon as it is).
    struct Held {
        release: mpsc::UnboundedReceiver<u64>,
        held: Vec<u64>,
        released: Vec<u64>,
        seen_draining: bool,
        ended: Option<tokio::sync::oneshot::Sender<(usize, bool)>>,
    }

    impl Protocol for Held {
        type Event = u64;
        async fn next_event(&mut self) -> u64 {
            match self.release.recv().await {
                Some(id) => id,
                None => std::future::pending().await,
            }
        }
        fn on_event(&mut self, id: u64, io: &mut FramedIo) {
            match self.held.iter().position(|h| *h == id) {
                Some(i) => {
                    self.held.swap_remove(i);
                    answer(io, id);
                }
                None => self.released.push(id),
            }
        }
        fn on_heartbeat(&mut self, _: Frame, _: &mut FramedIo) {}
        fn on_unexpected(&mut self) {}
        fn on_request(&mut self, frame: Frame, io: &mut FramedIo, draining: bool) {
            if draining || self.released.contains(&frame.header.req_id) {
                self.seen_draining |= draining;
                return answer(io, frame.header.req_id);
            }
            self.held.push(frame.header.req_id);
        }
        fn on_bad_frame(&mut self, _: &FrameError, _: &mut FramedIo) {}
        fn after_write(&mut self, _: &mut FramedIo) {}
        fn in_flight(&self) -> usize {
            self.held.len()
        }
        fn on_end(&mut self) {
            if let Some(tx) = self.ended.take() {
                let _ = tx.send((self.held.len(), self.seen_draining));
            }
        }
    }

    fn answer(io: &mut FramedIo, id: u64) {
        rpcmesh_wire::body::Response {
            status: 0,
            payload: bytes::Bytes::new(),
        }
        .put(io.wbuf(), Flags::NONE, id)
        .expect("a small frame encodes");
    }

    fn request(id: u64) -> BytesMut {
        let mut b = BytesMut::new();
        Request {
            service: bytes::Bytes::from_static(b"S"),
            method: bytes::Bytes::from_static(b"M"),
            payload: bytes::Bytes::new(),
        }
        .put(&mut b, Flags::NONE, id)
        .expect("a small frame encodes");
        b
    }

    async fn read_ids(s: &mut TcpStream, buf: &mut BytesMut, n: usize) -> Vec<u64> {
        let codec = FrameCodec::default();
        let mut ids = Vec::new();
        while ids.len() < n {
            while let Some(f) = codec.decode_frame(buf).expect("frames") {
                assert_eq!(f.header.msg_type, MsgType::Response);
                ids.push(f.header.req_id);
            }
            if ids.len() < n {
                assert!(s.read_buf(buf).await.expect("read") > 0, "closed early");
            }
        }
        ids
    }

    /// A session of [`Held`] on a real connection, and the test's end of it.
    struct Running {
        client: TcpStream,
        buf: BytesMut,
        release: mpsc::UnboundedSender<u64>,
        ended: tokio::sync::oneshot::Receiver<(usize, bool)>,
        shutdown: CancellationToken,
        session: tokio::task::JoinHandle<()>,
    }

    async fn start() -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let (release, rx) = mpsc::unbounded_channel();
        let (ended_tx, ended) = tokio::sync::oneshot::channel();
        let shutdown = CancellationToken::new();
        let session = tokio::spawn(serve(
            FramedIo::new(stream, FrameCodec::default()),
            Held {
                release: rx,
                held: Vec::new(),
                released: Vec::new(),
                seen_draining: false,
                ended: Some(ended_tx),
            },
            shutdown.clone(),
        ));
        Running {
            client,
            buf: BytesMut::new(),
            release,
            ended,
            shutdown,
            session,
        }
    }

    impl Running {
        async fn send(&mut self, id: u64) {
            self.client.write_all(&request(id)).await.unwrap();
        }

        async fn answered(&mut self) -> u64 {
            read_ids(&mut self.client, &mut self.buf, 1).await[0]
        }

        /// Waits for the session to close the connection.
        async fn closed(&mut self) {
            let mut rest = Vec::new();
            let n =
                tokio::time::timeout(Duration::from_secs(10), self.client.read_to_end(&mut rest))
                    .await
                    .expect("the session closes")
                    .unwrap();
            assert_eq!(n, 0, "nothing more was answered");
        }
    }

    #[tokio::test]
    async fn a_draining_session_answers_late_requests_finishes_what_it_holds_then_closes() {
        let mut s = start().await;
        s.send(1).await;
        s.send(2).await;
        s.release.send(1).unwrap();
        assert_eq!(s.answered().await, 1);
        // Shutdown with call 2 held: the session stays, answers what still arrives, and
        // closes only after call 2 is answered.
        s.shutdown.cancel();
        s.send(3).await;
        assert_eq!(s.answered().await, 3);
        s.release.send(2).unwrap();
        assert_eq!(s.answered().await, 2);
        s.closed().await;
        let (left, saw_draining) = (&mut s.ended).await.unwrap();
        assert_eq!(left, 0, "nothing was left in flight");
        assert!(saw_draining, "request 3 was answered as draining");
        s.session.await.unwrap();
    }

    #[tokio::test]
    async fn input_beyond_repair_ends_the_session_and_what_was_answered_is_delivered() {
        let mut s = start().await;
        s.send(7).await;
        s.release.send(7).unwrap();
        assert_eq!(s.answered().await, 7);
        s.client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        s.closed().await;
        s.session.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn the_drain_closes_only_after_the_linger_and_only_when_idle() {
        let mut d = Drain::default();
        assert!(!d.should_close(false, true), "not draining");
        assert!(!d.should_close(true, false), "busy");
        assert!(!d.should_close(true, true), "the linger starts now");
        tokio::time::advance(DRAIN_LINGER - Duration::from_millis(1)).await;
        assert!(!d.should_close(true, true));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(d.should_close(true, true));
    }
}
