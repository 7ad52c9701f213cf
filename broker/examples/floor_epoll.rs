//! The floor without the runtime: the forwarder of `floor`, on one epoll loop of its own
//! (mio) instead of Tokio's tasks, to measure what the runtime costs per call.
//!
//! It does per call what `floor` does (every frame checked where it lies with the broker's
//! codec, copied under an id neutral to its CRC, matched back by its key: `floor_shared`),
//! and differs only in how the work moves: one thread waits on every socket at once
//! (`epoll_wait`), reads each socket that is ready until it is drained, and hands calls and
//! replies along by appending them to the buffer of the connection they go to, with no
//! task, waker or channel between; when every ready socket was read, each connection given
//! something writes it in one `send`. That is the shape of an L4 proxy's event loop
//! (HAProxy's, nginx's), and of a broker whose thread owns its sessions and provider
//! connections outright. Not a product: no names read, no routing, caps, deadlines,
//! metrics, timeouts, TLS or budget; bad frames are dropped; the provider connection
//! failing ends the program. `scripts/profile` runs it as it runs the broker (it takes the
//! broker's flags and ignores all but `--listen`, `--upstream`, `--pool-size` and
//! `--busy-poll`):
//!
//! ```text
//! cargo build --release -p rpcmesh-broker --example floor --example floor_epoll
//! scripts/profile --no-build --broker target/release/examples/floor \
//!     --broker target/release/examples/floor_epoll
//! ```
//!
//! docs/performance.md ("What limits them") gives its figures beside the broker's.

use std::io;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use rpcmesh_broker::BusyPoll;
use rpcmesh_broker::engine::socket::{Filled, Socket, one_connections};
use rpcmesh_wire::codec::{FrameCodec, skip_frame};
use rpcmesh_wire::frame::DEFAULT_MAX_BODY_LEN;

mod floor_shared;
use floor_shared::{READ_CHUNK, Slots, addresses, flag, forward, next_frame, say_listening};

/// The listener's token; the provider connections' and the sessions' follow it.
const LISTENER: Token = Token(0);
/// Provider connection `k` is registered as `Token(FIRST_UPSTREAM + k)`, session `i` as
/// `Token(FIRST_UPSTREAM + upstreams + i)`.
const FIRST_UPSTREAM: usize = 1;
/// Provider connections without `--pool-size`: one, as `floor` has (the broker packs 64
/// calls over 8 client connections on one connection of its pool).
const DEFAULT_UPSTREAMS: usize = 1;
/// Readiness events taken per `epoll_wait`: more than the connections a yardstick run has.
const EVENTS: usize = 1024;

/// Everything the loop owns: one thread, no sharing.
struct Floor {
    poll: Poll,
    codec: FrameCodec,
    /// The provider connections; session `i` sends its calls on connection `i % len`.
    upstreams: Vec<Socket>,
    sessions: Vec<Option<Socket>>,
    slots: Slots,
    /// Sessions given replies this round.
    dirty: Vec<usize>,
    /// Where each read lands first ([`Socket::fill`]).
    scratch: Vec<u8>,
}

impl Floor {
    /// Takes every waiting connection. A session's index is never used again, so that a
    /// late reply to a session that has gone is dropped, never given to another; a
    /// connection that fails before it is registered is dropped alone.
    fn accept(&mut self, listener: &TcpListener) -> io::Result<()> {
        loop {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if !one_connections(&e) => return Err(e),
                Err(_) => continue,
            };
            let i = self.sessions.len();
            let mut conn = Socket::new(stream);
            let registered = self.poll.registry().register(
                &mut conn.stream,
                Token(FIRST_UPSTREAM + self.upstreams.len() + i),
                Interest::READABLE | Interest::WRITABLE,
            );
            self.sessions.push(registered.ok().map(|()| conn));
        }
    }

    /// Reads session `i` until it is drained: each call to the provider connection's
    /// buffer under a slot's id. The session is dropped when its peer closed or failed.
    fn read_session(&mut self, i: usize, to_the_end: bool) {
        let Some(Some(conn)) = self.sessions.get_mut(i) else {
            return;
        };
        let up = i % self.upstreams.len();
        loop {
            let read = match conn.fill(&mut self.scratch, to_the_end) {
                Ok(Filled::Closed) | Err(_) => {
                    let _ = self.poll.registry().deregister(&mut conn.stream);
                    self.sessions[i] = None;
                    return;
                }
                Ok(read) => read,
            };
            while let Some((mut header, trailer)) = next_frame(&self.codec, &mut conn.rbuf) {
                header.req_id = self.slots.give(i, header.req_id);
                forward(
                    &mut conn.rbuf,
                    &header,
                    trailer,
                    &mut self.upstreams[up].out,
                );
            }
            if read == Filled::Drained {
                return;
            }
        }
    }

    /// Reads provider connection `k` until it is drained: each reply to its session's
    /// buffer under the caller's id. Fails when the provider closed or the read failed.
    fn read_upstream(&mut self, k: usize, to_the_end: bool) -> io::Result<()> {
        loop {
            let up = &mut self.upstreams[k];
            let read = match up.fill(&mut self.scratch, to_the_end)? {
                Filled::Closed => return Err(io::ErrorKind::UnexpectedEof.into()),
                read => read,
            };
            while let Some((mut header, trailer)) = next_frame(&self.codec, &mut up.rbuf) {
                let to = self.slots.take(header.req_id).and_then(|(s, caller_id)| {
                    header.req_id = caller_id;
                    Some((s, self.sessions.get_mut(s)?.as_mut()?))
                });
                match to {
                    Some((s, conn)) => {
                        forward(&mut up.rbuf, &header, trailer, &mut conn.out);
                        if !conn.dirty {
                            conn.dirty = true;
                            self.dirty.push(s);
                        }
                    }
                    None => skip_frame(&mut up.rbuf, &header),
                }
            }
            if read == Filled::Drained {
                return Ok(());
            }
        }
    }

    /// Writes what this round gave: the calls, then each session's replies.
    fn flush(&mut self) -> io::Result<()> {
        for up in &mut self.upstreams {
            up.flush()?;
        }
        for i in self.dirty.drain(..) {
            if let Some(Some(conn)) = self.sessions.get_mut(i) {
                conn.dirty = false;
                if conn.flush().is_err() {
                    let _ = self.poll.registry().deregister(&mut conn.stream);
                    self.sessions[i] = None;
                }
            }
        }
        Ok(())
    }
}

