//! A socket on the loop: what it read and has not yet handed on, and what it has to
//! write. Reads drain it (the loop's readiness is edge-triggered); writes go once per
//! round, and what the socket does not take waits for its next writable event. Public
//! for the yardstick on the same loop (`broker/examples/floor_epoll.rs`).

use std::io::{self, Read, Write};

use bytes::{Buf, BytesMut};
use mio::net::TcpStream;
use rpcmesh_common::net::budget::MemoryBudget;
use rpcmesh_common::net::connection::{IoCounts, room_to_keep};

/// What one read takes at most, as the Tokio engine's reads (a read that fills it may
/// have left more behind, and is followed by another).
pub use rpcmesh_common::net::connection::READ_CHUNK;

/// The room a read buffer keeps however empty it is: a page, enough for a small call, so
/// that a caller of small calls is read without growing its buffer even while others hold
/// the budget (the Tokio engine's fresh read buffer's).
pub use rpcmesh_common::net::connection::MIN_READ_ROOM as MIN_READ;

/// How a read ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Filled {
    /// Bytes came; there may be more.
    More,
    /// The socket is drained for now.
    Drained,
    /// The peer closed its side.
    Closed,
}

/// A connected socket and its two buffers, with the TLS over it when it has TLS (the
/// buffers then hold plaintext).
#[derive(Debug)]
pub struct Socket {
    pub stream: TcpStream,
    /// Its TLS: the server side on a client's connection when the broker takes TLS, the
    /// client side on a provider's when it speaks TLS to providers.
    pub tls: Option<Box<rustls::Connection>>,
    /// Its TLS's socket read side ended.
    tcp_eof: bool,
    /// Read and not yet handed on: at most one partial frame between rounds.
    pub rbuf: BytesMut,
    /// To write at the end of the round.
    pub out: BytesMut,
    /// In the round's list of sockets to write.
    pub dirty: bool,
    /// Bytes the socket has taken of `out` since it was made: a frame queued at stream
    /// position `at` (this plus the length of `out` before it) is written once this
    /// passes its end.
    pub written: u64,
    /// Bytes still to drop as they arrive: the rest of a frame refused on its header
    /// and skipped ([`Socket::skip`]).
    discard: usize,
    /// Bytes and system calls since the owner last took them ([`Socket::take_counts`]).
    counts: IoCounts,
}

impl Socket {
    /// A socket on `stream`, its read buffer [`MIN_READ`] large (counted in the budget
    /// from the start, as the Tokio engine's base).
    pub fn new(stream: TcpStream) -> Socket {
        // Calls and replies are small and go in batches of a round: Nagle would only
        // hold the last one back.
        let _ = stream.set_nodelay(true);
        Socket {
            stream,
            tls: None,
            tcp_eof: false,
            rbuf: BytesMut::with_capacity(MIN_READ),
            out: BytesMut::new(),
            dirty: false,
            written: 0,
            discard: 0,
            counts: IoCounts::default(),
        }
    }

