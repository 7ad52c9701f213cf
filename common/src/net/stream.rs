//! The byte stream under a framed connection: a TCP socket, plain or carrying TLS.
//!
//! [`FramedIo`](crate::net::connection::FramedIo) reads and writes through a [`Stream`],
//! an enum rather than a trait object or a type parameter: the plain arm is the socket
//! calls the connection always made (a `read` into its buffer, `try_write` of its whole
//! write buffer), behind one well-predicted branch, so the plain path costs what it did;
//! and one connection type serves both, so neither the sessions nor the driver's links
//! grow a type parameter.
//!
//! The TLS arm drives a `rustls::Connection` over the same socket itself, readiness-first
//! like the plain arm (the way rustls's own `mio` examples do): a read pulls TLS records
//! from the socket ([`rustls::Connection::read_tls`]), decrypts them and copies the
//! plaintext into the read buffer; a flush moves plaintext from the write buffer into
//! rustls (up to its buffer limit, 64 KiB, so the backlog stays in the write buffer
//! where the session's limits and the memory budget see it) and writes the records out,
//! every record of a round in one vectored `write` where the socket takes them. The
//! handshake is done before (tokio-rustls, `crate::net::tls`), so a [`Stream`] only ever
//! carries application data.
//!
//! Byte counts are the socket's: TLS records as they cross the network, headers and tags
//! included, so wire figures show what TLS costs.

use std::io::{self, BufRead, Read, Write};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A connection's socket, plain or with TLS.
#[derive(Debug)]
pub enum Stream {
    /// Plain RPCF v1 over TCP.
    Plain(TcpStream),
    /// TLS over TCP, the handshake done (boxed: rustls's state is a few KiB, and a plain
    /// connection should not carry its room).
    Tls(Box<TlsStream>),
}

/// A TCP socket and the rustls connection over it, past its handshake.
#[derive(Debug)]
pub struct TlsStream {
    tcp: TcpStream,
    tls: rustls::Connection,
    /// The socket's read side ended (a FIN, with or without a TLS `close_notify`).
    tcp_eof: bool,
}

impl TlsStream {
    /// Wraps a socket whose rustls connection has finished its handshake.
    pub fn new(tcp: TcpStream, tls: rustls::Connection) -> TlsStream {
        TlsStream {
            tcp,
            tls,
            tcp_eof: false,
        }
    }

    /// The rustls connection (the peer's certificates, the protocol version).
    pub fn connection(&self) -> &rustls::Connection {
        &self.tls
    }
}

/// What one read did: bytes taken off the socket, and whether the stream ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadDone {
    /// Bytes read from the socket (TLS records, for a TLS stream).
    pub wire: usize,
    /// `read` calls that returned data.
    pub reads: u64,
    /// Bytes added to the read buffer (plaintext).
    pub data: usize,
    /// The peer closed its side.
    pub eof: bool,
}

/// What one flush did: bytes the socket took, and whether it would take more now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteDone {
    /// Bytes the socket took (TLS records, for a TLS stream).
    pub wire: usize,
    /// `write` calls that wrote something.
    pub writes: u64,
    /// The socket would take no more now (bytes are left to write).
    pub blocked: bool,
}

/// A [`Stream`] taken off its runtime's reactor, to be carried to another thread and
/// put on that runtime's ([`Stream::detach`], [`Detached::attach`]): the broker moves a
/// client connection between its cells so. The TLS state goes with the socket.
#[derive(Debug)]
pub struct Detached {
    tcp: std::net::TcpStream,
    tls: Option<(rustls::Connection, bool)>,
}

impl Detached {
    /// Registers the socket with the current runtime's reactor (call it on the runtime
    /// that is to serve it). A socket that was readable when it was detached wakes its
    /// new task at once: the reactor reports its readiness on registration.
    pub fn attach(self) -> io::Result<Stream> {
        let tcp = TcpStream::from_std(self.tcp)?;
        Ok(match self.tls {
            None => Stream::Plain(tcp),
            Some((tls, tcp_eof)) => Stream::Tls(Box::new(TlsStream { tcp, tls, tcp_eof })),
        })
    }
}

