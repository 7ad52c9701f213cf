//! A framed TCP connection: one socket, one read buffer split into frames, one write
//! buffer that collects every frame produced in a round and leaves in as few `write`
//! calls as the socket allows. The socket is plain or carries TLS ([`Stream`]); the
//! buffers, the frames and everything above see no difference.
//!
//! Owns the buffers and when the socket is read and written; what the frames mean, and who waits for them, is the
//! session's ([`crate::net::session`] for servers, and each program's protocol over it). One
//! task owns a connection's reads, writes and in-flight table without locks or a second
//! task: it waits in [`FramedIo::wait_io`] (beside its other event sources), takes the
//! frames read, appends replies, and calls [`FramedIo::try_flush`] once per round.

use std::io;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use std::task::{Context, Poll};

use tokio::net::TcpStream;
use tokio::time::Instant;

use rpcmesh_wire::codec::{self, FrameCodec};
use rpcmesh_wire::frame::{FRAME_OVERHEAD, Frame, FrameError, HEADER_LEN, Header};

use crate::net::budget::{Held, MemoryBudget, Pressure};
use crate::net::busy_poll::Activity;
use crate::net::stream::Stream;

/// Bytes a read may fill at once: 64 KiB holds about a thousand small frames, so a busy
/// connection reads a whole batch per `read` call.
pub const READ_CHUNK: usize = 64 * 1024;
/// The read buffer grows (by [`READ_CHUNK`]) only when less room than this is left (a
/// fresh buffer, this large, only once it is full). Frames
/// split off the buffer share its allocation while they live, so growing it before every
/// read would allocate a fresh 64 KiB buffer per read whenever one is still in flight
/// (the broker keeps forwarded requests until their upstream write).
pub const MIN_READ_ROOM: usize = 4096;

/// True when a read buffer `rbuf` must grow before the next read: it is full, or a large
/// one has less than [`MIN_READ_ROOM`] left. A fresh (small) buffer grows only once it
/// is full: a peer that sent a few bytes, or only a header, costs no read chunk. Both
/// engines' readers ask it.
pub fn must_grow(rbuf: &BytesMut) -> bool {
    let room = rbuf.capacity() - rbuf.len();
    room == 0 || (room < MIN_READ_ROOM && rbuf.capacity() >= READ_CHUNK)
}

/// The room an emptied buffer may keep: [`SHRINK_ABOVE`], or, while `budget` is past its
/// high mark, [`MIN_READ_ROOM`] (many callers that each sent a large frame, refused,
/// would otherwise keep its room).
pub fn room_to_keep(budget: &crate::net::budget::MemoryBudget) -> usize {
    if budget.pressure() >= Pressure::High {
        MIN_READ_ROOM
    } else {
        SHRINK_ABOVE
    }
}

/// A buffer left empty with more room than this after a peak is given back (replaced by a
/// fresh, small one): one large frame must not cost a connection its size for the rest of
/// its life.
pub const SHRINK_ABOVE: usize = 4 * READ_CHUNK;

/// Idle time before the first keepalive probe: a minute, long beyond any pause in a
/// healthy conversation, short enough that a dead peer's connection is freed within
/// about a minute and a half (with the probes below) instead of never.
pub const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(60);
/// Time between keepalive probes.
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
/// Unanswered probes before the kernel gives the connection up.
pub const KEEPALIVE_PROBES: u32 = 3;

/// Why a connection was closed, as `rpcmesh_connections_closed_total{reason}` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// The peer closed its side, with nothing left in flight.
    Peer,
    /// Nothing in flight, nothing to write and nothing read for the idle timeout.
    IdleTimeout,
    /// A frame was started and not completed within the frame timeout.
    FrameTimeout,
    /// Bytes waited to be written and the peer took none for the write timeout.
    WriteTimeout,
    /// The peer sent bytes the stream cannot be resynchronised after.
    BadInput,
    /// The socket failed (reset, broken pipe...).
    Error,
    /// This side is shutting down: the connection was drained.
    Shutdown,
    /// This side closed it for a reason of its own (a pool dropped it, a run ended).
    Local,
    /// Its TLS handshake was refused (the reason is counted apart, in
    /// `rpcmesh_tls_handshake_failures_total`).
    TlsHandshake,
    /// Its reads were paused for the memory budget, it was one of the connections holding
    /// the budget, and its frame was still not whole after the frame timeout; or the
    /// budget stayed past its high mark for `budget::SHED_AFTER` and it held the most.
    MemoryBudget,
}