/// `--busy-poll`, parsed as the broker parses it (`auto`, as with one thread: 50 µs;
/// `off`; a duration), and off when absent, as `scripts/profile` runs the broker (the
/// broker's own default is `auto`).
fn busy_poll() -> Result<Option<Duration>, String> {
    match flag("--busy-poll") {
        None => Ok(None),
        Some(v) => v
            .parse::<BusyPoll>()
            .map(|b| b.window(1))
            .map_err(|e| format!("--busy-poll {v}: {e}")),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (listen, to) = addresses("floor_epoll")?;
    let n = flag("--pool-size")
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(DEFAULT_UPSTREAMS);
    let poll = Poll::new()?;
    let mut upstreams = Vec::with_capacity(n);
    for k in 0..n {
        let s = std::net::TcpStream::connect(to)?;
        s.set_nonblocking(true)?;
        let mut up = Socket::new(TcpStream::from_std(s));
        poll.registry().register(
            &mut up.stream,
            Token(FIRST_UPSTREAM + k),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        upstreams.push(up);
    }
    let mut listener = TcpListener::bind(listen)?;
    say_listening("floor_epoll", listener.local_addr()?);
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut floor = Floor {
        poll,
        codec: FrameCodec::new(DEFAULT_MAX_BODY_LEN),
        upstreams,
        sessions: Vec::new(),
        slots: Slots::default(),
        dirty: Vec::new(),
        scratch: vec![0; READ_CHUNK],
    };
    let spin = busy_poll()?;
    // While spinning: polls that do not sleep, each empty one followed by `sched_yield`,
    // until `spin` passes with no event (the broker's busy polling, `common::net::busy_poll`).
    let mut spin_until: Option<Instant> = None;
    let mut events = Events::with_capacity(EVENTS);
    loop {
        let timeout = spin_until.map(|_| Duration::ZERO);
        match floor.poll.poll(&mut events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
        if let Some(window) = spin {
            let now = Instant::now();
            if !events.is_empty() {
                spin_until = Some(now + window);
            } else if spin_until.is_some_and(|until| now >= until) {
                spin_until = None;
            } else {
                std::thread::yield_now();
            }
        }
        for event in events.iter() {
            let t = event.token().0;
            // The peer closed, or the socket failed: read it to the end (`Conn::fill`).
            let closed = event.is_read_closed() || event.is_error();
            if event.token() == LISTENER {
                floor.accept(&listener)?;
            } else if t < FIRST_UPSTREAM + n {
                if event.is_readable() {
                    floor
                        .read_upstream(t - FIRST_UPSTREAM, closed)
                        .map_err(|e| format!("a provider connection ended: {e}"))?;
                }
            } else {
                let i = t - FIRST_UPSTREAM - n;
                if event.is_writable() {
                    if let Some(Some(conn)) = floor.sessions.get_mut(i) {
                        if !conn.out.is_empty() && !conn.dirty {
                            conn.dirty = true;
                            floor.dirty.push(i);
                        }
                    }
                }
                if event.is_readable() {
                    floor.read_session(i, closed);
                }
            }
        }
        floor.flush()?;
    }
}