    /// One read through `scratch`, appended to the read buffer. A read that did not fill
    /// `scratch` drained the socket, which spares the read that would only say so (more
    /// input raises a new edge), except when the peer has closed (`to_the_end`): its end
    /// of stream may have come with the last bytes and raises no edge of its own.
    /// (`scratch` because the workspace forbids `unsafe`, which a read into a `BytesMut`'s
    /// free room takes; the copy costs a few hundred bytes a read.)
    pub fn fill(&mut self, scratch: &mut [u8], to_the_end: bool) -> io::Result<Filled> {
        if self.tls.is_some() {
            return self.fill_tls();
        }
        loop {
            return match (&self.stream).read(scratch) {
                Ok(0) => Ok(Filled::Closed),
                Ok(n) => {
                    self.counts.reads += 1;
                    self.counts.bytes_read += n as u64;
                    let dropped = n.min(self.discard);
                    self.discard -= dropped;
                    self.rbuf.extend_from_slice(&scratch[dropped..n]);
                    Ok(if n < scratch.len() && !to_the_end {
                        Filled::Drained
                    } else {
                        Filled::More
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Filled::Drained),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
        }
    }

    /// True when the read buffer must grow before the next read
    /// (`rpcmesh_common::net::connection::must_grow`, the Tokio engine's rule).
    pub fn must_grow(&self) -> bool {
        rpcmesh_common::net::connection::must_grow(&self.rbuf)
    }

    /// Makes the read buffer's room for the next read as `budget` allows, and says how
    /// much that read may take: the room it has (a read chunk at most); grown first when
    /// it must, by doubling while that fits in the budget and by one read chunk exactly
    /// when not, as the Tokio engine's `make_read_room` (the caller has made sure a read
    /// chunk fits). A read never grows the buffer itself, so every growth is one the
    /// budget allowed, told before the next connection asks; and a buffer grows only as
    /// frames fill it, not by a read chunk for each of a thousand connections at once.
    pub fn read_room(&mut self, budget: &MemoryBudget) -> usize {
        if self.must_grow() {
            if budget.fits(self.rbuf.capacity().max(READ_CHUNK)) {
                self.rbuf.reserve(READ_CHUNK);
            } else {
                self.grow_read_exactly(READ_CHUNK);
            }
        }
        (self.rbuf.capacity() - self.rbuf.len()).min(READ_CHUNK)
    }

    /// Grows the read buffer to hold `more` bytes beyond what it holds, and no more.
    fn grow_read_exactly(&mut self, more: usize) {
        let mut grown = BytesMut::with_capacity(self.rbuf.len() + more);
        grown.extend_from_slice(&self.rbuf);
        self.rbuf = grown;
    }

    /// The bytes read and written and the system calls that moved them since the last
    /// time, added to `to`.
    pub fn take_counts(&mut self, to: &mut IoCounts) {
        let c = std::mem::take(&mut self.counts);
        to.bytes_read += c.bytes_read;
        to.bytes_written += c.bytes_written;
        to.reads += c.reads;
        to.writes += c.writes;
    }

    /// True when its peer has closed its side in the middle of the frame being read, which
    /// can then never be whole (`rpcmesh_common::net::connection::peer_left_mid_frame`):
    /// what a connection the budget pauses, reading nothing, looks at.
    pub fn peer_left_mid_frame(&self) -> bool {
        use rpcmesh_common::net::connection::{missing, peer_left_mid_frame};
        peer_left_mid_frame(&self.stream, missing(&self.rbuf, self.discard))
    }

    /// Drops the next `len` bytes of the stream, as they arrive: a frame refused on its
    /// header (too large) and skipped instead of ending the connection.
    pub fn skip(&mut self, len: usize) {
        let mut rbuf = std::mem::take(&mut self.rbuf);
        self.skip_from(&mut rbuf, len);
        self.rbuf = rbuf;
    }

    /// [`Socket::skip`], with its read buffer taken out while its frames are handled.
    pub fn skip_from(&mut self, rbuf: &mut BytesMut, len: usize) {
        let n = len.min(rbuf.len());
        rbuf.advance(n);
        self.discard = len - n;
    }

    /// The room its two buffers hold: what it counts in the memory budget.
    pub fn room(&self) -> usize {
        self.rbuf.capacity() + self.out.capacity()
    }

    /// Gives back the room of an emptied buffer that a peak left larger than
    /// [`SHRINK_ABOVE`] (one large frame must not cost a connection its size for the rest
    /// of its life), or, while `budget` is past its high mark, larger than a page: many
    /// callers that each sent a large frame (refused) would otherwise keep its room. An
    /// emptied read buffer keeps [`MIN_READ`].
    pub fn shrink_emptied(&mut self, budget: &MemoryBudget) {
        let keep = room_to_keep(budget);
        reclaim_emptied(&mut self.rbuf);
        reclaim_emptied(&mut self.out);
        if self.rbuf.is_empty() && self.rbuf.capacity() > keep {
            self.rbuf = BytesMut::with_capacity(MIN_READ);
        }
        if self.out.is_empty() && self.out.capacity() > keep {
            self.out = BytesMut::new();
        }
    }

    /// The plaintext its TLS holds, else the records the socket has, decrypted, into the
    /// read buffer: [`Filled::More`] when some came (there may be more), `Drained` when
    /// the socket has nothing whole, `Closed` at the end of the stream. A record that is
    /// not TLS, or a handshake refused, is an error (rustls's alert goes with the next
    /// flush).
    // Kept out of line: the plaintext path, every call's, stays small enough to inline.
    #[inline(never)]
    fn fill_tls(&mut self) -> io::Result<Filled> {
        let Some(tls) = self.tls.as_deref_mut() else {
            return Ok(Filled::Drained);
        };
        loop {
            match take_plaintext(tls, &mut self.rbuf, &mut self.discard) {
                Some(0) if self.tcp_eof => return Ok(Filled::Closed),
                Some(0) => {}
                Some(_) => return Ok(Filled::More),
                None => return Ok(Filled::Closed),
            }
            match tls.read_tls(&mut &self.stream) {
                Ok(0) => self.tcp_eof = true,
                Ok(n) => {
                    self.counts.reads += 1;
                    self.counts.bytes_read += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Filled::Drained),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if let Err(e) = tls.process_new_packets() {
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }

    /// Whether its TLS is still in its handshake.
    pub fn handshaking(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.is_handshaking())
    }

    /// Whether anything waits to be written: its buffer, or its TLS's records.
    pub fn unwritten(&self) -> bool {
        !self.out.is_empty() || self.tls.as_ref().is_some_and(|t| t.wants_write())
    }

    /// Writes what the socket takes of `out` now (through its TLS, when it has TLS).
    pub fn flush(&mut self) -> io::Result<()> {
        if self.tls.is_some() {
            return self.flush_tls();
        }
        while !self.out.is_empty() {
            match (&self.stream).write(&self.out) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.counts.writes += 1;
                    self.counts.bytes_written += n as u64;
                    self.written += n as u64;
                    self.out.advance(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Socket {
    /// [`Socket::flush`] through its TLS: `out` handed to rustls (up to its buffer's
    /// limit), and its records written until the socket takes no more.
    // Kept out of line: the plaintext path, every call's, stays small enough to inline.
    #[inline(never)]
    fn flush_tls(&mut self) -> io::Result<()> {
        let Some(tls) = self.tls.as_deref_mut() else {
            return Ok(());
        };
        loop {
            if !self.out.is_empty() {
                let n = tls.writer().write(&self.out)?;
                self.written += n as u64;
                self.out.advance(n);
            }
            if !tls.wants_write() {
                return Ok(());
            }
            match tls.write_tls(&mut &self.stream) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.counts.writes += 1;
                    self.counts.bytes_written += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Copies the plaintext `tls` holds into `rbuf`, dropping the first `discard` bytes
/// ([`Socket::skip`]); how much it took, or `None` once the peer closed and nothing is
/// left.
fn take_plaintext(
    tls: &mut rustls::Connection,
    rbuf: &mut BytesMut,
    discard: &mut usize,
) -> Option<usize> {
    use std::io::BufRead;
    let mut n = 0;
    let mut reader = tls.reader();
    loop {
        match reader.fill_buf() {
            Ok([]) => return (n > 0).then_some(n),
            Ok(chunk) => {
                let len = chunk.len();
                let dropped = len.min(*discard);
                *discard -= dropped;
                rbuf.extend_from_slice(&chunk[dropped..]);
                reader.consume(len);
                n += len;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Some(n),
            // A FIN without close_notify: the frames say whether anything was cut.
            Err(_) => return (n > 0).then_some(n),
        }
    }
}

/// Whether an `accept` error is one connection's (a peer that reset before it was taken,
/// a signal), after which the next accept may go on at once. Any other (no file
/// descriptor or buffer left, the listener's own failure) calls for a pause.
pub fn one_connections(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}

/// Takes back, when `buf` is empty, the room before its start that the bytes taken from
/// it left (`BytesMut::capacity` counts only the room after): an emptied buffer then
/// shows, and counts in the budget, its whole allocation. No allocation, no copy.
pub fn reclaim_emptied(buf: &mut BytesMut) {
    if buf.is_empty() {
        // Asking for more than the room after its start makes it look before it.
        let _ = buf.try_reclaim(buf.capacity() + 1);
    }
}