impl CloseReason {
    /// Whether a connection closing for this reason first flushes what is already answered
    /// (the session's final flush, up to `crate::net::session::FINAL_FLUSH_TIMEOUT`). Not when it was closed to
    /// give its buffers back to the memory budget: a flush to a caller that does not read
    /// would hold them for the whole flush, during which the budget, still past its mark,
    /// would close the next largest holder too.
    pub fn flushes_on_close(self) -> bool {
        self != CloseReason::MemoryBudget
    }

    /// Every reason, in the order of [`CloseReason::index`].
    pub const ALL: [CloseReason; 10] = [
        CloseReason::Peer,
        CloseReason::IdleTimeout,
        CloseReason::FrameTimeout,
        CloseReason::WriteTimeout,
        CloseReason::BadInput,
        CloseReason::Error,
        CloseReason::Shutdown,
        CloseReason::Local,
        CloseReason::TlsHandshake,
        CloseReason::MemoryBudget,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            CloseReason::Peer => "peer",
            CloseReason::IdleTimeout => "idle_timeout",
            CloseReason::FrameTimeout => "frame_timeout",
            CloseReason::WriteTimeout => "write_timeout",
            CloseReason::BadInput => "bad_input",
            CloseReason::Error => "error",
            CloseReason::Shutdown => "shutdown",
            CloseReason::Local => "local",
            CloseReason::TlsHandshake => "tls_handshake",
            CloseReason::MemoryBudget => "memory_budget",
        }
    }

    /// Position in [`CloseReason::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What [`FramedIo::wait_io`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoEvent {
    /// A read happened: data was added to the read buffer, or the stream ended
    /// ([`FramedIo::is_eof`]; also when a paused connection's peer left mid-frame).
    Read,
    /// Pending bytes were written (some or all).
    Wrote,
}

/// Running byte and syscall counts of one connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoCounts {
    /// Bytes read from the socket.
    pub bytes_read: u64,
    /// Bytes written to the socket.
    pub bytes_written: u64,
    /// `read` calls that returned data.
    pub reads: u64,
    /// `write` calls that wrote something.
    pub writes: u64,
}

/// A TCP connection with a frame decoder and a batching write buffer.
#[derive(Debug)]
pub struct FramedIo {
    stream: Stream,
    codec: FrameCodec,
    rbuf: BytesMut,
    wbuf: BytesMut,
    eof: bool,
    /// Bytes still to drop (see [`FramedIo::skip`]).
    discard: usize,
    counts: IoCounts,
    /// Since when bytes have waited to be written with the peer taking none (`None`
    /// while the write buffer is empty or the last write made progress just now).
    write_stalled: Option<Instant>,
    /// Told of every read that returned data (busy polling), if set.
    activity: Option<Arc<Activity>>,
    /// What this connection's buffers hold, told to the process's budget, if set.
    held: Option<Held>,
}

/// A [`FramedIo`] between two runtimes ([`FramedIo::detach`]): everything but its
/// registration with a reactor and its busy-polling activity, which belong to the runtime
/// that serves it.
#[derive(Debug)]
pub struct DetachedIo {
    stream: crate::net::stream::Detached,
    codec: FrameCodec,
    rbuf: BytesMut,
    wbuf: BytesMut,
    eof: bool,
    discard: usize,
    counts: IoCounts,
    write_stalled: Option<Instant>,
    held: Option<Held>,
}