impl Stream {
    /// The TCP socket (its options: keepalive, quick ACKs).
    /// Takes the socket off this runtime's reactor (it stays non-blocking), with its TLS
    /// state, for [`Detached::attach`] on another runtime.
    pub fn detach(self) -> io::Result<Detached> {
        Ok(match self {
            Stream::Plain(s) => Detached {
                tcp: s.into_std()?,
                tls: None,
            },
            Stream::Tls(t) => {
                let TlsStream { tcp, tls, tcp_eof } = *t;
                Detached {
                    tcp: tcp.into_std()?,
                    tls: Some((tls, tcp_eof)),
                }
            }
        })
    }

    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(t) => &t.tcp,
        }
    }

    /// The TLS side, when there is one.
    pub fn tls(&self) -> Option<&TlsStream> {
        match self {
            Stream::Plain(_) => None,
            Stream::Tls(t) => Some(t),
        }
    }

    /// True while bytes this layer holds wait to go out besides the caller's write buffer
    /// (TLS records rustls has made and the socket has not taken yet).
    pub fn holds_output(&self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Tls(t) => t.tls.wants_write(),
        }
    }

    /// Reads once: what the socket holds, into `rbuf` (which has room). Pending when
    /// there is nothing to read (the task is woken when there is).
    pub fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        rbuf: &mut BytesMut,
    ) -> Poll<io::Result<ReadDone>> {
        match self {
            Stream::Plain(s) => match tokio_util::io::poll_read_buf(Pin::new(s), cx, rbuf) {
                Poll::Ready(Ok(0)) => Poll::Ready(Ok(ReadDone {
                    eof: true,
                    ..ReadDone::default()
                })),
                Poll::Ready(Ok(n)) => Poll::Ready(Ok(ReadDone {
                    wire: n,
                    reads: 1,
                    data: n,
                    eof: false,
                })),
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            },
            Stream::Tls(t) => t.poll_read(cx, rbuf),
        }
    }

    /// Writes as much of `wbuf` as the socket takes now (and, for TLS, the records made
    /// of it), without waiting.
    pub fn try_write(&mut self, wbuf: &mut BytesMut) -> io::Result<WriteDone> {
        match self {
            Stream::Plain(s) => {
                let mut done = WriteDone::default();
                while !wbuf.is_empty() {
                    match s.try_write(wbuf) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(n) => {
                            done.wire += n;
                            done.writes += 1;
                            wbuf.advance(n);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            done.blocked = true;
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok(done)
            }
            Stream::Tls(t) => t.try_write(wbuf),
        }
    }

    /// Closes the write side (for TLS: a `close_notify` first), once what is written has
    /// gone out.
    pub async fn shutdown(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => tokio::io::AsyncWriteExt::shutdown(s).await,
            Stream::Tls(t) => {
                t.tls.send_close_notify();
                let mut empty = BytesMut::new();
                while t.tls.wants_write() {
                    t.tcp.writable().await?;
                    t.try_write(&mut empty)?;
                }
                std::future::poll_fn(|cx| Pin::new(&mut t.tcp).poll_shutdown(cx)).await
            }
        }
    }
}

impl TlsStream {
    fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        rbuf: &mut BytesMut,
    ) -> Poll<io::Result<ReadDone>> {
        let mut done = ReadDone::default();
        loop {
            // Plaintext decrypted already goes first: a read that found some is done.
            match self.take_plaintext(rbuf) {
                Ok(0) => {}
                Ok(n) => {
                    done.data += n;
                    return Poll::Ready(Ok(done));
                }
                Err(Ended) => {
                    done.eof = true;
                    return Poll::Ready(Ok(done));
                }
            }
            if self.tcp_eof {
                done.eof = true;
                return Poll::Ready(Ok(done));
            }
            let mut socket = PollRead {
                tcp: &mut self.tcp,
                cx,
            };
            match self.tls.read_tls(&mut socket) {
                Ok(0) => self.tcp_eof = true,
                Ok(n) => {
                    done.wire += n;
                    done.reads += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Records read in this poll may have held no whole record yet.
                    return if done.reads > 0 {
                        Poll::Ready(Ok(done))
                    } else {
                        Poll::Pending
                    };
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
            if let Err(e) = self.tls.process_new_packets() {
                // The alert rustls queued for the peer goes out with the next flush,
                // if the session makes one.
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
            }
        }
    }

    /// Copies the plaintext rustls holds into `rbuf`; `Err(Ended)` once the peer closed
    /// and nothing is left.
    fn take_plaintext(&mut self, rbuf: &mut BytesMut) -> Result<usize, Ended> {
        let mut n = 0;
        let mut reader = self.tls.reader();
        loop {
            match reader.fill_buf() {
                Ok([]) => return if n > 0 { Ok(n) } else { Err(Ended) },
                Ok(chunk) => {
                    let len = chunk.len();
                    rbuf.extend_from_slice(chunk);
                    reader.consume(len);
                    n += len;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(n),
                // A FIN without close_notify: the frames say whether anything was cut.
                Err(_) => return if n > 0 { Ok(n) } else { Err(Ended) },
            }
        }
    }

    fn try_write(&mut self, wbuf: &mut BytesMut) -> io::Result<WriteDone> {
        let mut done = WriteDone::default();
        loop {
            if !wbuf.is_empty() {
                // Up to rustls's buffer limit: the rest stays in the write buffer.
                let n = self.tls.writer().write(wbuf)?;
                wbuf.advance(n);
            }
            if !self.tls.wants_write() {
                return Ok(done);
            }
            let mut socket = TryWrite(&self.tcp);
            match self.tls.write_tls(&mut socket) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    done.wire += n;
                    done.writes += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    done.blocked = true;
                    return Ok(done);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The peer closed the TLS stream and no plaintext is left.
struct Ended;

/// The socket as rustls reads it: one `poll_read`, "would block" when it has nothing (the
/// task then waits for the socket), and tokio's note that a short read drained it.
struct PollRead<'a, 'b> {
    tcp: &'a mut TcpStream,
    cx: &'a mut Context<'b>,
}

impl Read for PollRead<'_, '_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut rb = ReadBuf::new(buf);
        match tokio::io::AsyncRead::poll_read(Pin::new(self.tcp), self.cx, &mut rb) {
            Poll::Ready(Ok(())) => Ok(rb.filled().len()),
            Poll::Ready(Err(e)) => Err(e),
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

/// The socket as rustls writes to it: `try_write`, vectored (every record of a round in
/// one system call).
struct TryWrite<'a>(&'a TcpStream);

impl Write for TryWrite<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.0.try_write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