impl DetachedIo {
    /// The connection again, registered with the current runtime's reactor and telling
    /// `activity` (that runtime's spinner, if any) of its reads.
    pub fn attach(self, activity: Option<Arc<Activity>>) -> io::Result<FramedIo> {
        Ok(FramedIo {
            stream: self.stream.attach()?,
            codec: self.codec,
            rbuf: self.rbuf,
            wbuf: self.wbuf,
            eof: self.eof,
            discard: self.discard,
            counts: self.counts,
            write_stalled: self.write_stalled,
            activity,
            held: self.held,
        })
    }
}

impl FramedIo {
    /// Wraps a connected socket, turns on `TCP_NODELAY` (frames are batched here, so
    /// Nagle would only add delay) and TCP keepalive (so that a peer that vanished without
    /// closing, a crashed host or a dropped NAT entry, is found and its connection freed).
    pub fn new(stream: TcpStream, codec: FrameCodec) -> Self {
        FramedIo::over(Stream::Plain(stream), codec)
    }

    /// As [`FramedIo::new`], over a stream that may carry TLS (its handshake done).
    pub fn over(stream: Stream, codec: FrameCodec) -> Self {
        if let Err(e) = stream.tcp().set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY");
        }
        FramedIo::wrap(stream, codec)
    }

    /// As [`FramedIo::new`], but leaves Nagle's algorithm on (`TCP_NODELAY` unset, the
    /// kernel's default): for the classic server (`provider --classic`), which stands for
    /// the plain RPCF v1 servers that never set it, so that the broker is measured and
    /// tested against them as they are.
    pub fn keeping_nagle(stream: TcpStream, codec: FrameCodec) -> Self {
        FramedIo::wrap(Stream::Plain(stream), codec)
    }

    fn wrap(stream: Stream, codec: FrameCodec) -> Self {
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES);
        if let Err(e) = socket2::SockRef::from(stream.tcp()).set_tcp_keepalive(&keepalive) {
            tracing::warn!(error = %e, "could not set TCP keepalive");
        }
        FramedIo {
            stream,
            codec,
            // Small until traffic comes: an idle connection costs a page, not two chunks;
            // the read buffer grows by READ_CHUNK on the second read, the write buffer
            // with the first replies.
            rbuf: BytesMut::with_capacity(MIN_READ_ROOM),
            wbuf: BytesMut::new(),
            eof: false,
            discard: 0,
            counts: IoCounts::default(),
            write_stalled: None,
            activity: None,
            held: None,
        }
    }

    /// Tells `activity` of every read that returns data, so that its busy poller keeps
    /// polling while this socket has traffic (see [`crate::net::busy_poll`]).
    pub fn with_activity(mut self, activity: Option<Arc<Activity>>) -> Self {
        self.activity = activity;
        self
    }

    /// Reports this connection's buffered bytes to `budget`, if given.
    pub fn with_budget(mut self, budget: Option<Arc<MemoryBudget>>) -> Self {
        self.held = budget.map(Held::new);
        self
    }

    /// Takes the connection off this runtime, its buffers, partial frame, counts and
    /// budget share whole, for [`DetachedIo::attach`] on another (the broker moves a
    /// client connection between its cells so, `broker::cell`).
    pub fn detach(self) -> io::Result<DetachedIo> {
        let FramedIo {
            stream,
            codec,
            rbuf,
            wbuf,
            eof,
            discard,
            counts,
            write_stalled,
            activity: _,
            held,
        } = self;
        Ok(DetachedIo {
            stream: stream.detach()?,
            codec,
            rbuf,
            wbuf,
            eof,
            discard,
            counts,
            write_stalled,
            held,
        })
    }

    /// Bytes the buffers hold now: the room of the read buffer (partial frames and the
    /// space they grew) and of the write buffer (the backlog and its space). Room, not
    /// length: buffers grow by doubling, and the room is what the process pays for.
    pub fn buffered(&self) -> usize {
        self.rbuf.capacity() + self.wbuf.capacity()
    }

    /// Tells the budget what the buffers hold now, and gives back a buffer that is empty
    /// after a peak: over [`SHRINK_ABOVE`] of room, or, while the budget is past half
    /// ([`crate::net::budget::Pressure::High`]), over a small buffer's: many callers that
    /// each sent a large frame (refused) would otherwise keep its room. While it is past
    /// half, a partial frame under a read chunk left in the read buffer is also copied
    /// into a buffer of its own. Once per round.
    pub fn account(&mut self) {
        let keep = self
            .held
            .as_ref()
            .map_or(SHRINK_ABOVE, |h| room_to_keep(h.budget()));
        if self.rbuf.is_empty() && self.rbuf.capacity() > keep {
            self.rbuf = BytesMut::with_capacity(MIN_READ_ROOM);
        }
        if self.wbuf.is_empty() && self.wbuf.capacity() > keep {
            self.wbuf = BytesMut::new();
        }
        // The part of a frame left after the frames before it were split off keeps their
        // whole allocation alive, which `capacity` no longer shows; under pressure it is
        // copied out, so that the allocation goes once those frames are done with.
        if keep == MIN_READ_ROOM && !self.rbuf.is_empty() && self.rbuf.len() < READ_CHUNK {
            let mut fresh = BytesMut::with_capacity(self.rbuf.len().max(MIN_READ_ROOM));
            fresh.extend_from_slice(&self.rbuf);
            self.rbuf = fresh;
        }
        let n = self.buffered();
        if let Some(h) = &mut self.held {
            h.set(n);
        }
    }

    /// The budget, when the process is near it and this connection holds enough to wait
    /// until it is relieved (see [`MemoryBudget::should_pause`]), or must grow its read
    /// buffer to read on and a read chunk more does not fit ([`MemoryBudget::fits`]); the
    /// budget is told whether this connection waits, and how much it holds. Once per
    /// round.
    pub fn budget_pause(&mut self) -> Option<Arc<MemoryBudget>> {
        let n = self.buffered();
        let must_grow = self.must_grow();
        let h = self.held.as_mut()?;
        let budget = h.budget();
        let pause = budget.should_pause(n) || (must_grow && !budget.fits(READ_CHUNK));
        h.set_waiting(pause, n);
        pause.then(|| h.budget().clone())
    }

    /// True while the budget pauses this connection's reads.
    pub fn is_budget_paused(&self) -> bool {
        self.held.as_ref().is_some_and(Held::is_waiting)
    }

    /// True while the budget pauses this connection and it is one of the connections
    /// holding the budget ([`MemoryBudget::is_holding`]): the time it waits is its own.
    pub fn holds_budget(&self) -> bool {
        self.held.as_ref().is_some_and(Held::is_holding)
    }

    /// True while this connection holds [`crate::net::budget::PAUSE_FLOOR`] or more of
    /// the memory budget: it looks every [`crate::net::budget::SHED_CHECK`] whether it
    /// is to be closed ([`FramedIo::sheds`]).
    pub fn is_large_holder(&self) -> bool {
        self.held.as_ref().is_some_and(Held::is_large)
    }

    /// True when this connection is to be closed to bring the memory budget back under
    /// its high mark ([`MemoryBudget::sheds`]).
    pub fn sheds(&self) -> bool {
        self.held.as_ref().is_some_and(Held::sheds)
    }

    /// As [`FramedIo::peer_left_mid_frame`], and if so the stream is taken as ended (the
    /// next frame asked for reports the frame cut off, as a read of the end would).
    pub fn note_peer_left(&mut self) -> bool {
        let left = !self.eof && self.peer_left_mid_frame();
        self.eof |= left;
        left
    }

    /// Bytes the frame being read still needs before it is whole (0 with no partial
    /// frame; a header not yet whole counts only its own missing bytes).
    fn missing(&self) -> usize {
        missing(&self.rbuf, self.discard)
    }

    /// True when the peer has closed its side (or reset the connection) and the frame
    /// being read can never be finished: the bytes waiting unread in the kernel are fewer
    /// than it still needs. A connection the budget pauses reads nothing, so it would not
    /// see its caller leave; this looks without reading (`poll` for `POLLRDHUP`, and
    /// `FIONREAD`). Two system calls: for paused connections only. The FIN comes only once
    /// the caller's kernel has sent everything before it: a caller that had more unsent
    /// than this side's receive buffer takes is seen to leave only by the frame clock.
    pub fn peer_left_mid_frame(&self) -> bool {
        peer_left_mid_frame(self.stream.tcp(), self.missing())
    }

    /// The socket under the frames: plain, or TLS with its peer's certificates.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The write buffer: append whole frames to it, then call [`FramedIo::try_flush`].
    pub fn wbuf(&mut self) -> &mut BytesMut {
        &mut self.wbuf
    }

    /// Bytes waiting to be written (for TLS, records made and not taken by the socket
    /// count as one byte more: rustls holds at most its buffer limit of them).
    pub fn pending_write(&self) -> usize {
        self.wbuf.len() + usize::from(self.stream.holds_output())
    }

    /// True while part of a frame has been read and the rest has not (or a refused frame is
    /// still being skipped).
    pub fn has_partial_frame(&self) -> bool {
        !self.rbuf.is_empty() || self.discard > 0
    }

    /// Since when the bytes waiting to be written have found the peer taking none: the
    /// time of the last write that left bytes behind. `None` when nothing waits.
    pub fn write_stalled_since(&self) -> Option<Instant> {
        self.write_stalled
    }

    /// True once the peer closed its side.
    pub fn is_eof(&self) -> bool {
        self.eof
    }

    /// Byte and syscall counts since the last call (for adding to metrics).
    pub fn take_counts(&mut self) -> IoCounts {
        std::mem::take(&mut self.counts)
    }

    /// Waits until the socket can make progress and makes it: writes pending bytes when
    /// it is writable, reads once into the read buffer when it is readable (and `read`).
    /// A read that does not fill the buffer tells the reactor the socket is drained, so
    /// the next wait costs no extra `read` that would only return "would block".
    ///
    /// Cancel-safe: bytes read are in the read buffer by the time it returns.
    pub async fn wait_io(&mut self, read: bool) -> io::Result<IoEvent> {
        std::future::poll_fn(|cx| self.poll_io(cx, read)).await
    }

    /// [`FramedIo::wait_io`] as a poll, for a caller that waits on several connections at
    /// once (the driver's worker, on the connections it is draining).
    pub fn poll_io(&mut self, cx: &mut Context<'_>, read: bool) -> Poll<io::Result<IoEvent>> {
        if self.pending_write() > 0 {
            if let Poll::Ready(r) = self.stream.tcp().poll_write_ready(cx) {
                r?;
                self.try_flush()?;
                return Poll::Ready(Ok(IoEvent::Wrote));
            }
        }
        if !read && !self.eof && self.is_budget_paused() {
            // Paused: nothing is read, but a caller that leaves is seen, as the end of
            // the stream it is (the frame it cut off is then reported as a read would).
            // With no bytes waiting in the kernel the task is woken by the FIN; with
            // bytes waiting the socket stays readable, and the frame clock's checks look
            // again (`FramedIo::peer_left_mid_frame`).
            if let Poll::Ready(Ok(())) = self.stream.tcp().poll_read_ready(cx) {
                if self.peer_left_mid_frame() {
                    self.eof = true;
                    return Poll::Ready(Ok(IoEvent::Read));
                }
            }
        }
        if read && !self.eof {
            self.make_read_room();
            match self.stream.poll_read(cx, &mut self.rbuf) {
                Poll::Ready(Ok(done)) => {
                    self.eof = done.eof;
                    if done.reads > 0 {
                        self.counts.bytes_read += done.wire as u64;
                        self.counts.reads += done.reads;
                        if let Some(a) = &self.activity {
                            a.note_read();
                        }
                    }
                    return Poll::Ready(Ok(IoEvent::Read));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        Poll::Pending
    }

    /// True when the read buffer must grow before the next read ([`must_grow`]).
    fn must_grow(&self) -> bool {
        must_grow(&self.rbuf)
    }

    /// Grows the read buffer when it must: by doubling (what [`BytesMut::reserve`] does,
    /// few copies for a large frame), or, when the doubling would not fit in the memory
    /// budget, by one read chunk exactly (a reader waits for the budget unless that fits:
    /// [`FramedIo::budget_pause`]).
    fn make_read_room(&mut self) {
        if !self.must_grow() {
            return;
        }
        let doubling = self.rbuf.capacity().max(READ_CHUNK);
        if self.held.as_ref().is_none_or(|h| h.budget().fits(doubling)) {
            self.rbuf.reserve(READ_CHUNK);
        } else {
            let mut grown = BytesMut::with_capacity(self.rbuf.len() + READ_CHUNK);
            grown.extend_from_slice(&self.rbuf);
            self.rbuf = grown;
        }
        // Told at once, before the read waits: another connection deciding whether its
        // own growth fits must see this one's.
        let n = self.buffered();
        if let Some(h) = &mut self.held {
            h.set(n);
        }
    }

    /// The next whole frame in the read buffer, if any. After a non-fatal error the bad
    /// bytes are gone and this may be called again. At end of stream, leftover bytes are
    /// reported once as [`FrameError::Truncated`] and dropped.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        Ok(self
            .peek_frame()?
            .map(|h| codec::split_frame(&mut self.rbuf, h)))
    }

    /// As [`FramedIo::next_frame`], with the frame's CRC trailer as received.
    pub fn next_frame_with_trailer(&mut self) -> Result<Option<(Frame, u32)>, FrameError> {
        Ok(self
            .peek_frame()?
            .map(|h| codec::split_frame_with_trailer(&mut self.rbuf, h)))
    }

    /// As [`FramedIo::next_frame`], but the frame is left in the read buffer and only its
    /// header returned: read its body with [`FramedIo::peeked_body`], then take it
    /// ([`FramedIo::take_peeked`]) or drop it ([`FramedIo::skip_peeked`]) before the next
    /// call.
    pub fn peek_frame(&mut self) -> Result<Option<Header>, FrameError> {
        if self.discard > 0 {
            let n = self.discard.min(self.rbuf.len());
            self.rbuf.advance(n);
            self.discard -= n;
            if self.discard > 0 {
                return Ok(None);
            }
        }
        match self.codec.peek_frame(&mut self.rbuf) {
            Ok(None) if self.eof && !self.rbuf.is_empty() => {
                let e = self.codec.check_eof(&self.rbuf);
                self.rbuf.clear();
                e.map(|()| None)
            }
            other => other,
        }
    }

    /// The body of the frame [`FramedIo::peek_frame`] returned the header of.
    pub fn peeked_body(&self, header: &Header) -> &[u8] {
        codec::body_in_place(&self.rbuf, header)
    }

    /// The CRC trailer (already checked) of the frame [`FramedIo::peek_frame`] returned the
    /// header of.
    pub fn peeked_trailer(&self, header: &Header) -> u32 {
        codec::trailer_in_place(&self.rbuf, header)
    }

    /// Takes the frame [`FramedIo::peek_frame`] returned the header of.
    pub fn take_peeked(&mut self, header: Header) -> Frame {
        codec::split_frame(&mut self.rbuf, header)
    }

    /// Drops the frame [`FramedIo::peek_frame`] returned the header of.
    pub fn skip_peeked(&mut self, header: &Header) {
        codec::skip_frame(&mut self.rbuf, header);
    }

    /// Drops the next `len` bytes of the stream, as they arrive: a whole frame that was
    /// refused on its header (too large) and is to be skipped instead of ending the
    /// connection.
    pub fn skip(&mut self, len: usize) {
        let n = len.min(self.rbuf.len());
        self.rbuf.advance(n);
        self.discard = len - n;
    }

    /// Sends the ACK of what was read at once, if the kernel was delaying it, and leaves
    /// delayed-ACK ("ping-pong") mode until the kernel goes back to it by itself (Linux
    /// `TCP_QUICKACK` is not sticky: it must be asked again after every read that should
    /// be acknowledged at once). One `setsockopt`; a no-op on systems without it.
    ///
    /// For a reader whose peer may be holding its next bytes until this ACK comes: a
    /// sender with Nagle's algorithm on keeps a small segment back while an earlier one is
    /// unacknowledged, and a receiver that delays its ACK (up to 40 ms on Linux) and has
    /// nothing of its own to send (which would carry the ACK) stalls them both for that
    /// long. The broker calls it after reads from plain v1 upstream connections with calls
    /// still in flight (`rpcmesh_broker::upstream`; docs/performance.md, "Behind a plain v1
    /// server with Nagle on").
    pub fn quick_ack(&self) -> io::Result<()> {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        {
            socket2::SockRef::from(self.stream.tcp()).set_tcp_quickack(true)
        }
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        {
            Ok(())
        }
    }

    /// Writes as much of the write buffer as the socket takes now.
    pub fn try_flush(&mut self) -> io::Result<()> {
        if self.pending_write() == 0 {
            self.write_stalled = None;
            return Ok(());
        }
        let done = self.stream.try_write(&mut self.wbuf)?;
        self.counts.bytes_written += done.wire as u64;
        self.counts.writes += done.writes;
        if done.blocked {
            if done.writes > 0 || self.write_stalled.is_none() {
                self.write_stalled = Some(Instant::now());
            }
        } else {
            self.write_stalled = None;
        }
        Ok(())
    }

    /// Writes the whole write buffer, waiting for the socket as needed.
    pub async fn flush(&mut self) -> io::Result<()> {
        while self.pending_write() > 0 {
            self.stream.tcp().writable().await?;
            self.try_flush()?;
        }
        Ok(())
    }

    /// Closes the write side after flushing (the peer then sees end of stream).
    pub async fn shutdown(&mut self) -> io::Result<()> {
        self.flush().await?;
        self.stream.shutdown().await
    }
}

/// Bytes the frame being read still needs before it is whole, `rbuf` holding what came of
/// it and `discard` what is still to be skipped of a frame refused on its header (0 with
/// no partial frame; a header not yet whole counts only its own missing bytes).
pub fn missing(rbuf: &[u8], discard: usize) -> usize {
    if discard > 0 {
        return discard.saturating_sub(rbuf.len());
    }
    let have = rbuf.len();
    if have == 0 {
        return 0;
    }
    if have < HEADER_LEN {
        return HEADER_LEN - have;
    }
    let body_len = u32::from_be_bytes([rbuf[6], rbuf[7], rbuf[8], rbuf[9]]);
    (FRAME_OVERHEAD + body_len as usize).saturating_sub(have)
}

/// True when the peer on `tcp` has closed its side (or reset the connection) and a frame
/// that still needs `missing` bytes can never be finished: the bytes waiting unread in
/// the kernel are fewer ([`FramedIo::peer_left_mid_frame`] says why and when to look).
/// Two system calls, without reading.
pub fn peer_left_mid_frame(tcp: impl std::os::fd::AsFd, missing: usize) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    if missing == 0 {
        return false;
    }
    let mut fds = [PollFd::new(&tcp, PollFlags::RDHUP)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if poll(&mut fds, Some(&zero)).is_err() {
        return false;
    }
    let seen = fds[0].revents();
    if !seen.intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR) {
        return false;
    }
    let waiting = rustix::io::ioctl_fionread(&tcp).unwrap_or(0);
    (waiting as usize) < missing
}
